export MOELINK_LL_SCENARIOS=basic,modes MOELINK_LL_TIMEOUT_S=5
L="python3 -m moelink.launch -n 2 --timeout 90"
for cfg in A B C D; do
  echo "##### config $cfg"
  case $cfg in
    A) $L tests/multi_gpu/ll_worker.py ;;
    B) $L --no-python env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 python3 tests/multi_gpu/ll_worker.py ;;
    C) MOELINK_SMS_PER_RANK=33 $L tests/multi_gpu/ll_worker.py ;;
    D) MOELINK_MPS=off $L tests/multi_gpu/ll_worker.py ;;
  esac 2>&1 | grep -E "^(PASS|FAIL [a-z_]+:|ll_worker:|\[moelink)|error" | cut -c1-300
done
