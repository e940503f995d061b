#!/usr/bin/env bash
# exp.sh WHEELDIR NAME [env...]: the 8-rank LL proxy scenario with one wheel.
set -uo pipefail
W=$1; N=$2; shift 2
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
S=/tmp/site-$N; rm -rf $S
python3 -m pip install -q --no-deps --no-index --target $S $W/*.whl || exit 2
t0=$SECONDS; echo "=== $N: $* (ranks ${NR:-8})"
env PYTHONPATH=$S MOELINK_LL_SCENARIOS=proxy MOELINK_LL_SCENARIO_TIMEOUT_S=120 "$@" \
  timeout -k 10 200 python3 -m moelink.launch -n ${NR:-8} --timeout 190 tests/multi_gpu/ll_worker.py > $OUT/$N.log 2>&1
rc=$?
echo "=== $N: rc=$rc $((SECONDS-t0)) s"; grep -E "^(PASS|FAIL)|Error|timed out|CUDA_MODULE" $OUT/$N.log | cut -c1-300 | head -8
