//! The limits of moelink's expert-parallel API in one place.
//!
//! The numbers are defined once, in [`ep_kernels::limits`] (the kernels impose
//! them), and re-exported here; [`calls`](crate::calls) checks the Buffer's
//! arguments against them, and the CPU reference (crate `ep-reference`, its
//! `limits` module) checks its own against the same numbers. [`TABLE`] is
//! what `moelink._native.limits()` exports to the Python checks and what the
//! table in `docs/api-notes.md` is tested against.

pub use ep_kernels::limits::*;

/// One limit as exported to Python: `name` is the key of
/// `moelink._native.limits()`, `what` says what it bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    pub name: &'static str,
    pub value: u64,
    pub what: &'static str,
}

const fn limit(name: &'static str, value: usize, what: &'static str) -> Limit {
    Limit {
        name,
        value: value as u64,
        what,
    }
}

/// Every limit of the EP API (intranode, low latency, the CPU reference).
pub const TABLE: &[Limit] = &[
    limit("max_ranks", MAX_RANKS, "ranks of a Buffer"),
    limit("max_topk", MAX_TOPK, "columns of topk_idx (K)"),
    limit(
        "max_experts_per_rank",
        MAX_EXPERTS_PER_RANK,
        "experts hosted by one rank",
    ),
    limit("max_experts", MAX_EXPERTS, "experts of a Buffer"),
    limit(
        "row_bytes_alignment",
        ROW_BYTES_ALIGNMENT,
        "intranode rows (hidden_bytes) are a positive multiple of this",
    ),
    limit(
        "max_hidden_bytes",
        MAX_HIDDEN_BYTES,
        "bytes of one intranode token row",
    ),
    limit(
        "fp8_group_size",
        FP8_GROUP_SIZE,
        "channels per fp8 scale; a low-latency hidden is a positive multiple of this",
    ),
    limit(
        "max_num_scales",
        MAX_NUM_SCALES,
        "f32 scales of one intranode token",
    ),
    limit(
        "max_tokens_per_rank",
        MAX_TOKENS_PER_RANK,
        "intranode tokens of one rank (max_tokens_per_rank of the size hint)",
    ),
    limit(
        "max_recv_tokens",
        MAX_RECV_TOKENS,
        "rows one rank receives in an intranode dispatch (num_worst_tokens)",
    ),
    limit(
        "max_expert_alignment",
        MAX_EXPERT_ALIGNMENT,
        "expert_alignment of an intranode dispatch",
    ),
    limit("ll_max_hidden", LL_MAX_HIDDEN, "low-latency hidden (H)"),
    limit(
        "ll_max_tokens_per_rank",
        LL_MAX_TOKENS_PER_RANK,
        "low-latency num_max_dispatch_tokens_per_rank (T)",
    ),
    limit(
        "min_num_sms",
        MIN_NUM_SMS,
        "num_sms of intranode dispatch / combine (even)",
    ),
    limit(
        "max_num_sms",
        MAX_NUM_SMS,
        "num_sms; a call uses at most its rank's share of the GPU",
    ),
    limit(
        "reference_max_bytes",
        DEFAULT_REFERENCE_MAX_BYTES,
        "outputs of one CPU reference call (env MOELINK_REFERENCE_MAX_BYTES)",
    ),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_unique_and_values_match_the_constants() {
        let mut names: Vec<_> = TABLE.iter().map(|l| l.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), TABLE.len());
        let get = |n: &str| TABLE.iter().find(|l| l.name == n).unwrap().value;
        assert_eq!(get("max_ranks"), MAX_RANKS as u64);
        assert_eq!(get("max_topk"), 32);
        assert_eq!(get("ll_max_hidden"), 8192);
        assert_eq!(get("ll_max_tokens_per_rank"), (1 << 21) - 1);
        assert_eq!(get("max_tokens_per_rank"), (1 << 26) - 1);
    }
}
