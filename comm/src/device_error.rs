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

    /// Ok while nothing was reported; else the recorded failure as an error.
    /// A rejected argument (not a timeout) is reported once: the record is
    /// cleared, so the caller can go on with good arguments; a timeout stays,
    /// since the ranks are out of step.
    pub fn check(&self) -> Result<()> {
        match self.read() {
            None => Ok(()),
            Some(e) => {
                if e.code != ERROR_TIMEOUT {
                    self.reset();
                }
                Err(describe(&e))
            }
        }
    }

    /// Like [`check`](Self::check), for a timeout only (kept); a rejected
    /// argument stays recorded for the next full check.
    pub fn check_timeout(&self) -> Result<()> {
        match self.read() {
            Some(e) if e.code == ERROR_TIMEOUT => Err(describe(&e)),
            _ => Ok(()),
        }
    }

    /// Tests: fills the record as a kernel would.
    #[cfg(test)]
    pub(crate) fn record_for_test(&self, e: DeviceError) {
        // SAFETY: the record's memory holds exactly one DeviceError; tests
        // write it while no kernel runs.
        unsafe { std::ptr::write_volatile(self.mem.as_ptr() as *mut DeviceError, e) };
        std::sync::atomic::fence(Ordering::SeqCst);
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
    if kind == Some(WaitKind::InvalidExpertId) {
        let observed = e.observed as i64;
        return CommError::invalid(
            "topk_idx",
            format!(
                "rank {}: token {}, column {} holds expert id {observed}, outside [-1, {}) \
                 (found on the GPU)",
                e.rank,
                e.id >> 8,
                e.id & 0xff,
                e.expected
            ),
        );
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device_handles::ERROR_INVALID;

    /// A record holding `(code, kind, rank, peer, id, expected, observed)`.
    fn record_with(
        (code, kind, rank, peer, id, expected, observed): (u32, WaitKind, i32, i32, u64, u64, u64),
    ) -> DeviceErrorRecord {
        let r = DeviceErrorRecord::new(None).unwrap();
        r.record_for_test(DeviceError {
            code,
            kind: kind as u32,
            rank,
            peer,
            id,
            expected,
            observed,
        });
        r
    }

    #[test]
    fn a_bad_expert_id_names_token_column_and_value_once() {
        let r = record_with((
            ERROR_INVALID,
            WaitKind::InvalidExpertId,
            3,
            -1,
            (17 << 8) | 5,
            64,
            (-7i64) as u64,
        ));
        let msg = r.check().unwrap_err().to_string();
        assert!(msg.contains("topk_idx"), "{msg}");
        assert!(
            msg.contains("rank 3: token 17, column 5 holds expert id -7"),
            "{msg}"
        );
        assert!(msg.contains("[-1, 64)"), "{msg}");
        // Reported once: the record is clear for the next call.
        assert!(r.check().is_ok());
    }

    #[test]
    fn a_timeout_stays_recorded() {
        let r = record_with((ERROR_TIMEOUT, WaitKind::Semaphore, 1, 0, 2, 5, 4));
        assert!(matches!(r.check(), Err(CommError::Timeout { rank: 1, .. })));
        assert!(r.check().is_err());
        assert!(r.check_timeout().is_err());
    }

    #[test]
    fn every_wait_kind_has_a_description_and_a_poisoned_partial_names_its_forwarder() {
        for v in 1..=16 {
            let k = WaitKind::from_u32(v).unwrap_or_else(|| panic!("kind {v}"));
            assert_eq!(k as u32, v);
            assert!(!k.describe().is_empty());
        }
        assert_eq!(WaitKind::from_u32(17), None);
        let flag = (0x4d4c4e4b_u64 << 32) | 9;
        let r = record_with((
            ERROR_TIMEOUT,
            WaitKind::InternodePoisoned,
            0,
            6,
            (3 << 32) | 40,
            flag,
            flag | 1 << 63,
        ));
        let msg = r.check().unwrap_err().to_string();
        assert!(msg.contains("rank 0"), "{msg}");
        assert!(msg.contains("poison") || msg.contains("NaN"), "{msg}");
        assert!(msg.contains("from rank 6"), "{msg}");
    }

    #[test]
    fn check_timeout_leaves_a_bad_argument_for_the_full_check() {
        let r = record_with((
            ERROR_INVALID,
            WaitKind::InvalidExpertId,
            0,
            -1,
            1 << 8,
            8,
            8,
        ));
        assert!(r.check_timeout().is_ok());
        assert!(r.check().is_err());
        assert!(r.check().is_ok());
    }
}
