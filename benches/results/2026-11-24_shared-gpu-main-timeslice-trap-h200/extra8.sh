export MOELINK_MPS=auto
echo "##### main --ranks 8"
python3 -m moelink --ranks 8 --num-tokens 1024 --iters 5 --warmup 2 --timeout 300 2>&1 | tail -40
echo "##### main --ranks 2"
python3 -m moelink --ranks 2 --iters 20 --warmup 5 --timeout 200 2>&1 | tail -30
for c in 8 32; do for i in 1 2; do
  echo "##### LL-4 proxy, CUDA_DEVICE_MAX_CONNECTIONS=$c, try $i"
  CUDA_DEVICE_MAX_CONNECTIONS=$c MOELINK_LL_SCENARIOS=proxy MOELINK_LL_TIMEOUT_S=10 \
    python3 -m moelink.launch -n 4 --timeout 80 tests/multi_gpu/ll_worker.py 2>&1 |
    grep -E "^(PASS|FAIL [a-z_]+:)" | cut -c1-300
done; done
echo "##### trap-2"
MOELINK_MPS=off python3 -m moelink.launch -n 2 --timeout 60 tests/multi_gpu/trap_worker.py 2>&1 | grep -E "^(PASS|FAIL)" | cut -c1-300
for s in intranode ll; do
  echo "##### time-sliced $s-2"
  t0=$SECONDS
  MOELINK_MPS=off python3 -m moelink.launch -n 2 --timeout 150 tests/multi_gpu/${s}_worker.py 2>&1 |
    grep -E "^(PASS|FAIL [a-z_]+:)|error" | cut -c1-300
  echo "time-sliced $s-2: $((SECONDS - t0)) s"
done
