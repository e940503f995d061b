#!/usr/bin/env bash
# GPU loop for moelink-tch, step 2 (on the GPU machine, repository root, .gpu/
# carried, the moelink wheel importable: inside scripts/gpu_run.sh, e.g. through
# GPU_RUN_EXTRA='bash moelink-tch/scripts/gpu_run.sh'):
#   bash moelink-tch/scripts/gpu_run.sh [RANKS...]     (default: 2 4)
# At each rank count, ranks sharing GPUs where they outnumber them: the MoE layer
# example against its single-process check, then the bit-for-bit comparison of
# the tch API with the Python API (examples/tch_parity.py), then the checks of
# events / async_finish / allocate_on_comm_stream, CUDA graphs, the AllReduce
# tuning file and the host-side id check against the CPU reference
# (moelink-tch/examples/tch_streams.rs).
# TCH_INTERNODE=1 adds the internode pass: the same three programs at
# TCH_INTERNODE_RANKS ranks (default 4) on emulated nodes of
# TCH_INTERNODE_PER_NODE ranks (default 2; MOELINK_RANKS_PER_NODE), where dispatch and
# combine take the internode path (combine checked against the internode model);
# their device waits are bounded by GPU_RUN_INTERNODE_TIMEOUT_S (default 20 s).
# TCH_INTERNODE=only runs that pass alone.
# Exit status: 0 when every run passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
TORCH_LIB=$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
export LD_LIBRARY_PATH="$TORCH_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
status=0
RANKS=("$@")
[ ${#RANKS[@]} -gt 0 ] || RANKS=(2 4)

# A TERM, INT or HUP for this script (scripts/gpu_run.sh's step timeout, or
# an outer one) ends the running program too: `timeout` puts it in a process
# group of its own, which a signal for this script does not reach.
CHILD=
trap '[ -n "$CHILD" ] && kill -TERM "$CHILD" 2>/dev/null && wait "$CHILD" 2>/dev/null
  exit 143' TERM INT HUP
# `timeout -k 10 SECONDS CMD...` in the background, waited for: its status.
bounded() {
  timeout -k 10 "$@" &
  CHILD=$!
  wait "$CHILD"
  local rc=$?
  CHILD=
  return $rc
}

# The three programs at $1 ranks; $2 names the pass in the FAIL lines; the rest
# of the arguments are environment assignments for them.
run_programs() {
  local n=$1 name=$2
  shift 2
  echo "=== tch moe_layer, $name"
  bounded 300 env "$@" python3 -m moelink.launch -n "$n" --timeout 280 --no-python \
    .gpu/tch/moe_layer || { echo "FAIL tch moe_layer-$name"; status=1; }
  echo "=== tch parity, $name"
  bounded 420 env "$@" python3 examples/tch_parity.py --bin .gpu/tch/tch_parity -n "$n" \
    --timeout 200 || { echo "FAIL tch parity-$name"; status=1; }
  echo "=== tch streams, $name"
  bounded 300 env "$@" python3 -m moelink.launch -n "$n" --timeout 280 --no-python \
    .gpu/tch/tch_streams || { echo "FAIL tch streams-$name"; status=1; }
}

if [ "${TCH_INTERNODE:-}" != only ]; then
  for n in "${RANKS[@]}"; do
    run_programs "$n" "$n"
  done
fi
if [ -n "${TCH_INTERNODE:-}" ] && [ "${TCH_INTERNODE}" != 0 ]; then
  xn=${TCH_INTERNODE_RANKS:-4} xl=${TCH_INTERNODE_PER_NODE:-2}
  run_programs "$xn" "internode-$((xn / xl))x$xl" MOELINK_RANKS_PER_NODE="$xl" \
    MOELINK_DEVICE_TIMEOUT_S="${GPU_RUN_INTERNODE_TIMEOUT_S:-20}"
fi
exit $status
