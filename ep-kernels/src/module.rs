//! The embedded fatbin of ep-kernels and its kernel-id table.

use comm::module::{LoadedModule, ModuleCache};
use comm::{Device, Result};

/// The fatbin nvcc produced from every `.cu` under `cuda/` (see build.rs).
pub static FATBIN: &[u8] = include_bytes!(env!("MOELINK_FATBIN"));

/// The CUDA targets the fatbin holds SASS for, e.g. `["90a"]`.
pub fn compiled_archs() -> Vec<&'static str> {
    env!("MOELINK_CUDA_ARCHS").split(',').collect()
}

comm::kernel_table! {
    /// Every kernel entry point of the fatbin (`extern "C"` names).
    pub enum KernelId {
        DiagnosticsWritePeers => "diagnostics_write_peers",
        ReduceRowsBf16 => "reduce_rows_bf16",
        LayoutDispatch => "layout_dispatch",
        DispatchNotify => "dispatch_notify",
        DispatchBarrier => "dispatch_barrier",
        DispatchSend => "dispatch_send",
        DispatchWait => "dispatch_wait",
        DispatchRecv => "dispatch_recv",
        CombineBarrier => "combine_barrier",
        CombineSend => "combine_send",
        CombineWait => "combine_wait",
        CombineRecv => "combine_recv",
        DispatchFused => "dispatch_fused",
        CombineFused => "combine_fused",
        LlDispatch => "ll_dispatch",
        LlCombine => "ll_combine",
        InternodeNotify => "internode_notify",
        InternodeBarrier => "internode_barrier",
        InternodeDispatch => "internode_dispatch",
        InternodeCombine => "internode_combine",
    }
}

static MODULES: ModuleCache = ModuleCache::new("ep-kernels", FATBIN, KernelId::NAMES);

/// The loaded kernels of one device.
pub struct DeviceKernels(&'static LoadedModule);

impl DeviceKernels {
    /// The kernels of `device`, loading the module on first use.
    pub fn get(device: Device) -> Result<DeviceKernels> {
        MODULES.get(device).map(DeviceKernels)
    }

    pub fn device(&self) -> Device {
        self.0.device()
    }

    pub fn function(&self, id: KernelId) -> cudarc::driver::sys::CUfunction {
        self.0.function(id as usize)
    }

    /// Launches kernel `id` with its argument block `p`
    /// ([`comm::module::LoadedModule::launch_params`]).
    ///
    /// # Safety
    /// As [`comm::module::LoadedModule::launch_params`].
    pub(crate) unsafe fn launch_params<P: Copy>(
        &self,
        id: KernelId,
        grid: (u32, u32),
        threads: u32,
        shared_mem: u32,
        stream: comm::StreamHandle,
        p: P,
    ) -> Result<()> {
        // SAFETY: forwarded from the caller's contract.
        unsafe {
            self.0
                .launch_params(id as usize, grid, threads, shared_mem, stream, p)
        }
        .inspect_err(|_| tracing::error!("launch of {} failed", id.name()))
    }
}

#[cfg(test)]
mod trap_switch_tests {
    /// Every name of the kernel table is a kernel of the fatbin.
    #[test]
    fn every_kernel_of_the_table_is_in_the_fatbin() {
        let missing =
            comm::module::names_missing_from_fatbin(super::FATBIN, super::KernelId::NAMES);
        assert!(missing.is_empty(), "not in the fatbin: {missing:?}");
        assert_eq!(super::KernelId::ALL.len(), super::KernelId::NAMES.len());
        assert_eq!(super::KernelId::LlCombine.name(), "ll_combine");
        assert_eq!(
            super::KernelId::InternodeCombine.name(),
            "internode_combine"
        );
    }

    /// MOELINK_TRAP_ON_TIMEOUT finds its switch in this fatbin.
    #[test]
    fn the_fatbin_has_the_trap_switch_under_its_c_name() {
        assert!(comm::module::has_trap_switch(super::FATBIN));
        assert!(!comm::module::has_trap_switch(
            b"_ZN4comm20comm_trap_on_timeoutE"
        ));
    }
}
