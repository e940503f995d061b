//! Semaphores: monotonic 64-bit counters in GPU memory (device side:
//! `semaphore_device.cuh`).
//!
//! A rank keeps all its semaphores' counters in one [`SignalPage`] (GPU memory,
//! registered and mapped once by each peer). Slot `s` holds `inbound`,
//! `expected_inbound`, `outbound` (32 bytes). A [`Semaphore`] pairs our slot for
//! a peer with the peer's slot for us:
//! - device-to-device (memory channels): our GPU stores straight into the
//!   peer's `inbound` over NVLink (`remote_inbound` mapped here);
//! - host-to-device (port channels): our proxy writes the peer's `inbound`
//!   through a connection (`update_and_sync`), keeping the outbound count on
//!   the host.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use crate::cuda::Device;
use crate::device_error::DeviceErrorRecord;
use crate::device_handles::SemaphoreDeviceHandle;
use crate::error::{CommError, Result};
use crate::registered_memory::RegisteredMemory;
use crate::vmm::VmmMemory;

/// Bytes per semaphore slot (inbound, expected_inbound, outbound, padding).
pub const SLOT_BYTES: u64 = 32;

/// This rank's semaphore counters, zeroed, in GPU memory shareable with peers.
#[derive(Debug)]
pub struct SignalPage {
    memory: Arc<VmmMemory>,
    slots: u32,
    next: AtomicU32,
}

impl SignalPage {
    pub fn new(device: Device, slots: u32) -> Result<Self> {
        let memory = VmmMemory::alloc(device, slots as usize * SLOT_BYTES as usize)?;
        // Zeroed before any peer or kernel can see it (complete on return).
        // SAFETY: the whole mapped range belongs to this allocation.
        unsafe { device.memset_sync(memory.ptr(), memory.len(), 0) }?;
        Ok(Self {
            memory: Arc::new(memory),
            slots,
            next: AtomicU32::new(0),
        })
    }

    pub fn memory(&self) -> &Arc<VmmMemory> {
        &self.memory
    }

    /// A fresh slot (slots are never reused during the page's life).
    pub fn allocate(&self) -> Result<u32> {
        let s = self.next.fetch_add(1, Ordering::Relaxed);
        if s >= self.slots {
            return Err(CommError::invalid(
                "semaphores",
                format!(
                    "the signal page holds {} semaphores; all are in use",
                    self.slots
                ),
            ));
        }
        Ok(s)
    }

    /// Address of slot `s`'s `inbound` counter in this process.
    pub fn slot_ptr(&self, s: u32) -> u64 {
        self.memory.ptr() + s as u64 * SLOT_BYTES
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
            outbound: self.local_inbound + 16,
            remote_inbound,
            error: error.device_ptr(),
            rank: self.rank as i32,
            peer: self.peer as i32,
            id: self.id,
        }
    }
}
