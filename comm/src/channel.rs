//! Channels: what kernels use to move data to peers, built on the host and
//! handed to kernels as `#[repr(C)]` device handles.
//!
//! - [`MemoryChannel`]: the GPU itself loads/stores to the peer's registered
//!   memory mapped here (NVLink), with a device-to-device semaphore.
//! - [`PortChannel`]: the GPU pushes triggers to a proxy, which performs them on
//!   a connection; the peer's proxy signals our host-to-device semaphore (over
//!   CUDA IPC its inbound counter is in shared host memory, [`HostInbound`]).

use crate::device_error::DeviceErrorRecord;
use crate::device_handles::{FifoDeviceHandle, MemoryChannelDeviceHandle, PortChannelDeviceHandle};
use crate::error::{CommError, Result};
use crate::registered_memory::RegisteredMemory;
use crate::semaphore::Semaphore;

#[derive(Clone, Debug)]
pub struct MemoryChannel {
    pub semaphore: Semaphore,
    /// The peer's memory, mapped here.
    pub dst: RegisteredMemory,
    /// Our memory.
    pub src: RegisteredMemory,
    /// Our memory that the peer writes packets into.
    pub packets: RegisteredMemory,
}

impl MemoryChannel {
    pub fn device_handle(&self, error: &DeviceErrorRecord) -> Result<MemoryChannelDeviceHandle> {
        if !self.dst.is_mapped() {
            return Err(CommError::invalid(
                "memory channel",
                format!("rank {}'s memory is not mapped here", self.dst.rank()),
            ));
        }
        Ok(MemoryChannelDeviceHandle {
            semaphore: self.semaphore.device_to_device_handle(error)?,
            dst: self.dst.ptr(),
            src: self.src.ptr(),
            packets: self.packets.ptr(),
        })
    }
}

/// A port channel's inbound counter in this rank's shared host memory (CUDA
/// IPC port channels: the peer's proxy signals it with a CPU store).
#[derive(Clone, Debug)]
pub struct HostInbound {
    /// The counter's address for this GPU.
    pub device_ptr: u64,
    /// The block holding it (kept alive with the channel).
    pub block: RegisteredMemory,
}

#[derive(Clone, Debug)]
pub struct PortChannel {
    /// The channel's id in its proxy.
    pub channel: u32,
    pub fifo: FifoDeviceHandle,
    pub semaphore: Semaphore,
    /// Proxy memory ids: the peer's buffer and ours.
    pub dst_mem: u32,
    pub src_mem: u32,
    /// Where the peer's proxy signals us when not in the semaphore's slot
    /// (CUDA IPC: shared host memory); None: the slot's inbound counter.
    pub host_inbound: Option<HostInbound>,
}

impl PortChannel {
    pub fn device_handle(&self, error: &DeviceErrorRecord) -> PortChannelDeviceHandle {
        let mut semaphore = self.semaphore.host_to_device_handle(error);
        if let Some(h) = &self.host_inbound {
            semaphore.inbound = h.device_ptr;
        }
        PortChannelDeviceHandle {
            fifo: self.fifo,
            semaphore,
            channel: self.channel,
            dst_mem: self.dst_mem,
            src_mem: self.src_mem,
            pad_: 0,
        }
    }
}
