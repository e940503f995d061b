//! The library's environment switches (`MOELINK_*`): one registry, read in one
//! place.
//!
//! [`SWITCHES`] lists every `MOELINK_*` variable the library understands (run
//! time, and the build-time ones its build scripts read), with its kind,
//! default and meaning; docs/environment.md is its table and
//! tests/test_env_registry.py checks that the two agree. Every run-time read of
//! a `MOELINK_*` variable goes through [`var`] (or [`var_result`] /
//! [`is_set`] where a site tells a non-UTF-8 value apart); each site keeps its
//! own parsing (trimming, empty values, ranges). Reading a name that is not
//! registered panics in debug builds, so tests catch a switch added without an
//! entry. The Python package reads through `moelink._env`, which checks names
//! against this list (`_native.env_switches()`).

use std::env::VarError;

/// Who a switch is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A user may set it in production (timeouts, transports, placement).
    User,
    /// A debugging or profiling aid.
    Diagnostic,
}

impl Kind {
    /// The kind's name in docs/environment.md and `_native.env_switches()`.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::User => "user",
            Kind::Diagnostic => "diagnostic",
        }
    }
}

/// One environment switch.
#[derive(Clone, Copy, Debug)]
pub struct Switch {
    pub name: &'static str,
    pub kind: Kind,
    /// What applies where the variable is unset.
    pub default: &'static str,
    pub meaning: &'static str,
}

const fn s(name: &'static str, kind: Kind, default: &'static str, meaning: &'static str) -> Switch {
    Switch {
        name,
        kind,
        default,
        meaning,
    }
}

use Kind::{Diagnostic, User};

/// Every `MOELINK_*` switch, sorted by name (a unit test checks it).
pub static SWITCHES: &[Switch] = &[
    s(
        "MOELINK_AR_TIMEOUT_S",
        User,
        "30",
        "Bound of every AllReduce device wait, seconds of GPU time (positive).",
    ),
    s(
        "MOELINK_AR_TUNE_FILE",
        User,
        "`~/.cache/moelink/allreduce-<gpu>-<R>gpu.json`",
        "AllReduce's tuned table (JSON) where set and not empty.",
    ),
    s(
        "MOELINK_BOOTSTRAP_PORT",
        User,
        "`MASTER_PORT + 1`",
        "TCP port of the environment bootstrap's root (at `MASTER_ADDR`).",
    ),
    s(
        "MOELINK_CHECK_IDS",
        Diagnostic,
        "0",
        "`1`: check `topk_idx` values and handles on the host before each call (read when \
         moelink is imported or the first check runs; `set_check_ids` changes it).",
    ),
    s(
        "MOELINK_CUDA_ARCHS",
        User,
        "`90a`",
        "Build time: comma list of GPU targets the CUDA kernels are compiled for.",
    ),
    s(
        "MOELINK_DEVICE_TIMEOUT_S",
        User,
        "30",
        "Bound of every intranode device wait, seconds of GPU time (positive).",
    ),
    s(
        "MOELINK_DIST_BACKEND",
        User,
        "unset: gloo where ranks outnumber GPUs or there is none, else nccl",
        "`moelink.launch.init_distributed`'s torch.distributed backend, `gloo` or `nccl`.",
    ),
    s(
        "MOELINK_ETHERNET_ADDR",
        User,
        "unset: `127.0.0.1:0` under `MOELINK_TRANSPORT=ethernet` (one host), else none",
        "`host:port` (port 0: any) where this rank's Ethernet receiver listens; an address \
         the other hosts reach.",
    ),
    s(
        "MOELINK_IB_GID_INDEX",
        User,
        "0",
        "GID table index, 0 to 255 (RoCE v2 needs the right one; InfiniBand: unused).",
    ),
    s(
        "MOELINK_IB_HCA",
        User,
        "unset: every HCA",
        "Which HCAs (and ports) to use, NCCL_IB_HCA's syntax: a comma list of `name[:port]` \
         prefixes; `=` before it: exact names; `^`: every HCA but these.",
    ),
    s(
        "MOELINK_IB_MODE",
        User,
        "`host`",
        "`host` (signals and counter adds as RDMA atomics) or `host-no-atomic` \
         (write-with-immediate, applied by the receiving proxy).",
    ),
    s(
        "MOELINK_IB_MTU",
        User,
        "the smaller active MTU of both ports",
        "Path MTU in bytes: 256, 512, 1024, 2048 or 4096.",
    ),
    s(
        "MOELINK_IB_QPS_PER_RANK",
        User,
        "1",
        "Queue pairs per peer, 1 to 16 (every rank must agree).",
    ),
    s("MOELINK_IB_SL", User, "0", "IB service level, 0 to 15."),
    s(
        "MOELINK_IB_TC",
        User,
        "0",
        "Traffic class (RoCE v2), 0 to 255.",
    ),
    s(
        "MOELINK_INTRANODE_PROFILE",
        Diagnostic,
        "0",
        "`1` at Buffer creation: the fused intranode kernels record phase stamps.",
    ),
    s(
        "MOELINK_INTRANODE_RECV",
        User,
        "kernels",
        "At Buffer creation: how an intranode dispatch receives. `packed`: every SM of the call \
         sends, straight to the received rows, and one device copy per output receives (faster \
         on an otherwise idle GPU at up to 16 SMs; the copy takes the whole GPU for about 100 us \
         after the sends). `direct`: packed, with `recv_x` allocated from a receive pool that \
         every peer maps, so the senders write the rows into `recv_x` itself and only the small \
         outputs are copied (a `recv_x` outside the pool, e.g. under CUDA graph capture, is \
         received as in `packed`); and a combine whose `x` lies in the pool (such as `recv_x` \
         itself, overwritten in place by the experts) is read by the peers where it lies, \
         instead of being sent.",
    ),
    s(
        "MOELINK_INTRANODE_RECV_POOL_BYTES",
        User,
        "the NVL buffer's size",
        "At Buffer creation with `MOELINK_INTRANODE_RECV=direct`: bytes of each rank's receive \
         pool. Every `recv_x` alive at once must fit; one that does not is allocated as usual \
         and received by a copy.",
    ),
    s(
        "MOELINK_IPC_CONTEXT",
        Diagnostic,
        "unset: the proxy's own context",
        "`primary`: proxies issue their GPU work (CUDA IPC puts, Ethernet copies) in the \
         primary context, which reproduces the internode stall that their own context \
         avoids (docs/design-internode.md).",
    ),
    s(
        "MOELINK_LAUNCH_GPUS",
        User,
        "set by the launcher",
        "Set by `python -m moelink.launch` for its ranks: the GPUs it found.",
    ),
    s(
        "MOELINK_LAUNCH_GPUS_OVERRIDE",
        Diagnostic,
        "unset: ask the driver",
        "For tests: the launcher plans for this many GPUs.",
    ),
    s(
        "MOELINK_LAUNCH_MPS",
        User,
        "set by the launcher",
        "Set by `python -m moelink.launch` for its ranks: `1` where the rank runs under MPS, \
         else `0`.",
    ),
    s(
        "MOELINK_LL_PROFILE",
        Diagnostic,
        "0",
        "`1` at Buffer creation: the low-latency kernels record phase stamps.",
    ),
    s(
        "MOELINK_LL_TIMEOUT_S",
        User,
        "`MOELINK_DEVICE_TIMEOUT_S`'s bound",
        "Bound of every low-latency receive, seconds of GPU time (positive); a peer silent \
         longer is masked.",
    ),
    s(
        "MOELINK_LOG",
        Diagnostic,
        "`warn`",
        "The native library's log filter (tracing `EnvFilter` syntax), on stderr.",
    ),
    s(
        "MOELINK_MPS",
        User,
        "`auto`",
        "The launcher's MPS mode where `--mps` is not given: `auto`, `on` or `off`.",
    ),
    s(
        "MOELINK_MPS_PERCENTAGE",
        User,
        "`none`",
        "The launcher's MPS thread percentage where `--mps-percentage` is not given: \
         `none`, `auto` or 1 to 100.",
    ),
    s(
        "MOELINK_NVCC",
        User,
        "unset: `NVCC`, `CUDA_HOME` / `CUDA_PATH`, `PATH`",
        "Build time: path to the nvcc that compiles the CUDA kernels.",
    ),
    s(
        "MOELINK_NVCC_FLAGS",
        User,
        "none",
        "Build time: extra flags passed to nvcc.",
    ),
    s(
        "MOELINK_PROXY_THREADS",
        User,
        "1",
        "Proxy threads per internode Buffer, 1 to 32.",
    ),
    s(
        "MOELINK_RANKS_PER_NODE",
        User,
        "unset: each host is a node",
        "Split each host's ranks into emulated nodes of this many consecutive ranks (>= 1).",
    ),
    s(
        "MOELINK_REFERENCE_MAX_BYTES",
        User,
        "17179869184 (16 GiB)",
        "Bytes the outputs of one CPU reference call may take.",
    ),
    s(
        "MOELINK_REFERENCE_SEED",
        Diagnostic,
        "each test's base seed",
        "Base seed of ep-reference's random unit tests (to reproduce a failure).",
    ),
    s(
        "MOELINK_SMS_PER_RANK",
        User,
        "unset: no limit beyond MPS",
        "At most this many SMs per rank's grids (>= 1), below the context's (MPS) limit.",
    ),
    s(
        "MOELINK_TIMEOUT_S",
        User,
        "60",
        "Bound of host-side waits (bootstrap, dispatch counts, peer exchanges), seconds.",
    ),
    s(
        "MOELINK_TRANSPORT",
        User,
        "`auto`",
        "Transport to the ranks of other nodes: `auto` (IB verbs where every rank has a usable \
         RDMA device, else CUDA IPC through the proxy for an emulated node of this host, else \
         Ethernet), `ib`, `ethernet` (also between emulated nodes) or `cuda_ipc` (emulated \
         nodes of one host only).",
    ),
    s(
        "MOELINK_TRAP_ON_TIMEOUT",
        Diagnostic,
        "0",
        "`1`: a device wait that runs out traps its kernel (the CUDA context is lost) after \
         recording what it waited for.",
    ),
];

/// The registered switch `name`, if any.
pub fn switch(name: &str) -> Option<&'static Switch> {
    SWITCHES
        .binary_search_by(|s| s.name.cmp(name))
        .ok()
        .map(|i| &SWITCHES[i])
}

fn check(name: &str) {
    debug_assert!(
        switch(name).is_some(),
        "environment variable {name} is not registered in comm::env::SWITCHES"
    );
}

/// `std::env::var(name)` for a registered switch: the one place the library
/// reads `MOELINK_*` variables.
pub fn var_result(name: &str) -> Result<String, VarError> {
    check(name);
    std::env::var(name)
}

/// The value of switch `name` (None: unset, or not valid UTF-8). Panics in
/// debug builds where `name` is not in [`SWITCHES`].
pub fn var(name: &str) -> Option<String> {
    var_result(name).ok()
}

/// Whether switch `name` is set at all (valid UTF-8 or not).
pub fn is_set(name: &str) -> bool {
    check(name);
    std::env::var_os(name).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Spelled in two parts, so that the scan of tests/test_env_registry.py
    /// does not take it for a switch.
    const UNREGISTERED: &str = concat!("MOELINK_", "NOT_A_SWITCH");

    #[test]
    fn switches_are_sorted_unique_and_named_moelink() {
        for w in SWITCHES.windows(2) {
            assert!(w[0].name < w[1].name, "{} before {}", w[0].name, w[1].name);
        }
        for s in SWITCHES {
            assert!(s.name.starts_with("MOELINK_"), "{}", s.name);
            let rest = &s.name["MOELINK_".len()..];
            assert!(
                !rest.is_empty()
                    && rest
                        .bytes()
                        .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_'),
                "{}",
                s.name
            );
            assert!(!s.default.is_empty() && !s.meaning.is_empty(), "{}", s.name);
            assert!(
                !s.meaning.contains('|') && !s.default.contains('|'),
                "{}: `|` breaks the docs table",
                s.name
            );
        }
    }

    #[test]
    fn a_registered_switch_is_read() {
        assert!(switch("MOELINK_TIMEOUT_S").is_some());
        assert!(switch(UNREGISTERED).is_none());
        // A registered name nothing sets in the test process.
        assert_eq!(
            var("MOELINK_INTRANODE_PROFILE").is_some(),
            is_set("MOELINK_INTRANODE_PROFILE")
        );
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "not registered")]
    fn an_unregistered_read_panics_in_debug_builds() {
        let _ = var(UNREGISTERED);
    }
}
