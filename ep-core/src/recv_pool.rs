//! The receive pool of a direct intranode dispatch (`MOELINK_INTRANODE_RECV=direct`):
//! one region per rank that every peer maps, from which the rank's `recv_x` is
//! allocated, so that the senders write each received row straight into the
//! output.
//!
//! - The pool's first [`HEADER_BYTES`] hold the header that `publish_barrier`
//!   writes before every direct dispatch (where this call's `recv_x` lies).
//! - The rest is handed out first fit, [`ALIGN`]-aligned, as [`Lease`]s: the
//!   front end wraps one into a tensor (DLPack) whose deleter drops the lease,
//!   which returns the range at once. No cache sits in between, so a range is
//!   either held by a live tensor or free.
//! - A request the pool cannot serve gets `None`: the front end allocates that
//!   `recv_x` as any tensor, and the dispatch receives it by a copy.
//! - Every lease holds the pool: its region is freed when the Buffer is gone
//!   and the last tensor of it has been freed.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use comm::symmetric::SymmetricRegion;

/// Bytes at the start of every pool that hold its header (and that no
/// allocation uses).
pub const HEADER_BYTES: u64 = 512;
/// Alignment of every range the pool hands out.
pub const ALIGN: u64 = 512;

/// Free ranges of `[HEADER_BYTES, len)`, first fit, coalesced on free.
#[derive(Debug)]
pub struct Ranges {
    /// start -> length of every free range, disjoint and never adjacent.
    free: BTreeMap<u64, u64>,
    len: u64,
    /// Bytes handed out.
    used: u64,
}

impl Ranges {
    pub fn new(len: u64) -> Ranges {
        let mut free = BTreeMap::new();
        if len > HEADER_BYTES {
            free.insert(HEADER_BYTES, len - HEADER_BYTES);
        }
        Ranges { free, len, used: 0 }
    }

    fn rounded(size: u64) -> Option<u64> {
        size.max(1).checked_next_multiple_of(ALIGN)
    }

    /// The offset of `size` bytes (rounded up to [`ALIGN`]), or `None` when no
    /// free range holds them.
    pub fn alloc(&mut self, size: u64) -> Option<u64> {
        let size = Self::rounded(size)?;
        let (&start, &len) = self.free.iter().find(|(_, &len)| len >= size)?;
        self.free.remove(&start);
        if len > size {
            self.free.insert(start + size, len - size);
        }
        self.used += size;
        Some(start)
    }

    /// Returns the range that [`alloc`](Self::alloc) handed out at `start` for
    /// `size` bytes. A range it did not hand out is refused (`false`).
    pub fn free(&mut self, start: u64, size: u64) -> bool {
        let Some(size) = Self::rounded(size) else {
            return false;
        };
        let end = start + size;
        if start < HEADER_BYTES || end > self.len || size > self.used {
            return false;
        }
        // Overlapping a free range: not a range handed out.
        if let Some((&s, &l)) = self.free.range(..end).next_back() {
            if s + l > start {
                return false;
            }
        }
        let (mut s, mut e) = (start, end);
        if let Some((&ps, &pl)) = self.free.range(..start).next_back() {
            if ps + pl == start {
                self.free.remove(&ps);
                s = ps;
            }
        }
        if let Some(&nl) = self.free.get(&end) {
            self.free.remove(&end);
            e = end + nl;
        }
        self.free.insert(s, e - s);
        self.used -= size;
        true
    }

    /// Bytes handed out and not yet returned.
    pub fn used(&self) -> u64 {
        self.used
    }
}

/// One rank's receive pool (its region mapped by every peer).
#[derive(Debug)]
pub struct RecvPool {
    region: SymmetricRegion,
    ranges: Mutex<Ranges>,
}

/// Pools alive in this process.
static LIVE: AtomicUsize = AtomicUsize::new(0);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl RecvPool {
    /// A pool over `region` (allocated by every rank of its Communicator,
    /// each rank's copy mapped by every other).
    pub fn new(region: SymmetricRegion) -> Arc<RecvPool> {
        LIVE.fetch_add(1, Ordering::Relaxed);
        Arc::new(RecvPool {
            ranges: Mutex::new(Ranges::new(region.len())),
            region,
        })
    }

    /// This rank's pool: base address and length.
    pub fn range(&self) -> (u64, u64) {
        (self.region.ptr(), self.region.len())
    }

    /// `bytes` at `ptr` lie inside the allocatable part of this pool: their
    /// offset from the pool's base.
    pub fn offset_of(&self, ptr: u64, bytes: u64) -> Option<u64> {
        let (base, len) = self.range();
        let off = ptr.checked_sub(base + HEADER_BYTES)? + HEADER_BYTES;
        (off.checked_add(bytes)? <= len).then_some(off)
    }

    /// Bytes held by leases.
    pub fn used(&self) -> u64 {
        lock(&self.ranges).used()
    }

    /// `bytes` (at least 1) of the pool until the lease is dropped, or `None`
    /// when no free range holds them.
    pub fn lease(self: &Arc<Self>, bytes: u64) -> Option<Lease> {
        let offset = lock(&self.ranges).alloc(bytes)?;
        Some(Lease {
            pool: self.clone(),
            offset,
            bytes,
        })
    }
}

impl Drop for RecvPool {
    fn drop(&mut self) {
        LIVE.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A range of a [`RecvPool`], returned when dropped.
#[derive(Debug)]
pub struct Lease {
    pool: Arc<RecvPool>,
    offset: u64,
    bytes: u64,
}

impl Lease {
    /// The range's device address.
    pub fn ptr(&self) -> u64 {
        self.pool.region.ptr() + self.offset
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Keeps the first `bytes` (at most what the lease holds, at least 1) and
    /// returns the rest of the range to the pool.
    pub fn truncate(&mut self, bytes: u64) {
        let bytes = bytes.clamp(1, self.bytes);
        let (keep, had) = (
            Ranges::rounded(bytes).unwrap_or(u64::MAX),
            Ranges::rounded(self.bytes).unwrap_or(u64::MAX),
        );
        if keep < had {
            let ok = lock(&self.pool.ranges).free(self.offset + keep, had - keep);
            debug_assert!(ok, "the tail of a lease is its own");
        }
        self.bytes = bytes;
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let ok = lock(&self.pool.ranges).free(self.offset, self.bytes);
        debug_assert!(ok, "a lease returns the range it was given");
    }
}

/// Receive pools alive in this process (held by a Buffer or a tensor).
pub fn live_pools() -> usize {
    LIVE.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Frees `held` (offset, bytes requested) and checks that the pool of
    /// `bytes` past its header came back whole: nothing used, and all of it
    /// one range again (coalesced).
    fn free_all_comes_back_whole(r: &mut Ranges, held: &[(u64, u64)], bytes: u64) {
        for &(o, s) in held {
            assert!(r.free(o, s), "({o}, {s}) was handed out");
        }
        assert_eq!(r.used(), 0);
        assert_eq!(r.alloc(bytes), Some(HEADER_BYTES));
    }

    #[test]
    fn first_fit_aligned_and_coalesced() {
        let mut r = Ranges::new(HEADER_BYTES + 4096);
        let a = r.alloc(1).unwrap();
        assert_eq!(a, HEADER_BYTES, "the header is never handed out");
        let b = r.alloc(600).unwrap();
        assert_eq!(b, HEADER_BYTES + 512, "rounded up to 512");
        let c = r.alloc(512).unwrap();
        assert_eq!(c, HEADER_BYTES + 1536);
        assert_eq!(r.used(), 2048);
        assert_eq!(r.alloc(2049), None, "2048 bytes are left");
        assert!(r.free(b, 600));
        // The hole of 1024 serves a 1024 request before the tail does.
        assert_eq!(r.alloc(1000), Some(b));
        free_all_comes_back_whole(&mut r, &[(b, 1000), (a, 1), (c, 512)], 4096);
    }

    #[test]
    fn a_cut_range_returns_its_tail() {
        let mut r = Ranges::new(HEADER_BYTES + 8192);
        let a = r.alloc(4096).unwrap();
        let b = r.alloc(1024).unwrap();
        // What Lease::truncate does: the tail of `a` past 1000 bytes (rounded to 1024).
        assert!(r.free(a + 1024, 3072));
        assert_eq!(r.used(), 2048);
        assert_eq!(r.alloc(3072), Some(a + 1024), "the tail is free again");
        free_all_comes_back_whole(&mut r, &[(a + 1024, 3072), (a, 1000), (b, 1024)], 8192);
    }

    #[test]
    fn refuses_ranges_it_did_not_hand_out() {
        let mut r = Ranges::new(HEADER_BYTES + 8192);
        let a = r.alloc(1024).unwrap();
        assert!(!r.free(0, 512), "the header");
        assert!(!r.free(a + 2048, 512), "a free range");
        assert!(!r.free(HEADER_BYTES + 8192, 512), "past the end");
        assert!(r.free(a, 1024));
        assert!(!r.free(a, 1024), "twice");
        assert_eq!(r.used(), 0);
    }

    #[test]
    fn many_sizes_come_back_whole() {
        let len = HEADER_BYTES + (1 << 20);
        let mut r = Ranges::new(len);
        let mut held = Vec::new();
        let mut x = 12345u64;
        for i in 0..400 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let size = 1 + (x >> 40) % 20000;
            if let Some(off) = r.alloc(size) {
                assert_eq!(off % ALIGN, 0);
                assert!(off + size <= len);
                for &(o, s) in &held {
                    let s = Ranges::rounded(s).unwrap();
                    assert!(off + size <= o || o + s <= off, "overlap");
                }
                held.push((off, size));
            }
            if i % 3 == 0 && !held.is_empty() {
                let (o, s) = held.remove((x as usize) % held.len());
                assert!(r.free(o, s));
            }
        }
        free_all_comes_back_whole(&mut r, &held, 1 << 20);
    }
}
