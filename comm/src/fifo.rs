//! The host side of the trigger FIFO (device side: `fifo_device.cuh`).
//!
//! One allocation of host memory holds the ring of 16-byte slots followed by
//! the `tail` counter. Producers (GPU threads, or host threads through
//! [`HostProducer`] in tests) claim positions by an atomic add on `head`, wait
//! while the ring is full, write `fst` then `snd` (release). The single consumer
//! (a proxy thread) polls the slot at `tail`: non-zero `snd` means full; it
//! reads the trigger, clears the slot and advances `tail` (release), which is
//! what producers wait on for free space and for flushes.
//!
//! GPU producers check for room against `tail_replica`, a lower bound of
//! `tail` in GPU memory (device side: `fifo_device.cuh`). The consumer
//! refreshes it (`TailReplica`) with one `cuStreamWriteValue64` of the new
//! tail every quarter ring it pops: a posted write into GPU memory, so a push
//! reads host memory over PCIe only while the ring looks full (producers also
//! raise the replica to the host tail they read while waiting, so progress
//! never depends on the refresh).
//!
//! `head` and the replica live in a cuMem allocation where the device has
//! one, and the write goes on a stream of the proxies' own context
//! ([`Device::proxy_context`]), like CUDA IPC's puts: in the primary context
//! a CUDA call of the process that waits on the GPU can hold the proxy
//! thread inside the write (the internode stall's second cause; whether stream writes
//! are held like copies was not measured). A `cuMemAlloc` fallback, or
//! `MOELINK_IPC_CONTEXT=primary`, keeps it in the primary context.
//!
//! The proxy consumes through a [`FifoConsumer`]: it reads triggers in place
//! and publishes `tail` (clearing the finished slots first) once per batch of
//! at most [`TAIL_PUBLISH_EVERY`] pops, whenever the ring is found empty, and
//! before anything that may wait (see [`FifoConsumer::publish`]), instead of
//! one clear-and-release per trigger. A producer waiting for room therefore
//! gets it at the latest `TAIL_PUBLISH_EVERY` pops later (the ring is full, so
//! the consumer is popping), and one waiting in `sync` as soon as the
//! consumer reaches an empty slot or the end of the batch.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The most triggers a [`FifoConsumer`] pops before it publishes the tail
/// (capped to the ring's size).
pub const TAIL_PUBLISH_EVERY: u64 = 32;
use std::time::{Duration, Instant};

use cudarc::driver::sys;

use crate::cuda::{Device, OwnedStream, RestoreCurrent};
use crate::device_error::DeviceErrorRecord;
use crate::device_handles::{FifoDeviceHandle, ProxyTrigger};
use crate::error::{CommError, CudaResultExt, Result};
use crate::host_memory::HostMemory;
use crate::memory::DeviceMemory;
use crate::vmm::VmmMemory;

/// Where producers' `head` counter (and the tail replica after it) lives: GPU
/// memory (GPU producers; cuMem where the device has it, so that the proxies'
/// own context can write the replica) or host memory (host producers only).
#[derive(Debug)]
enum Head {
    Vmm(VmmMemory),
    Device(DeviceMemory),
    Host(HostMemory),
}

impl Head {
    /// The device address of `head` (0 for host memory).
    fn device_ptr(&self) -> u64 {
        match self {
            Head::Vmm(m) => m.ptr(),
            Head::Device(m) => m.ptr(),
            Head::Host(_) => 0,
        }
    }
}

#[derive(Debug)]
pub struct Fifo {
    /// Declared (so dropped) before `head`, which holds the replica word.
    replica: Option<TailReplica>,
    ring: HostMemory,
    head: Head,
    error: DeviceErrorRecord,
    size: usize,
    rank: i32,
    id: u64,
    /// Consumer's position (only the single consumer writes it).
    tail: AtomicU64,
    /// Whether a [`FifoConsumer`] exists (there is at most one).
    consuming: AtomicBool,
}

/// The consumer's side of the GPU tail replica: a stream write of the tail
/// every `every` pops. Only the single consumer calls it.
#[derive(Debug)]
struct TailReplica {
    stream: OwnedStream,
    /// The replica's device address.
    ptr: u64,
    every: u64,
    /// The tail last written.
    sent: AtomicU64,
    /// Set after a failed write: producers then keep the replica up themselves.
    failed: AtomicBool,
}

impl TailReplica {
    /// Writes `tail` to the replica if it moved `every` past the last write.
    fn after_pop(&self, tail: u64) {
        if tail < self.sent.load(Ordering::Relaxed) + self.every
            || self.failed.load(Ordering::Relaxed)
        {
            return;
        }
        self.sent.store(tail, Ordering::Relaxed);
        // The proxy thread keeps its own current context (the write may be in
        // the proxies' own one).
        let _restore = RestoreCurrent::new();
        if let Err(e) = self.stream.device().make_current() {
            tracing::warn!(
                "{e}; GPU producers refresh the FIFO tail replica themselves from now on"
            );
            self.failed.store(true, Ordering::Relaxed);
            return;
        }
        // SAFETY: ptr is the replica's u64 in GPU memory, alive with the FIFO.
        let r = unsafe {
            sys::cuStreamWriteValue64_v2(
                self.stream.handle().raw(),
                self.ptr,
                tail,
                sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
            )
        }
        .result()
        .call("cuStreamWriteValue64 (FIFO tail replica)");
        if let Err(e) = r {
            // Not fatal: producers fall back to reading the host tail.
            tracing::warn!(
                "{e}; GPU producers refresh the FIFO tail replica themselves from now on"
            );
            self.failed.store(true, Ordering::Relaxed);
        }
    }
}

impl Drop for TailReplica {
    fn drop(&mut self) {
        // Dropped on a caller's thread: the stream's context (maybe the
        // proxies' own) must not stay current there.
        let _restore = RestoreCurrent::new();
        // A write still queued must land before the replica's memory is freed.
        if let Err(e) = self.stream.synchronize_bounded(
            Duration::from_secs(10),
            -1,
            "the FIFO tail replica write",
        ) {
            tracing::warn!("{e}");
        }
    }
}

impl Fifo {
    /// A FIFO of `size` slots for producers on `device` (None: host producers only).
    pub fn new(device: Option<Device>, size: usize, rank: i32, id: u64) -> Result<Self> {
        if size == 0 || size > (1 << 24) {
            return Err(CommError::invalid(
                "size",
                format!("{size} slots (1..=16M)"),
            ));
        }
        let bytes = size * 16 + 64;
        let (ring, head, replica) = match device {
            Some(d) => {
                // [head, tail_replica]
                let own = crate::cuda::proxy_context_wanted();
                let head = match own.then(|| VmmMemory::alloc(d, 16)) {
                    Some(Ok(m)) => Head::Vmm(m),
                    Some(Err(e)) => {
                        tracing::debug!("{e}: the FIFO head goes in cuMemAlloc memory");
                        Head::Device(DeviceMemory::alloc(d, 16)?)
                    }
                    None => Head::Device(DeviceMemory::alloc(d, 16)?),
                };
                // SAFETY: the first 16 bytes of the allocation just made.
                unsafe { d.memset_sync(head.device_ptr(), 16, 0) }?;
                let writer = d.proxy_context_or_primary(
                    matches!(head, Head::Vmm(_)),
                    "FIFO tail replica writes",
                );
                let _restore = RestoreCurrent::new()?;
                let replica = Some(TailReplica {
                    stream: OwnedStream::new(writer)?,
                    ptr: head.device_ptr() + 8,
                    every: (size as u64 / 4).max(1),
                    sent: AtomicU64::new(0),
                    failed: AtomicBool::new(false),
                });
                (HostMemory::pinned(d, bytes)?, head, replica)
            }
            None => (
                HostMemory::heap(bytes),
                Head::Host(HostMemory::heap(8)),
                None,
            ),
        };
        Ok(Self {
            replica,
            ring,
            head,
            error: DeviceErrorRecord::new(device)?,
            size,
            rank,
            id,
            tail: AtomicU64::new(0),
            consuming: AtomicBool::new(false),
        })
    }

    pub fn size(&self) -> usize {
        self.size
    }

    fn tail_atomic(&self) -> &AtomicU64 {
        self.ring.atomic_u64(self.size * 16)
    }

    /// Triggers popped so far (as far as the [`FifoConsumer`] published).
    pub fn tail(&self) -> u64 {
        self.tail.load(Ordering::Relaxed)
    }

    /// The ring as slots of `[fst, snd]`.
    fn slots(&self) -> &[[AtomicU64; 2]] {
        // SAFETY: the ring holds `size` 16-byte slots from its (64-byte
        // aligned) start, lives as long as &self, and is only ever accessed
        // through atomics (here and by producers).
        unsafe {
            std::slice::from_raw_parts(self.ring.as_ptr() as *const [AtomicU64; 2], self.size)
        }
    }

    /// The single consumer's cursor, with batched tail publication (what the
    /// proxy thread uses). Fails while another one exists.
    pub fn consumer(&self) -> Result<FifoConsumer<'_>> {
        if self.consuming.swap(true, Ordering::Acquire) {
            return Err(CommError::invalid(
                "fifo",
                format!("FIFO {} already has a consumer", self.id),
            ));
        }
        let tail = self.tail.load(Ordering::Relaxed);
        Ok(FifoConsumer {
            fifo: self,
            slots: self.slots(),
            tail_atomic: self.tail_atomic(),
            tail,
            slot: (tail % self.size as u64) as usize,
            published: tail,
            every: TAIL_PUBLISH_EVERY.min(self.size as u64),
        })
    }

    /// The record device pushes/syncs of this FIFO report timeouts into.
    pub fn error(&self) -> &DeviceErrorRecord {
        &self.error
    }

    pub fn device_handle(&self) -> FifoDeviceHandle {
        let head = self.head.device_ptr();
        FifoDeviceHandle {
            triggers: self.ring.device_ptr(),
            head,
            tail: self.ring.device_ptr() + (self.size * 16) as u64,
            tail_replica: if head == 0 { 0 } else { head + 8 },
            error: self.error.device_ptr(),
            size: self.size as i32,
            rank: self.rank,
            id: self.id,
        }
    }

    /// A producer for host threads (the FIFO must have been made without a device).
    pub fn host_producer(&self) -> Result<HostProducer<'_>> {
        match &self.head {
            Head::Host(h) => Ok(HostProducer {
                fifo: self,
                head: h.atomic_u64(0),
            }),
            Head::Vmm(_) | Head::Device(_) => Err(CommError::invalid(
                "fifo",
                "this FIFO's head counter is in GPU memory: only GPU threads can push",
            )),
        }
    }
}

/// The consumer side of a [`Fifo`] for one thread (see [`Fifo::consumer`]):
/// [`poll`](Self::poll) reads the trigger at the tail in place,
/// [`pop`](Self::pop) moves past it, and the tail producers wait on is
/// published (the finished slots cleared first) every
/// [`TAIL_PUBLISH_EVERY`] pops (at most the ring's size), on
/// [`publish`](Self::publish), and when the consumer is dropped.
#[derive(Debug)]
pub struct FifoConsumer<'a> {
    fifo: &'a Fifo,
    slots: &'a [[AtomicU64; 2]],
    tail_atomic: &'a AtomicU64,
    /// Position of the next trigger.
    tail: u64,
    /// Its slot: `tail % size`, kept without a division.
    slot: usize,
    /// The tail producers see.
    published: u64,
    every: u64,
}

impl FifoConsumer<'_> {
    /// The trigger at the tail, if a producer has finished writing it.
    #[inline]
    pub fn poll(&self) -> Option<ProxyTrigger> {
        let [fst, snd] = &self.slots[self.slot];
        // `snd` non-zero (acquire): the producer wrote `fst` before it.
        let s = snd.load(Ordering::Acquire);
        if s == 0 {
            return None;
        }
        Some(ProxyTrigger {
            fst: fst.load(Ordering::Relaxed),
            snd: s,
        })
    }

    /// Moves past the trigger at the tail (after it was performed);
    /// publishes the tail once [`TAIL_PUBLISH_EVERY`] pops are unpublished.
    #[inline]
    pub fn pop(&mut self) {
        self.tail += 1;
        self.slot += 1;
        if self.slot == self.slots.len() {
            self.slot = 0;
        }
        if self.tail - self.published >= self.every {
            self.publish();
        }
    }

    /// Pops made and not yet published.
    pub fn unpublished(&self) -> u64 {
        self.tail - self.published
    }

    /// Clears the slots popped since the last publication and publishes the
    /// tail (release): producers may reuse those slots, and `sync` on their
    /// positions returns. The consumer calls it whenever it finds the ring
    /// empty and before an operation that may wait.
    pub fn publish(&mut self) {
        if self.tail == self.published {
            return;
        }
        let size = self.slots.len();
        let mut i = (self.published % size as u64) as usize;
        for _ in self.published..self.tail {
            // `fst` needs no clearing: a producer writes it before `snd`.
            self.slots[i][1].store(0, Ordering::Relaxed);
            i += 1;
            if i == size {
                i = 0;
            }
        }
        self.published = self.tail;
        self.fifo.tail.store(self.tail, Ordering::Relaxed);
        self.tail_atomic.store(self.tail, Ordering::Release);
        if let Some(r) = &self.fifo.replica {
            r.after_pop(self.tail);
        }
    }
}

impl Drop for FifoConsumer<'_> {
    fn drop(&mut self) {
        self.publish();
        self.fifo.consuming.store(false, Ordering::Release);
    }
}

/// Pushes triggers from host threads with the device algorithm (tests, and
/// host-side users of a proxy).
#[derive(Clone, Copy, Debug)]
pub struct HostProducer<'a> {
    fifo: &'a Fifo,
    head: &'a AtomicU64,
}

impl HostProducer<'_> {
    /// Pushes `t` (its `snd` must be non-zero); waits up to `timeout` for space.
    pub fn push(&self, t: ProxyTrigger, timeout: Duration) -> Result<u64> {
        if t.snd == 0 {
            return Err(CommError::invalid("trigger", "snd must be non-zero"));
        }
        let pos = self.head.fetch_add(1, Ordering::Relaxed);
        let size = self.fifo.size as u64;
        let tail = self.fifo.tail_atomic();
        self.wait(
            timeout,
            || pos < size + tail.load(Ordering::Acquire),
            "a free FIFO slot",
        )?;
        let [fst, snd] = &self.fifo.slots()[(pos % size) as usize];
        fst.store(t.fst, Ordering::Relaxed);
        snd.store(t.snd, Ordering::Release);
        Ok(pos)
    }

    /// Waits up to `timeout` until the consumer has popped position `pos`.
    pub fn sync(&self, pos: u64, timeout: Duration) -> Result<()> {
        let tail = self.fifo.tail_atomic();
        self.wait(
            timeout,
            || tail.load(Ordering::Acquire) > pos,
            "the proxy to pop a trigger",
        )
    }

    fn wait(&self, timeout: Duration, mut done: impl FnMut() -> bool, what: &str) -> Result<()> {
        if done() {
            return Ok(());
        }
        let start = Instant::now();
        let mut spins = 0u32;
        while !done() {
            if start.elapsed() > timeout {
                return Err(CommError::Timeout {
                    rank: self.fifo.rank as i64,
                    what: format!("{what} (FIFO {})", self.fifo.id),
                    waited_ms: start.elapsed().as_millis() as u64,
                });
            }
            spins += 1;
            if spins > 64 {
                std::thread::yield_now();
            }
        }
        Ok(())
    }
}
