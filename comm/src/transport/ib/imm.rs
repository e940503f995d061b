//! Signals and counter adds as write-with-immediate: the `host-no-atomic`
//! signalling mode, and every 32-bit add (IB atomics are 64-bit only, and a
//! 32-bit counter is never the target of a 64-bit atomic).
//!
//! The sender writes a 32-byte [`Record`] (what to do, where, which value)
//! into the next slot of the receiver's record ring, as the payload of a
//! write with immediate; the receiving proxy finds the slot by the record's
//! sequence number and applies it ([`crate::transport::inbound`]). One queue
//! pair delivers in order, so data written earlier on it, and the record
//! itself, are in place when the receive completion arrives: data before
//! signal. The Ethernet transport carries the same (immediate, record) pair
//! in a frame, and its receiver runs the same [`decode`] and apply.
//!
//! The immediate (host order here; verbs carries `imm_data` in network byte
//! order, which the native binding converts): bits 30..32 the kind (0 set,
//! 1 add; 2 and 3 are invalid), bits 0..30 the low 30 bits of the record's
//! sequence number, checked against the receiver's count.

use crate::error::{CommError, Result};
use crate::transport::inbound::Op;
use crate::transport::AtomicWidth;
use crate::wire::u64_at;

const KIND_SHIFT: u32 = 30;
/// The sequence bits an immediate carries.
pub const SEQ_MASK: u32 = (1 << KIND_SHIFT) - 1;
/// Bytes of one record.
pub const RECORD_BYTES: usize = 32;

/// What a record asks the receiving proxy to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Store `value` in the u64 at `target` (a semaphore signal: the
    /// sender's count, so a lost or repeated store cannot skew it).
    Set,
    /// Atomically add `value` to the integer of `width` at `target`.
    Add(AtomicWidth),
}

/// One operation for the receiver: the `seq`-th record of its sender on this
/// queue pair (or connection), on the receiver's memory at `target` (its own
/// address, which its region table checks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record {
    pub seq: u64,
    pub target: u64,
    pub value: u64,
    pub action: Action,
}

impl Record {
    /// The immediate that goes with this record.
    pub fn imm(&self) -> u32 {
        let kind = match self.action {
            Action::Set => 0,
            Action::Add(_) => 1,
        };
        (kind << KIND_SHIFT) | (self.seq as u32 & SEQ_MASK)
    }

    /// `seq u64 | target u64 | value u64 | kind u8 | width u8 | 0 x6`,
    /// little-endian.
    pub fn to_bytes(&self) -> [u8; RECORD_BYTES] {
        let mut b = [0u8; RECORD_BYTES];
        b[0..8].copy_from_slice(&self.seq.to_le_bytes());
        b[8..16].copy_from_slice(&self.target.to_le_bytes());
        b[16..24].copy_from_slice(&self.value.to_le_bytes());
        (b[24], b[25]) = match self.action {
            Action::Set => (0, 8),
            Action::Add(w) => (1, w.bytes() as u8),
        };
        b
    }
}

/// The operation of immediate `imm` with record bytes `record`, which must
/// be record number `expected` of `peer` on this link: checks that they
/// agree (kind, sequence), that the width is 4 or 8 (a set: 8) and that the
/// target is aligned to it. Every failure is an `Rdma` error naming `peer`.
pub fn decode(imm: u32, record: &[u8], expected: u64, peer: usize) -> Result<Op<'static>> {
    let bad = |what: String| CommError::Rdma { peer, what };
    let kind = imm >> KIND_SHIFT;
    if kind > 1 {
        return Err(bad(format!(
            "immediate {imm:#010x} has kind {kind}, which no sender writes"
        )));
    }
    if imm & SEQ_MASK != expected as u32 & SEQ_MASK {
        return Err(bad(format!(
            "immediate {imm:#010x} is out of sequence: record {expected} was due"
        )));
    }
    let b: &[u8; RECORD_BYTES] = record.try_into().map_err(|_| {
        bad(format!(
            "a signal record of {} bytes, expected {RECORD_BYTES}",
            record.len()
        ))
    })?;
    let seq = u64_at(b, 0);
    if seq != expected || b[24] as u32 != kind {
        return Err(bad(format!(
            "signal record {seq} (kind {}) does not match immediate {imm:#010x}; record \
             {expected} was due",
            b[24]
        )));
    }
    let (ptr, value) = (u64_at(b, 8), u64_at(b, 16));
    let width = match b[25] {
        4 => AtomicWidth::U32,
        8 => AtomicWidth::U64,
        w => return Err(bad(format!("a signal record of width {w} bytes (4 or 8)"))),
    };
    if ptr % width.bytes() != 0 {
        return Err(bad(format!(
            "a {}-byte update at {ptr:#x}, not aligned to its width",
            width.bytes()
        )));
    }
    Ok(match kind {
        0 if width == AtomicWidth::U64 => Op::Set { ptr, value },
        0 => return Err(bad("a 4-byte semaphore store".into())),
        _ => Op::Add {
            ptr,
            value: value as i64,
            width,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(seq: u64, action: Action) -> Record {
        Record {
            seq,
            target: 0x7f00_0000_1000,
            value: 0xffff_fffe,
            action,
        }
    }

    #[test]
    fn records_decode_to_their_operations() {
        let r = rec(5, Action::Set);
        assert_eq!(r.imm(), 5);
        assert_eq!(
            decode(r.imm(), &r.to_bytes(), 5, 1).unwrap(),
            Op::Set {
                ptr: r.target,
                value: r.value
            }
        );
        let r = rec((1 << 30) + 3, Action::Add(AtomicWidth::U32));
        assert_eq!(r.imm(), (1 << 30) | 3, "kind 1, low 30 bits of seq");
        assert_eq!(
            decode(r.imm(), &r.to_bytes(), r.seq, 1).unwrap(),
            Op::Add {
                ptr: r.target,
                value: 0xffff_fffe,
                width: AtomicWidth::U32
            }
        );
    }

    #[test]
    fn corrupt_or_foreign_immediates_name_the_peer() {
        let r = rec(7, Action::Add(AtomicWidth::U64));
        let cases: Vec<(u32, Vec<u8>, u64, &str)> = vec![
            (0xC000_0007, r.to_bytes().to_vec(), 7, "kind 3"),
            (r.imm(), r.to_bytes().to_vec(), 8, "out of sequence"),
            (r.imm(), r.to_bytes()[..31].to_vec(), 7, "31 bytes"),
            (7, r.to_bytes().to_vec(), 7, "does not match"),
            (
                r.imm(),
                Record {
                    target: 0x1004,
                    ..r
                }
                .to_bytes()
                .to_vec(),
                7,
                "not aligned",
            ),
            (
                rec(7, Action::Set).imm(),
                {
                    let mut b = rec(7, Action::Set).to_bytes();
                    b[25] = 4;
                    b.to_vec()
                },
                7,
                "4-byte semaphore",
            ),
            (
                r.imm(),
                {
                    let mut b = r.to_bytes();
                    b[25] = 2;
                    b.to_vec()
                },
                7,
                "width 2",
            ),
        ];
        for (imm, bytes, expected, want) in cases {
            let e = decode(imm, &bytes, expected, 4).unwrap_err().to_string();
            assert!(e.contains("rank 4") && e.contains(want), "{want}: {e}");
        }
    }
}
