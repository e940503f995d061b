//! Publishes the device-side headers (`include/comm/*.cuh`) to dependants, which
//! read `DEP_MOELINK_COMM_INCLUDE`, and compiles comm's own kernels (`cuda/`:
//! the transports' remote atomics, the device-handle layout probe) into the
//! fatbin embedded in this crate, and the test kernels (`cuda_testing/`) into a
//! second one that only `comm::kernels::testing` loads.

use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let include = manifest.join("include");
    println!("cargo:include={}", include.display());
    println!("cargo:rerun-if-changed=build.rs");
    build_utils::compile_fatbin(
        "comm_kernels",
        "COMM",
        &manifest.join("cuda"),
        std::slice::from_ref(&include),
    );
    // The kernels behind comm's GPU tests and benchmarks, in a fatbin of their
    // own: the module every process loads holds the production kernels only.
    build_utils::compile_fatbin(
        "comm_test_kernels",
        "COMM_TEST",
        &manifest.join("cuda_testing"),
        &[include],
    );
}
