//! Host memory the GPU can reach: page-locked and mapped into the device's
//! address space (`cuMemHostAlloc` with DEVICEMAP | PORTABLE). The FIFO ring,
//! its tail and the device error records live here. Without a GPU (CPU tests of
//! the FIFO and proxy logic) the same type wraps ordinary zeroed heap memory.

use std::alloc::Layout;
use std::sync::atomic::{AtomicU32, AtomicU64};

use cudarc::driver::sys;

use crate::cuda::{warn_if_failed, Device};
use crate::error::{CommError, CudaResultExt, Result};
use crate::memory::prepare_alloc;

#[derive(Debug)]
enum Backing {
    Pinned,
    Heap(Layout),
}

/// Zero-initialised host memory, optionally mapped for a device.
#[derive(Debug)]
pub struct HostMemory {
    ptr: *mut u8,
    len: usize,
    device_ptr: u64,
    backing: Backing,
}

// SAFETY: plain memory; concurrent access goes through atomics by the users.
unsafe impl Send for HostMemory {}
// SAFETY: as above.
unsafe impl Sync for HostMemory {}

impl HostMemory {
    /// Page-locked memory mapped into `device`'s address space.
    pub fn pinned(device: Device, len: usize) -> Result<Self> {
        prepare_alloc(device, len)?;
        let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: p receives a new allocation of len bytes.
        unsafe { sys::cuMemHostAlloc(&mut p, len, flags) }
            .result()
            .call("cuMemHostAlloc")?;
        // SAFETY: p is a fresh allocation of len bytes.
        unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, len) };
        let mut dptr = 0;
        // SAFETY: p was allocated with DEVICEMAP in the current context.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, p, 0) }.result();
        if let Err(e) = r {
            // SAFETY: p came from cuMemHostAlloc above.
            unsafe { sys::cuMemFreeHost(p) };
            return Err(CommError::Cuda {
                call: "cuMemHostGetDevicePointer",
                source: e,
            });
        }
        Ok(Self {
            ptr: p.cast(),
            len,
            device_ptr: dptr,
            backing: Backing::Pinned,
        })
    }

    /// Ordinary heap memory (64-byte aligned) with no device mapping.
    pub fn heap(len: usize) -> Self {
        let layout = Layout::from_size_align(len.max(1), 64).expect("valid layout");
        // SAFETY: layout has non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null(), "out of host memory allocating {len} bytes");
        Self {
            ptr,
            len,
            device_ptr: 0,
            backing: Backing::Heap(layout),
        }
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address kernels use for this memory (0 for heap memory).
    pub fn device_ptr(&self) -> u64 {
        self.device_ptr
    }

    /// An atomic view of the u64 at byte `offset` (8-byte aligned, in range).
    pub fn atomic_u64(&self, offset: usize) -> &AtomicU64 {
        // SAFETY: AtomicU64 is an integer type whose alignment is its size.
        unsafe { self.atomic_at(offset, "u64") }
    }

    /// An atomic view of the u32 at byte `offset` (4-byte aligned, in range).
    pub fn atomic_u32(&self, offset: usize) -> &AtomicU32 {
        // SAFETY: AtomicU32 is an integer type whose alignment is its size.
        unsafe { self.atomic_at(offset, "u32") }
    }

    /// The `A` at byte `offset`, which must be aligned to `A`'s size and in
    /// range (panics naming `what` otherwise).
    ///
    /// # Safety
    /// `A` must be an atomic integer type: valid for any bit pattern, with
    /// alignment equal to its size.
    unsafe fn atomic_at<A>(&self, offset: usize, what: &str) -> &A {
        let size = std::mem::size_of::<A>();
        assert!(
            offset % size == 0 && offset + size <= self.len,
            "{what} at {offset} of {}",
            self.len
        );
        // SAFETY: in range, aligned (base is page- or 64-aligned, offset a
        // multiple of the size), lives as long as &self.
        unsafe { &*(self.ptr.add(offset) as *const A) }
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        match self.backing {
            // SAFETY: ptr came from cuMemHostAlloc and is freed once.
            Backing::Pinned => unsafe {
                warn_if_failed(
                    "cuMemFreeHost",
                    sys::cuMemFreeHost(self.ptr.cast()).result(),
                );
            },
            // SAFETY: ptr came from alloc_zeroed with this layout.
            Backing::Heap(layout) => unsafe { std::alloc::dealloc(self.ptr, layout) },
        }
    }
}
