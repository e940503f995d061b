//! Helpers shared by the unit tests of the reference modules.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

use comm::{CommError, Result};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Runs `f` with an rng seeded from the base seed (`MOELINK_REFERENCE_SEED`,
/// else `default_base`) plus `offset`; on a failure prints how to reproduce it.
pub(crate) fn with_seed(what: &str, default_base: u64, offset: u64, f: impl FnOnce(&mut StdRng)) {
    let base = comm::env::var("MOELINK_REFERENCE_SEED")
        .and_then(|s| s.parse().ok())
        .unwrap_or(default_base);
    let mut rng = StdRng::seed_from_u64(base.wrapping_add(offset));
    if let Err(e) = catch_unwind(AssertUnwindSafe(|| f(&mut rng))) {
        eprintln!(
            "{what} failed: base seed {base}, offset {offset} \
             (rerun with MOELINK_REFERENCE_SEED={base})"
        );
        resume_unwind(e);
    }
}

/// The bit patterns of `v`, for comparing f32 results exactly (NaN payloads
/// and signed zeros included).
pub(crate) fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

/// Asserts `res` is an `InvalidArgument` naming argument `want`.
pub(crate) fn assert_invalid<T: std::fmt::Debug>(res: Result<T>, want: &str) {
    match res {
        Err(CommError::InvalidArgument { name, reason }) => {
            assert_eq!(name, want, "wrong argument named (reason: {reason})")
        }
        other => panic!("expected InvalidArgument({want}), got {other:?}"),
    }
}

/// Random top-k ids for `n` tokens: `k` distinct experts of `num_experts` per
/// token (as from top-k of random scores), then some whole rows and some
/// single ids set to -1, and (with `duplicates`) some rows with a repeated id.
pub(crate) fn random_topk(
    rng: &mut StdRng,
    n: usize,
    num_experts: usize,
    k: usize,
    duplicates: bool,
) -> Vec<i64> {
    let mut topk = Vec::with_capacity(n * k);
    for _ in 0..n {
        let mut row: Vec<i64> = rand::seq::index::sample(rng, num_experts, k)
            .into_iter()
            .map(|e| e as i64)
            .collect();
        if rng.random_bool(0.05) {
            row.fill(-1);
        }
        for e in row.iter_mut() {
            if rng.random_bool(0.15) {
                *e = -1;
            }
        }
        if duplicates && k > 1 && rng.random_bool(0.3) {
            let c = rng.random_range(1..k);
            row[c] = row[0];
        }
        topk.extend(row);
    }
    topk
}
