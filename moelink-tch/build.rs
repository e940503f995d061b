//! With feature `tch`:
//!
//! - Binaries of this crate (tests, examples) find libtorch at run time
//!   through an rpath to the directory torch-sys linked them against
//!   (`DEP_TCH_LIBTORCH_LIB`: the `.venv` torch's `lib/` with
//!   `LIBTORCH_USE_PYTORCH=1`). Elsewhere (the GPU machine, another torch
//!   install of the same version) `LD_LIBRARY_PATH` takes precedence over
//!   nothing: set it to that torch's `lib/` (docs/rust-api.md).
//! - `src/shim.cpp` (torch's CUDA graph, `Tensor.record_stream` on an external
//!   stream: what tch does not expose) is compiled against that torch's
//!   headers (`lib/../include`) and the CUDA headers beside it (the pip
//!   `nvidia/cu13/include`, else `$CUDA_HOME/include`) with `$CXX` (default
//!   `c++`), into a static library linked into the crate. It calls only
//!   libtorch's own symbols (no CUDA runtime of ours).

use std::path::{Path, PathBuf};
use std::process::Command;

fn cuda_include(torch_lib: &Path) -> Option<PathBuf> {
    let site = torch_lib.parent()?.parent()?; // .../site-packages
    let mut candidates = vec![
        site.join("nvidia/cu13/include"),
        site.join("nvidia/cuda_runtime/include"),
    ];
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = std::env::var_os(var) {
            candidates.push(PathBuf::from(home).join("include"));
        }
    }
    candidates.push(PathBuf::from("/usr/local/cuda/include"));
    candidates
        .into_iter()
        .find(|d| d.join("cuda_runtime_api.h").is_file())
}

fn run(cmd: &mut Command) {
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("moelink-tch build.rs: running {cmd:?}: {e}"));
    assert!(
        status.success(),
        "moelink-tch build.rs: {cmd:?} failed ({status})"
    );
}

fn build_shim(torch_lib: &Path) {
    println!("cargo:rerun-if-changed=src/shim.cpp");
    println!("cargo:rerun-if-env-changed=CXX");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let torch_include = torch_lib.join("../include");
    let cuda = cuda_include(torch_lib).unwrap_or_else(|| {
        panic!(
            "moelink-tch build.rs: no CUDA headers (cuda_runtime_api.h) beside {} nor under \
             $CUDA_HOME/include: install the pip nvidia-cuda-runtime of the torch \
             (scripts/setup.sh does) or set CUDA_HOME",
            torch_lib.display()
        )
    });
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let obj = out.join("shim.o");
    run(Command::new(&cxx)
        .args([
            "-std=c++17",
            "-O2",
            "-fPIC",
            "-w",
            "-c",
            "src/shim.cpp",
            "-o",
        ])
        .arg(&obj)
        .arg("-I")
        .arg(&torch_include)
        .arg("-I")
        .arg(&cuda));
    let lib = out.join("libmoelink_tch_shim.a");
    let _ = std::fs::remove_file(&lib);
    run(Command::new("ar").arg("crs").arg(&lib).arg(&obj));
    println!("cargo:rustc-link-search=native={}", out.display());
    println!("cargo:rustc-link-lib=static=moelink_tch_shim");
}

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if std::env::var_os("CARGO_FEATURE_TCH").is_none() {
        return;
    }
    if let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        build_shim(Path::new(&lib));
        // RUNPATH (searched after LD_LIBRARY_PATH).
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
        // libtorch_cuda is linked for its C entry point of the current CUDA
        // stream (src/stream.rs) and torch's CUDA graph (src/shim.cpp),
        // libc10_cuda for the shim's external streams; keep them even where
        // only that is used.
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-ltorch_cuda");
        println!("cargo:rustc-link-arg=-lc10_cuda");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }
}
