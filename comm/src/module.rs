//! Embedded fatbins loaded lazily, once per device, with every named kernel
//! resolved up front. Shared by comm's own kernels and by ep-kernels.

use std::ffi::{c_void, CString};
use std::sync::{Mutex, OnceLock};

use cudarc::driver::{result, sys};

use crate::cuda::{Device, StreamHandle};
use crate::error::{CommError, CudaResultExt, Result};

const MAX_DEVICES: usize = 64;

/// One fatbin loaded on one device.
pub struct LoadedModule {
    device: Device,
    _module: sys::CUmodule,
    functions: Vec<sys::CUfunction>,
}

// SAFETY: module and function handles are context-global, usable from any thread.
unsafe impl Send for LoadedModule {}
// SAFETY: see above; the handles are never mutated after loading.
unsafe impl Sync for LoadedModule {}

impl LoadedModule {
    pub fn device(&self) -> Device {
        self.device
    }

    /// The function at `index` of the name list the cache was built with.
    pub fn function(&self, index: usize) -> sys::CUfunction {
        self.functions[index]
    }

    /// Launches function `index` on `stream`.
    ///
    /// # Safety
    /// `params` must point to values whose types and order match the kernel's
    /// signature, and every device pointer among them must be valid for the
    /// accesses the kernel makes. Only typed launchers should call this.
    pub unsafe fn launch(
        &self,
        index: usize,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_mem: u32,
        stream: StreamHandle,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        self.device.make_current()?;
        // SAFETY: forwarded from the caller's contract.
        unsafe {
            result::launch_kernel(
                self.functions[index],
                grid,
                block,
                shared_mem,
                stream.raw(),
                params,
            )
        }
        .call("cuLaunchKernel")
    }

    /// Launches function `index`, whose one parameter is `p` (an argument
    /// block passed `const __grid_constant__`, or a single scalar), on a
    /// `grid` of `threads`-thread blocks: the launch convention of every
    /// kernel of every crate.
    ///
    /// # Safety
    /// `P` must be the `#[repr(C)]` mirror of the kernel's parameter and every
    /// device pointer in it valid for the accesses the kernel makes.
    pub unsafe fn launch_params<P: Copy>(
        &self,
        index: usize,
        grid: (u32, u32),
        threads: u32,
        shared_mem: u32,
        stream: StreamHandle,
        p: P,
    ) -> Result<()> {
        let mut p = p;
        let mut params = [kernel_arg(&mut p)];
        // SAFETY: forwarded from the caller's contract.
        unsafe {
            self.launch(
                index,
                (grid.0, grid.1, 1),
                (threads, 1, 1),
                shared_mem,
                stream,
                &mut params,
            )
        }
    }

    /// Runs layout probe `index` (one thread whose one parameter is a `u64*`
    /// it writes at most `n` words through) on `n` words of device memory
    /// filled with `fill` bytes, and returns the words (synchronously).
    ///
    /// # Safety
    /// Function `index` must be such a probe.
    pub unsafe fn run_probe(&self, index: usize, n: usize, fill: u8) -> Result<Vec<u64>> {
        let buf = crate::memory::DeviceMemory::alloc(self.device, n * 8)?;
        buf.fill(fill)?;
        // SAFETY: the caller's contract; the buffer holds n words.
        unsafe { self.launch_params(index, (1, 1), 1, 0, StreamHandle(0), buf.ptr()) }?;
        self.device.synchronize()?;
        let mut out = vec![0u64; n];
        buf.copy_to_host(0, &mut out)?;
        Ok(out)
    }
}

/// One kernel parameter for `cuLaunchKernel`'s argument array: the address of
/// `v`, which must outlive the launch call (every crate's launchers use this).
pub fn kernel_arg<T>(v: &mut T) -> *mut std::ffi::c_void {
    (v as *mut T).cast()
}

/// Declares a crate's kernel table: a `#[repr(usize)]` enum whose variants are
/// the indices, in declaration order, of the `extern "C"` names a
/// [`ModuleCache`] resolves (`NAMES`), so that launchers name a kernel, never a
/// literal index. Every crate with a fatbin declares its table this way (or
/// computes its indices from one, as collectives' variant families do).
///
/// ```ignore
/// comm::kernel_table! {
///     /// Every kernel entry point of the fatbin.
///     pub enum KernelId { AtomicAdd64 => "comm_atomic_add64", AtomicAdd32 => "comm_atomic_add32" }
/// }
/// static MODULES: ModuleCache = ModuleCache::new("comm", FATBIN, KernelId::NAMES);
/// ```
#[macro_export]
macro_rules! kernel_table {
    ($(#[$meta:meta])* $vis:vis enum $table:ident { $($variant:ident => $name:literal),* $(,)? }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[repr(usize)]
        $vis enum $table { $($variant),* }

        impl $table {
            /// Every kernel, in index order.
            pub const ALL: &'static [$table] = &[$($table::$variant),*];
            /// The `extern "C"` names, in index order (what the module cache resolves).
            pub const NAMES: &'static [&'static str] = &[$($name),*];

            /// The kernel's `extern "C"` name.
            pub fn name(self) -> &'static str {
                Self::NAMES[self as usize]
            }

            /// Its index in [`Self::NAMES`] (and in the loaded module).
            pub fn index(self) -> usize {
                self as usize
            }
        }
    };
}

/// The names of `names` that `fatbin` does not hold as a C symbol (a table
/// entry with no kernel behind it fails at module load on a GPU; this finds it
/// on any machine).
pub fn names_missing_from_fatbin<'a>(fatbin: &[u8], names: &[&'a str]) -> Vec<&'a str> {
    names
        .iter()
        .copied()
        .filter(|name| {
            let n = name.as_bytes();
            // A C symbol in the ELF string table: NUL before and after it.
            !fatbin
                .windows(n.len() + 2)
                .any(|w| w[0] == 0 && w[n.len() + 1] == 0 && &w[1..=n.len()] == n)
        })
        .collect()
}

/// `MOELINK_TRAP_ON_TIMEOUT=1`: a device wait that runs out traps its kernel
/// (the context is lost, as with DeepEP's timeout) after recording what it
/// waited for, for users who prefer a crash to an error on the next call.
pub fn trap_on_timeout() -> bool {
    std::env::var("MOELINK_TRAP_ON_TIMEOUT").is_ok_and(|v| v == "1")
}

/// `MOELINK_SPIN_BACKOFF_NS=N`: every device wait sleeps N ns after each
/// failed poll once its clock started (an A/B switch for polling pressure;
/// unset or 0: waits spin).
pub fn spin_backoff_ns() -> i32 {
    std::env::var("MOELINK_SPIN_BACKOFF_NS")
        .ok()
        .and_then(|v| v.parse::<i32>().ok())
        .map_or(0, |n| n.clamp(0, 1_000_000))
}

/// Whether `fatbin` defines the trap switch under its C name (what
/// [`ModuleCache`] looks up), not only a C++-mangled one
/// (`_ZN4comm20comm_trap_on_timeoutE`), which the lookup would miss.
pub fn has_trap_switch(fatbin: &[u8]) -> bool {
    const NAME: &[u8] = b"comm_trap_on_timeout";
    fatbin.windows(NAME.len()).enumerate().any(|(i, w)| {
        w == NAME
            && !(i >= 2 && &fatbin[i - 2..i] == b"20")
            && fatbin.get(i + NAME.len()) != Some(&b'E')
    })
}

/// A fatbin plus its kernel names; loads one [`LoadedModule`] per device on
/// first use and keeps it for the life of the process.
pub struct ModuleCache {
    label: &'static str,
    fatbin: &'static [u8],
    names: &'static [&'static str],
    /// Per device: the primary context's, then the proxy contexts'.
    loaded: [OnceLock<LoadedModule>; 2 * MAX_DEVICES],
    loading: Mutex<()>,
}

impl ModuleCache {
    pub const fn new(
        label: &'static str,
        fatbin: &'static [u8],
        names: &'static [&'static str],
    ) -> Self {
        Self {
            label,
            fatbin,
            names,
            loaded: [const { OnceLock::new() }; 2 * MAX_DEVICES],
            loading: Mutex::new(()),
        }
    }

    /// Launches function `index` on `device` (loading the module on first use)
    /// on a 1-D grid of `blocks` x `threads`, no dynamic shared memory, with
    /// its one parameter `p` ([`LoadedModule::launch_params`]).
    ///
    /// # Safety
    /// As [`LoadedModule::launch_params`].
    pub unsafe fn launch_params<P: Copy>(
        &'static self,
        device: Device,
        index: usize,
        blocks: u32,
        threads: u32,
        stream: StreamHandle,
        p: P,
    ) -> Result<()> {
        let m = self.get(device)?;
        // SAFETY: forwarded from the caller's contract.
        unsafe { m.launch_params(index, (blocks, 1), threads, 0, stream, p) }
    }

    pub fn get(&'static self, device: Device) -> Result<&'static LoadedModule> {
        let slot = self
            .loaded
            .get(device.ordinal as usize + if device.own { MAX_DEVICES } else { 0 })
            .filter(|_| (device.ordinal as usize) < MAX_DEVICES)
            .ok_or_else(|| CommError::invalid("device", "device ordinal above 63"))?;
        if let Some(m) = slot.get() {
            return Ok(m);
        }
        let _guard = self.loading.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = slot.get() {
            return Ok(m);
        }
        let loaded = self.load(device)?;
        Ok(slot.get_or_init(|| loaded))
    }

    fn load(&self, device: Device) -> Result<LoadedModule> {
        device.make_current()?;
        // SAFETY: the fatbin was produced by nvcc at build time (build-utils).
        let module = unsafe { result::module::load_data(self.fatbin.as_ptr().cast()) }
            .call("cuModuleLoadData")
            .inspect_err(|_| {
                tracing::error!(
                    "loading the {} fatbin (SASS for sm_{}) on device {} failed",
                    self.label,
                    env!("MOELINK_CUDA_ARCHS"),
                    device.ordinal
                )
            })?;
        let mut functions = Vec::with_capacity(self.names.len());
        for name in self.names {
            let cname = CString::new(*name).expect("kernel names have no NUL");
            // SAFETY: module was just loaded and is never unloaded.
            let f = unsafe { result::module::get_function(module, cname) }
                .call("cuModuleGetFunction")?;
            functions.push(f);
        }
        if trap_on_timeout() {
            // SAFETY: module is loaded; the symbol, where the module has it, is
            // the 4-byte `comm_trap_on_timeout` of common_device.cuh.
            match unsafe {
                result::module::get_global(module, CString::from(c"comm_trap_on_timeout"))
            } {
                Ok((ptr, 4)) => {
                    // SAFETY: a 4-byte device global of this module, in this context.
                    unsafe { result::memcpy_htod_sync(ptr, &[1i32]) }.call("cuMemcpyHtoD")?;
                }
                _ => tracing::warn!(
                    "MOELINK_TRAP_ON_TIMEOUT=1: the {} module has no comm_trap_on_timeout; \
                     its waits report timeouts without trapping",
                    self.label
                ),
            }
        }
        let backoff = spin_backoff_ns();
        if backoff > 0 {
            // SAFETY: module is loaded; the symbol, where the module has it, is
            // the 4-byte `comm_spin_backoff_ns` of common_device.cuh.
            if let Ok((ptr, 4)) = unsafe {
                result::module::get_global(module, CString::from(c"comm_spin_backoff_ns"))
            } {
                // SAFETY: a 4-byte device global of this module, in this context.
                unsafe { result::memcpy_htod_sync(ptr, &[backoff]) }.call("cuMemcpyHtoD")?;
            }
        }
        tracing::debug!("loaded {} kernels on device {}", self.label, device.ordinal);
        Ok(LoadedModule {
            device,
            _module: module,
            functions,
        })
    }
}
