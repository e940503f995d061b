//! Typed launchers: the only place that builds kernel argument lists. Each one
//! checks what the kernel cannot, picks the launch geometry, and launches on the
//! caller's stream.

use comm::error::{CommError, Result};
use comm::{Device, StreamHandle};

use crate::module::{DeviceKernels, KernelId};

/// `DiagnosticsParams` of diagnostics.cu (kernel `moelink::diagnostics::write_peers`).
#[derive(Clone, Copy, Debug)]
#[repr(C)]
struct DiagnosticsParams {
    peers: u64,
    words: u64,
    seed: u64,
    nranks: i32,
    rank: i32,
}

/// `ReduceRowsParams` of reduce_rows.cu (kernel `moelink::reduce_rows_bf16`).
#[derive(Clone, Copy, Debug)]
#[repr(C)]
struct ReduceRowsParams {
    input: u64,
    out: u64,
    rows: i64,
    cols: i64,
}

/// The layout kernel's argument block (`moelink::layout::Params` of
/// layout.cu, kernel `moelink::layout::count_tokens`): device addresses and
/// sizes, see [`layout_dispatch`].
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct LayoutParams {
    /// `[num_tokens, num_topk]` int64 expert ids (-1 = none).
    pub topk_idx: u64,
    /// Out: `[num_ranks]` int32.
    pub num_tokens_per_rank: u64,
    /// Out: `[num_experts]` int32.
    pub num_tokens_per_expert: u64,
    /// Out: `[num_tokens, num_ranks]` bool.
    pub is_token_in_rank: u64,
    /// int32 scratch of [`layout_scratch_elems`] elements (any content).
    pub partials: u64,
    /// A device u32 that is 0 and is left 0.
    pub ticket: u64,
    /// Device error record for an id out of range (0: not recorded).
    pub error: u64,
    pub num_tokens: i32,
    pub num_topk: i32,
    pub num_experts: i32,
    pub num_ranks: i32,
    /// This rank (named in the error record).
    pub rank: i32,
    /// Out: `[num_ranks / ranks_per_node]` int32 tokens per node (DeepEP's
    /// `num_tokens_per_rdma_rank`: a token counts once per node holding any
    /// of its experts), or 0.
    pub num_tokens_per_node: u64,
    /// Consecutive ranks per node (with `num_tokens_per_node`).
    pub ranks_per_node: i32,
    pub pad: i32,
}

// The same numbers as the kernels' static_asserts (a CPU test reads them).
param_layout!(DIAGNOSTICS_LAYOUT = { DiagnosticsParams: 32 });
param_layout!(REDUCE_ROWS_LAYOUT = { ReduceRowsParams: 32 });
param_layout!(LAYOUT_LAYOUT = { LayoutParams as Params: 96 { num_tokens: 56, rank: 72 } });

/// `moelink::diagnostics::write_peers`: rank `rank` writes its pattern into slot `rank`
/// of every peer buffer. `peer_table` is a device array of `nranks` pointers
/// (`peer_table[p]` = rank p's buffer as mapped here), each buffer at least
/// `nranks * words * 8` bytes.
///
/// # Safety
/// The pointers in `peer_table` must be valid, mapped, and large enough.
pub unsafe fn diagnostics_write_peers(
    k: &DeviceKernels,
    stream: StreamHandle,
    peer_table: u64,
    nranks: i32,
    rank: i32,
    words: u64,
    seed: u64,
) -> Result<()> {
    if nranks <= 0 || rank < 0 || rank >= nranks {
        return Err(CommError::invalid(
            "rank",
            format!("rank {rank} of {nranks}"),
        ));
    }
    if words == 0 {
        return Ok(());
    }
    let blocks_per_peer = words.div_ceil(256 * 4).clamp(1, 32) as u32;
    let p = DiagnosticsParams {
        peers: peer_table,
        words,
        seed,
        nranks,
        rank,
    };
    // SAFETY: DiagnosticsParams mirrors the kernel's block; pointer validity is the caller's contract.
    unsafe {
        k.launch_params(
            KernelId::DiagnosticsWritePeers,
            (blocks_per_peer, nranks as u32),
            256,
            0,
            stream,
            p,
        )
    }
}

/// `moelink::reduce_rows_bf16`: `out[c] = bf16(sum_r float(input[r, c]))` for a
/// row-major `[rows, cols]` bf16 matrix at `input` on `device`; `out` holds
/// `cols` values (a test helper of the Python package: `moelink._testing`).
///
/// # Safety
/// `input` must hold `rows * cols` and `out` `cols` bf16 values on `device`.
pub unsafe fn reduce_rows_bf16(
    device: Device,
    stream: StreamHandle,
    input: u64,
    out: u64,
    rows: i64,
    cols: i64,
) -> Result<()> {
    if rows < 0 || cols < 0 {
        return Err(CommError::invalid("shape", format!("[{rows}, {cols}]")));
    }
    if cols == 0 {
        return Ok(());
    }
    let k = DeviceKernels::get(device)?;
    let threads = 256u32;
    let work = if cols % 8 == 0 { cols / 8 } else { cols };
    let blocks = (work as u64).div_ceil(threads as u64).clamp(1, 1024) as u32;
    let p = ReduceRowsParams {
        input,
        out,
        rows,
        cols,
    };
    // SAFETY: ReduceRowsParams mirrors the kernel's block; pointer validity is the caller's contract.
    unsafe { k.launch_params(KernelId::ReduceRowsBf16, (blocks, 1), threads, 0, stream, p) }
}

/// Threads (tokens) per block of the layout kernel.
const LAYOUT_THREADS: u32 = 256;

/// int32 elements of the `partials` scratch [`layout_dispatch`] needs.
pub fn layout_scratch_elems(num_tokens: usize, num_experts: usize, num_ranks: usize) -> usize {
    num_tokens.div_ceil(LAYOUT_THREADS as usize).max(1) * (num_experts + 2 * num_ranks)
}

/// The layout kernel (`moelink::layout::count_tokens`): per-rank and
/// per-expert token counts and
/// `is_token_in_rank` from `topk_idx`, with the semantics of
/// `ep_reference::normal::layout`. Every output element is written. An id
/// outside `[-1, num_experts)` counts nowhere and is recorded (rank, token,
/// column and value) in the device error record.
///
/// # Safety
/// Every address of `p` valid on this device for the sizes documented in
/// [`LayoutParams`].
pub unsafe fn layout_dispatch(
    k: &DeviceKernels,
    stream: StreamHandle,
    p: LayoutParams,
) -> Result<()> {
    let LayoutParams {
        num_tokens,
        num_topk,
        num_experts,
        num_ranks,
        ..
    } = p;
    if num_ranks <= 0 || num_ranks > 32 || num_experts <= 0 || num_experts % num_ranks != 0 {
        return Err(CommError::invalid(
            "num_experts",
            format!(
                "{num_experts} experts cannot be split evenly over {num_ranks} ranks \
                 (1 to 32 ranks)"
            ),
        ));
    }
    if p.num_tokens_per_node != 0 && (p.ranks_per_node <= 0 || num_ranks % p.ranks_per_node != 0) {
        return Err(CommError::invalid(
            "ranks_per_node",
            format!("{} does not divide {num_ranks} ranks", p.ranks_per_node),
        ));
    }
    let smem = 4 * (num_experts as u64 + 2 * num_ranks as u64);
    if smem > 48 * 1024 {
        return Err(CommError::invalid(
            "num_experts",
            format!(
                "{num_experts} experts: at most {} supported",
                48 * 1024 / 4 - 32
            ),
        ));
    }
    if num_tokens < 0 || !(1..=32).contains(&num_topk) {
        return Err(CommError::invalid(
            "topk_idx",
            format!("shape [{num_tokens}, {num_topk}] (top-k must be 1..=32)"),
        ));
    }
    let blocks = (num_tokens as u32).div_ceil(LAYOUT_THREADS).max(1);
    // SAFETY: LayoutParams mirrors the kernel's block; pointer validity is the caller's contract.
    unsafe {
        k.launch_params(
            KernelId::LayoutCountTokens,
            (blocks, 1),
            LAYOUT_THREADS,
            smem as u32,
            stream,
            p,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn param_blocks_match_the_kernels_static_asserts() {
        let files = [
            (
                "diagnostics.cu",
                include_str!("../cuda/diagnostics.cu"),
                DIAGNOSTICS_LAYOUT,
            ),
            (
                "reduce_rows.cu",
                include_str!("../cuda/reduce_rows.cu"),
                REDUCE_ROWS_LAYOUT,
            ),
            (
                "layout.cu",
                include_str!("../cuda/layout.cu"),
                LAYOUT_LAYOUT,
            ),
        ];
        for (file, cu, table) in files {
            crate::check_static_asserts(file, cu, table);
        }
    }
}
