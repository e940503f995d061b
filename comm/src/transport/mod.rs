//! Transports and connections: how one rank's proxy (or host code) moves data
//! into, signals, and atomically updates a peer's registered memory.
//!
//! | transport | module | reach | how |
//! |---|---|---|---|
//! | CUDA IPC | [`cuda_ipc`] | GPUs of one host | copies, value writes and atomic kernels on a proxy-owned stream, into the peer's memory mapped here |
//! | Ethernet | [`ethernet`] | any two processes | TCP to the peer's receiver thread, which applies writes / signals / atomics to its memory (host or GPU) |
//! | IB verbs | [`ib`] (in progress: configuration, run-time loading, discovery; no queue pairs yet) | across hosts | RDMA write, fetch-and-add, write-with-immediate |

pub mod cuda_ipc;
pub mod ethernet;
pub mod ib;

use std::time::Duration;

use crate::error::Result;
use crate::registered_memory::RegisteredMemory;

/// The kind of a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transport {
    CudaIpc,
    Ethernet,
    /// The IB verbs transport ([`ib`]); no connection of this kind can be
    /// built yet (the error says why: no RDMA device, or no queue pairs yet).
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

/// A one-directional link from this rank to `remote_rank()`. Operations are
/// applied at the peer in the order they were issued on one connection; none
/// waits for completion except `flush`.
pub trait Connection: Send + Sync + std::fmt::Debug {
    fn transport(&self) -> Transport;
    fn remote_rank(&self) -> usize;

    /// Copies `size` bytes from local `src` at `src_offset` into the peer's
    /// `dst` at `dst_offset`.
    fn write(
        &self,
        dst: &RegisteredMemory,
        dst_offset: u64,
        src: &RegisteredMemory,
        src_offset: u64,
        size: u64,
    ) -> Result<()>;

    /// Sets the u64 at the peer's `dst` + `dst_offset` to `value`, after every
    /// earlier write of this connection has landed (a semaphore signal).
    fn update_and_sync(&self, dst: &RegisteredMemory, dst_offset: u64, value: u64) -> Result<()>;

    /// Atomically adds `value` to the integer of width `width` at the peer's
    /// `dst` + `dst_offset` (on the target, not as a read-modify-write copy).
    fn atomic_add(
        &self,
        dst: &RegisteredMemory,
        dst_offset: u64,
        value: i64,
        width: AtomicWidth,
    ) -> Result<()>;

    /// Waits, at most `timeout`, until every earlier operation has completed at
    /// the peer.
    fn flush(&self, timeout: Duration) -> Result<()>;

    /// Whether operations issued so far are still in flight (None: the
    /// transport cannot tell). Diagnostics only: never waits.
    fn busy(&self) -> Option<bool> {
        None
    }
}

/// Validates an atomic target: in range and aligned to its width.
pub(crate) fn check_atomic_target(
    dst: &RegisteredMemory,
    dst_offset: u64,
    width: AtomicWidth,
) -> Result<()> {
    dst.check_range(dst_offset, width.bytes(), "atomic_add offset")?;
    if (dst.info().owner_ptr + dst_offset) % width.bytes() != 0 {
        return Err(crate::error::CommError::invalid(
            "atomic_add offset",
            format!(
                "offset {dst_offset} is not aligned to {} bytes",
                width.bytes()
            ),
        ));
    }
    Ok(())
}
