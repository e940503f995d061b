//! Embedded fatbins loaded lazily, once per device, with every named kernel
//! resolved up front. Shared by comm's own kernels and by ep-kernels.
//!
//! A kernel is named either by its `extern "C"` symbol (`comm_copy`) or by
//! its C++ qualified name (`moelink::ll::dispatch`), which is what profilers
//! show. A qualified name is resolved once per process, on the CPU, to the one
//! mangled symbol of the fatbin that starts with its Itanium prefix
//! (`_ZN7moelink2ll8dispatchE`; the parameter types follow), and that symbol
//! is what `cuModuleGetFunction` gets.

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
/// the indices, in declaration order, of the kernel names a [`ModuleCache`]
/// resolves (`NAMES`: `extern "C"` names or C++ qualified names, see the
/// module docs), so that launchers name a kernel, never a literal index. Every crate with a fatbin declares its table this way (or
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
            /// The kernel names, in index order (what the module cache resolves).
            pub const NAMES: &'static [&'static str] = &[$($name),*];

            /// The kernel's name (`extern "C"`, or C++ qualified).
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

/// The names of `names` that `fatbin` does not hold as a kernel symbol: a C
/// name absent from its string tables, or a qualified name that does not
/// resolve to exactly one mangled symbol ([`resolve_symbols`]). A table entry
/// with no kernel behind it fails at module load on a GPU; this finds it on
/// any machine.
pub fn names_missing_from_fatbin<'a>(fatbin: &[u8], names: &[&'a str]) -> Vec<&'a str> {
    let mangled = MangledSymbols::scan(fatbin);
    names
        .iter()
        .copied()
        .filter(|name| match mangled_prefix(name) {
            Some(prefix) => mangled.starting_with(&prefix).len() != 1,
            None => !has_c_symbol(fatbin, name),
        })
        .collect()
}

/// Whether `fatbin` holds `name` as a NUL-terminated string after a NUL (a C
/// symbol in an ELF string table).
fn has_c_symbol(fatbin: &[u8], name: &str) -> bool {
    let n = name.as_bytes();
    fatbin
        .windows(n.len() + 2)
        .any(|w| w[0] == 0 && w[n.len() + 1] == 0 && &w[1..=n.len()] == n)
}

/// The Itanium-mangled prefix of a C++ qualified function name, up to its
/// parameter types: `moelink::ll::dispatch` gives `_ZN7moelink2ll8dispatchE`.
/// `None` for a name without `::` (an `extern "C"` name) or with a component
/// that is not a plain identifier (templates and operators are not supported).
pub fn mangled_prefix(qualified: &str) -> Option<String> {
    if !qualified.contains("::") {
        return None;
    }
    let mut out = String::from("_ZN");
    for part in qualified.split("::") {
        let ident = part
            .bytes()
            .enumerate()
            .all(|(i, b)| b == b'_' || b.is_ascii_alphabetic() || (i > 0 && b.is_ascii_digit()));
        if part.is_empty() || !ident {
            return None;
        }
        out.push_str(&format!("{}{part}", part.len()));
    }
    out.push('E');
    Some(out)
}

/// Every distinct `_ZN...` symbol of a fatbin's ELF string tables: a string of
/// symbol characters after a NUL or a `.` (section names such as
/// `.text.<symbol>` share a string table with symbols) and up to a NUL.
struct MangledSymbols(std::collections::BTreeSet<String>);

impl MangledSymbols {
    fn scan(fatbin: &[u8]) -> Self {
        let mut set = std::collections::BTreeSet::new();
        let symbol_byte = |b: u8| b == b'_' || b == b'$' || b.is_ascii_alphanumeric();
        let mut i = 1;
        while i + 3 <= fatbin.len() {
            if &fatbin[i..i + 3] == b"_ZN" && matches!(fatbin[i - 1], 0 | b'.') {
                let len = fatbin[i..].iter().position(|&b| b == 0);
                if let Some(len) = len {
                    let s = &fatbin[i..i + len];
                    if s.iter().all(|&b| symbol_byte(b)) {
                        set.insert(String::from_utf8_lossy(s).into_owned());
                    }
                    i += len;
                    continue;
                }
            }
            i += 1;
        }
        Self(set)
    }

    fn starting_with(&self, prefix: &str) -> Vec<&str> {
        self.0
            .range(prefix.to_string()..)
            .take_while(|s| s.starts_with(prefix))
            .map(String::as_str)
            .collect()
    }
}

/// The symbol `cuModuleGetFunction` gets for each of `names`: a C name as it
/// is; a qualified name ([`mangled_prefix`]) as the one symbol of `fatbin`
/// that starts with its mangled prefix. An error names the kernel when none
/// or several match.
pub fn resolve_symbols(fatbin: &[u8], names: &[&str]) -> std::result::Result<Vec<String>, String> {
    let mut mangled = None;
    names
        .iter()
        .map(|name| {
            let Some(prefix) = mangled_prefix(name) else {
                if name.contains("::") {
                    return Err(format!(
                        "kernel `{name}`: not a plain qualified name (identifiers joined by ::)"
                    ));
                }
                return Ok(name.to_string());
            };
            let symbols = mangled.get_or_insert_with(|| MangledSymbols::scan(fatbin));
            match symbols.starting_with(&prefix).as_slice() {
                [one] => Ok(one.to_string()),
                [] => Err(format!(
                    "kernel `{name}`: no symbol starting with {prefix} in the fatbin"
                )),
                several => Err(format!(
                    "kernel `{name}`: {} symbols start with {prefix} in the fatbin ({}); \
                     overloads of a kernel are not supported",
                    several.len(),
                    several.join(", ")
                )),
            }
        })
        .collect()
}

/// `MOELINK_TRAP_ON_TIMEOUT=1`: a device wait that runs out traps its kernel
/// (the context is lost, as with DeepEP's timeout) after recording what it
/// waited for, for users who prefer a crash to an error on the next call.
pub fn trap_on_timeout() -> bool {
    crate::env::var("MOELINK_TRAP_ON_TIMEOUT").is_some_and(|v| v == "1")
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
    /// The symbols of `names` in this fatbin, resolved once per process.
    symbols: OnceLock<std::result::Result<Vec<CString>, String>>,
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
            symbols: OnceLock::new(),
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

    /// The symbols of the kernel names (resolved on first use; an error names
    /// the kernel that has none, or several, in the fatbin).
    pub fn symbols(&self) -> Result<&[CString]> {
        let resolved = self.symbols.get_or_init(|| {
            resolve_symbols(self.fatbin, self.names).map(|symbols| {
                symbols
                    .into_iter()
                    .map(|s| CString::new(s).expect("symbols have no NUL"))
                    .collect()
            })
        });
        match resolved {
            Ok(symbols) => Ok(symbols),
            Err(e) => {
                tracing::error!("the {} fatbin: {e}", self.label);
                Err(CommError::invalid(
                    "kernel",
                    format!("the {} fatbin: {e}", self.label),
                ))
            }
        }
    }

    fn load(&self, device: Device) -> Result<LoadedModule> {
        let symbols = self.symbols()?;
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
        for (name, symbol) in self.names.iter().zip(symbols) {
            // SAFETY: module was just loaded and is never unloaded.
            let f = unsafe { result::module::get_function(module, symbol.clone()) }
                .call("cuModuleGetFunction")
                .inspect_err(|_| {
                    tracing::error!("kernel {name} ({symbol:?}) of the {} fatbin", self.label)
                })?;
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
        tracing::debug!("loaded {} kernels on device {}", self.label, device.ordinal);
        Ok(LoadedModule {
            device,
            _module: module,
            functions,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qualified_names_mangle_to_their_itanium_prefix() {
        assert_eq!(
            mangled_prefix("moelink::ll::dispatch").as_deref(),
            Some("_ZN7moelink2ll8dispatchE")
        );
        assert_eq!(
            mangled_prefix("moelink::internode::cached_notify").as_deref(),
            Some("_ZN7moelink9internode13cached_notifyE")
        );
        assert_eq!(mangled_prefix("comm_copy"), None);
        assert_eq!(mangled_prefix("moelink::"), None);
        assert_eq!(mangled_prefix("a::f<int>"), None);
        assert_eq!(mangled_prefix("a::9f"), None);
    }

    /// A string table as nvcc lays it out: symbols after NULs, section names
    /// (`.text.<symbol>`) holding the same symbols after a `.`.
    const STRTAB: &[u8] = b"\0.text._ZN7moelink2ll8dispatchENS0_16LlDispatchParamsE\0\
        _ZN7moelink2ll8dispatchENS0_16LlDispatchParamsE\0\
        _ZN7moelink2ll7combineENS0_15LlCombineParamsE\0\
        _ZN7moelink9intranode8dispatchENS0_19DispatchFusedParamsE\0\
        _ZN7moelink9intranode13dispatch_sendENS0_18DispatchSendParamsE\0\
        _ZN7moelink1x1fEi\0_ZN7moelink1x1fEl\0\
        _ZZN7moelink2ll7barrierEvE7blocked\0comm_copy\0";

    #[test]
    fn qualified_names_resolve_to_their_one_symbol() {
        let names = [
            "moelink::ll::dispatch",
            "moelink::intranode::dispatch",
            "moelink::intranode::dispatch_send",
            "comm_copy",
        ];
        let got = resolve_symbols(STRTAB, &names).unwrap();
        assert_eq!(
            got,
            [
                "_ZN7moelink2ll8dispatchENS0_16LlDispatchParamsE",
                "_ZN7moelink9intranode8dispatchENS0_19DispatchFusedParamsE",
                "_ZN7moelink9intranode13dispatch_sendENS0_18DispatchSendParamsE",
                "comm_copy",
            ]
        );
        assert!(names_missing_from_fatbin(STRTAB, &names).is_empty());
    }

    #[test]
    fn missing_and_ambiguous_names_are_errors_naming_the_kernel() {
        let e = resolve_symbols(STRTAB, &["moelink::ll::notify"]).unwrap_err();
        assert!(
            e.contains("moelink::ll::notify") && e.contains("no symbol"),
            "{e}"
        );
        let e = resolve_symbols(STRTAB, &["moelink::x::f"]).unwrap_err();
        assert!(
            e.contains("moelink::x::f") && e.contains("2 symbols"),
            "{e}"
        );
        // A static local of a kernel (`_ZZ...`) is no kernel.
        assert!(resolve_symbols(STRTAB, &["moelink::ll::barrier"]).is_err());
        assert!(resolve_symbols(STRTAB, &["moelink::ll::f<int>"]).is_err());
        assert_eq!(
            names_missing_from_fatbin(
                STRTAB,
                &["moelink::ll::combine", "moelink::x::f", "comm_absent"]
            ),
            ["moelink::x::f", "comm_absent"]
        );
    }
}
