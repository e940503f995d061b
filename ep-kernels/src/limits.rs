//! Every limit of moelink's expert-parallel API, defined once.
//!
//! The kernels impose these limits (array sizes, one warp lane per rank or
//! top-k column, int32 counts and offsets), so they live in the crate that
//! launches them; everything above (`ep_core::limits` and
//! `ep_reference::limits`, which re-export this module, the CPU reference,
//! the size hints, the `Buffer`, the Python checks through
//! `moelink._native.limits()`, and the table in `docs/api-notes.md`) reads
//! them from here. The CUDA sources repeat the few that size device
//! arrays (`kMaxRanks`, `kMaxTopk`); a test below reads them back from the
//! `.cu` text.
//!
//! One number here is not the kernels': the CPU reference's output budget
//! ([`DEFAULT_REFERENCE_MAX_BYTES`]), kept with the others so that the table
//! of every limit (`ep_core::limits::TABLE`) and the reference read the same
//! one.
//!
//! The allreduce communicator has its own limits (`collectives::args`).

/// Ranks of one intranode or low-latency `Buffer` (one warp lane, and one
/// flag per parity, per rank).
pub const MAX_RANKS: usize = 32;

/// Columns of `topk_idx` (`K`): one warp lane per column.
pub const MAX_TOPK: usize = 32;

/// Experts hosted by one rank: the intranode counts block that the host
/// reads, and the low-latency kernels' per-expert shared-memory counters.
pub const MAX_EXPERTS_PER_RANK: usize = 1024;

/// Experts of one `Buffer` (`MAX_RANKS` ranks of `MAX_EXPERTS_PER_RANK`).
pub const MAX_EXPERTS: usize = MAX_RANKS * MAX_EXPERTS_PER_RANK;

/// Intranode token rows (`hidden_bytes`) are a positive multiple of this many
/// bytes: the kernels move rows in 16-byte vectors, 8 lanes at a time.
pub const ROW_BYTES_ALIGNMENT: usize = 128;

/// Largest intranode token row in bytes (512 Ki bf16 channels, far above any
/// model): every offset inside a dispatch record stays well inside int32.
pub const MAX_HIDDEN_BYTES: usize = 1 << 20;

/// Channels per fp8 scale; the scales of an fp8 row of `H` channels are
/// `H / FP8_GROUP_SIZE` floats, and a low-latency `hidden` is a positive
/// multiple of this.
pub const FP8_GROUP_SIZE: usize = 128;

/// Largest number of f32 scales per intranode token: one per
/// `FP8_GROUP_SIZE` bytes of the largest row.
pub const MAX_NUM_SCALES: usize = MAX_HIDDEN_BYTES / FP8_GROUP_SIZE;

/// Intranode tokens per rank: a destination receives at most `MAX_RANKS`
/// times this many, which must fit the kernels' int32 prefix sums.
pub const MAX_TOKENS_PER_RANK: usize = i32::MAX as usize / MAX_RANKS;

/// Rows a rank can receive in an intranode dispatch (the bound of
/// `num_worst_tokens`).
pub const MAX_RECV_TOKENS: usize = MAX_RANKS * MAX_TOKENS_PER_RANK;

/// `expert_alignment` of an intranode dispatch: the kernels round int32
/// counts up to a multiple of it.
pub const MAX_EXPERT_ALIGNMENT: usize = i32::MAX as usize;

/// Largest low-latency `hidden` (one block thread per 8 channels).
pub const LL_MAX_HIDDEN: usize = 8192;

/// Low-latency `num_max_dispatch_tokens_per_rank` (`T`): every message index
/// `R * T * K` must fit int32.
pub const LL_MAX_TOKENS_PER_RANK: usize = i32::MAX as usize / (MAX_RANKS * MAX_TOPK);

/// `num_sms` of an intranode dispatch / combine: the kernels run in sender /
/// receiver pairs, so it is even and at least 2.
pub const MIN_NUM_SMS: usize = 2;

/// Largest `num_sms` (more than any GPU has; a call uses at most the SMs of
/// the rank's share of its GPU).
pub const MAX_NUM_SMS: usize = 1024;

/// Default of the bytes the outputs of one CPU reference call may take
/// (`ep_reference::limits::reference_max_bytes`): 16 GiB.
pub const DEFAULT_REFERENCE_MAX_BYTES: usize = 16 << 30;

/// Environment variable that overrides [`DEFAULT_REFERENCE_MAX_BYTES`].
pub const REFERENCE_MAX_BYTES_ENV: &str = "MOELINK_REFERENCE_MAX_BYTES";

#[cfg(test)]
mod tests {
    use super::*;

    /// The CUDA sources size their arrays with the same numbers.
    #[test]
    fn cuda_constants_match() {
        let intranode = include_str!("../cuda/intranode.cuh");
        let ll = include_str!("../cuda/low_latency.cu");
        for (file, body, text) in [
            (
                "intranode.cuh",
                intranode,
                format!("constexpr int kMaxRanks = {MAX_RANKS};"),
            ),
            (
                "low_latency.cu",
                ll,
                format!("constexpr int kMaxRanks = {MAX_RANKS};"),
            ),
            (
                "low_latency.cu",
                ll,
                format!("constexpr int kMaxTopk = {MAX_TOPK};"),
            ),
        ] {
            assert!(body.contains(&text), "{file} lacks `{text}`");
        }
    }

    #[test]
    fn derived_limits_fit_the_kernels_int32_counts() {
        assert!(MAX_RECV_TOKENS <= i32::MAX as usize);
        assert!(LL_MAX_TOKENS_PER_RANK * MAX_RANKS * MAX_TOPK <= i32::MAX as usize);
        // A record (row, scales, K ids and weights, source index) fits int32.
        assert!(MAX_HIDDEN_BYTES + 4 * MAX_NUM_SCALES + 12 * MAX_TOPK + 16 < i32::MAX as usize);
        assert_eq!(MAX_HIDDEN_BYTES % ROW_BYTES_ALIGNMENT, 0);
        assert_eq!(MIN_NUM_SMS % 2, 0);
        assert_eq!(MAX_NUM_SMS % 2, 0);
    }
}
