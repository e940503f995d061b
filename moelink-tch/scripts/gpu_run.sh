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
# (moelink-tch/examples/tch_streams.rs). Exit status: 0 when every run passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
TORCH_LIB=$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
export LD_LIBRARY_PATH="$TORCH_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
status=0
RANKS=("$@")
[ ${#RANKS[@]} -gt 0 ] || RANKS=(2 4)
for n in "${RANKS[@]}"; do
  echo "=== tch moe_layer, $n ranks"
  timeout -k 10 300 python3 -m moelink.launch -n "$n" --timeout 280 --no-python \
    .gpu/tch/moe_layer || { echo "FAIL tch moe_layer-$n"; status=1; }
  echo "=== tch parity, $n ranks"
  timeout -k 10 420 python3 examples/tch_parity.py --bin .gpu/tch/tch_parity -n "$n" \
    --timeout 200 || { echo "FAIL tch parity-$n"; status=1; }
  echo "=== tch streams, $n ranks"
  timeout -k 10 300 python3 -m moelink.launch -n "$n" --timeout 280 --no-python \
    .gpu/tch/tch_streams || { echo "FAIL tch streams-$n"; status=1; }
done
exit $status
