#!/usr/bin/env bash
# The test command (README; .ci/run calls it). On any machine, GPU or not:
# formatting and lints, every Rust test, the compile of every CUDA file (build.rs),
# `pip install .` of the package, and pytest. GPU tests skip with a reason where
# there is no GPU; on the GPU machine scripts/gpu_run.sh runs them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=.venv/bin/python
export PATH="$PWD/.venv/bin:$PATH"

step() { echo; echo "=== $* ==="; }

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "cargo test (compiles every CUDA file through the comm and ep-kernels build scripts)"
cargo test --workspace --locked

step "moelink-tch: the Rust API on tch tensors (feature tch, built against .venv's torch)"
# Off in the workspace build above (libtorch's C++ wrapper stays out of clippy,
# cargo test and scripts/gpu_build.sh); torch-sys finds torch through python3.
LIBTORCH_USE_PYTORCH=1 cargo clippy -p moelink-tch --features tch --all-targets --locked -- -D warnings
LIBTORCH_USE_PYTORCH=1 cargo test -p moelink-tch --features tch --locked

step "python lint (ruff)"
"$PY" -m ruff check python tests benches scripts
"$PY" -m ruff format --check python tests benches scripts

step "pip install . (maturin; nvcc from the build requirements)"
"$PY" -m pip install -q --no-deps --force-reinstall .

step "pytest"
set +e
(cd /tmp && "$OLDPWD/$PY" -c 'import moelink; print("imported", moelink.__file__)')
"$PY" -m pytest tests -q
rc=$?
set -e
[ $rc -eq 5 ] && { echo "pytest collected no tests" >&2; exit 1; }
exit $rc
