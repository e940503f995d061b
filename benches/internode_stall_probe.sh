#!/bin/bash
# The internode stall on 4 GPUs in one bounded run (docs/design-internode.md):
#   bash benches/internode_stall_probe.sh /tmp/probe "$OUT/probe.tgz"
# (carry: [".gpu"]; scripts/gpu_build.sh made it). Every step runs under `timeout`
# with short device bounds (a stall fails in seconds); its log goes to
# DIR/<step>.log and DIR is re-packed into TGZ (default DIR.tgz) after every step:
# a device call brings back at most 8 files, and one cut off at its limit still
# brings the steps so far when TGZ lies in the call's $OUT.
# Steps, most telling first:
#   repro-upload       the comm repro of the stall's cause: a pageable upload on the
#                      legacy stream, ordered after a kernel that waits for the
#                      proxy's CUDA IPC puts (2 ranks; passes with the proxy's own
#                      context, stalls with MOELINK_IPC_CONTEXT=primary)
#   repro-upload-primary   the same in the primary context (expected to FAIL: it
#                      shows the cause is still there)
#   repro-ethernet     the same two repros over the Ethernet transport (its copies
#                      out of and into GPU memory in the proxies' own context)
#   repro-ethernet-primary   those in the primary context (MOELINK_IPC_CONTEXT=primary)
#   comm               every comm GPU scenario (2 ranks)
#   suite-2x2          the internode suite and the killed-rank worker at 2 x 2 (4
#                      ranks, one per GPU)
#   suite-2x2-threads2 the internode suite at 2 x 2 with two proxy threads per
#                      Buffer (MOELINK_PROXY_THREADS=2: channels by peer on a pool)
#   speed-internode    benches/speed_run.sh internode (the emulated 2 x 2 bench)
#   suite-ll-2x2       the low-latency suite at 2 x 2 (mixed transports)
#   suite-ll-2x4-a, suite-ll-2x4-b   the same at 2 x 4 (8 ranks, 2 per GPU), in two
#                      halves (2 x 2 took 254 s on 4 GPUs; 8 ranks may not fit one call)
#   suite-4x2, suite-2x4   8 ranks, 2 per GPU
#   suite-2x2-ethernet the 2 x 2 suite with the Ethernet transport forced
#   memcheck-2x2       compute-sanitizer memcheck over the 2 x 2 data scenarios
#   main-nodes         the main job, python -m moelink --nodes 2 (4 ranks)
#   speed-comm         benches/speed_run.sh comm (comm_bench, with the
#                      memory channel's relaxed floor)
#   host-overhead      the eager low-latency figures: host time per call with
#                      its native / allocation / Python breakdown (4 ranks)
#   profile-stamps     intranode_profile.py's kernel times and the fused
#                      kernels' phase stamps (bf16, fp8, full dispatch, combine; 4 ranks)
#   profile-suite-2x2  the 2 x 2 suite's combine and iterations scenarios with rank 0
#                      under cProfile (MOELINK_TEST_PROFILE): where a scenario's
#                      seconds go (~1 s a checked round, intranode too)
#   capture-test       gpu_kernels' test of the library threads' relaxed capture mode
#                      (a thread's CUDA call during a user's global-mode capture)
#   send-stamps        the fused kernels' phase stamps at 24 and 48 SMs (intranode_profile.py)
#   killed-ethernet-mps, -timeslice   the killed-rank worker at 2 x 2 over Ethernet two
#                      ways: as the suite runs it, and without MPS (MOELINK_MPS=off: a
#                      fault stays in its own context); on one GPU the first gave
#                      the survivors an illegal memory access (2026-11-27)
# On a one-GPU machine the same steps run every rank on that GPU (MPS).
# PROBE_STEPS (a regex of step names) runs some only: the whole list takes more than
# one call's 10 minutes (measured 4 x H200: the steps to speed-internode ~170 s, the
# low-latency suite at 2 x 2 over 200 s).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?output folder, outside the device call output folder}
TGZ=${2:-$OUT.tgz}
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
pstep() { # step, when PROBE_STEPS is unset or matches its name
  if [ -n "${PROBE_STEPS:-}" ] && ! [[ $1 =~ $PROBE_STEPS ]]; then return 0; fi
  step "$@"
}
step_summary() { grep -E "^(PASS|FAIL)|TimeoutError|GB/s|^trace" "$1" | cut -c1-300 | head -n 20; }
step_done() { tar czf "$TGZ" -C "$(dirname "$OUT")" "$(basename "$OUT")"; }
nvidia-smi -L > "$OUT/machine.txt" 2>&1
REPROS=port_cuda_ipc_beside_a_spinning_kernel_pageable_upload
SUITE=(--no-python "$BIN/gpu_multi_rank" --include-ignored --test-threads=1 --nocapture)
pstep repro-upload 60 env MOELINK_TEST_ONLY=$REPROS $TR --nproc-per-node=2 "${SUITE[@]}"
pstep repro-upload-primary 60 env MOELINK_IPC_CONTEXT=primary MOELINK_TEST_ONLY=$REPROS \
  $TR --nproc-per-node=2 "${SUITE[@]}"
EREPROS=port_ethernet_beside_a_spinning_kernel,port_ethernet_beside_a_spinning_kernel_pageable_upload
pstep repro-ethernet 60 env MOELINK_TEST_ONLY=$EREPROS $TR --nproc-per-node=2 "${SUITE[@]}"
pstep repro-ethernet-primary 60 env MOELINK_IPC_CONTEXT=primary MOELINK_TEST_ONLY=$EREPROS \
  $TR --nproc-per-node=2 "${SUITE[@]}"
pstep comm 120 env MOELINK_TEST_SKIP=create_destroy_500x1GiB $TR --nproc-per-node=2 "${SUITE[@]}"
X=(GPU_RUN_INTERNODE_TIMEOUT_S=10)
pstep suite-2x2 260 env "${X[@]}" GPU_RUN_INTERNODE=4:2 GPU_RUN_STEPS='^(internode|killed)' \
  bash scripts/gpu_run.sh "$OUT/suite-2x2"
pstep suite-2x2-threads2 200 env "${X[@]}" MOELINK_PROXY_THREADS=2 GPU_RUN_INTERNODE=4:2 \
  GPU_RUN_STEPS='^internode' bash scripts/gpu_run.sh "$OUT/suite-2x2-threads2"
pstep speed-internode 150 bash benches/speed_run.sh internode "$OUT/speed"
pstep suite-ll-2x2 540 env "${X[@]}" GPU_RUN_INTERNODE=4:2 GPU_RUN_STEPS='^ll-internode' \
  bash scripts/gpu_run.sh "$OUT/suite-ll-2x2"
LL_A=basic,modes,standard_shape,out_and_stats
LL_B=proxy,proxy_loose,invalid_args,cuda_graph,overlap,masked_rank,timeout_mask,timeout_poison,create_destroy
pstep suite-ll-2x4-a 540 env "${X[@]}" MOELINK_LL_SCENARIOS=$LL_A GPU_RUN_INTERNODE=8:4 \
  GPU_RUN_STEPS='^ll-internode' bash scripts/gpu_run.sh "$OUT/suite-ll-2x4-a"
pstep suite-ll-2x4-b 540 env "${X[@]}" MOELINK_LL_SCENARIOS=$LL_B GPU_RUN_INTERNODE=8:4 \
  GPU_RUN_STEPS='^ll-internode' bash scripts/gpu_run.sh "$OUT/suite-ll-2x4-b"
pstep suite-4x2 540 env "${X[@]}" GPU_RUN_INTERNODE=8:2 GPU_RUN_STEPS='^(internode|killed)' \
  bash scripts/gpu_run.sh "$OUT/suite-4x2"
pstep suite-2x4 540 env "${X[@]}" GPU_RUN_INTERNODE=8:4 GPU_RUN_STEPS='^(internode|killed)' \
  bash scripts/gpu_run.sh "$OUT/suite-2x4"
pstep suite-2x2-ethernet 540 env "${X[@]}" GPU_RUN_INTERNODE=4:2:ethernet \
  GPU_RUN_STEPS='^(internode|killed)' bash scripts/gpu_run.sh "$OUT/suite-2x2-ethernet"
pstep memcheck-2x2 560 env GPU_RUN_SANITIZE=1 GPU_RUN_INTERNODE=4:2 \
  GPU_RUN_STEPS='^sanitize-memcheck-internode' bash scripts/gpu_run.sh "$OUT/memcheck-2x2"
pstep main-nodes 300 python3 -m moelink --nodes 2 --ranks 4 --iters 5 --warmup 2 --timeout 280
pstep speed-comm 200 bash benches/speed_run.sh comm "$OUT/speed-comm"
pstep host-overhead 200 $TR --nproc-per-node=4 benches/host_overhead.py --iters 300 \
  --breakdown --out "$OUT/host-overhead"
pstep profile-stamps 300 env MOELINK_INTRANODE_PROFILE=1 MOELINK_DEVICE_TIMEOUT_S=30 \
  $TR --nproc-per-node=4 benches/intranode_profile.py --sms 24 48
pstep profile-suite-2x2 200 env "${X[@]}" MOELINK_TEST_PROFILE=20 \
  GPU_RUN_INTERNODE_SCENARIOS=combine,iterations GPU_RUN_INTERNODE=4:2 GPU_RUN_STEPS='^internode' \
  bash scripts/gpu_run.sh "$OUT/profile-suite-2x2"
pstep capture-test 60 $BIN/gpu_kernels --include-ignored --test-threads=1 --nocapture \
  library_threads_may_call_cuda_during_a_global_capture
KX=(MOELINK_RANKS_PER_NODE=2 MOELINK_TRANSPORT=ethernet MOELINK_DEVICE_TIMEOUT_S=10)
KW=(python3 -m moelink.launch -n 4 --timeout 50 tests/multi_gpu/killed_worker.py)
pstep killed-ethernet-mps 60 env "${KX[@]}" "${KW[@]}"
pstep killed-ethernet-timeslice 60 env "${KX[@]}" MOELINK_MPS=off "${KW[@]}"
pstep send-stamps 120 env MOELINK_INTRANODE_PROFILE=1 MOELINK_DEVICE_TIMEOUT_S=30 \
  $TR --nproc-per-node=4 benches/intranode_profile.py --sms 24 48
echo "internode_stall_probe: $failed failed step(s)"
step_done
exit $failed
