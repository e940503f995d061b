#!/usr/bin/env bash
# GPU tests, step 2 (on the GPU machine, repository root, with the .gpu/ folder that
# scripts/gpu_build.sh made; docs/gpu-tests.md):
#   bash scripts/gpu_run.sh [LOG_DIR] [-- extra commands are not taken; use GPU_RUN_EXTRA]
# Installs the wheel into a temporary target, sets the no-multicast policy, runs the
# GPU tests (Rust GPU tests with --include-ignored; the multi-rank suites at each
# rank count of GPU_RUN_RANKS through `python -m moelink.launch`, ranks sharing GPUs
# where they outnumber them; pytest -m gpu), each under `timeout`, with per-step wall
# times, and writes logs + summary.json into LOG_DIR (default $OUT,
# else ./gpu-logs): per-step logs are re-packed into one archive, steps.tgz, after
# every step (a few files are easy to collect), next to machine.txt and summary.json.
# GPU_RUN_PYTEST_ARGS narrows pytest (e.g. "-k peer");
# GPU_RUN_EXTRA is a command run last (benchmarks), its output logged as extra.log.
# GPU_RUN_INTERNODE="4:2 8:4 ..." adds the internode splits (RANKS:RANKS_PER_NODE).
# GPU_RUN_TIMESLICE=1 adds comm, intranode, low-latency and allreduce at 2 ranks
# without MPS (steps timeslice-*-2).
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${1:-${OUT:-./gpu-logs}}
# Step logs live outside LOG and are re-packed into LOG/steps.tgz after every
# step, so a run cut short by its time limit still brings its logs back.
STEPS=$(mktemp -d /tmp/gpu-steps.XXXXXX)/steps
mkdir -p "$STEPS" "$LOG"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
SITE=/tmp/moelink-site
rm -rf "$SITE"
python3 -m pip install -q --no-deps --no-index --target "$SITE" .gpu/wheels/*.whl ||
  { echo "gpu_run: wheel install failed" >&2; exit 2; }
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
# `import deep_ep` for the framework-call steps: moelink's alias package
# (python/deep_ep_alias, one pure-Python package `deep_ep`) from the checkout. Not
# pip-installed: an offline --no-build-isolation build of it needs setuptools >= 77
# (its PEP 639 license string), which this machine's python may lack.
export PYTHONPATH="$PYTHONPATH:$PWD/python/deep_ep_alias"

declare -A RESULT SECONDS_OF
# A TERM, INT or HUP for this script (say, an outer `timeout`) ends the running
# step too. `timeout` moves itself and the step into a process group of their
# own, which a signal for this script does not reach: without this the step
# ran on after the script was gone, beside whatever the GPU was given next.
# `timeout` passes the TERM on to its whole group (and kills it 10 s later).
STEP_PID= PACKER_PID=
trap 'kill "$PACKER_PID" 2>/dev/null
  [ -n "$STEP_PID" ] && kill -TERM "$STEP_PID" 2>/dev/null && wait "$STEP_PID" 2>/dev/null
  exit 143' TERM INT HUP
run() { # name timeout cmd...   (GPU_RUN_STEPS: a regex of step names to run)
  local name=$1 t=$2; shift 2
  if [ -n "${GPU_RUN_STEPS:-}" ] && ! [[ $name =~ $GPU_RUN_STEPS ]]; then return; fi
  echo "=== $name: $* (timeout ${t}s)"
  local t0=$SECONDS
  # Re-pack the logs every 15 s while the step runs, so that a device call cut
  # off by its own time limit still brings back how far this step got.
  ( while sleep 15; do tar -czf "$LOG/steps.tgz.tmp" -C "$(dirname "$STEPS")" steps &&
      mv "$LOG/steps.tgz.tmp" "$LOG/steps.tgz"; done ) &
  PACKER_PID=$!
  timeout -k 10 "$t" "$@" > "$STEPS/$name.log" 2>&1 &
  STEP_PID=$!
  wait "$STEP_PID"
  local rc=$?
  STEP_PID=
  kill "$PACKER_PID" 2>/dev/null; wait "$PACKER_PID" 2>/dev/null
  RESULT[$name]=$rc
  SECONDS_OF[$name]=$((SECONDS - t0))
  grep -E "^(PASS|FAIL|SKIPPED)|test result|passed|failed|error|ERROR SUMMARY" "$STEPS/$name.log" | tail -n 30
  echo "=== $name: rc=$rc (${SECONDS_OF[$name]} s)"
  tar -czf "$LOG/steps.tgz" -C "$(dirname "$STEPS")" steps
}

{
  cat .gpu/BUILD_INFO
  echo "date=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  nvidia-smi topo -m
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
} > "$LOG/machine.txt" 2>&1
cat "$LOG/machine.txt" | head -n 12

NGPU=$(nvidia-smi -L | wc -l)
# Multi-rank suites: every rank count of GPU_RUN_RANKS (default "2 4"; "8" too, as
# a call of its own) on whatever GPUs there are: ranks map to GPUs round-robin
# through `python -m moelink.launch`, several per GPU where ranks outnumber GPUs,
# under an MPS daemon the launcher starts and stops (GPU_RUN_MPS=off: time-slicing).
RANKS=${GPU_RUN_RANKS:-2 4}
export MOELINK_MPS=${GPU_RUN_MPS:-auto}
LAUNCH="python3 -m moelink.launch"
for exe in .gpu/bin/*; do
  [ -x "$exe" ] || continue
  name=$(basename "$exe")
  case "$name" in
    gpu_multi_rank)  # multi-process: the comm suite at every rank count
      for n in $RANKS; do
        run "rust-$name-$n" 400 $LAUNCH -n "$n" --timeout 380 --no-python "$exe" \
          --include-ignored --test-threads=1 --nocapture
      done ;;
    comm_bench) ;;  # a benchmark: run through GPU_RUN_EXTRA
    ib_hardware)  # needs an RDMA NIC: --nocapture shows each test's "SKIPPED: <reason>"
      run "rust-$name" 300 "$exe" --include-ignored --test-threads=1 --nocapture ;;
    *) run "rust-$name" 300 "$exe" --include-ignored --test-threads=1 ;;
  esac
done
for n in $RANKS; do
  run "peer_write-$n" 120 $LAUNCH -n "$n" --timeout 110 tests/multi_gpu/peer_write_worker.py
  run "intranode-$n" 400 $LAUNCH -n "$n" --timeout 380 tests/multi_gpu/intranode_worker.py
  # The intranode suite again on the packed dispatch (MOELINK_INTRANODE_RECV=packed)
  # and on the direct one (recv_x in the receive pool the peers write into).
  run "intranode-packed-$n" 400 env MOELINK_INTRANODE_RECV=packed \
    $LAUNCH -n "$n" --timeout 380 tests/multi_gpu/intranode_worker.py
  run "intranode-direct-$n" 400 env MOELINK_INTRANODE_RECV=direct \
    $LAUNCH -n "$n" --timeout 380 tests/multi_gpu/intranode_worker.py
  run "low_latency-$n" 400 $LAUNCH -n "$n" --timeout 380 tests/multi_gpu/ll_worker.py
  # A rank killed mid-dispatch: the others raise TimeoutError naming it, none hangs.
  # Never under MPS: an MPS client that exits while its kernel runs faults every
  # other client of the GPU (benches/mps_kill_probe.py, no moelink involved).
  run "killed-$n" 150 env MOELINK_MPS=off $LAUNCH -n "$n" --timeout 120 \
    tests/multi_gpu/killed_worker.py
  run "allreduce-$n" 400 $LAUNCH -n "$n" --timeout 380 tests/multi_gpu/allreduce_worker.py
  run "ops-$n" 500 $LAUNCH -n "$n" --timeout 480 tests/multi_gpu/ops_worker.py
  run "frameworks-$n" 400 $LAUNCH -n "$n" --timeout 380 tests/multi_gpu/frameworks_worker.py
  run "deep_ep_script-$n" 200 $LAUNCH -n "$n" --timeout 180 tests/multi_gpu/deep_ep_script.py
  # Profiler names: what DeepEP's bench_kineto reads of each call under torch.profiler.
  run "profiler-$n" 300 $LAUNCH -n "$n" --timeout 280 tests/multi_gpu/profiler_worker.py
  # The Rust tch API (moelink-tch/scripts/gpu_build.sh put its binaries in .gpu/tch):
  # the MoE-layer example and the bit-for-bit parity test against the Python API.
  [ -x .gpu/tch/moe_layer ] && run "tch-$n" 400 bash moelink-tch/scripts/gpu_run.sh "$n"
done
# The internode path on emulated nodes (ranks sharing GPUs, every cross-node byte
# through the proxy): GPU_RUN_INTERNODE lists RANKS:RANKS_PER_NODE[:TRANSPORT]
# splits (e.g. "4:2 8:4 8:2 4:2:ethernet"); each runs the intranode suite, which
# then takes the internode path (tests/multi_gpu/intranode_worker.py), and the
# low-latency suite, which then reaches the other nodes' ranks through the proxy
# and its own node's over NVLink (mixed transports).
# Their device waits are bounded by GPU_RUN_INTERNODE_TIMEOUT_S (default 20 s, so
# that a stalled scenario fails in seconds, not minutes), and
# GPU_RUN_INTERNODE_SCENARIOS narrows the intranode suite there (default: all).
# The Python workers under compute-sanitizer: no MPS, and a gloo group (an NCCL
# group's start-up probes NCCL's kernels with calls the sanitizer counts as API
# errors: benches/results/2026-11-27_h200x4_internode-suites-memcheck).
SAN_ENV=(MOELINK_MPS=off MOELINK_DIST_BACKEND=gloo)
for split in ${GPU_RUN_INTERNODE:-}; do
  IFS=: read -r xn xl xt <<< "$split"
  xenv=(MOELINK_RANKS_PER_NODE="$xl" MOELINK_DEVICE_TIMEOUT_S="${GPU_RUN_INTERNODE_TIMEOUT_S:-20}")
  run "internode-$((xn / xl))x${xl}${xt:+-$xt}" 500 env "${xenv[@]}" \
    ${GPU_RUN_INTERNODE_SCENARIOS:+MOELINK_INTRANODE_SCENARIOS=$GPU_RUN_INTERNODE_SCENARIOS} \
    ${xt:+MOELINK_TRANSPORT=$xt} $LAUNCH -n "$xn" --timeout 480 \
    tests/multi_gpu/intranode_worker.py
  [ -z "$xt" ] && run "ll-internode-$((xn / xl))x${xl}" 500 env "${xenv[@]}" \
    $LAUNCH -n "$xn" --timeout 480 tests/multi_gpu/ll_worker.py
  # The frameworks' normal-mode sequences across nodes, and SGLang's auto mode:
  # one low_latency_mode Buffer with NVLink and RDMA bytes serving normal
  # (internode) and low-latency calls, interleaved. (vLLM's high-throughput
  # buffer is sized for one node, num_rdma_bytes=0: across nodes it gets the
  # ValueError that says so, so it is not in the list.)
  [ -z "$xt" ] && run "frameworks-internode-$((xn / xl))x${xl}" 500 env "${xenv[@]}" \
    MOELINK_FRAMEWORKS_SCENARIOS="${GPU_RUN_INTERNODE_FRAMEWORKS:-sglang_normal,sglang_mode_switch,megatron_flex_sync}" \
    $LAUNCH -n "$xn" --timeout 480 tests/multi_gpu/frameworks_worker.py
  # The Rust tch API across the same nodes (moelink-tch/scripts/gpu_run.sh's
  # internode pass: MoE layer, parity with Python, streams and graphs).
  [ -z "$xt" ] && [ -x .gpu/tch/moe_layer ] && run "tch-internode-$((xn / xl))x${xl}" 500 \
    env TCH_INTERNODE=only TCH_INTERNODE_RANKS="$xn" TCH_INTERNODE_PER_NODE="$xl" \
    GPU_RUN_INTERNODE_TIMEOUT_S="${GPU_RUN_INTERNODE_TIMEOUT_S:-20}" \
    bash moelink-tch/scripts/gpu_run.sh
  run "killed-internode-$((xn / xl))x${xl}${xt:+-$xt}" 150 env "${xenv[@]}" MOELINK_MPS=off \
    ${xt:+MOELINK_TRANSPORT=$xt} $LAUNCH -n "$xn" --timeout 120 \
    tests/multi_gpu/killed_worker.py
  # GPU_RUN_SANITIZE=1: memcheck over the data scenarios on this split (no MPS;
  # device bounds of 120 s: the sanitizer slows the kernels many times over).
  [ -n "${GPU_RUN_SANITIZE:-}" ] && [ -z "$xt" ] &&
    run "sanitize-memcheck-internode-$((xn / xl))x${xl}" 540 env "${SAN_ENV[@]}" \
      MOELINK_RANKS_PER_NODE="$xl" MOELINK_DEVICE_TIMEOUT_S=120 \
      MOELINK_INTRANODE_SCENARIOS=dispatch_bf16,dispatch_fp8,dispatch_cached,worst_tokens,combine \
      $LAUNCH -n "$xn" --timeout 520 --no-python compute-sanitizer --tool memcheck \
      --error-exitcode 9 python3 tests/multi_gpu/intranode_worker.py
done
# Profiler names of the internode calls (notify, cached_notify, the two launches of
# one dispatch kernel, combine) on 2 emulated nodes of 2 ranks.
run "profiler-internode" 400 env MOELINK_RANKS_PER_NODE=2 \
  MOELINK_DEVICE_TIMEOUT_S="${GPU_RUN_INTERNODE_TIMEOUT_S:-20}" $LAUNCH -n 4 --timeout 380 \
  tests/multi_gpu/profiler_worker.py
# MOELINK_TRAP_ON_TIMEOUT=1 (2 ranks, no MPS: a trap under MPS takes down every
# rank on the GPU): a device timeout traps the kernel.
run "trap-2" 120 env MOELINK_MPS=off $LAUNCH -n 2 --timeout 100 tests/multi_gpu/trap_worker.py
if [ -n "${GPU_RUN_TIMESLICE:-}" ]; then
  # The multi-rank suites at 2 ranks without MPS (the contexts time-slice: slow
  # waits, same results). A call of its own: they take minutes.
  run "timeslice-rust-gpu_multi_rank-2" 200 env MOELINK_MPS=off $LAUNCH -n 2 --timeout 190 \
    --no-python .gpu/bin/gpu_multi_rank --include-ignored --test-threads=1 --nocapture
  for w in intranode ll allreduce; do
    run "timeslice-$w-2" 300 env MOELINK_MPS=off $LAUNCH -n 2 --timeout 290 \
      "tests/multi_gpu/${w}_worker.py"
  done
fi
if [ -n "${GPU_RUN_MAIN_RANKS:-}" ]; then
  # The main job (python -m moelink) on that many ranks, shared GPUs included.
  run "main-${GPU_RUN_MAIN_RANKS}" 400 python3 -m moelink --ranks "$GPU_RUN_MAIN_RANKS" \
    --num-tokens 1024 --iters 5 --warmup 2 --timeout 380
fi
if [ -n "${GPU_RUN_SANITIZE:-}" ]; then
  # compute-sanitizer memcheck over the 2-rank workers (ranks share GPUs where there
  # are fewer than 2; run without MPS, so they time-slice), memcheck + racecheck
  # over comm's 2-rank suite and over the single-GPU kernel tests.
  for w in intranode ll; do
    run "sanitize-memcheck-$w-2" 500 env "${SAN_ENV[@]}" $LAUNCH -n 2 --timeout 480 \
      --no-python compute-sanitizer --tool memcheck --error-exitcode 9 \
      python3 "tests/multi_gpu/${w}_worker.py"
  done
  # racecheck (shared-memory hazards) over the intranode kernels: the data scenarios
  # only (racecheck slows a kernel far more than memcheck), device bounds of 120 s.
  run "sanitize-racecheck-intranode-2" 540 env "${SAN_ENV[@]}" MOELINK_DEVICE_TIMEOUT_S=120 \
    MOELINK_INTRANODE_SCENARIOS=layout,dispatch_bf16,dispatch_fp8,dispatch_cached,combine \
    $LAUNCH -n 2 --timeout 520 --no-python compute-sanitizer --tool racecheck --error-exitcode 9 \
    python3 tests/multi_gpu/intranode_worker.py
  # The packed and direct dispatches' kernels (MOELINK_INTRANODE_RECV) under both
  # tools, over the dispatch scenarios (worst tokens too: its padding rows; direct:
  # its pool, with some ranks' recv_x outside it).
  for recv in packed direct; do
    scen=dispatch_bf16,dispatch_fp8,dispatch_cached,worst_tokens
    [ "$recv" = direct ] && scen=$scen,direct_pool
    for tool in memcheck racecheck; do
      run "sanitize-$tool-intranode-$recv-2" 540 env "${SAN_ENV[@]}" MOELINK_DEVICE_TIMEOUT_S=120 \
        MOELINK_INTRANODE_RECV=$recv MOELINK_INTRANODE_SCENARIOS=$scen SANITIZER_RUN=1 \
        $LAUNCH -n 2 --timeout 520 --no-python compute-sanitizer --tool "$tool" --error-exitcode 9 \
        python3 tests/multi_gpu/intranode_worker.py
    done
  done
  for tool in memcheck racecheck; do
    # Left out under the sanitizer: scenarios that launch thousands of tiny
    # kernels from proxy threads (atomics, Ethernet), which it slows past the
    # suite's 60 s bootstrap bound, and the 500 x 1 GiB loop.
    run "sanitize-$tool-multi_rank-2" 150 env MOELINK_MPS=off \
      MOELINK_TEST_SKIP=create_destroy_500x1GiB,port_cuda_ipc_atomics,port_ethernet_put_signal_flush,port_ethernet_atomics \
      $LAUNCH -n 2 --timeout 140 --no-python compute-sanitizer --tool "$tool" --error-exitcode 9 \
      .gpu/bin/gpu_multi_rank --include-ignored --test-threads=1 --nocapture
    run "sanitize-$tool-kernels" 200 compute-sanitizer --tool "$tool" --error-exitcode 9 \
      .gpu/bin/gpu_kernels --include-ignored --test-threads=1
  done
fi
# Single-GPU pytest tests (the multi-rank suites ran above, step by step).
run pytest-gpu 540 python3 -m pytest tests -m gpu -v -rs -p no:cacheprovider ${GPU_RUN_PYTEST_ARGS:-}
if [ -n "${GPU_RUN_EXTRA:-}" ]; then
  run extra 540 bash -c "$GPU_RUN_EXTRA"
fi

status=0
{
  echo "{"
  echo "  \"build\": \"$(tr '\n' ' ' < .gpu/BUILD_INFO)\","
  echo "  \"results\": {"
  first=1
  for k in "${!RESULT[@]}"; do
    [ $first -eq 1 ] || echo ","
    first=0
    printf '    "%s": {"rc": %s, "seconds": %s}' "$k" "${RESULT[$k]}" "${SECONDS_OF[$k]}"
    [ "${RESULT[$k]}" -eq 0 ] || status=1
  done
  echo; echo "  }"; echo "}"
} > "$LOG/summary.json"
echo "=== summary"; cat "$LOG/summary.json"
exit $status
