#!/usr/bin/env bash
# DeepEP V1's own test programs, run through `import deep_ep` on one 4-GPU host
# (moelink's alias package by default, or a real DeepEP for comparison):
#   bash benches/deepep_tests.sh DEEPEP_TESTS_DIR OUT [STEPS]
# DEEPEP_TESTS_DIR: the tests/ folder of a DeepEP V1 checkout (commit 567632d:
#   `git clone https://github.com/deepseek-ai/DeepEP && git -C DeepEP checkout 567632d`,
#   then pass DeepEP/tests), or the checkout itself. DeepEP's code is not part of this
#   repository: benches/deepep_patch.py copies utils.py, test_intranode.py,
#   test_low_latency.py and test_internode.py to a temporary folder and applies only
#   its allowed edits there (8-ranks-per-node asserts; each rank's GPU is its global
#   rank modulo the GPU count; below 6 ranks the shrink test's clean fails rank 2,
#   not the absent rank 5); OUT/PATCH.diff shows them.
# STEPS (comma list, default all):
#   intranode     test_intranode.py --num-processes 4
#   low_latency   test_low_latency.py --num-processes 4
#   shrink        test_low_latency.py --num-processes 4 --shrink-test, MOELINK_LL_TIMEOUT_S=5
#                 (a short device bound, so that masking a failed rank takes seconds)
#   shrink_2x2    the same on two emulated nodes of 2 ranks (as internode below)
#   internode     two emulated nodes of 2 ranks (GPUs 0,1 and 2,3): two concurrent
#                 `WORLD_SIZE=2 RANK=<node> MOELINK_RANKS_PER_NODE=2 test_internode.py
#                 --num-processes 2`; logs OUT/internode.node0.log and .node1.log
#   internode_ll  the same with --test-ll-compatibility
# `import deep_ep` is moelink's alias (python/deep_ep_alias, put first on PYTHONPATH;
# moelink itself must be importable: installed wheel or PYTHONPATH); with
# DEEP_EP_IMPL=deepep the caller's PYTHONPATH (a real DeepEP build first) is kept.
# Every step runs under `timeout` (DEEPEP_TESTS_TIMEOUT_S, default 240;
# DEEPEP_TESTS_INTERNODE_TIMEOUT_S, default 420) in its own process group, which is
# killed when the step ends, so that the next step starts clean; its output (the
# tests' timing lines included) goes to OUT/<step>.log. When one internode node fails,
# the other gets DEEPEP_TESTS_PEER_GRACE_S (default 30) before it is killed. Each
# step prints one result line, then a table follows; the exit code is the number
# of failed steps. With fewer than 4 GPUs, the single-node steps run on 2 ranks and
# the internode steps are skipped (SKIP lines say so); with fewer than 2 GPUs nothing
# runs and every selected step counts as failed.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
SRC=${1:?DeepEP V1 tests folder (a checkout at 567632d, its tests/)}
OUT=${2:?output folder}
STEPS=${3:-intranode,low_latency,shrink,shrink_2x2,internode,internode_ll}
T_STEP=${DEEPEP_TESTS_TIMEOUT_S:-240}
T_INTER=${DEEPEP_TESTS_INTERNODE_TIMEOUT_S:-420}
GRACE=${DEEPEP_TESTS_PEER_GRACE_S:-30}
IMPL=${DEEP_EP_IMPL:-moelink}
PY=${PYTHON:-$(command -v python || command -v python3)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
for s in ${STEPS//,/ }; do
  case "$s" in
    intranode | low_latency | shrink | shrink_2x2 | internode | internode_ll) ;;
    *) echo "unknown step '$s' (intranode,low_latency,shrink,shrink_2x2,internode,internode_ll)" >&2; exit 64 ;;
  esac
done

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
case "$IMPL" in
  moelink) export PYTHONPATH="$REPO/python/deep_ep_alias${PYTHONPATH:+:$PYTHONPATH}" ;;
  deepep) ;;
  *) echo "DEEP_EP_IMPL must be moelink or deepep, got '$IMPL'" >&2; exit 64 ;;
esac

WORK=$(mktemp -d "${TMPDIR:-/tmp}/deepep-tests.XXXXXX")
GROUPS_ALIVE=()
cleanup() {
  local g
  for g in ${GROUPS_ALIVE[@]+"${GROUPS_ALIVE[@]}"}; do kill -KILL -- "-$g" 2>/dev/null; done
  wait 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'echo "interrupted" >&2; exit 130' INT TERM

if ! "$PY" "$REPO/benches/deepep_patch.py" "$SRC" "$WORK"; then
  N=$(wc -w <<< "${STEPS//,/ }")
  echo "patch failed: nothing ran, the $N selected step(s) count as failed" >&2
  exit "$N"
fi
cp "$WORK/PATCH.diff" "$OUT/PATCH.diff"

# GPUs: nvidia-smi's list, narrowed by CUDA_VISIBLE_DEVICES when set.
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
  n=$(tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c .)
  [ "$n" -lt "$NGPU" ] && NGPU=$n
fi
NPROC=4
[ "$NGPU" -lt 4 ] && NPROC=2
{
  echo "impl: $IMPL  gpus: $NGPU  single-node ranks: $NPROC"
  nvidia-smi -L 2>&1
  "$PY" -c 'import deep_ep; print("deep_ep:", deep_ep.__file__, "backend:", getattr(deep_ep, "BACKEND", "deepep"))' 2>&1 | tail -n 3
  "$PY" -c 'import torch; print("torch:", torch.__version__, "cuda:", torch.version.cuda)' 2>&1 | tail -n 1
  # The build that runs: .gpu/BUILD_INFO where scripts/gpu_build.sh made it (a copy of
  # the tree may carry an older .git), else the checkout's HEAD.
  if [ -f "$REPO/.gpu/BUILD_INFO" ]; then
    sed 's/^/moelink build: /' "$REPO/.gpu/BUILD_INFO"
  else
    git -C "$REPO" rev-parse HEAD 2>/dev/null | sed 's/^/moelink commit: /'
  fi
} > "$OUT/env.txt"
cat "$OUT/env.txt"
[ "$NGPU" -lt 4 ] && echo "NOTE: $NGPU GPU(s), fewer than 4: single-node steps run on $NPROC ranks, internode steps are skipped"

free_port() {
  "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# start LOG TIMEOUT CMD...: runs CMD in the background under `timeout` (which makes
# itself the leader of a new process group) in $WORK with output to LOG; sets PID.
start() {
  local log=$1 t=$2; shift 2
  (cd "$WORK" && exec timeout -k 10 "$t" "$@") > "$log" 2>&1 &
  PID=$!
  GROUPS_ALIVE+=("$PID")
}

# finish PID: waits for it, kills what is left of its process group, sets RC.
finish() {
  wait "$1" 2>/dev/null # (no "Killed" job notice: the result line says it)
  RC=$?
  kill -KILL -- "-$1" 2>/dev/null
  local g keep=()
  for g in ${GROUPS_ALIVE[@]+"${GROUPS_ALIVE[@]}"}; do [ "$g" = "$1" ] || keep+=("$g"); done
  GROUPS_ALIVE=(${keep[@]+"${keep[@]}"})
}

timing_lines() { # the tests' timing and bandwidth lines in the given logs
  cat "$@" 2>/dev/null | grep -cE 'GB/s|avg_t=| us\b|\[tuning\]'
}

declare -A RESULT RCS SECS TIMING LOGS
ORDER=()
failed=0
ran=0
NOTE=""
record() { # record STEP RESULT RC SECONDS LOGS... (NOTE: appended to the result line)
  local s=$1
  ORDER+=("$s")
  RESULT[$s]=$2 RCS[$s]=$3 SECS[$s]=$4
  shift 4
  LOGS[$s]="$*"
  TIMING[$s]=$(timing_lines "$@")
  [ "${RESULT[$s]}" = FAIL ] && failed=$((failed + 1))
  local why=""
  [ "${RCS[$s]}" = 124 ] && why=" (timed out)"
  [ "${RCS[$s]}" = 137 ] && why=" (killed)"
  echo "$s: ${RESULT[$s]} rc=${RCS[$s]}$why${NOTE:+ $NOTE}, ${SECS[$s]} s," \
    "${TIMING[$s]} timing lines, log ${LOGS[$s]//$OUT\//}"
  NOTE=""
  if [ "${RESULT[$s]}" = FAIL ]; then
    local l
    for l in "$@"; do [ -f "$l" ] && tail -n 8 "$l" | sed "s|^|  ${l##*/}: |"; done
  fi
}

single_node() { # single_node STEP ARGS...: one test program on this host's ranks
  local s=$1; shift
  local log="$OUT/$s.log" t0=$SECONDS
  echo "=== $s: $*"
  start "$log" "$T_STEP" env -u WORLD_SIZE -u RANK -u LOCAL_RANK -u LOCAL_WORLD_SIZE \
    -u MOELINK_RANKS_PER_NODE MASTER_ADDR=127.0.0.1 MASTER_PORT="$(free_port)" "$@"
  finish "$PID"
  ran=$((ran + 1))
  record "$s" "$([ $RC -eq 0 ] && echo PASS || echo FAIL)" "$RC" $((SECONDS - t0)) "$log"
}

internode() { # internode STEP ARGS...: two emulated nodes of 2 ranks, one process each
  local s=$1; shift
  local port t0=$SECONDS n pids=() rcs=() logs=() done_at=""
  port=$(free_port)
  echo "=== $s: 2 nodes x $*"
  for n in 0 1; do
    logs+=("$OUT/$s.node$n.log")
    start "$OUT/$s.node$n.log" "$T_INTER" env -u LOCAL_RANK -u LOCAL_WORLD_SIZE WORLD_SIZE=2 \
      RANK=$n MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" MOELINK_RANKS_PER_NODE=2 "$@"
    pids+=("$PID")
  done
  # Poll: once one node has failed, the other gets GRACE seconds, then is killed.
  rcs=("" "")
  while [ -z "${rcs[0]}" ] || [ -z "${rcs[1]}" ]; do
    for n in 0 1; do
      if [ -z "${rcs[$n]}" ] && ! kill -0 "${pids[$n]}" 2>/dev/null; then
        finish "${pids[$n]}"
        rcs[n]=$RC
        [ "$RC" -ne 0 ] && [ -z "$done_at" ] && done_at=$SECONDS
      fi
    done
    if [ -n "$done_at" ] && [ $((SECONDS - done_at)) -ge "$GRACE" ]; then
      for n in 0 1; do
        if [ -z "${rcs[$n]}" ]; then
          echo "$s: node $n still running ${GRACE} s after its peer failed: killed"
          kill -KILL -- "-${pids[$n]}" 2>/dev/null
          finish "${pids[$n]}"
          rcs[n]=$RC
        fi
      done
    fi
    sleep 1
  done
  ran=$((ran + 1))
  local worst=${rcs[0]}
  [ "${rcs[1]}" -gt "$worst" ] && worst=${rcs[1]}
  NOTE="(node0 rc=${rcs[0]}, node1 rc=${rcs[1]})"
  record "$s" "$([ "$worst" -eq 0 ] && echo PASS || echo FAIL)" "$worst" $((SECONDS - t0)) "${logs[@]}"
}

skip() { # skip STEP WHY
  ORDER+=("$1")
  RESULT[$1]=SKIP RCS[$1]=- SECS[$1]=- TIMING[$1]=- LOGS[$1]="($2)"
  echo "$1: SKIP ($2)"
}

for s in ${STEPS//,/ }; do
  if [ "$NGPU" -lt 2 ]; then
    skip "$s" "needs >= 2 GPUs, found $NGPU"
    continue
  fi
  case "$s" in
    intranode) single_node "$s" "$PY" test_intranode.py --num-processes "$NPROC" ;;
    low_latency) single_node "$s" "$PY" test_low_latency.py --num-processes "$NPROC" ;;
    shrink)
      single_node "$s" env MOELINK_LL_TIMEOUT_S=5 \
        "$PY" test_low_latency.py --num-processes "$NPROC" --shrink-test
      ;;
    shrink_2x2 | internode | internode_ll)
      if [ "$NGPU" -lt 4 ]; then
        skip "$s" "two nodes of 2 ranks need 4 GPUs, found $NGPU"
        continue
      fi
      if [ "$s" = shrink_2x2 ]; then
        internode "$s" env MOELINK_LL_TIMEOUT_S=5 \
          "$PY" test_low_latency.py --num-processes 2 --shrink-test
        continue
      fi
      extra=()
      [ "$s" = internode_ll ] && extra=(--test-ll-compatibility)
      internode "$s" "$PY" test_internode.py --num-processes 2 ${extra[@]+"${extra[@]}"}
      ;;
  esac
done

echo
{
  printf '%-13s %-6s %-5s %-6s %-7s %s\n' step result rc sec timing log
  for s in "${ORDER[@]}"; do
    printf '%-13s %-6s %-5s %-6s %-7s %s\n' "$s" "${RESULT[$s]}" "${RCS[$s]}" "${SECS[$s]}" \
      "${TIMING[$s]}" "${LOGS[$s]//$OUT\//}"
  done
} | tee "$OUT/summary.txt"
if [ "$ran" -eq 0 ]; then
  echo "no step could run ($NGPU GPU(s)): every selected step counts as failed"
  exit "${#ORDER[@]}"
fi
echo "impl $IMPL: $failed failed of $ran run, $((${#ORDER[@]} - ran)) skipped"
exit "$failed"
