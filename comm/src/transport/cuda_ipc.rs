//! CUDA IPC transport: the peer's memory is mapped into this process (legacy
//! IPC handle or cuMem fd), and every operation is enqueued on the one stream
//! that all CUDA IPC connections of a Communicator share (the proxy's; see
//! [`CudaIpcConnection::new`] for why one): copies with `cuMemcpyAsync` (copy engines),
//! signals with `cuStreamWriteValue64` (the value is captured when enqueued, so
//! a signal can never overtake the data issued before it), atomics with a
//! one-thread kernel doing a real `atomicAdd` on the target over NVLink.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys;

use super::{AtomicWidth, Connection, Put, Transport};
use crate::cuda::OwnedStream;
use crate::error::{CommError, CudaResultExt, Result};
use crate::registered_memory::RegisteredMemory;

#[derive(Debug)]
pub struct CudaIpcConnection {
    rank: usize,
    remote_rank: usize,
    stream: Arc<OwnedStream>,
}

impl CudaIpcConnection {
    /// A connection whose operations go on `stream`, which the caller shares
    /// between all its CUDA IPC connections (as MSCCL++ shares one IPC stream
    /// per context). Measured on one H200 with 8 ranks under MPS: with one
    /// stream per peer (7 per rank), the forced-proxy low-latency round trips
    /// timed out in 6 of 6 runs where ranks leave each call on their own (some
    /// peers' copies stayed in flight while the receiving kernels spun), and
    /// passed in every run with one stream. The driver-side cause is not known:
    /// it is not the compute work-queue limit (2 ranks pass with
    /// `CUDA_DEVICE_MAX_CONNECTIONS=1`) nor lazy kernel loading
    /// (benches/results/2026-11-25_ll-8-proxy-streams).
    pub fn new(rank: usize, remote_rank: usize, stream: Arc<OwnedStream>) -> Self {
        Self {
            rank,
            remote_rank,
            stream,
        }
    }

    pub fn stream(&self) -> &OwnedStream {
        &self.stream
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
        self.stream.device().make_current()?;
        // SAFETY: both ranges were checked against their registrations and are mapped here.
        unsafe { sys::cuMemcpyAsync(d, s, size as usize, self.stream.handle().raw()) }
            .result()
            .call("cuMemcpyAsync")
    }

    fn set(&self, dst: &RegisteredMemory, dst_offset: u64, value: u64) -> Result<()> {
        let d = self.mapped(dst, "signal destination")? + dst_offset;
        self.stream.device().make_current()?;
        // SAFETY: an aligned u64 inside the peer's mapped registration.
        unsafe {
            sys::cuStreamWriteValue64_v2(
                self.stream.handle().raw(),
                d,
                value,
                sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
            )
        }
        .result()
        .call("cuStreamWriteValue64")
    }

    fn add(
        &self,
        dst: &RegisteredMemory,
        dst_offset: u64,
        value: i64,
        width: AtomicWidth,
    ) -> Result<()> {
        let d = self.mapped(dst, "atomic_add destination")? + dst_offset;
        // SAFETY: d is an aligned integer of `width` inside the mapped registration.
        unsafe {
            crate::kernels::atomic_add(
                self.stream.device(),
                self.stream.handle(),
                d,
                value,
                width == AtomicWidth::U64,
            )
        }
    }

    fn busy(&self) -> Option<bool> {
        self.stream.is_busy().ok()
    }

    fn flush(&self, timeout: Duration) -> Result<()> {
        self.stream.synchronize_bounded(
            timeout,
            self.rank as i64,
            &format!(
                "CUDA IPC operations to rank {} (and to the peers sharing its stream) to complete",
                self.remote_rank
            ),
        )
    }
}
