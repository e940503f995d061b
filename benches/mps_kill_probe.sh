#!/usr/bin/env bash
# benches/mps_kill_probe.py under a private MPS daemon (4 trials, 3 survivors),
# then without MPS (2 trials), then the kernel log's Xid lines. Plain torch, no
# moelink. Device machine, repository root: bash benches/mps_kill_probe.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p $OUT/mpslog /tmp/nvidia-mps
export CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps CUDA_MPS_LOG_DIRECTORY=$OUT/mpslog
nvidia-cuda-mps-control -d; sleep 1
timeout 200 python3 benches/mps_kill_probe.py --trials 4 --survivors 3 2>&1 | tail -20
echo quit | nvidia-cuda-mps-control; sleep 1
echo "--- no MPS"; unset CUDA_MPS_PIPE_DIRECTORY
timeout 100 python3 benches/mps_kill_probe.py --trials 2 --survivors 3 2>&1 | tail -5
dmesg 2>&1 | grep Xid | tail -20
