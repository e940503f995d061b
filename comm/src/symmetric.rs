//! [`SymmetricRegion`]: one allocation of the same size on every rank of a
//! Communicator, each rank's copy imported (and mapped where reachable) by
//! every other; and [`device_table`], the dense per-peer device arrays of
//! channel handles that kernels index by rank. The setup that the intranode
//! buffer, the low-latency buffer and the allreduce communicator share (each
//! on its group's one Communicator, with its own device error record).

use crate::channel::MemoryChannel;
use crate::communicator::Communicator;
use crate::cuda::Device;
use crate::device_error::DeviceErrorRecord;
use crate::device_handles::{MemoryChannelDeviceHandle, PortChannelDeviceHandle};
use crate::error::{CommError, Result};
use crate::memory::DeviceMemory;
use crate::registered_memory::RegisteredMemory;

/// Plain device data for which all-zero bytes are a valid value: what a
/// [`device_table`] stores for an absent entry (this rank, an unreachable peer).
///
/// # Safety
/// The type must be `#[repr(C)]` plain data (integers and device addresses)
/// that kernels read as such; all-zero must be a valid value.
pub unsafe trait PlainDeviceData: Copy {}

// SAFETY: #[repr(C)] structs of integers and device addresses.
unsafe impl PlainDeviceData for MemoryChannelDeviceHandle {}
// SAFETY: as above.
unsafe impl PlainDeviceData for PortChannelDeviceHandle {}
// SAFETY: an integer.
unsafe impl PlainDeviceData for u64 {}

/// A device array of `entries` in order, `None` entries zeroed.
pub fn device_table<T: PlainDeviceData>(
    device: Device,
    entries: &[Option<T>],
) -> Result<DeviceMemory> {
    let dense: Vec<T> = entries
        .iter()
        .map(|e| match e {
            Some(v) => *v,
            // SAFETY: PlainDeviceData promises that all-zero is a valid value.
            None => unsafe { std::mem::zeroed() },
        })
        .collect();
    let table = DeviceMemory::alloc(device, std::mem::size_of_val(dense.as_slice()).max(1))?;
    table.copy_from_host(0, &dense)?;
    Ok(table)
}

/// This rank's allocation and every rank's copy of it (rank order; ours is the
/// local allocation itself), imported through the Communicator.
pub struct SymmetricRegion {
    local: RegisteredMemory,
    peers: Vec<RegisteredMemory>,
}

impl std::fmt::Debug for SymmetricRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SymmetricRegion")
            .field("ptr", &self.local.ptr())
            .field("len", &self.local.len())
            .field("all_mapped", &self.all_mapped())
            .finish()
    }
}

impl SymmetricRegion {
    /// *Collective.* Allocates `bytes` on the Communicator's device, zeroes the
    /// first `zeroed` bytes (before any peer can see them), and imports every
    /// peer's copy, mapped where it is reachable.
    pub fn new(comm: &Communicator, bytes: usize, zeroed: usize) -> Result<Self> {
        let device = comm
            .device()
            .ok_or_else(|| CommError::invalid("device", "a symmetric region needs a device"))?;
        if zeroed > bytes {
            return Err(CommError::invalid(
                "zeroed",
                format!("{zeroed} bytes to zero in a region of {bytes}"),
            ));
        }
        let local = comm.alloc_memory(bytes)?;
        if zeroed > 0 {
            // SAFETY: the prefix lies inside the allocation, mapped here.
            unsafe { device.memset_sync(local.ptr(), zeroed, 0) }?;
        }
        let peers = comm.exchange_memory(&local)?;
        Ok(Self { local, peers })
    }

    /// This rank's copy.
    pub fn local(&self) -> &RegisteredMemory {
        &self.local
    }

    /// Every rank's copy, in rank order (ours: [`Self::local`]).
    pub fn peers(&self) -> &[RegisteredMemory] {
        &self.peers
    }

    pub fn ptr(&self) -> u64 {
        self.local.ptr()
    }

    pub fn len(&self) -> u64 {
        self.local.len()
    }

    pub fn is_empty(&self) -> bool {
        self.local.len() == 0
    }

    /// Whether every rank's copy is mapped here (loads and stores reach it).
    pub fn all_mapped(&self) -> bool {
        self.peers.iter().all(|m| m.is_mapped())
    }

    /// Every rank's copy as a device address here: ours, and the mapped peers'
    /// (`None` where a peer's copy is not mapped).
    pub fn bases(&self) -> Vec<Option<u64>> {
        self.peers
            .iter()
            .map(|m| m.is_mapped().then(|| m.ptr()))
            .collect()
    }

    /// *Collective.* One memory channel per mapped peer (`None` for this rank;
    /// an unmapped peer fails): a fresh semaphore pair each, the peer's copy
    /// as destination, ours (or `packets`) as source.
    pub fn memory_channels(
        &self,
        comm: &Communicator,
        packets: Option<&RegisteredMemory>,
    ) -> Result<Vec<Option<MemoryChannel>>> {
        comm.memory_channels_to(&self.local, &self.peers, packets)
    }

    /// *Collective.* `rows` sets of [`memory_channels`](Self::memory_channels)
    /// (one per block of a kernel whose blocks each talk to every peer, or
    /// one) as a device table `[rows][ranks]` of handles (this rank's entries
    /// zeroed), beside the channels it refers to. The handles report into
    /// `error`: the record of the object that owns the table (on a shared
    /// Communicator, each object its own).
    pub fn memory_channel_table(
        &self,
        comm: &Communicator,
        rows: usize,
        error: &DeviceErrorRecord,
    ) -> Result<(Vec<Vec<Option<MemoryChannel>>>, DeviceMemory)> {
        let device = comm
            .device()
            .ok_or_else(|| CommError::invalid("device", "a channel table needs a device"))?;
        let mut handles = Vec::with_capacity(rows * self.peers.len());
        let mut channels = Vec::with_capacity(rows);
        for _ in 0..rows {
            let row = self.memory_channels(comm, None)?;
            for c in &row {
                handles.push(c.as_ref().map(|c| c.device_handle(error)).transpose()?);
            }
            channels.push(row);
        }
        let table = device_table(device, &handles)?;
        Ok((channels, table))
    }
}
