//! Typed launchers: the only place that builds kernel argument lists. Each one
//! checks what the kernel cannot, picks the launch geometry, and launches on the
//! caller's stream.

use comm::error::{CommError, Result};
use comm::StreamHandle;

use crate::module::{DeviceKernels, KernelId};
use comm::module::kernel_arg as arg;

/// `diagnostics_write_peers`: rank `rank` writes its pattern into slot `rank`
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
    let (mut t, mut n, mut r, mut w, mut s) = (peer_table, nranks, rank, words, seed);
    let mut params = [
        arg(&mut t),
        arg(&mut n),
        arg(&mut r),
        arg(&mut w),
        arg(&mut s),
    ];
    // SAFETY: argument types match the kernel signature; pointer validity is the caller's contract.
    unsafe {
        k.launch(
            KernelId::DiagnosticsWritePeers,
            (blocks_per_peer, nranks as u32, 1),
            (256, 1, 1),
            0,
            stream,
            &mut params,
        )
    }
}

/// `reduce_rows_bf16`: `out[c] = bf16(sum_r float(input[r, c]))` for a
/// row-major `[rows, cols]` bf16 matrix at `input`; `out` holds `cols` values.
///
/// # Safety
/// `input` must hold `rows * cols` and `out` `cols` bf16 values on this device.
pub unsafe fn reduce_rows_bf16(
    k: &DeviceKernels,
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
    let threads = 256u32;
    let work = if cols % 8 == 0 { cols / 8 } else { cols };
    let blocks = (work as u64).div_ceil(threads as u64).clamp(1, 1024) as u32;
    let (mut i, mut o, mut r, mut c) = (input, out, rows, cols);
    let mut params = [arg(&mut i), arg(&mut o), arg(&mut r), arg(&mut c)];
    // SAFETY: argument types match the kernel signature; pointer validity is the caller's contract.
    unsafe {
        k.launch(
            KernelId::ReduceRowsBf16,
            (blocks, 1, 1),
            (threads, 1, 1),
            0,
            stream,
            &mut params,
        )
    }
}

/// Threads (tokens) per block of `layout_dispatch`.
const LAYOUT_THREADS: u32 = 256;

/// int32 elements of the `partials` scratch [`layout_dispatch`] needs.
pub fn layout_scratch_elems(num_tokens: usize, num_experts: usize, num_ranks: usize) -> usize {
    num_tokens.div_ceil(LAYOUT_THREADS as usize).max(1) * (num_experts + num_ranks)
}

/// `layout_dispatch`: per-rank and per-expert token counts and
/// `is_token_in_rank` from `topk_idx` (`[num_tokens, num_topk]` int64, -1 =
/// none), with the semantics of `ep_core::reference::layout`. Every output
/// element is written. An id outside `[-1, num_experts)` counts nowhere and is
/// recorded (rank `rank`, its token, column and value) in the device error
/// record at `error` (0: not recorded).
/// `partials` is int32 scratch of [`layout_scratch_elems`] elements (any
/// content); `ticket` a device u32 that is 0 and is left 0.
///
/// # Safety
/// `topk_idx` must hold `num_tokens * num_topk` int64 values, the outputs
/// `[num_ranks]` int32, `[num_experts]` int32 and `[num_tokens, num_ranks]`
/// bytes, the scratch as documented, all on this device.
#[allow(clippy::too_many_arguments)]
pub unsafe fn layout_dispatch(
    k: &DeviceKernels,
    stream: StreamHandle,
    topk_idx: u64,
    num_tokens: i32,
    num_topk: i32,
    num_experts: i32,
    num_ranks: i32,
    num_tokens_per_rank: u64,
    num_tokens_per_expert: u64,
    is_token_in_rank: u64,
    partials: u64,
    ticket: u64,
    error: u64,
    rank: i32,
) -> Result<()> {
    if num_ranks <= 0 || num_ranks > 32 || num_experts <= 0 || num_experts % num_ranks != 0 {
        return Err(CommError::invalid(
            "num_experts",
            format!(
                "{num_experts} experts cannot be split evenly over {num_ranks} ranks \
                 (1 to 32 ranks)"
            ),
        ));
    }
    let smem = 4 * (num_experts as u64 + num_ranks as u64);
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
    let (mut ids, mut n, mut kk, mut e, mut r) =
        (topk_idx, num_tokens, num_topk, num_experts, num_ranks);
    let (mut per_rank, mut per_expert, mut in_rank, mut part, mut tk, mut err, mut rk) = (
        num_tokens_per_rank,
        num_tokens_per_expert,
        is_token_in_rank,
        partials,
        ticket,
        error,
        rank,
    );
    let mut params = [
        arg(&mut ids),
        arg(&mut n),
        arg(&mut kk),
        arg(&mut e),
        arg(&mut r),
        arg(&mut per_rank),
        arg(&mut per_expert),
        arg(&mut in_rank),
        arg(&mut part),
        arg(&mut tk),
        arg(&mut err),
        arg(&mut rk),
    ];
    // SAFETY: argument types match the kernel signature; pointer validity is the caller's contract.
    unsafe {
        k.launch(
            KernelId::LayoutDispatch,
            (blocks, 1, 1),
            (LAYOUT_THREADS, 1, 1),
            smem as u32,
            stream,
            &mut params,
        )
    }
}
