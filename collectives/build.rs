//! Compiles every `.cu` under `cuda/` (with comm's device headers on the include
//! path) into one fatbin embedded in the crate (`MOELINK_COLL_FATBIN`); see
//! build-utils for how nvcc is found and which targets (`MOELINK_CUDA_ARCHS`)
//! are built. The fatbin and its unity source are named `moelink_collectives`
//! in this crate's own `OUT_DIR`, so they never collide with ep-kernels' or
//! comm's.

use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let comm_include = PathBuf::from(
        std::env::var("DEP_MOELINK_COMM_INCLUDE").expect("comm publishes its include dir"),
    );
    println!("cargo:rerun-if-changed=build.rs");
    build_utils::compile_fatbin(
        "moelink_collectives",
        "MOELINK_COLL",
        &manifest.join("cuda"),
        &[comm_include],
    );
}
