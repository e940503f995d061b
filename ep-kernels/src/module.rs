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
    /// Every kernel entry point of the fatbin, by its C++ qualified name (what
    /// profilers show; docs/api-notes.md, "Profiler names"). A dispatch's
    /// kernels carry `::dispatch` in their name, a combine's `::combine`; no
    /// other kernel has either word.
    pub enum KernelId {
        DiagnosticsWritePeers => "moelink::diagnostics::write_peers",
        ReduceRowsBf16 => "moelink::reduce_rows_bf16",
        LayoutCountTokens => "moelink::layout::count_tokens",
        IntranodeNotify => "moelink::intranode::notify",
        IntranodeBarrier => "moelink::intranode::barrier",
        PublishBarrier => "moelink::intranode::publish_barrier",
        IntranodeWaitPeers => "moelink::intranode::wait_peers",
        DispatchSend => "moelink::intranode::dispatch_send",
        DispatchRecv => "moelink::intranode::dispatch_recv",
        DispatchSendPacked => "moelink::intranode::dispatch_send_packed",
        FinishRows => "moelink::intranode::finish_rows",
        CombineSend => "moelink::intranode::combine_send",
        CombineRecv => "moelink::intranode::combine_recv",
        IntranodeDispatch => "moelink::intranode::dispatch",
        IntranodeCombine => "moelink::intranode::combine",
        CombineDirect => "moelink::intranode::combine_direct",
        CombineDirectWide => "moelink::intranode::combine_direct_wide",
        LlDispatch => "moelink::ll::dispatch",
        LlCombine => "moelink::ll::combine",
        InternodeNotify => "moelink::internode::notify",
        InternodeCachedNotify => "moelink::internode::cached_notify",
        InternodeDispatch => "moelink::internode::dispatch",
        InternodeCombine => "moelink::internode::combine",
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
    /// Every name of the kernel table resolves to exactly one symbol of the
    /// fatbin (what the loader hands to cuModuleGetFunction).
    #[test]
    fn every_kernel_of_the_table_is_in_the_fatbin() {
        let missing =
            comm::module::names_missing_from_fatbin(super::FATBIN, super::KernelId::NAMES);
        assert!(missing.is_empty(), "not in the fatbin: {missing:?}");
        let symbols = comm::module::resolve_symbols(super::FATBIN, super::KernelId::NAMES)
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(symbols.len(), super::KernelId::NAMES.len());
        let unique: std::collections::HashSet<_> = symbols.iter().collect();
        assert_eq!(unique.len(), symbols.len(), "{symbols:?}");
        assert_eq!(super::KernelId::ALL.len(), super::KernelId::NAMES.len());
        assert_eq!(super::KernelId::LlCombine.name(), "moelink::ll::combine");
        assert!(symbols[super::KernelId::LlCombine.index()].starts_with("_ZN7moelink2ll7combineE"));
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

/// The names a profiler shows are what DeepEP's `bench_kineto` times by
/// (docs/api-notes.md, "Profiler names").
#[cfg(test)]
mod profiler_name_tests {
    use super::KernelId::{self, *};

    /// Which call's work a kernel does.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Side {
        Dispatch,
        Combine,
        /// Notify, barriers, waits, layout, diagnostics.
        Other,
    }

    fn side(k: KernelId) -> Side {
        match k {
            DispatchSend | DispatchRecv | DispatchSendPacked | IntranodeDispatch | LlDispatch
            | InternodeDispatch => Side::Dispatch,
            CombineSend | CombineRecv | IntranodeCombine | CombineDirect | CombineDirectWide
            | LlCombine | InternodeCombine => Side::Combine,
            DiagnosticsWritePeers
            | ReduceRowsBf16
            | LayoutCountTokens
            | IntranodeNotify
            | IntranodeBarrier
            | PublishBarrier
            | IntranodeWaitPeers
            | FinishRows
            | InternodeNotify
            | InternodeCachedNotify => Side::Other,
        }
    }

    /// What the profiler shows of a kernel: its qualified name, then its
    /// parameter types (demangled from the symbol; checked here on the
    /// mangled tail, which holds the type names as written).
    fn parameter_tail(k: KernelId) -> String {
        let symbols = comm::module::resolve_symbols(super::FATBIN, &[k.name()]).unwrap();
        let prefix = comm::module::mangled_prefix(k.name()).unwrap();
        symbols[0][prefix.len()..].to_string()
    }

    #[test]
    fn names_say_which_side_of_a_call_a_kernel_is() {
        for &k in KernelId::ALL {
            let name = k.name();
            assert!(
                name.starts_with("moelink::"),
                "{name}: not in namespace moelink"
            );
            let (d, c) = (name.contains("dispatch"), name.contains("combine"));
            match side(k) {
                Side::Dispatch => assert!(
                    name.contains("::dispatch") && !c,
                    "{name}: a dispatch kernel names ::dispatch and not combine"
                ),
                Side::Combine => assert!(
                    name.contains("::combine") && !d,
                    "{name}: a combine kernel names ::combine and not dispatch"
                ),
                Side::Other => assert!(
                    !d && !c,
                    "{name}: notify, layout, barrier and wait kernels name neither \
                     dispatch nor combine"
                ),
            }
            // The parameter types (shown after the name) add none of the words
            // the profiler table is searched for.
            let tail = parameter_tail(k);
            for word in ["dispatch", "combine", "notify"] {
                assert!(
                    !tail.contains(word),
                    "{name}: parameter types {tail} contain {word}"
                );
            }
        }
    }

    /// The kernels of one API call (ep_core's launch sequences; both fused
    /// halves of a normal intranode dispatch and both launches of an
    /// internode dispatch are the same kernel).
    const CALLS: &[(&str, &[KernelId])] = &[
        ("get_dispatch_layout", &[LayoutCountTokens]),
        (
            "intranode dispatch",
            &[IntranodeNotify, IntranodeDispatch, IntranodeDispatch],
        ),
        (
            "intranode cached dispatch",
            &[IntranodeBarrier, IntranodeDispatch],
        ),
        ("intranode combine", &[IntranodeBarrier, IntranodeCombine]),
        (
            "intranode dispatch on one SM, separate kernels",
            &[
                IntranodeNotify,
                DispatchSend,
                IntranodeWaitPeers,
                DispatchRecv,
            ],
        ),
        (
            "intranode dispatch, packed",
            &[
                IntranodeNotify,
                DispatchSendPacked,
                IntranodeWaitPeers,
                FinishRows,
            ],
        ),
        (
            "intranode cached dispatch, packed",
            &[
                IntranodeBarrier,
                DispatchSendPacked,
                IntranodeWaitPeers,
                FinishRows,
            ],
        ),
        (
            "intranode dispatch, direct",
            &[
                IntranodeNotify,
                DispatchSendPacked,
                IntranodeWaitPeers,
                FinishRows,
            ],
        ),
        (
            "intranode cached dispatch, direct",
            &[
                PublishBarrier,
                DispatchSendPacked,
                IntranodeWaitPeers,
                FinishRows,
            ],
        ),
        (
            "intranode combine on one SM, separate kernels",
            &[
                IntranodeBarrier,
                CombineSend,
                IntranodeWaitPeers,
                CombineRecv,
            ],
        ),
        (
            "intranode combine, direct",
            &[PublishBarrier, CombineDirect],
        ),
        (
            "intranode combine, direct, on one SM (a send-only launch first)",
            &[PublishBarrier, CombineDirect, CombineDirect],
        ),
        ("low-latency dispatch", &[LlDispatch]),
        (
            "low-latency dispatch, send and receive phases",
            &[LlDispatch, LlDispatch],
        ),
        ("low-latency combine", &[LlCombine]),
        (
            "low-latency combine, send and receive phases",
            &[LlCombine, LlCombine],
        ),
        (
            "internode dispatch",
            &[InternodeNotify, InternodeDispatch, InternodeDispatch],
        ),
        (
            "internode cached dispatch",
            &[InternodeCachedNotify, InternodeDispatch, InternodeDispatch],
        ),
        (
            "internode combine",
            &[InternodeCachedNotify, InternodeCombine],
        ),
    ];

    fn distinct_with(kernels: &[KernelId], word: &str) -> usize {
        let names: std::collections::BTreeSet<_> = kernels
            .iter()
            .map(|k| k.name())
            .filter(|n| n.contains(word))
            .collect();
        names.len()
    }

    /// DeepEP's bench_kineto finds exactly one profiler row per word it is
    /// given: a dispatch call (the default, fused kernels) has one kernel
    /// name with "dispatch" and none with "combine", a combine call the
    /// reverse, and an internode cached dispatch and combine one with
    /// "notify" (DeepEP's cached_notify).
    #[test]
    fn each_call_has_one_kernel_name_per_word() {
        for (call, kernels) in CALLS {
            let (d, c) = (
                distinct_with(kernels, "dispatch"),
                distinct_with(kernels, "combine"),
            );
            let separate = call.ends_with("separate kernels");
            if call.contains("dispatch") && !call.contains("layout") {
                assert_eq!(c, 0, "{call}");
                // The separate send / receive kernels (a call on one SM,
                // where the fused kernel cannot run) are two names.
                assert_eq!(d, if separate { 2 } else { 1 }, "{call}");
            } else if call.contains("combine") {
                assert_eq!(d, 0, "{call}");
                assert_eq!(c, if separate { 2 } else { 1 }, "{call}");
            } else {
                assert_eq!((d, c), (0, 0), "{call}");
            }
            let notify = distinct_with(kernels, "notify");
            if call.starts_with("internode") || *call == "intranode dispatch" {
                assert_eq!(notify, 1, "{call}");
            }
            // bench_kineto's hook mode takes the trace events with
            // `::dispatch` / `::combine`: the kernels of the call, none else.
            for (word, n) in [("::dispatch", d), ("::combine", c)] {
                let events = kernels.iter().filter(|k| k.name().contains(word)).count();
                assert!(n == 0 || events >= 1, "{call}: {word}");
            }
        }
    }
}
