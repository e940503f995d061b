//! Helpers the CPU integration tests of comm share: test data and checksums.
//! (Each test binary uses some of them.)
#![allow(dead_code)]

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};

/// A fresh odd seed, different in every run.
pub fn random_seed() -> u64 {
    RandomState::new().build_hasher().finish() | 1
}

/// `len` deterministic bytes from `seed` (splitmix64): what both sides of a
/// transfer compute to check it.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// FNV-1a of `data`: a checksum a child process can report in one line.
pub fn fnv1a(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}
