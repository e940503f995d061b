//! Publishes the device-side headers (`include/comm/*.cuh`) to dependants:
//! crates that compile CUDA read `DEP_MOELINK_COMM_INCLUDE` from their build script.

fn main() {
    let dir = std::path::Path::new(&std::env::var("CARGO_MANIFEST_DIR").unwrap()).join("include");
    println!("cargo:include={}", dir.display());
    println!("cargo:rerun-if-changed=build.rs");
}
