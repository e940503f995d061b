#!/usr/bin/env bash
# GPU loop for moelink-tch, step 1 (here, no GPU needed; after scripts/gpu_build.sh,
# which empties .gpu/): the release example binaries into .gpu/tch/ (stripped):
#   .gpu/tch/moe_layer    examples/moe_layer.rs (the MoE layer, checked, timed)
#   .gpu/tch/tch_parity   examples/tch_parity.rs (the Rust half of the parity test)
#   .gpu/tch/tch_streams  moelink-tch/examples/tch_streams.rs (events, async_finish,
#                         allocate_on_comm_stream, CUDA graphs, tuning file, id check)
# They link the torch of .venv (2.11) dynamically: on the GPU machine they find
# that machine's torch 2.11 through LD_LIBRARY_PATH (moelink-tch/scripts/gpu_run.sh
# sets it).
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup.sh >/dev/null
export PATH="$PWD/.venv/bin:$PATH" LIBTORCH_USE_PYTORCH=1
cargo build --release --locked -p moelink-tch --features tch --examples -q
mkdir -p .gpu/tch
cp target/release/examples/moe_layer target/release/examples/tch_parity \
  target/release/examples/tch_streams .gpu/tch/
strip .gpu/tch/*
size=$(du -sm .gpu | cut -f1)
echo "moelink-tch gpu_build: $(du -sh .gpu/tch | cut -f1) in .gpu/tch; .gpu is ${size} MiB"
[ "$size" -lt 64 ] || { echo "moelink-tch gpu_build: .gpu exceeds 64 MiB" >&2; exit 1; }
