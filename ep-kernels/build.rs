//! Compiles every `.cu` under `cuda/` (with comm's device headers on the include
//! path) into one fatbin embedded in the crate; see build-utils for how nvcc is
//! found and which targets are built.

use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let comm_include = PathBuf::from(
        std::env::var("DEP_MOELINK_COMM_INCLUDE").expect("comm publishes its include dir"),
    );
    println!("cargo:rerun-if-changed=build.rs");
    build_utils::compile_fatbin(
        "moelink_kernels",
        "MOELINK",
        &manifest.join("cuda"),
        &[comm_include],
    );
}
