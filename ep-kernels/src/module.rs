//! The embedded fatbin, loaded lazily once per device, and the kernel-id table.

use std::ffi::CString;
use std::sync::{Mutex, OnceLock};

use comm::error::{CommError, CudaResultExt, Result};
use comm::Device;
use cudarc::driver::{result, sys};

/// The fatbin nvcc produced from every `.cu` under `cuda/` (see build.rs).
pub static FATBIN: &[u8] = include_bytes!(env!("MOELINK_FATBIN"));

/// The CUDA targets the fatbin holds SASS for, e.g. `["90a"]`.
pub fn compiled_archs() -> Vec<&'static str> {
    env!("MOELINK_CUDA_ARCHS").split(',').collect()
}

macro_rules! kernels {
    ($($variant:ident => $name:literal),* $(,)?) => {
        /// Every kernel entry point of the fatbin (`extern "C"` names).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[repr(usize)]
        pub enum KernelId { $($variant),* }

        impl KernelId {
            pub const ALL: &'static [KernelId] = &[$(KernelId::$variant),*];
            pub fn name(self) -> &'static str {
                match self { $(KernelId::$variant => $name),* }
            }
        }
    };
}

kernels! {
    DiagnosticsWritePeers => "diagnostics_write_peers",
    ReduceRowsBf16 => "reduce_rows_bf16",
}

/// The loaded module of one device with every function resolved.
pub struct DeviceKernels {
    device: Device,
    _module: sys::CUmodule,
    functions: Vec<sys::CUfunction>,
}

// SAFETY: module and function handles are context-global, usable from any thread.
unsafe impl Send for DeviceKernels {}
// SAFETY: see above; the handles are never mutated after loading.
unsafe impl Sync for DeviceKernels {}

impl DeviceKernels {
    /// The kernels of `device`, loading the module on first use. The module
    /// stays loaded for the life of the process (like the primary context).
    pub fn get(device: Device) -> Result<&'static DeviceKernels> {
        const MAX: usize = 64;
        static LOADED: [OnceLock<DeviceKernels>; MAX] = [const { OnceLock::new() }; MAX];
        static LOADING: Mutex<()> = Mutex::new(());
        let slot = LOADED
            .get(device.ordinal as usize)
            .ok_or_else(|| CommError::invalid("device", "device ordinal above 63"))?;
        if let Some(k) = slot.get() {
            return Ok(k);
        }
        let _guard = LOADING.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = slot.get() {
            return Ok(k);
        }
        let loaded = Self::load(device)?;
        Ok(slot.get_or_init(|| loaded))
    }

    fn load(device: Device) -> Result<DeviceKernels> {
        device.make_current()?;
        // SAFETY: FATBIN is a well-formed fatbin produced by nvcc at build time.
        let module = unsafe { result::module::load_data(FATBIN.as_ptr().cast()) }
            .call("cuModuleLoadData")
            .inspect_err(|_| {
                tracing::error!(
                    "loading the moelink fatbin (SASS for {:?}) on device {} failed",
                    compiled_archs(),
                    device.ordinal
                )
            })?;
        let mut functions = Vec::with_capacity(KernelId::ALL.len());
        for k in KernelId::ALL {
            let name = CString::new(k.name()).expect("kernel names have no NUL");
            // SAFETY: module was just loaded and is never unloaded.
            functions.push(
                unsafe { result::module::get_function(module, name) }
                    .call("cuModuleGetFunction")?,
            );
        }
        tracing::debug!("loaded moelink kernels on device {}", device.ordinal);
        Ok(DeviceKernels {
            device,
            _module: module,
            functions,
        })
    }

    pub fn device(&self) -> Device {
        self.device
    }

    pub fn function(&self, id: KernelId) -> sys::CUfunction {
        self.functions[id as usize]
    }

    /// Launches `id`. Only the typed launchers in [`crate::launch`] call this.
    ///
    /// # Safety
    /// `params` must point to values whose types and order match the kernel's
    /// signature, and every device pointer among them must be valid for the
    /// accesses the kernel makes.
    pub(crate) unsafe fn launch(
        &self,
        id: KernelId,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_mem: u32,
        stream: comm::StreamHandle,
        params: &mut [*mut std::ffi::c_void],
    ) -> Result<()> {
        self.device.make_current()?;
        // SAFETY: forwarded from the caller's contract.
        unsafe {
            result::launch_kernel(
                self.function(id),
                grid,
                block,
                shared_mem,
                stream.raw(),
                params,
            )
        }
        .map_err(|source| CommError::Cuda {
            call: "cuLaunchKernel",
            source,
        })
        .inspect_err(|_| tracing::error!("launch of {} failed", id.name()))
    }
}
