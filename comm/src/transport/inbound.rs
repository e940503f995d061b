//! Operations a peer asks the owner of memory to apply: what the Ethernet
//! receiver does for every frame, and what the IB receiving proxy does for a
//! write with immediate (a `host-no-atomic` signal, a 32-bit add). Both run
//! this code: [`Regions`] checks the target against what the owner
//! registered and applies the operation to host memory (plain copies, real
//! atomics) or GPU memory (on the caller's [`ApplyStreams`], bounded wait).
//!
//! GPU operations on memory mapped process-wide (cuMem) go on a stream of the
//! proxies' own context ([`Device::proxy_context`]), as CUDA IPC's puts do:
//! in the primary context they can be held back while another call of the
//! process waits on the GPU there (the internode stall), and the kernel waiting for them
//! spins out its bound. Other device memory (a `cuMemAlloc` registration)
//! belongs to the primary context and goes on a stream there.
//!
//! | operation | host memory | GPU memory |
//! |---|---|---|
//! | write | copy | `cuMemcpyHtoDAsync` + bounded stream sync |
//! | set (signal) | `AtomicU64` store (release) | 8-byte copy, after the earlier operations completed |
//! | add | `AtomicU64` / `AtomicU32` `fetch_add` | `kernels::atomic_add` + bounded stream sync |

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{PoisonError, RwLock};
use std::time::Duration;

use cudarc::driver::sys;

use crate::cuda::{Device, OwnedStream};
use crate::error::{CommError, CudaResultExt, Result};
use crate::registered_memory::Location;
use crate::transport::AtomicWidth;

/// Bound of the wait for one GPU operation.
pub const GPU_TIMEOUT: Duration = Duration::from_secs(10);

/// One operation on the owner's memory, at the owner's address `ptr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op<'a> {
    Write {
        ptr: u64,
        data: &'a [u8],
    },
    /// Store a u64 (a semaphore signal).
    Set {
        ptr: u64,
        value: u64,
    },
    /// Atomic add to an integer of `width` (a 32-bit add adds `value as i32`).
    Add {
        ptr: u64,
        value: i64,
        width: AtomicWidth,
    },
}

impl Op<'_> {
    fn name(&self) -> &'static str {
        match self {
            Op::Write { .. } => "write",
            Op::Set { .. } => "signal",
            Op::Add { .. } => "atomic add",
        }
    }

    /// Target address and length.
    fn target(&self) -> (u64, u64) {
        match *self {
            Op::Write { ptr, data } => (ptr, data.len() as u64),
            Op::Set { ptr, .. } => (ptr, 8),
            Op::Add { ptr, width, .. } => (ptr, width.bytes()),
        }
    }
}

/// Why an operation was not applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ApplyError {
    /// Not allowed (outside every registered region, misaligned, on a GPU
    /// this owner does not serve): nothing was touched.
    Rejected(String),
    /// Applying it failed (a CUDA error, a timeout).
    Failed(String),
}

impl std::fmt::Display for ApplyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ApplyError::Rejected(m) | ApplyError::Failed(m) => f.write_str(m),
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Region {
    len: u64,
    location: Location,
    /// Addressable from the proxies' own context (see the module docs).
    process_wide: bool,
}

/// The streams one applying thread puts its GPU operations on, each made at
/// its first use: the proxies' own context's for process-wide memory, the
/// primary context's for the rest. Every operation completes before `apply`
/// returns, so the thread's operations land in order across the two.
#[derive(Debug, Default)]
pub struct ApplyStreams {
    own: Option<OwnedStream>,
    primary: Option<OwnedStream>,
}

impl ApplyStreams {
    fn for_target(&mut self, dev: Device, process_wide: bool) -> Result<&OwnedStream> {
        let dev = dev.proxy_context_or_primary(process_wide, "peers' operations on GPU memory");
        let slot = if dev.is_proxy_context() {
            &mut self.own
        } else {
            &mut self.primary
        };
        if slot.is_none() {
            *slot = Some(OwnedStream::new(dev)?);
        }
        Ok(slot.as_ref().expect("made above"))
    }
}

/// The memory an owner lets peers touch, and how it applies their operations.
#[derive(Debug)]
pub struct Regions {
    rank: usize,
    device: Option<Device>,
    /// By start address. `apply` holds the read lock while it touches
    /// memory, so once `unregister` returns nothing lands there.
    map: RwLock<BTreeMap<u64, Region>>,
}

impl Regions {
    /// `rank`: the owner (for messages); `device`: the GPU whose memory it
    /// may register (None: host memory only).
    pub fn new(rank: usize, device: Option<Device>) -> Self {
        Self {
            rank,
            device,
            map: RwLock::new(BTreeMap::new()),
        }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn device(&self) -> Option<Device> {
        self.device
    }

    /// Lets peers touch `[ptr, ptr + len)` (replacing a registration at
    /// `ptr`). Device memory registered here belongs to the primary context;
    /// cuMem memory goes through [`register_process_wide`](Self::register_process_wide).
    pub fn register(&self, ptr: u64, len: u64, location: Location) {
        self.insert(ptr, len, location, location == Location::Host);
    }

    /// [`register`](Self::register) for memory mapped process-wide (a cuMem
    /// allocation): its GPU operations go on the proxies' own context.
    pub fn register_process_wide(&self, ptr: u64, len: u64, location: Location) {
        self.insert(ptr, len, location, true);
    }

    fn insert(&self, ptr: u64, len: u64, location: Location, process_wide: bool) {
        let mut map = self.map.write().unwrap_or_else(PoisonError::into_inner);
        map.insert(
            ptr,
            Region {
                len,
                location,
                process_wide,
            },
        );
    }

    /// Removes the registration at `ptr`; once this returns, nothing lands there.
    pub fn unregister(&self, ptr: u64) {
        let mut map = self.map.write().unwrap_or_else(PoisonError::into_inner);
        map.remove(&ptr);
    }

    pub fn len(&self) -> usize {
        self.map.read().map(|m| m.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Applies `op` if it lies inside a registered region. GPU operations go
    /// on one of `streams` and complete before this returns.
    pub fn apply(
        &self,
        op: &Op,
        streams: &mut ApplyStreams,
    ) -> std::result::Result<(), ApplyError> {
        let (what, (ptr, len)) = (op.name(), op.target());
        let rejected = |m: String| ApplyError::Rejected(m);
        if !matches!(op, Op::Write { .. }) && ptr % len != 0 {
            return Err(rejected(format!(
                "{what} target {ptr:#x} is not {len}-byte aligned"
            )));
        }
        let map = self.map.read().unwrap_or_else(PoisonError::into_inner);
        let region = ptr.checked_add(len).and_then(|end| {
            let mut below = map.range(..=ptr).rev();
            below.find(|(start, r)| start.checked_add(r.len).is_some_and(|e| end <= e))
        });
        let Some((_, region)) = region else {
            return Err(rejected(format!(
                "{what} of {len} bytes at {ptr:#x} is not inside a region registered by rank {}",
                self.rank
            )));
        };
        let dev = match (region.location, self.device) {
            (Location::Host, _) => {
                // SAFETY: the target lies inside a registered host region,
                // which its owner keeps valid while registered; the read lock
                // keeps it registered; alignment was checked above.
                unsafe { apply_host(op) };
                return Ok(());
            }
            (Location::Device(d), Some(dev)) if dev.ordinal == d => dev,
            (Location::Device(d), _) => {
                return Err(rejected(format!(
                    "{what} target is on GPU {d}, which rank {} does not serve",
                    self.rank
                )))
            }
        };
        let failed = |e: CommError| ApplyError::Failed(format!("{what} at {ptr:#x}: {e}"));
        let stream = streams
            .for_target(dev, region.process_wide)
            .map_err(failed)?;
        apply_device(op, stream, self.rank).map_err(failed)
    }
}

/// Host memory: plain copies for writes, real atomics for signals and adds.
///
/// # Safety
/// The target of `op` is valid, aligned memory of this process.
unsafe fn apply_host(op: &Op) {
    match *op {
        // SAFETY: the caller's contract.
        Op::Write { ptr, data } => unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), ptr as *mut u8, data.len())
        },
        // SAFETY: as above, an aligned u64.
        Op::Set { ptr, value } => {
            unsafe { AtomicU64::from_ptr(ptr as *mut u64) }.store(value, Ordering::Release)
        }
        Op::Add {
            ptr,
            value,
            width: AtomicWidth::U64,
        } => {
            // SAFETY: as above, an aligned u64.
            unsafe { AtomicU64::from_ptr(ptr as *mut u64) }
                .fetch_add(value as u64, Ordering::AcqRel);
        }
        Op::Add { ptr, value, .. } => {
            // Truncation to 32 bits adds `value as i32`, like the GPU kernel.
            // SAFETY: as above, an aligned u32.
            unsafe { AtomicU32::from_ptr(ptr as *mut u32) }
                .fetch_add(value as u32, Ordering::AcqRel);
        }
    }
}

/// GPU memory: the operation goes on `stream` (in its context) and completes
/// (bounded wait) before this returns, so one caller's operations land in order.
fn apply_device(op: &Op, stream: &OwnedStream, rank: usize) -> Result<()> {
    let dev = stream.device();
    dev.make_current()?;
    let raw = stream.handle().raw();
    match *op {
        Op::Write { ptr, data } => {
            // SAFETY: the target range lies inside a registered GPU region of
            // `dev` (kept registered by the caller's read lock); the source
            // stays alive until the stream is synchronized below.
            unsafe { sys::cuMemcpyHtoDAsync_v2(ptr, data.as_ptr().cast(), data.len(), raw) }
                .result()
                .call("cuMemcpyHtoDAsync")?
        }
        Op::Set { ptr, value } => {
            // SAFETY: as above, for the aligned 8 bytes at ptr; `value`
            // outlives the sync.
            unsafe { sys::cuMemcpyHtoDAsync_v2(ptr, (&value as *const u64).cast(), 8, raw) }
                .result()
                .call("cuMemcpyHtoDAsync")?
        }
        // SAFETY: ptr is an aligned integer of the given width inside the region.
        Op::Add { ptr, value, width } => unsafe {
            crate::kernels::atomic_add(dev, stream.handle(), ptr, value, width == AtomicWidth::U64)
        }?,
    }
    stream.synchronize_bounded(GPU_TIMEOUT, rank as i64, "a peer's operation on its GPU")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_operations_land_inside_regions_only() {
        let mut mem = vec![0u64; 8];
        let base = mem.as_mut_ptr() as u64;
        let r = Regions::new(3, None);
        r.register(base, 64, Location::Host);
        let mut s = ApplyStreams::default();
        let data = [7u8; 8];
        r.apply(
            &Op::Write {
                ptr: base,
                data: &data,
            },
            &mut s,
        )
        .unwrap();
        r.apply(
            &Op::Set {
                ptr: base + 8,
                value: 9,
            },
            &mut s,
        )
        .unwrap();
        let add = |ptr, value, width| Op::Add { ptr, value, width };
        r.apply(&add(base + 16, -1, AtomicWidth::U64), &mut s)
            .unwrap();
        r.apply(&add(base + 24, -1, AtomicWidth::U32), &mut s)
            .unwrap();
        assert_eq!(mem[0], u64::from_le_bytes(data));
        assert_eq!((mem[1], mem[2]), (9, u64::MAX));
        assert_eq!(
            mem[3],
            u32::MAX as u64,
            "the 32-bit add leaves the high half"
        );
        let e = r
            .apply(&add(base + 60, 1, AtomicWidth::U64), &mut s)
            .unwrap_err();
        assert!(
            matches!(&e, ApplyError::Rejected(m) if m.contains("aligned")),
            "{e}"
        );
        let e = r
            .apply(
                &Op::Write {
                    ptr: base + 60,
                    data: &data,
                },
                &mut s,
            )
            .unwrap_err();
        assert!(e.to_string().contains("registered by rank 3"), "{e}");
        r.unregister(base);
        assert!(r.is_empty());
        assert!(r
            .apply(
                &Op::Set {
                    ptr: base,
                    value: 1
                },
                &mut s
            )
            .is_err());
        assert_eq!(mem[0], u64::from_le_bytes(data));
    }
}
