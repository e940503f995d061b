//! Peer-write diagnostics: can every GPU of the job store into every other's
//! memory? Each rank allocates a buffer with one slot per rank, exports it,
//! maps every peer's buffer, and one kernel writes a rank-specific pattern into
//! slot `rank` of every buffer. Each rank then checks all slots of its own
//! buffer against [`pattern_word`] (the CPU twin of the kernel's pattern).
//!
//! The exchange of handles is the caller's (torch.distributed in Python,
//! the bootstrap in Rust): this type only produces and consumes bytes.

use comm::error::{CommError, Result};
use comm::{Device, DeviceMemory, IpcHandle, PeerMemory, StreamHandle};
use ep_kernels::{launch, DeviceKernels};

/// Word `i` of the pattern rank `src` writes into rank `dst` (matches `pattern.cuh`).
pub fn pattern_word(seed: u64, src: u32, dst: u32, i: u64) -> u64 {
    splitmix64(seed ^ ((src as u64) << 48) ^ ((dst as u64) << 32) ^ splitmix64(i))
}

pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The value unwritten words hold: a run that forgets a word cannot pass.
pub const POISON_BYTE: u8 = 0xA5;

/// One rank's side of the peer-write check.
pub struct PeerWriteCheck {
    rank: usize,
    nranks: usize,
    words: u64,
    local: DeviceMemory,
    peers: Vec<Option<PeerMemory>>,
    table: Option<DeviceMemory>,
}

/// A slot whose contents differ from the expected pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    pub src: usize,
    pub first_bad_word: u64,
    pub bad_words: u64,
    pub expected: u64,
    pub got: u64,
}

impl PeerWriteCheck {
    /// Allocates `nranks` slots of `words` words on `device`, poisoned.
    pub fn new(device: Device, rank: usize, nranks: usize, words: u64) -> Result<Self> {
        if nranks == 0 || rank >= nranks {
            return Err(CommError::invalid(
                "rank",
                format!("rank {rank} of {nranks} ranks"),
            ));
        }
        if words == 0 {
            return Err(CommError::invalid(
                "words",
                "need at least one word per slot",
            ));
        }
        let local = DeviceMemory::alloc(device, nranks * words as usize * 8)?;
        local.fill(POISON_BYTE)?;
        Ok(Self {
            rank,
            nranks,
            words,
            local,
            peers: (0..nranks).map(|_| None).collect(),
            table: None,
        })
    }

    /// This rank's buffer as bytes to send to every peer.
    pub fn export(&self) -> Result<Vec<u8>> {
        Ok(self.local.ipc_handle()?.to_bytes())
    }

    /// Maps every peer's buffer (`handles[p]` from rank p; our own is skipped).
    pub fn connect(&mut self, handles: &[Vec<u8>]) -> Result<()> {
        if handles.len() != self.nranks {
            return Err(CommError::invalid(
                "handles",
                format!("{} handles for {} ranks", handles.len(), self.nranks),
            ));
        }
        let device = self.local.device();
        let mut table = vec![0u64; self.nranks];
        for (p, h) in handles.iter().enumerate() {
            if p == self.rank {
                table[p] = self.local.ptr();
                continue;
            }
            let h = IpcHandle::from_bytes(h)?;
            if h.len < self.local.len() as u64 {
                return Err(CommError::invalid(
                    "handles",
                    format!(
                        "rank {p}'s buffer has {} bytes, need {}",
                        h.len,
                        self.local.len()
                    ),
                ));
            }
            let peer = PeerMemory::open(device, &h)?;
            table[p] = peer.ptr();
            self.peers[p] = Some(peer);
        }
        let t = DeviceMemory::alloc(device, self.nranks * 8)?;
        t.copy_from_host(0, &table)?;
        self.table = Some(t);
        Ok(())
    }

    /// Launches the write of this rank's pattern into every peer on `stream`.
    pub fn write(&self, stream: StreamHandle, seed: u64) -> Result<()> {
        let table = self
            .table
            .as_ref()
            .ok_or_else(|| CommError::invalid("connect", "call connect() before write()"))?;
        let kernels = DeviceKernels::get(self.local.device())?;
        // SAFETY: the table holds this buffer and every mapped peer buffer, each
        // nranks * words * 8 bytes (checked in connect()).
        unsafe {
            launch::diagnostics_write_peers(
                &kernels,
                stream,
                table.ptr(),
                self.nranks as i32,
                self.rank as i32,
                self.words,
                seed,
            )
        }
    }

    /// Reads this rank's buffer back and compares every slot with the pattern
    /// its source rank should have written. Call after all ranks' writes are
    /// complete (the caller's barrier).
    pub fn verify(&self, seed: u64) -> Result<Vec<Mismatch>> {
        let mut host = vec![0u64; self.nranks * self.words as usize];
        self.local.copy_to_host(0, &mut host)?;
        Ok(check_slots(&host, self.rank, self.nranks, self.words, seed))
    }
}

/// Compares the slots of `dst`'s buffer with the expected patterns.
pub fn check_slots(buf: &[u64], dst: usize, nranks: usize, words: u64, seed: u64) -> Vec<Mismatch> {
    let mut out = Vec::new();
    for src in 0..nranks {
        let slot = &buf[src * words as usize..(src + 1) * words as usize];
        let mut bad: Option<Mismatch> = None;
        for (i, &got) in slot.iter().enumerate() {
            let expected = pattern_word(seed, src as u32, dst as u32, i as u64);
            if got != expected {
                match &mut bad {
                    Some(m) => m.bad_words += 1,
                    None => {
                        bad = Some(Mismatch {
                            src,
                            first_bad_word: i as u64,
                            bad_words: 1,
                            expected,
                            got,
                        })
                    }
                }
            }
        }
        out.extend(bad);
    }
    out
}

/// `out[c] = bf16(sum_r input[r, c])` in float32 on `device`, launched on
/// `stream` (a test helper of the Python package: `moelink._testing`).
pub use ep_kernels::launch::reduce_rows_bf16;

#[cfg(test)]
mod tests {
    use super::*;

    fn fill(dst: usize, nranks: usize, words: u64, seed: u64) -> Vec<u64> {
        (0..nranks)
            .flat_map(|src| (0..words).map(move |i| pattern_word(seed, src as u32, dst as u32, i)))
            .collect()
    }

    #[test]
    fn pattern_depends_on_every_input() {
        let base = pattern_word(1, 2, 3, 4);
        assert_ne!(base, pattern_word(9, 2, 3, 4));
        assert_ne!(base, pattern_word(1, 0, 3, 4));
        assert_ne!(base, pattern_word(1, 2, 0, 4));
        assert_ne!(base, pattern_word(1, 2, 3, 5));
        // A known value pins the CPU/GPU contract (pattern.cuh computes the same).
        assert_eq!(splitmix64(0), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn check_slots_finds_each_kind_of_error() {
        let (nranks, words, seed) = (4, 100, 0xfeed);
        let good = fill(2, nranks, words, seed);
        assert!(check_slots(&good, 2, nranks, words, seed).is_empty());
        // wrong destination rank, wrong seed, a poisoned word
        assert_eq!(check_slots(&good, 1, nranks, words, seed).len(), nranks);
        assert_eq!(check_slots(&good, 2, nranks, words, seed + 1).len(), nranks);
        let mut bad = good.clone();
        bad[words as usize + 7] = u64::from_ne_bytes([POISON_BYTE; 8]);
        let m = check_slots(&bad, 2, nranks, words, seed);
        assert_eq!(m.len(), 1);
        assert_eq!((m[0].src, m[0].first_bad_word, m[0].bad_words), (1, 7, 1));
    }
}
