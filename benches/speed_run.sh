#!/usr/bin/env bash
# The speed measurements on one multi-GPU host (4 x H200 is the reference), in
# parts that each fit one device call (<= 10 min), every figure next to the peers
# measured in the same call:
#   bash benches/speed_run.sh PART OUT
# PART (one or several, comma separated):
#   intranode  peer_bench.py --only intranode (the same code, workload and byte
#              formula for every library) for moelink (fused kernels, the default),
#              moelink's direct dispatch (MOELINK_INTRANODE_RECV=direct, a pool that
#              holds every recv_x the benchmark keeps), DeepEP V1 and UCCL-EP; then
#              peer_table.py (the fused default against the peers). NCCL all_to_all_single is the
#              baseline row.
#   ll         peer_bench.py --only ll for moelink, moelink's base build (when
#              .gpu/base/wheels holds one: the kernels before a change, measured in
#              the same call), DeepEP V1 and UCCL-EP; then peer_table.py.
#   comm       comm_bench (2 GPUs: round trips and puts), and .gpu/base/comm_bench
#              (the base build) when present.
#   internode  intranode_bench.py --nodes 2 (emulated nodes, the proxy between them):
#              NVLink-side and RDMA-side GB/s (DeepEP's byte formulas) and the bytes
#              that cross nodes, NCCL all_to_all_single beside it.
#   sm         bandwidth by SM count (benches/sm_table.py): peer_bench.py --only
#              intranode at SM_COUNTS (default "4 8 12 16 24 32 48 64") for moelink
#              (fused), moelink direct, DeepEP V1 and UCCL-EP (the peers at the
#              counts up to 48), into OUT/sm/<row>; SM_PROBE_LOG, when set, is the
#              NVLink ceiling probe's output, copied to OUT/sm/probe.log; then the
#              table, OUT/sm/sm_table.{json,png}.
#   detail     ll_bench with phase stamps (MOELINK_LL_PROFILE=1) and
#              intranode_profile (per-kernel GPU times and the fused kernels' phase
#              stamps, MOELINK_INTRANODE_PROFILE=1).
# Needs: the moelink wheel installed (scripts/gpu_run.sh does it, or PYTHONPATH),
# and for `peers` the peers' builds in .peers/ (benches/README.md says what they are;
# they are not part of the repository). Every step runs under `timeout`; its log goes
# to OUT/<step>.log; a failed step does not stop the others; the exit code is the
# number of failed steps.
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:?part(s): intranode,ll,sm,comm,internode,detail}
OUT=${2:?output folder}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
NGPU=$(nvidia-smi -L | wc -l)
RUN="python3 -m torch.distributed.run --standalone --nproc-per-node=$NGPU"
failed=0
. benches/step.sh
step_summary() { tail -n 25 "$1"; }
step_done() { :; }
{ # what scripts/record_gpu_run.py reads: GPUs, build (commit=, dirty=) and date=
  echo "date=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  nvidia-smi topo -m
  python3 -m pip show nvidia-nvshmem-cu13 2>/dev/null | grep -E "^(Name|Version)"
  cat .gpu/BUILD_INFO 2>/dev/null
} > "$OUT/machine.txt" 2>&1
head -n 8 "$OUT/machine.txt"
base_site() { # the base build's package, installed once (empty when absent)
  local w
  w=$(ls .gpu/base/wheels/*.whl 2>/dev/null | head -n1)
  [ -n "$w" ] || return 0
  [ -d /tmp/moelink-base-site ] ||
    python3 -m pip install -q --no-deps --no-index --target /tmp/moelink-base-site "$w"
  echo /tmp/moelink-base-site
}
for part in ${PART//,/ }; do
  case "$part" in
    intranode)
      P="$OUT/intranode"
      mkdir -p "$P/direct"
      for impl in moelink deep_ep uccl; do
        step "intranode-$impl" 170 $RUN benches/peer_bench.py --impl "$impl" --only intranode --out "$P"
      done
      step intranode-moelink-direct 120 env MOELINK_INTRANODE_RECV=direct \
        MOELINK_INTRANODE_RECV_POOL_BYTES=$((8 << 30)) \
        $RUN benches/peer_bench.py --impl moelink --only intranode --out "$P/direct"
      step intranode-table 60 python3 benches/peer_table.py "$P"
      ;;
    ll)
      P="$OUT/ll"
      mkdir -p "$P/base"
      for impl in moelink deep_ep; do
        step "ll-$impl" 150 $RUN benches/peer_bench.py --impl "$impl" --only ll --out "$P"
      done
      site=$(base_site)
      [ -n "$site" ] && step ll-moelink-base 150 env PYTHONPATH="$site" \
        $RUN benches/peer_bench.py --impl moelink --only ll --out "$P/base"
      # UCCL-EP's low-latency mode goes through its CPU proxies (RDMA): bounded.
      step ll-uccl 60 $RUN benches/peer_bench.py --impl uccl --only ll --out "$P"
      step ll-table 60 python3 benches/peer_table.py "$P"
      ;;
    sm)
      P="$OUT/sm"
      SMS=${SM_COUNTS:-4 8 12 16 24 32 48 64}
      PEER_SMS=$(for s in $SMS; do [ "$s" -le 48 ] && printf '%s ' "$s"; done)
      mkdir -p "$P/fused" "$P/direct" "$P/deepep" "$P/uccl"
      B="benches/peer_bench.py --only intranode --iters 10 --warmup 3"
      step sm-fused 200 $RUN $B --impl moelink --sms $SMS --out "$P/fused"
      step sm-direct 200 env MOELINK_INTRANODE_RECV=direct \
        MOELINK_INTRANODE_RECV_POOL_BYTES=$((8 << 30)) \
        $RUN $B --impl moelink --sms $SMS --out "$P/direct"
      step sm-deepep 200 $RUN $B --impl deep_ep --sms $PEER_SMS --out "$P/deepep"
      step sm-uccl 200 $RUN $B --impl uccl --sms $PEER_SMS --out "$P/uccl"
      [ -n "${SM_PROBE_LOG:-}" ] && cp "$SM_PROBE_LOG" "$P/probe.log"
      step sm-table 60 python3 benches/sm_table.py "$P" --out "$P/sm_table"
      ;;
    comm)
      step comm_bench 150 python3 -m torch.distributed.run --standalone --nproc-per-node=2 \
        --no-python .gpu/bin/comm_bench --out "$OUT/comm_bench.json"
      [ -x .gpu/base/comm_bench ] && step comm_bench-base 150 python3 -m torch.distributed.run \
        --standalone --nproc-per-node=2 --no-python .gpu/base/comm_bench --out "$OUT/comm_bench_base.json"
      ;;
    detail)
      mkdir -p "$OUT/llstamps"
      step ll_bench 200 env MOELINK_LL_PROFILE=1 MOELINK_CHECK_IDS=0 \
        $RUN benches/ll_bench.py --no-sweep --out "$OUT/llstamps"
      # With phase stamps (MOELINK_INTRANODE_PROFILE=1).
      step intranode_profile 120 env MOELINK_INTRANODE_PROFILE=1 \
        $RUN benches/intranode_profile.py --sms 24 48
      ;;
    internode)
      # Emulated nodes of consecutive ranks on this host (2 x 2 on 4 GPUs): the
      # internode kernels, every cross-node byte through the proxy (CUDA IPC copies
      # over NVLink); GB/s of the NVLink side (bytes received) and the RDMA side by
      # DeepEP's formulas, and of what crosses nodes.
      mkdir -p "$OUT/internode"
      step "internode-nodes2" 200 env MOELINK_DEVICE_TIMEOUT_S=20 $RUN \
        benches/intranode_bench.py --nodes 2 --sms 24 48 --out "$OUT/internode"
      ;;
    *) echo "unknown part $part" >&2; exit 2 ;;
  esac
done
echo "speed_run $PART: $failed failed step(s)"
exit "$failed"
