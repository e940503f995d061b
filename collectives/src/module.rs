//! The embedded fatbin of the collectives, its kernel table and the one
//! launcher every kernel goes through (all take a single [`CollArgs`]).

use comm::module::{LoadedModule, ModuleCache};
use comm::{Device, Result, StreamHandle};

use crate::args::CollArgs;
use crate::dtype::NUM_VARIANTS;

/// The fatbin nvcc produced from every `.cu` under `cuda/` (see build.rs).
pub static FATBIN: &[u8] = include_bytes!(env!("MOELINK_COLL_FATBIN"));

/// The CUDA targets the fatbin holds SASS for, e.g. `["90a"]`.
pub fn compiled_archs() -> Vec<&'static str> {
    env!("MOELINK_CUDA_ARCHS").split(',').collect()
}

/// Allreduce kernel families (each has [`NUM_VARIANTS`] entry points
/// `ar_<family>_<variant suffix>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(usize)]
pub enum Family {
    OneShotLl = 0,
    TwoShotLl = 1,
    RsAg = 2,
}

impl Family {
    pub const ALL: [Family; 3] = [Family::OneShotLl, Family::TwoShotLl, Family::RsAg];

    pub fn name(self) -> &'static str {
        match self {
            Family::OneShotLl => "oneshot_ll",
            Family::TwoShotLl => "twoshot_ll",
            Family::RsAg => "rsag",
        }
    }
}

/// One entry point of the fatbin.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// An allreduce family and variant (see [`crate::dtype::variant`]).
    AllReduce(Family, usize),
    AllGatherLl,
    AllGatherMesh,
    LayoutProbe,
}

const NUM_AR: usize = 3 * NUM_VARIANTS;

impl Kernel {
    /// Index into [`NAMES`].
    pub fn index(self) -> usize {
        match self {
            Kernel::AllReduce(f, v) => {
                assert!(v < NUM_VARIANTS, "variant {v}");
                f as usize * NUM_VARIANTS + v
            }
            Kernel::AllGatherLl => NUM_AR,
            Kernel::AllGatherMesh => NUM_AR + 1,
            Kernel::LayoutProbe => NUM_AR + 2,
        }
    }

    pub fn name(self) -> &'static str {
        NAMES[self.index()]
    }
}

macro_rules! kernel_names {
    ($($family:literal),*) => {
        &[
            $(
                concat!("ar_", $family, "_bf16_sum"),
                concat!("ar_", $family, "_bf16_min"),
                concat!("ar_", $family, "_bf16_max"),
                concat!("ar_", $family, "_fp16_sum"),
                concat!("ar_", $family, "_fp16_min"),
                concat!("ar_", $family, "_fp16_max"),
                concat!("ar_", $family, "_fp32_sum"),
                concat!("ar_", $family, "_fp32_min"),
                concat!("ar_", $family, "_fp32_max"),
                concat!("ar_", $family, "_int32_sum"),
                concat!("ar_", $family, "_int32_min"),
                concat!("ar_", $family, "_int32_max"),
                concat!("ar_", $family, "_fp8e4m3_sum_acc16"),
                concat!("ar_", $family, "_fp8e4m3_sum_acc32"),
                concat!("ar_", $family, "_fp8e4m3_min"),
                concat!("ar_", $family, "_fp8e4m3_max"),
                concat!("ar_", $family, "_fp8e5m2_sum_acc16"),
                concat!("ar_", $family, "_fp8e5m2_sum_acc32"),
                concat!("ar_", $family, "_fp8e5m2_min"),
                concat!("ar_", $family, "_fp8e5m2_max"),
            )*
            "ag_ll",
            "ag_mesh",
            "coll_layout_probe",
        ]
    };
}

/// Every `extern "C"` entry point, in [`Kernel::index`] order.
pub static NAMES: &[&str] = kernel_names!("oneshot_ll", "twoshot_ll", "rsag");

static MODULES: ModuleCache = ModuleCache::new("collectives", FATBIN, NAMES);

/// The loaded collective kernels of one device.
#[derive(Clone, Copy)]
pub struct CollKernels(&'static LoadedModule);

impl std::fmt::Debug for CollKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("CollKernels")
            .field(&self.0.device().ordinal)
            .finish()
    }
}

impl CollKernels {
    /// The kernels of `device`, loading the module on first use.
    pub fn get(device: Device) -> Result<CollKernels> {
        MODULES.get(device).map(CollKernels)
    }

    pub fn device(&self) -> Device {
        self.0.device()
    }

    pub fn function(&self, k: Kernel) -> cudarc::driver::sys::CUfunction {
        self.0.function(k.index())
    }

    /// Launches collective kernel `k` with `args` on `stream`.
    ///
    /// # Safety
    /// Every pointer in `args` must be valid for what kernel `k` does with it
    /// (docs of [`CollArgs`]); only [`crate::allreduce::AllReduceComm`] builds them.
    pub(crate) unsafe fn launch(
        &self,
        k: Kernel,
        blocks: u32,
        threads: u32,
        stream: StreamHandle,
        args: &CollArgs,
    ) -> Result<()> {
        // SAFETY: every collective kernel takes exactly one CollArgs
        // (`const __grid_constant__`); pointer validity is the caller's contract.
        unsafe {
            self.0
                .launch_params(k.index(), (blocks, 1), threads, 0, stream, *args)
        }
        .inspect_err(|_| tracing::error!("launch of {} failed", k.name()))
    }

    /// Runs `coll_layout_probe` and returns what the device compiler laid out
    /// (compare with [`crate::args::layout_probe_expected`]).
    pub fn layout_probe(&self) -> Result<Vec<u64>> {
        let n = crate::args::layout_probe_expected().len();
        // SAFETY: coll_layout_probe(unsigned long long*) writes n words.
        unsafe { self.0.run_probe(Kernel::LayoutProbe.index(), n, 0) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::VARIANT_SUFFIXES;

    /// Every name of the kernel table is a kernel of the fatbin.
    #[test]
    fn every_kernel_of_the_table_is_in_the_fatbin() {
        let missing = comm::module::names_missing_from_fatbin(FATBIN, NAMES);
        assert!(missing.is_empty(), "not in the fatbin: {missing:?}");
    }

    /// MOELINK_TRAP_ON_TIMEOUT finds its switch in this fatbin.
    #[test]
    fn the_fatbin_has_the_trap_switch_under_its_c_name() {
        assert!(comm::module::has_trap_switch(FATBIN));
    }

    #[test]
    fn names_follow_the_index_scheme() {
        assert_eq!(NAMES.len(), NUM_AR + 3);
        for f in Family::ALL {
            for (v, suffix) in VARIANT_SUFFIXES.iter().enumerate() {
                let k = Kernel::AllReduce(f, v);
                assert_eq!(k.name(), format!("ar_{}_{suffix}", f.name()));
            }
        }
        assert_eq!(Kernel::AllGatherLl.name(), "ag_ll");
        assert_eq!(Kernel::AllGatherMesh.name(), "ag_mesh");
        assert_eq!(Kernel::LayoutProbe.name(), "coll_layout_probe");
        let unique: std::collections::HashSet<_> = NAMES.iter().collect();
        assert_eq!(unique.len(), NAMES.len());
    }

    /// The CUDA source instantiates the same variants in the same order, and
    /// defines every other entry point: checked on the text, without a GPU
    /// (the GPU test resolves every name in the loaded module).
    #[test]
    fn cuda_source_defines_the_same_kernels() {
        let src = include_str!("../cuda/allreduce.cu");
        let suffixes: Vec<&str> = src
            .lines()
            .filter_map(|l| l.trim().strip_prefix("X(family, "))
            .filter_map(|l| l.split(',').next())
            .collect();
        assert_eq!(suffixes, VARIANT_SUFFIXES);
        for f in Family::ALL {
            assert!(
                src.contains(&format!(
                    "MOELINK_AR_VARIANTS(MOELINK_AR_KERNEL, {})",
                    f.name()
                )),
                "{} not instantiated",
                f.name()
            );
        }
        let ag = include_str!("../cuda/allgather.cu");
        for name in ["ag_ll(", "ag_mesh(", "coll_layout_probe("] {
            assert!(
                ag.contains(&format!(
                    "extern \"C\" __global__ void __launch_bounds__(1024)\n    {name}"
                )) || ag.contains(&format!("extern \"C\" __global__ void {name}")),
                "{name} missing from allgather.cu"
            );
        }
    }
}
