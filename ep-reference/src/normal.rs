//! CPU reference semantics of the "normal" (intranode and internode) path:
//! dispatch layout, dispatch and combine, for any number of ranks simulated in
//! one process. This module is the test oracle: every GPU test of these
//! operations compares its results with the functions here, so their docs are
//! the exact contract (the Python-level contract is `docs/api.md`, sections
//! "Layout", "dispatch" and "combine"; low latency is not covered here).
//!
//! Every size is checked against [`crate::limits`] (the GPU path's limits)
//! before anything is allocated; outputs whose size an argument chooses
//! (`num_worst_tokens`) are allocated fallibly and held to
//! [`limits::reference_max_bytes`], so no argument panics or aborts.
//!
//! # Model
//!
//! There are `R` ranks (`1 <= R <= MAX_RANKS`) and `E` experts, `E` a
//! positive multiple of `R`; every rank hosts `E_local = E / R` consecutive
//! experts (at most `MAX_EXPERTS_PER_RANK`), so expert `e` lives on rank
//! `e / E_local` and has local id `e - rank * E_local` there. Source rank `r`
//! holds `0 <= N_r <= MAX_TOKENS_PER_RANK` tokens. Token `t`
//! of rank `r` has a row of `K` expert ids `topk_idx[t * K .. (t + 1) * K]`
//! (`1 <= K <= MAX_TOPK`), each in `-1 ..= E - 1`; `-1` means "no expert".
//! All matrices are flat, row-major `Vec`s / slices.
//!
//! Token payloads are opaque bytes (`hidden_bytes` per token, a multiple of
//! [`HIDDEN_BYTES_ALIGNMENT`], at most `MAX_HIDDEN_BYTES`), so bf16 and fp8
//! are moved the same way; fp8 tokens additionally carry a row of
//! `num_scales` f32 scales (`H / 128` for DeepEP's fp8 format) that travels
//! with the token. Nothing is converted.
//!
//! # Choices where the Python contract is silent
//!
//! - **Duplicate expert ids in one token's top-k.** A token "has" expert `e`
//!   if `e` appears at least once in its row. Every per-expert count
//!   ([`Layout::num_tokens_per_expert`], [`RankOutput::num_recv_tokens_per_expert`])
//!   counts each (token, expert) pair once, however often `e` repeats. Routers
//!   (top-k of scores) never produce duplicates; for duplicate-free rows this
//!   is identical to DeepEP, which counts (token, k) occurrences. Entries are
//!   never merged: a duplicate id keeps its own column in `recv_topk_idx`
//!   and its own weight.
//! - **`-1` columns.** A `-1` column is dropped on every rank: its
//!   `recv_topk_idx` is `-1` and its `recv_topk_weights` entry is `0.0`
//!   wherever it lands, so the combined weight of that column is `0.0`, not
//!   the original weight. A token whose row is all `-1` goes nowhere and
//!   combines to its bias (zeros without bias).
//! - **Ids below `-1`** are rejected (DeepEP silently ignores any negative id).
//! - **`K > MAX_TOPK`** is rejected (DeepEP's normal kernels give each top-k
//!   column one warp lane).
//! - **Padding rows** (`num_worst_tokens > 0`): the contract fixes only
//!   `recv_topk_idx = -1` and `recv_topk_weights = 0.0` there. The reference
//!   fills the other padded outputs with zeros (`recv_x`, `recv_scales`) and
//!   `-1` (`recv_src_idx`, `recv_src_rank`), but GPU tests must not compare
//!   them: only rows `..num_recv_tokens` of those are specified.
//!
//! # Internode: nodes of consecutive ranks
//!
//! An internode job splits the `R` ranks into `R / ranks_per_node` nodes of
//! `ranks_per_node` consecutive ranks (`ranks_per_node >= 1` divides `R`):
//! rank `j` is on node `j / ranks_per_node`. The split changes how bytes
//! travel (a token crosses to each destination node once, over RDMA, and is
//! forwarded there over NVLink), not what arrives:
//!
//! - [`layout_internode`] is [`layout`] plus `num_tokens_per_rdma_rank`, the
//!   tokens with at least one expert on a rank of each node (once per node);
//! - [`dispatch_internode`] gives exactly the outputs of [`dispatch`] (rows,
//!   order, ids, weights, payloads, scales, source info, per-expert counts,
//!   prefix matrix) for every split; only its layouts also carry the per-node
//!   counts. So an internode dispatch is checked bit for bit against the
//!   single-node results;
//! - combine reduces in two levels with a bf16 rounding in between, so its
//!   result does depend on the split: [`combine_internode`] is the model of
//!   the internode kernels, below.
//!
//! ## Internode combine model
//!
//! For a token `t` of source rank `s` dispatched to the set `D(t)` of ranks,
//! with `y_d` the row rank `d` returns for it and `w_d` its `K` weights (when
//! given):
//!
//! 1. Every node `n` (ascending) holding at least one rank of `D(t)`, the
//!    source's own node included, forms the partial
//!    `p_n = bf16(0.0 + y_{d0} + y_{d1} + ...)` over the ranks `d0 < d1 < ...`
//!    of `D(t)` on node `n`: summed in f32 from `+0.0`, left to right, then
//!    rounded once to bf16 (to nearest, ties to even: [`f32_to_bf16_bits`]).
//!    Weights: `q_n = 0.0 + w_{d0} + w_{d1} + ...` in f32, not rounded.
//! 2. The source rank sums `(bias0 + bias1) + p_{n0} + p_{n1} + ...` in f32
//!    over those nodes `n0 < n1 < ...` (absent biases read as `0.0`, exactly
//!    as in [`combine`]), and the kernel stores it as bf16. Weights:
//!    `0.0 + q_{n0} + q_{n1} + ...` in f32.
//!
//! [`combine_internode`] returns the f32 sum of step 2, before that last store,
//! like [`combine`]: its [`round_to_bf16`] is the kernels' bf16 output and its
//! weights their f32 weights, bit for bit. A token routed nowhere combines to
//! its bias (zeros without bias), as in [`combine`]. This is DeepEP's internode
//! combine: on each node a forwarder reduces the in-node copies in f32 and
//! sends one bf16 row per (token, node) over RDMA; the source rank adds those
//! to the biases in ascending node order.
//!
//! `ranks_per_node == R` (one node) is a valid split of [`combine_internode`]
//! and gives `bf16((bias0 + bias1) + bf16(sum of the copies))`. A
//! `moelink.Buffer` whose group is a single node, however, runs the intranode
//! kernels, whose model is [`combine`] (no partial rounding): use [`combine`]
//! for single-node groups and [`combine_internode`] for two nodes or more.
//!
//! # Summation order and tolerances
//!
//! [`combine`] accumulates in f32 in one fixed order: first `bias0 + bias1`
//! (absent ones read as `0.0`), then the returned copies in ascending
//! destination-rank order; topk weights start from `0.0` and add the copies in
//! the same order. This is DeepEP's intranode order. [`combine_internode`]
//! follows the internode kernels' order and rounding exactly (see above):
//! compare a GPU combine with the model of the path that ran it, bit for bit
//! after [`round_to_bf16`]. Results summed in another order (the other model,
//! or kernels that sum differently) differ, because f32 addition is not
//! associative and partial sums may be rounded, so between those:
//!
//! - exact comparisons need inputs whose sums are exact in f32 and in bf16
//!   in any order and grouping (e.g. small integers, or bf16 values with few
//!   significant bits and a narrow exponent range); then compare
//!   `round_to_bf16(reference)` with the GPU's bf16 output bit for bit;
//! - for general random inputs, compare after bf16 rounding and allow
//!   [`bf16_ulp_distance`] `<= 1` per element between sums that differ only
//!   in f32 order (a different f32 sum can land on the other side of a bf16
//!   rounding boundary); between the two combine models also allow half a
//!   bf16 ulp of each node's partial; with cancellation (sums near zero) use
//!   an absolute tolerance of a few bf16 ulps of the largest addend;
//! - dispatch and everything except combine's sums (layout counts, order,
//!   indices, payload bytes, scales, weights) is exact: compare bit for bit.

use comm::error::{CommError, Result};

use crate::limits::{self, check_budget, zeroed};

/// Largest supported top-k (`K`): the normal kernels give each column a warp
/// lane. Token rows (`hidden_bytes` of dispatch, `2 * hidden` bytes of
/// combine's bf16 rows) must be a positive multiple of
/// `HIDDEN_BYTES_ALIGNMENT` bytes. Both are [`limits`].
pub use crate::limits::{MAX_TOPK, ROW_BYTES_ALIGNMENT as HIDDEN_BYTES_ALIGNMENT};

/// Result of [`layout`] / [`layout_internode`] for one source rank: the
/// outputs of `Buffer.get_dispatch_layout`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// `[R]`: entry `j` is the number of this rank's tokens that have at least
    /// one expert on rank `j` (a token counts once per rank, however many of
    /// its experts live there).
    pub num_tokens_per_rank: Vec<i32>,
    /// `[R / ranks_per_node]`: entry `n` is the number of tokens with at least
    /// one expert on a rank of node `n` (ranks `n * ranks_per_node ..
    /// (n + 1) * ranks_per_node`), once per node. `None` from [`layout`];
    /// always `Some` from [`layout_internode`] (the Python API returns `None`
    /// when there is only one node).
    pub num_tokens_per_rdma_rank: Option<Vec<i32>>,
    /// `[E]`: entry `e` is the number of tokens that have expert `e` in their
    /// top-k (once per token, see the module docs on duplicates).
    pub num_tokens_per_expert: Vec<i32>,
    /// `[N, R]`: `is_token_in_rank[t * R + j]` is true iff token `t` has at
    /// least one expert on rank `j`.
    pub is_token_in_rank: Vec<bool>,
}

impl Layout {
    /// Number of ranks `R`.
    pub fn num_ranks(&self) -> usize {
        self.num_tokens_per_rank.len()
    }

    /// Number of tokens `N` of the source rank this layout describes.
    pub fn num_tokens(&self) -> usize {
        self.is_token_in_rank
            .len()
            .checked_div(self.num_ranks())
            .unwrap_or(0)
    }

    /// `is_token_in_rank[token, rank]`. Panics when out of range.
    pub fn token_in_rank(&self, token: usize, rank: usize) -> bool {
        assert!(rank < self.num_ranks(), "rank {rank} out of range");
        self.is_token_in_rank[token * self.num_ranks() + rank]
    }
}

/// Dispatch layout of one rank's tokens (`get_dispatch_layout`, intranode).
///
/// `topk_idx` is `[N, num_topk]` (its length must be a multiple of
/// `num_topk`; `N = 0` is fine). See [`Layout`] for the meaning of each field;
/// `num_tokens_per_rdma_rank` is `None`.
///
/// Errors (`InvalidArgument`): `num_ranks` not in `1..=MAX_RANKS`;
/// `num_experts` not a positive multiple of `num_ranks` or more than
/// `MAX_EXPERTS_PER_RANK` per rank; `num_topk` not in `1..=MAX_TOPK`;
/// `topk_idx` length not a multiple of `num_topk`; an id outside
/// `-1 ..= num_experts - 1`; more than `MAX_TOKENS_PER_RANK` tokens.
pub fn layout(
    topk_idx: &[i64],
    num_topk: usize,
    num_experts: usize,
    num_ranks: usize,
) -> Result<Layout> {
    compute_layout(topk_idx, num_topk, num_experts, num_ranks, None, None)
}

/// [`layout`] plus `num_tokens_per_rdma_rank` for nodes of `ranks_per_node`
/// consecutive ranks (rank `j` is on node `j / ranks_per_node`).
///
/// Errors: those of [`layout`], and `ranks_per_node` zero or not dividing
/// `num_ranks`.
pub fn layout_internode(
    topk_idx: &[i64],
    num_topk: usize,
    num_experts: usize,
    num_ranks: usize,
    ranks_per_node: usize,
) -> Result<Layout> {
    check_ranks_per_node(ranks_per_node, num_ranks)?;
    compute_layout(
        topk_idx,
        num_topk,
        num_experts,
        num_ranks,
        Some(ranks_per_node),
        None,
    )
}

/// Shape and options of a dispatch (the same on every rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DispatchArgs {
    /// `E`: a positive multiple of the number of ranks.
    pub num_experts: usize,
    /// `K`: columns of `topk_idx` / `topk_weights`, `1..=MAX_TOPK`.
    pub num_topk: usize,
    /// Bytes of one token row of `x`; a positive multiple of
    /// [`HIDDEN_BYTES_ALIGNMENT`] (`2 * H` for bf16, `H` for fp8).
    pub hidden_bytes: usize,
    /// f32 scales per token (`H / 128` for fp8); `0` = no scales (bf16).
    pub num_scales: usize,
    /// Each entry of `num_recv_tokens_per_expert` is rounded up to a multiple
    /// of this (`>= 1`; DeepEP's default is 1).
    pub expert_alignment: usize,
    /// `0`: outputs have exactly the received rows. `> 0`: outputs are padded
    /// to this many rows and `num_recv_tokens_per_expert` is empty; it is an
    /// error if a rank receives more tokens than this.
    pub num_worst_tokens: usize,
}

impl DispatchArgs {
    /// bf16-style arguments: no scales, `expert_alignment = 1`,
    /// `num_worst_tokens = 0`.
    pub fn new(num_experts: usize, num_topk: usize, hidden_bytes: usize) -> Self {
        DispatchArgs {
            num_experts,
            num_topk,
            hidden_bytes,
            num_scales: 0,
            expert_alignment: 1,
            num_worst_tokens: 0,
        }
    }
}

/// One source rank's dispatch inputs. `N` is `topk_idx.len() / num_topk`.
#[derive(Debug, Clone, Copy)]
pub struct RankInput<'a> {
    /// `[N, K]` expert ids in `-1 ..= E - 1`.
    pub topk_idx: &'a [i64],
    /// `[N, K]`, or `None`. Either every rank passes weights or none does.
    pub topk_weights: Option<&'a [f32]>,
    /// `[N, hidden_bytes]` token payloads, moved as bytes.
    pub x: &'a [u8],
    /// `[N, num_scales]`; `Some` iff `num_scales > 0`. Moved with the token.
    pub scales: Option<&'a [f32]>,
}

/// What one destination rank `d` receives from [`dispatch`].
///
/// "Rows" is `num_worst_tokens` when that is positive, else `num_recv_tokens`.
/// Received tokens are ordered by source rank ascending, then by token index
/// on the source rank ascending; row `i < num_recv_tokens` is token
/// `recv_src_idx[i]` of rank `recv_src_rank[i]`.
#[derive(Debug, Clone, PartialEq)]
pub struct RankOutput {
    /// Number of tokens received: those of all source ranks with at least one
    /// expert on `d`, each exactly once.
    pub num_recv_tokens: usize,
    /// `[rows, hidden_bytes]`: the source token's bytes, unchanged.
    pub recv_x: Vec<u8>,
    /// `[rows, num_scales]` when dispatched with scales: the source token's
    /// scales, unchanged (bit for bit).
    pub recv_scales: Option<Vec<f32>>,
    /// `[rows, K]`: column `k` is `e - d * E_local` when the source id `e` is
    /// an expert of `d`, else `-1` (other ranks' experts and `-1` alike).
    /// Padding rows are all `-1`.
    pub recv_topk_idx: Vec<i64>,
    /// `[rows, K]` when dispatched with weights: the source weight where
    /// `recv_topk_idx` is kept, `0.0` where it is `-1` (padding rows included).
    pub recv_topk_weights: Option<Vec<f32>>,
    /// `[rows]`: index of the token on its source rank (handle field).
    pub recv_src_idx: Vec<i32>,
    /// `[rows]`: source rank of each row (reference-only; on the GPU it is
    /// implied by `rank_prefix_matrix`).
    pub recv_src_rank: Vec<i32>,
    /// `[E_local]`, empty when `num_worst_tokens > 0`: entry `j` is the number
    /// of received tokens that have local expert `j` in their top-k (once per
    /// token), rounded up to a multiple of `expert_alignment` (0 stays 0).
    pub num_recv_tokens_per_expert: Vec<i32>,
}

impl RankOutput {
    /// Rows of every per-token output (`num_worst_tokens` when padded).
    pub fn num_rows(&self) -> usize {
        self.recv_src_idx.len()
    }
}

/// Result of [`dispatch`]: every rank's outputs plus the routing (the parts of
/// the handle that are not GPU-specific), which [`dispatch_cached`] and
/// [`combine`] take.
#[derive(Debug, Clone, PartialEq)]
pub struct Dispatched {
    /// The arguments the dispatch ran with.
    pub args: DispatchArgs,
    /// `[R]`: the layout of each source rank, as [`layout`] computes it
    /// ([`layout_internode`] for [`dispatch_internode`]); its
    /// `is_token_in_rank` is the handle's.
    pub layouts: Vec<Layout>,
    /// `[R, R]`: entry `[i * R + j]` is the number of tokens ranks `0..=i`
    /// send to rank `j` (cumulative over source ranks); the same matrix on
    /// every rank. Its last row is each rank's `num_recv_tokens`.
    pub rank_prefix_matrix: Vec<i32>,
    /// `[R]`: what each destination rank receives.
    pub ranks: Vec<RankOutput>,
}

impl Dispatched {
    /// Number of ranks `R`.
    pub fn num_ranks(&self) -> usize {
        self.ranks.len()
    }
}

/// Dispatch over all ranks at once; `inputs[r]` is rank `r`'s input, so the
/// number of ranks is `inputs.len()`. See [`RankOutput`] for what each rank
/// receives and [`Dispatched`] for the routing.
///
/// Errors (`InvalidArgument`): no ranks or more than `MAX_RANKS` (`inputs`);
/// every [`layout`] error; a `hidden_bytes` that is not a positive multiple
/// of [`HIDDEN_BYTES_ALIGNMENT`] or above `MAX_HIDDEN_BYTES`; `num_scales`
/// above `MAX_NUM_SCALES`; `expert_alignment` not in
/// `1..=MAX_EXPERT_ALIGNMENT`; `num_worst_tokens` above `MAX_RECV_TOKENS`;
/// `x`, `topk_weights` or `scales` of the wrong length; weights passed by
/// some ranks only; scales present with `num_scales == 0` or absent with
/// `num_scales > 0`; a rank receiving more than `num_worst_tokens` (when
/// positive) tokens; counts that overflow `i32`; outputs beyond
/// [`limits::reference_max_bytes`] or that cannot be allocated
/// (`num_worst_tokens`).
pub fn dispatch(inputs: &[RankInput<'_>], args: &DispatchArgs) -> Result<Dispatched> {
    dispatch_with(inputs, args, None)
}

/// [`dispatch`] of an internode job whose nodes are groups of
/// `ranks_per_node` consecutive ranks (see the module docs): the outputs
/// (`ranks`, `rank_prefix_matrix`, `args`) are exactly [`dispatch`]'s for
/// every split, and each of `layouts` is what [`layout_internode`] computes
/// (so it also carries `num_tokens_per_rdma_rank`). The handle works with
/// [`dispatch_cached`], [`combine`] and [`combine_internode`].
///
/// Errors: those of [`dispatch`], and `ranks_per_node` zero or not dividing
/// the number of ranks (`inputs.len()`).
pub fn dispatch_internode(
    inputs: &[RankInput<'_>],
    args: &DispatchArgs,
    ranks_per_node: usize,
) -> Result<Dispatched> {
    dispatch_with(inputs, args, Some(ranks_per_node))
}

/// [`dispatch`], with internode layouts when `ranks_per_node` is given.
fn dispatch_with(
    inputs: &[RankInput<'_>],
    args: &DispatchArgs,
    ranks_per_node: Option<usize>,
) -> Result<Dispatched> {
    let num_ranks = limits::check_ranks("inputs", inputs.len())?;
    if let Some(rpn) = ranks_per_node {
        check_ranks_per_node(rpn, num_ranks)?;
    }
    let experts_per_rank = limits::experts_per_rank(args.num_experts, num_ranks)?;
    limits::check_topk("num_topk", args.num_topk)?;
    limits::check_row_bytes("hidden_bytes", args.hidden_bytes)?;
    limits::check_range(
        "num_scales",
        args.num_scales,
        0,
        limits::MAX_NUM_SCALES,
        "scales per token",
    )?;
    limits::check_range(
        "expert_alignment",
        args.expert_alignment,
        1,
        limits::MAX_EXPERT_ALIGNMENT,
        "tokens",
    )?;
    limits::check_range(
        "num_worst_tokens",
        args.num_worst_tokens,
        0,
        limits::MAX_RECV_TOKENS,
        "rows",
    )?;
    let with_weights = inputs[0].topk_weights.is_some();
    let k = args.num_topk;
    let mut layouts = Vec::with_capacity(num_ranks);
    for (r, input) in inputs.iter().enumerate() {
        let layout = compute_layout(
            input.topk_idx,
            k,
            args.num_experts,
            num_ranks,
            ranks_per_node,
            Some(r),
        )?;
        let n = layout.num_tokens();
        check_weights(r, input.topk_weights, with_weights, n, k)?;
        check_token_data(
            r,
            n,
            input.x,
            input.scales,
            args.hidden_bytes,
            args.num_scales,
        )?;
        layouts.push(layout);
    }

    let rank_prefix_matrix = prefix_matrix(&layouts)?;
    let num_recv = |d: usize| rank_prefix_matrix[(num_ranks - 1) * num_ranks + d] as usize;
    if let Some(d) =
        (0..num_ranks).find(|&d| args.num_worst_tokens > 0 && num_recv(d) > args.num_worst_tokens)
    {
        return Err(CommError::invalid(
            "num_worst_tokens",
            format!(
                "rank {d} receives {} tokens, more than num_worst_tokens = {}",
                num_recv(d),
                args.num_worst_tokens
            ),
        ));
    }
    // Every output row: payload, scales, ids, weights, source index and rank.
    let row_bytes = args.hidden_bytes + 4 * args.num_scales + 12 * k + 8;
    let total_rows = (0..num_ranks)
        .map(|d| rows_for(num_recv(d), args.num_worst_tokens))
        .sum();
    check_budget(
        "num_worst_tokens",
        limits::mul("num_worst_tokens", total_rows, row_bytes)?,
    )?;
    let mut ranks = Vec::with_capacity(num_ranks);
    for d in 0..num_ranks {
        let num_recv = num_recv(d);
        let rows = rows_for(num_recv, args.num_worst_tokens);
        let (recv_src_rank, recv_src_idx) = routes_to(&layouts, d, rows)?;
        let (recv_x, recv_scales) = gather(
            &recv_src_rank,
            &recv_src_idx,
            |s| (inputs[s].x, inputs[s].scales),
            args.hidden_bytes,
            args.num_scales,
        )?;

        let mut recv_topk_idx = zeroed("num_worst_tokens", rows * k, -1i64)?;
        let mut recv_topk_weights = if with_weights {
            Some(zeroed("num_worst_tokens", rows * k, 0.0f32)?)
        } else {
            None
        };
        let mut counts = vec![0usize; experts_per_rank];
        let first = (d * experts_per_rank) as i64;
        let last = first + experts_per_rank as i64;
        for i in 0..num_recv {
            let (s, t) = (recv_src_rank[i] as usize, recv_src_idx[i] as usize);
            let src_row = &inputs[s].topk_idx[t * k..(t + 1) * k];
            for (c, &e) in src_row.iter().enumerate() {
                if e < first || e >= last {
                    continue;
                }
                recv_topk_idx[i * k + c] = e - first;
                if let (Some(out), Some(w)) = (&mut recv_topk_weights, inputs[s].topk_weights) {
                    out[i * k + c] = w[t * k + c];
                }
                if !src_row[..c].contains(&e) {
                    counts[(e - first) as usize] += 1;
                }
            }
        }
        let num_recv_tokens_per_expert = if args.num_worst_tokens > 0 {
            Vec::new()
        } else {
            counts
                .iter()
                .map(|&c| {
                    to_i32(
                        "expert_alignment",
                        c.div_ceil(args.expert_alignment) * args.expert_alignment,
                    )
                })
                .collect::<Result<Vec<_>>>()?
        };
        ranks.push(RankOutput {
            num_recv_tokens: num_recv,
            recv_x,
            recv_scales,
            recv_topk_idx,
            recv_topk_weights,
            recv_src_idx,
            recv_src_rank,
            num_recv_tokens_per_expert,
        });
    }
    Ok(Dispatched {
        args: *args,
        layouts,
        rank_prefix_matrix,
        ranks,
    })
}

/// One source rank's token data for [`dispatch_cached`].
#[derive(Debug, Clone, Copy)]
pub struct TokenData<'a> {
    /// `[N, hidden_bytes]` token payloads.
    pub x: &'a [u8],
    /// `[N, num_scales]`; `Some` iff `num_scales > 0`.
    pub scales: Option<&'a [f32]>,
}

/// What one destination rank receives from [`dispatch_cached`].
#[derive(Debug, Clone, PartialEq)]
pub struct CachedOutput {
    /// `[rows, hidden_bytes]`, rows and order as in the handle's [`RankOutput`].
    pub recv_x: Vec<u8>,
    /// `[rows, num_scales]` when dispatched with scales.
    pub recv_scales: Option<Vec<f32>>,
}

/// Cached dispatch (`dispatch(x, handle=...)`): moves new token data along the
/// routing of an earlier [`dispatch`]. Row `i` of rank `d`'s output is the new
/// row of token `recv_src_idx[i]` of rank `recv_src_rank[i]`, exactly where
/// the original dispatch put that token; the row count (padding included) is
/// the handle's. `hidden_bytes` and `num_scales` may differ from the original
/// dispatch; `N_r` must not.
///
/// Errors (`InvalidArgument`): `inputs.len()` different from the handle's
/// number of ranks; a bad `hidden_bytes` or `num_scales`; `x` / `scales` of
/// the wrong length; scales present with `num_scales == 0` or absent with
/// `num_scales > 0`; outputs beyond [`limits::reference_max_bytes`].
pub fn dispatch_cached(
    handle: &Dispatched,
    inputs: &[TokenData<'_>],
    hidden_bytes: usize,
    num_scales: usize,
) -> Result<Vec<CachedOutput>> {
    check_rank_count(inputs.len(), handle.num_ranks())?;
    limits::check_row_bytes("hidden_bytes", hidden_bytes)?;
    limits::check_range(
        "num_scales",
        num_scales,
        0,
        limits::MAX_NUM_SCALES,
        "scales per token",
    )?;
    for (r, input) in inputs.iter().enumerate() {
        let n = handle.layouts[r].num_tokens();
        check_token_data(r, n, input.x, input.scales, hidden_bytes, num_scales)?;
    }
    let rows: usize = handle.ranks.iter().map(RankOutput::num_rows).sum();
    check_budget(
        "hidden_bytes",
        limits::mul("hidden_bytes", rows, hidden_bytes + 4 * num_scales)?,
    )?;
    handle
        .ranks
        .iter()
        .map(|out| {
            let (recv_x, recv_scales) = gather(
                &out.recv_src_rank,
                &out.recv_src_idx,
                |s| (inputs[s].x, inputs[s].scales),
                hidden_bytes,
                num_scales,
            )?;
            Ok(CachedOutput {
                recv_x,
                recv_scales,
            })
        })
        .collect()
}

/// One rank's combine inputs. The rank plays two roles: `y` and
/// `topk_weights` are what it returns for the rows it received; `bias` belongs
/// to the tokens it sent (its own `N` tokens).
#[derive(Debug, Clone, Copy, Default)]
pub struct CombineInput<'a> {
    /// `[rows, hidden]`: the expert outputs for the received rows, as f32
    /// values (convert the GPU's bf16 exactly with [`bf16_bits_to_f32`]).
    /// `rows` is the dispatch's (padding included); padding rows are ignored.
    pub y: &'a [f32],
    /// `[rows, K]`, or `None`; either every rank passes them or none does.
    /// Padding rows are ignored.
    pub topk_weights: Option<&'a [f32]>,
    /// Up to two `[N, hidden]` biases of this rank's own tokens (`bias=None`,
    /// one tensor, or a pair), as f32 values. An absent bias reads as zeros.
    pub bias: [Option<&'a [f32]>; 2],
}

/// Combine result for one source rank, from [`combine`] or
/// [`combine_internode`] (which groups the same copies per node first, see
/// its docs; the rest of this description is [`combine`]'s).
#[derive(Debug, Clone, PartialEq)]
pub struct CombineOutput {
    /// `[N, hidden]`, f32 before the GPU's final bf16 store: for token `t`,
    /// `(bias0[t] + bias1[t]) + y_{d0}[row] + y_{d1}[row] + ...` summed in f32
    /// left to right, over the destination ranks `d0 < d1 < ...` that
    /// received `t`, `row` being where `t` landed on each. A token sent
    /// nowhere is `bias0[t] + bias1[t]` (zeros without bias). Compare with
    /// the GPU through [`round_to_bf16`] (see the module docs on tolerances).
    pub combined_x: Vec<f32>,
    /// `[N, K]` when weights were passed: `0.0 + w_{d0}[row, k] + w_{d1}[row, k]
    /// + ...` over the same ranks and order. With the unmodified
    /// `recv_topk_weights` this rebuilds the original weight at every `k`
    /// whose id is not `-1` (each kept weight arrives from exactly one rank,
    /// the others contribute `0.0`), and is `0.0` at `-1` columns.
    pub combined_topk_weights: Option<Vec<f32>>,
}

/// Combine over all ranks at once: every original token gets the plain
/// (unweighted) f32 sum of the rows returned for it by the ranks it was
/// dispatched to, plus its biases; see [`CombineOutput`] for the exact order.
/// This is the model of the intranode kernels (one node); the internode one
/// is [`combine_internode`]. `inputs[r]` is rank `r`'s input; `hidden` is the
/// number of elements per row (bf16 on the GPU, so `2 * hidden` must be a
/// positive multiple of [`HIDDEN_BYTES_ALIGNMENT`]).
///
/// Errors (`InvalidArgument`): `inputs.len()` different from the handle's
/// number of ranks; a bad `hidden` (bf16 rows of `2 * hidden` bytes as
/// [`limits::check_row_bytes`] requires); `y`, `topk_weights` or a bias of
/// the wrong length; weights passed by some ranks only; outputs beyond
/// [`limits::reference_max_bytes`]; a `handle` whose fields disagree (one
/// not made by [`dispatch`] / [`dispatch_internode`]).
pub fn combine(
    handle: &Dispatched,
    inputs: &[CombineInput<'_>],
    hidden: usize,
) -> Result<Vec<CombineOutput>> {
    combine_with(handle, inputs, hidden, None)
}

/// Combine as the internode kernels reduce, for nodes of `ranks_per_node`
/// consecutive ranks (see "Internode combine model" in the module docs): per
/// token, each node's copies are summed in f32 from `+0.0` in ascending rank
/// order and rounded to bf16, then `(bias0 + bias1)` and those partials, in
/// ascending node order, are summed in f32. `combined_x` is that last f32 sum
/// (before the GPU's bf16 store: compare through [`round_to_bf16`]);
/// `combined_topk_weights` the same two-level f32 sum of the weights, without
/// rounding. The handle may come from [`dispatch`] or [`dispatch_internode`]
/// (their routing is the same); the other arguments are [`combine`]'s.
///
/// Errors: those of [`combine`], and `ranks_per_node` zero or not dividing
/// the handle's number of ranks.
pub fn combine_internode(
    handle: &Dispatched,
    inputs: &[CombineInput<'_>],
    hidden: usize,
    ranks_per_node: usize,
) -> Result<Vec<CombineOutput>> {
    check_ranks_per_node(ranks_per_node, handle.num_ranks())?;
    combine_with(handle, inputs, hidden, Some(ranks_per_node))
}

/// [`combine`] (`ranks_per_node` `None`) or [`combine_internode`].
fn combine_with(
    handle: &Dispatched,
    inputs: &[CombineInput<'_>],
    hidden: usize,
    ranks_per_node: Option<usize>,
) -> Result<Vec<CombineOutput>> {
    check_handle(handle)?;
    let num_ranks = handle.num_ranks();
    check_rank_count(inputs.len(), num_ranks)?;
    limits::check_multiple(
        "hidden",
        hidden,
        HIDDEN_BYTES_ALIGNMENT / 2,
        limits::MAX_HIDDEN_BYTES / 2,
        "bf16 elements per row",
    )?;
    let k = handle.args.num_topk;
    let with_weights = inputs[0].topk_weights.is_some();
    for (r, input) in inputs.iter().enumerate() {
        let rows = handle.ranks[r].num_rows();
        let n = handle.layouts[r].num_tokens();
        check_len("y", r, input.y.len(), rows, hidden)?;
        check_weights(r, input.topk_weights, with_weights, rows, k)?;
        for b in input.bias.iter().flatten() {
            check_len("bias", r, b.len(), n, hidden)?;
        }
    }

    let tokens: usize = handle.layouts.iter().map(Layout::num_tokens).sum();
    check_budget("hidden", limits::mul("hidden", tokens, 4 * (hidden + k))?)?;
    let mut outputs: Vec<CombineOutput> = handle
        .layouts
        .iter()
        .map(|layout| {
            let n = layout.num_tokens();
            Ok(CombineOutput {
                combined_x: zeroed("hidden", n * hidden, 0.0f32)?,
                combined_topk_weights: if with_weights {
                    Some(zeroed("topk_weights", n * k, 0.0f32)?)
                } else {
                    None
                },
            })
        })
        .collect::<Result<_>>()?;
    // One node's partial sums (internode only).
    let mut partial = vec![0.0f32; hidden];
    let mut partial_w = vec![0.0f32; k];
    let y_row = |d: usize, row: usize| &inputs[d].y[row * hidden..(row + 1) * hidden];
    let w_row = |d: usize, row: usize| inputs[d].topk_weights.map(|w| &w[row * k..(row + 1) * k]);
    for_each_token(handle, |s, t, copies| {
        let out = &mut outputs[s];
        let acc = &mut out.combined_x[t * hidden..(t + 1) * hidden];
        let bias = inputs[s].bias;
        for (h, a) in acc.iter_mut().enumerate() {
            let i = t * hidden + h;
            *a = bias[0].map_or(0.0, |b| b[i]) + bias[1].map_or(0.0, |b| b[i]);
        }
        let mut acc_w = out
            .combined_topk_weights
            .as_mut()
            .map(|w| &mut w[t * k..(t + 1) * k]);
        match ranks_per_node {
            // Intranode: every copy straight onto the biases, ranks ascending.
            None => {
                for &(d, row) in copies {
                    add_to(acc, y_row(d, row));
                    if let (Some(acc_w), Some(w)) = (&mut acc_w, w_row(d, row)) {
                        add_to(acc_w, w);
                    }
                }
            }
            // Internode: one rounded partial per node, nodes ascending.
            Some(rpn) => {
                for node in copies.chunk_by(|a, b| a.0 / rpn == b.0 / rpn) {
                    partial.fill(0.0);
                    partial_w.fill(0.0);
                    for &(d, row) in node {
                        add_to(&mut partial, y_row(d, row));
                        if let Some(w) = w_row(d, row) {
                            add_to(&mut partial_w, w);
                        }
                    }
                    for (a, &p) in acc.iter_mut().zip(&partial) {
                        *a += round_to_bf16(p);
                    }
                    if let Some(acc_w) = &mut acc_w {
                        add_to(acc_w, &partial_w);
                    }
                }
            }
        }
    })?;
    Ok(outputs)
}

/// bf16 bits of `x` rounded to nearest, ties to even (torch's
/// `float -> bfloat16` conversion and CUDA's `__float2bfloat16_rn`). Values
/// beyond the largest bf16 round to infinity; every NaN becomes the quiet NaN
/// `0x7FC0` (torch's choice).
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    if x.is_nan() {
        return 0x7FC0;
    }
    let bits = x.to_bits();
    // Cannot overflow for a non-NaN: the largest magnitude is infinity,
    // 0x7F80_0000 (or 0xFF80_0000), plus at most 0x8000.
    let rounding = 0x7FFF + ((bits >> 16) & 1);
    ((bits + rounding) >> 16) as u16
}

/// The f32 value of bf16 `bits` (exact).
pub fn bf16_bits_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// `x` rounded to bf16 and back: the value a GPU bf16 store of `x` holds.
pub fn round_to_bf16(x: f32) -> f32 {
    bf16_bits_to_f32(f32_to_bf16_bits(x))
}

/// Distance between `round_to_bf16(a)` and `round_to_bf16(b)` in bf16 ulps
/// (the number of bf16 values stepped over, counting across zero, with
/// `+0 == -0`). Equal infinities are 0 apart; a NaN on either side is
/// `u32::MAX`.
pub fn bf16_ulp_distance(a: f32, b: f32) -> u32 {
    if a.is_nan() || b.is_nan() {
        return u32::MAX;
    }
    // Map bf16 bits onto a line where adjacent values differ by one.
    let ordinal = |x: f32| -> i32 {
        let bits = i32::from(f32_to_bf16_bits(x));
        if bits & 0x8000 != 0 {
            -(bits & 0x7FFF)
        } else {
            bits
        }
    };
    ordinal(a).abs_diff(ordinal(b))
}

// ---- internals --------------------------------------------------------------

/// `ranks_per_node` splits `num_ranks` ranks into whole nodes.
fn check_ranks_per_node(ranks_per_node: usize, num_ranks: usize) -> Result<()> {
    if ranks_per_node == 0 || num_ranks % ranks_per_node != 0 {
        return Err(CommError::invalid(
            "ranks_per_node",
            format!("{ranks_per_node} ranks per node does not divide {num_ranks} ranks"),
        ));
    }
    Ok(())
}

/// The shapes a combine relies on: `1..=MAX_RANKS` ranks, one layout and one
/// output per rank, each layout of that many ranks, a valid `num_topk`.
fn check_handle(handle: &Dispatched) -> Result<()> {
    let num_ranks = limits::check_ranks("handle", handle.num_ranks())?;
    limits::check_topk("handle", handle.args.num_topk)?;
    if handle.layouts.len() != num_ranks
        || handle.layouts.iter().any(|l| l.num_ranks() != num_ranks)
    {
        return Err(CommError::invalid(
            "handle",
            format!("layouts do not describe its {num_ranks} ranks"),
        ));
    }
    Ok(())
}

/// `acc[i] += v[i]` in f32, element by element.
fn add_to(acc: &mut [f32], v: &[f32]) {
    for (a, &x) in acc.iter_mut().zip(v) {
        *a += x;
    }
}

/// Calls `f(s, t, copies)` for every token `t` of every source rank `s` (in
/// that order), `copies` being the `(destination rank, row)` pairs where the
/// token landed, destination ranks ascending (empty for a token sent
/// nowhere). Rows come from the dispatch order (source rank, then token
/// index, on every destination) and are checked against the handle's
/// `recv_src_rank` / `recv_src_idx`, so a handle whose fields disagree is an
/// error, not a panic. Needs [`check_handle`].
fn for_each_token(
    handle: &Dispatched,
    mut f: impl FnMut(usize, usize, &[(usize, usize)]),
) -> Result<()> {
    let num_ranks = handle.num_ranks();
    let mut next_row = vec![0usize; num_ranks];
    let mut copies = Vec::with_capacity(num_ranks);
    let mismatch = |d: usize, why: String| {
        CommError::invalid("handle", format!("rank {d}'s received rows: {why}"))
    };
    for (s, layout) in handle.layouts.iter().enumerate() {
        for t in 0..layout.num_tokens() {
            copies.clear();
            let in_rank = &layout.is_token_in_rank[t * num_ranks..(t + 1) * num_ranks];
            for (d, out) in handle.ranks.iter().enumerate() {
                if !in_rank[d] {
                    continue;
                }
                let row = next_row[d];
                let src = (out.recv_src_rank.get(row), out.recv_src_idx.get(row));
                if row >= out.num_recv_tokens || src != (Some(&(s as i32)), Some(&(t as i32))) {
                    return Err(mismatch(
                        d,
                        format!("row {row} should be token {t} of rank {s}"),
                    ));
                }
                next_row[d] += 1;
                copies.push((d, row));
            }
            f(s, t, &copies);
        }
    }
    if let Some(d) = (0..num_ranks).find(|&d| next_row[d] != handle.ranks[d].num_recv_tokens) {
        return Err(mismatch(
            d,
            format!(
                "{} received, but the layouts send it {}",
                handle.ranks[d].num_recv_tokens, next_row[d]
            ),
        ));
    }
    Ok(())
}

fn check_rank_count(got: usize, want: usize) -> Result<()> {
    if got != want {
        return Err(CommError::invalid(
            "inputs",
            format!("{got} rank inputs for a handle of {want} ranks"),
        ));
    }
    Ok(())
}

/// Checks rank `r`'s `topk_weights`: given iff rank 0's are (`with_weights`),
/// and then `[rows, k]`.
fn check_weights(
    r: usize,
    weights: Option<&[f32]>,
    with_weights: bool,
    rows: usize,
    k: usize,
) -> Result<()> {
    match weights {
        Some(_) if !with_weights => Err(CommError::invalid(
            "topk_weights",
            format!("rank {r} passes weights but rank 0 does not"),
        )),
        None if with_weights => Err(CommError::invalid(
            "topk_weights",
            format!("rank 0 passes weights but rank {r} does not"),
        )),
        Some(w) => check_len("topk_weights", r, w.len(), rows, k),
        None => Ok(()),
    }
}

/// The number of tokens `N` of `[N, num_topk]` `topk_idx`, after checking it
/// in the order both dispatches report: a whole number of rows, at most
/// `max_tokens` of them (else the error `too_many(N)`, whose argument and
/// wording differ between the calls), and every id within `-1 ..= E - 1`.
/// `whose` starts each message ("rank 3: ", or empty for a lone layout).
pub(crate) fn check_topk_rows(
    topk_idx: &[i64],
    num_topk: usize,
    num_experts: usize,
    whose: &str,
    max_tokens: usize,
    too_many: impl FnOnce(usize) -> CommError,
) -> Result<usize> {
    if topk_idx.len() % num_topk != 0 {
        return Err(CommError::invalid(
            "topk_idx",
            format!(
                "{whose}{} ids is not a whole number of rows of {num_topk}",
                topk_idx.len()
            ),
        ));
    }
    let n = topk_idx.len() / num_topk;
    if n > max_tokens {
        return Err(too_many(n));
    }
    if let Some(pos) = topk_idx
        .iter()
        .position(|&e| e < -1 || e >= num_experts as i64)
    {
        return Err(CommError::invalid(
            "topk_idx",
            format!(
                "{whose}token {} column {} has expert id {}, outside -1..={}",
                pos / num_topk,
                pos % num_topk,
                topk_idx[pos],
                num_experts - 1
            ),
        ));
    }
    Ok(n)
}

/// `len == rows * cols` for matrix `name` of rank `rank`.
pub(crate) fn check_len(
    name: &'static str,
    rank: usize,
    len: usize,
    rows: usize,
    cols: usize,
) -> Result<()> {
    if rows.checked_mul(cols) != Some(len) {
        return Err(CommError::invalid(
            name,
            format!("rank {rank}: {len} elements, expected [{rows}, {cols}]"),
        ));
    }
    Ok(())
}

fn check_token_data(
    rank: usize,
    n: usize,
    x: &[u8],
    scales: Option<&[f32]>,
    hidden_bytes: usize,
    num_scales: usize,
) -> Result<()> {
    check_len("x", rank, x.len(), n, hidden_bytes)?;
    match (scales, num_scales) {
        (Some(_), 0) => Err(CommError::invalid(
            "scales",
            format!("rank {rank} passes scales but num_scales is 0"),
        )),
        (None, ns) if ns > 0 => Err(CommError::invalid(
            "scales",
            format!("num_scales is {ns} but rank {rank} passes no scales"),
        )),
        (Some(s), ns) => check_len("scales", rank, s.len(), n, ns),
        (None, _) => Ok(()),
    }
}

fn to_i32(name: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| CommError::invalid(name, format!("count {v} overflows int32")))
}

fn rows_for(num_recv: usize, num_worst_tokens: usize) -> usize {
    if num_worst_tokens > 0 {
        num_worst_tokens
    } else {
        num_recv
    }
}

/// `rank` is the source rank for error messages (`None` for a lone layout).
fn compute_layout(
    topk_idx: &[i64],
    num_topk: usize,
    num_experts: usize,
    num_ranks: usize,
    ranks_per_node: Option<usize>,
    rank: Option<usize>,
) -> Result<Layout> {
    limits::check_ranks("num_ranks", num_ranks)?;
    let experts_per_rank = limits::experts_per_rank(num_experts, num_ranks)?;
    limits::check_topk("num_topk", num_topk)?;
    let whose = rank.map_or_else(String::new, |r| format!("rank {r}: "));
    let max = limits::MAX_TOKENS_PER_RANK;
    let n = check_topk_rows(topk_idx, num_topk, num_experts, &whose, max, |n| {
        CommError::invalid("topk_idx", format!("{whose}{n} tokens, more than {max}"))
    })?;

    let mut num_tokens_per_rank = vec![0i32; num_ranks];
    let mut num_tokens_per_expert = vec![0i32; num_experts];
    let mut is_token_in_rank = vec![false; n * num_ranks];
    let mut num_tokens_per_rdma_rank = ranks_per_node.map(|rpn| vec![0i32; num_ranks / rpn]);
    for (t, row) in topk_idx.chunks_exact(num_topk).enumerate() {
        let in_rank = &mut is_token_in_rank[t * num_ranks..(t + 1) * num_ranks];
        for (c, &e) in row.iter().enumerate() {
            if e < 0 || row[..c].contains(&e) {
                continue;
            }
            num_tokens_per_expert[e as usize] += 1;
            in_rank[e as usize / experts_per_rank] = true;
        }
        for (count, &hit) in num_tokens_per_rank.iter_mut().zip(in_rank.iter()) {
            *count += i32::from(hit);
        }
        if let (Some(per_node), Some(rpn)) = (&mut num_tokens_per_rdma_rank, ranks_per_node) {
            for (count, node) in per_node.iter_mut().zip(in_rank.chunks_exact(rpn)) {
                *count += i32::from(node.contains(&true));
            }
        }
    }
    Ok(Layout {
        num_tokens_per_rank,
        num_tokens_per_rdma_rank,
        num_tokens_per_expert,
        is_token_in_rank,
    })
}

/// `[R, R]` cumulative send counts (see [`Dispatched::rank_prefix_matrix`]).
fn prefix_matrix(layouts: &[Layout]) -> Result<Vec<i32>> {
    let r = layouts.len();
    let mut m = vec![0i32; r * r];
    for (i, layout) in layouts.iter().enumerate() {
        for j in 0..r {
            let before = if i == 0 { 0 } else { m[(i - 1) * r + j] };
            m[i * r + j] = before
                .checked_add(layout.num_tokens_per_rank[j])
                .ok_or_else(|| {
                    CommError::invalid("topk_idx", format!("rank {j} receives over int32 tokens"))
                })?;
        }
    }
    Ok(m)
}

/// Source (rank, index) of each row received by `dest`, in order, padded to
/// `rows` (at least the received tokens) with -1.
fn routes_to(layouts: &[Layout], dest: usize, rows: usize) -> Result<(Vec<i32>, Vec<i32>)> {
    let mut src_rank = zeroed("num_worst_tokens", rows, -1)?;
    let mut src_idx = zeroed("num_worst_tokens", rows, -1)?;
    let received = layouts.iter().enumerate().flat_map(|(s, layout)| {
        (0..layout.num_tokens())
            .filter(move |&t| layout.token_in_rank(t, dest))
            .map(move |t| (s as i32, t as i32))
    });
    for ((rank, idx), (s, t)) in src_rank.iter_mut().zip(src_idx.iter_mut()).zip(received) {
        (*rank, *idx) = (s, t);
    }
    Ok((src_rank, src_idx))
}

/// Copies the source rows named by `src_rank` / `src_idx` (`-1` = padding,
/// left zero).
fn gather<'a>(
    src_rank: &[i32],
    src_idx: &[i32],
    data: impl Fn(usize) -> (&'a [u8], Option<&'a [f32]>),
    hidden_bytes: usize,
    num_scales: usize,
) -> Result<(Vec<u8>, Option<Vec<f32>>)> {
    let rows = src_rank.len();
    let mut x = zeroed("num_worst_tokens", rows * hidden_bytes, 0u8)?;
    let mut scales = if num_scales > 0 {
        Some(zeroed("num_worst_tokens", rows * num_scales, 0.0f32)?)
    } else {
        None
    };
    for (i, (&s, &t)) in src_rank.iter().zip(src_idx).enumerate() {
        if s < 0 {
            continue;
        }
        let (sx, ss) = data(s as usize);
        let t = t as usize;
        x[i * hidden_bytes..(i + 1) * hidden_bytes]
            .copy_from_slice(&sx[t * hidden_bytes..(t + 1) * hidden_bytes]);
        if let (Some(out), Some(ss)) = (&mut scales, ss) {
            out[i * num_scales..(i + 1) * num_scales]
                .copy_from_slice(&ss[t * num_scales..(t + 1) * num_scales]);
        }
    }
    Ok((x, scales))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{assert_invalid, bits};
    use rand::rngs::StdRng;
    use rand::Rng;
    use std::collections::HashMap;

    // ---- helpers ------------------------------------------------------------

    /// Seeds the random tests (base 0x5EED_0001; `MOELINK_REFERENCE_SEED` overrides it).
    fn with_seed(what: &str, offset: u64, f: impl FnOnce(&mut StdRng)) {
        crate::test_support::with_seed(what, 0x5EED_0001, offset, f)
    }

    fn f32s_to_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|f| f.to_ne_bytes()).collect()
    }

    fn bytes_to_f32s(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(4)
            .map(|c| f32::from_ne_bytes(c.try_into().unwrap()))
            .collect()
    }

    impl<'a> RankInput<'a> {
        /// Test shortcut: ids and payloads only, no weights or scales.
        fn bare(topk_idx: &'a [i64], x: &'a [u8]) -> Self {
            RankInput {
                topk_idx,
                topk_weights: None,
                x,
                scales: None,
            }
        }
    }

    // ---- the hand-computed case ---------------------------------------------
    //
    // 2 ranks, 4 experts (rank 0: experts 0 and 1, rank 1: experts 2 and 3), K = 2.
    //   rank 0: t0 [0, 3] -> both ranks     t1 [1, 0] -> rank 0 once (same rank twice)
    //           t2 [-1, -1] -> nowhere      t3 [2, -1] -> rank 1
    //   rank 1: t0 [3, 2] -> rank 1 once    t1 [-1, 1] -> rank 0
    //           t2 [0, 2] -> both ranks

    const HAND_HIDDEN_BYTES: usize = 128;
    const HAND_TOPK: [&[i64]; 2] = [&[0, 3, 1, 0, -1, -1, 2, -1], &[3, 2, -1, 1, 0, 2]];
    const HAND_WEIGHTS: [&[f32]; 2] = [
        &[0.5, 0.25, 0.75, 0.125, 1.0, 2.0, 0.0625, 3.0],
        &[1.5, 2.5, 4.0, 0.375, 0.875, 0.0078125],
    ];

    /// Token `t` of rank `r` is `HAND_HIDDEN_BYTES` bytes of value `16 r + t + 1`.
    fn hand_x(r: usize) -> Vec<u8> {
        let n = HAND_TOPK[r].len() / 2;
        (0..n)
            .flat_map(|t| vec![(16 * r + t + 1) as u8; HAND_HIDDEN_BYTES])
            .collect()
    }

    /// One scale per token: `100 r + t`.
    fn hand_scales(r: usize) -> Vec<f32> {
        let n = HAND_TOPK[r].len() / 2;
        (0..n).map(|t| (100 * r + t) as f32).collect()
    }

    fn hand_dispatch(args: DispatchArgs) -> Result<Dispatched> {
        let x = [hand_x(0), hand_x(1)];
        let scales = [hand_scales(0), hand_scales(1)];
        let inputs: Vec<RankInput> = (0..2)
            .map(|r| RankInput {
                topk_idx: HAND_TOPK[r],
                topk_weights: Some(HAND_WEIGHTS[r]),
                x: &x[r],
                scales: Some(&scales[r]),
            })
            .collect();
        dispatch(&inputs, &args)
    }

    fn hand_args() -> DispatchArgs {
        DispatchArgs {
            num_scales: 1,
            ..DispatchArgs::new(4, 2, HAND_HIDDEN_BYTES)
        }
    }

    /// Row bytes of the tokens `(src rank, src idx)`.
    fn rows_of(tokens: &[(usize, usize)]) -> Vec<u8> {
        tokens
            .iter()
            .flat_map(|&(r, t)| vec![(16 * r + t + 1) as u8; HAND_HIDDEN_BYTES])
            .collect()
    }

    #[test]
    fn hand_layout() {
        let l0 = layout(HAND_TOPK[0], 2, 4, 2).unwrap();
        assert_eq!(l0.num_tokens_per_rank, [2, 2]);
        assert_eq!(l0.num_tokens_per_rdma_rank, None);
        assert_eq!(l0.num_tokens_per_expert, [2, 1, 1, 1]);
        assert_eq!(
            l0.is_token_in_rank,
            [true, true, true, false, false, false, false, true]
        );
        assert_eq!((l0.num_ranks(), l0.num_tokens()), (2, 4));
        assert!(l0.token_in_rank(3, 1) && !l0.token_in_rank(3, 0));

        let l1 = layout(HAND_TOPK[1], 2, 4, 2).unwrap();
        assert_eq!(l1.num_tokens_per_rank, [2, 2]);
        assert_eq!(l1.num_tokens_per_expert, [1, 1, 2, 1]);
        assert_eq!(l1.is_token_in_rank, [false, true, true, false, true, true]);
    }

    #[test]
    fn hand_layout_internode() {
        // 4 ranks in 2 nodes of 2, 8 experts (2 per rank, 4 per node).
        let topk = [
            0, 1, // rank 0 twice: rank 0, node 0
            0, 2, // ranks 0 and 1, both node 0: counted once per node
            1, 7, // ranks 0 and 3: nodes 0 and 1
            -1, -1, // nowhere
            5, 6, // ranks 2 and 3: node 1 once
        ];
        let l = layout_internode(&topk, 2, 8, 4, 2).unwrap();
        assert_eq!(l.num_tokens_per_rank, [3, 1, 1, 2]);
        assert_eq!(l.num_tokens_per_rdma_rank, Some(vec![3, 2]));
        assert_eq!(l.num_tokens_per_expert, [2, 2, 1, 0, 0, 1, 1, 1]);
        // One node of all ranks: still Some, one entry.
        let l = layout_internode(&topk, 2, 8, 4, 4).unwrap();
        assert_eq!(l.num_tokens_per_rdma_rank, Some(vec![4]));
        // One rank per node: the per-node counts are the per-rank ones.
        let l = layout_internode(&topk, 2, 8, 4, 1).unwrap();
        assert_eq!(l.num_tokens_per_rdma_rank, Some(vec![3, 1, 1, 2]));
    }

    #[test]
    fn hand_dispatch_every_field() {
        let d = hand_dispatch(hand_args()).unwrap();
        assert_eq!(d.num_ranks(), 2);
        assert_eq!(d.rank_prefix_matrix, [2, 2, 4, 4]);
        assert_eq!(d.layouts[0], layout(HAND_TOPK[0], 2, 4, 2).unwrap());
        assert_eq!(d.layouts[1], layout(HAND_TOPK[1], 2, 4, 2).unwrap());

        let o = &d.ranks[0];
        assert_eq!(o.num_recv_tokens, 4);
        assert_eq!(o.num_rows(), 4);
        assert_eq!(o.recv_src_rank, [0, 0, 1, 1]);
        assert_eq!(o.recv_src_idx, [0, 1, 1, 2]);
        assert_eq!(o.recv_x, rows_of(&[(0, 0), (0, 1), (1, 1), (1, 2)]));
        assert_eq!(o.recv_scales, Some(vec![0.0, 1.0, 101.0, 102.0]));
        assert_eq!(o.recv_topk_idx, [0, -1, 1, 0, -1, 1, 0, -1]);
        assert_eq!(
            o.recv_topk_weights,
            Some(vec![0.5, 0.0, 0.75, 0.125, 0.0, 0.375, 0.875, 0.0])
        );
        // expert 0: r0t0, r0t1, r1t2; expert 1: r0t1, r1t1.
        assert_eq!(o.num_recv_tokens_per_expert, [3, 2]);

        let o = &d.ranks[1];
        assert_eq!(o.num_recv_tokens, 4);
        assert_eq!(o.recv_src_rank, [0, 0, 1, 1]);
        assert_eq!(o.recv_src_idx, [0, 3, 0, 2]);
        assert_eq!(o.recv_x, rows_of(&[(0, 0), (0, 3), (1, 0), (1, 2)]));
        assert_eq!(o.recv_scales, Some(vec![0.0, 3.0, 100.0, 102.0]));
        assert_eq!(o.recv_topk_idx, [-1, 1, 0, -1, 1, 0, -1, 0]);
        assert_eq!(
            o.recv_topk_weights,
            Some(vec![0.0, 0.25, 0.0625, 0.0, 1.5, 2.5, 0.0, 0.0078125])
        );
        // expert 2: r0t3, r1t0, r1t2; expert 3: r0t0, r1t0.
        assert_eq!(o.num_recv_tokens_per_expert, [3, 2]);
    }

    #[test]
    fn hand_dispatch_without_weights_or_scales() {
        let x = [hand_x(0), hand_x(1)];
        let inputs: Vec<RankInput> = (0..2)
            .map(|r| RankInput::bare(HAND_TOPK[r], &x[r]))
            .collect();
        let d = dispatch(&inputs, &DispatchArgs::new(4, 2, HAND_HIDDEN_BYTES)).unwrap();
        let full = hand_dispatch(hand_args()).unwrap();
        for (o, f) in d.ranks.iter().zip(&full.ranks) {
            assert_eq!(o.recv_topk_weights, None);
            assert_eq!(o.recv_scales, None);
            assert_eq!(o.recv_x, f.recv_x);
            assert_eq!(o.recv_topk_idx, f.recv_topk_idx);
            assert_eq!(o.recv_src_idx, f.recv_src_idx);
        }
    }

    #[test]
    fn hand_expert_alignment() {
        let d = hand_dispatch(DispatchArgs {
            expert_alignment: 4,
            ..hand_args()
        })
        .unwrap();
        assert_eq!(d.ranks[0].num_recv_tokens_per_expert, [4, 4]);
        assert_eq!(d.ranks[1].num_recv_tokens_per_expert, [4, 4]);
        let d = hand_dispatch(DispatchArgs {
            expert_alignment: 2,
            ..hand_args()
        })
        .unwrap();
        assert_eq!(d.ranks[0].num_recv_tokens_per_expert, [4, 2]);
        let d = hand_dispatch(DispatchArgs {
            expert_alignment: 3,
            ..hand_args()
        })
        .unwrap();
        assert_eq!(d.ranks[1].num_recv_tokens_per_expert, [3, 3]);
        // An expert nobody routes to stays 0 whatever the alignment.
        let x = vec![0u8; 128];
        let d = dispatch(
            &[RankInput::bare(&[1], &x)],
            &DispatchArgs {
                expert_alignment: 128,
                ..DispatchArgs::new(2, 1, 128)
            },
        )
        .unwrap();
        assert_eq!(d.ranks[0].num_recv_tokens_per_expert, [0, 128]);
    }

    #[test]
    fn hand_num_worst_tokens() {
        let d = hand_dispatch(DispatchArgs {
            num_worst_tokens: 6,
            expert_alignment: 4,
            ..hand_args()
        })
        .unwrap();
        let unpadded = hand_dispatch(hand_args()).unwrap();
        assert_eq!(d.rank_prefix_matrix, unpadded.rank_prefix_matrix);
        for (o, u) in d.ranks.iter().zip(&unpadded.ranks) {
            assert_eq!(o.num_recv_tokens, 4);
            assert_eq!(o.num_rows(), 6);
            assert!(o.num_recv_tokens_per_expert.is_empty());
            assert_eq!(o.recv_x.len(), 6 * HAND_HIDDEN_BYTES);
            assert_eq!(o.recv_x[..4 * HAND_HIDDEN_BYTES], u.recv_x[..]);
            assert_eq!(o.recv_topk_idx[..8], u.recv_topk_idx[..]);
            assert_eq!(o.recv_topk_idx[8..], [-1; 4]);
            let w = o.recv_topk_weights.as_ref().unwrap();
            assert_eq!(w[..8], u.recv_topk_weights.as_ref().unwrap()[..]);
            assert_eq!(w[8..], [0.0; 4]);
            assert_eq!(o.recv_scales.as_ref().unwrap().len(), 6);
            assert_eq!(o.recv_src_idx[..4], u.recv_src_idx[..]);
            assert_eq!(o.recv_src_idx[4..], [-1, -1]);
            assert_eq!(o.recv_src_rank[4..], [-1, -1]);
        }
        // Exactly the received count is enough.
        let d = hand_dispatch(DispatchArgs {
            num_worst_tokens: 4,
            ..hand_args()
        })
        .unwrap();
        assert_eq!(d.ranks[0].num_rows(), 4);
        // One short is an error.
        assert_invalid(
            hand_dispatch(DispatchArgs {
                num_worst_tokens: 3,
                ..hand_args()
            }),
            "num_worst_tokens",
        );
    }

    /// `y` of destination `d`: row `i` is all `10 d + i + 1`.
    fn hand_y(d: usize, rows: usize, hidden: usize) -> Vec<f32> {
        (0..rows)
            .flat_map(|i| vec![(10 * d + i + 1) as f32; hidden])
            .collect()
    }

    #[test]
    fn hand_combine() {
        const HIDDEN: usize = 64;
        let d = hand_dispatch(hand_args()).unwrap();
        let y = [hand_y(0, 4, HIDDEN), hand_y(1, 4, HIDDEN)];
        let inputs: Vec<CombineInput> = (0..2)
            .map(|r| CombineInput {
                y: &y[r],
                topk_weights: d.ranks[r].recv_topk_weights.as_deref(),
                bias: [None, None],
            })
            .collect();
        let out = combine(&d, &inputs, HIDDEN).unwrap();
        let per_token = |o: &CombineOutput| -> Vec<f32> {
            o.combined_x
                .chunks_exact(HIDDEN)
                .map(|row| {
                    assert!(row.iter().all(|&v| v == row[0]));
                    row[0]
                })
                .collect()
        };
        // rank 0: t0 = d0 row 0 + d1 row 0; t1 = d0 row 1; t2 nowhere; t3 = d1 row 1.
        assert_eq!(per_token(&out[0]), [1.0 + 11.0, 2.0, 0.0, 12.0]);
        // rank 1: t0 = d1 row 2; t1 = d0 row 2; t2 = d0 row 3 + d1 row 3.
        assert_eq!(per_token(&out[1]), [13.0, 3.0, 4.0 + 14.0]);
        // Weights come back where the id is valid; -1 columns (r0 t2, r0 t3
        // column 1, r1 t1 column 0) are 0.
        assert_eq!(
            out[0].combined_topk_weights,
            Some(vec![0.5, 0.25, 0.75, 0.125, 0.0, 0.0, 0.0625, 0.0])
        );
        assert_eq!(
            out[1].combined_topk_weights,
            Some(vec![1.5, 2.5, 0.0, 0.375, 0.875, 0.0078125])
        );

        // Without weights there are no combined weights.
        let inputs: Vec<CombineInput> = (0..2)
            .map(|r| CombineInput {
                y: &y[r],
                ..Default::default()
            })
            .collect();
        let out = combine(&d, &inputs, HIDDEN).unwrap();
        assert_eq!(out[0].combined_topk_weights, None);
        assert_eq!(out[0].combined_x.len(), 4 * HIDDEN);
        assert_eq!(out[1].combined_x.len(), 3 * HIDDEN);
    }

    #[test]
    fn hand_combine_with_bias() {
        const HIDDEN: usize = 64;
        let d = hand_dispatch(hand_args()).unwrap();
        let y = [hand_y(0, 4, HIDDEN), hand_y(1, 4, HIDDEN)];
        // rank 0 passes a pair, rank 1 one tensor (in the second slot).
        let b00: Vec<f32> = (0..4 * HIDDEN).map(|i| (i % 7) as f32).collect();
        let b01: Vec<f32> = (0..4 * HIDDEN).map(|i| 0.5 * (i % 3) as f32).collect();
        let b11: Vec<f32> = (0..3 * HIDDEN).map(|i| -((i % 5) as f32)).collect();
        let inputs = [
            CombineInput {
                y: &y[0],
                topk_weights: None,
                bias: [Some(&b00), Some(&b01)],
            },
            CombineInput {
                y: &y[1],
                topk_weights: None,
                bias: [None, Some(&b11)],
            },
        ];
        let out = combine(&d, &inputs, HIDDEN).unwrap();
        let sums0 = [12.0, 2.0, 0.0, 12.0];
        for (i, &v) in out[0].combined_x.iter().enumerate() {
            assert_eq!(v, b00[i] + b01[i] + sums0[i / HIDDEN], "rank 0 element {i}");
        }
        let sums1 = [13.0, 3.0, 18.0];
        for (i, &v) in out[1].combined_x.iter().enumerate() {
            assert_eq!(v, b11[i] + sums1[i / HIDDEN], "rank 1 element {i}");
        }
        // The token sent nowhere (rank 0, t2) is its bias alone.
        assert_eq!(
            out[0].combined_x[2 * HIDDEN..3 * HIDDEN],
            (2 * HIDDEN..3 * HIDDEN)
                .map(|i| b00[i] + b01[i])
                .collect::<Vec<_>>()[..]
        );
    }

    #[test]
    fn hand_combine_ignores_padding_rows() {
        const HIDDEN: usize = 64;
        let d = hand_dispatch(DispatchArgs {
            num_worst_tokens: 7,
            ..hand_args()
        })
        .unwrap();
        let mut y = [hand_y(0, 7, HIDDEN), hand_y(1, 7, HIDDEN)];
        let mut w: Vec<Vec<f32>> = d
            .ranks
            .iter()
            .map(|o| o.recv_topk_weights.clone().unwrap())
            .collect();
        for r in 0..2 {
            y[r][4 * HIDDEN..].fill(f32::NAN);
            w[r][4 * 2..].fill(f32::NAN);
        }
        let inputs: Vec<CombineInput> = (0..2)
            .map(|r| CombineInput {
                y: &y[r],
                topk_weights: Some(&w[r]),
                bias: [None, None],
            })
            .collect();
        let out = combine(&d, &inputs, HIDDEN).unwrap();
        assert_eq!(out[0].combined_x[0], 12.0);
        assert!(out.iter().all(|o| o.combined_x.iter().all(|v| !v.is_nan())));
        assert_eq!(
            out[1].combined_topk_weights,
            Some(vec![1.5, 2.5, 0.0, 0.375, 0.875, 0.0078125])
        );
    }

    /// Bias first, then destination ranks in ascending order, in f32.
    #[test]
    fn combine_summation_order() {
        const HIDDEN: usize = 64;
        // 3 ranks, 3 experts, one token on rank 0 sent to every rank.
        let x = vec![0u8; 128];
        let empty: [u8; 0] = [];
        let inputs = [
            RankInput::bare(&[0, 1, 2], &x),
            RankInput::bare(&[], &empty),
            RankInput::bare(&[], &empty),
        ];
        let d = dispatch(&inputs, &DispatchArgs::new(3, 3, 128)).unwrap();
        let big = 16_777_216.0f32; // 2^24: 2^24 + 1 rounds back to 2^24
        let y: Vec<Vec<f32>> = [big, 1.0, -big].iter().map(|&v| vec![v; HIDDEN]).collect();
        let bias = vec![1.0f32; HIDDEN];
        let run = |bias: Option<&[f32]>| {
            let inputs: Vec<CombineInput> = (0..3)
                .map(|r| CombineInput {
                    y: &y[r],
                    topk_weights: None,
                    bias: [if r == 0 { bias } else { None }, None],
                })
                .collect();
            combine(&d, &inputs, HIDDEN).unwrap()[0].combined_x[0]
        };
        // ((0 + 2^24) + 1) - 2^24 = 0; descending order would give 1.
        assert_eq!(run(None), 0.0);
        // (((1 + 0) + 2^24) + 1) - 2^24 = 0; bias last would give 1.
        assert_eq!(run(Some(&bias)), 0.0);
    }

    #[test]
    fn duplicate_experts_count_once() {
        // Token 0 has expert 1 twice (rank 0), token 1 has expert 2 twice (rank 1).
        let topk = [1, 1, 2, 2, 3, 3];
        let l = layout(&topk, 2, 4, 2).unwrap();
        assert_eq!(l.num_tokens_per_expert, [0, 1, 1, 1]);
        assert_eq!(l.num_tokens_per_rank, [1, 2]);
        let x = vec![7u8; 3 * 128];
        let w = [0.25, 0.5, 1.0, 2.0, 4.0, 8.0];
        let d = dispatch(
            &[RankInput {
                topk_idx: &topk,
                topk_weights: Some(&w),
                x: &x,
                scales: None,
            }],
            &DispatchArgs::new(4, 2, 128),
        )
        .unwrap();
        let o = &d.ranks[0];
        // One rank hosting every expert: both entries are kept, counted once.
        assert_eq!(o.recv_topk_idx, topk);
        assert_eq!(o.num_recv_tokens_per_expert, [0, 1, 1, 1]);
        // With two ranks each duplicate stays in its own column.
        let d = dispatch(
            &[
                RankInput {
                    topk_idx: &topk,
                    topk_weights: Some(&w),
                    x: &x,
                    scales: None,
                },
                RankInput {
                    topk_idx: &[],
                    topk_weights: Some(&[]),
                    x: &[],
                    scales: None,
                },
            ],
            &DispatchArgs::new(4, 2, 128),
        )
        .unwrap();
        assert_eq!(d.ranks[0].recv_topk_idx, [1, 1]);
        assert_eq!(d.ranks[0].recv_topk_weights, Some(vec![0.25, 0.5]));
        assert_eq!(d.ranks[0].num_recv_tokens_per_expert, [0, 1]);
        assert_eq!(d.ranks[1].recv_topk_idx, [0, 0, 1, 1]);
        assert_eq!(d.ranks[1].num_recv_tokens_per_expert, [1, 1]);
    }

    #[test]
    fn all_ranks_empty() {
        for num_ranks in [1, 2, 8] {
            let inputs = vec![
                RankInput {
                    topk_idx: &[],
                    topk_weights: Some(&[]),
                    x: &[],
                    scales: Some(&[]),
                };
                num_ranks
            ];
            let args = DispatchArgs {
                num_scales: 2,
                expert_alignment: 4,
                ..DispatchArgs::new(2 * num_ranks, 4, 256)
            };
            let d = dispatch(&inputs, &args).unwrap();
            assert_eq!(d.rank_prefix_matrix, vec![0; num_ranks * num_ranks]);
            for o in &d.ranks {
                assert_eq!(o.num_recv_tokens, 0);
                assert_eq!(o.num_rows(), 0);
                assert!(o.recv_x.is_empty() && o.recv_topk_idx.is_empty());
                assert_eq!(o.recv_scales, Some(vec![]));
                assert_eq!(o.num_recv_tokens_per_expert, [0, 0]);
            }
            let cinputs = vec![
                CombineInput {
                    y: &[],
                    topk_weights: Some(&[]),
                    bias: [Some(&[]), None],
                };
                num_ranks
            ];
            let out = combine(&d, &cinputs, 64).unwrap();
            assert!(out
                .iter()
                .all(|o| o.combined_x.is_empty()
                    && o.combined_topk_weights.as_deref() == Some(&[][..])));
            // Padded: every row is padding.
            let d = dispatch(
                &inputs,
                &DispatchArgs {
                    num_worst_tokens: 3,
                    ..args
                },
            )
            .unwrap();
            for o in &d.ranks {
                assert_eq!(o.num_rows(), 3);
                assert_eq!(o.recv_topk_idx, vec![-1; 12]);
                assert_eq!(o.recv_topk_weights, Some(vec![0.0; 12]));
            }
        }
    }

    // ---- random cases -------------------------------------------------------

    /// One random job: per-rank routing, weights, payloads (f32 small integers
    /// stored as bytes, so sums are exact in any order) and scales.
    struct Case {
        args: DispatchArgs,
        topk: Vec<Vec<i64>>,
        weights: Vec<Vec<f32>>,
        x: Vec<Vec<u8>>,
        scales: Vec<Vec<f32>>,
    }

    impl Case {
        fn num_ranks(&self) -> usize {
            self.topk.len()
        }

        fn num_tokens(&self, r: usize) -> usize {
            self.topk[r].len() / self.args.num_topk
        }

        fn hidden(&self) -> usize {
            self.args.hidden_bytes / 4
        }

        fn inputs(&self) -> Vec<RankInput<'_>> {
            (0..self.num_ranks())
                .map(|r| RankInput {
                    topk_idx: &self.topk[r],
                    topk_weights: Some(&self.weights[r]),
                    x: &self.x[r],
                    scales: (self.args.num_scales > 0).then_some(&self.scales[r][..]),
                })
                .collect()
        }
    }

    fn small_ints(rng: &mut StdRng, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| rng.random_range(-1000i32..=1000) as f32)
            .collect()
    }

    /// `duplicates`: some rows repeat an expert id.
    fn random_case(rng: &mut StdRng, num_ranks: usize, k: usize, duplicates: bool) -> Case {
        let experts_per_rank = k.div_ceil(num_ranks) + rng.random_range(0..4);
        let num_experts = num_ranks * experts_per_rank;
        // 256 bytes: the 64 f32s of a row are also a whole bf16 row of 128
        // bytes for combine. (Payload size does not change the semantics;
        // cached dispatch below varies it.)
        let hidden_bytes = 256;
        let num_scales = if rng.random_bool(0.5) {
            hidden_bytes / 128
        } else {
            0
        };
        let args = DispatchArgs {
            num_scales,
            expert_alignment: [1, 2, 3, 8, 128][rng.random_range(0..5)],
            ..DispatchArgs::new(num_experts, k, hidden_bytes)
        };
        let mut case = Case {
            args,
            topk: vec![],
            weights: vec![],
            x: vec![],
            scales: vec![],
        };
        for _ in 0..num_ranks {
            let n = if rng.random_bool(0.2) {
                0
            } else {
                rng.random_range(1..=300)
            };
            let topk = crate::test_support::random_topk(rng, n, num_experts, k, duplicates);
            case.weights
                .push((0..n * k).map(|_| rng.random_range(0.0f32..1.0)).collect());
            case.x
                .push(f32s_to_bytes(&small_ints(rng, n * hidden_bytes / 4)));
            case.scales
                .push((0..n * num_scales).map(|_| rng.random::<f32>()).collect());
            case.topk.push(topk);
        }
        case
    }

    /// Checks a dispatch result against a direct recomputation from `case`.
    fn check_dispatch(case: &Case, d: &Dispatched) {
        let r_count = case.num_ranks();
        let k = case.args.num_topk;
        let el = case.args.num_experts / r_count;
        let hb = case.args.hidden_bytes;
        let ns = case.args.num_scales;
        // goes[s][t * R + dest]: token t of rank s has an expert on dest.
        let goes: Vec<Vec<bool>> = case
            .topk
            .iter()
            .map(|topk| {
                let mut g = vec![false; topk.len() / k * r_count];
                for (t, row) in topk.chunks_exact(k).enumerate() {
                    for &e in row.iter().filter(|&&e| e >= 0) {
                        g[t * r_count + e as usize / el] = true;
                    }
                }
                g
            })
            .collect();
        let has = |s: usize, t: usize, dest: usize| goes[s][t * r_count + dest];
        // Layouts.
        for s in 0..r_count {
            let l = &d.layouts[s];
            assert_eq!(l.num_tokens(), case.num_tokens(s));
            for dest in 0..r_count {
                let want = (0..case.num_tokens(s)).filter(|&t| has(s, t, dest)).count();
                assert_eq!(l.num_tokens_per_rank[dest] as usize, want);
                for t in 0..case.num_tokens(s) {
                    assert_eq!(l.token_in_rank(t, dest), has(s, t, dest));
                }
            }
            for e in 0..case.args.num_experts {
                let want = case.topk[s]
                    .chunks_exact(k)
                    .filter(|row| row.contains(&(e as i64)))
                    .count();
                assert_eq!(l.num_tokens_per_expert[e] as usize, want, "expert {e}");
            }
        }
        // rank_prefix_matrix.
        for i in 0..r_count {
            for j in 0..r_count {
                let want: i32 = (0..=i).map(|s| d.layouts[s].num_tokens_per_rank[j]).sum();
                assert_eq!(d.rank_prefix_matrix[i * r_count + j], want);
            }
        }
        // What each rank receives.
        for (dest, o) in d.ranks.iter().enumerate() {
            let want: Vec<(usize, usize)> = (0..r_count)
                .flat_map(|s| (0..case.num_tokens(s)).map(move |t| (s, t)))
                .filter(|&(s, t)| has(s, t, dest))
                .collect();
            assert_eq!(o.num_recv_tokens, want.len());
            let sent: i32 = d.layouts.iter().map(|l| l.num_tokens_per_rank[dest]).sum();
            assert_eq!(o.num_recv_tokens, sent as usize);
            assert_eq!(
                d.rank_prefix_matrix[(r_count - 1) * r_count + dest] as usize,
                o.num_recv_tokens
            );
            let rows = if case.args.num_worst_tokens > 0 {
                case.args.num_worst_tokens
            } else {
                want.len()
            };
            assert_eq!(o.num_rows(), rows);
            assert_eq!(o.recv_x.len(), rows * hb);
            assert_eq!(o.recv_topk_idx.len(), rows * k);
            assert_eq!(o.recv_src_rank.len(), rows);
            let w = o.recv_topk_weights.as_ref().unwrap();
            assert_eq!(w.len(), rows * k);
            let mut counts = vec![0usize; el];
            for (i, &(s, t)) in want.iter().enumerate() {
                assert_eq!(
                    (o.recv_src_rank[i], o.recv_src_idx[i]),
                    (s as i32, t as i32)
                );
                assert_eq!(
                    o.recv_x[i * hb..(i + 1) * hb],
                    case.x[s][t * hb..(t + 1) * hb]
                );
                if ns > 0 {
                    assert_eq!(
                        bits(&o.recv_scales.as_ref().unwrap()[i * ns..(i + 1) * ns]),
                        bits(&case.scales[s][t * ns..(t + 1) * ns])
                    );
                } else {
                    assert_eq!(o.recv_scales, None);
                }
                let src = &case.topk[s][t * k..(t + 1) * k];
                for c in 0..k {
                    let (e, got) = (src[c], o.recv_topk_idx[i * k + c]);
                    if e >= 0 && e as usize / el == dest {
                        assert_eq!(got, e - (dest * el) as i64);
                        assert_eq!(w[i * k + c].to_bits(), case.weights[s][t * k + c].to_bits());
                    } else {
                        assert_eq!(got, -1);
                        assert_eq!(w[i * k + c].to_bits(), 0.0f32.to_bits());
                    }
                }
                for (j, count) in counts.iter_mut().enumerate() {
                    *count += usize::from(src.contains(&((dest * el + j) as i64)));
                }
            }
            for i in want.len()..rows {
                assert!(o.recv_topk_idx[i * k..(i + 1) * k].iter().all(|&e| e == -1));
                assert!(w[i * k..(i + 1) * k].iter().all(|&v| v.to_bits() == 0));
            }
            if case.args.num_worst_tokens > 0 {
                assert!(o.num_recv_tokens_per_expert.is_empty());
            } else {
                let a = case.args.expert_alignment;
                let want: Vec<i32> = counts.iter().map(|&c| (c.div_ceil(a) * a) as i32).collect();
                assert_eq!(o.num_recv_tokens_per_expert, want);
                // Same as the sum of the source layouts' per-expert counts.
                for (j, &c) in counts.iter().enumerate() {
                    let sum: i32 = d
                        .layouts
                        .iter()
                        .map(|l| l.num_tokens_per_expert[dest * el + j])
                        .sum();
                    assert_eq!(sum as usize, c);
                }
            }
        }
    }

    /// Every rank's received top-k weights (`k` per row) as combine inputs:
    /// NaN in the padding rows, which combine must ignore.
    fn received_weights(d: &Dispatched, k: usize) -> Vec<Vec<f32>> {
        d.ranks
            .iter()
            .map(|o| {
                let mut w = o.recv_topk_weights.clone().unwrap();
                w[o.num_recv_tokens * k..].fill(f32::NAN);
                w
            })
            .collect()
    }

    /// dispatch -> combine with `y = recv_x` read as f32 (padding rows NaN)
    /// and the received weights gives back `bias0 + bias1 + x * copies` and
    /// the original weights (0 at `-1` columns), exactly.
    fn check_round_trip(rng: &mut StdRng, case: &Case, d: &Dispatched) {
        let r_count = case.num_ranks();
        let k = case.args.num_topk;
        let hidden = case.hidden();
        let el = case.args.num_experts / r_count;
        let ys: Vec<Vec<f32>> = d
            .ranks
            .iter()
            .map(|o| {
                let mut y = bytes_to_f32s(&o.recv_x);
                y[o.num_recv_tokens * hidden..].fill(f32::NAN);
                y
            })
            .collect();
        let ws = received_weights(d, k);
        let nbias = rng.random_range(0..=2);
        let biases: Vec<Vec<Vec<f32>>> = (0..r_count)
            .map(|s| {
                (0..nbias)
                    .map(|_| small_ints(rng, case.num_tokens(s) * hidden))
                    .collect()
            })
            .collect();
        let inputs: Vec<CombineInput> = (0..r_count)
            .map(|r| CombineInput {
                y: &ys[r],
                topk_weights: Some(&ws[r]),
                bias: [
                    biases[r].first().map(|b| &b[..]),
                    biases[r].get(1).map(|b| &b[..]),
                ],
            })
            .collect();
        let out = combine(d, &inputs, hidden).unwrap();
        for s in 0..r_count {
            let x = bytes_to_f32s(&case.x[s]);
            for t in 0..case.num_tokens(s) {
                let row = &case.topk[s][t * k..(t + 1) * k];
                let copies = (0..r_count)
                    .filter(|&dest| row.iter().any(|&e| e >= 0 && e as usize / el == dest))
                    .count() as f32;
                for h in 0..hidden {
                    let i = t * hidden + h;
                    let bias: f32 = biases[s].iter().map(|b| b[i]).sum();
                    assert_eq!(
                        out[s].combined_x[i],
                        bias + x[i] * copies,
                        "rank {s} token {t}"
                    );
                }
                let cw = out[s].combined_topk_weights.as_ref().unwrap();
                for c in 0..k {
                    let want = if row[c] >= 0 {
                        case.weights[s][t * k + c]
                    } else {
                        0.0
                    };
                    assert_eq!(
                        cw[t * k + c].to_bits(),
                        want.to_bits(),
                        "rank {s} token {t}"
                    );
                }
            }
        }
    }

    fn check_cached(rng: &mut StdRng, case: &Case, d: &Dispatched) {
        // New payloads, possibly of another size, along the same routing.
        let hb = 128 * rng.random_range(1..=2);
        let ns = rng.random_range(0..=2);
        let xs: Vec<Vec<u8>> = (0..case.num_ranks())
            .map(|s| (0..case.num_tokens(s) * hb).map(|_| rng.random()).collect())
            .collect();
        let ss: Vec<Vec<f32>> = (0..case.num_ranks())
            .map(|s| (0..case.num_tokens(s) * ns).map(|_| rng.random()).collect())
            .collect();
        let data: Vec<TokenData> = (0..case.num_ranks())
            .map(|s| TokenData {
                x: &xs[s],
                scales: (ns > 0).then_some(&ss[s][..]),
            })
            .collect();
        let cached = dispatch_cached(d, &data, hb, ns).unwrap();
        let inputs: Vec<RankInput> = (0..case.num_ranks())
            .map(|s| RankInput {
                topk_idx: &case.topk[s],
                topk_weights: Some(&case.weights[s]),
                x: &xs[s],
                scales: (ns > 0).then_some(&ss[s][..]),
            })
            .collect();
        let fresh = dispatch(
            &inputs,
            &DispatchArgs {
                hidden_bytes: hb,
                num_scales: ns,
                ..case.args
            },
        )
        .unwrap();
        for (c, f) in cached.iter().zip(&fresh.ranks) {
            assert_eq!(c.recv_x, f.recv_x);
            assert_eq!(
                c.recv_scales.as_deref().map(bits),
                f.recv_scales.as_deref().map(bits)
            );
        }
    }

    fn random_job(num_ranks: usize, k: usize, duplicates: bool, offset: u64) {
        let what = format!("random job R={num_ranks} K={k} duplicates={duplicates}");
        with_seed(&what, offset, |rng| {
            let mut case = random_case(rng, num_ranks, k, duplicates);
            let d = dispatch(&case.inputs(), &case.args).unwrap();
            check_dispatch(&case, &d);
            check_round_trip(rng, &case, &d);
            check_cached(rng, &case, &d);

            // Padded to num_worst_tokens: the same, plus padding.
            let max_recv = d.ranks.iter().map(|o| o.num_recv_tokens).max().unwrap();
            case.args.num_worst_tokens = max_recv.max(1) + rng.random_range(0..5);
            let padded = dispatch(&case.inputs(), &case.args).unwrap();
            check_dispatch(&case, &padded);
            check_round_trip(rng, &case, &padded);
            check_cached(rng, &case, &padded);
            if max_recv > 1 {
                case.args.num_worst_tokens = max_recv - 1;
                assert_invalid(dispatch(&case.inputs(), &case.args), "num_worst_tokens");
            }

            // Internode per-node counts.
            for rpn in (1..=num_ranks).filter(|rpn| num_ranks % rpn == 0) {
                for s in 0..num_ranks {
                    let l =
                        layout_internode(&case.topk[s], k, case.args.num_experts, num_ranks, rpn)
                            .unwrap();
                    let per_node = l.num_tokens_per_rdma_rank.unwrap();
                    assert_eq!(per_node.len(), num_ranks / rpn);
                    for (node, &count) in per_node.iter().enumerate() {
                        let want = (0..case.num_tokens(s))
                            .filter(|&t| {
                                (0..rpn).any(|j| d.layouts[s].token_in_rank(t, node * rpn + j))
                            })
                            .count();
                        assert_eq!(count as usize, want);
                    }
                }
            }
        });
    }

    #[test]
    fn random_jobs() {
        let mut offset = 0;
        for num_ranks in [1, 2, 4, 8] {
            for k in [1, 4, 8, 32] {
                for _ in 0..3 {
                    random_job(num_ranks, k, false, offset);
                    offset += 1;
                }
            }
        }
    }

    #[test]
    fn random_jobs_with_duplicate_experts() {
        let mut offset = 1000;
        for num_ranks in [1, 2, 4, 8] {
            for k in [2, 8] {
                random_job(num_ranks, k, true, offset);
                offset += 1;
            }
        }
    }

    // ---- internode ----------------------------------------------------------

    /// (nodes, ranks per node) of the internode tests.
    const SPLITS: [(usize, usize); 5] = [(1, 4), (2, 2), (4, 1), (2, 4), (3, 2)];

    /// Random bf16 values (as f32) of both signs over a wide exponent range,
    /// zeros of both signs included, so that f32 sums are rarely exact in bf16.
    fn random_bf16s(rng: &mut StdRng, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let r: u32 = rng.random();
                let sign = ((r & 1) as u16) << 15;
                // Exponent 2^-8 ..= 2^8, 7 random fraction bits; 1 in 20 zero.
                let exponent = ((119 + (r >> 1) % 17) as u16) << 7;
                let fraction = ((r >> 8) & 0x7F) as u16;
                if (r >> 24) % 20 == 0 {
                    bf16_bits_to_f32(sign)
                } else {
                    bf16_bits_to_f32(sign | exponent | fraction)
                }
            })
            .collect()
    }

    /// What every rank returns to a combine, and the biases of its tokens.
    struct CombineCase {
        ys: Vec<Vec<f32>>,
        ws: Vec<Vec<f32>>,
        biases: Vec<[Option<Vec<f32>>; 2]>,
    }

    impl CombineCase {
        /// Random bf16 rows and f32 weights for every received row (NaN in
        /// padding rows, which must be ignored); bias slots as `slots` says.
        fn random(rng: &mut StdRng, case: &Case, d: &Dispatched, slots: [bool; 2]) -> Self {
            let (hidden, k) = (case.hidden(), case.args.num_topk);
            let mut ys = Vec::new();
            let mut ws = Vec::new();
            for o in &d.ranks {
                let mut y = random_bf16s(rng, o.num_rows() * hidden);
                y[o.num_recv_tokens * hidden..].fill(f32::NAN);
                ys.push(y);
                let mut w: Vec<f32> = (0..o.num_rows() * k)
                    .map(|_| rng.random_range(-1.0f32..1.0) * 2f32.powi(rng.random_range(-30..=4)))
                    .collect();
                w[o.num_recv_tokens * k..].fill(f32::NAN);
                ws.push(w);
            }
            let biases = (0..case.num_ranks())
                .map(|s| slots.map(|on| on.then(|| random_bf16s(rng, case.num_tokens(s) * hidden))))
                .collect();
            CombineCase { ys, ws, biases }
        }

        fn inputs(&self, weights: bool) -> Vec<CombineInput<'_>> {
            (0..self.ys.len())
                .map(|r| CombineInput {
                    y: &self.ys[r],
                    topk_weights: weights.then_some(&self.ws[r][..]),
                    bias: [self.biases[r][0].as_deref(), self.biases[r][1].as_deref()],
                })
                .collect()
        }
    }

    /// The internode combine model written out on its own: for every token,
    /// the destination ranks from its `topk_idx` row, its row on each from a
    /// search of `recv_src_rank` / `recv_src_idx`, explicit loops over the
    /// nodes and their ranks, and the independent bf16 rounding. Returns
    /// `(combined_x, combined_topk_weights)` per source rank.
    fn internode_model(
        case: &Case,
        d: &Dispatched,
        cc: &CombineCase,
        ranks_per_node: usize,
    ) -> Vec<(Vec<f32>, Vec<f32>)> {
        let r_count = case.num_ranks();
        let (hidden, k) = (case.hidden(), case.args.num_topk);
        let el = case.args.num_experts / r_count;
        let row_of: Vec<HashMap<(i32, i32), usize>> = d
            .ranks
            .iter()
            .map(|o| {
                (0..o.num_recv_tokens)
                    .map(|i| ((o.recv_src_rank[i], o.recv_src_idx[i]), i))
                    .collect()
            })
            .collect();
        let round = |v: f32| bf16_bits_to_f32(slow_bf16_bits(v));
        (0..r_count)
            .map(|s| {
                let n = case.num_tokens(s);
                let mut x = vec![0.0f32; n * hidden];
                let mut w = vec![0.0f32; n * k];
                for t in 0..n {
                    let ids = &case.topk[s][t * k..(t + 1) * k];
                    let bias = |slot: usize, h: usize| {
                        cc.biases[s][slot]
                            .as_ref()
                            .map_or(0.0, |b| b[t * hidden + h])
                    };
                    for h in 0..hidden {
                        x[t * hidden + h] = bias(0, h) + bias(1, h);
                    }
                    for node in 0..r_count / ranks_per_node {
                        let ranks: Vec<(usize, usize)> = (node * ranks_per_node
                            ..(node + 1) * ranks_per_node)
                            .filter(|&dest| ids.iter().any(|&e| e >= 0 && e as usize / el == dest))
                            .map(|dest| (dest, row_of[dest][&(s as i32, t as i32)]))
                            .collect();
                        if ranks.is_empty() {
                            continue;
                        }
                        for h in 0..hidden {
                            let mut p = 0.0f32;
                            for &(dest, row) in &ranks {
                                p += cc.ys[dest][row * hidden + h];
                            }
                            x[t * hidden + h] += round(p);
                        }
                        for c in 0..k {
                            let mut q = 0.0f32;
                            for &(dest, row) in &ranks {
                                q += cc.ws[dest][row * k + c];
                            }
                            w[t * k + c] += q;
                        }
                    }
                }
                (x, w)
            })
            .collect()
    }

    /// Per-node token counts of source rank `s`, straight from its ids.
    fn per_node_counts(case: &Case, s: usize, ranks_per_node: usize) -> Vec<i32> {
        let k = case.args.num_topk;
        let el = case.args.num_experts / case.num_ranks();
        (0..case.num_ranks() / ranks_per_node)
            .map(|node| {
                case.topk[s]
                    .chunks_exact(k)
                    .filter(|row| {
                        row.iter()
                            .any(|&e| e >= 0 && e as usize / el / ranks_per_node == node)
                    })
                    .count() as i32
            })
            .collect()
    }

    /// For each split: dispatch (plain and padded) equal to the single-node
    /// dispatch, layouts equal to `layout` plus independent per-node counts,
    /// and the internode combine equal to the model written out in the test,
    /// bit for bit, for every bias pattern, with and without weights.
    fn internode_job(num_nodes: usize, ranks_per_node: usize, k: usize, dup: bool, offset: u64) {
        let num_ranks = num_nodes * ranks_per_node;
        let what = format!("internode {num_nodes}x{ranks_per_node} K={k} duplicates={dup}");
        with_seed(&what, offset, |rng| {
            let mut case = random_case(rng, num_ranks, k, dup);
            for padded in [false, true] {
                let single = dispatch(&case.inputs(), &case.args).unwrap();
                if padded {
                    let max_recv = single.ranks.iter().map(|o| o.num_recv_tokens).max();
                    case.args.num_worst_tokens = max_recv.unwrap().max(1) + rng.random_range(0..4);
                    continue;
                }
                let d = dispatch_internode(&case.inputs(), &case.args, ranks_per_node).unwrap();
                check_dispatch(&case, &d);
                assert_eq!(d.args, single.args);
                assert_eq!(d.rank_prefix_matrix, single.rank_prefix_matrix);
                assert_eq!(d.ranks, single.ranks);
                for s in 0..num_ranks {
                    let want = Layout {
                        num_tokens_per_rdma_rank: Some(per_node_counts(&case, s, ranks_per_node)),
                        ..single.layouts[s].clone()
                    };
                    assert_eq!(d.layouts[s], want, "rank {s}");
                    let l = layout_internode(
                        &case.topk[s],
                        k,
                        case.args.num_experts,
                        num_ranks,
                        ranks_per_node,
                    )
                    .unwrap();
                    assert_eq!(l, want, "rank {s}");
                }
            }
            // Padded outputs: the same equality.
            let single = dispatch(&case.inputs(), &case.args).unwrap();
            let d = dispatch_internode(&case.inputs(), &case.args, ranks_per_node).unwrap();
            check_dispatch(&case, &d);
            assert_eq!(d.ranks, single.ranks);
            assert_eq!(d.rank_prefix_matrix, single.rank_prefix_matrix);

            for slots in [[false, false], [true, false], [false, true], [true, true]] {
                let cc = CombineCase::random(rng, &case, &d, slots);
                let want = internode_model(&case, &d, &cc, ranks_per_node);
                let out =
                    combine_internode(&d, &cc.inputs(true), case.hidden(), ranks_per_node).unwrap();
                for (s, (o, (x, w))) in out.iter().zip(&want).enumerate() {
                    assert_eq!(bits(&o.combined_x), bits(x), "rank {s} {slots:?}");
                    let got = o.combined_topk_weights.as_ref().unwrap();
                    assert_eq!(bits(got), bits(w), "rank {s} {slots:?}");
                }
                if slots == [true, true] {
                    // Without weights: the same rows, no weights.
                    let plain =
                        combine_internode(&d, &cc.inputs(false), case.hidden(), ranks_per_node)
                            .unwrap();
                    for (p, o) in plain.iter().zip(&out) {
                        assert_eq!(bits(&p.combined_x), bits(&o.combined_x));
                        assert_eq!(p.combined_topk_weights, None);
                    }
                    // The single-node handle: the same routing, the same result.
                    let other =
                        combine_internode(&single, &cc.inputs(true), case.hidden(), ranks_per_node)
                            .unwrap();
                    assert_eq!(other, out);
                }
            }

            // The dispatched weights come back: the original weight where the
            // id is valid (duplicates in their own columns), 0 at -1 columns.
            let ws = received_weights(&d, k);
            let cc = CombineCase::random(rng, &case, &d, [false, false]);
            let inputs: Vec<CombineInput> = (0..num_ranks)
                .map(|r| CombineInput {
                    y: &cc.ys[r],
                    topk_weights: Some(&ws[r]),
                    bias: [None, None],
                })
                .collect();
            let out = combine_internode(&d, &inputs, case.hidden(), ranks_per_node).unwrap();
            for (s, o) in out.iter().enumerate() {
                let got = o.combined_topk_weights.as_ref().unwrap();
                for (i, (&g, &id)) in got.iter().zip(&case.topk[s]).enumerate() {
                    let want = if id >= 0 { case.weights[s][i] } else { 0.0 };
                    assert_eq!(g.to_bits(), want.to_bits(), "rank {s} entry {i}");
                }
                // A token routed nowhere combines to zeros (no bias).
                for (t, row) in case.topk[s].chunks_exact(k).enumerate() {
                    if row.iter().all(|&e| e < 0) {
                        let x = &o.combined_x[t * case.hidden()..(t + 1) * case.hidden()];
                        assert!(x.iter().all(|v| v.to_bits() == 0), "rank {s} token {t}");
                    }
                }
            }
        });
    }

    #[test]
    fn internode_splits_random() {
        let mut offset = 3000;
        for (nodes, rpn) in SPLITS {
            for (k, dup) in [(1, false), (4, false), (8, true), (2, true)] {
                internode_job(nodes, rpn, k, dup, offset);
                offset += 1;
            }
        }
    }

    /// How the two models relate: one node of all ranks is the intranode sum
    /// of the copies, rounded, plus the biases; one rank per node with bf16
    /// rows is the intranode combine itself (values; zeros may differ in sign).
    #[test]
    fn internode_relations_to_intranode() {
        for (offset, num_ranks) in [(3100u64, 2usize), (3101, 4), (3102, 6), (3103, 8)] {
            with_seed("internode relations", offset, |rng| {
                let case = random_case(rng, num_ranks, 4, true);
                let d = dispatch(&case.inputs(), &case.args).unwrap();
                let hidden = case.hidden();
                let cc = CombineCase::random(rng, &case, &d, [true, true]);
                let plain = CombineCase {
                    biases: vec![[None, None]; num_ranks],
                    ys: cc.ys.clone(),
                    ws: cc.ws.clone(),
                };
                let intra = combine(&d, &cc.inputs(true), hidden).unwrap();
                let intra_plain = combine(&d, &plain.inputs(true), hidden).unwrap();
                let one_node = combine_internode(&d, &cc.inputs(true), hidden, num_ranks).unwrap();
                let per_rank = combine_internode(&d, &cc.inputs(true), hidden, 1).unwrap();
                for s in 0..num_ranks {
                    let b = &cc.biases[s];
                    for (i, &v) in one_node[s].combined_x.iter().enumerate() {
                        let bias = b[0].as_ref().unwrap()[i] + b[1].as_ref().unwrap()[i];
                        let want = bias + round_to_bf16(intra_plain[s].combined_x[i]);
                        assert_eq!(v, want, "rank {s} element {i}");
                    }
                    assert_eq!(
                        bits(one_node[s].combined_topk_weights.as_ref().unwrap()),
                        bits(intra[s].combined_topk_weights.as_ref().unwrap())
                    );
                    assert_eq!(per_rank[s].combined_x, intra[s].combined_x, "rank {s}");
                    assert_eq!(
                        per_rank[s].combined_topk_weights,
                        intra[s].combined_topk_weights
                    );
                }
            });
        }
    }

    /// 4 ranks, expert `j` on rank `j`, K = 4, chosen values whose sums show
    /// each rounding: on rank 0, A = [0, 1, 2, -1], B = all -1 (nowhere),
    /// C = [3, 3, -1, 2] (a duplicate), F = [1, 2, -1, -1]; on rank 1,
    /// D = [0, 3, -1, -1], E = [0, 2, 3, -1]; ranks 2 and 3 have no tokens.
    #[test]
    fn internode_combine_hand() {
        const HIDDEN: usize = 64;
        let a = 2f32.powi(-8);
        let topk: [&[i64]; 4] = [
            &[0, 1, 2, -1, -1, -1, -1, -1, 3, 3, -1, 2, 1, 2, -1, -1],
            &[0, 3, -1, -1, 0, 2, 3, -1],
            &[],
            &[],
        ];
        let xs: Vec<Vec<u8>> = (0..4).map(|r| vec![0u8; topk[r].len() / 4 * 128]).collect();
        let inputs: Vec<RankInput> = (0..4).map(|r| RankInput::bare(topk[r], &xs[r])).collect();
        let d = dispatch(&inputs, &DispatchArgs::new(4, 4, 128)).unwrap();
        // (source rank, token, destination) -> (y, weight); weight 0.5 unless listed.
        let value = |s: i32, t: i32, dest: usize| -> (f32, f32) {
            match (s, t, dest) {
                (0, 0, 0) => (1.0, 0.5),
                (0, 0, _) => (a, 0.5),   // A: 1, 2^-8, 2^-8
                (0, 2, 2) => (1.0, 0.5), // C: 1 (rank 2), 3 * 2^-9 (rank 3)
                (0, 2, _) => (1.5 * a, 0.5),
                (0, 3, 1) => (1.0, 0.5), // F: 1 (rank 1), 2^-8 (rank 2)
                (0, 3, _) => (a, 0.5),
                (1, 0, _) => (1.0, 0.5), // D: 1, 1
                (1, 1, 0) => (1.0, 1.0), // E: weights 1, 2^-24, 2^-24
                (1, 1, _) => (a, 2f32.powi(-24)),
                _ => unreachable!(),
            }
        };
        let mut ys = Vec::new();
        let mut ws = Vec::new();
        for (dest, o) in d.ranks.iter().enumerate() {
            let (mut y, mut w) = (Vec::new(), Vec::new());
            for i in 0..o.num_recv_tokens {
                let (v, wv) = value(o.recv_src_rank[i], o.recv_src_idx[i], dest);
                y.extend([v; HIDDEN]);
                w.extend([wv; 4]);
            }
            ys.push(y);
            ws.push(w);
        }
        // Rank 0's biases: a pair, 0.5 + 0.25 on B, 2^-8 + 0 on F; rank 1's:
        // zeros in the second slot.
        let per_token = |v: [f32; 4]| -> Vec<f32> { v.iter().flat_map(|&x| [x; HIDDEN]).collect() };
        let b0 = per_token([0.0, 0.5, 0.0, a]);
        let b1 = per_token([0.0, 0.25, 0.0, 0.0]);
        let zeros = vec![0.0f32; 2 * HIDDEN];
        let run = |rpn: Option<usize>, bias: bool| {
            let cin: Vec<CombineInput> = (0..4)
                .map(|r| CombineInput {
                    y: &ys[r],
                    topk_weights: Some(&ws[r]),
                    bias: match (bias, r) {
                        (true, 0) => [Some(&b0[..]), Some(&b1[..])],
                        (true, 1) => [None, Some(&zeros[..])],
                        _ => [None, None],
                    },
                })
                .collect();
            let out = match rpn {
                Some(rpn) => combine_internode(&d, &cin, HIDDEN, rpn).unwrap(),
                None => combine(&d, &cin, HIDDEN).unwrap(),
            };
            let rows = |o: &CombineOutput| -> (Vec<f32>, Vec<f32>) {
                let x = o.combined_x.chunks_exact(HIDDEN).map(|r| {
                    assert!(r.iter().all(|v| v.to_bits() == r[0].to_bits()));
                    r[0]
                });
                let w = o
                    .combined_topk_weights
                    .as_ref()
                    .unwrap()
                    .chunks_exact(4)
                    .map(|r| {
                        assert!(r.iter().all(|v| v.to_bits() == r[0].to_bits()));
                        r[0]
                    });
                (x.collect(), w.collect())
            };
            let (x0, w0) = rows(&out[0]);
            let (x1, w1) = rows(&out[1]);
            assert!(out[2].combined_x.is_empty() && out[3].combined_x.is_empty());
            (x0, w0, x1, w1)
        };
        // 1 + 2^-7 (a bf16 value), 1 + 2^-8 (a tie between bf16 1 and 1 + 2^-7),
        // 1 + 3 * 2^-9 (rounds up to 1 + 2^-7).
        let (s7, s8, s9) = (1.0 + 2.0 * a, 1.0 + a, 1.0 + 1.5 * a);

        // Intranode (no partial rounding): A 1 + 2^-8 + 2^-8, B its biases,
        // C 1 + 3 * 2^-9, F 2^-8 + 1 + 2^-8.
        let (x0, w0, x1, w1) = run(None, true);
        assert_eq!(x0, [s7, 0.75, s9, s7]);
        assert_eq!(w0, [1.5, 0.0, 1.0, 1.0]);
        assert_eq!(x1, [2.0, s7]);
        assert_eq!(w1, [1.0, 1.0]); // (1 + 2^-24) + 2^-24 = 1 in f32

        // 2 nodes of 2: A's node-0 partial 1 + 2^-8 rounds (tie, to even) to 1,
        // so A is 1 + 2^-8, which the GPU stores as 1.0, where the intranode
        // model gives 1 + 2^-7. C (node 1 only) is bf16(1 + 3 * 2^-9). F: 2^-8
        // + 1 + 2^-8. E's weights: 1 + (2^-24 + 2^-24), no longer 1.
        let (x0, w0, x1, w1) = run(Some(2), true);
        assert_eq!(x0, [s8, 0.75, s7, s7]);
        assert_eq!(round_to_bf16(x0[0]), 1.0);
        assert_eq!(round_to_bf16(s7), s7);
        assert_eq!(w0, [1.5, 0.0, 1.0, 1.0]);
        assert_eq!(x1, [2.0, s7]);
        assert_eq!(w1, [1.0, 1.0 + 2f32.powi(-23)]);
        // Without biases: B (sent nowhere) is zero, F is 1 + 2^-8.
        let (x0, _, _, _) = run(Some(2), false);
        assert_eq!(x0, [s8, 0.0, s7, s8]);

        // One node of all 4: A's partial is exact; F's partial 1 + 2^-8 rounds
        // to 1 before its bias 2^-8 is added.
        let (x0, w0, x1, w1) = run(Some(4), true);
        assert_eq!(x0, [s7, 0.75, s7, s8]);
        assert_eq!(round_to_bf16(x0[3]), 1.0);
        assert_eq!(w0, [1.5, 0.0, 1.0, 1.0]);
        assert_eq!((x1, w1), (vec![2.0, s7], vec![1.0, 1.0]));

        // One rank per node: every partial is a single bf16 row, unchanged, so
        // this is the intranode result.
        assert_eq!(run(Some(1), true), run(None, true));
        assert_eq!(run(Some(1), false), run(None, false));
    }

    #[test]
    fn internode_rejects_bad_arguments() {
        const HIDDEN: usize = 64;
        let x = vec![0u8; 128];
        let ids = [0i64, 2];
        let w = [0.5f32; 2];
        let good = RankInput {
            topk_idx: &ids,
            topk_weights: Some(&w),
            x: &x,
            scales: None,
        };
        let args = DispatchArgs::new(4, 2, 128);
        let four = [good; 4];
        let d = dispatch_internode(&four, &args, 2).unwrap();
        for rpn in [0, 3, 5, 8, usize::MAX] {
            assert_invalid(dispatch_internode(&four, &args, rpn), "ranks_per_node");
        }
        assert_invalid(dispatch_internode(&[], &args, 1), "inputs");
        assert_invalid(
            dispatch_internode(&four, &DispatchArgs::new(3, 2, 128), 2),
            "num_experts",
        );

        let ys: Vec<Vec<f32>> = d
            .ranks
            .iter()
            .map(|o| vec![1.0; o.num_rows() * HIDDEN])
            .collect();
        let ws: Vec<Vec<f32>> = d
            .ranks
            .iter()
            .map(|o| vec![1.0; o.num_rows() * 2])
            .collect();
        let b = vec![0.0f32; HIDDEN];
        let good: Vec<CombineInput> = (0..4)
            .map(|r| CombineInput {
                y: &ys[r],
                topk_weights: Some(&ws[r]),
                bias: [Some(&b), None],
            })
            .collect();
        for rpn in [1, 2, 4] {
            combine_internode(&d, &good, HIDDEN, rpn).unwrap();
        }
        for rpn in [0, 3, 5, 8, usize::MAX] {
            assert_invalid(combine_internode(&d, &good, HIDDEN, rpn), "ranks_per_node");
        }
        assert_invalid(combine_internode(&d, &good[..3], HIDDEN, 2), "inputs");
        for hidden in [0, 32, 100, 1 << 40, usize::MAX] {
            assert_invalid(combine_internode(&d, &good, hidden, 2), "hidden");
        }
        assert_invalid(combine_internode(&d, &good, 128, 2), "y");
        fn changed<'a>(
            inputs: &[CombineInput<'a>],
            f: impl FnOnce(&mut CombineInput<'a>),
        ) -> Vec<CombineInput<'a>> {
            let mut inputs = inputs.to_vec();
            f(&mut inputs[2]);
            inputs
        }
        let bad = |inputs: Vec<CombineInput>| combine_internode(&d, &inputs, HIDDEN, 2);
        assert_invalid(bad(changed(&good, |c| c.y = &ys[2][1..])), "y");
        assert_invalid(
            bad(changed(&good, |c| c.topk_weights = None)),
            "topk_weights",
        );
        assert_invalid(
            bad(changed(&good, |c| c.topk_weights = Some(&ws[2][1..]))),
            "topk_weights",
        );
        assert_invalid(bad(changed(&good, |c| c.bias[1] = Some(&b[1..]))), "bias");
        assert_invalid(bad(changed(&good, |c| c.bias[0] = Some(&ys[0]))), "bias");
        let mut first_without = good.clone();
        first_without[0].topk_weights = None;
        assert_invalid(
            combine_internode(&d, &first_without, HIDDEN, 2),
            "topk_weights",
        );

        // A handle whose fields disagree is an error (of both combines), not a panic.
        let no_bias: Vec<CombineInput> = good
            .iter()
            .map(|c| CombineInput {
                bias: [None, None],
                ..*c
            })
            .collect();
        let corrupt = |f: &dyn Fn(&mut Dispatched)| {
            let mut h = d.clone();
            f(&mut h);
            assert_invalid(combine(&h, &no_bias, HIDDEN), "handle");
            assert_invalid(combine_internode(&h, &no_bias, HIDDEN, 2), "handle");
        };
        corrupt(&|h| h.ranks[0].recv_src_rank.swap(0, 1));
        corrupt(&|h| h.ranks[2].recv_src_idx[1] = 1);
        corrupt(&|h| h.ranks[2].recv_src_rank[0] = 9);
        corrupt(&|h| h.ranks[3].num_recv_tokens = 7);
        corrupt(&|h| h.ranks[0].num_recv_tokens -= 1);
        corrupt(&|h| h.layouts[1].is_token_in_rank[2] = false);
        corrupt(&|h| h.layouts[1].is_token_in_rank[1] = true);
        corrupt(&|h| h.layouts[1].is_token_in_rank.truncate(3));
        corrupt(&|h| {
            h.layouts.pop();
        });
        corrupt(&|h| h.args.num_topk = usize::MAX);
        let mut empty = d.clone();
        empty.ranks.clear();
        empty.layouts.clear();
        assert_invalid(combine(&empty, &[], HIDDEN), "handle");
        assert_invalid(combine_internode(&empty, &[], HIDDEN, 1), "handle");
    }

    // ---- validation ---------------------------------------------------------

    #[test]
    fn layout_rejects_bad_arguments() {
        let topk = [0i64, 1, 2, 3];
        assert_invalid(layout(&topk, 2, 4, 0), "num_ranks");
        assert_invalid(layout(&topk, 2, 0, 2), "num_experts");
        assert_invalid(layout(&topk, 2, 6, 4), "num_experts");
        assert_invalid(layout(&topk, 0, 4, 2), "num_topk");
        assert_invalid(layout(&[0; 33], 33, 4, 2), "num_topk");
        assert_invalid(layout(&topk, 3, 4, 2), "topk_idx");
        assert_invalid(layout(&[0, 4], 2, 4, 2), "topk_idx");
        assert_invalid(layout(&[0, -2], 2, 4, 2), "topk_idx");
        assert_invalid(layout_internode(&topk, 2, 4, 2, 0), "ranks_per_node");
        assert_invalid(layout_internode(&topk, 2, 8, 4, 3), "ranks_per_node");
        // The kernels' limits, before anything is allocated.
        assert_invalid(layout(&topk, 2, 1 << 40, 2), "num_experts");
        assert_invalid(layout(&topk, 2, usize::MAX - 1, 2), "num_experts");
        assert_invalid(layout(&topk, 2, 66, 33), "num_ranks");
        assert_invalid(layout(&topk, 2, 4, usize::MAX), "num_ranks");
        layout(&topk, 2, limits::MAX_EXPERTS, limits::MAX_RANKS).unwrap();
        // The limits themselves are fine.
        layout(&[0; 32], 32, 4, 2).unwrap();
        layout(&[-1, 3], 2, 4, 2).unwrap();
        layout(&[], 1, 4, 2).unwrap();
    }

    #[test]
    fn dispatch_rejects_bad_arguments() {
        let x = vec![0u8; 2 * 128];
        let w = [0.5f32; 4];
        let s = [1.0f32; 2];
        let good = RankInput {
            topk_idx: &[0, 1, 2, 3],
            topk_weights: Some(&w),
            x: &x,
            scales: Some(&s),
        };
        let args = DispatchArgs {
            num_scales: 1,
            ..DispatchArgs::new(4, 2, 128)
        };
        dispatch(&[good, good], &args).unwrap();

        assert_invalid(dispatch(&[], &args), "inputs");
        let with = |f: fn(&mut DispatchArgs)| {
            let mut a = args;
            f(&mut a);
            dispatch(&[good, good], &a)
        };
        assert_invalid(with(|a| a.num_experts = 3), "num_experts");
        assert_invalid(with(|a| a.num_experts = 0), "num_experts");
        assert_invalid(with(|a| a.num_topk = 0), "num_topk");
        assert_invalid(with(|a| a.num_topk = 33), "num_topk");
        assert_invalid(with(|a| a.num_topk = 3), "topk_idx");
        assert_invalid(with(|a| a.hidden_bytes = 0), "hidden_bytes");
        assert_invalid(with(|a| a.hidden_bytes = 64), "hidden_bytes");
        assert_invalid(with(|a| a.hidden_bytes = 200), "hidden_bytes");
        assert_invalid(with(|a| a.hidden_bytes = 256), "x");
        assert_invalid(with(|a| a.expert_alignment = 0), "expert_alignment");
        assert_invalid(with(|a| a.num_scales = 0), "scales");
        assert_invalid(with(|a| a.num_scales = 2), "scales");
        assert_invalid(with(|a| a.num_worst_tokens = 1), "num_worst_tokens");
        // The kernels' limits, before anything is allocated.
        assert_invalid(with(|a| a.num_experts = 1 << 40), "num_experts");
        assert_invalid(with(|a| a.hidden_bytes = 1 << 40), "hidden_bytes");
        assert_invalid(with(|a| a.num_scales = usize::MAX), "num_scales");
        assert_invalid(
            with(|a| a.expert_alignment = usize::MAX),
            "expert_alignment",
        );
        assert_invalid(with(|a| a.num_worst_tokens = 1 << 40), "num_worst_tokens");
        assert_invalid(
            with(|a| a.num_worst_tokens = usize::MAX),
            "num_worst_tokens",
        );
        // Within the limits, but outputs beyond the reference's budget.
        assert_invalid(
            with(|a| a.num_worst_tokens = limits::MAX_RECV_TOKENS),
            "num_worst_tokens",
        );
        assert_invalid(
            dispatch(&vec![good; limits::MAX_RANKS + 1], &args),
            "inputs",
        );

        let bad = |f: fn(&mut RankInput)| {
            let mut b = good;
            f(&mut b);
            dispatch(&[good, b], &args)
        };
        assert_invalid(bad(|b| b.topk_idx = &[0, 4, 2, 3]), "topk_idx");
        assert_invalid(bad(|b| b.topk_idx = &[0, -3, 2, 3]), "topk_idx");
        assert_invalid(bad(|b| b.topk_idx = &[0, 1, 2]), "topk_idx");
        assert_invalid(bad(|b| b.topk_weights = None), "topk_weights");
        assert_invalid(bad(|b| b.topk_weights = Some(&[0.5; 3])), "topk_weights");
        assert_invalid(bad(|b| b.x = &[0; 128]), "x");
        assert_invalid(bad(|b| b.scales = None), "scales");
        assert_invalid(bad(|b| b.scales = Some(&[1.0; 3])), "scales");
        // Weights on a later rank only.
        let mut first = good;
        first.topk_weights = None;
        assert_invalid(dispatch(&[first, good], &args), "topk_weights");
        // Scales with num_scales == 0.
        assert_invalid(
            dispatch(
                &[good],
                &DispatchArgs {
                    num_scales: 0,
                    ..args
                },
            ),
            "scales",
        );
    }

    #[test]
    fn dispatch_cached_rejects_bad_arguments() {
        let d = hand_dispatch(hand_args()).unwrap();
        let x = [hand_x(0), hand_x(1)];
        let s = [hand_scales(0), hand_scales(1)];
        let data = |r: usize| TokenData {
            x: &x[r],
            scales: Some(&s[r]),
        };
        let out = dispatch_cached(&d, &[data(0), data(1)], 128, 1).unwrap();
        for (c, o) in out.iter().zip(&d.ranks) {
            assert_eq!(c.recv_x, o.recv_x);
            assert_eq!(c.recv_scales, o.recv_scales);
        }
        assert_invalid(dispatch_cached(&d, &[data(0)], 128, 1), "inputs");
        assert_invalid(
            dispatch_cached(&d, &[data(0), data(1)], 100, 1),
            "hidden_bytes",
        );
        assert_invalid(dispatch_cached(&d, &[data(0), data(1)], 256, 1), "x");
        assert_invalid(dispatch_cached(&d, &[data(0), data(1)], 128, 2), "scales");
        assert_invalid(dispatch_cached(&d, &[data(0), data(1)], 128, 0), "scales");
        let no_scales = TokenData {
            x: &x[1],
            scales: None,
        };
        assert_invalid(dispatch_cached(&d, &[data(0), no_scales], 128, 1), "scales");
    }

    #[test]
    fn combine_rejects_bad_arguments() {
        const HIDDEN: usize = 64;
        let d = hand_dispatch(hand_args()).unwrap();
        let y = vec![0.0f32; 4 * HIDDEN];
        let w = vec![0.0f32; 4 * 2];
        let b0 = vec![0.0f32; 4 * HIDDEN];
        let b1 = vec![0.0f32; 3 * HIDDEN];
        let good = [
            CombineInput {
                y: &y,
                topk_weights: Some(&w),
                bias: [Some(&b0), None],
            },
            CombineInput {
                y: &y,
                topk_weights: Some(&w),
                bias: [Some(&b1), Some(&b1)],
            },
        ];
        combine(&d, &good, HIDDEN).unwrap();
        assert_invalid(combine(&d, &good[..1], HIDDEN), "inputs");
        assert_invalid(combine(&d, &good, 0), "hidden");
        assert_invalid(combine(&d, &good, 32), "hidden");
        assert_invalid(combine(&d, &good, 100), "hidden");
        assert_invalid(combine(&d, &good, 128), "y");

        fn modified<'a>(
            mut inputs: [CombineInput<'a>; 2],
            f: impl FnOnce(&mut CombineInput<'a>),
        ) -> [CombineInput<'a>; 2] {
            f(&mut inputs[1]);
            inputs
        }
        let bad = |inputs: [CombineInput; 2]| combine(&d, &inputs, HIDDEN);
        assert_invalid(bad(modified(good, |c| c.y = &y[..3 * HIDDEN])), "y");
        assert_invalid(
            bad(modified(good, |c| c.topk_weights = None)),
            "topk_weights",
        );
        assert_invalid(
            bad(modified(good, |c| c.topk_weights = Some(&w[..6]))),
            "topk_weights",
        );
        assert_invalid(bad(modified(good, |c| c.bias[0] = Some(&b0))), "bias");
        assert_invalid(
            bad(modified(good, |c| c.bias[1] = Some(&y[..HIDDEN]))),
            "bias",
        );
        let mut first_without = good;
        first_without[0].topk_weights = None;
        assert_invalid(combine(&d, &first_without, HIDDEN), "topk_weights");
    }

    // ---- bf16 helpers -------------------------------------------------------

    /// Independent rounding: the nearer of the two bf16 neighbours in f64,
    /// ties to the even one.
    fn slow_bf16_bits(x: f32) -> u16 {
        let lo = (x.to_bits() >> 16) as u16; // truncated toward zero
        let hi = lo + 1; // next bf16 away from zero
        let value = |b: u16| -> f64 {
            let v = bf16_bits_to_f32(b);
            if v.is_infinite() {
                v.signum() as f64 * 2f64.powi(128)
            } else {
                v as f64
            }
        };
        let (dlo, dhi) = ((x as f64 - value(lo)).abs(), (value(hi) - x as f64).abs());
        if dlo < dhi || (dlo == dhi && lo & 1 == 0) {
            lo
        } else {
            hi
        }
    }

    #[test]
    fn bf16_rounding_known_values() {
        assert_eq!(f32_to_bf16_bits(1.0), 0x3F80);
        assert_eq!(f32_to_bf16_bits(-2.0), 0xC000);
        assert_eq!(f32_to_bf16_bits(0.0), 0x0000);
        assert_eq!(f32_to_bf16_bits(-0.0), 0x8000);
        // bf16 keeps 7 fraction bits: the ulp of 1.0 is 2^-7.
        let ulp = 2f32.powi(-7);
        assert_eq!(round_to_bf16(1.0 + ulp / 2.0), 1.0); // tie, to even
        assert_eq!(round_to_bf16(1.0 + 1.5 * ulp), 1.0 + 2.0 * ulp); // tie, to even
        assert_eq!(round_to_bf16(1.0 + ulp / 2.0 + ulp / 64.0), 1.0 + ulp);
        assert_eq!(round_to_bf16(1.0 + ulp / 4.0), 1.0);
        assert_eq!(round_to_bf16(std::f32::consts::PI), 3.140625);
        assert_eq!(f32_to_bf16_bits(f32::MAX), 0x7F80); // overflows to inf
        assert_eq!(f32_to_bf16_bits(f32::INFINITY), 0x7F80);
        assert_eq!(f32_to_bf16_bits(f32::NEG_INFINITY), 0xFF80);
        assert_eq!(f32_to_bf16_bits(f32::NAN), 0x7FC0);
        assert_eq!(f32_to_bf16_bits(-f32::NAN), 0x7FC0);
        assert_eq!(f32_to_bf16_bits(f32::from_bits(0x7F80_0001)), 0x7FC0);
        assert_eq!(f32_to_bf16_bits(f32::from_bits(0x0000_8000)), 0x0000); // tie
        assert_eq!(f32_to_bf16_bits(f32::from_bits(0x0001_8000)), 0x0002); // tie
        assert_eq!(bf16_bits_to_f32(0x3F80), 1.0);
        assert_eq!(bf16_bits_to_f32(0x4049), 3.140625);
    }

    #[test]
    fn bf16_rounding_matches_independent_rounding() {
        with_seed("bf16 rounding", 2000, |rng| {
            let check = |b: u32| {
                let x = f32::from_bits(b);
                if !x.is_nan() {
                    assert_eq!(
                        f32_to_bf16_bits(x),
                        slow_bf16_bits(x),
                        "x = {x:e} ({b:#010x})"
                    );
                }
            };
            for _ in 0..200_000 {
                check(rng.random());
            }
            // Around every tie of a few thousand bf16 values, both signs.
            for _ in 0..5_000 {
                let hi = rng.random::<u32>() & 0xFFFF_0000;
                for low in [0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF] {
                    check(hi | low);
                }
            }
        });
    }

    #[test]
    fn bf16_ulp_distances() {
        let ulp = 2f32.powi(-7);
        assert_eq!(bf16_ulp_distance(1.0, 1.0), 0);
        assert_eq!(bf16_ulp_distance(1.0, 1.0 + ulp), 1);
        assert_eq!(bf16_ulp_distance(1.0 + ulp, 1.0), 1);
        assert_eq!(bf16_ulp_distance(1.0, 1.0 + ulp / 4.0), 0); // same after rounding
        assert_eq!(bf16_ulp_distance(0.0, -0.0), 0);
        let tiny = bf16_bits_to_f32(0x0001);
        assert_eq!(bf16_ulp_distance(tiny, -tiny), 2);
        assert_eq!(
            bf16_ulp_distance(bf16_bits_to_f32(0x7F7F), f32::INFINITY),
            1
        );
        assert_eq!(bf16_ulp_distance(f32::INFINITY, f32::INFINITY), 0);
        assert_eq!(bf16_ulp_distance(f32::NAN, 1.0), u32::MAX);
        assert_eq!(bf16_ulp_distance(1.0, f32::NAN), u32::MAX);
        assert_eq!(bf16_ulp_distance(-1.0, -1.0 - 3.0 * ulp), 3);
    }
}
