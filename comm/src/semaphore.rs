//! Semaphores: monotonic 64-bit counters in GPU memory (device side:
//! `semaphore_device.cuh`).
//!
//! A rank keeps its semaphores' counters in [`SignalPage`]s (GPU memory,
//! registered and mapped once by each peer; heap memory for a Communicator
//! without a GPU). Slot `s` holds `inbound`, `expected_inbound` and two unused
//! words (32 bytes). A [`Semaphore`] pairs our slot for a peer with the
//! peer's slot for us:
//! - device-to-device (memory channels): our GPU adds one to the peer's
//!   `inbound` over NVLink (`remote_inbound` mapped here; one `red.release.sys`
//!   per signal, no outbound counter);
//! - host-to-device (port channels): our proxy writes the peer's `inbound`
//!   through a connection (`update_and_sync`), keeping the outbound count on
//!   the host. Over CUDA IPC the counter it writes is not the slot's but one
//!   in the peer's shared host memory (see
//!   [`Communicator::port_channels`](crate::Communicator::port_channels));
//!   the slot's `expected_inbound` is still the waits' count.
//!
//! A Communicator starts with one page and adds one, collectively, whenever
//! the semaphores of one [`Communicator::semaphores`](crate::Communicator::semaphores)
//! call do not fit the rest of its newest page (see [`SlotCursor`]): the
//! number of semaphores is not bounded by the page size. Slots are never
//! reused: those of a dropped object stay allocated (32 bytes each) until the
//! Communicator goes.

use std::sync::Arc;

use crate::cuda::Device;
use crate::device_error::DeviceErrorRecord;
use crate::device_handles::SemaphoreDeviceHandle;
use crate::error::{CommError, Result};
use crate::host_memory::HostMemory;
use crate::registered_memory::RegisteredMemory;
use crate::vmm::VmmMemory;

/// Bytes per semaphore slot (inbound, expected_inbound, two unused words).
pub const SLOT_BYTES: u64 = 32;

#[derive(Debug)]
enum PageMemory {
    Device(Arc<VmmMemory>),
    Host(Arc<HostMemory>),
}

/// One page of this rank's semaphore counters, zeroed: GPU memory shareable
/// with peers, or (without a GPU) heap memory that peers reach over Ethernet.
#[derive(Debug)]
pub struct SignalPage {
    memory: PageMemory,
    slots: u32,
}

impl SignalPage {
    /// `slots` counters on `device` (one cuMem allocation, rounded up to the
    /// allocation granularity: 2 MiB holds 65536 slots).
    pub fn new(device: Device, slots: u32) -> Result<Self> {
        let slots = slots.max(1);
        let memory = VmmMemory::alloc(device, slots as usize * SLOT_BYTES as usize)?;
        // Zeroed before any peer or kernel can see it (complete on return).
        // SAFETY: the whole mapped range belongs to this allocation.
        unsafe { device.memset_sync(memory.ptr(), memory.len(), 0) }?;
        Ok(Self {
            memory: PageMemory::Device(Arc::new(memory)),
            slots,
        })
    }

    /// `slots` counters in zeroed heap memory (a Communicator without a GPU).
    pub fn host(slots: u32) -> Self {
        let slots = slots.max(1);
        let memory = HostMemory::heap(slots as usize * SLOT_BYTES as usize);
        Self {
            memory: PageMemory::Host(Arc::new(memory)),
            slots,
        }
    }

    /// The page's GPU allocation (None for a host page).
    pub fn device_memory(&self) -> Option<&Arc<VmmMemory>> {
        match &self.memory {
            PageMemory::Device(m) => Some(m),
            PageMemory::Host(_) => None,
        }
    }

    /// The page's heap memory (None for a GPU page).
    pub fn host_memory(&self) -> Option<&Arc<HostMemory>> {
        match &self.memory {
            PageMemory::Device(_) => None,
            PageMemory::Host(m) => Some(m),
        }
    }

    /// Counters the page holds.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// The page's address in this process.
    pub fn ptr(&self) -> u64 {
        match &self.memory {
            PageMemory::Device(m) => m.ptr(),
            PageMemory::Host(m) => m.as_ptr() as u64,
        }
    }

    /// Address of slot `s`'s `inbound` counter in this process.
    pub fn slot_ptr(&self, s: u32) -> u64 {
        self.ptr() + s as u64 * SLOT_BYTES
    }
}

/// Where the next semaphores go: pages of `per_page` slots (the same number
/// on every rank), filled in order; a call's slots that do not fit the rest
/// of the newest page go to a new page. Every rank asks for the same counts
/// in the same order (semaphores are made collectively), so every rank
/// decides to add a page at the same call, and the page exchange that
/// follows is collective too.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotCursor {
    per_page: u32,
    /// Pages so far (the newest is `pages - 1`).
    pages: u32,
    /// Slots taken in the newest page.
    used: u32,
}

impl SlotCursor {
    /// One page of `per_page` slots, none taken.
    pub fn new(per_page: u32) -> Self {
        Self {
            per_page: per_page.max(1),
            pages: 1,
            used: 0,
        }
    }

    pub fn per_page(&self) -> u32 {
        self.per_page
    }

    pub fn pages(&self) -> u32 {
        self.pages
    }

    /// Whether `n` more slots need a new page first (`InvalidArgument` when
    /// `n` exceeds a whole page).
    pub fn needs_page(&self, n: u32) -> Result<bool> {
        if n > self.per_page {
            return Err(CommError::invalid(
                "semaphores",
                format!(
                    "{n} semaphores in one call; a signal page holds {}",
                    self.per_page
                ),
            ));
        }
        Ok(self.used + n > self.per_page)
    }

    /// Records that a new page was added.
    pub fn add_page(&mut self) {
        self.pages += 1;
        self.used = 0;
    }

    /// The next slot of the newest page: (page, slot). The caller checked
    /// [`needs_page`](Self::needs_page) for the whole call first.
    pub fn take(&mut self) -> Result<(u32, u32)> {
        if self.used >= self.per_page {
            return Err(CommError::invalid(
                "semaphores",
                format!(
                    "signal page {} is full ({} slots)",
                    self.pages - 1,
                    self.per_page
                ),
            ));
        }
        let s = self.used;
        self.used += 1;
        Ok((self.pages - 1, s))
    }

    /// A slot's number across pages (for error reports).
    pub fn global(&self, page: u32, slot: u32) -> u64 {
        page as u64 * self.per_page as u64 + slot as u64
    }
}

/// One side of a semaphore pair: our counters and where the peer's inbound is.
#[derive(Clone, Debug)]
pub struct Semaphore {
    pub rank: usize,
    pub peer: usize,
    /// Our slot's `inbound` address (this process).
    pub local_inbound: u64,
    /// The peer's signal page (mapped here for device-to-device use).
    pub remote_page: RegisteredMemory,
    /// Byte offset of the peer's slot for us in `remote_page`.
    pub remote_offset: u64,
    /// Identifies the semaphore in error reports.
    pub id: u64,
}

impl Semaphore {
    /// The handle for a device-to-device semaphore (memory channels): the peer's
    /// inbound must be mapped here (same host, CUDA IPC).
    pub fn device_to_device_handle(
        &self,
        error: &DeviceErrorRecord,
    ) -> Result<SemaphoreDeviceHandle> {
        if !self.remote_page.is_mapped() {
            return Err(CommError::invalid(
                "semaphore",
                format!(
                    "rank {}'s signal page is not mapped in rank {}: a memory channel needs \
                     the peer on this host with CUDA IPC",
                    self.peer, self.rank
                ),
            ));
        }
        Ok(self.handle(self.remote_page.ptr() + self.remote_offset, error))
    }

    /// The handle for a host-to-device semaphore (port channels): waits only;
    /// signals go through the proxy.
    pub fn host_to_device_handle(&self, error: &DeviceErrorRecord) -> SemaphoreDeviceHandle {
        self.handle(0, error)
    }

    fn handle(&self, remote_inbound: u64, error: &DeviceErrorRecord) -> SemaphoreDeviceHandle {
        SemaphoreDeviceHandle {
            inbound: self.local_inbound,
            expected_inbound: self.local_inbound + 8,
            reserved: 0,
            remote_inbound,
            error: error.device_ptr(),
            rank: self.rank as i32,
            peer: self.peer as i32,
            id: self.id,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_that_does_not_fit_the_rest_of_a_page_starts_a_new_one() {
        let mut c = SlotCursor::new(5);
        let mut got = Vec::new();
        for _ in 0..4 {
            // Two slots per call: pages 0, 0, 1, 1 (slot 4 of each page unused).
            if c.needs_page(2).unwrap() {
                c.add_page();
            }
            got.push((c.take().unwrap(), c.take().unwrap()));
        }
        assert_eq!(
            got,
            vec![
                ((0, 0), (0, 1)),
                ((0, 2), (0, 3)),
                ((1, 0), (1, 1)),
                ((1, 2), (1, 3)),
            ]
        );
        assert_eq!(c.pages(), 2);
        assert_eq!(c.global(1, 3), 8);
        assert!(c.needs_page(6).is_err(), "more than a page in one call");
        assert!(!c.needs_page(1).unwrap());
        c.take().unwrap();
        assert!(c.take().is_err(), "a full page hands out nothing");
    }

    #[test]
    fn a_host_page_holds_its_slots_zeroed() {
        let p = SignalPage::host(3);
        assert_eq!(p.slots(), 3);
        assert!(p.device_memory().is_none());
        let m = p.host_memory().unwrap();
        assert_eq!(m.len() as u64, 3 * SLOT_BYTES);
        assert_eq!(p.slot_ptr(2), p.ptr() + 2 * SLOT_BYTES);
        assert!((0..m.len())
            .step_by(8)
            .all(|o| m.atomic_u64(o).load(std::sync::atomic::Ordering::Relaxed) == 0));
    }
}
