//! With feature `tch`: binaries of this crate (tests, examples) find libtorch
//! at run time through an rpath to the directory torch-sys linked them
//! against (`DEP_TCH_LIBTORCH_LIB`: the `.venv` torch's `lib/` with
//! `LIBTORCH_USE_PYTORCH=1`). Elsewhere (the GPU machine, another torch
//! install of the same version) `LD_LIBRARY_PATH` takes precedence over
//! nothing: set it to that torch's `lib/` (docs/rust-api.md).

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if std::env::var_os("CARGO_FEATURE_TCH").is_none() {
        return;
    }
    if let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        // RUNPATH (searched after LD_LIBRARY_PATH).
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
        // libtorch_cuda is linked for its C entry point of the current CUDA
        // stream (src/stream.rs); keep it even where only that is used.
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-ltorch_cuda");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }
}
