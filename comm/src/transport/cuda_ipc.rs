//! CUDA IPC transport: the peer's memory is mapped into this process (legacy
//! IPC handle or cuMem fd), and every operation is enqueued on the one stream
//! that all CUDA IPC connections of a Communicator share (the proxy's; see
//! [`CudaIpcConnection::new`] for why one): copies with `cuMemcpyAsync` (copy engines),
//! atomics with a one-thread kernel doing a real `atomicAdd` on the target over
//! NVLink.
//!
//! Signals (`set`): a port channel's inbound counter lives in the peer's shared
//! host memory ([`crate::host_memory::HostMemory::shared`], mapped here too), so
//! when every operation this connection enqueued before is known complete the
//! proxy signals with one CPU store (release), no driver call. Otherwise (a
//! put still in flight, or a target without a CPU mapping) the signal is a
//! `cuStreamWriteValue64` behind that work on the stream, as before (the value
//! is captured when enqueued, so a signal never overtakes the data issued
//! before it). "Known complete": the connection counts the operations it
//! enqueued and the count it last saw drained (a `cuStreamQuery` that found
//! the stream idle, or a flush); see `IssueCount`. A completed copy's data
//! is in the peer's memory before the stream reports it complete, so a store
//! made after that report orders after the data, as the stream operation did.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys;

use super::{AtomicAdd, AtomicWidth, Connection, Put, Transport};
use crate::cuda::{Device, OwnedStream, RestoreCurrent};
use crate::error::{CommError, CudaResultExt, Result};
use crate::registered_memory::RegisteredMemory;

/// How many stream operations a connection enqueued, and how many of them
/// are known complete. Operations are counted after they were enqueued; a
/// query that finds the stream idle proves complete every operation counted
/// before the query was made (the count is read first).
#[derive(Debug, Default)]
pub(crate) struct IssueCount {
    issued: AtomicU64,
    done: AtomicU64,
}

impl IssueCount {
    /// Counts one operation (call after it was enqueued).
    pub(crate) fn issued(&self) {
        self.issued.fetch_add(1, Ordering::AcqRel);
    }

    /// The count to pass to [`saw_idle`](Self::saw_idle) after a query or
    /// synchronisation made from now on found the stream idle.
    pub(crate) fn snapshot(&self) -> u64 {
        self.issued.load(Ordering::Acquire)
    }

    /// Records that the stream was idle after `snapshot` was taken.
    pub(crate) fn saw_idle(&self, snapshot: u64) {
        self.done.fetch_max(snapshot, Ordering::AcqRel);
    }

    /// Whether every counted operation has completed: true at once when the
    /// last idle stream seen covers them all, else asks `busy` (a stream
    /// query) once.
    pub(crate) fn drained(&self, busy: impl FnOnce() -> Result<bool>) -> Result<bool> {
        let n = self.snapshot();
        if self.done.load(Ordering::Acquire) >= n {
            return Ok(true);
        }
        if busy()? {
            return Ok(false);
        }
        self.saw_idle(n);
        Ok(true)
    }
}

/// The streams a Communicator's CUDA IPC connections issue on (shared by all
/// of them: see [`CudaIpcConnection::new`]).
///
/// By default the operations go on a stream of the proxy's own context
/// ([`Device::proxy_context`]): while a CUDA call of the process waits on the
/// GPU inside the primary context (a pageable host-to-device copy on a stream
/// ordered after a running kernel syncs that stream first), the copies and
/// kernels other threads issue in that context do not reach the GPU, and
/// kernels spinning for the proxy's copies never see them (the internode stall: measured with
/// `port_cuda_ipc_beside_a_spinning_kernel_pageable_upload`, which stalls in
/// the primary context and passes in the proxy's). The proxy's context
/// addresses only what is mapped process-wide: cuMem (VMM) allocations and
/// portable host memory; a connection that meets other memory (a legacy IPC
/// registration) moves to the primary context's stream for good.
/// `MOELINK_IPC_CONTEXT=primary` keeps everything in the primary context.
#[derive(Debug)]
pub struct IpcStreams {
    own: Option<OwnedStream>,
    primary: OwnedStream,
    /// Whether anything was issued to `primary`: until then the proxy never
    /// touches it (a query there could wait for the very lock it avoids).
    primary_used: AtomicBool,
}

impl IpcStreams {
    pub fn new(device: Device) -> Result<Self> {
        let _restore = RestoreCurrent::new()?;
        let own_dev = device.proxy_context_or_primary(true, "CUDA IPC puts");
        let own = if !own_dev.is_proxy_context() {
            None
        } else {
            match OwnedStream::new(own_dev) {
                Ok(s) => Some(s),
                Err(e) => {
                    tracing::warn!(
                        "{e}; the CUDA IPC proxy issues in the primary context (a CUDA call \
                         of this process that waits on the GPU can then hold its copies back)"
                    );
                    None
                }
            }
        };
        let primary_used = AtomicBool::new(own.is_none());
        Ok(Self {
            own,
            primary: OwnedStream::new(device)?,
            primary_used,
        })
    }

    /// The primary context's stream, marked as used from now on.
    fn primary(&self) -> &OwnedStream {
        self.primary_used.store(true, Ordering::Release);
        &self.primary
    }

    /// The streams anything was issued to (the own context's first).
    fn used(&self) -> impl Iterator<Item = &OwnedStream> {
        let primary = self.primary_used.load(Ordering::Acquire);
        self.own.iter().chain(primary.then_some(&self.primary))
    }

    /// Whether work issued to either stream has not completed yet (from any
    /// thread: a hang report asks too).
    fn is_busy(&self) -> Result<bool> {
        let _restore = RestoreCurrent::new()?;
        for s in self.used() {
            if s.is_busy()? {
                return Ok(true);
            }
        }
        Ok(false)
    }
}

impl Drop for IpcStreams {
    fn drop(&mut self) {
        // Dropped on a caller's thread (with its Communicator): the own
        // stream's destruction makes the proxy's context current there.
        let _restore = RestoreCurrent::new();
        self.own.take();
    }
}

#[derive(Debug)]
pub struct CudaIpcConnection {
    rank: usize,
    remote_rank: usize,
    streams: Arc<IpcStreams>,
    /// Set once the connection met memory its own context cannot address
    /// (see [`IpcStreams`]): it issues on the primary stream from then on.
    primary_only: AtomicBool,
    /// This connection's stream operations (for the CPU-store signal).
    ops: IssueCount,
}

impl CudaIpcConnection {
    /// A connection whose operations go on `streams`, which the caller shares
    /// between all its CUDA IPC connections (as MSCCL++ shares one IPC stream
    /// per context). Measured on one H200 with 8 ranks under MPS: with one
    /// stream per peer (7 per rank), the forced-proxy low-latency round trips
    /// timed out in 6 of 6 runs where ranks leave each call on their own (some
    /// peers' copies stayed in flight while the receiving kernels spun), and
    /// passed in every run with one stream. The driver-side cause is not known:
    /// it is not the compute work-queue limit (2 ranks pass with
    /// `CUDA_DEVICE_MAX_CONNECTIONS=1`) nor lazy kernel loading
    /// (benches/results/2026-11-25_h200_ll-proxy-streams-8-ranks).
    pub fn new(rank: usize, remote_rank: usize, streams: Arc<IpcStreams>) -> Self {
        Self {
            rank,
            remote_rank,
            streams,
            primary_only: AtomicBool::new(false),
            ops: IssueCount::default(),
        }
    }

    /// The stream for an operation on `mems`: the own context's while every
    /// memory is addressable there, else (for good, after the own stream
    /// drained, so the order of the connection's operations holds) the
    /// primary one.
    fn stream_for(&self, mems: &[&RegisteredMemory]) -> Result<&OwnedStream> {
        let Some(own) = &self.streams.own else {
            return Ok(self.streams.primary());
        };
        if self.primary_only.load(Ordering::Acquire) {
            return Ok(self.streams.primary());
        }
        if mems.iter().all(|m| m.info().process_wide()) {
            return Ok(own);
        }
        own.synchronize_bounded(
            Duration::from_secs(30),
            self.rank as i64,
            &format!(
                "CUDA IPC operations to rank {} before it moves to the primary context",
                self.remote_rank
            ),
        )?;
        self.primary_only.store(true, Ordering::Release);
        tracing::debug!(
            rank = self.rank,
            peer = self.remote_rank,
            "CUDA IPC connection met memory of the primary context only (legacy IPC): \
             it issues in the primary context from now on"
        );
        Ok(self.streams.primary())
    }

    fn mapped(&self, m: &RegisteredMemory, what: &'static str) -> Result<u64> {
        if !m.is_mapped() {
            return Err(CommError::invalid(
                what,
                format!(
                    "rank {}'s memory is not mapped in rank {} (different host, or no IPC export)",
                    m.rank(),
                    self.rank
                ),
            ));
        }
        Ok(m.ptr())
    }
}

impl Connection for CudaIpcConnection {
    fn transport(&self) -> Transport {
        Transport::CudaIpc
    }

    fn remote_rank(&self) -> usize {
        self.remote_rank
    }

    fn put(&self, p: Put<'_>) -> Result<()> {
        let (dst, dst_offset, src, src_offset, size) =
            (p.dst, p.dst_offset, p.src, p.src_offset, p.size);
        if size == 0 {
            return Ok(());
        }
        let d = self.mapped(dst, "write destination")? + dst_offset;
        let s = self.mapped(src, "write source")? + src_offset;
        let stream = self.stream_for(&[dst, src])?;
        stream.device().make_current()?;
        // SAFETY: both ranges were checked against their registrations and are mapped here.
        unsafe { sys::cuMemcpyAsync(d, s, size as usize, stream.handle().raw()) }
            .result()
            .call("cuMemcpyAsync")?;
        self.ops.issued();
        Ok(())
    }

    fn set(&self, dst: &RegisteredMemory, dst_offset: u64, value: u64) -> Result<()> {
        if let Some(cpu) = dst.host_ptr() {
            if self.ops.drained(|| self.streams.is_busy())? {
                // SAFETY: the word was checked (in range, 8-byte aligned) against
                // the peer's shared host memory, which is mapped here (host_ptr)
                // for as long as `dst` lives.
                let word = unsafe { AtomicU64::from_ptr((cpu + dst_offset) as *mut u64) };
                word.store(value, Ordering::Release);
                return Ok(());
            }
        }
        let d = self.mapped(dst, "signal destination")? + dst_offset;
        let stream = self.stream_for(&[dst])?;
        stream.device().make_current()?;
        // SAFETY: an aligned u64 inside the peer's mapped registration.
        unsafe {
            sys::cuStreamWriteValue64_v2(
                stream.handle().raw(),
                d,
                value,
                sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
            )
        }
        .result()
        .call("cuStreamWriteValue64")?;
        self.ops.issued();
        Ok(())
    }

    fn add(&self, a: AtomicAdd<'_>) -> Result<()> {
        let d = self.mapped(a.dst, "atomic_add destination")? + a.dst_offset;
        let stream = self.stream_for(&[a.dst])?;
        // SAFETY: d is an aligned integer of `width` inside the mapped registration.
        unsafe {
            crate::kernels::atomic_add(
                stream.device(),
                stream.handle(),
                d,
                a.value,
                a.width == AtomicWidth::U64,
            )
        }?;
        self.ops.issued();
        Ok(())
    }

    fn busy(&self) -> Option<bool> {
        let n = self.ops.snapshot();
        let busy = self.streams.is_busy().ok()?;
        if !busy {
            self.ops.saw_idle(n);
        }
        Some(busy)
    }

    fn flush(&self, timeout: Duration) -> Result<()> {
        let _restore = RestoreCurrent::new()?;
        let n = self.ops.snapshot();
        let start = std::time::Instant::now();
        for s in self.streams.used() {
            s.synchronize_bounded(
                timeout.saturating_sub(start.elapsed()),
                self.rank as i64,
                &format!(
                    "CUDA IPC operations to rank {} (and to the peers sharing its stream) \
                     to complete",
                    self.remote_rank
                ),
            )?;
        }
        self.ops.saw_idle(n);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::IssueCount;
    use crate::fd_passing::FdAddress;
    use crate::memory::IpcHandle;
    use crate::registered_memory::{IpcExport, Location, MemoryInfo, RegisteredMemory};

    fn memory(location: Location, ipc: Option<IpcExport>) -> RegisteredMemory {
        let info = MemoryInfo {
            rank: 0,
            len: 4096,
            location,
            host_id: 1,
            owner_ptr: 0x1000,
            ipc,
            ethernet: None,
            ib: None,
        };
        RegisteredMemory::local(info, None)
    }

    #[test]
    fn only_vmm_and_host_memory_go_to_the_proxys_own_context() {
        let server = FdAddress::from_bytes(b"moelink-test").unwrap();
        let vmm = IpcExport::Vmm {
            server: server.clone(),
            key: 1,
            len: 4096,
        };
        let legacy = IpcExport::Legacy(IpcHandle {
            bytes: [7; 64],
            len: 4096,
        });
        let shared = IpcExport::SharedHost {
            server,
            key: 2,
            len: 4096,
        };
        assert!(memory(Location::Device(0), Some(vmm)).info().process_wide());
        assert!(memory(Location::Host, Some(shared)).info().process_wide());
        assert!(memory(Location::Host, None).info().process_wide());
        // cuMemAlloc memory belongs to the primary context.
        assert!(!memory(Location::Device(0), Some(legacy))
            .info()
            .process_wide());
        assert!(!memory(Location::Device(0), None).info().process_wide());
    }

    #[test]
    fn only_an_idle_stream_seen_after_the_last_operation_drains_it() {
        let c = IssueCount::default();
        // Nothing issued: drained without asking the stream.
        assert!(c.drained(|| panic!("no query needed")).unwrap());
        c.issued();
        assert!(!c.drained(|| Ok(true)).unwrap(), "the stream is busy");
        assert!(c.drained(|| Ok(false)).unwrap(), "an idle stream drains it");
        assert!(c.drained(|| panic!("already known drained")).unwrap());
        // An idle stream seen before an operation was issued proves nothing about it.
        let before = c.snapshot();
        c.issued();
        c.saw_idle(before);
        assert!(!c.drained(|| Ok(true)).unwrap());
        let after = c.snapshot();
        c.saw_idle(after);
        assert!(c
            .drained(|| panic!("covered by the idle stream seen"))
            .unwrap());
        assert!(c
            .drained(|| Err(crate::error::CommError::invalid("x", "y")))
            .is_ok());
        c.issued();
        assert!(c
            .drained(|| Err(crate::error::CommError::invalid("x", "y")))
            .is_err());
    }
}
