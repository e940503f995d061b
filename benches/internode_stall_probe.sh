#!/bin/bash
# Issue 17's stall, one device call on 4 GPUs (docs/design-internode.md, "Next"):
#   bash benches/internode_stall_probe.sh /tmp/probe; cp /tmp/probe.tgz $OUT/
# (carry: [".gpu"]; scripts/gpu_build.sh made it). Every step runs under `timeout`
# with short device bounds (a stall fails in seconds); its log goes to
# DIR/<step>.log and DIR is re-packed into DIR.tgz after every step (a device call
# brings back at most 8 files; a call cut off still brings the steps so far). Steps:
#   repro-copy[-kernel]  the comm suite's copy-behind-a-spinning-kernel repros,
#                        copy engine / MOELINK_IPC_COPY=kernel (2 ranks)
#   comm-kernel          every comm GPU scenario with MOELINK_IPC_COPY=kernel (the
#                        SM copy's data checked by the port-channel scenarios)
#   ethernet             the Ethernet transport's GPU suite (its async read-back)
#   bench-2x1-trace      2 emulated nodes of 1 rank, a CUDA activity trace per rank
#   bench-2x1-side       the same on a side stream, no trace
#   bench-2x1-kernel     the same with MOELINK_IPC_COPY=kernel
#   bench-2x2-kernel, suite-2x2-kernel   when bench-2x1-kernel passed: 2 x 2 bench and
#                        the internode + low-latency suites with the switch
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?output folder, outside the device call output folder}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 MOELINK_DEVICE_TIMEOUT_S=${PROBE_TIMEOUT_S:-8}
if [ -d .gpu/wheels ]; then
  python3 -m pip install -q --no-deps --no-index --target /tmp/moelink-probe-site .gpu/wheels/*.whl
  export PYTHONPATH=/tmp/moelink-probe-site:$PWD/python/deep_ep_alias
fi
TR="python3 -m torch.distributed.run --standalone"
BIN=.gpu/bin
failed=0
. benches/step.sh
step_summary() { grep -E "^(PASS|FAIL)|TimeoutError|GB/s|^trace" "$1" | cut -c1-300 | head -n 20; }
step_done() { tar czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"; }
nvidia-smi -L > "$OUT/machine.txt" 2>&1
REPROS=port_cuda_ipc_beside_a_spinning_kernel_copy_queued,port_cuda_ipc_beside_a_spinning_kernel_copy_after_it
SUITE=(--no-python "$BIN/gpu_multi_rank" --include-ignored --test-threads=1 --nocapture)
step repro-copy 60 env MOELINK_TEST_ONLY=$REPROS $TR --nproc-per-node=2 "${SUITE[@]}"
step repro-copy-kernel 60 env MOELINK_IPC_COPY=kernel MOELINK_TEST_ONLY=$REPROS \
  $TR --nproc-per-node=2 "${SUITE[@]}"
step comm-kernel 150 env MOELINK_IPC_COPY=kernel MOELINK_TEST_SKIP=create_destroy_500x1GiB \
  $TR --nproc-per-node=2 "${SUITE[@]}"
step ethernet 120 "$BIN/ethernet" --include-ignored --test-threads=1 --nocapture
BENCH=(benches/intranode_bench.py --nodes 2 --sms 24)
step bench-2x1-trace 90 $TR --nproc-per-node=2 "${BENCH[@]}" --iters 2 --warmup 1 --trace \
  --out "$OUT/bench-2x1-trace"
step bench-2x1-side 60 $TR --nproc-per-node=2 "${BENCH[@]}" --stream side --out "$OUT/bench-2x1-side"
if step bench-2x1-kernel 60 env MOELINK_IPC_COPY=kernel $TR --nproc-per-node=2 "${BENCH[@]}" \
  --out "$OUT/bench-2x1-kernel"; then
  step bench-2x2-kernel 90 env MOELINK_IPC_COPY=kernel $TR --nproc-per-node=4 \
    benches/intranode_bench.py --nodes 2 --sms 24 48 --out "$OUT/bench-2x2-kernel"
  step suite-2x2-kernel 240 env MOELINK_IPC_COPY=kernel GPU_RUN_INTERNODE=4:2 \
    GPU_RUN_INTERNODE_TIMEOUT_S=10 GPU_RUN_STEPS='^(internode|ll-internode)' \
    bash scripts/gpu_run.sh "$OUT/suite-2x2-kernel"
fi
echo "internode_stall_probe: $failed failed step(s)"
tar czf "$OUT.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"
exit $failed
