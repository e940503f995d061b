//! The `host-no-atomic` signalling mode: signals and counter adds travel as
//! RDMA write-with-immediate, and the receiving proxy applies them. One queue
//! pair delivers in order, so the data written before a signal is in place
//! when the signal's completion arrives, and an add's operand record (written
//! just before its immediate) is complete when the immediate is read.
//!
//! The 32-bit immediate (host order here; verbs carries `imm_data` in network
//! byte order, which the queue-pair code converts): bits 30..32 the kind,
//! bits 0..30 an index.
//! - kind 0, signal: add 1 to the receiver's semaphore slot `index` (its
//!   signal page, `remote_offset / SLOT_BYTES`);
//! - kind 1, add: apply the operand record in slot `index` of the
//!   connection's operand ring ([`AddOperand`]);
//! - kinds 2 and 3 are invalid (a corrupted or foreign immediate).

use super::fixed_record;
use crate::error::{CommError, Result};
use crate::transport::AtomicWidth;
use crate::wire::{u32_at, u64_at};

const KIND_SHIFT: u32 = 30;
/// Largest index an immediate carries.
pub const MAX_INDEX: u32 = (1 << KIND_SHIFT) - 1;

/// What one immediate asks the receiving proxy to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Imm {
    Signal { slot: u32 },
    Add { operand: u32 },
}

impl Imm {
    pub fn encode(self) -> Result<u32> {
        let (kind, index) = match self {
            Imm::Signal { slot } => (0u32, slot),
            Imm::Add { operand } => (1u32, operand),
        };
        if index > MAX_INDEX {
            return Err(CommError::invalid(
                "imm",
                format!("index {index} is above {MAX_INDEX}, the largest an immediate carries"),
            ));
        }
        Ok((kind << KIND_SHIFT) | index)
    }

    /// `peer`: who sent it (named in the error of an invalid immediate).
    pub fn decode(imm: u32, peer: usize) -> Result<Self> {
        let index = imm & MAX_INDEX;
        match imm >> KIND_SHIFT {
            0 => Ok(Imm::Signal { slot: index }),
            1 => Ok(Imm::Add { operand: index }),
            k => Err(CommError::Rdma {
                peer,
                what: format!("immediate {imm:#010x} has kind {k}, which no sender writes"),
            }),
        }
    }
}

/// The operand of a counter add in `host-no-atomic` mode: where (registered
/// memory id and byte offset, in the receiver's registrations) and what to add,
/// at which width. 24 bytes, little-endian.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AddOperand {
    pub memory_id: u32,
    pub width: AtomicWidth,
    pub offset: u64,
    pub value: i64,
}

/// Bytes of one [`AddOperand`] record.
pub const OPERAND_BYTES: usize = 24;

impl AddOperand {
    pub fn to_bytes(&self) -> [u8; OPERAND_BYTES] {
        let mut b = [0u8; OPERAND_BYTES];
        b[0..4].copy_from_slice(&self.memory_id.to_le_bytes());
        b[4..8].copy_from_slice(&(self.width.bytes() as u32).to_le_bytes());
        b[8..16].copy_from_slice(&self.offset.to_le_bytes());
        b[16..24].copy_from_slice(&self.value.to_le_bytes());
        b
    }

    /// Checks the record as the receiver must: a known width, an offset
    /// aligned to it (a 64-bit add never lands on a 32-bit counter's half).
    pub fn from_bytes(b: &[u8], peer: usize) -> Result<Self> {
        let b: &[u8; OPERAND_BYTES] = fixed_record(b, peer, "an add operand")?;
        let bad = |what: String| CommError::Rdma { peer, what };
        let width = match u32_at(b, 4) {
            4 => AtomicWidth::U32,
            8 => AtomicWidth::U64,
            w => return Err(bad(format!("an add operand of width {w} bytes (4 or 8)"))),
        };
        let offset = u64_at(b, 8);
        if offset % width.bytes() != 0 {
            return Err(bad(format!(
                "a {}-byte add at offset {offset}, not aligned to its width",
                width.bytes()
            )));
        }
        Ok(Self {
            memory_id: u32_at(b, 0),
            width,
            offset,
            value: u64_at(b, 16) as i64,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn immediates_round_trip_and_keep_their_kind() {
        for imm in [
            Imm::Signal { slot: 0 },
            Imm::Signal { slot: MAX_INDEX },
            Imm::Add { operand: 7 },
            Imm::Add { operand: MAX_INDEX },
        ] {
            assert_eq!(Imm::decode(imm.encode().unwrap(), 0).unwrap(), imm);
        }
        assert_ne!(
            Imm::Signal { slot: 5 }.encode().unwrap(),
            Imm::Add { operand: 5 }.encode().unwrap()
        );
        assert!(Imm::Signal {
            slot: MAX_INDEX + 1
        }
        .encode()
        .is_err());
        let e = Imm::decode(0xC000_0001, 4).unwrap_err().to_string();
        assert!(e.contains("rank 4") && e.contains("kind 3"), "{e}");
    }

    #[test]
    fn operands_round_trip_and_are_checked() {
        let op = AddOperand {
            memory_id: 9,
            width: AtomicWidth::U64,
            offset: 4096,
            value: -3,
        };
        assert_eq!(AddOperand::from_bytes(&op.to_bytes(), 0).unwrap(), op);
        let op32 = AddOperand {
            width: AtomicWidth::U32,
            offset: 4100,
            ..op
        };
        assert_eq!(AddOperand::from_bytes(&op32.to_bytes(), 0).unwrap(), op32);
        let misaligned = AddOperand { offset: 4100, ..op }.to_bytes();
        let e = AddOperand::from_bytes(&misaligned, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank 2") && e.contains("not aligned"), "{e}");
        let mut bad_width = op.to_bytes();
        bad_width[4] = 2;
        assert!(AddOperand::from_bytes(&bad_width, 0).is_err());
        assert!(AddOperand::from_bytes(&[0; 23], 0).is_err());
    }
}
