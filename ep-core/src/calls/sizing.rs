//! The NVLink buffer's size hint (`Config.get_nvl_buffer_size_hint`, the tch
//! `Buffer::nvl_buffer_size_hint`) and the record sizes it is made of
//! (`moelink.config.token_record_bytes`, `combine_record_bytes`).
//!
//! The intranode kernels give every token a fixed slot in two data regions
//! (dispatch, combine) that follow the control region
//! ([`ep_kernels::intranode::CTRL_BYTES`]); a slot holds one record, which ends
//! in the fused kernels' 8-byte flag ([`ep_kernels::intranode::FLAG_BYTES`]).
//! The hint is an upper bound of what the kernels' layouts
//! (`RecordLayout::dispatch`, `combine_record_bytes`) need for the largest
//! batch, whatever the top-k and the scales.

use ep_kernels::intranode::{CTRL_BYTES, FLAG_BYTES};

use super::{int_in, lim, value_err, ArgResult};
use crate::limits::{MAX_HIDDEN_BYTES, MAX_NUM_SCALES, MAX_RANKS, MAX_TOKENS_PER_RANK, MAX_TOPK};

/// Bytes of the control region (per-rank/per-expert counts, signals) at the
/// start of an NVLink buffer: 64 KiB.
pub const COUNTER_BYTES: i64 = CTRL_BYTES as i64;
/// Top-k weights (f32) a combine slot of the hint carries next to the row.
pub const COMBINE_RECORD_TOPK: i64 = 32;
/// Slots start on 16-byte boundaries (the kernels' 16-byte vector stores).
const RECORD_ALIGN: i64 = 16;
/// Buffer sizes are multiples of this.
const BUFFER_ALIGN: i64 = 128;
/// The bytes of a dispatch record after its ids and weights: the i32 source
/// index, the 8-byte flag, and the padding of the ids to 8 bytes.
const TOKEN_TAIL_BYTES: i64 = 4 + FLAG_BYTES + 4;

const _: () = assert!(COUNTER_BYTES == 64 * 1024);

fn round_up(n: i64, multiple: i64) -> i64 {
    (n + multiple - 1) / multiple * multiple
}

/// Bytes of one dispatch slot: what one token carries to one destination
/// rank. `hidden_bytes` (`1..=MAX_HIDDEN_BYTES`) of row data, `num_scales`
/// f32 scales (`0..=MAX_NUM_SCALES`; `None`: `hidden_bytes / 128`, one per
/// 128 fp8 channels), `num_topk` (`0..=MAX_TOPK`) int64 expert ids and f32
/// weights, and 16 bytes for the source token index, the 8-byte flag and
/// padding; rounded up to a multiple of 16.
pub fn token_record_bytes(
    hidden_bytes: i64,
    num_topk: i64,
    num_scales: Option<i64>,
) -> ArgResult<i64> {
    let hidden_bytes = int_in("hidden_bytes", hidden_bytes, 1, lim(MAX_HIDDEN_BYTES))?;
    let num_topk = int_in("num_topk", num_topk, 0, lim(MAX_TOPK))?;
    let num_scales = num_scales.unwrap_or(hidden_bytes / 128);
    let num_scales = int_in("num_scales", num_scales, 0, lim(MAX_NUM_SCALES))?;
    let raw = hidden_bytes + num_scales * 4 + num_topk * (8 + 4) + TOKEN_TAIL_BYTES;
    Ok(round_up(raw, RECORD_ALIGN))
}

/// Bytes of one combine slot: a row of `hidden_bytes` (`1..=MAX_HIDDEN_BYTES`)
/// and `num_topk` (`0..=MAX_TOPK`) f32 weights, then the 8-byte flag; rounded
/// up to a multiple of 16.
pub fn combine_record_bytes(hidden_bytes: i64, num_topk: i64) -> ArgResult<i64> {
    let hidden_bytes = int_in("hidden_bytes", hidden_bytes, 1, lim(MAX_HIDDEN_BYTES))?;
    let num_topk = int_in("num_topk", num_topk, 0, lim(MAX_TOPK))?;
    Ok(round_up(
        hidden_bytes + num_topk * 4 + FLAG_BYTES,
        RECORD_ALIGN,
    ))
}

/// `hidden_bytes` of a size hint: a positive multiple of 128 up to
/// `MAX_HIDDEN_BYTES`.
fn hint_hidden_bytes(hidden_bytes: i64) -> ArgResult<i64> {
    let (unit, max) = (BUFFER_ALIGN, lim(MAX_HIDDEN_BYTES));
    if hidden_bytes <= 0 || hidden_bytes % unit != 0 || hidden_bytes > max {
        return value_err(format!(
            "hidden_bytes must be a positive multiple of {unit} up to {max}, got {hidden_bytes}"
        ));
    }
    Ok(hidden_bytes)
}

/// The checked arguments of both size hints: `(num_ranks, max_tokens_per_rank,
/// the NVLink slot's bytes)`, the slot the larger of a dispatch record with
/// the most top-k and scales and a combine record.
fn hint_args(
    hidden_bytes: i64,
    num_ranks: i64,
    max_tokens_per_rank: i64,
) -> ArgResult<(i64, i64, i64)> {
    let hidden_bytes = hint_hidden_bytes(hidden_bytes)?;
    let num_ranks = int_in("num_ranks", num_ranks, 1, lim(MAX_RANKS))?;
    let max_tokens = int_in(
        "max_tokens_per_rank",
        max_tokens_per_rank,
        1,
        lim(MAX_TOKENS_PER_RANK),
    )?;
    let slot_bytes = token_record_bytes(hidden_bytes, lim(MAX_TOPK), None)?
        .max(combine_record_bytes(hidden_bytes, COMBINE_RECORD_TOPK)?);
    Ok((num_ranks, max_tokens, slot_bytes))
}

/// Bytes of NVLink buffer (`num_nvl_bytes`) for intranode dispatch and
/// combine of rows of `hidden_bytes` among `num_ranks` ranks, each sending at
/// most `max_tokens_per_rank` tokens; a multiple of 128:
///
/// - [`COUNTER_BYTES`] of counters,
/// - two equal data regions, dispatch and combine, each of `num_ranks *
///   max_tokens_per_rank` slots of `max(token_record_bytes(hidden_bytes,
///   MAX_TOPK, None), combine_record_bytes(hidden_bytes,
///   COMBINE_RECORD_TOPK))` bytes.
///
/// `hidden_bytes` is a positive multiple of 128 up to `MAX_HIDDEN_BYTES`,
/// `num_ranks` within `1..=MAX_RANKS`, `max_tokens_per_rank` within
/// `1..=MAX_TOKENS_PER_RANK`.
pub fn nvl_buffer_size_hint(
    hidden_bytes: i64,
    num_ranks: i64,
    max_tokens_per_rank: i64,
) -> ArgResult<i64> {
    let (num_ranks, max_tokens, slot_bytes) =
        hint_args(hidden_bytes, num_ranks, max_tokens_per_rank)?;
    let slots = num_ranks * max_tokens;
    // At most 2 * 2^31 slots of about 2^20 bytes: far within i64.
    Ok(round_up(
        2 * slots * slot_bytes + COUNTER_BYTES,
        BUFFER_ALIGN,
    ))
}

/// Bytes of RDMA buffer (`num_rdma_bytes`) of the normal kernels: what the
/// internode part adds to [`nvl_buffer_size_hint`]'s bytes when the
/// `num_ranks` ranks span nodes of `ranks_per_node` (0 within one node:
/// `num_ranks <= ranks_per_node`), for batches of up to `max_tokens_per_rank`:
///
/// - 64 KiB of notify staging rows,
/// - two equal halves, each `max_tokens_per_rank * (num_ranks + 2 * nodes)`
///   records of `slot + 4 * ranks_per_node + 16` bytes (`slot` as the NVLink
///   hint's), which with the NVLink hint's bytes covers the dispatch half
///   (`R` NVL records and `2N` cross-node records per token, each of those
///   the NVL record plus `L` slots) and the combine half (`2R + 2N` combine
///   records per token) of `ep_core::internode`.
///
/// The arguments are checked as the NVLink hint checks them;
/// `ranks_per_node` must divide `num_ranks`.
pub fn rdma_buffer_size_hint(
    hidden_bytes: i64,
    num_ranks: i64,
    max_tokens_per_rank: i64,
    ranks_per_node: i64,
) -> ArgResult<i64> {
    let (num_ranks, max_tokens, slot_bytes) =
        hint_args(hidden_bytes, num_ranks, max_tokens_per_rank)?;
    let l = int_in("ranks_per_node", ranks_per_node, 1, lim(MAX_RANKS))?;
    if num_ranks <= l {
        return Ok(0);
    }
    if num_ranks % l != 0 {
        return value_err(format!(
            "ranks_per_node {l} does not divide num_ranks {num_ranks}"
        ));
    }
    let nodes = num_ranks / l;
    let record = slot_bytes + 4 * l + 16;
    Ok(round_up(
        2 * max_tokens * (num_ranks + 2 * nodes) * record + COUNTER_BYTES,
        BUFFER_ALIGN,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calls::test_util::value;
    use ep_kernels::intranode::{combine_record_bytes as kernel_combine, RecordLayout};

    #[test]
    fn record_bytes() {
        // 7168 bf16 channels: row 14336 + 112 scales * 4 + 32 * 12 + 16.
        assert_eq!(token_record_bytes(14336, 32, None), Ok(15184));
        assert_eq!(
            token_record_bytes(14336, 8, Some(56)),
            Ok(14336 + 224 + 96 + 16)
        );
        assert_eq!(token_record_bytes(130, 1, None), Ok(176)); // 162 rounded up
        assert_eq!(token_record_bytes(128, 0, Some(1)), Ok(160)); // 148 rounded up
        assert_eq!(combine_record_bytes(14336, 32), Ok(14336 + 128 + 16));
        assert_eq!(combine_record_bytes(64, 0), Ok(80));
    }

    #[test]
    fn record_bytes_name_the_argument() {
        value(
            token_record_bytes(0, 32, None),
            "hidden_bytes must be positive, got 0",
        );
        value(
            token_record_bytes(lim(MAX_HIDDEN_BYTES) + 1, 32, None),
            "hidden_bytes must be <= 1048576, got 1048577",
        );
        value(
            token_record_bytes(128, -1, None),
            "num_topk must be >= 0, got -1",
        );
        value(
            token_record_bytes(128, 33, None),
            "num_topk must be <= 32, got 33",
        );
        value(
            token_record_bytes(128, 1, Some(-1)),
            "num_scales must be >= 0, got -1",
        );
        value(
            token_record_bytes(128, 1, Some(8193)),
            "num_scales must be <= 8192, got 8193",
        );
        value(
            combine_record_bytes(-5, 0),
            "hidden_bytes must be positive, got -5",
        );
        value(
            combine_record_bytes(128, 40),
            "num_topk must be <= 32, got 40",
        );
    }

    #[test]
    fn the_standard_workload() {
        // Hidden 7168 in bf16 among 4 and 8 ranks, 4096 tokens each (the
        // Python default): 2 regions of R * T slots of 15184 bytes + 64 KiB.
        assert_eq!(
            nvl_buffer_size_hint(14336, 4, 4096),
            Ok(2 * 4 * 4096 * 15184 + 65536)
        );
        assert_eq!(nvl_buffer_size_hint(14336, 4, 4096), Ok(497_614_848));
        assert_eq!(
            nvl_buffer_size_hint(14336, 8, 4096),
            Ok(2 * 8 * 4096 * 15184 + 65536)
        );
        // Small rows: the combine record (32 weights) is the larger slot.
        // token: 128 + 4 + 384 + 16 = 532 -> 544; combine: 128 + 128 + 8 -> 272.
        assert_eq!(nvl_buffer_size_hint(128, 2, 1), Ok(2 * 2 * 544 + 65536));
        // Rounded up to 128: 2 * 3 * 7 * (384 + 4*3 + 384 + 16 = 796 -> 800) + 64 KiB.
        assert_eq!(
            nvl_buffer_size_hint(384, 3, 7),
            Ok(round_up(2 * 3 * 7 * 800 + 65536, 128))
        );
        assert_eq!(nvl_buffer_size_hint(384, 3, 7).unwrap() % 128, 0);
        // The largest shape within the limits fits an i64.
        assert!(nvl_buffer_size_hint(1 << 20, 32, lim(MAX_TOKENS_PER_RANK)).unwrap() > 1 << 50);
        // Within one node: 0. Across 2 nodes of 2: 64 KiB + 2 * T * (R + 2N) records.
        assert_eq!(rdma_buffer_size_hint(14336, 8, 4096, 8), Ok(0));
        let slot = token_record_bytes(128, 32, None).unwrap().max(272);
        assert_eq!(
            rdma_buffer_size_hint(128, 4, 3, 2),
            Ok(round_up(2 * 3 * (4 + 4) * (slot + 8 + 16) + 65536, 128))
        );
        value(
            rdma_buffer_size_hint(128, 6, 3, 4),
            "ranks_per_node 4 does not divide num_ranks 6",
        );
    }

    #[test]
    fn the_hint_names_the_argument() {
        for bad in [0, 100, -128, lim(MAX_HIDDEN_BYTES) + 128, i64::MAX] {
            value(
                nvl_buffer_size_hint(bad, 4, 16),
                &format!(
                    "hidden_bytes must be a positive multiple of 128 up to 1048576, got {bad}"
                ),
            );
            value(
                rdma_buffer_size_hint(bad, 4, 16, 2),
                &format!(
                    "hidden_bytes must be a positive multiple of 128 up to 1048576, got {bad}"
                ),
            );
        }
        value(
            nvl_buffer_size_hint(1024, 0, 16),
            "num_ranks must be positive, got 0",
        );
        value(
            nvl_buffer_size_hint(1024, 33, 16),
            "num_ranks must be <= 32, got 33",
        );
        value(
            rdma_buffer_size_hint(1024, 64, 16, 2),
            "num_ranks must be <= 32, got 64",
        );
        value(
            nvl_buffer_size_hint(1024, 4, 0),
            "max_tokens_per_rank must be positive, got 0",
        );
        value(
            nvl_buffer_size_hint(1024, 4, 1 << 26),
            "max_tokens_per_rank must be <= 67108863, got 67108864",
        );
        value(
            nvl_buffer_size_hint(1024, 4, i64::MIN),
            &format!("max_tokens_per_rank must be positive, got {}", i64::MIN),
        );
    }

    /// The hint covers what the kernels lay out: a buffer of the hint's size
    /// holds `max_tokens_per_rank` tokens per rank in each data region (as
    /// `IntranodeBuffer` splits it) for every top-k and scale count the rows
    /// allow, dispatch and combine.
    #[test]
    fn the_hint_covers_the_kernels_records() {
        for hidden_bytes in [128, 256, 384, 2048, 7168, 14336, 1 << 20] {
            for (ranks, tokens) in [(1, 1), (2, 33), (8, 4096)] {
                let hint = nvl_buffer_size_hint(hidden_bytes, ranks, tokens).unwrap();
                let region = (hint as u64 - CTRL_BYTES) / 2 / 16 * 16;
                let hb = hidden_bytes as usize;
                for k in [0, 1, 8, MAX_TOPK] {
                    for scales in [0, hb / 128] {
                        let rec = RecordLayout::dispatch(hb, scales, k).unwrap();
                        let slots = region / (ranks as u64 * rec.bytes as u64);
                        assert!(slots >= tokens as u64, "{hidden_bytes} {k} {scales}");
                    }
                    let rec = kernel_combine(hb / 2, k) as u64;
                    assert!(region / (ranks as u64 * rec) >= tokens as u64);
                }
            }
        }
    }
}
