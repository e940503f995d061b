//! Compiles every `.cu` under `cuda/` (with comm's device headers on the include
//! path) into one fatbin embedded in the crate; see build-utils for how nvcc is
//! found and which targets are built.

fn main() {
    build_utils::compile_fatbin_with_comm_headers("moelink_kernels", "MOELINK");
}
