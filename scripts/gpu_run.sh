#!/usr/bin/env bash
# GPU loop, step 2 (on the GPU machine, repository root, .gpu/ carried along):
#   bash scripts/gpu_run.sh [LOG_DIR] [-- extra commands are not taken; use GPU_RUN_EXTRA]
# Installs the wheel into a temporary target, sets the no-multicast policy, runs the
# GPU tests (pytest -m "gpu or multi_gpu", Rust GPU tests with --include-ignored),
# each under `timeout`, and writes logs + summary.json into LOG_DIR (default $OUT,
# else ./gpu-logs): per-step logs are re-packed into steps.tgz after every step (the device
# tool brings back at most 8 files), next to machine.txt and summary.json.
# GPU_RUN_PYTEST_ARGS narrows pytest (e.g. "-k peer");
# GPU_RUN_EXTRA is a command run last (benchmarks), its output logged as extra.log.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${1:-${OUT:-./gpu-logs}}
# Step logs live outside LOG and are re-packed into LOG/steps.tgz after every
# step, so a run cut short by its time limit still brings its logs back.
STEPS=$(mktemp -d /tmp/gpu-steps.XXXXXX)/steps
mkdir -p "$STEPS" "$LOG"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
SITE=/tmp/moelink-site
rm -rf "$SITE"
python3 -m pip install -q --no-deps --no-index --target "$SITE" .gpu/wheels/*.whl ||
  { echo "gpu_run: wheel install failed" >&2; exit 2; }
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

declare -A RESULT
run() { # name timeout cmd...   (GPU_RUN_STEPS: a regex of step names to run)
  local name=$1 t=$2; shift 2
  if [ -n "${GPU_RUN_STEPS:-}" ] && ! [[ $name =~ $GPU_RUN_STEPS ]]; then return; fi
  echo "=== $name: $* (timeout ${t}s)"
  timeout -k 10 "$t" "$@" > "$STEPS/$name.log" 2>&1
  local rc=$?
  RESULT[$name]=$rc
  grep -E "^(PASS|FAIL|SKIPPED)|test result|passed|failed|error|ERROR SUMMARY" "$STEPS/$name.log" | tail -n 30
  echo "=== $name: rc=$rc"
  tar -czf "$LOG/steps.tgz" -C "$(dirname "$STEPS")" steps
}

{
  cat .gpu/BUILD_INFO
  echo "date=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  nvidia-smi topo -m
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
} > "$LOG/machine.txt" 2>&1
cat "$LOG/machine.txt" | head -n 12

NGPU=$(nvidia-smi -L | wc -l)
for exe in .gpu/bin/*; do
  [ -x "$exe" ] || continue
  name=$(basename "$exe")
  case "$name" in
    gpu_multi_rank)  # multi-process: one rank per GPU under torchrun, at 2 and 4 ranks
      for n in 2 4; do
        [ "$NGPU" -ge "$n" ] || { echo "=== rust-$name-$n: skipped, $NGPU GPUs"; continue; }
        run "rust-$name-$n" 400 python3 -m torch.distributed.run --standalone \
          --nproc-per-node="$n" --no-python "$exe" --include-ignored --test-threads=1 --nocapture
      done ;;
    comm_bench) ;;  # a benchmark: run through GPU_RUN_EXTRA
    *) run "rust-$name" 300 "$exe" --include-ignored --test-threads=1 ;;
  esac
done
if [ -n "${GPU_RUN_SANITIZE:-}" ] && [ -x .gpu/bin/gpu_multi_rank ]; then
  # compute-sanitizer memcheck and racecheck over the multi-rank suite at 2 ranks
  # (without the 500 x 1 GiB loop) and over the single-GPU kernel tests.
  for tool in memcheck racecheck; do
    # Left out under the sanitizer: scenarios that launch thousands of tiny
    # kernels from proxy threads (atomics, Ethernet), which it slows past the
    # suite's 60 s bootstrap bound, and the 500 x 1 GiB loop.
    run "sanitize-$tool-multi_rank" 150 env \
      MOELINK_TEST_SKIP=create_destroy_500x1GiB,port_cuda_ipc_atomics,port_ethernet_put_signal_flush,port_ethernet_atomics \
      python3 -m torch.distributed.run --standalone --nproc-per-node=2 --no-python \
      compute-sanitizer --tool "$tool" --error-exitcode 9 \
      .gpu/bin/gpu_multi_rank --include-ignored --test-threads=1 --nocapture
    run "sanitize-$tool-kernels" 200 compute-sanitizer --tool "$tool" --error-exitcode 9 \
      .gpu/bin/gpu_kernels --include-ignored --test-threads=1
  done
fi
run pytest-gpu 540 python3 -m pytest tests -m "gpu or multi_gpu" -v -rs -p no:cacheprovider ${GPU_RUN_PYTEST_ARGS:-}
if [ -n "${GPU_RUN_EXTRA:-}" ]; then
  run extra 540 bash -c "$GPU_RUN_EXTRA"
fi

status=0
{
  echo "{"
  echo "  \"build\": \"$(tr '\n' ' ' < .gpu/BUILD_INFO)\","
  echo "  \"results\": {"
  first=1
  for k in "${!RESULT[@]}"; do
    [ $first -eq 1 ] || echo ","
    first=0
    printf '    "%s": %s' "$k" "${RESULT[$k]}"
    [ "${RESULT[$k]}" -eq 0 ] || status=1
  done
  echo; echo "  }"; echo "}"
} > "$LOG/summary.json"
echo "=== summary"; cat "$LOG/summary.json"
exit $status
