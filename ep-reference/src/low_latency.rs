//! CPU reference semantics of the low-latency path: `low_latency_dispatch`
//! (with its on-the-fly fp8 cast) and `low_latency_combine`, for any number of
//! ranks simulated in one process. Like [`normal`](super::normal) for
//! the normal path, this module is the test oracle: every GPU test of the
//! low-latency kernels compares its results with the functions here, so their
//! docs are the exact contract (the Python-level contract is `docs/api.md`,
//! section "Low latency").
//!
//! # Model
//!
//! There are `R` ranks (`R >= 1`) and `E` experts, `E` a positive multiple of
//! `R`; every rank hosts `E_local = E / R` consecutive experts, so expert `e`
//! lives on rank `e / E_local` as local expert `e % E_local`. `T` is
//! `num_max_dispatch_tokens_per_rank`. Source rank `r` holds `T_r <= T` tokens
//! (`T_r == 0` is allowed; ranks may differ). Token `t` of rank `r` is a row of
//! `H` bf16 channels (`H` a positive multiple of [`FP8_GROUP_SIZE`]) and a row
//! of `K` expert ids `topk_idx[t * K .. (t + 1) * K]` (`1 <= K <= MAX_TOPK`),
//! each in `-1 ..= E - 1`; `-1` means "no expert". All matrices are flat
//! `Vec`s / slices in row-major order, except the fp8 scales of the receive
//! side (see "FP8 cast").
//!
//! **bf16 data is passed as f32 values that are exactly bf16**: an f32 whose
//! low 16 bits are zero, i.e.
//! [`bf16_bits_to_f32`](crate::normal::bf16_bits_to_f32) of the bf16 bits (torch:
//! `t.float()`). This holds for `x` of dispatch, `recv_x` of a bf16 dispatch,
//! and the expert outputs `x` of combine; anything else is rejected (round
//! with [`round_to_bf16`] first). Bit for bit, the f32 and the bf16 carry the
//! same value, so comparing `to_bits()` of these f32s is comparing the bf16s.
//!
//! # Dispatch ([`low_latency_dispatch`])
//!
//! There is no per-rank deduplication: every (token `t`, column `k`) whose id
//! `e = topk_idx[t][k]` is not `-1` is one message, from its source rank to
//! local expert `j = e % E_local` of rank `d = e / E_local`. Rank `d` receives,
//! per local expert `j`, a slab of `R * T` rows (see [`LlRankOutput`]):
//!
//! - `recv_count[j]` rows are valid: one per message addressed to `e`, from
//!   all source ranks together. Rows `recv_count[j] ..` are padding.
//! - The messages from one source rank `r` form one contiguous block;
//!   `layout_range[j][r] = (begin << 32) | count` ([`pack_layout_range`]): the
//!   block is rows `begin .. begin + count`. The blocks of the sources with
//!   `count > 0` tile `0 .. recv_count[j]` exactly.
//! - `src_info[j][row]` is the index `t` of the row's token on its source rank
//!   (the source rank is the block's).
//! - The row's payload is the token's `H` channels: the bf16 values unchanged,
//!   or their fp8 cast plus scales (next section).
//!
//! **Order.** The reference puts the blocks in source-rank-ascending order and
//! the rows of a block in token-ascending order (a token that lists `e` in
//! several columns has one row per column, consecutive, in column order). The
//! GPU is free in both: DeepEP's receiver reserves a block's rows with an atomic
//! when that source's messages arrive, and its sender picks each message's slot
//! inside the block with an atomic. Whatever order a kernel uses, its `src_info`
//! and `layout_range` describe it, and combine takes that handle back. So GPU
//! tests compare the dispatch with [`compare_recv`] and [`RecvOrder::Any`] (or a
//! stricter [`RecvOrder`] for a kernel that promises more), never with `==`.
//!
//! **Unspecified outputs.** Padding rows of `recv_x`, of the scales and of
//! `src_info`, and the `begin` of an empty block (DeepEP writes whatever its
//! atomic counter held at that moment), are unspecified: GPU tests must not
//! compare them ([`compare_recv`] does not). The reference fills padding with
//! `0` (`recv_x`, scales) and `-1` (`src_info`), and gives an empty block the
//! `begin` where it would have started in source order.
//!
//! # FP8 cast (`use_fp8`)
//!
//! The sender casts each token once, before sending, exactly as DeepEP's
//! kernel does, in f32 arithmetic with round-to-nearest-even (`fl(..)` below).
//! Per token and per group `g` of [`FP8_GROUP_SIZE`] consecutive channels
//! ([`fp8_scale`], [`quantize_fp8`]):
//!
//! 1. `amax = max(FP8_AMAX_MIN, max_i |x_i|)` over the group (the bf16 values as
//!    f32; the clamp [`FP8_AMAX_MIN`] `= 1e-4` is DeepEP's `kFP8Margin`, so an
//!    all-zero group gets a finite, nonzero scale and quantizes to zeros).
//! 2. Without `round_scale`: `scale_inv = fl(amax * E4M3_MAX_INV)` and
//!    `scale = fl(E4M3_MAX / amax)` (an IEEE division). With `round_scale`:
//!    `v = fl(amax * E4M3_MAX_INV)`, `p = ceil(log2 v)` read off `v`'s bits
//!    (unbiased exponent, plus one if any mantissa bit is set), `scale_inv =
//!    2^p`, `scale = 2^-p` (exact powers of two).
//! 3. `q_i = e4m3(fl(x_i * scale))` ([`f32_to_e4m3_bits`]: e4m3fn,
//!    round-to-nearest-even, saturating to `±448`).
//!
//! The stored scale is `scale_inv`; the value a row stands for is
//! `decode(q_i) * scale_inv` ([`dequantize_fp8`]). Note that the multiplier is
//! `fl(448 / amax)`, not `1 / scale_inv`: `fl(x * fl(448 / amax))` and
//! `fl(x / scale_inv)` differ in the last f32 bit for some `x`, which moves a
//! value across an e4m3 rounding boundary now and then, so a kernel must use
//! these formulas, with an IEEE division (not `--use_fast_math`'s
//! approximate one), to match bit for bit.
//!
//! Receive layout ([`RecvShape`] computes every index below). `G = H / 128`,
//! `RT = R * T`.
//! - `recv_x`: e4m3fn bytes `[E_local, RT, H]`, row-major.
//! - f32 scales: logically `[E_local, RT, G]` with the last two dims
//!   column-major, i.e. strides `(RT * G, 1, RT)`: element `(j, row, g)` is at
//!   `j * RT * G + g * RT + row` ([`RecvShape::scale_index`]). This is the
//!   memory order of torch's `empty([E_local, G, RT]).transpose(1, 2)`, the
//!   tensor DeepEP returns; the flat `Vec` is that memory.
//! - `use_ue8m0` (needs `round_scale`): each scale is a power of two, stored as
//!   its biased exponent byte (bits 23..=30 of the f32 `scale_inv`, so
//!   `scale_inv = 2^(byte - 127)`, [`ue8m0_byte`]), four per int32 along the
//!   group axis: int32 `[E_local, RT, W]`, `W = ceil(G / 4)`, column-major in
//!   the same way (`(j, row, w)` at `j * RT * W + w * RT + row`,
//!   [`RecvShape::packed_scale_index`]). Group `g` is byte `g % 4` of word
//!   `g / 4`, little-endian: bits `8 * (g % 4) .. 8 * (g % 4) + 8`, so group
//!   `4w` is the low byte. When `G % 4 != 0` the unused high bytes of the last
//!   word are unspecified (DeepEP requires `H % 512 == 0` and never has them);
//!   the reference writes `0` there.
//!
//! # Combine ([`low_latency_combine`])
//!
//! Every rank returns the expert outputs `y` (bf16 `[E_local, RT, H]`, in the
//! row layout of its dispatch handle) and every source rank rebuilds each of
//! its tokens:
//!
//! ```text
//! acc = +0.0 (f32)
//! for k in 0..K, ascending, skipping topk_idx[t][k] == -1:
//!     acc = fma(y_{e_k}[row of (t, k)], topk_weights[t][k], acc)
//! combined_x[t] = bf16(acc)   (round to nearest even)
//! ```
//!
//! where `row of (t, k)` is the row that carried the message `(t, k)` to expert
//! `e_k` (found through the handle). This is DeepEP's order; `fma` (one
//! rounding) is what nvcc emits for its `acc += y * w` with the default
//! `--fmad=true`. A token with no valid id combines to `+0.0`. Padding rows of
//! `y` are never read.
//!
//! # Choices where the Python contract is silent
//!
//! - **Duplicate ids in one token's top-k.** One message per occurrence, as in
//!   DeepEP (one message per (token, column)): a token listing `e` twice
//!   delivers two rows to `e`, both with its `src_info`. In combine the `i`-th
//!   occurrence (in column order) reads the `i`-th of those rows (in row order).
//!   On the GPU (DeepEP's design) the two occurrences share one return slot,
//!   whichever row's output lands there last: tests with duplicates must give
//!   the duplicate rows identical outputs. With duplicates a source can send
//!   more than `T` messages to one expert; more than `T` (the size of a
//!   source's block on the GPU) is rejected.
//! - **Ids below `-1`** are rejected (DeepEP ignores every negative id).
//! - **`K > MAX_TOPK`** (32) is rejected. DeepEP's low-latency kernels allow a
//!   smaller top-k; the contract here is the larger one.
//! - **`round_scale` without `use_fp8`** is ignored (DeepEP only reads it for
//!   fp8). **`use_ue8m0` without `use_fp8`** is rejected (bf16 dispatch has no
//!   scales to pack), and so is `use_ue8m0` without `round_scale`.
//! - **Non-finite `x` with `use_fp8`** is rejected: DeepEP's amax skips NaNs and
//!   an infinite amax gives a zero multiplier, so the cast is meaningless. bf16
//!   dispatch moves any bf16 bits, NaN and infinities included.
//! - **`H`** must be a positive multiple of 128 in both modes, at most
//!   `LL_MAX_HIDDEN` (8192); every other size is held to the low-latency
//!   kernels' [`limits`] too, so the reference accepts exactly
//!   the shapes a `Buffer` runs.
//!
//! # Comparing GPU results, and tolerances
//!
//! - Dispatch is exact: [`compare_recv`] checks counts, block sizes, that the
//!   GPU's blocks tile the valid rows, and each (expert, source) block's rows
//!   (token index, payload bits, scale bits) as a multiset or in order.
//! - Combine: a kernel with exactly this order and fma is bit-exact, and so is
//!   any kernel on inputs whose products and partial sums are exact in f32
//!   (powers-of-two weights and bf16 values of a narrow range). Otherwise use
//!   [`check_combined`]: a per-element bound that any summation order and any
//!   fused or unfused multiply-add meets. DeepEP's own end-to-end check is
//!   [`calc_diff`]: against the reference computed from the data actually
//!   received (`y` from [`dequantize_fp8`] and [`round_to_bf16`] for fp8) it is
//!   far below `1e-5` in both modes; against the unquantized `sum_k w_k x_t`
//!   DeepEP requires `< 1e-5` for bf16 and `< 9e-4` for fp8 dispatch.
//!
//! # Not modelled
//!
//! `use_logfmt` (a lossy transport encoding of combine), rank masks
//! (`enable_shrink`), hooks and events, and the optional statistics tensors
//! (`cumulative_local_expert_recv_stats` gains `recv_count`).

use crate::limits::{self, check_budget, zeroed};
use crate::normal::{check_len, check_topk_rows, round_to_bf16};
use comm::error::{CommError, Result};
use ep_kernels::low_latency::LlShape;

/// Channels per fp8 scale; `H` must be a positive multiple of this in both
/// modes, at most `LL_MAX_HIDDEN` ([`limits`]).
pub use crate::limits::FP8_GROUP_SIZE;

/// Largest finite e4m3fn value: the saturation bound of the cast and the
/// target of a group's amax.
pub const E4M3_MAX: f32 = 448.0;

/// `1 / 448` rounded to f32 (DeepEP's `kFinfoAmaxInvE4M3`).
pub const E4M3_MAX_INV: f32 = 1.0 / 448.0;

/// Lower clamp of a group's amax (DeepEP's `kFP8Margin`), as f32.
pub const FP8_AMAX_MIN: f32 = 1e-4;

/// The e4m3fn NaN that [`f32_to_e4m3_bits`] produces for every NaN
/// (`0xFF` decodes to NaN as well).
pub const E4M3_NAN: u8 = 0x7F;

/// ue8m0 exponent bytes packed into one int32.
pub const UE8M0_PER_INT32: usize = 4;

// ---- arguments and shapes ----------------------------------------------------

/// Arguments of `low_latency_dispatch` (the same on every rank). Combine uses
/// only the shape fields (`num_max_dispatch_tokens_per_rank`, `hidden`,
/// `num_experts`, `num_topk`), which the Python handle carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LowLatencyArgs {
    /// `T`: at least 1; every rank's token count must be at most this, and
    /// `R * T` must fit in an int32.
    pub num_max_dispatch_tokens_per_rank: usize,
    /// `H`: channels per token, a positive multiple of [`FP8_GROUP_SIZE`].
    pub hidden: usize,
    /// `E`: a positive multiple of the number of ranks.
    pub num_experts: usize,
    /// `K`: columns of `topk_idx` / `topk_weights`, `1..=MAX_TOPK`.
    pub num_topk: usize,
    /// Cast to e4m3fn with one scale per 128 channels (Python default `True`).
    pub use_fp8: bool,
    /// Round the scales up to powers of two (only with `use_fp8`).
    pub round_scale: bool,
    /// Store the scales as packed exponent bytes (only with `use_fp8`;
    /// requires `round_scale`).
    pub use_ue8m0: bool,
}

impl LowLatencyArgs {
    /// The Python defaults: fp8 with float32 scales, no rounding, no ue8m0.
    pub fn new(
        num_max_dispatch_tokens_per_rank: usize,
        hidden: usize,
        num_experts: usize,
        num_topk: usize,
    ) -> Self {
        LowLatencyArgs {
            num_max_dispatch_tokens_per_rank,
            hidden,
            num_experts,
            num_topk,
            use_fp8: true,
            round_scale: false,
            use_ue8m0: false,
        }
    }

    /// These arguments for a bf16 dispatch (`use_fp8=False`).
    pub fn bf16(self) -> Self {
        LowLatencyArgs {
            use_fp8: false,
            ..self
        }
    }

    /// The receive shape for `num_ranks` ranks, after checking the shape
    /// arguments (not the fp8 flags).
    ///
    /// Errors (`InvalidArgument`), the limits of the low-latency kernels
    /// ([`limits`]): `num_ranks` not in `1..=MAX_RANKS`
    /// (`inputs`); `num_experts` not a positive multiple of `num_ranks`, more
    /// than `MAX_EXPERTS_PER_RANK` per rank, or more than a kernel block's
    /// shared memory holds at this `hidden`; `num_topk` not in
    /// `1..=MAX_TOPK`; `hidden` not a positive multiple of [`FP8_GROUP_SIZE`]
    /// or above `LL_MAX_HIDDEN`; `num_max_dispatch_tokens_per_rank` not in
    /// `1..=LL_MAX_TOKENS_PER_RANK`.
    pub fn recv_shape(&self, num_ranks: usize) -> Result<RecvShape> {
        limits::check_ranks("inputs", num_ranks)?;
        let num_local_experts = limits::experts_per_rank(self.num_experts, num_ranks)?;
        limits::check_topk("num_topk", self.num_topk)?;
        limits::check_ll_hidden("hidden", self.hidden)?;
        let t = limits::check_range(
            "num_max_dispatch_tokens_per_rank",
            self.num_max_dispatch_tokens_per_rank,
            1,
            limits::LL_MAX_TOKENS_PER_RANK,
            "tokens per rank",
        )?;
        LlShape {
            num_ranks,
            max_tokens: t,
            hidden: self.hidden,
            num_experts: self.num_experts,
            num_topk: self.num_topk,
        }
        .check_smem()?;
        Ok(RecvShape {
            num_ranks,
            num_local_experts,
            max_tokens: t,
            hidden: self.hidden,
        })
    }

    fn check_format(&self) -> Result<()> {
        if self.use_ue8m0 && !self.use_fp8 {
            return Err(CommError::invalid(
                "use_ue8m0",
                "ue8m0 scales need use_fp8=True (bf16 dispatch has no scales)",
            ));
        }
        if self.use_fp8 && self.use_ue8m0 && !self.round_scale {
            return Err(CommError::invalid(
                "use_ue8m0",
                "ue8m0 scales need round_scale=True",
            ));
        }
        Ok(())
    }

    /// Bytes of every rank's outputs of a dispatch of this shape (the
    /// reference's f32 channels for bf16), checked against
    /// [`limits::reference_max_bytes`].
    fn check_budget(&self, shape: &RecvShape) -> Result<()> {
        let per_row = if self.use_fp8 {
            self.hidden + 4 * shape.num_scales() + 4
        } else {
            4 * self.hidden + 4
        };
        let rows = shape.num_rows() as u128 * shape.num_ranks as u128;
        let bytes = usize::try_from(rows * per_row as u128).unwrap_or(usize::MAX);
        check_budget("num_max_dispatch_tokens_per_rank", bytes)
    }
}

/// Shape of one rank's receive buffers and every index into them. `RT = R * T`
/// rows per local expert, `G = H / 128` scale groups, `W = ceil(G / 4)` packed
/// ue8m0 words.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvShape {
    /// `R`.
    pub num_ranks: usize,
    /// `E_local = E / R`.
    pub num_local_experts: usize,
    /// `T` (`num_max_dispatch_tokens_per_rank`).
    pub max_tokens: usize,
    /// `H`.
    pub hidden: usize,
}

impl RecvShape {
    /// `RT = R * T`: rows of each local expert's slab.
    pub fn rows_per_expert(&self) -> usize {
        self.num_ranks * self.max_tokens
    }

    /// `E_local * RT`: rows of `recv_x` / entries of `src_info`.
    pub fn num_rows(&self) -> usize {
        self.num_local_experts * self.rows_per_expert()
    }

    /// `G = H / 128`: f32 scales per row.
    pub fn num_scales(&self) -> usize {
        self.hidden / FP8_GROUP_SIZE
    }

    /// `W = ceil(G / 4)`: ue8m0 int32 words per row.
    pub fn num_packed_scales(&self) -> usize {
        self.num_scales().div_ceil(UE8M0_PER_INT32)
    }

    /// Index of row `row` of local expert `expert` in `src_info`; the row's
    /// channels are `recv_x[row_index * H .. (row_index + 1) * H]`.
    pub fn row_index(&self, expert: usize, row: usize) -> usize {
        expert * self.rows_per_expert() + row
    }

    /// Index of the f32 scale of group `group` of row `row` of local expert
    /// `expert`: `expert * RT * G + group * RT + row` (column-major last two
    /// dims).
    pub fn scale_index(&self, expert: usize, row: usize, group: usize) -> usize {
        let rt = self.rows_per_expert();
        expert * rt * self.num_scales() + group * rt + row
    }

    /// Index of ue8m0 word `word` (groups `4 * word .. 4 * word + 4`) of row
    /// `row` of local expert `expert`: `expert * RT * W + word * RT + row`.
    pub fn packed_scale_index(&self, expert: usize, row: usize, word: usize) -> usize {
        let rt = self.rows_per_expert();
        expert * rt * self.num_packed_scales() + word * rt + row
    }

    /// The ue8m0 byte of group `group` of a row: byte `group % 4`
    /// (little-endian) of its word `group / 4` in `packed`.
    pub fn ue8m0_byte_at(&self, packed: &[i32], expert: usize, row: usize, group: usize) -> u8 {
        let word = packed[self.packed_scale_index(expert, row, group / UE8M0_PER_INT32)] as u32;
        (word >> (8 * (group % UE8M0_PER_INT32))) as u8
    }
}

/// `(begin << 32) | count`: a `layout_range` entry (DeepEP's
/// `pack2<int, int64_t>(count, begin)`: `count` in the low 32 bits).
pub fn pack_layout_range(begin: i32, count: i32) -> i64 {
    (i64::from(begin) << 32) | i64::from(count as u32)
}

/// `(begin, count)` of a `layout_range` entry; the inverse of
/// [`pack_layout_range`].
pub fn unpack_layout_range(packed: i64) -> (i32, i32) {
    ((packed >> 32) as i32, packed as i32)
}

// ---- dispatch -----------------------------------------------------------------

/// One source rank's inputs of `low_latency_dispatch`. `T_r` is
/// `topk_idx.len() / K`.
#[derive(Debug, Clone, Copy)]
pub struct LlRankInput<'a> {
    /// `[T_r, H]` bf16 values as f32 (see the module docs).
    pub x: &'a [f32],
    /// `[T_r, K]` expert ids in `-1 ..= E - 1`.
    pub topk_idx: &'a [i64],
}

/// The received channels of one rank.
#[derive(Debug, Clone, PartialEq)]
pub enum RecvX {
    /// `[E_local, RT, H]` bf16 values as f32: the source token's values,
    /// unchanged.
    Bf16(Vec<f32>),
    /// The fp8 cast.
    Fp8 {
        /// `[E_local, RT, H]` e4m3fn bytes.
        x: Vec<u8>,
        /// The scales, in the column-major layouts of the module docs.
        scales: RecvScales,
    },
}

/// Scales of an fp8 dispatch (layouts in the module docs and [`RecvShape`]).
#[derive(Debug, Clone, PartialEq)]
pub enum RecvScales {
    /// `[E_local, RT, G]` f32 `scale_inv`, last two dims column-major.
    F32(Vec<f32>),
    /// `[E_local, RT, W]` int32 of four ue8m0 bytes each, last two dims
    /// column-major (`use_ue8m0`).
    Ue8m0(Vec<i32>),
}

/// What one destination rank `d` receives from [`low_latency_dispatch`]: the
/// Python call's `recv_x` (and scales), `recv_count` and the handle's two
/// tensors. Also the shape a GPU result is put in for [`compare_recv`].
#[derive(Debug, Clone, PartialEq)]
pub struct LlRankOutput {
    /// Channels of the received rows; row `row` of local expert `j` is
    /// `RecvShape::row_index(j, row)`. Only rows `..recv_count[j]` are
    /// specified.
    pub recv_x: RecvX,
    /// `[E_local]`: number of messages received by each local expert.
    pub recv_count: Vec<i32>,
    /// `[E_local, RT]`: index of each valid row's token on its source rank.
    pub src_info: Vec<i32>,
    /// `[E_local, R]`: `(begin << 32) | count` of each source rank's block.
    pub layout_range: Vec<i64>,
}

impl LlRankOutput {
    /// The handle's routing tensors, as [`low_latency_combine`] takes them.
    pub fn handle(&self) -> LlHandle<'_> {
        LlHandle {
            src_info: &self.src_info,
            layout_range: &self.layout_range,
        }
    }
}

/// Result of [`low_latency_dispatch`] for all ranks.
#[derive(Debug, Clone, PartialEq)]
pub struct LlDispatched {
    /// The arguments the dispatch ran with.
    pub args: LowLatencyArgs,
    /// Receive shape (the same on every rank).
    pub shape: RecvShape,
    /// `[R]`: `T_r`, the token count of each source rank.
    pub num_tokens: Vec<usize>,
    /// `[R]`: what each destination rank receives.
    pub ranks: Vec<LlRankOutput>,
}

/// `low_latency_dispatch` over all ranks at once; `inputs[r]` is rank `r`'s
/// input, so `R = inputs.len()`. See the module docs for the semantics and
/// [`LlRankOutput`] for the outputs; the reference's order is source rank
/// ascending, then token ascending, then column ascending.
///
/// Errors (`InvalidArgument`): those of [`LowLatencyArgs::recv_shape`];
/// `use_ue8m0` with `use_fp8` but without `round_scale`; `topk_idx` not a
/// whole number of rows or with an id outside `-1 ..= E - 1`; a rank with
/// more than `T` tokens (`num_max_dispatch_tokens_per_rank`), or sending more
/// than `T` messages to one expert (duplicate ids; `topk_idx`); `x` of the
/// wrong length, with a value that is not exactly bf16, or (fp8) not finite.
pub fn low_latency_dispatch(
    inputs: &[LlRankInput<'_>],
    args: &LowLatencyArgs,
) -> Result<LlDispatched> {
    let (shape, num_tokens, cast) = prepare_dispatch(inputs, args)?;
    let ranks = (0..shape.num_ranks)
        .map(|d| receive(d, inputs, args, &shape, cast.as_deref()))
        .collect::<Result<_>>()?;
    Ok(LlDispatched {
        args: *args,
        shape,
        num_tokens,
        ranks,
    })
}

/// What `rank` receives in [`low_latency_dispatch`] of every rank's `inputs`
/// (its `ranks[rank]`), computed alone: 1 / R of the work and memory, for a
/// rank that checks its own GPU results.
pub fn low_latency_dispatch_rank(
    inputs: &[LlRankInput<'_>],
    args: &LowLatencyArgs,
    rank: usize,
) -> Result<LlRankOutput> {
    if rank >= inputs.len() {
        return Err(CommError::invalid(
            "rank",
            format!("{rank}: the dispatch has {} ranks", inputs.len()),
        ));
    }
    let (shape, _, cast) = prepare_dispatch(inputs, args)?;
    receive(rank, inputs, args, &shape, cast.as_deref())
}

/// The checks of a dispatch, the receive shape, every rank's token count and
/// (fp8) every rank's tokens cast once.
#[allow(clippy::type_complexity)]
fn prepare_dispatch(
    inputs: &[LlRankInput<'_>],
    args: &LowLatencyArgs,
) -> Result<(RecvShape, Vec<usize>, Option<Vec<Fp8Tokens>>)> {
    let shape = args.recv_shape(inputs.len())?;
    args.check_format()?;
    args.check_budget(&shape)?;
    let (num_ranks, h) = (shape.num_ranks, args.hidden);
    let mut num_tokens = Vec::with_capacity(num_ranks);
    for (r, input) in inputs.iter().enumerate() {
        let n = check_topk_idx(r, input.topk_idx, args)?;
        check_len("x", r, input.x.len(), n, h)?;
        check_bf16("x", r, input.x, h, args.use_fp8)?;
        num_tokens.push(n);
    }
    // Each (source rank, expert) block holds at most T rows on the GPU.
    for (r, input) in inputs.iter().enumerate() {
        let mut per_expert = vec![0usize; args.num_experts];
        for &e in input.topk_idx.iter().filter(|&&e| e >= 0) {
            per_expert[e as usize] += 1;
        }
        if let Some((e, &c)) = per_expert
            .iter()
            .enumerate()
            .find(|&(_, &c)| c > shape.max_tokens)
        {
            return Err(CommError::invalid(
                "topk_idx",
                format!(
                    "rank {r} sends {c} messages to expert {e} (duplicate ids), more than \
                     num_max_dispatch_tokens_per_rank = {}",
                    shape.max_tokens
                ),
            ));
        }
    }
    // The sender casts every token once.
    let cast: Option<Vec<Fp8Tokens>> = args.use_fp8.then(|| {
        inputs
            .iter()
            .map(|input| quantize_groups(input.x, args.round_scale))
            .collect()
    });
    Ok((shape, num_tokens, cast))
}

/// Rank `d`'s outputs of a dispatch (see [`low_latency_dispatch`]).
fn receive(
    d: usize,
    inputs: &[LlRankInput<'_>],
    args: &LowLatencyArgs,
    shape: &RecvShape,
    cast: Option<&[Fp8Tokens]>,
) -> Result<LlRankOutput> {
    let (num_ranks, k, h) = (shape.num_ranks, args.num_topk, args.hidden);
    let el = shape.num_local_experts;
    let rt = shape.rows_per_expert();
    let g = shape.num_scales();
    let mut src_info = zeroed("num_max_dispatch_tokens_per_rank", el * rt, -1i32)?;
    let mut layout_range = vec![0i64; el * num_ranks];
    let mut recv_count = vec![0i32; el];
    // (local expert, row, source rank, token) of every valid row.
    let mut placed = Vec::new();
    for j in 0..el {
        let e = (d * el + j) as i64;
        let mut next = 0usize;
        for (r, input) in inputs.iter().enumerate() {
            let begin = next;
            for (t, row) in input.topk_idx.chunks_exact(k).enumerate() {
                for _ in row.iter().filter(|&&id| id == e) {
                    src_info[shape.row_index(j, next)] = t as i32;
                    placed.push((j, next, r, t));
                    next += 1;
                }
            }
            // Fits: at most T per block, R * T <= i32::MAX.
            layout_range[j * num_ranks + r] =
                pack_layout_range(begin as i32, (next - begin) as i32);
        }
        recv_count[j] = next as i32;
    }
    let recv_x = match &cast {
        None => {
            let mut x = zeroed(
                "num_max_dispatch_tokens_per_rank",
                shape.num_rows() * h,
                0.0f32,
            )?;
            for &(j, row, r, t) in &placed {
                let at = shape.row_index(j, row) * h;
                x[at..at + h].copy_from_slice(&inputs[r].x[t * h..(t + 1) * h]);
            }
            RecvX::Bf16(x)
        }
        Some(cast) => {
            let rows = shape.num_rows();
            let name = "num_max_dispatch_tokens_per_rank";
            let mut x = zeroed(name, rows * h, 0u8)?;
            let (f32_len, packed_len) = if args.use_ue8m0 {
                (0, rows * shape.num_packed_scales())
            } else {
                (rows * g, 0)
            };
            let mut f32_scales = zeroed(name, f32_len, 0.0f32)?;
            let mut packed = zeroed(name, packed_len, 0i32)?;
            for &(j, row, r, t) in &placed {
                let at = shape.row_index(j, row) * h;
                x[at..at + h].copy_from_slice(&cast[r].x[t * h..(t + 1) * h]);
                for (group, &s) in cast[r].scales[t * g..(t + 1) * g].iter().enumerate() {
                    if args.use_ue8m0 {
                        let w = shape.packed_scale_index(j, row, group / UE8M0_PER_INT32);
                        let shift = 8 * (group % UE8M0_PER_INT32);
                        packed[w] = (packed[w] as u32 | u32::from(ue8m0_byte(s)) << shift) as i32;
                    } else {
                        f32_scales[shape.scale_index(j, row, group)] = s;
                    }
                }
            }
            let scales = if args.use_ue8m0 {
                RecvScales::Ue8m0(packed)
            } else {
                RecvScales::F32(f32_scales)
            };
            RecvX::Fp8 { x, scales }
        }
    };
    Ok(LlRankOutput {
        recv_x,
        recv_count,
        src_info,
        layout_range,
    })
}

// ---- comparing a GPU dispatch ---------------------------------------------------

/// How much of the reference's receive order [`compare_recv`] demands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecvOrder {
    /// The reference's order: blocks in source-rank order (every nonempty
    /// block's `begin` equal) and rows in token order.
    Exact,
    /// Blocks in any order; rows of each block in token order (column order
    /// for a duplicated id).
    TokensAscending,
    /// Blocks in any order, rows of each block in any order (DeepEP's
    /// guarantee).
    Any,
}

/// Compares what a GPU received on one rank (`got`, its host copies put into
/// an [`LlRankOutput`]) with the reference's `expected`, looking only at
/// specified data: `recv_count`; each block's count; that `got`'s nonempty
/// blocks lie in `0..recv_count[j]` without overlap (so they tile it); and
/// per (local expert, source rank) block the rows as (`src_info`, channel
/// bits, scale bits or ue8m0 bytes of the `G` real groups) — compared as a
/// multiset or in order as `order` says. Padding rows, empty blocks' `begin`
/// and unused ue8m0 bytes are ignored.
///
/// `Err` describes the first difference (or a malformed buffer length).
pub fn compare_recv(
    shape: &RecvShape,
    expected: &LlRankOutput,
    got: &LlRankOutput,
    order: RecvOrder,
) -> std::result::Result<(), String> {
    check_output_lengths(shape, expected).map_err(|e| format!("expected: {e}"))?;
    check_output_lengths(shape, got).map_err(|e| format!("got: {e}"))?;
    if format_name(&expected.recv_x) != format_name(&got.recv_x) {
        return Err(format!(
            "format: expected {}, got {}",
            format_name(&expected.recv_x),
            format_name(&got.recv_x)
        ));
    }
    if expected.recv_count != got.recv_count {
        return Err(format!(
            "recv_count: expected {:?}, got {:?}",
            expected.recv_count, got.recv_count
        ));
    }
    let num_ranks = shape.num_ranks;
    for j in 0..shape.num_local_experts {
        let total = got.recv_count[j].max(0) as usize;
        let mut covered = vec![false; total];
        for r in 0..num_ranks {
            let (eb, ec) = unpack_layout_range(expected.layout_range[j * num_ranks + r]);
            let (gb, gc) = unpack_layout_range(got.layout_range[j * num_ranks + r]);
            let at = format!("local expert {j}, source rank {r}");
            if ec != gc {
                return Err(format!("{at}: block of {gc} rows, expected {ec}"));
            }
            if gc == 0 {
                continue;
            }
            if gb < 0 || gb as usize + gc as usize > total {
                return Err(format!(
                    "{at}: block {gb}..{} outside the {total} valid rows",
                    i64::from(gb) + i64::from(gc)
                ));
            }
            let (gb, count) = (gb as usize, gc as usize);
            if let Some(row) = (gb..gb + count).find(|&row| covered[row]) {
                return Err(format!("{at}: row {row} also belongs to another block"));
            }
            covered[gb..gb + count].fill(true);
            if order == RecvOrder::Exact && eb as usize != gb {
                return Err(format!("{at}: block begins at row {gb}, expected {eb}"));
            }
            let mut want: Vec<RowKey> = (0..count)
                .map(|i| row_key(shape, expected, j, eb as usize + i))
                .collect();
            let mut have: Vec<RowKey> =
                (0..count).map(|i| row_key(shape, got, j, gb + i)).collect();
            if order == RecvOrder::Any {
                want.sort();
                have.sort();
            }
            for (i, (w, g)) in want.iter().zip(&have).enumerate() {
                if w.token != g.token {
                    return Err(format!(
                        "{at}: row {i} of the block{} is token {}, expected token {}",
                        if order == RecvOrder::Any {
                            " (sorted)"
                        } else {
                            ""
                        },
                        g.token,
                        w.token
                    ));
                }
                if let Some(c) = (0..w.data.len()).find(|&c| w.data[c] != g.data[c]) {
                    let what = if c < shape.hidden {
                        format!("channel {c}")
                    } else {
                        format!("scale group {}", c - shape.hidden)
                    };
                    return Err(format!(
                        "{at}: token {}, {what}: bits {:#x}, expected {:#x}",
                        w.token, g.data[c], w.data[c]
                    ));
                }
            }
        }
    }
    Ok(())
}

/// One valid row as compared by [`compare_recv`]: token index, then the
/// channel bits, then the scale bits (f32) or exponent bytes (ue8m0).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct RowKey {
    token: i32,
    data: Vec<u32>,
}

fn row_key(shape: &RecvShape, out: &LlRankOutput, j: usize, row: usize) -> RowKey {
    let h = shape.hidden;
    let at = shape.row_index(j, row);
    let mut data = Vec::with_capacity(h + shape.num_scales());
    match &out.recv_x {
        RecvX::Bf16(x) => data.extend(x[at * h..(at + 1) * h].iter().map(|v| v.to_bits())),
        RecvX::Fp8 { x, scales } => {
            data.extend(x[at * h..(at + 1) * h].iter().map(|&q| u32::from(q)));
            for g in 0..shape.num_scales() {
                data.push(match scales {
                    RecvScales::F32(s) => s[shape.scale_index(j, row, g)].to_bits(),
                    RecvScales::Ue8m0(p) => u32::from(shape.ue8m0_byte_at(p, j, row, g)),
                });
            }
        }
    }
    RowKey {
        token: out.src_info[at],
        data,
    }
}

fn format_name(x: &RecvX) -> &'static str {
    match x {
        RecvX::Bf16(_) => "bf16",
        RecvX::Fp8 {
            scales: RecvScales::F32(_),
            ..
        } => "fp8 with f32 scales",
        RecvX::Fp8 {
            scales: RecvScales::Ue8m0(_),
            ..
        } => "fp8 with ue8m0 scales",
    }
}

fn check_output_lengths(shape: &RecvShape, out: &LlRankOutput) -> std::result::Result<(), String> {
    let rows = shape.num_rows();
    let el = shape.num_local_experts;
    let lens = [
        ("recv_count", out.recv_count.len(), el),
        ("src_info", out.src_info.len(), rows),
        ("layout_range", out.layout_range.len(), el * shape.num_ranks),
    ];
    let (x_len, scales) = match &out.recv_x {
        RecvX::Bf16(x) => (x.len(), None),
        RecvX::Fp8 {
            x,
            scales: RecvScales::F32(s),
        } => (x.len(), Some((s.len(), rows * shape.num_scales()))),
        RecvX::Fp8 {
            x,
            scales: RecvScales::Ue8m0(p),
        } => (x.len(), Some((p.len(), rows * shape.num_packed_scales()))),
    };
    for (name, len, want) in lens
        .into_iter()
        .chain([("recv_x", x_len, rows * shape.hidden)])
        .chain(scales.map(|(len, want)| ("scales", len, want)))
    {
        if len != want {
            return Err(format!("{name} has {len} elements, expected {want}"));
        }
    }
    if let Some(j) = (0..el).find(|&j| out.recv_count[j] < 0) {
        return Err(format!(
            "recv_count[{j}] = {} is negative",
            out.recv_count[j]
        ));
    }
    Ok(())
}

// ---- combine -----------------------------------------------------------------------

/// The routing tensors of one rank's low-latency handle (the rest of the
/// Python handle, `T`, `H` and `E`, is in [`LowLatencyArgs`]). They may come
/// from [`low_latency_dispatch`] or from a GPU: [`low_latency_combine`] takes
/// any valid arrival order.
#[derive(Debug, Clone, Copy)]
pub struct LlHandle<'a> {
    /// `[E_local, RT]` source token index of each valid row.
    pub src_info: &'a [i32],
    /// `[E_local, R]` `(begin << 32) | count` of each source rank's block.
    pub layout_range: &'a [i64],
}

/// One rank's arguments of `low_latency_combine`. The rank plays two roles:
/// `x` and `handle` describe the rows it received; `topk_idx` and
/// `topk_weights` belong to its own tokens.
#[derive(Debug, Clone, Copy)]
pub struct LlCombineInput<'a> {
    /// `[E_local, RT, H]` expert outputs as bf16 values in f32, in the row
    /// layout of `handle`. Only valid rows are read (and must be bf16).
    pub x: &'a [f32],
    /// `[T_r, K]` this rank's routing, as passed to dispatch.
    pub topk_idx: &'a [i64],
    /// `[T_r, K]` weights; entries at `-1` ids are ignored.
    pub topk_weights: &'a [f32],
    /// This rank's dispatch handle.
    pub handle: LlHandle<'a>,
}

impl<'a> LlCombineInput<'a> {
    /// One rank's input from its arrays, as the bindings decode them.
    pub fn new(
        x: &'a [f32],
        topk_idx: &'a [i64],
        topk_weights: &'a [f32],
        src_info: &'a [i32],
        layout_range: &'a [i64],
    ) -> Self {
        Self {
            x,
            topk_idx,
            topk_weights,
            handle: LlHandle {
                src_info,
                layout_range,
            },
        }
    }
}

/// Combine result for one source rank.
#[derive(Debug, Clone, PartialEq)]
pub struct LlCombineOutput {
    /// `[T_r, H]`: the bf16 output (as f32 values), `round_to_bf16` of
    /// `combined_x_f32`: what a kernel with the reference order stores.
    pub combined_x: Vec<f32>,
    /// `[T_r, H]`: the f32 accumulator before the final bf16 store (see the
    /// module docs for the order).
    pub combined_x_f32: Vec<f32>,
    /// `[T_r, H]`: `sum_k |w_k * y_k|` (in f64, stored as f32), the scale of
    /// the rounding error of any summation order; used by [`check_combined`].
    pub abs_sum: Vec<f32>,
}

/// `low_latency_combine` over all ranks at once: `inputs[r]` is rank `r`'s
/// input, so `R = inputs.len()`. Each source token gets the weighted sum of
/// its experts' outputs, accumulated as the module docs say.
///
/// The handles are checked against the routing: every (destination rank,
/// local expert, source rank) block must hold exactly one row per occurrence
/// of that expert in the source's `topk_idx`, with that token's index in
/// `src_info`, in any order; so a GPU handle can be used as is.
///
/// Errors (`InvalidArgument`): those of [`LowLatencyArgs::recv_shape`];
/// `topk_idx` as in dispatch (shape, ids, `T_r > T`:
/// `num_max_dispatch_tokens_per_rank`); `topk_weights` or `x` of the wrong
/// length; a `src_info` / `layout_range` of the wrong length; a block outside
/// `0..RT`, with a negative count, or overlapping another, or blocks that do
/// not tile `0..sum of counts` (`layout_range`); a row whose token index is
/// out of range or a block whose tokens differ from the routing (`src_info`);
/// a valid row of `x` that is not exactly bf16 (`x`).
pub fn low_latency_combine(
    inputs: &[LlCombineInput<'_>],
    args: &LowLatencyArgs,
) -> Result<Vec<LlCombineOutput>> {
    let shape = args.recv_shape(inputs.len())?;
    let (num_ranks, el, rt) = (
        shape.num_ranks,
        shape.num_local_experts,
        shape.rows_per_expert(),
    );
    let (k, h) = (args.num_topk, args.hidden);
    let mut num_tokens = Vec::with_capacity(num_ranks);
    for (r, input) in inputs.iter().enumerate() {
        let n = check_topk_idx(r, input.topk_idx, args)?;
        check_len("topk_weights", r, input.topk_weights.len(), n, k)?;
        check_len("x", r, input.x.len(), shape.num_rows(), h)?;
        check_len("src_info", r, input.handle.src_info.len(), el, rt)?;
        check_len(
            "layout_range",
            r,
            input.handle.layout_range.len(),
            el,
            num_ranks,
        )?;
        num_tokens.push(n);
    }

    // occurrences[r][e]: the (token, column) of every message of rank r to
    // expert e, token-major, column-minor.
    let occurrences: Vec<Vec<Vec<(usize, usize)>>> = inputs
        .iter()
        .map(|input| {
            let mut per_expert = vec![Vec::new(); args.num_experts];
            for (t, row) in input.topk_idx.chunks_exact(k).enumerate() {
                for (c, &e) in row.iter().enumerate() {
                    if e >= 0 {
                        per_expert[e as usize].push((t, c));
                    }
                }
            }
            per_expert
        })
        .collect();

    // source[r][t * K + c] = (destination rank, row index) of message (t, c).
    let mut source: Vec<Vec<(usize, usize)>> = num_tokens
        .iter()
        .map(|&n| vec![(usize::MAX, usize::MAX); n * k])
        .collect();
    for (d, input) in inputs.iter().enumerate() {
        for j in 0..el {
            let blocks = check_blocks(
                d,
                j,
                &input.handle.layout_range[j * num_ranks..][..num_ranks],
                rt,
            )?;
            for (r, (begin, count)) in blocks.into_iter().enumerate() {
                // Rows of the block sorted by (token, row): the i-th occurrence
                // in (token, column) order takes the i-th row.
                let mut rows: Vec<(i32, usize)> = (begin..begin + count)
                    .map(|row| (input.handle.src_info[shape.row_index(j, row)], row))
                    .collect();
                if let Some(&(t, row)) = rows
                    .iter()
                    .find(|&&(t, _)| t < 0 || t as usize >= num_tokens[r])
                {
                    return Err(CommError::invalid(
                        "src_info",
                        format!(
                            "rank {d}, local expert {j}, row {row}: token {t} is not a token \
                             of source rank {r} (it has {})",
                            num_tokens[r]
                        ),
                    ));
                }
                rows.sort_unstable();
                let want = &occurrences[r][d * el + j];
                let tokens_differ = rows.len() != want.len()
                    || rows
                        .iter()
                        .zip(want)
                        .any(|(&(t, _), &(wt, _))| t as usize != wt);
                if tokens_differ {
                    return Err(CommError::invalid(
                        "src_info",
                        format!(
                            "rank {d}, local expert {j}: the block of source rank {r} holds \
                             tokens {:?}, but the routing sends tokens {:?}",
                            rows.iter().map(|&(t, _)| t).collect::<Vec<_>>(),
                            want.iter().map(|&(t, _)| t).collect::<Vec<_>>()
                        ),
                    ));
                }
                for (&(_, row), &(t, c)) in rows.iter().zip(want) {
                    let at = shape.row_index(j, row);
                    check_bf16_row(d, at, &input.x[at * h..(at + 1) * h])?;
                    source[r][t * k + c] = (d, at);
                }
            }
        }
    }

    Ok(inputs
        .iter()
        .enumerate()
        .map(|(r, input)| {
            let n = num_tokens[r];
            let mut acc = vec![0.0f32; n * h];
            let mut abs_sum = vec![0.0f64; n * h];
            for t in 0..n {
                let out = &mut acc[t * h..(t + 1) * h];
                let mag = &mut abs_sum[t * h..(t + 1) * h];
                for c in 0..k {
                    if input.topk_idx[t * k + c] < 0 {
                        continue;
                    }
                    let w = input.topk_weights[t * k + c];
                    let (d, at) = source[r][t * k + c];
                    let y = &inputs[d].x[at * h..(at + 1) * h];
                    for ((a, m), &v) in out.iter_mut().zip(mag.iter_mut()).zip(y) {
                        *a = v.mul_add(w, *a);
                        *m += (f64::from(v) * f64::from(w)).abs();
                    }
                }
            }
            LlCombineOutput {
                combined_x: acc.iter().map(|&v| round_to_bf16(v)).collect(),
                combined_x_f32: acc,
                abs_sum: abs_sum.iter().map(|&v| v as f32).collect(),
            }
        })
        .collect())
}

/// `(begin, count)` of the `R` blocks of one local expert, checked: inside
/// `0..rt`, nonnegative, disjoint, nonempty ones tiling `0..sum of counts`.
fn check_blocks(d: usize, j: usize, ranges: &[i64], rt: usize) -> Result<Vec<(usize, usize)>> {
    let mut blocks = Vec::with_capacity(ranges.len());
    let mut nonempty = Vec::new();
    for (r, &packed) in ranges.iter().enumerate() {
        let (begin, count) = unpack_layout_range(packed);
        let bad = |why: String| {
            CommError::invalid(
                "layout_range",
                format!("rank {d}, local expert {j}, source rank {r}: {why}"),
            )
        };
        if count < 0 {
            return Err(bad(format!("negative count {count}")));
        }
        if count == 0 {
            blocks.push((0, 0));
            continue;
        }
        if begin < 0 || begin as usize + count as usize > rt {
            return Err(bad(format!(
                "rows {begin}..{} outside 0..{rt}",
                i64::from(begin) + i64::from(count)
            )));
        }
        blocks.push((begin as usize, count as usize));
        nonempty.push((begin as usize, count as usize));
    }
    nonempty.sort_unstable();
    let mut next = 0;
    for &(begin, count) in &nonempty {
        if begin != next {
            return Err(CommError::invalid(
                "layout_range",
                format!(
                    "rank {d}, local expert {j}: blocks do not tile the valid rows \
                     (a block starts at {begin}, expected {next})"
                ),
            ));
        }
        next += count;
    }
    Ok(blocks)
}

/// Checks a GPU's combined bf16 output (`got`, as f32 values) of one source
/// rank against the reference, element by element, with a bound that holds
/// for any summation order and for fused or separate multiply-adds:
///
/// ```text
/// delta   = 2 (K + 1) 2^-24 abs_sum          (f32 rounding of K products and sums, both sides)
/// allowed = delta + 2^-8 (|ref| + delta) + 2^-133   (the final bf16 rounding; bf16 subnormals)
/// ```
///
/// where `ref` is `combined_x_f32`. An element passes if it equals
/// `combined_x` bit for bit (infinities included) or is within `allowed` of
/// `ref`; a NaN passes only where the reference is NaN. `Err` names the first
/// element that fails.
pub fn check_combined(
    expected: &LlCombineOutput,
    got: &[f32],
    num_topk: usize,
) -> std::result::Result<(), String> {
    if got.len() != expected.combined_x.len() {
        return Err(format!(
            "{} elements, expected {}",
            got.len(),
            expected.combined_x.len()
        ));
    }
    let unit = 2f64.powi(-24);
    for (i, &g) in got.iter().enumerate() {
        let r = expected.combined_x_f32[i];
        if g.to_bits() == expected.combined_x[i].to_bits() || (r.is_nan() && g.is_nan()) {
            continue;
        }
        let delta = 2.0 * (num_topk as f64 + 1.0) * unit * f64::from(expected.abs_sum[i]);
        let allowed = delta + 2f64.powi(-8) * (f64::from(r).abs() + delta) + 2f64.powi(-133);
        let diff = (f64::from(g) - f64::from(r)).abs();
        if diff.is_nan() || diff > allowed {
            return Err(format!(
                "element {i}: got {g:e}, reference {r:e} (bf16 {:e}), |diff| {diff:e} > \
                 allowed {allowed:e}",
                expected.combined_x[i]
            ));
        }
    }
    Ok(())
}

/// DeepEP's similarity measure (`calc_diff` of its tests): with `a' = a + 1`
/// and `b' = b + 1` in f64, `1 - 2 sum(a' b') / sum(a'^2 + b'^2)`. 0 means
/// equal; DeepEP asserts `< 1e-5` for bf16 and `< 9e-4` for fp8 dispatch
/// (combine against the unquantized input). Empty inputs give 0.
///
/// Panics if the lengths differ.
pub fn calc_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "calc_diff of slices of different lengths");
    let (mut cross, mut squares) = (0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (f64::from(x) + 1.0, f64::from(y) + 1.0);
        cross += x * y;
        squares += x * x + y * y;
    }
    if squares == 0.0 {
        0.0
    } else {
        1.0 - 2.0 * cross / squares
    }
}

// ---- fp8 --------------------------------------------------------------------------

/// The scale pair of one group ([`fp8_scale`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fp8Scale {
    /// Multiplier applied before the cast (`448 / amax`, or `2^-p`).
    pub scale: f32,
    /// Stored scale: the dequantization factor (`amax / 448`, or `2^p`).
    pub scale_inv: f32,
}

/// Scales of a group with this `amax` (already clamped: finite and at least
/// [`FP8_AMAX_MIN`]), exactly as the module docs say: without `round_scale`
/// `scale_inv = fl(amax * E4M3_MAX_INV)`, `scale = fl(448 / amax)`; with it
/// `scale_inv = 2^p`, `scale = 2^-p`, `p = ceil(log2(fl(amax * E4M3_MAX_INV)))`.
pub fn fp8_scale(amax: f32, round_scale: bool) -> Fp8Scale {
    debug_assert!(amax.is_finite() && amax >= FP8_AMAX_MIN, "amax {amax}");
    let v = amax * E4M3_MAX_INV;
    if round_scale {
        // v >= 1e-4 / 448 is a normal f32, and p lies in -22..=121.
        let bits = v.to_bits();
        let p = ((bits >> 23) & 0xFF) as i32 - 127 + i32::from(bits & 0x7F_FFFF != 0);
        Fp8Scale {
            scale: pow2(-p),
            scale_inv: pow2(p),
        }
    } else {
        Fp8Scale {
            scale: E4M3_MAX / amax,
            scale_inv: v,
        }
    }
}

/// `2^p` for `-126 <= p <= 127`, exactly.
fn pow2(p: i32) -> f32 {
    f32::from_bits(((p + 127) as u32) << 23)
}

/// An fp8 cast of whole rows: what [`quantize_fp8`] returns.
#[derive(Debug, Clone, PartialEq)]
pub struct Fp8Tokens {
    /// `[N, H]` e4m3fn bytes, like the input.
    pub x: Vec<u8>,
    /// `[N, H / 128]` stored scales (`scale_inv`), row-major: one per group,
    /// in the order of the groups.
    pub scales: Vec<f32>,
}

/// The sender's fp8 cast of `[N, H]` bf16 values (`H` a multiple of 128; only
/// `x.len()` matters, since groups never straddle rows): per group of 128,
/// amax, [`fp8_scale`] and [`f32_to_e4m3_bits`] as the module docs say.
/// Non-finite inputs are outside the contract (a NaN is skipped by the amax,
/// as by CUDA's `fmaxf`, and cast to [`E4M3_NAN`]).
///
/// Errors (`InvalidArgument`): `x.len()` not a multiple of 128 (`x`).
pub fn quantize_fp8(x: &[f32], round_scale: bool) -> Result<Fp8Tokens> {
    check_whole_groups(x.len(), "values")?;
    Ok(quantize_groups(x, round_scale))
}

/// `InvalidArgument` (`x`) unless `len` `unit`s make whole fp8 groups.
fn check_whole_groups(len: usize, unit: &str) -> Result<()> {
    if len % FP8_GROUP_SIZE != 0 {
        return Err(CommError::invalid(
            "x",
            format!("{len} {unit} is not a whole number of {FP8_GROUP_SIZE}-channel groups"),
        ));
    }
    Ok(())
}

fn quantize_groups(x: &[f32], round_scale: bool) -> Fp8Tokens {
    let mut q = Vec::with_capacity(x.len());
    let mut scales = Vec::with_capacity(x.len() / FP8_GROUP_SIZE);
    for group in x.chunks_exact(FP8_GROUP_SIZE) {
        let amax = group.iter().fold(FP8_AMAX_MIN, |m, v| m.max(v.abs()));
        let s = fp8_scale(amax, round_scale);
        q.extend(group.iter().map(|&v| f32_to_e4m3_bits(v * s.scale)));
        scales.push(s.scale_inv);
    }
    Fp8Tokens { x: q, scales }
}

/// The inverse of [`quantize_fp8`]'s layout: `decode(q) * scale_inv` (one f32
/// multiplication) for `[N, H]` bytes and `[N, H / 128]` row-major scales.
/// The result is generally not bf16: round with [`round_to_bf16`] to get the
/// bf16 tensor torch's `(q.float() * s).bfloat16()` gives.
///
/// Errors (`InvalidArgument`): `x.len()` not a multiple of 128 (`x`);
/// `scales.len() != x.len() / 128` (`scales`).
pub fn dequantize_fp8_rows(x: &[u8], scales: &[f32]) -> Result<Vec<f32>> {
    check_whole_groups(x.len(), "bytes")?;
    if scales.len() != x.len() / FP8_GROUP_SIZE {
        return Err(CommError::invalid(
            "scales",
            format!(
                "{} scales for {} groups",
                scales.len(),
                x.len() / FP8_GROUP_SIZE
            ),
        ));
    }
    Ok(x.chunks_exact(FP8_GROUP_SIZE)
        .zip(scales)
        .flat_map(|(group, &s)| group.iter().map(move |&q| e4m3_bits_to_f32(q) * s))
        .collect())
}

/// Dequantizes a received fp8 buffer (`recv_x` bytes `[E_local, RT, H]` and
/// its scales in the receive layouts of the module docs) to `[E_local, RT, H]`
/// f32 values `decode(q) * scale_inv`, ue8m0 bytes read as `2^(byte - 127)`
/// ([`ue8m0_to_f32`]). Padding rows are converted too (they mean nothing).
/// Round with [`round_to_bf16`] to use the result as bf16 expert outputs.
///
/// Errors (`InvalidArgument`): `hidden` not a positive multiple of 128;
/// `x` or `scales` of the wrong length.
pub fn dequantize_fp8(x: &[u8], scales: &RecvScales, shape: &RecvShape) -> Result<Vec<f32>> {
    let h = shape.hidden;
    if h == 0 || h % FP8_GROUP_SIZE != 0 {
        return Err(CommError::invalid(
            "hidden",
            format!("hidden {h} is not a positive multiple of {FP8_GROUP_SIZE}"),
        ));
    }
    let rows = shape.num_rows();
    if x.len() != rows * h {
        return Err(CommError::invalid(
            "x",
            format!("{} bytes, expected [{rows}, {h}]", x.len()),
        ));
    }
    let (len, want) = match scales {
        RecvScales::F32(s) => (s.len(), rows * shape.num_scales()),
        RecvScales::Ue8m0(p) => (p.len(), rows * shape.num_packed_scales()),
    };
    if len != want {
        return Err(CommError::invalid(
            "scales",
            format!("{len} scale elements, expected {want}"),
        ));
    }
    let mut out = Vec::with_capacity(rows * h);
    for j in 0..shape.num_local_experts {
        for row in 0..shape.rows_per_expert() {
            let at = shape.row_index(j, row) * h;
            for (g, group) in x[at..at + h].chunks_exact(FP8_GROUP_SIZE).enumerate() {
                let s = match scales {
                    RecvScales::F32(s) => s[shape.scale_index(j, row, g)],
                    RecvScales::Ue8m0(p) => ue8m0_to_f32(shape.ue8m0_byte_at(p, j, row, g)),
                };
                out.extend(group.iter().map(|&q| e4m3_bits_to_f32(q) * s));
            }
        }
    }
    Ok(out)
}

/// e4m3fn bits of `x`: round to nearest, ties to even, saturating (CUDA's
/// `__nv_cvt_float2_to_fp8x2(.., __NV_SATFINITE, __NV_E4M3)`).
///
/// e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities;
/// `0x7F` / `0xFF` are NaN, so the largest finite value is `0x7E` = 448;
/// exponent 0 holds the subnormals `m * 2^-9` (smallest `2^-9`). Magnitudes
/// `>= 448`, infinities included, give `±448`; every NaN gives
/// [`E4M3_NAN`]; the sign of zero is kept (`-0.0` -> `0x80`).
pub fn f32_to_e4m3_bits(x: f32) -> u8 {
    if x.is_nan() {
        return E4M3_NAN;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a >= E4M3_MAX {
        return sign | 0x7E;
    }
    // a < 448 = 1.75 * 2^8: its binade exponent is at most 8. f32 subnormals
    // read as exponent -127, i.e. far inside the e4m3 subnormal range.
    let exp = ((a.to_bits() >> 23) & 0xFF) as i32 - 127;
    // The spacing of e4m3 values around a is 2^quantum: 2^-9 below 2^-6 (the
    // subnormals), else 2^(exp - 3) (3 mantissa bits).
    let quantum = exp.max(-6) - 3;
    // Scaling by a power of two is exact here (the result is below 16, and an
    // f32 subnormal only gains bits), so the only rounding is the one below.
    let n = (a * pow2(-quantum)).round_ties_even() as u8;
    let code = if exp < -6 {
        // Subnormal: n in 0..=8, and 8 is the smallest normal, code 0x08.
        n
    } else {
        // n in 8..=16; 16 carries into the next exponent. a < 448 keeps the
        // result at or below 0x7E.
        (((exp + 7) as u8) << 3) + (n - 8)
    };
    sign | code
}

/// The value of e4m3fn bits `b` (exact); `0x7F` and `0xFF` are NaN.
pub fn e4m3_bits_to_f32(b: u8) -> f32 {
    let exp = (b >> 3) & 0xF;
    let mantissa = b & 0x7;
    if exp == 0xF && mantissa == 0x7 {
        return f32::NAN;
    }
    let magnitude = if exp == 0 {
        f32::from(mantissa) * pow2(-9)
    } else {
        f32::from(8 + mantissa) * pow2(i32::from(exp) - 10)
    };
    if b & 0x80 != 0 {
        -magnitude
    } else {
        magnitude
    }
}

/// The ue8m0 byte of a scale: bits 23..=30 of its f32 (for the positive
/// power-of-two scales of `round_scale`, its biased exponent: `2^p` ->
/// `p + 127`). DeepEP's `extract_required_scale_format<true>`.
pub fn ue8m0_byte(scale: f32) -> u8 {
    (scale.to_bits() >> 23) as u8
}

/// The value of a ue8m0 byte: `2^(byte - 127)`; `0` is `2^-127` (an f32
/// subnormal) and `0xFF` is NaN (OCP MX). The inverse of [`ue8m0_byte`] on
/// powers of two.
pub fn ue8m0_to_f32(byte: u8) -> f32 {
    match byte {
        0 => f32::from_bits(0x0040_0000),
        0xFF => f32::NAN,
        b => f32::from_bits(u32::from(b) << 23),
    }
}

// ---- internals ------------------------------------------------------------------------

/// `T_r` of rank `rank` after checking its `topk_idx`.
fn check_topk_idx(rank: usize, topk_idx: &[i64], args: &LowLatencyArgs) -> Result<usize> {
    let max = args.num_max_dispatch_tokens_per_rank;
    check_topk_rows(
        topk_idx,
        args.num_topk,
        args.num_experts,
        &format!("rank {rank}: "),
        max,
        |n| {
            CommError::invalid(
                "num_max_dispatch_tokens_per_rank",
                format!(
                    "rank {rank} has {n} tokens, more than num_max_dispatch_tokens_per_rank = {max}"
                ),
            )
        },
    )
}

/// True if `v` is exactly a bf16 value (its low 16 bits are zero).
fn is_bf16(v: f32) -> bool {
    v.to_bits() & 0xFFFF == 0
}

/// Every value of `[N, hidden]` `x` is bf16 and, with `finite`, finite.
fn check_bf16(
    name: &'static str,
    rank: usize,
    x: &[f32],
    hidden: usize,
    finite: bool,
) -> Result<()> {
    if let Some(pos) = x
        .iter()
        .position(|&v| !is_bf16(v) || (finite && !v.is_finite()))
    {
        let why = if is_bf16(x[pos]) {
            "is not finite (the fp8 cast needs finite values)"
        } else {
            "is not exactly a bf16 value"
        };
        return Err(CommError::invalid(
            name,
            format!(
                "rank {rank}: token {} channel {}: {:e} ({:#010x}) {why}",
                pos / hidden,
                pos % hidden,
                x[pos],
                x[pos].to_bits()
            ),
        ));
    }
    Ok(())
}

/// Row `row_index` (in `[E_local * RT]`) of rank `rank`'s combine input is bf16.
fn check_bf16_row(rank: usize, row_index: usize, y: &[f32]) -> Result<()> {
    if let Some(c) = y.iter().position(|&v| !is_bf16(v)) {
        return Err(CommError::invalid(
            "x",
            format!(
                "rank {rank}: row {row_index} channel {c}: {:e} ({:#010x}) is not exactly a \
                 bf16 value (round with round_to_bf16)",
                y[c],
                y[c].to_bits()
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::normal::{bf16_bits_to_f32, f32_to_bf16_bits};
    use crate::test_support::{assert_invalid, bits};
    use rand::rngs::StdRng;
    use rand::seq::SliceRandom;
    use rand::Rng;

    // ---- helpers ------------------------------------------------------------

    /// Seeds the random tests (base 0x5EED_0011; `MOELINK_REFERENCE_SEED` overrides it).
    fn with_seed(what: &str, offset: u64, f: impl FnOnce(&mut StdRng)) {
        crate::test_support::with_seed(what, 0x5EED_0011, offset, f)
    }

    fn pow2f(p: i32) -> f32 {
        2f32.powi(p)
    }

    /// A random bf16 value in `(-scale, scale)`.
    fn random_bf16(rng: &mut StdRng, scale: f32) -> f32 {
        round_to_bf16(rng.random_range(-1.0f32..1.0) * scale)
    }

    /// The f32 next to a positive finite `x`, up or down.
    fn next_up(x: f32) -> f32 {
        f32::from_bits(x.to_bits() + 1)
    }

    fn next_down(x: f32) -> f32 {
        f32::from_bits(x.to_bits() - 1)
    }

    // ---- e4m3 ------------------------------------------------------------------

    /// e4m3fn decoded from the format's definition, in f64 (NaN for 0x7F/0xFF).
    fn spec_e4m3(c: u8) -> f64 {
        let sign = if c & 0x80 != 0 { -1.0 } else { 1.0 };
        let e = i32::from((c >> 3) & 0xF);
        let m = f64::from(c & 7);
        if e == 15 && m == 7.0 {
            f64::NAN
        } else if e == 0 {
            sign * m / 8.0 * 2f64.powi(-6)
        } else {
            sign * (1.0 + m / 8.0) * 2f64.powi(e - 7)
        }
    }

    /// Independent encoder: the nearest of all finite codes (ties to the even
    /// code), saturating.
    fn nearest_e4m3(x: f32) -> u8 {
        if x.is_nan() {
            return 0x7F;
        }
        let sign = if x.is_sign_negative() { 0x80 } else { 0 };
        let a = f64::from(x).abs();
        let (mut best, mut best_d) = (0u8, f64::INFINITY);
        for c in 0u8..=0x7E {
            let d = (spec_e4m3(c) - a).abs();
            if d < best_d || (d == best_d && c & 1 == 0) {
                (best, best_d) = (c, d);
            }
        }
        sign | best
    }

    #[test]
    fn e4m3_decodes_every_code() {
        let mut nan = 0;
        for c in 0..=255u8 {
            let (got, want) = (e4m3_bits_to_f32(c), spec_e4m3(c));
            if want.is_nan() {
                assert!(got.is_nan(), "code {c:#04x}");
                nan += 1;
            } else {
                assert_eq!(f64::from(got), want, "code {c:#04x}");
                assert_eq!(got.is_sign_negative(), c & 0x80 != 0, "code {c:#04x}");
            }
        }
        assert_eq!(nan, 2);
        // Positive codes increase strictly; the extremes.
        for c in 0..0x7Eu8 {
            assert!(e4m3_bits_to_f32(c) < e4m3_bits_to_f32(c + 1));
        }
        assert_eq!(e4m3_bits_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_bits_to_f32(0xFE), -448.0);
        assert_eq!(e4m3_bits_to_f32(0x01), 0.001953125); // 2^-9
        assert_eq!(e4m3_bits_to_f32(0x07), 7.0 * 0.001953125);
        assert_eq!(e4m3_bits_to_f32(0x08), 0.015625); // 2^-6, smallest normal
        assert_eq!(e4m3_bits_to_f32(0x38), 1.0);
        assert_eq!(e4m3_bits_to_f32(0x80).to_bits(), (-0.0f32).to_bits());
    }

    #[test]
    fn e4m3_encoding_round_trips_every_finite_code() {
        for c in (0..=255u8).filter(|&c| c & 0x7F != 0x7F) {
            assert_eq!(f32_to_e4m3_bits(e4m3_bits_to_f32(c)), c, "code {c:#04x}");
        }
    }

    #[test]
    fn e4m3_encoding_known_values() {
        let cases: &[(f32, u8)] = &[
            (0.0, 0x00),
            (-0.0, 0x80),
            (1.0, 0x38),
            (-1.0, 0xB8),
            (448.0, 0x7E),
            (-448.0, 0xFE),
            (0.001953125, 0x01),                 // 2^-9, smallest subnormal
            (0.0009765625, 0x00),                // 2^-10: tie between 0 and 2^-9, to even
            (f32::from_bits(0x3A80_0001), 0x01), // just above that tie
            (-0.0009765625, 0x80),               // negative tie: to -0
            (0.0029296875, 0x02),                // 1.5 * 2^-9: tie between 0x01 and 0x02
            (0.015625, 0x08),                    // 2^-6
            (0.0146484375, 0x08),                // 7.5 * 2^-9: tie between 0x07 and 0x08, to even
            (1.0625, 0x38),                      // tie between 1.0 and 1.125, to even
            (1.1875, 0x3A),                      // tie between 1.125 and 1.25, to even
            (f32::from_bits(0x3F88_0001), 0x39), // just above the tie
            (119.0, 0x6F),                       // nearest is 120
            (116.0, 0x6E),                       // tie between 112 and 120, to even
            (232.0, 0x76),                       // tie between 224 and 240, to even (224)
            (432.0, 0x7E),                       // tie between 416 and 448, to even (448)
            (440.0, 0x7E),
            (449.0, 0x7E), // saturates
            (464.0, 0x7E), // would round to 480 without saturation
            (1e9, 0x7E),
            (f32::MAX, 0x7E),
            (f32::INFINITY, 0x7E),
            (f32::NEG_INFINITY, 0xFE),
            (f32::NAN, 0x7F),
            (-f32::NAN, 0x7F),
            (f32::from_bits(1), 0x00), // f32 subnormal
            (f32::from_bits(0x8000_0001), 0x80),
        ];
        for &(x, want) in cases {
            assert_eq!(f32_to_e4m3_bits(x), want, "x = {x:e}");
            assert_eq!(nearest_e4m3(x), want, "independent encoder, x = {x:e}");
        }
    }

    #[test]
    fn e4m3_encoding_matches_nearest_search() {
        let check = |x: f32| {
            assert_eq!(
                f32_to_e4m3_bits(x),
                nearest_e4m3(x),
                "x = {x:e} ({:#010x})",
                x.to_bits()
            );
        };
        // Every rounding boundary (midpoints of adjacent codes, and 464 above
        // the largest), the f32s around it, both signs.
        let mut mids: Vec<f32> = (0..0x7Eu8)
            .map(|c| ((spec_e4m3(c) + spec_e4m3(c + 1)) / 2.0) as f32)
            .collect();
        mids.push(464.0);
        for &m in &mids {
            for x in [m, next_up(m), next_down(m), next_up(next_up(m))] {
                check(x);
                check(-x);
            }
        }
        with_seed("e4m3 random", 100, |rng| {
            for _ in 0..100_000 {
                // Exponents 2^-27 .. 2^12 cover every e4m3 binade and beyond.
                let exp = rng.random_range(100u32..140);
                check(f32::from_bits(
                    (rng.random::<u32>() & 0x807F_FFFF) | (exp << 23),
                ));
            }
            for _ in 0..20_000 {
                check(f32::from_bits(rng.random()));
            }
        });
    }

    // ---- fp8 cast -----------------------------------------------------------------

    /// Independent cast: amax and scales in f64 (f32 results of f32 operands
    /// computed in f64 and rounded once are the f32 results), the exponent by
    /// search, the bytes by [`nearest_e4m3`].
    fn slow_quantize(x: &[f32], round_scale: bool) -> (Vec<u8>, Vec<f32>) {
        let inv448 = (1.0f64 / 448.0) as f32;
        let (mut q, mut scales) = (Vec::new(), Vec::new());
        for group in x.chunks(128) {
            let amax = group
                .iter()
                .fold(f64::from(1e-4f32), |m, &v| m.max(f64::from(v).abs()));
            let v = (amax * f64::from(inv448)) as f32;
            let (scale, scale_inv) = if round_scale {
                let mut p = -40;
                while 2f64.powi(p) < f64::from(v) {
                    p += 1;
                }
                (2f64.powi(-p) as f32, 2f64.powi(p) as f32)
            } else {
                ((448.0 / amax) as f32, v)
            };
            for &x in group {
                q.push(nearest_e4m3((f64::from(x) * f64::from(scale)) as f32));
            }
            scales.push(scale_inv);
        }
        (q, scales)
    }

    /// Groups of 128 bf16 values with the interesting amax cases.
    fn interesting_groups(rng: &mut StdRng) -> Vec<f32> {
        let mut x = Vec::new();
        let mut group = |f: &mut dyn FnMut(usize) -> f32| x.extend((0..128).map(&mut *f));
        group(&mut |_| 0.0); // all zeros: amax clamps to 1e-4
        group(&mut |i| if i % 2 == 0 { 0.0 } else { -0.0 });
        group(&mut |i| if i == 17 { 1000.0 } else { 0.0 }); // a single large value
        group(&mut |i| {
            if i == 0 {
                round_to_bf16(-3.0e4)
            } else {
                random_bf16(rng, 1e-3)
            }
        });
        group(&mut |_| random_bf16(rng, 1e-6)); // below the clamp
        group(&mut |_| round_to_bf16(5e-5)); // all equal, below the clamp
        group(&mut |_| round_to_bf16(-1.5)); // all equal
        group(&mut |i| round_to_bf16(3.0e38) * if i == 3 { 1.0 } else { 0.5 }); // near bf16 max
        group(&mut |i| {
            if i == 0 {
                448.0
            } else {
                random_bf16(rng, 448.0)
            }
        });
        for _ in 0..40 {
            let scale = 10f32.powi(rng.random_range(-6..=6));
            group(&mut |_| random_bf16(rng, scale));
        }
        x
    }

    #[test]
    fn fp8_scale_known_values() {
        // 448 * fl(1/448) is exactly 1, and 448 / 448 is 1.
        let s = fp8_scale(448.0, false);
        assert_eq!((s.scale, s.scale_inv), (1.0, 1.0));
        let s = fp8_scale(448.0, true);
        assert_eq!((s.scale, s.scale_inv), (1.0, 1.0));
        let s = fp8_scale(448.0 * 8.0, false);
        assert_eq!((s.scale, s.scale_inv), (0.125, 8.0));
        // The clamp value: scale_inv = fl(1e-4 * fl(1/448)), rounded up to
        // 2^-22 (1e-4 / 448 = 2.23e-7, between 2^-23 and 2^-22).
        let s = fp8_scale(FP8_AMAX_MIN, false);
        assert_eq!(s.scale_inv, FP8_AMAX_MIN * E4M3_MAX_INV);
        assert_eq!(s.scale, 448.0 / FP8_AMAX_MIN);
        let s = fp8_scale(FP8_AMAX_MIN, true);
        assert_eq!((s.scale, s.scale_inv), (pow2f(22), pow2f(-22)));
        assert_eq!(ue8m0_byte(s.scale_inv), 127 - 22);
        // Just above a power of two rounds up; exactly one does not.
        let s = fp8_scale(448.0 * 2.0, true);
        assert_eq!(s.scale_inv, 2.0);
        let s = fp8_scale(448.0 * 2.0 * (1.0 + pow2f(-7)), true);
        assert_eq!((s.scale, s.scale_inv), (0.25, 4.0));
        // E4M3_MAX_INV is 1/448 correctly rounded.
        assert_eq!(E4M3_MAX_INV, (1.0f64 / 448.0) as f32);
    }

    #[test]
    fn fp8_cast_matches_independent_implementation() {
        with_seed("fp8 cast", 200, |rng| {
            let x = interesting_groups(rng);
            for round_scale in [false, true] {
                let got = quantize_fp8(&x, round_scale).unwrap();
                let (q, scales) = slow_quantize(&x, round_scale);
                assert_eq!(
                    bits(&got.scales),
                    bits(&scales),
                    "round_scale={round_scale}"
                );
                for (i, (&a, &b)) in got.x.iter().zip(&q).enumerate() {
                    assert_eq!(
                        a,
                        b,
                        "round_scale={round_scale}: element {i} = {:e}, scale_inv {:e}",
                        x[i],
                        scales[i / 128]
                    );
                }
                // Properties of each group.
                for (g, group) in x.chunks(128).enumerate() {
                    let qs = &got.x[g * 128..(g + 1) * 128];
                    let amax = group.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    if amax == 0.0 {
                        assert!(qs.iter().all(|&b| b & 0x7F == 0), "group {g}: zeros");
                        assert_eq!(
                            got.scales[g],
                            fp8_scale(FP8_AMAX_MIN, round_scale).scale_inv
                        );
                        continue;
                    }
                    let at = group.iter().position(|v| v.abs() == amax).unwrap();
                    let top = e4m3_bits_to_f32(qs[at]).abs();
                    if amax >= FP8_AMAX_MIN && !round_scale {
                        assert_eq!(top, 448.0, "group {g}: the amax element");
                    } else if amax >= FP8_AMAX_MIN {
                        // (224, 448], or 224 when fl(amax * E4M3_MAX_INV)
                        // rounds up onto the next power of two.
                        assert!((224.0..=448.0).contains(&top), "group {g}: {top}");
                    } else {
                        // Below the clamp: the clamp's scale.
                        let clamp = fp8_scale(FP8_AMAX_MIN, round_scale).scale_inv;
                        assert_eq!(got.scales[g], clamp, "group {g}: below the clamp");
                    }
                    if round_scale {
                        // A power of two, and its ue8m0 byte is its exponent.
                        let s = got.scales[g];
                        assert_eq!(s.to_bits() & 0x807F_FFFF, 0, "group {g}: {s:e}");
                        assert_eq!(2f32.powi(i32::from(ue8m0_byte(s)) - 127), s);
                        assert_eq!(ue8m0_to_f32(ue8m0_byte(s)), s);
                        let raw = amax.max(FP8_AMAX_MIN) * E4M3_MAX_INV;
                        assert!(s >= raw && s < 2.0 * raw, "group {g}: {s:e} vs {raw:e}");
                    }
                }
                // Dequantized values stay within half an e4m3 step of x.
                let back = dequantize_fp8_rows(&got.x, &got.scales).unwrap();
                for (i, (&v, &orig)) in back.iter().zip(&x).enumerate() {
                    let s = got.scales[i / 128];
                    let tol =
                        f64::from(s) * (f64::from(orig.abs() / s) / 16.0).max(pow2f(-10).into());
                    assert!(
                        (f64::from(v) - f64::from(orig)).abs() <= tol * 1.0001,
                        "element {i}: {orig:e} -> {v:e}"
                    );
                }
            }
        });
    }

    #[test]
    fn fp8_multiplier_is_448_over_amax() {
        // The module docs say x * fl(448 / amax) and x / fl(amax / 448) can
        // quantize differently; find such cases and check which one is used.
        let inv = E4M3_MAX_INV;
        let mut found = 0;
        for m in 0..128u32 {
            let amax = bf16_bits_to_f32(0x4380 + m as u16); // 256 + 2m, in [256, 512)
            let scale = 448.0 / amax;
            let scale_inv = amax * inv;
            for c in 0x30..0x7Eu8 {
                let mid = ((spec_e4m3(c) + spec_e4m3(c + 1)) / 2.0) as f32;
                let target = round_to_bf16(mid * scale_inv);
                for x in [target, next_up_bf16(target), next_down_bf16(target)] {
                    if x.abs() > amax {
                        continue;
                    }
                    let a = f32_to_e4m3_bits(x * scale);
                    let b = f32_to_e4m3_bits(x / scale_inv);
                    if a != b {
                        found += 1;
                        let mut group = vec![0.0f32; 128];
                        group[0] = amax;
                        group[1] = x;
                        let q = quantize_fp8(&group, false).unwrap();
                        assert_eq!(q.x[1], a, "amax {amax}, x {x}");
                    }
                }
            }
        }
        assert!(found > 0, "no case where the two formulas differ");
    }

    fn next_up_bf16(x: f32) -> f32 {
        bf16_bits_to_f32(f32_to_bf16_bits(x) + 1)
    }

    fn next_down_bf16(x: f32) -> f32 {
        bf16_bits_to_f32(f32_to_bf16_bits(x) - 1)
    }

    #[test]
    fn ue8m0_bytes() {
        assert_eq!(ue8m0_byte(1.0), 127);
        assert_eq!(ue8m0_byte(2.0), 128);
        assert_eq!(ue8m0_byte(pow2f(-21)), 106);
        assert_eq!(ue8m0_byte(pow2f(120)), 247);
        for b in 1..=254u8 {
            let v = ue8m0_to_f32(b);
            assert_eq!(v, 2f32.powi(i32::from(b) - 127));
            assert_eq!(ue8m0_byte(v), b);
        }
        assert_eq!(ue8m0_to_f32(0), 2f32.powi(-127));
        assert!(ue8m0_to_f32(255).is_nan());
    }

    #[test]
    fn layout_range_packing() {
        assert_eq!(pack_layout_range(2, 1), (2i64 << 32) | 1);
        assert_eq!(pack_layout_range(0, 5), 5);
        assert_eq!(pack_layout_range(7, 0), 7i64 << 32);
        for (b, c) in [(0, 0), (3, 4), (i32::MAX, i32::MAX), (1, -1), (-1, 2)] {
            assert_eq!(unpack_layout_range(pack_layout_range(b, c)), (b, c));
        }
        // DeepEP's pack2<int, int64_t>(count, begin): count is the first
        // (low, little-endian) int.
        let packed = pack_layout_range(9, 3).to_le_bytes();
        assert_eq!(i32::from_le_bytes(packed[..4].try_into().unwrap()), 3);
        assert_eq!(i32::from_le_bytes(packed[4..].try_into().unwrap()), 9);
    }

    #[test]
    fn recv_shape_indices() {
        let s = RecvShape {
            num_ranks: 2,
            num_local_experts: 3,
            max_tokens: 4,
            hidden: 640,
        };
        assert_eq!((s.rows_per_expert(), s.num_rows()), (8, 24));
        assert_eq!((s.num_scales(), s.num_packed_scales()), (5, 2));
        assert_eq!(s.row_index(2, 5), 21);
        // (j, row, g) at j * RT * G + g * RT + row.
        assert_eq!(s.scale_index(0, 0, 1), 8);
        assert_eq!(s.scale_index(1, 3, 2), 40 + 16 + 3);
        assert_eq!(s.packed_scale_index(2, 7, 1), 32 + 8 + 7);
        let mut packed = vec![0i32; s.num_rows() * 2];
        packed[s.packed_scale_index(1, 2, 0)] = 0x8281_807Fu32 as i32;
        packed[s.packed_scale_index(1, 2, 1)] = 0x83;
        let bytes: Vec<u8> = (0..5).map(|g| s.ue8m0_byte_at(&packed, 1, 2, g)).collect();
        assert_eq!(bytes, [0x7F, 0x80, 0x81, 0x82, 0x83]);
    }

    // ---- the hand-computed case ------------------------------------------------
    //
    // 2 ranks, 4 experts (rank 0: experts 0 and 1, rank 1: experts 2 and 3),
    // K = 2, T = 4 (so RT = 8 rows per local expert).
    //   rank 0: t0 [0, 3]   t1 [2, -1]   t2 [1, 0]
    //   rank 1: t0 [3, 2]   t1 [-1, 0]
    // Rank 0 receives: expert 0 (j 0): r0 t0, r0 t2 | r1 t1; expert 1: r0 t2 | -.
    // Rank 1 receives: expert 2 (j 0): r0 t1 | r1 t0;        expert 3: r0 t0 | r1 t0.

    const HAND_T: usize = 4;
    const HAND_TOPK: [&[i64]; 2] = [&[0, 3, 2, -1, 1, 0], &[3, 2, -1, 0]];
    const HAND_WEIGHTS: [&[f32]; 2] = [&[0.5, 0.25, 2.0, 8.0, 1.0, 0.125], &[0.25, 4.0, 3.0, 0.5]];

    /// bf16 token `t` of rank `r`: `16 r + t + 1`, negated and halved at odd
    /// channels.
    fn hand_token(r: usize, t: usize, hidden: usize) -> Vec<f32> {
        let v = (16 * r + t + 1) as f32;
        (0..hidden)
            .map(|h| if h % 2 == 0 { v } else { -0.5 * v })
            .collect()
    }

    fn hand_x(hidden: usize, token: impl Fn(usize, usize) -> Vec<f32>) -> [Vec<f32>; 2] {
        [0, 1].map(|r| {
            (0..HAND_TOPK[r].len() / 2)
                .flat_map(|t| {
                    let row = token(r, t);
                    assert_eq!(row.len(), hidden);
                    row
                })
                .collect()
        })
    }

    fn hand_dispatch(args: &LowLatencyArgs, x: &[Vec<f32>; 2]) -> Result<LlDispatched> {
        let inputs = [0, 1].map(|r| LlRankInput {
            x: &x[r],
            topk_idx: HAND_TOPK[r],
        });
        low_latency_dispatch(&inputs, args)
    }

    /// `src_info` of the hand case: rank 0, then rank 1.
    const HAND_SRC_INFO: [[i32; 16]; 2] = [
        [0, 2, 1, -1, -1, -1, -1, -1, 2, -1, -1, -1, -1, -1, -1, -1],
        [1, 0, -1, -1, -1, -1, -1, -1, 0, 0, -1, -1, -1, -1, -1, -1],
    ];

    /// (rank, token) of each valid row of the hand case, per destination rank
    /// and local expert.
    const HAND_ROWS: [[&[(usize, usize)]; 2]; 2] = [
        [&[(0, 0), (0, 2), (1, 1)], &[(0, 2)]],
        [&[(0, 1), (1, 0)], &[(0, 0), (1, 0)]],
    ];

    /// The bf16 dispatch of the hand case's `hand_token` rows of `hidden`
    /// channels, and its arguments.
    fn hand_bf16(hidden: usize) -> (LowLatencyArgs, LlDispatched) {
        let x = hand_x(hidden, |r, t| hand_token(r, t, hidden));
        let args = LowLatencyArgs::new(HAND_T, hidden, 4, 2).bf16();
        (args, hand_dispatch(&args, &x).unwrap())
    }

    fn check_hand_routing(d: &LlDispatched) {
        assert_eq!(d.num_tokens, [3, 2]);
        assert_eq!(
            d.shape,
            RecvShape {
                num_ranks: 2,
                num_local_experts: 2,
                max_tokens: HAND_T,
                hidden: d.args.hidden
            }
        );
        let p = pack_layout_range;
        let o = &d.ranks[0];
        assert_eq!(o.recv_count, [3, 1]);
        assert_eq!(o.src_info, HAND_SRC_INFO[0]);
        assert_eq!(o.layout_range, [p(0, 2), p(2, 1), p(0, 1), p(1, 0)]);
        assert_eq!(o.layout_range, [2, (2 << 32) | 1, 1, 1 << 32]);
        let o = &d.ranks[1];
        assert_eq!(o.recv_count, [2, 2]);
        assert_eq!(o.src_info, HAND_SRC_INFO[1]);
        assert_eq!(o.layout_range, [p(0, 1), p(1, 1), p(0, 1), p(1, 1)]);
    }

    #[test]
    fn hand_dispatch_bf16() {
        let h = 128;
        let (_, d) = hand_bf16(h);
        check_hand_routing(&d);
        for (dest, o) in d.ranks.iter().enumerate() {
            let recv = o.bf16_x();
            assert_eq!(recv.len(), 2 * 8 * h);
            for (j, rows) in HAND_ROWS[dest].iter().enumerate() {
                for row in 0..8 {
                    let at = d.shape.row_index(j, row) * h;
                    let want = match rows.get(row) {
                        Some(&(r, t)) => hand_token(r, t, h),
                        None => vec![0.0; h], // the reference's padding
                    };
                    assert_eq!(
                        recv[at..at + h],
                        want[..],
                        "rank {dest} expert {j} row {row}"
                    );
                }
            }
        }
    }

    /// The fp8 hand token: group `g` of token `(r, t)` is [`HAND_GROUP`] times
    /// `2^s`, `s = shift(r, t, g)`, so its amax is `448 * 2^s`, both scale
    /// modes give `scale_inv = 2^s` and the bytes are [`HAND_GROUP_Q`].
    fn hand_fp8_token(
        r: usize,
        t: usize,
        groups: usize,
        shift: fn(usize, usize, usize) -> i32,
    ) -> Vec<f32> {
        (0..groups)
            .flat_map(|g| {
                let s = pow2f(shift(r, t, g));
                (0..128).map(move |i| HAND_GROUP.get(i).map_or(0.0, |&v| v * s))
            })
            .collect()
    }

    const HAND_GROUP: [f32; 12] = [
        448.0,
        -224.0,
        119.0, // -> 120
        116.0, // tie -> 112
        0.0,
        -0.0,
        0.001953125,  // 2^-9
        0.0009765625, // tie -> 0
        0.0029296875, // tie -> 2^-8
        1.0,
        1.0625, // tie -> 1.0
        1.1875, // tie -> 1.25
    ];
    const HAND_GROUP_Q: [u8; 12] = [
        0x7E, 0xF6, 0x6F, 0x6E, 0x00, 0x80, 0x01, 0x00, 0x02, 0x38, 0x38, 0x3A,
    ];

    fn hand_group_bytes() -> Vec<u8> {
        (0..128)
            .map(|i| HAND_GROUP_Q.get(i).copied().unwrap_or(0))
            .collect()
    }

    #[test]
    fn one_rank_is_that_rank_of_the_whole_dispatch() {
        let h = 256;
        let shift = |r: usize, t: usize, g: usize| 2 * g as i32 - t as i32 - 3 * r as i32;
        let x = hand_x(h, |r, t| hand_fp8_token(r, t, 2, shift));
        let inputs = [0, 1].map(|r| LlRankInput {
            x: &x[r],
            topk_idx: HAND_TOPK[r],
        });
        for use_fp8 in [false, true] {
            let args = LowLatencyArgs {
                use_fp8,
                ..LowLatencyArgs::new(HAND_T, h, 4, 2)
            };
            let all = low_latency_dispatch(&inputs, &args).unwrap();
            for d in 0..2 {
                let one = low_latency_dispatch_rank(&inputs, &args, d).unwrap();
                assert_eq!(one, all.ranks[d], "rank {d}, fp8 {use_fp8}");
            }
            let e = low_latency_dispatch_rank(&inputs, &args, 2).unwrap_err();
            assert!(e.to_string().contains("rank"), "{e}");
        }
    }

    #[test]
    fn hand_dispatch_fp8() {
        // H = 256: two groups per token, so the column-major scales show.
        let h = 256;
        let shift = |r: usize, t: usize, g: usize| 2 * g as i32 - t as i32 - 3 * r as i32;
        let x = hand_x(h, |r, t| hand_fp8_token(r, t, 2, shift));
        for round_scale in [false, true] {
            let args = LowLatencyArgs {
                round_scale,
                ..LowLatencyArgs::new(HAND_T, h, 4, 2)
            };
            let d = hand_dispatch(&args, &x).unwrap();
            check_hand_routing(&d);
            let group = hand_group_bytes();
            for (dest, o) in d.ranks.iter().enumerate() {
                let (recv, scales) = o.fp8_f32();
                assert_eq!((recv.len(), scales.len()), (2 * 8 * h, 2 * 8 * 2));
                for j in 0..2 {
                    for (row, &(r, t)) in HAND_ROWS[dest][j].iter().enumerate() {
                        let at = d.shape.row_index(j, row) * h;
                        assert_eq!(recv[at..at + 128], group[..]);
                        assert_eq!(recv[at + 128..at + 256], group[..]);
                        for g in 0..2 {
                            assert_eq!(
                                scales[d.shape.scale_index(j, row, g)],
                                pow2f(shift(r, t, g))
                            );
                        }
                    }
                }
            }
            // The whole scale tensors, column-major: [j][g][row].
            let (_, s0) = d.ranks[0].fp8_f32();
            #[rustfmt::skip]
            let want0 = [
                // expert 0: rows r0t0, r0t2, r1t1; group 0 then group 1
                1.0, 0.25, 0.0625, 0.0, 0.0, 0.0, 0.0, 0.0,
                4.0, 1.0, 0.25, 0.0, 0.0, 0.0, 0.0, 0.0,
                // expert 1: row r0t2
                0.25, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
            ];
            assert_eq!(s0[..], want0[..]);
            // Dequantized: the group values, with 119 -> 120, 116 -> 112, ...
            let (q, scales) = d.ranks[1].fp8();
            let y = dequantize_fp8(q, scales, &d.shape).unwrap();
            // rank 1, expert 3, row 1 = r1 t0: group 1 has s = 2 - 0 - 3 = -1.
            let at = d.shape.row_index(1, 1) * h + 128;
            let want: Vec<f32> = [448.0, -224.0, 120.0, 112.0, 0.0, -0.0, 0.001953125, 0.0]
                .iter()
                .map(|v| v * 0.5)
                .collect();
            assert_eq!(bits(&y[at..at + 8]), bits(&want));
        }
    }

    #[test]
    fn hand_dispatch_ue8m0() {
        // H = 640: five groups, two words per row, the second one with three
        // unused bytes.
        let h = 640;
        let shift = |r: usize, t: usize, g: usize| g as i32 - t as i32 - r as i32;
        let x = hand_x(h, |r, t| hand_fp8_token(r, t, 5, shift));
        let args = LowLatencyArgs {
            round_scale: true,
            use_ue8m0: true,
            ..LowLatencyArgs::new(HAND_T, h, 4, 2)
        };
        let d = hand_dispatch(&args, &x).unwrap();
        check_hand_routing(&d);
        let o = &d.ranks[1];
        let (recv, packed) = o.fp8_ue8m0();
        assert_eq!(packed.len(), 2 * 8 * 2);
        let group = hand_group_bytes();
        for g in 0..5 {
            let at = d.shape.row_index(1, 0) * h + g * 128;
            assert_eq!(recv[at..at + 128], group[..]);
        }
        // Expert 3 (j 1): row 0 = r0 t0 (s = g), row 1 = r1 t0 (s = g - 1).
        // Word (j, row, w) at j * 16 + w * 8 + row; group 4w in the low byte.
        #[rustfmt::skip]
        let want = [
            // expert 2 (j 0): row 0 = r0 t1 (s = g - 1), row 1 = r1 t0 (s = g - 1)
            0x8180_7F7Eu32 as i32, 0x8180_7F7E_u32 as i32, 0, 0, 0, 0, 0, 0,
            0x82, 0x82, 0, 0, 0, 0, 0, 0,
            // expert 3 (j 1)
            0x8281_807Fu32 as i32, 0x8180_7F7Eu32 as i32, 0, 0, 0, 0, 0, 0,
            0x83, 0x82, 0, 0, 0, 0, 0, 0,
        ];
        assert_eq!(packed[..], want[..]);
        // Dequantizing reads the exponents back.
        let y = dequantize_fp8(recv, o.fp8().1, &d.shape).unwrap();
        let at = d.shape.row_index(1, 1) * h + 4 * 128; // r1 t0, group 4: s = 3
        assert_eq!(y[at], 448.0 * 8.0);
        assert_eq!(y[at + 2], 120.0 * 8.0);
        // The same dispatch with f32 scales holds the same bytes and the
        // powers of two the bytes encode.
        let f = hand_dispatch(
            &LowLatencyArgs {
                use_ue8m0: false,
                ..args
            },
            &x,
        )
        .unwrap();
        for (a, b) in f.ranks.iter().zip(&d.ranks) {
            let ((fx, fs), (ux, up)) = (a.fp8_f32(), b.fp8_ue8m0());
            assert_eq!(fx, ux);
            for j in 0..2 {
                for row in 0..b.recv_count[j] as usize {
                    for g in 0..5 {
                        assert_eq!(
                            fs[d.shape.scale_index(j, row, g)],
                            ue8m0_to_f32(d.shape.ue8m0_byte_at(up, j, row, g))
                        );
                    }
                }
            }
        }
    }

    impl LlRankOutput {
        /// Test shortcut: the values of a bf16 output.
        fn bf16_x(&self) -> &[f32] {
            match &self.recv_x {
                RecvX::Bf16(x) => x,
                RecvX::Fp8 { .. } => panic!("not bf16"),
            }
        }

        /// Test shortcut: the bytes and scales of an fp8 output.
        fn fp8(&self) -> (&[u8], &RecvScales) {
            match &self.recv_x {
                RecvX::Fp8 { x, scales } => (x, scales),
                RecvX::Bf16(_) => panic!("not fp8"),
            }
        }

        /// Test shortcut: [`Self::fp8`] with f32 scales.
        fn fp8_f32(&self) -> (&[u8], &[f32]) {
            match self.fp8() {
                (x, RecvScales::F32(s)) => (x, s),
                _ => panic!("not f32 scales"),
            }
        }

        /// Test shortcut: [`Self::fp8`] with packed ue8m0 scales.
        fn fp8_ue8m0(&self) -> (&[u8], &[i32]) {
            match self.fp8() {
                (x, RecvScales::Ue8m0(p)) => (x, p),
                _ => panic!("not ue8m0 scales"),
            }
        }
    }

    #[test]
    fn hand_combine() {
        let h = 128;
        let (args, d) = hand_bf16(h);
        // Expert e multiplies its input by e + 1; padding rows are NaN.
        let ys: Vec<Vec<f32>> = d
            .ranks
            .iter()
            .enumerate()
            .map(|(dest, o)| {
                let recv = o.bf16_x();
                let mut y = vec![f32::NAN; recv.len()];
                for j in 0..2 {
                    for row in 0..o.recv_count[j] as usize {
                        let at = d.shape.row_index(j, row) * h;
                        for c in at..at + h {
                            y[c] = recv[c] * (2 * dest + j + 1) as f32;
                        }
                    }
                }
                y
            })
            .collect();
        let inputs = combine_inputs(&d.ranks, &ys, &HAND_TOPK, &HAND_WEIGHTS);
        let out = low_latency_combine(&inputs, &args).unwrap();
        // sum_k w_k (e_k + 1), -1 columns (and their weights) skipped:
        //   r0 t0: 0.5 * 1 + 0.25 * 4 = 1.5     r0 t1: 2 * 3 = 6
        //   r0 t2: 1 * 2 + 0.125 * 1 = 2.125   r1 t0: 0.25 * 4 + 4 * 3 = 13
        //   r1 t1: 0.5 * 1 = 0.5
        let factors = [vec![1.5f32, 6.0, 2.125], vec![13.0, 0.5]];
        for r in 0..2 {
            let want: Vec<f32> = factors[r]
                .iter()
                .enumerate()
                .flat_map(|(t, &f)| hand_token(r, t, h).into_iter().map(move |v| v * f))
                .collect();
            assert_eq!(bits(&out[r].combined_x), bits(&want), "rank {r}");
            assert_eq!(bits(&out[r].combined_x_f32), bits(&want), "rank {r}");
            let abs: Vec<f32> = want.iter().map(|v| v.abs()).collect();
            assert_eq!(out[r].abs_sum, abs);
            check_combined(&out[r], &want, 2).unwrap();
        }
    }

    #[test]
    fn combine_accumulates_with_fma_in_column_order() {
        // One rank, two experts, K = 3, one token; values chosen so that both
        // the column order and the fused rounding show.
        let h = 128;
        let args = LowLatencyArgs::new(1, h, 2, 3).bf16();
        let x = vec![1.0f32; h];
        let topk = [0i64, 1, -1];
        let d = low_latency_dispatch(
            &[LlRankInput {
                x: &x,
                topk_idx: &topk,
            }],
            &args,
        )
        .unwrap();
        // Expert 0 (row (0, 0)) returns -1, expert 1 (row (1, 0)) 1 + 2^-7.
        let mut y = vec![0.0f32; 2 * h];
        y[..h].fill(-1.0);
        y[h..].fill(1.0 + pow2f(-7));
        let w = [1.0, 1.0 + pow2f(-23), 5.0];
        let out = low_latency_combine(
            &[LlCombineInput {
                x: &y,
                topk_idx: &topk,
                topk_weights: &w,
                handle: d.ranks[0].handle(),
            }],
            &args,
        )
        .unwrap();
        // acc = -1, then fma(1 + 2^-7, 1 + 2^-23, -1) = 2^-7 + 2^-23 + 2^-30
        // exactly; the -1 column's weight 5 is ignored. A separate multiply
        // loses the 2^-30 (the product needs 31 bits), and so does the
        // reverse order (the product is rounded before -1 is added).
        let want = pow2f(-7) + pow2f(-23) + pow2f(-30);
        assert_eq!((1.0 + pow2f(-7)).mul_add(1.0 + pow2f(-23), -1.0), want);
        let unfused = (1.0 + pow2f(-7)) * (1.0 + pow2f(-23)) - 1.0;
        assert_ne!(unfused, want);
        assert!(out[0].combined_x_f32.iter().all(|&v| v == want));
        assert!(out[0].combined_x.iter().all(|&v| v == round_to_bf16(want)));
        // Either way the other kernel is within check_combined's bound.
        check_combined(&out[0], &vec![round_to_bf16(unfused); h], 3).unwrap();
    }

    #[test]
    fn duplicate_experts_send_one_message_per_occurrence() {
        // 2 ranks, 4 experts, K = 3, T = 4. Rank 0 lists expert 1 twice in
        // both of its tokens, rank 1 twice in its one token.
        let h = 128;
        let topk: [&[i64]; 2] = [&[1, 1, 2, 1, -1, 1], &[1, 0, 1]];
        let x = [
            [hand_token(0, 0, h), hand_token(0, 1, h)].concat(),
            hand_token(1, 0, h),
        ];
        let inputs = [0, 1].map(|r| LlRankInput {
            x: &x[r],
            topk_idx: topk[r],
        });
        let args = LowLatencyArgs::new(4, h, 4, 3).bf16();
        let d = low_latency_dispatch(&inputs, &args).unwrap();
        let o = &d.ranks[0];
        // Expert 1: r0 t0, t0, t1, t1 | r1 t0, t0. Expert 0: r1 t0.
        assert_eq!(o.recv_count, [1, 6]);
        assert_eq!(
            o.layout_range,
            [
                pack_layout_range(0, 0),
                pack_layout_range(0, 1),
                pack_layout_range(0, 4),
                pack_layout_range(4, 2)
            ]
        );
        assert_eq!(o.src_info[8..14], [0, 0, 1, 1, 0, 0]);
        assert_eq!(d.ranks[1].recv_count, [1, 0]);
        // Combine pairs the i-th occurrence with the i-th row: give every row
        // a different output (row index + 1) to see the pairing.
        let ys: Vec<Vec<f32>> = d
            .ranks
            .iter()
            .map(|o| {
                let mut y = vec![f32::NAN; d.shape.num_rows() * h];
                for j in 0..2 {
                    for row in 0..o.recv_count[j] as usize {
                        let at = d.shape.row_index(j, row);
                        y[at * h..(at + 1) * h].fill((at + 1) as f32);
                    }
                }
                y
            })
            .collect();
        let w: [&[f32]; 2] = [&[1.0, 2.0, 4.0, 8.0, 16.0, 32.0], &[1.0, 2.0, 4.0]];
        let cinputs = combine_inputs(&d.ranks, &ys, &topk, &w);
        let out = low_latency_combine(&cinputs, &args).unwrap();
        // Rank 0's rows of expert 1 are at 8..12 (values 9..=12); expert 2 is
        // rank 1's row 0 (value 1).
        let r0 = [1.0 * 9.0 + 2.0 * 10.0 + 4.0 * 1.0, 8.0 * 11.0 + 32.0 * 12.0];
        // Rank 1: t0 -> expert 1 rows 12, 13 (values 13, 14), expert 0 row 0.
        let r1 = [1.0 * 13.0 + 2.0 * 1.0 + 4.0 * 14.0];
        for (r, want) in [&r0[..], &r1[..]].iter().enumerate() {
            for (t, &v) in want.iter().enumerate() {
                assert!(out[r].combined_x[t * h..(t + 1) * h]
                    .iter()
                    .all(|&c| c == v));
            }
        }
        // T = 3 cannot hold rank 0's four messages to expert 1.
        assert_invalid(
            low_latency_dispatch(&inputs, &LowLatencyArgs::new(3, h, 4, 3).bf16()),
            "topk_idx",
        );
    }

    #[test]
    fn all_ranks_empty() {
        for num_ranks in [1, 2, 8] {
            let inputs = vec![
                LlRankInput {
                    x: &[],
                    topk_idx: &[]
                };
                num_ranks
            ];
            for args in [
                LowLatencyArgs::new(3, 128, 2 * num_ranks, 4).bf16(),
                LowLatencyArgs {
                    round_scale: true,
                    use_ue8m0: true,
                    ..LowLatencyArgs::new(3, 640, 2 * num_ranks, 4)
                },
            ] {
                let d = low_latency_dispatch(&inputs, &args).unwrap();
                assert_eq!(d.num_tokens, vec![0; num_ranks]);
                for o in &d.ranks {
                    assert_eq!(o.recv_count, [0, 0]);
                    assert!(o.src_info.iter().all(|&s| s == -1));
                    assert!(o.layout_range.iter().all(|&l| l == pack_layout_range(0, 0)));
                }
                let y = vec![f32::NAN; d.shape.num_rows() * args.hidden];
                let cinputs: Vec<LlCombineInput> = d
                    .ranks
                    .iter()
                    .map(|o| LlCombineInput {
                        x: &y,
                        topk_idx: &[],
                        topk_weights: &[],
                        handle: o.handle(),
                    })
                    .collect();
                let out = low_latency_combine(&cinputs, &args).unwrap();
                assert!(out.iter().all(|o| o.combined_x.is_empty()));
            }
        }
    }

    // ---- comparing GPU-like outputs ---------------------------------------------------

    /// Rearranges `o` the way a GPU may: blocks in a random order, rows of
    /// each block shuffled (if `shuffle_rows`), random `begin`s for empty
    /// blocks, garbage in padding rows and in unused ue8m0 bytes.
    fn gpu_like(
        rng: &mut StdRng,
        shape: &RecvShape,
        o: &LlRankOutput,
        shuffle_rows: bool,
    ) -> LlRankOutput {
        let (rn, el) = (shape.num_ranks, shape.num_local_experts);
        let mut out = o.clone();
        // Garbage everywhere first; valid rows are rewritten below.
        out.src_info.iter_mut().for_each(|s| *s = rng.random());
        match &mut out.recv_x {
            RecvX::Bf16(x) => x.iter_mut().for_each(|v| *v = f32::from_bits(rng.random())),
            RecvX::Fp8 { x, scales } => {
                x.iter_mut().for_each(|v| *v = rng.random());
                match scales {
                    RecvScales::F32(s) => s.iter_mut().for_each(|v| *v = rng.random()),
                    RecvScales::Ue8m0(p) => p.iter_mut().for_each(|v| *v = rng.random()),
                }
            }
        }
        for j in 0..el {
            let total = o.recv_count[j];
            let mut order: Vec<usize> = (0..rn).collect();
            order.shuffle(rng);
            let mut next = 0usize;
            for &r in &order {
                let (b, c) = unpack_layout_range(o.layout_range[j * rn + r]);
                if c == 0 {
                    let begin = rng.random_range(0..=total);
                    out.layout_range[j * rn + r] = pack_layout_range(begin, 0);
                    continue;
                }
                let mut rows: Vec<usize> = (b as usize..(b + c) as usize).collect();
                if shuffle_rows {
                    rows.shuffle(rng);
                }
                for (i, &src_row) in rows.iter().enumerate() {
                    copy_row(shape, o, j, src_row, &mut out, next + i);
                }
                out.layout_range[j * rn + r] = pack_layout_range(next as i32, c);
                next += c as usize;
            }
        }
        out
    }

    /// Copies valid row `from` of local expert `j` of `src` into row `to` of
    /// `dst` (channels, scales, `src_info`); unused ue8m0 bytes keep `dst`'s.
    fn copy_row(
        shape: &RecvShape,
        src: &LlRankOutput,
        j: usize,
        from: usize,
        dst: &mut LlRankOutput,
        to: usize,
    ) {
        let h = shape.hidden;
        let (a, b) = (shape.row_index(j, from), shape.row_index(j, to));
        dst.src_info[b] = src.src_info[a];
        match (&src.recv_x, &mut dst.recv_x) {
            (RecvX::Bf16(s), RecvX::Bf16(d)) => {
                d[b * h..(b + 1) * h].copy_from_slice(&s[a * h..(a + 1) * h])
            }
            (RecvX::Fp8 { x: sx, scales: ss }, RecvX::Fp8 { x: dx, scales: ds }) => {
                dx[b * h..(b + 1) * h].copy_from_slice(&sx[a * h..(a + 1) * h]);
                match (ss, ds) {
                    (RecvScales::F32(s), RecvScales::F32(d)) => {
                        for g in 0..shape.num_scales() {
                            d[shape.scale_index(j, to, g)] = s[shape.scale_index(j, from, g)];
                        }
                    }
                    (RecvScales::Ue8m0(s), RecvScales::Ue8m0(d)) => {
                        for g in 0..shape.num_scales() {
                            let w = shape.packed_scale_index(j, to, g / 4);
                            let shift = 8 * (g % 4);
                            let byte = u32::from(shape.ue8m0_byte_at(s, j, from, g));
                            d[w] = ((d[w] as u32 & !(0xFF << shift)) | byte << shift) as i32;
                        }
                    }
                    _ => unreachable!(),
                }
            }
            _ => unreachable!(),
        }
    }

    #[test]
    fn compare_recv_accepts_any_arrival_order() {
        with_seed("compare_recv", 300, |rng| {
            for (fmt, (use_fp8, round_scale, use_ue8m0)) in [
                (false, false, false),
                (true, false, false),
                (true, true, true),
            ]
            .into_iter()
            .enumerate()
            {
                let mut case = random_case(rng, 4, 4, false, false);
                case.args.use_fp8 = use_fp8;
                case.args.round_scale = round_scale;
                case.args.use_ue8m0 = use_ue8m0;
                if use_ue8m0 {
                    case.args.hidden = 640;
                    case.x = (0..4)
                        .map(|r| {
                            (0..case.num_tokens(r) * 640)
                                .map(|_| random_bf16(rng, 4.0))
                                .collect()
                        })
                        .collect();
                }
                let d = low_latency_dispatch(&case.inputs(), &case.args).unwrap();
                let shape = d.shape;
                for (dest, o) in d.ranks.iter().enumerate() {
                    let at = format!("format {fmt}, rank {dest}");
                    assert_eq!(compare_recv(&shape, o, o, RecvOrder::Exact), Ok(()), "{at}");
                    // Blocks moved, rows in order.
                    let g = gpu_like(rng, &shape, o, false);
                    compare_recv(&shape, o, &g, RecvOrder::TokensAscending).unwrap();
                    compare_recv(&shape, o, &g, RecvOrder::Any).unwrap();
                    // Rows shuffled too.
                    let g = gpu_like(rng, &shape, o, true);
                    compare_recv(&shape, o, &g, RecvOrder::Any).unwrap();
                    let moved = (0..shape.num_local_experts).any(|j| {
                        (0..shape.num_ranks).any(|r| {
                            let i = j * shape.num_ranks + r;
                            let (eb, ec) = unpack_layout_range(o.layout_range[i]);
                            let (gb, _) = unpack_layout_range(g.layout_range[i]);
                            ec > 0 && eb != gb
                        })
                    });
                    if moved {
                        assert!(
                            compare_recv(&shape, o, &g, RecvOrder::Exact).is_err(),
                            "{at}"
                        );
                    }
                    check_corruptions_are_caught(rng, &shape, o, &g);
                }
            }
        });
    }

    /// Every kind of wrong GPU output is caught; changes to unspecified data
    /// are not.
    fn check_corruptions_are_caught(
        rng: &mut StdRng,
        shape: &RecvShape,
        o: &LlRankOutput,
        g: &LlRankOutput,
    ) {
        let (rn, el, h) = (shape.num_ranks, shape.num_local_experts, shape.hidden);
        let any = RecvOrder::Any;
        // Rows in use in `g`, as (j, row).
        let valid: Vec<(usize, usize)> = (0..el)
            .flat_map(|j| (0..g.recv_count[j] as usize).map(move |row| (j, row)))
            .collect();
        // Padding and empty-block begins are free.
        let mut free = g.clone();
        for j in 0..el {
            for row in g.recv_count[j] as usize..shape.rows_per_expert() {
                free.src_info[shape.row_index(j, row)] = 12345;
            }
            for r in 0..rn {
                if unpack_layout_range(g.layout_range[j * rn + r]).1 == 0 {
                    free.layout_range[j * rn + r] = pack_layout_range(-7, 0);
                }
            }
        }
        compare_recv(shape, o, &free, any).unwrap();
        if valid.is_empty() {
            return;
        }
        let (j, row) = valid[rng.random_range(0..valid.len())];
        let at = shape.row_index(j, row);
        // A wrong channel.
        let mut bad = g.clone();
        match &mut bad.recv_x {
            RecvX::Bf16(x) => {
                x[at * h + h - 1] = f32::from_bits(x[at * h + h - 1].to_bits() ^ 1 << 16)
            }
            RecvX::Fp8 { x, .. } => x[at * h + 5] ^= 1,
        }
        assert!(compare_recv(shape, o, &bad, any).is_err(), "channel");
        // A wrong scale (or exponent byte of a real group).
        let mut bad = g.clone();
        match &mut bad.recv_x {
            RecvX::Bf16(_) => {}
            RecvX::Fp8 { scales, .. } => {
                let group = shape.num_scales() - 1;
                match scales {
                    RecvScales::F32(s) => s[shape.scale_index(j, row, group)] *= 2.0,
                    RecvScales::Ue8m0(p) => {
                        p[shape.packed_scale_index(j, row, group / 4)] ^= 1 << (8 * (group % 4))
                    }
                }
                assert!(compare_recv(shape, o, &bad, any).is_err(), "scale");
            }
        }
        // A wrong token index.
        let mut bad = g.clone();
        bad.src_info[at] += 1;
        assert!(compare_recv(shape, o, &bad, any).is_err(), "src_info");
        // A wrong count.
        let mut bad = g.clone();
        bad.recv_count[j] += 1;
        assert!(compare_recv(shape, o, &bad, any).is_err(), "recv_count");
        // Overlapping blocks: move a nonempty block onto another one's rows.
        let nonempty: Vec<usize> = (0..rn)
            .filter(|&r| unpack_layout_range(g.layout_range[j * rn + r]).1 > 0)
            .collect();
        if nonempty.len() >= 2 {
            let mut bad = g.clone();
            let (b0, _) = unpack_layout_range(g.layout_range[j * rn + nonempty[0]]);
            let (_, c1) = unpack_layout_range(g.layout_range[j * rn + nonempty[1]]);
            bad.layout_range[j * rn + nonempty[1]] = pack_layout_range(b0, c1);
            assert!(compare_recv(shape, o, &bad, any).is_err(), "overlap");
        }
        // A block past the valid rows.
        let r = nonempty[0];
        let (_, c) = unpack_layout_range(g.layout_range[j * rn + r]);
        let mut bad = g.clone();
        bad.layout_range[j * rn + r] = pack_layout_range(g.recv_count[j] - c + 1, c);
        assert!(compare_recv(shape, o, &bad, any).is_err(), "out of range");
        // A malformed length.
        let mut bad = g.clone();
        bad.src_info.pop();
        assert!(compare_recv(shape, o, &bad, any).is_err(), "length");
    }

    #[test]
    fn combine_accepts_a_gpu_like_handle() {
        with_seed("combine with a permuted handle", 400, |rng| {
            for use_fp8 in [false, true] {
                for dups in [false, true] {
                    let mut case = random_case(rng, 4, 8, dups, false);
                    case.args.use_fp8 = use_fp8;
                    let d = low_latency_dispatch(&case.inputs(), &case.args).unwrap();
                    let reference = combine_received(&case, &d.shape, &d.ranks);
                    let shuffled: Vec<LlRankOutput> = d
                        .ranks
                        .iter()
                        .map(|o| gpu_like(rng, &d.shape, o, true))
                        .collect();
                    let from_gpu = combine_received(&case, &d.shape, &shuffled);
                    for (a, b) in reference.iter().zip(&from_gpu) {
                        assert_eq!(bits(&a.combined_x_f32), bits(&b.combined_x_f32));
                    }
                }
            }
        });
    }

    /// Combine with `y` = what each rank received (bf16, or fp8 dequantized
    /// and rounded to bf16), padding rows NaN.
    fn combine_received(
        case: &Case,
        shape: &RecvShape,
        ranks: &[LlRankOutput],
    ) -> Vec<LlCombineOutput> {
        let h = shape.hidden;
        let ys: Vec<Vec<f32>> = ranks
            .iter()
            .map(|o| {
                let mut y: Vec<f32> = match &o.recv_x {
                    RecvX::Bf16(x) => x.clone(),
                    RecvX::Fp8 { x, scales } => dequantize_fp8(x, scales, shape)
                        .unwrap()
                        .into_iter()
                        .map(round_to_bf16)
                        .collect(),
                };
                for j in 0..shape.num_local_experts {
                    let first = shape.row_index(j, o.recv_count[j] as usize);
                    let end = shape.row_index(j + 1, 0);
                    y[first * h..end * h].fill(f32::NAN);
                }
                y
            })
            .collect();
        let inputs = combine_inputs(ranks, &ys, &case.topk, &case.weights);
        low_latency_combine(&inputs, &case.args).unwrap()
    }

    /// Every rank's combine input: rank `r` returns `ys[r]` along its handle
    /// of `ranks[r]`, for its tokens routed by `topk[r]` with `weights[r]`.
    fn combine_inputs<'a>(
        ranks: &'a [LlRankOutput],
        ys: &'a [Vec<f32>],
        topk: &'a [impl AsRef<[i64]>],
        weights: &'a [impl AsRef<[f32]>],
    ) -> Vec<LlCombineInput<'a>> {
        (0..ranks.len())
            .map(|r| LlCombineInput {
                x: &ys[r],
                topk_idx: topk[r].as_ref(),
                topk_weights: weights[r].as_ref(),
                handle: ranks[r].handle(),
            })
            .collect()
    }

    // ---- random jobs ----------------------------------------------------------------

    /// One random job: routing, weights and bf16 tokens of every rank.
    struct Case {
        args: LowLatencyArgs,
        topk: Vec<Vec<i64>>,
        weights: Vec<Vec<f32>>,
        x: Vec<Vec<f32>>,
        /// Tokens are small integers times 2^-4 and weights are powers of
        /// two: every bf16 combine is exact.
        exact: bool,
    }

    impl Case {
        fn num_ranks(&self) -> usize {
            self.topk.len()
        }

        fn num_tokens(&self, r: usize) -> usize {
            self.topk[r].len() / self.args.num_topk
        }

        fn inputs(&self) -> Vec<LlRankInput<'_>> {
            (0..self.num_ranks())
                .map(|r| LlRankInput {
                    x: &self.x[r],
                    topk_idx: &self.topk[r],
                })
                .collect()
        }
    }

    /// A bf16 job (set the fp8 flags after); `duplicates`: some rows repeat
    /// an id (then every rank has at most `T / 2` tokens).
    fn random_case(
        rng: &mut StdRng,
        num_ranks: usize,
        k: usize,
        duplicates: bool,
        exact: bool,
    ) -> Case {
        let experts_per_rank = k.div_ceil(num_ranks).max(rng.random_range(1..=4));
        let num_experts = num_ranks * experts_per_rank;
        let max_tokens = rng.random_range(2..=128);
        let hidden = 128 * rng.random_range(1..=2);
        let args = LowLatencyArgs::new(max_tokens, hidden, num_experts, k).bf16();
        let mut case = Case {
            args,
            topk: vec![],
            weights: vec![],
            x: vec![],
            exact,
        };
        let most = if duplicates {
            max_tokens / 2
        } else {
            max_tokens
        };
        for _ in 0..num_ranks {
            let n = match rng.random_range(0..5) {
                0 => 0,
                1 => most,
                _ => rng.random_range(1..=most),
            };
            let topk = crate::test_support::random_topk(rng, n, num_experts, k, duplicates);
            let weights = (0..n * k)
                .map(|_| {
                    if exact {
                        let sign = if rng.random_bool(0.5) { 1.0 } else { -1.0 };
                        sign * pow2f(rng.random_range(-2..=1))
                    } else {
                        rng.random_range(-1.0f32..1.0)
                    }
                })
                .collect();
            let x = (0..n * hidden)
                .map(|_| {
                    if exact {
                        rng.random_range(-255i32..=255) as f32 / 16.0
                    } else {
                        random_bf16(rng, 1.0)
                    }
                })
                .collect();
            case.topk.push(topk);
            case.weights.push(weights);
            case.x.push(x);
        }
        case
    }

    /// Checks a dispatch against a direct recomputation from `case`.
    fn check_dispatch(case: &Case, d: &LlDispatched) {
        let (rn, k, h) = (case.num_ranks(), case.args.num_topk, case.args.hidden);
        let el = case.args.num_experts / rn;
        let shape = d.shape;
        assert_eq!(
            (
                shape.num_ranks,
                shape.num_local_experts,
                shape.max_tokens,
                shape.hidden
            ),
            (rn, el, case.args.num_max_dispatch_tokens_per_rank, h)
        );
        assert_eq!(
            d.num_tokens,
            (0..rn).map(|r| case.num_tokens(r)).collect::<Vec<_>>()
        );
        let cast: Vec<Fp8Tokens> = case
            .x
            .iter()
            .map(|x| quantize_fp8(x, case.args.round_scale).unwrap())
            .collect();
        let (g, rt) = (shape.num_scales(), shape.rows_per_expert());
        let mut total = 0;
        for (dest, o) in d.ranks.iter().enumerate() {
            check_output_lengths(&shape, o).unwrap();
            for j in 0..el {
                let e = (dest * el + j) as i64;
                let mut begin = 0;
                for (r, cast) in cast.iter().enumerate() {
                    // One row per (token, column) that selected e, in order.
                    let want: Vec<usize> = case.topk[r]
                        .chunks_exact(k)
                        .enumerate()
                        .flat_map(|(t, row)| row.iter().filter(|&&id| id == e).map(move |_| t))
                        .collect();
                    assert_eq!(
                        unpack_layout_range(o.layout_range[j * rn + r]),
                        (begin as i32, want.len() as i32),
                        "rank {dest} expert {j} source {r}"
                    );
                    for (i, &t) in want.iter().enumerate() {
                        let row = begin + i;
                        let at = shape.row_index(j, row);
                        assert_eq!(o.src_info[at], t as i32);
                        assert!(case.topk[r][t * k..(t + 1) * k].contains(&e));
                        match &o.recv_x {
                            RecvX::Bf16(x) => assert_eq!(
                                bits(&x[at * h..(at + 1) * h]),
                                bits(&case.x[r][t * h..(t + 1) * h])
                            ),
                            RecvX::Fp8 { x, scales } => {
                                assert_eq!(x[at * h..(at + 1) * h], cast.x[t * h..(t + 1) * h]);
                                for gi in 0..g {
                                    let want = cast.scales[t * g + gi];
                                    match scales {
                                        RecvScales::F32(s) => assert_eq!(
                                            s[shape.scale_index(j, row, gi)].to_bits(),
                                            want.to_bits()
                                        ),
                                        RecvScales::Ue8m0(p) => assert_eq!(
                                            shape.ue8m0_byte_at(p, j, row, gi),
                                            ue8m0_byte(want)
                                        ),
                                    }
                                }
                            }
                        }
                    }
                    begin += want.len();
                }
                assert_eq!(o.recv_count[j] as usize, begin);
                assert!(
                    o.src_info[shape.row_index(j, begin)..shape.row_index(j, rt)]
                        .iter()
                        .all(|&s| s == -1)
                );
                total += begin;
            }
        }
        let valid: usize = case
            .topk
            .iter()
            .map(|t| t.iter().filter(|&&e| e >= 0).count())
            .sum();
        assert_eq!(total, valid);
    }

    /// dispatch -> combine with `y` = what was received gives `sum_k w_k x_t`
    /// (x_t after the fp8 round trip when fp8), within the documented
    /// tolerances, and exactly for exact bf16 cases.
    fn check_round_trip(case: &Case, d: &LlDispatched) {
        let (k, h) = (case.args.num_topk, case.args.hidden);
        let out = combine_received(case, &d.shape, &d.ranks);
        for (r, o) in out.iter().enumerate() {
            let n = case.num_tokens(r);
            // The token values the experts saw.
            let seen: Vec<f32> = if case.args.use_fp8 {
                let q = quantize_fp8(&case.x[r], case.args.round_scale).unwrap();
                dequantize_fp8_rows(&q.x, &q.scales)
                    .unwrap()
                    .into_iter()
                    .map(round_to_bf16)
                    .collect()
            } else {
                case.x[r].clone()
            };
            let (mut want, mut unquantized, mut alt) = (
                vec![0.0f64; n * h],
                vec![0.0f32; n * h],
                vec![0.0f32; n * h],
            );
            for t in 0..n {
                for i in t * h..(t + 1) * h {
                    for c in 0..k {
                        if case.topk[r][t * k + c] >= 0 {
                            let w = case.weights[r][t * k + c];
                            want[i] += f64::from(w) * f64::from(seen[i]);
                            unquantized[i] += w * case.x[r][i];
                        }
                    }
                    // Another kernel: reverse order, separate multiply and add.
                    for c in (0..k).rev() {
                        if case.topk[r][t * k + c] >= 0 {
                            alt[i] += case.weights[r][t * k + c] * seen[i];
                        }
                    }
                }
                if case.topk[r][t * k..(t + 1) * k].iter().all(|&e| e < 0) {
                    assert!(o.combined_x[t * h..(t + 1) * h]
                        .iter()
                        .all(|v| v.to_bits() == 0));
                }
            }
            let want32: Vec<f32> = want.iter().map(|&v| v as f32).collect();
            if case.exact && !case.args.use_fp8 {
                assert_eq!(
                    bits(&o.combined_x_f32),
                    bits(&want32),
                    "rank {r}: exact sums"
                );
                let rounded: Vec<f32> = want32.iter().map(|&v| round_to_bf16(v)).collect();
                assert_eq!(bits(&o.combined_x), bits(&rounded), "rank {r}");
            }
            let independent: Vec<f32> = want32.iter().map(|&v| round_to_bf16(v)).collect();
            check_combined(o, &independent, k).unwrap();
            let alt: Vec<f32> = alt.iter().map(|&v| round_to_bf16(v)).collect();
            check_combined(o, &alt, k).unwrap();
            let diff = calc_diff(&o.combined_x, &want32);
            assert!(
                diff < 1e-5,
                "rank {r}: calc_diff {diff:e} against the received data"
            );
            if case.args.use_fp8 && !case.exact && n > 0 {
                let diff = calc_diff(&o.combined_x, &unquantized);
                assert!(
                    diff < 9e-4,
                    "rank {r}: calc_diff {diff:e} against unquantized x"
                );
            }
        }
    }

    fn random_job(num_ranks: usize, k: usize, offset: u64) {
        let what = format!("random job R={num_ranks} K={k}");
        with_seed(&what, offset, |rng| {
            let duplicates = k > 1 && rng.random_bool(0.3);
            let exact = rng.random_bool(0.5);
            let mut case = random_case(rng, num_ranks, k, duplicates, exact);
            check_dispatches(&case);
            check_fp8_dispatches(&mut case, &[(false, false), (true, false), (true, true)]);
        });
    }

    /// Dispatch of `case` as it is, checked, and its round trip.
    fn check_dispatches(case: &Case) {
        let d = low_latency_dispatch(&case.inputs(), &case.args).unwrap();
        check_dispatch(case, &d);
        check_round_trip(case, &d);
    }

    /// [`check_dispatches`] of `case` in fp8 with each `(round_scale, use_ue8m0)`.
    fn check_fp8_dispatches(case: &mut Case, variants: &[(bool, bool)]) {
        for &(round_scale, use_ue8m0) in variants {
            case.args.use_fp8 = true;
            case.args.round_scale = round_scale;
            case.args.use_ue8m0 = use_ue8m0;
            check_dispatches(case);
        }
    }

    #[test]
    fn random_jobs() {
        let mut offset = 1000;
        for num_ranks in [1, 2, 4, 8] {
            for k in [1, 4, 8] {
                for _ in 0..2 {
                    random_job(num_ranks, k, offset);
                    offset += 1;
                }
            }
        }
    }

    #[test]
    fn random_jobs_with_odd_group_counts() {
        // H = 640: five groups, a partly used ue8m0 word.
        with_seed("H = 640", 2000, |rng| {
            for num_ranks in [1, 2] {
                let mut case = random_case(rng, num_ranks, 4, false, false);
                case.args.hidden = 640;
                case.x = (0..num_ranks)
                    .map(|r| {
                        (0..case.num_tokens(r) * 640)
                            .map(|_| random_bf16(rng, 8.0))
                            .collect()
                    })
                    .collect();
                check_fp8_dispatches(&mut case, &[(false, false), (true, true)]);
            }
        });
    }

    // ---- tolerances ------------------------------------------------------------------

    #[test]
    fn check_combined_bounds() {
        let expected = LlCombineOutput {
            // 1 + 2^-8 is a bf16 tie: it rounds to 1.0, a hair more to 1 + 2^-7.
            combined_x: vec![1.0, 0.0, 256.0, f32::NAN],
            combined_x_f32: vec![1.0 + pow2f(-8), 0.0, 256.0, f32::NAN],
            abs_sum: vec![2.0, 512.0, 256.0, 1.0],
        };
        // The exact output, and NaN where the reference is NaN.
        check_combined(&expected, &[1.0, 0.0, 256.0, f32::NAN], 4).unwrap();
        // The other side of the tie passes.
        check_combined(&expected, &[1.0 + pow2f(-7), 0.0, 256.0, f32::NAN], 4).unwrap();
        // Cancellation: a sum of 512 in magnitude that cancels to 0 may be off
        // by about 2 (K + 1) 2^-24 * 512.
        check_combined(&expected, &[1.0, 2e-4, 256.0, f32::NAN], 4).unwrap();
        for bad in [
            [1.0 + 2.0 * pow2f(-7), 0.0, 256.0, f32::NAN],
            [1.0 - pow2f(-8), 0.0, 256.0, f32::NAN],
            [1.0, 1e-3, 256.0, f32::NAN],
            [1.0, 0.0, 258.0, f32::NAN],
            [1.0, 0.0, f32::NAN, f32::NAN],
            [1.0, 0.0, 256.0, 0.0],
        ] {
            assert!(check_combined(&expected, &bad, 4).is_err(), "{bad:?}");
        }
        assert!(check_combined(&expected, &[1.0], 4).is_err());
    }

    #[test]
    fn calc_diff_values() {
        assert_eq!(calc_diff(&[], &[]), 0.0);
        assert_eq!(calc_diff(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert_eq!(calc_diff(&[-1.0], &[-1.0]), 0.0); // 0 / 0
                                                      // x' = 2, y' = 3: 1 - 12 / 13.
        assert!((calc_diff(&[1.0], &[2.0]) - 1.0 / 13.0).abs() < 1e-15);
    }

    // ---- validation --------------------------------------------------------------------

    #[test]
    fn dispatch_rejects_bad_arguments() {
        let x = vec![1.0f32; 2 * 128];
        let good = LlRankInput {
            x: &x,
            topk_idx: &[0, 1, 2, 3],
        };
        let args = LowLatencyArgs::new(2, 128, 4, 2);
        low_latency_dispatch(&[good, good], &args).unwrap();

        assert_invalid(low_latency_dispatch(&[], &args), "inputs");
        let with = |f: fn(&mut LowLatencyArgs)| {
            let mut a = args;
            f(&mut a);
            low_latency_dispatch(&[good, good], &a)
        };
        assert_invalid(with(|a| a.num_experts = 3), "num_experts");
        assert_invalid(with(|a| a.num_experts = 0), "num_experts");
        assert_invalid(with(|a| a.num_topk = 0), "num_topk");
        assert_invalid(with(|a| a.num_topk = 33), "num_topk");
        assert_invalid(with(|a| a.num_topk = 3), "topk_idx");
        assert_invalid(with(|a| a.hidden = 0), "hidden");
        assert_invalid(with(|a| a.hidden = 64), "hidden");
        assert_invalid(with(|a| a.hidden = 200), "hidden");
        assert_invalid(with(|a| a.hidden = 256), "x");
        assert_invalid(
            with(|a| a.num_max_dispatch_tokens_per_rank = 0),
            "num_max_dispatch_tokens_per_rank",
        );
        assert_invalid(
            with(|a| a.num_max_dispatch_tokens_per_rank = 1),
            "num_max_dispatch_tokens_per_rank",
        );
        assert_invalid(
            with(|a| a.num_max_dispatch_tokens_per_rank = 1 << 30),
            "num_max_dispatch_tokens_per_rank",
        );
        assert_invalid(with(|a| a.use_ue8m0 = true), "use_ue8m0");
        // round_scale means nothing without use_fp8; use_ue8m0 is an error
        // there; ue8m0 with round_scale is fine.
        with(|a| {
            a.use_fp8 = false;
            a.round_scale = true;
        })
        .unwrap();
        assert_invalid(
            with(|a| {
                a.use_fp8 = false;
                a.use_ue8m0 = true;
                a.round_scale = true;
            }),
            "use_ue8m0",
        );
        // The kernels' limits, before anything is allocated.
        assert_invalid(with(|a| a.hidden = limits::LL_MAX_HIDDEN + 128), "hidden");
        assert_invalid(
            with(|a| a.num_max_dispatch_tokens_per_rank = limits::LL_MAX_TOKENS_PER_RANK + 1),
            "num_max_dispatch_tokens_per_rank",
        );
        assert_invalid(
            with(|a| a.num_max_dispatch_tokens_per_rank = usize::MAX),
            "num_max_dispatch_tokens_per_rank",
        );
        assert_invalid(with(|a| a.num_experts = 2 * 1025), "num_experts");
        assert_invalid(with(|a| a.num_experts = usize::MAX - 1), "num_experts");
        let many = vec![good; limits::MAX_RANKS + 1];
        assert_invalid(low_latency_dispatch(&many, &args), "inputs");
        // Within the limits, but outputs beyond the reference's budget.
        assert_invalid(
            with(|a| {
                a.num_max_dispatch_tokens_per_rank = limits::LL_MAX_TOKENS_PER_RANK;
                a.hidden = limits::LL_MAX_HIDDEN;
            }),
            "num_max_dispatch_tokens_per_rank",
        );
        with(|a| {
            a.round_scale = true;
            a.use_ue8m0 = true;
        })
        .unwrap();

        let bad = |f: &dyn Fn(&mut LlRankInput)| {
            let mut b = good;
            f(&mut b);
            low_latency_dispatch(&[good, b], &args)
        };
        assert_invalid(bad(&|b| b.topk_idx = &[0, 4, 2, 3]), "topk_idx");
        assert_invalid(bad(&|b| b.topk_idx = &[0, -2, 2, 3]), "topk_idx");
        assert_invalid(bad(&|b| b.topk_idx = &[0, 1, 2]), "topk_idx");
        assert_invalid(
            bad(&|b| b.topk_idx = &[0, 1, 2, 3, 0, 1]),
            "num_max_dispatch_tokens_per_rank",
        );
        let b = LlRankInput {
            x: &x[..128],
            ..good
        };
        assert_invalid(low_latency_dispatch(&[good, b], &args), "x");
        // Duplicates beyond T messages to one expert.
        assert_invalid(bad(&|b| b.topk_idx = &[1, 1, 1, -1]), "topk_idx");
        bad(&|b| b.topk_idx = &[1, 1, -1, -1]).unwrap();
        // Values: not bf16, or (fp8) not finite.
        for v in [1.0 + pow2f(-10), f32::from_bits(0x7FC0_0001)] {
            let mut y = x.clone();
            y[130] = v;
            let b = LlRankInput { x: &y, ..good };
            assert_invalid(low_latency_dispatch(&[good, b], &args), "x");
        }
        for v in [f32::INFINITY, f32::NAN, f32::NEG_INFINITY] {
            let mut y = x.clone();
            y[7] = round_to_bf16(v);
            let b = LlRankInput { x: &y, ..good };
            assert_invalid(low_latency_dispatch(&[good, b], &args), "x");
            // bf16 dispatch moves them.
            let bf = LowLatencyArgs::new(2, 128, 4, 2).bf16();
            let d = low_latency_dispatch(&[good, b], &bf).unwrap();
            let recv = d.ranks[0].bf16_x();
            // Rank 1 t0 -> expert 0 row 1.
            assert_eq!(
                recv[d.shape.row_index(0, 1) * 128 + 7].to_bits(),
                y[7].to_bits()
            );
        }
    }

    #[test]
    fn combine_rejects_bad_arguments() {
        let h = 128;
        let (args, d) = hand_bf16(h);
        let ys = [d.ranks[0].bf16_x().to_vec(), d.ranks[1].bf16_x().to_vec()];
        let good: [LlCombineInput; 2] = combine_inputs(&d.ranks, &ys, &HAND_TOPK, &HAND_WEIGHTS)
            .try_into()
            .unwrap();
        low_latency_combine(&good, &args).unwrap();

        assert_invalid(low_latency_combine(&[], &args), "inputs");
        let bad = |f: &dyn Fn(&mut LlCombineInput)| {
            let mut inputs = good;
            f(&mut inputs[1]);
            low_latency_combine(&inputs, &args)
        };
        // Routing of rank 1's own tokens.
        assert_invalid(bad(&|c| c.topk_idx = &[3, 2, -1]), "topk_idx");
        assert_invalid(bad(&|c| c.topk_idx = &[3, 4, -1, 0]), "topk_idx");
        assert_invalid(bad(&|c| c.topk_idx = &[3, 2, -1, -3]), "topk_idx");
        assert_invalid(bad(&|c| c.topk_weights = &[1.0; 3]), "topk_weights");
        let mut short = args;
        short.num_max_dispatch_tokens_per_rank = 2;
        assert_invalid(
            low_latency_combine(&good, &short),
            "num_max_dispatch_tokens_per_rank",
        );
        // Shapes of the expert outputs and the handle.
        assert_invalid(bad(&|c| c.x = &c.x[..c.x.len() - 1]), "x");
        assert_invalid(
            bad(&|c| c.handle.src_info = &c.handle.src_info[1..]),
            "src_info",
        );
        assert_invalid(
            bad(&|c| c.handle.layout_range = &c.handle.layout_range[1..]),
            "layout_range",
        );
        // A routing that does not match the handle: rank 1's t1 now picks
        // expert 1 instead of 0.
        assert_invalid(bad(&|c| c.topk_idx = &[3, 2, -1, 1]), "src_info");

        // Broken handles of rank 0 (expert 0 holds r0 t0, r0 t2 | r1 t1).
        let with_handle = |src_info: &[i32], layout_range: &[i64]| {
            let mut inputs = good;
            inputs[0].handle = LlHandle {
                src_info,
                layout_range,
            };
            low_latency_combine(&inputs, &args)
        };
        let (si, lr) = (&d.ranks[0].src_info, &d.ranks[0].layout_range);
        with_handle(si, lr).unwrap();
        let p = pack_layout_range;
        for (ranges, why) in [
            ([p(0, 2), p(2, -1), lr[2], lr[3]], "negative count"),
            ([p(0, 2), p(7, 2), lr[2], lr[3]], "past RT"),
            ([p(-1, 2), p(2, 1), lr[2], lr[3]], "negative begin"),
            ([p(0, 2), p(1, 1), lr[2], lr[3]], "overlap"),
            ([p(1, 2), p(3, 1), lr[2], lr[3]], "gap"),
        ] {
            match with_handle(si, &ranges) {
                Err(CommError::InvalidArgument {
                    name: "layout_range",
                    ..
                }) => {}
                other => panic!("{why}: {other:?}"),
            }
        }
        // Blocks in another order and an empty block anywhere are fine.
        let mut moved = si.clone();
        moved[..3].copy_from_slice(&[1, 0, 2]);
        with_handle(&moved, &[p(1, 2), p(0, 1), p(0, 1), p(5, 0)]).unwrap();
        // Token indices: out of range, or a token that did not pick the expert.
        for bad_token in [3, -1, 1] {
            let mut wrong = si.clone();
            wrong[1] = bad_token;
            assert_invalid(with_handle(&wrong, lr), "src_info");
        }
        // Expert outputs: a valid row must be bf16; padding rows are free.
        let mut padding = ys[0].clone();
        padding[d.shape.row_index(0, 3) * h] = 0.1;
        let mut valid = ys[0].clone();
        valid[d.shape.row_index(0, 2) * h + 5] = 0.1;
        let mut inputs = good;
        inputs[0].x = &padding;
        low_latency_combine(&inputs, &args).unwrap();
        inputs[0].x = &valid;
        assert_invalid(low_latency_combine(&inputs, &args), "x");
    }

    #[test]
    fn fp8_helpers_reject_bad_lengths() {
        assert_invalid(quantize_fp8(&[0.0; 100], false), "x");
        assert_eq!(quantize_fp8(&[], true).unwrap().x, Vec::<u8>::new());
        assert_invalid(dequantize_fp8_rows(&[0; 100], &[1.0]), "x");
        assert_invalid(dequantize_fp8_rows(&[0; 256], &[1.0]), "scales");
        let shape = RecvShape {
            num_ranks: 2,
            num_local_experts: 1,
            max_tokens: 1,
            hidden: 256,
        };
        let x = vec![0x38u8; 2 * 256];
        let ok = dequantize_fp8(&x, &RecvScales::F32(vec![2.0; 4]), &shape).unwrap();
        assert!(ok.iter().all(|&v| v == 2.0));
        assert_invalid(
            dequantize_fp8(&x[1..], &RecvScales::F32(vec![2.0; 4]), &shape),
            "x",
        );
        assert_invalid(
            dequantize_fp8(&x, &RecvScales::F32(vec![2.0; 3]), &shape),
            "scales",
        );
        assert_invalid(
            dequantize_fp8(&x, &RecvScales::Ue8m0(vec![0; 1]), &shape),
            "scales",
        );
        let packed = RecvScales::Ue8m0(vec![0x8180, 0x7F7E]);
        let y = dequantize_fp8(&x, &packed, &shape).unwrap();
        // Row 0: groups 0, 1 = bytes 0x80, 0x81; row 1: 0x7E, 0x7F.
        assert_eq!([y[0], y[128], y[256], y[384]], [2.0, 4.0, 0.5, 1.0]);
        let odd = RecvShape {
            hidden: 100,
            ..shape
        };
        assert_invalid(dequantize_fp8(&x, &RecvScales::F32(vec![]), &odd), "hidden");
    }
}
