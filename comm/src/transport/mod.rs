//! Transports and connections: how one rank's proxy (or host code) moves data
//! into, signals, and atomically updates a peer's registered memory.
//!
//! | transport | module | reach | how |
//! |---|---|---|---|
//! | CUDA IPC | [`cuda_ipc`] | GPUs of one host | copies, value writes and atomic kernels on a proxy-owned stream, into the peer's memory mapped here |
//! | Ethernet | [`ethernet`] | any two processes | TCP to the peer's receiver thread, which applies writes / signals / atomics to its memory (host or GPU) |
//! | IB verbs | [`ib`] | across hosts (libibverbs loaded at run time) | RDMA write, fetch-and-add, write-with-immediate on RC queue pairs; records applied by the receiver's IB receiving proxy ([`inbound`]) |

pub mod cuda_ipc;
pub mod ethernet;
pub mod ib;
pub mod inbound;

use std::time::Duration;

use crate::error::Result;
use crate::registered_memory::RegisteredMemory;

/// The kind of a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transport {
    CudaIpc,
    Ethernet,
    /// The IB verbs transport ([`ib`]): a Communicator builds it for peers
    /// on other nodes where every rank has a usable RDMA device (else the
    /// error says why).
    IbVerbs,
}

/// Width of a remote atomic add. A 64-bit add never lands on a 32-bit counter:
/// the width travels with the operation and both sides check alignment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AtomicWidth {
    U32,
    U64,
}

impl AtomicWidth {
    pub fn bytes(self) -> u64 {
        match self {
            AtomicWidth::U32 => 4,
            AtomicWidth::U64 => 8,
        }
    }
}

/// One [`Connection::write`] whose ranges are checked: `size` bytes from local
/// `src` at `src_offset` into the peer's `dst` at `dst_offset`.
#[derive(Clone, Copy, Debug)]
pub struct Put<'a> {
    pub dst: &'a RegisteredMemory,
    pub dst_offset: u64,
    pub src: &'a RegisteredMemory,
    pub src_offset: u64,
    pub size: u64,
}

/// One [`Connection::atomic_add`] whose word is checked: `value` added to the
/// integer of width `width` at the peer's `dst` + `dst_offset`.
#[derive(Clone, Copy, Debug)]
pub struct AtomicAdd<'a> {
    pub dst: &'a RegisteredMemory,
    pub dst_offset: u64,
    pub value: i64,
    pub width: AtomicWidth,
}

/// A one-directional link from this rank to `remote_rank()`. Operations are
/// applied at the peer in the order they were issued on one connection; none
/// waits for completion except `flush`.
pub trait Connection: Send + Sync + std::fmt::Debug {
    fn transport(&self) -> Transport;
    fn remote_rank(&self) -> usize;

    /// Copies `size` bytes from local `src` at `src_offset` into the peer's
    /// `dst` at `dst_offset`: both ranges checked against their
    /// registrations, then the transport's [`put`](Self::put).
    fn write(
        &self,
        dst: &RegisteredMemory,
        dst_offset: u64,
        src: &RegisteredMemory,
        src_offset: u64,
        size: u64,
    ) -> Result<()> {
        dst.check_range(dst_offset, size, "write destination")?;
        src.check_range(src_offset, size, "write source")?;
        self.put(Put {
            dst,
            dst_offset,
            src,
            src_offset,
            size,
        })
    }

    /// The transport's half of [`write`](Self::write), its ranges checked
    /// (`size` may be 0: the transport still checks that it can reach `dst`).
    fn put(&self, p: Put<'_>) -> Result<()>;

    /// Sets the u64 at the peer's `dst` + `dst_offset` to `value`, after every
    /// earlier write of this connection has landed (a semaphore signal): the
    /// word checked (in range, 8-byte aligned), then the transport's
    /// [`set`](Self::set).
    fn update_and_sync(&self, dst: &RegisteredMemory, dst_offset: u64, value: u64) -> Result<()> {
        check_word_target(dst, dst_offset, 8, "signal destination")?;
        self.set(dst, dst_offset, value)
    }

    /// The transport's half of [`update_and_sync`](Self::update_and_sync),
    /// its word checked.
    fn set(&self, dst: &RegisteredMemory, dst_offset: u64, value: u64) -> Result<()>;

    /// Atomically adds `value` to the integer of width `width` at the peer's
    /// `dst` + `dst_offset` (on the target, not as a read-modify-write copy):
    /// the word checked (in range, aligned to its width), then the
    /// transport's [`add`](Self::add).
    fn atomic_add(
        &self,
        dst: &RegisteredMemory,
        dst_offset: u64,
        value: i64,
        width: AtomicWidth,
    ) -> Result<()> {
        check_word_target(dst, dst_offset, width.bytes(), "atomic_add offset")?;
        self.add(AtomicAdd {
            dst,
            dst_offset,
            value,
            width,
        })
    }

    /// The transport's half of [`atomic_add`](Self::atomic_add), its word
    /// checked.
    fn add(&self, a: AtomicAdd<'_>) -> Result<()>;

    /// Waits, at most `timeout`, until every earlier operation has completed at
    /// the peer.
    fn flush(&self, timeout: Duration) -> Result<()>;

    /// Whether operations issued so far are still in flight (None: the
    /// transport cannot tell). Diagnostics only: never waits.
    fn busy(&self) -> Option<bool> {
        None
    }

    /// What the proxy calls while operations of this connection are in
    /// flight: drives completions, and returns (once) an error found in the
    /// background, e.g. a failed RDMA completion; else what `busy` says.
    fn progress(&self) -> Result<Option<bool>> {
        Ok(self.busy())
    }
}

/// Validates the target word of a signal or atomic (`what`): `bytes` long,
/// in range and aligned to `bytes` in its owner's memory.
fn check_word_target(
    dst: &RegisteredMemory,
    dst_offset: u64,
    bytes: u64,
    what: &'static str,
) -> Result<()> {
    dst.check_range(dst_offset, bytes, what)?;
    if (dst.info().owner_ptr + dst_offset) % bytes != 0 {
        return Err(crate::error::CommError::invalid(
            what,
            format!("offset {dst_offset} is not aligned to {bytes} bytes"),
        ));
    }
    Ok(())
}

/// What `MOELINK_TRANSPORT` asks for peers on other nodes (hosts, or the
/// emulated nodes of one host under `MOELINK_RANKS_PER_NODE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrossNode {
    /// IB verbs where a usable RDMA device exists, else CUDA IPC through the
    /// proxy for a node on this host, else Ethernet (one log line).
    Auto,
    /// IB verbs; no usable device is an error.
    Ib,
    /// Ethernet (TCP), even where an RDMA device exists or the node is on
    /// this host.
    Ethernet,
    /// CUDA IPC through the proxy: emulated nodes of one host only.
    CudaIpc,
}

/// The environment variable that forces the cross-node transport.
pub const TRANSPORT_ENV: &str = "MOELINK_TRANSPORT";

impl CrossNode {
    /// `MOELINK_TRANSPORT`: `auto` (or unset / empty), `ib`, `ethernet`,
    /// `cuda_ipc` (case-insensitive); anything else is refused naming the
    /// variable.
    pub fn from_env() -> Result<Self> {
        Self::parse(&crate::env::var(TRANSPORT_ENV).unwrap_or_default())
    }

    pub fn parse(text: &str) -> Result<Self> {
        match text.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(Self::Auto),
            "ib" => Ok(Self::Ib),
            "ethernet" => Ok(Self::Ethernet),
            "cuda_ipc" => Ok(Self::CudaIpc),
            other => Err(crate::error::CommError::invalid(
                TRANSPORT_ENV,
                format!("{other:?}: expected auto, ib, ethernet or cuda_ipc"),
            )),
        }
    }

    /// Whether peers on other nodes go through IB verbs. `cross_node`: some
    /// peer is on another node (else nothing is probed and the answer is no);
    /// `probe` lists the usable RDMA devices (`NoRdma` where there are none).
    /// `Auto` without a device falls back to Ethernet with one logged line;
    /// `Ib` without one fails with the probe's error, naming the variable.
    pub fn uses_ib(
        self,
        rank: usize,
        cross_node: bool,
        probe: impl FnOnce() -> Result<Vec<String>>,
    ) -> Result<bool> {
        if !cross_node || matches!(self, Self::Ethernet | Self::CudaIpc) {
            return Ok(false);
        }
        match (self, probe()) {
            (_, Ok(devices)) if !devices.is_empty() => Ok(true),
            (Self::Ib, Ok(_)) => Err(crate::error::CommError::NoRdma {
                reason: format!("{TRANSPORT_ENV}=ib, but no RDMA device is usable"),
            }),
            (Self::Ib, Err(e)) => Err(crate::error::CommError::NoRdma {
                reason: format!("{TRANSPORT_ENV}=ib: {e}"),
            }),
            (_, Ok(_)) => {
                tracing::info!(
                    "rank {rank}: no usable RDMA device; peers on other nodes use Ethernet"
                );
                Ok(false)
            }
            (_, Err(e)) => {
                tracing::info!("rank {rank}: {e}; peers on other nodes use Ethernet");
                Ok(false)
            }
        }
    }
}

/// The usable RDMA devices under the `MOELINK_IB_*` settings (`NoRdma` where
/// libibverbs or a device is missing).
pub fn usable_rdma_devices() -> Result<Vec<String>> {
    let config = ib::config::IbConfig::from_env()?;
    let verbs = ib::native::shared_verbs()?;
    ib::verbs::usable_devices(&*verbs, &config.hca)
}

#[cfg(test)]
mod cross_node_tests {
    use super::*;
    use crate::error::CommError;

    fn no_device() -> Result<Vec<String>> {
        Err(CommError::NoRdma {
            reason: "libibverbs finds no RDMA device on this machine".into(),
        })
    }

    #[test]
    fn the_variable_is_parsed_and_checked() {
        assert_eq!(CrossNode::parse("").unwrap(), CrossNode::Auto);
        assert_eq!(CrossNode::parse(" Auto ").unwrap(), CrossNode::Auto);
        assert_eq!(CrossNode::parse("IB").unwrap(), CrossNode::Ib);
        assert_eq!(CrossNode::parse("ethernet").unwrap(), CrossNode::Ethernet);
        assert_eq!(CrossNode::parse("CUDA_IPC").unwrap(), CrossNode::CudaIpc);
        let e = CrossNode::parse("rdma").unwrap_err().to_string();
        assert!(
            e.contains("MOELINK_TRANSPORT") && e.contains("\"rdma\""),
            "{e}"
        );
    }

    #[test]
    fn auto_uses_ib_only_with_a_device_and_only_across_nodes() {
        let dev = || Ok(vec!["mlx5_0".to_string()]);
        assert!(CrossNode::Auto.uses_ib(0, true, dev).unwrap());
        assert!(!CrossNode::Auto.uses_ib(0, true, no_device).unwrap());
        assert!(!CrossNode::Auto.uses_ib(0, true, || Ok(vec![])).unwrap());
        // One node: nothing is probed.
        let probe = || -> Result<Vec<String>> { panic!("probed") };
        assert!(!CrossNode::Auto.uses_ib(0, false, probe).unwrap());
        assert!(!CrossNode::Ib.uses_ib(0, false, probe).unwrap());
        assert!(!CrossNode::Ethernet.uses_ib(0, true, probe).unwrap());
        assert!(!CrossNode::CudaIpc.uses_ib(0, true, probe).unwrap());
    }

    #[test]
    fn forcing_ib_without_a_device_fails_naming_the_variable() {
        assert!(CrossNode::Ib
            .uses_ib(0, true, || Ok(vec!["mlx5_1".into()]))
            .unwrap());
        for e in [
            CrossNode::Ib.uses_ib(0, true, no_device).unwrap_err(),
            CrossNode::Ib.uses_ib(0, true, || Ok(vec![])).unwrap_err(),
        ] {
            let text = e.to_string();
            assert!(matches!(e, CommError::NoRdma { .. }), "{e:?}");
            assert!(text.contains("MOELINK_TRANSPORT=ib"), "{text}");
        }
    }
}
