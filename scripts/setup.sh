#!/usr/bin/env bash
# Installs everything moelink needs to build and test into the ignored project-local
# environment .venv: the CUDA 13.0 compiler from pip (pinned: an unpinned nvvm emits
# PTX the 13.0 ptxas rejects), torch 2.11.0, maturin, pytest, hypothesis, ruff, numpy,
# matplotlib.
# Idempotent: a second run only checks. Needs: python3 (>= 3.9) with venv, a Rust
# toolchain (rustup reads rust-toolchain.toml), a C/C++ compiler for nvcc's host side.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.moelink-setup-v2

need() { command -v "$1" >/dev/null 2>&1 || { echo "setup: '$1' is required: $2" >&2; exit 1; }; }
need "$PY" "install Python 3.9+"
need cargo "install Rust with rustup (https://rustup.rs); rust-toolchain.toml pins the version"
need g++ "install a C++ compiler (Debian: apt-get install g++)"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
if [ ! -f "$STAMP" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q \
    "nvidia-cuda-nvcc==13.0.88" "nvidia-nvvm==13.0.88" "nvidia-cuda-crt==13.0.88" \
    "nvidia-cuda-cccl==13.0.*" "nvidia-cuda-runtime==13.0.*" \
    "torch==2.11.0" "maturin>=1.9,<2" "pytest>=8" "hypothesis>=6.100" "ruff==0.14.*" \
    numpy matplotlib
  touch "$STAMP"
fi
NVCC=$(ls "$VENV"/lib/python3*/site-packages/nvidia/cu13/bin/nvcc 2>/dev/null | head -n1)
[ -x "$NVCC" ] || { echo "setup: nvcc missing from $VENV after install" >&2; exit 1; }
rustup component add rustfmt clippy >/dev/null 2>&1 || true
echo "setup: ok ($("$NVCC" --version | tail -n1); $("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
