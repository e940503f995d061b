#!/usr/bin/env bash
# The killed-rank worker over the Ethernet transport at 2 x 2, every rank on one GPU,
# under a private MPS daemon whose logs land in $OUT/mpslog: 4 trials. Each rank prints its
# PID; the kernel log's Xid lines (dmesg) name the client whose channel faulted.
# Device machine, repository root, .gpu carried: bash benches/mps_fault_probe.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-deps --no-index --target /tmp/site .gpu/wheels/*.whl
export PYTHONPATH=/tmp/site
mkdir -p $OUT/mpslog /tmp/nvidia-mps
export CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps CUDA_MPS_LOG_DIRECTORY=$OUT/mpslog
nvidia-cuda-mps-control -d
sleep 1
for i in 1 2 3 4; do
  echo "=== run $i"
  MOELINK_RANKS_PER_NODE=2 MOELINK_TRANSPORT=ethernet MOELINK_DEVICE_TIMEOUT_S=10 timeout 60 python3 -m moelink.launch -n 4 --timeout 50 tests/multi_gpu/killed_worker.py > $OUT/run$i.log 2>&1
  echo "rc=$?"; grep -E "^killed_worker|^PASS|^FAIL|illegal memory" $OUT/run$i.log | sort | uniq | cut -c1-160
done
echo quit | nvidia-cuda-mps-control
sleep 1
(dmesg 2>&1 | tail -40) > $OUT/dmesg.txt
grep -iE "fault|error|exit|Xid" $OUT/mpslog/*.log | tail -40
