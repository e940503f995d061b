#!/usr/bin/env bash
# GPU tests, step 1 (any machine with Rust; no GPU needed): build everything the GPU
# tests run into the ignored folder .gpu/, kept under 64 MiB so that it is quick to
# copy to a GPU machine without a Rust toolchain (docs/gpu-tests.md):
#   .gpu/wheels/moelink-*.whl   the package (abi3, sm_90a SASS embedded)
#   .gpu/bin/<test binary>      Rust test executables that hold GPU tests
#   .gpu/BUILD_INFO             commit, date, dirty flag: results cite it
# Then, on the GPU machine (repository root, with .gpu/): `bash scripts/gpu_run.sh`.
# GPU_BUILD_BINS="comm_bench ..." keeps only those binaries in .gpu/bin (to keep the
# folder small when other files, such as benches/speed_run.sh's peers, go along).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
export PATH="$PWD/.venv/bin:$PATH"

rm -rf .gpu && mkdir -p .gpu/wheels .gpu/bin
.venv/bin/maturin build --release --strip -o .gpu/wheels -q 2>&1 | grep -v "^🍹\|^📦\|^🔗" || true
ls .gpu/wheels/*.whl >/dev/null

# Rust integration-test binaries (tests/*.rs: where the GPU tests live) (release; run with --include-ignored).
cargo test --workspace --release --no-run --message-format=json 2>/dev/null |
  .venv/bin/python -c '
import json, shutil, sys, os
for line in sys.stdin:
    m = json.loads(line)
    if (m.get("reason") == "compiler-artifact" and m.get("executable")
            and m["target"]["kind"] == ["test"]):
        shutil.copy(m["executable"], os.path.join(".gpu/bin", m["target"]["name"]))
'
# Benchmark binaries (run through GPU_RUN_EXTRA by torchrun --no-python).
if [ -f benches/Cargo.toml ]; then
  cargo build --release -p moelink-benches -q
  cp target/release/comm_bench .gpu/bin/
fi
strip .gpu/bin/* 2>/dev/null || true
if [ -n "${GPU_BUILD_BINS:-}" ]; then
  for exe in .gpu/bin/*; do
    [[ " $GPU_BUILD_BINS " == *" $(basename "$exe") "* ]] || rm -f "$exe"
  done
  for want in $GPU_BUILD_BINS; do
    [ -e ".gpu/bin/$want" ] || { echo "gpu_build: no binary $want (GPU_BUILD_BINS)" >&2; exit 1; }
  done
fi

{
  echo "commit=$(git rev-parse HEAD 2>/dev/null || echo none)"
  echo "dirty=$([ -z "$(git status --porcelain 2>/dev/null)" ] && echo no || echo yes)"
  echo "built=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "archs=${MOELINK_CUDA_ARCHS:-90a}"
} > .gpu/BUILD_INFO
size=$(du -sm .gpu | cut -f1)
echo "gpu_build: .gpu is ${size} MiB: $(ls .gpu/wheels) + $(ls .gpu/bin | tr '\n' ' ')"
[ "$size" -lt 64 ] || { echo "gpu_build: .gpu exceeds 64 MiB" >&2; exit 1; }
