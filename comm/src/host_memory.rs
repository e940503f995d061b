//! Host memory the GPU can reach: page-locked and mapped into the device's
//! address space (`cuMemHostAlloc` with DEVICEMAP | PORTABLE). The FIFO ring,
//! its tail and the device error records live here. Without a GPU (CPU tests of
//! the FIFO and proxy logic) the same type wraps ordinary zeroed heap memory.
//! [`HostMemory::shared`] / [`HostMemory::import_shared`]: memory shared between
//! the processes of one host (a memfd), registered with the device.

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
    /// A `MAP_SHARED` mapping of a memfd, registered with `Some` device.
    Shared(Option<Device>),
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
            Backing::Shared(device) => {
                if let Some(d) = device {
                    if d.make_current().is_ok() {
                        // SAFETY: registered in map_shared and unregistered once.
                        warn_if_failed("cuMemHostUnregister", unsafe {
                            sys::cuMemHostUnregister(self.ptr.cast()).result()
                        });
                    }
                }
                // SAFETY: our mapping of len bytes, unmapped once.
                unsafe { libc::munmap(self.ptr.cast(), self.len) };
            }
        }
    }
}

impl HostMemory {
    /// `len` bytes (rounded up to whole pages) of new, zeroed memory shared
    /// between the processes of one host (a memfd mapped `MAP_SHARED`),
    /// page-locked and mapped for `device` if given (`cuMemHostRegister` with
    /// DEVICEMAP | PORTABLE), and its fd.
    ///
    /// The owner hands the fd out (through the fd server) until every peer on
    /// the host mapped the same pages ([`HostMemory::import_shared`]); neither
    /// side keeps an fd open afterwards (a mapping outlives its fd). Both CPUs
    /// can then store into it directly and both GPUs can read it. Used for the
    /// inbound counters of CUDA IPC port channels: the peer's proxy signals with
    /// a plain CPU store instead of a stream memory operation.
    pub fn shared(device: Option<Device>, len: usize) -> Result<(Self, std::os::fd::OwnedFd)> {
        use std::os::fd::FromRawFd;
        let page = page_size();
        let len = len.max(1).div_ceil(page) * page;
        // SAFETY: a NUL-terminated name; the returned fd (if any) is ours.
        let raw = unsafe { libc::memfd_create(c"moelink-signals".as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(io_error("memfd_create"));
        }
        // SAFETY: raw is a fresh fd we own.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) };
        // SAFETY: fd is a memfd; the new size reads as zeros.
        if unsafe { libc::ftruncate(raw, len as libc::off_t) } != 0 {
            return Err(io_error("ftruncate of the shared signal memory"));
        }
        let m = Self::map_shared(device, &fd, len)?;
        Ok((m, fd))
    }

    /// Maps the shared memory behind `fd` (`len` bytes, from the owner's
    /// [`HostMemory::shared`]), registered with `device` if given.
    pub fn import_shared(
        device: Option<Device>,
        fd: std::os::fd::OwnedFd,
        len: usize,
    ) -> Result<Self> {
        use std::os::fd::AsRawFd;
        // SAFETY: an all-zero stat is a valid out-parameter.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fd is open; st is a valid out-parameter.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(io_error("fstat of a peer's shared signal memory"));
        }
        if (st.st_size as u64) < len as u64 || len == 0 {
            return Err(CommError::invalid(
                "shared host memory",
                format!("{len} bytes announced, the fd holds {}", st.st_size),
            ));
        }
        Self::map_shared(device, &fd, len)
    }

    fn map_shared(device: Option<Device>, fd: &std::os::fd::OwnedFd, len: usize) -> Result<Self> {
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh shared mapping of len bytes of fd (checked to be that long).
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io_error("mmap of the shared signal memory"));
        }
        // From here on, drop unmaps (and unregisters once `Shared(Some)`).
        let mut m = Self {
            ptr: p.cast(),
            len,
            device_ptr: 0,
            backing: Backing::Shared(None),
        };
        if let Some(d) = device {
            d.make_current()?;
            let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
            // SAFETY: p..p+len is our mapping; it stays mapped until drop,
            // which unregisters first.
            unsafe { sys::cuMemHostRegister_v2(p, len, flags) }
                .result()
                .call("cuMemHostRegister")?;
            m.backing = Backing::Shared(Some(d));
            let mut dptr = 0;
            // SAFETY: p was registered with DEVICEMAP just above.
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dptr, p, 0) }
                .result()
                .call("cuMemHostGetDevicePointer")?;
            m.device_ptr = dptr;
        }
        Ok(m)
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    (unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).max(4096) as usize
}

fn io_error(what: &str) -> CommError {
    CommError::Io {
        context: what.into(),
        source: std::io::Error::last_os_error(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn shared_memory_is_seen_through_an_imported_mapping() {
        let (a, fd) = HostMemory::shared(None, 100).unwrap();
        assert_eq!(a.len(), page_size());
        assert_eq!(a.device_ptr(), 0);
        assert_eq!(a.atomic_u64(64).load(Ordering::Relaxed), 0, "zero-filled");
        let dup = fd.try_clone().unwrap();
        let b = HostMemory::import_shared(None, fd, a.len()).unwrap();
        assert_ne!(a.as_ptr(), b.as_ptr(), "a second mapping of the same pages");
        a.atomic_u64(64).store(7, Ordering::Release);
        assert_eq!(b.atomic_u64(64).load(Ordering::Acquire), 7);
        b.atomic_u64(8).store(9, Ordering::Release);
        drop(b);
        assert_eq!(a.atomic_u64(8).load(Ordering::Acquire), 9);
        assert!(HostMemory::import_shared(None, dup, a.len() + 1).is_err());
    }
}
