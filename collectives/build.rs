//! Compiles every `.cu` under `cuda/` (with comm's device headers on the include
//! path) into one fatbin embedded in the crate (`MOELINK_COLL_FATBIN`); see
//! build-utils for how nvcc is found and which targets (`MOELINK_CUDA_ARCHS`)
//! are built. The fatbin and its unity source are named `moelink_collectives`
//! in this crate's own `OUT_DIR`, so they never collide with ep-kernels' or
//! comm's.

fn main() {
    build_utils::compile_fatbin_with_comm_headers("moelink_collectives", "MOELINK_COLL");
}
