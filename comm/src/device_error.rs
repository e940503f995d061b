//! The host side of device error reporting: a [`DeviceError`] record in
//! host-mapped memory that bounded device waits fill in when they run out, and
//! its translation into a [`CommError`] naming the rank and what it waited for.

use std::sync::atomic::Ordering;

use crate::cuda::Device;
use crate::device_handles::{DeviceError, WaitKind, ERROR_NONE, ERROR_TIMEOUT};
use crate::error::{CommError, Result};
use crate::host_memory::HostMemory;

/// One device error record (40 bytes of host-mapped memory).
#[derive(Debug)]
pub struct DeviceErrorRecord {
    mem: HostMemory,
}

impl DeviceErrorRecord {
    pub fn new(device: Option<Device>) -> Result<Self> {
        let len = std::mem::size_of::<DeviceError>();
        let mem = match device {
            Some(d) => HostMemory::pinned(d, len)?,
            None => HostMemory::heap(len),
        };
        Ok(Self { mem })
    }

    /// The address device handles store in their `error` field.
    pub fn device_ptr(&self) -> u64 {
        self.mem.device_ptr()
    }

    /// A snapshot of the record, or None while the device has reported nothing.
    pub fn read(&self) -> Option<DeviceError> {
        let code = self.mem.atomic_u32(0).load(Ordering::Acquire);
        if code == ERROR_NONE || code == u32::MAX {
            return None; // nothing, or a writer is still filling it in
        }
        // SAFETY: the record is fully written before `code` is published.
        let mut e = unsafe { std::ptr::read_volatile(self.mem.as_ptr() as *const DeviceError) };
        e.code = code;
        Some(e)
    }

    /// Ok while nothing was reported; else the error, described.
    pub fn check(&self) -> Result<()> {
        match self.read() {
            None => Ok(()),
            Some(e) => Err(describe(&e)),
        }
    }

    /// Clears the record (only while no kernel that may write it is running).
    pub fn reset(&self) {
        // SAFETY: the record is ours; no writer runs concurrently by contract.
        unsafe { std::ptr::write_bytes(self.mem.as_ptr(), 0, self.mem.len()) };
        std::sync::atomic::fence(Ordering::SeqCst);
    }
}

/// Turns a device error record into a [`CommError`].
pub fn describe(e: &DeviceError) -> CommError {
    let kind = WaitKind::from_u32(e.kind);
    let peer = if e.peer >= 0 {
        format!(" from rank {}", e.peer)
    } else {
        String::new()
    };
    let what = match kind {
        Some(k) => format!(
            "{}{} (id {}): expected {}, observed {}",
            k.describe(),
            peer,
            e.id,
            e.expected,
            e.observed
        ),
        None => format!("unknown wait kind {} (id {})", e.kind, e.id),
    };
    if e.code == ERROR_TIMEOUT {
        CommError::Timeout {
            rank: e.rank as i64,
            what: format!("(on the GPU) {what}"),
            waited_ms: 0,
        }
    } else {
        CommError::invalid("device operation", format!("rank {}: {what}", e.rank))
    }
}
