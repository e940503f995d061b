//! GPU memory owned by this process, and peers' memory mapped into it.
//!
//! Both are RAII: a [`DeviceMemory`] frees its allocation on drop, a
//! [`PeerMemory`] closes its mapping on drop. Handles cross processes as plain
//! bytes ([`IpcHandle`]) through whatever bootstrap the caller uses.

use cudarc::driver::{result, sys};

use crate::cuda::{warn_if_failed, Device};
use crate::error::{CommError, CudaResultExt, Result};
use crate::wire::u64_at;

/// What every allocator of device memory does before its first driver call:
/// refuses an empty allocation and binds `device`'s context.
pub(crate) fn prepare_alloc(device: Device, len: usize) -> Result<()> {
    if len == 0 {
        return Err(CommError::invalid("len", "cannot allocate 0 bytes"));
    }
    device.make_current()
}

/// The accessors of a type that holds a range of device addresses in fields
/// `ptr: u64` and `len: usize` (and, with `device`, the `device: Device` it
/// belongs to).
macro_rules! device_range_accessors {
    ($ty:ty) => {
        impl $ty {
            /// The device address of the first byte.
            pub fn ptr(&self) -> u64 {
                self.ptr
            }

            /// The length in bytes.
            pub fn len(&self) -> usize {
                self.len
            }

            /// Whether the range is empty (never, for a live allocation or mapping).
            pub fn is_empty(&self) -> bool {
                self.len == 0
            }
        }
    };
    ($ty:ty, device) => {
        $crate::memory::device_range_accessors!($ty);

        impl $ty {
            /// The device this memory belongs to.
            pub fn device(&self) -> $crate::cuda::Device {
                self.device
            }
        }
    };
}
pub(crate) use device_range_accessors;

/// Device memory allocated with `cuMemAlloc` on one device. `Send + Sync`:
/// the allocation belongs to a context, not a thread, and all uses bind it
/// first.
#[derive(Debug)]
pub struct DeviceMemory {
    device: Device,
    ptr: sys::CUdeviceptr,
    len: usize,
}

device_range_accessors!(DeviceMemory, device);

impl DeviceMemory {
    /// Allocates `len` bytes (at least one) on `device`.
    pub fn alloc(device: Device, len: usize) -> Result<Self> {
        prepare_alloc(device, len)?;
        // SAFETY: the device's context is current; len > 0.
        let ptr = unsafe { result::malloc_sync(len) }.call("cuMemAlloc")?;
        Ok(Self { device, ptr, len })
    }

    /// Fills every byte with `value`; complete on return. (cuMemsetD8 and a
    /// pageable cuMemcpyHtoD may return before the device has finished, and
    /// kernels on non-blocking streams do not wait for the legacy stream, so
    /// these helpers synchronise the context.)
    pub fn fill(&self, value: u8) -> Result<()> {
        // SAFETY: the range is this allocation.
        unsafe { self.device.memset_sync(self.ptr, self.len, value) }
    }

    pub fn copy_from_host<T: Copy>(&self, offset: usize, src: &[T]) -> Result<()> {
        self.check_range(offset, std::mem::size_of_val(src))?;
        self.device.make_current()?;
        // SAFETY: the destination range was checked to lie inside this allocation.
        unsafe { result::memcpy_htod_sync(self.ptr + offset as u64, src) }.call("cuMemcpyHtoD")?;
        self.device.synchronize()
    }

    pub fn copy_to_host<T: Copy>(&self, offset: usize, dst: &mut [T]) -> Result<()> {
        self.check_range(offset, std::mem::size_of_val(dst))?;
        self.device.make_current()?;
        // SAFETY: the source range was checked to lie inside this allocation.
        unsafe { result::memcpy_dtoh_sync(dst, self.ptr + offset as u64) }.call("cuMemcpyDtoH")
    }

    fn check_range(&self, offset: usize, bytes: usize) -> Result<()> {
        if offset.checked_add(bytes).is_none_or(|end| end > self.len) {
            return Err(CommError::invalid(
                "offset",
                format!(
                    "{bytes} bytes at offset {offset} exceed the {}-byte buffer",
                    self.len
                ),
            ));
        }
        Ok(())
    }

    /// Exports a legacy CUDA IPC handle for this allocation.
    pub fn ipc_handle(&self) -> Result<IpcHandle> {
        self.device.make_current()?;
        let mut handle = std::mem::MaybeUninit::<sys::CUipcMemHandle>::uninit();
        // SAFETY: ptr is the base of a cuMemAlloc allocation of the current context.
        unsafe { sys::cuIpcGetMemHandle(handle.as_mut_ptr(), self.ptr) }
            .result()
            .call("cuIpcGetMemHandle")?;
        // SAFETY: initialised by the successful call above.
        let handle = unsafe { handle.assume_init() };
        let mut bytes = [0u8; IpcHandle::LEN];
        for (b, c) in bytes.iter_mut().zip(handle.reserved.iter()) {
            *b = *c as u8;
        }
        Ok(IpcHandle {
            bytes,
            len: self.len as u64,
        })
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if self.device.make_current().is_ok() {
            // SAFETY: ptr came from cuMemAlloc and is freed exactly once.
            if let Err(e) = unsafe { result::free_sync(self.ptr) } {
                tracing::warn!("cuMemFree failed on device {}: {e}", self.device.ordinal);
            }
        }
    }
}

/// A legacy CUDA IPC memory handle plus the allocation's length, as bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcHandle {
    pub bytes: [u8; 64],
    pub len: u64,
}

impl IpcHandle {
    pub const LEN: usize = 64;
    pub const SERIALIZED_LEN: usize = Self::LEN + 8;

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(Self::SERIALIZED_LEN);
        v.extend_from_slice(&self.bytes);
        v.extend_from_slice(&self.len.to_le_bytes());
        v
    }

    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        if b.len() != Self::SERIALIZED_LEN {
            return Err(CommError::invalid(
                "handle",
                format!("expected {} bytes, got {}", Self::SERIALIZED_LEN, b.len()),
            ));
        }
        let mut bytes = [0u8; 64];
        bytes.copy_from_slice(&b[..64]);
        let len = u64_at(b, 64);
        Ok(Self { bytes, len })
    }
}

/// A peer's allocation mapped into this process (through CUDA IPC).
/// `Send + Sync` as [`DeviceMemory`] is.
#[derive(Debug)]
pub struct PeerMemory {
    device: Device,
    ptr: sys::CUdeviceptr,
    len: usize,
}

device_range_accessors!(PeerMemory);

impl PeerMemory {
    /// Maps `handle` (exported by another process) into `device`'s context.
    pub fn open(device: Device, handle: &IpcHandle) -> Result<Self> {
        device.make_current()?;
        let mut raw = sys::CUipcMemHandle { reserved: [0; 64] };
        for (c, b) in raw.reserved.iter_mut().zip(handle.bytes.iter()) {
            *c = *b as _;
        }
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: raw is a handle exported by cuIpcGetMemHandle in another process.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                raw,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()
        .call("cuIpcOpenMemHandle")?;
        Ok(Self {
            device,
            ptr,
            len: handle.len as usize,
        })
    }
}

impl Drop for PeerMemory {
    fn drop(&mut self) {
        if self.device.make_current().is_ok() {
            // SAFETY: ptr came from cuIpcOpenMemHandle and is closed exactly once.
            let closed = unsafe { sys::cuIpcCloseMemHandle(self.ptr) }.result();
            warn_if_failed("cuIpcCloseMemHandle", closed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_types_are_send_and_sync() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<DeviceMemory>();
        send_sync::<PeerMemory>();
        send_sync::<crate::vmm::VmmMemory>();
        send_sync::<crate::vmm::VmmMapping>();
    }

    #[test]
    fn ipc_handle_round_trip() {
        let mut bytes = [0u8; 64];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i * 7 + 3) as u8;
        }
        let h = IpcHandle {
            bytes,
            len: 0x1234_5678_9abc,
        };
        let s = h.to_bytes();
        assert_eq!(s.len(), IpcHandle::SERIALIZED_LEN);
        assert_eq!(IpcHandle::from_bytes(&s).unwrap(), h);
        assert!(IpcHandle::from_bytes(&s[1..]).is_err());
    }
}
