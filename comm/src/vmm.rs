//! GPU memory through the CUDA virtual memory API: physical allocations
//! created shareable as POSIX file descriptors (`cuMemCreate`), mapped into a
//! reserved address range; peers import the descriptor and map the same
//! physical memory. RAII: [`VmmMemory`] and [`VmmMapping`] unmap, release and
//! free everything they created on drop, and an exported descriptor is an
//! [`OwnedFd`] the caller closes (by dropping it) once it was handed over.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use cudarc::driver::sys;

use crate::cuda::{warn_if_failed, Device};
use crate::error::{CommError, CudaResultExt, Result};
use crate::memory::{device_range_accessors, prepare_alloc};

fn prop(device: Device) -> sys::CUmemAllocationProp {
    // SAFETY: all-zero is a valid bit pattern for this plain C struct.
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.requestedHandleTypes =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    p.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = device.ordinal;
    p
}

/// The allocation granularity of `device` (sizes are rounded up to it).
pub fn granularity(device: Device) -> Result<usize> {
    let p = prop(device);
    let mut g = 0usize;
    // SAFETY: p is a valid property struct; g receives the value.
    unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut g,
            &p,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        )
    }
    .result()
    .call("cuMemGetAllocationGranularity")?;
    Ok(g.max(1))
}

/// Maps `handle` at a newly reserved range of `len` bytes readable and
/// writable by `device`. Undoes its own steps on failure.
fn map(device: Device, handle: sys::CUmemGenericAllocationHandle, len: usize) -> Result<u64> {
    let align = granularity(device)?;
    let mut ptr = 0;
    // SAFETY: reserves a fresh range; no existing mapping is touched.
    unsafe { sys::cuMemAddressReserve(&mut ptr, len, align, 0, 0) }
        .result()
        .call("cuMemAddressReserve")?;
    // SAFETY: ptr..ptr+len was just reserved; handle is a live allocation of >= len bytes.
    if let Err(e) = unsafe { sys::cuMemMap(ptr, len, 0, handle, 0) }.result() {
        // SAFETY: the range was reserved above and is not mapped.
        unsafe { sys::cuMemAddressFree(ptr, len) };
        return Err(CommError::Cuda {
            call: "cuMemMap",
            source: e,
        });
    }
    let desc = sys::CUmemAccessDesc {
        location: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device.ordinal,
        },
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: the range is mapped; desc names this process's device.
    if let Err(e) = unsafe { sys::cuMemSetAccess(ptr, len, &desc, 1) }.result() {
        // SAFETY: undo the map and reservation made above.
        unsafe {
            sys::cuMemUnmap(ptr, len);
            sys::cuMemAddressFree(ptr, len);
        }
        return Err(CommError::Cuda {
            call: "cuMemSetAccess",
            source: e,
        });
    }
    Ok(ptr)
}

fn unmap(ptr: u64, len: usize) {
    // SAFETY: ptr..ptr+len was mapped by `map` and is released exactly once.
    unsafe {
        warn_if_failed("cuMemUnmap", sys::cuMemUnmap(ptr, len).result());
        warn_if_failed("cuMemAddressFree", sys::cuMemAddressFree(ptr, len).result());
    }
}

/// GPU memory of this process, shareable with peers as a file descriptor. Its
/// length is a multiple of the granularity. `Send + Sync`: handles and
/// addresses are process-wide, and all uses bind the device first.
#[derive(Debug)]
pub struct VmmMemory {
    device: Device,
    handle: sys::CUmemGenericAllocationHandle,
    ptr: u64,
    len: usize,
}

device_range_accessors!(VmmMemory, device);

impl VmmMemory {
    /// Allocates at least `len` bytes (rounded up to the granularity) on `device`.
    pub fn alloc(device: Device, len: usize) -> Result<Self> {
        prepare_alloc(device, len)?;
        let g = granularity(device)?;
        let len = len.div_ceil(g) * g;
        let p = prop(device);
        let mut handle = 0;
        // SAFETY: p describes pinned device memory on `device`; handle receives it.
        unsafe { sys::cuMemCreate(&mut handle, len, &p, 0) }
            .result()
            .call("cuMemCreate")?;
        match map(device, handle, len) {
            Ok(ptr) => Ok(Self {
                device,
                handle,
                ptr,
                len,
            }),
            Err(e) => {
                // SAFETY: handle was created above and is not mapped.
                unsafe { sys::cuMemRelease(handle) };
                Err(e)
            }
        }
    }

    /// A new file descriptor for the allocation, for a peer to import. Dropping
    /// the returned fd closes this process's copy.
    pub fn export_fd(&self) -> Result<OwnedFd> {
        let mut fd: i32 = -1;
        // SAFETY: handle is live and was created with the POSIX-fd handle type.
        unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut i32).cast(),
                self.handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        }
        .result()
        .call("cuMemExportToShareableHandle")?;
        // SAFETY: the driver returned a new descriptor that we now own.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

impl Drop for VmmMemory {
    fn drop(&mut self) {
        if self.device.make_current().is_ok() {
            unmap(self.ptr, self.len);
            // SAFETY: handle was created by cuMemCreate and is released once.
            warn_if_failed(
                "cuMemRelease",
                unsafe { sys::cuMemRelease(self.handle) }.result(),
            );
        }
    }
}

/// A peer's [`VmmMemory`] mapped into this process (`Send + Sync` as that is).
#[derive(Debug)]
pub struct VmmMapping {
    device: Device,
    ptr: u64,
    len: usize,
}

device_range_accessors!(VmmMapping);

impl VmmMapping {
    /// Imports the allocation behind `fd` (`len` bytes, as exported) and maps it
    /// for `device`. The fd is closed on return; the mapping keeps the memory.
    pub fn import(device: Device, fd: OwnedFd, len: usize) -> Result<Self> {
        device.make_current()?;
        let mut handle = 0;
        // SAFETY: fd is an open descriptor exported by cuMemExportToShareableHandle;
        // the API takes it as a pointer-sized integer.
        unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                fd.as_raw_fd() as usize as *mut std::ffi::c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        }
        .result()
        .call("cuMemImportFromShareableHandle")?;
        drop(fd);
        let mapped = map(device, handle, len);
        // The mapping (if any) holds the memory; the imported handle goes now.
        // SAFETY: handle was imported above and is released once.
        unsafe { sys::cuMemRelease(handle) };
        Ok(Self {
            device,
            ptr: mapped?,
            len,
        })
    }
}

impl Drop for VmmMapping {
    fn drop(&mut self) {
        if self.device.make_current().is_ok() {
            unmap(self.ptr, self.len);
        }
    }
}
