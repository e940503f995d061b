#!/usr/bin/env bash
# EXPERIMENT (not committed): LL forced-proxy at 4 ranks: skew between ranks vs stuck copies.
set -u
OUT=${1:-/tmp/exp}; mkdir -p "$OUT/exp"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
rm -rf /tmp/ms; python3 -m pip install -q --no-deps --no-index --target /tmp/ms .gpu/wheels/*.whl > "$OUT/exp/pip.log" 2>&1
export PYTHONPATH=/tmp/ms MOELINK_EXP_TIMING=1
v() { # name ranks scenarios env...
  local name=$1 n=$2 sc=$3; shift 3
  local t0=$(date +%s)
  env "$@" MOELINK_LL_SCENARIOS=$sc timeout -k 5 200 python3 -m moelink.launch -n "$n" --timeout 190 \
    tests/multi_gpu/ll_worker.py > "$OUT/exp/$name.log" 2>&1
  echo "== $name rc=$? $(( $(date +%s) - t0 ))s: $(grep -cE '^PASS' "$OUT/exp/$name.log") PASS, $(grep -cE '^FAIL' "$OUT/exp/$name.log") FAIL"
  tar -czf "$OUT/exp.tgz" -C "$OUT" exp
}
v t30-mps 4 proxy,proxy,proxy MOELINK_LL_TIMEOUT_S=30
v b8-mps 4 proxy,proxy,proxy MOELINK_LL_TIMEOUT_S=8 MOELINK_EXP_BARRIER=1
