//! Launchers of the intranode dispatch/combine kernels (`cuda/intranode.cu`).
//! The host side that owns buffers and channels is `ep_core::intranode`; this
//! module only mirrors the kernels' argument structs and builds launches.
//!
//! All pointers are device addresses (`0` = absent where the kernel allows it).

use std::mem::offset_of;

use comm::error::{CommError, Result};
use comm::StreamHandle;

use crate::module::{DeviceKernels, KernelId};

/// Largest rank count the kernels handle (one warp lane per rank).
pub use crate::limits::MAX_RANKS;
use crate::limits::{MAX_TOPK, ROW_BYTES_ALIGNMENT};
/// Bytes of one half of the control region (two halves alternate per notify).
pub const CTRL_HALF_BYTES: u64 = 32 * 1024;
/// Bytes of the control region at the start of every NVL buffer.
pub const CTRL_BYTES: u64 = 2 * CTRL_HALF_BYTES;
/// Threads per block of the data kernels (32 warps).
pub const THREADS: u32 = 1024;
/// Threads per block of `combine_direct_wide` (`kWideThreads`).
pub const WIDE_THREADS: u32 = 512;
const NOTIFY_THREADS: u32 = 1024;

/// `moelink::intranode::Ctx`.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct IntranodeCtx {
    /// Device array of `num_ranks` `MemoryChannelDeviceHandle`s.
    pub channels: u64,
    /// This rank's NVL buffer.
    pub local: u64,
    /// Device u32, zero between kernels.
    pub ticket: u64,
    /// Device u64 counter of notify calls.
    pub epoch: u64,
    pub dispatch_offset: u64,
    pub combine_offset: u64,
    pub dispatch_slots: i64,
    pub combine_slots: i64,
    /// Bound of every device wait, nanoseconds of GPU time.
    pub timeout_ns: i64,
    pub rank: i32,
    pub num_ranks: i32,
}

/// `moelink::intranode::RecordLayout`: where a dispatch record's fields sit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct RecordLayout {
    pub bytes: i64,
    pub hidden_bytes: i32,
    pub num_scales: i32,
    pub idx_offset: i32,
    pub w_offset: i32,
    pub src_offset: i32,
    pub num_topk: i32,
}

const _: () = assert!(offset_of!(IntranodeCtx, rank) == 72);

/// `moelink::intranode::NotifyParams`: the argument block of the notify
/// kernel (`moelink::intranode::notify`), launched by [`dispatch_notify`].
#[derive(Clone, Copy, Debug)]
#[repr(C)]
struct NotifyParams {
    c: IntranodeCtx,
    is_token_in_rank: u64,
    num_tokens_per_expert: u64,
    rank_prefix_matrix: u64,
    send_head: u64,
    common: NotifyCommon,
    pool_header: u64,
    pool_value: RecvPoolHeader,
}

/// The fields of both notify kernels' argument blocks from `host_counts` to
/// `num_topk` (the .cu structs list them one by one; the same bytes), taken
/// from the call's [`NotifyArgs`] by [`notify_common`].
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub(crate) struct NotifyCommon {
    pub(crate) host_counts: u64,
    pub(crate) host_epoch: u64,
    pub(crate) epoch_value: u64,
    pub(crate) topk_idx: u64,
    pub(crate) error: u64,
    pub(crate) num_tokens: i32,
    pub(crate) experts_per_rank: i32,
    pub(crate) expert_alignment: i32,
    pub(crate) num_topk: i32,
}

/// `moelink::intranode::DispatchSendParams`.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub(crate) struct DispatchSendParams {
    c: IntranodeCtx,
    rec: RecordLayout,
    x: u64,
    scales: u64,
    /// `scale_stride0`, `scale_stride1`.
    scale_strides: [i64; 2],
    topk_idx: u64,
    topk_weights: u64,
    send_head: u64,
    num_tokens: i32,
    experts_per_rank: i32,
}

/// `moelink::intranode::DispatchRecvParams`.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub(crate) struct DispatchRecvParams {
    c: IntranodeCtx,
    rec: RecordLayout,
    rank_prefix_matrix: u64,
    num_rows: i64,
    recv_x: u64,
    recv_scales: u64,
    /// `scale_stride0`, `scale_stride1`.
    scale_strides: [i64; 2],
    recv_topk_idx: u64,
    recv_topk_weights: u64,
    recv_src_idx: u64,
}

/// `moelink::intranode::CombineSendParams`.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub(crate) struct CombineSendParams {
    c: IntranodeCtx,
    y: u64,
    row_bytes: i64,
    topk_weights: u64,
    record_bytes: i64,
    rank_prefix_matrix: u64,
    num_topk: i32,
}

/// `moelink::intranode::CombineRecvParams`.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub(crate) struct CombineRecvParams {
    c: IntranodeCtx,
    send_head: u64,
    record_bytes: i64,
    /// `bias0`, `bias1`.
    bias: [u64; 2],
    out: u64,
    out_weights: u64,
    num_tokens: i32,
    hidden: i32,
    num_topk: i32,
}

/// `moelink::intranode::DispatchFusedParams`.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub(crate) struct DispatchFusedParams {
    send: DispatchSendParams,
    recv: DispatchRecvParams,
    send_calls: u64,
    recv_calls: u64,
    recv_ticket: u64,
    error: u64,
    prof: u64,
    num_send_blocks: i32,
    barrier: i32,
}

/// `moelink::intranode::CombineFusedParams`.
/// `moelink::intranode::PackedLayout`: the packed dispatch's arrays (byte
/// offsets in every rank's NVL buffer, `capacity` rows each), which the
/// senders fill in received-row order and one device copy per array moves into
/// the outputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct PackedLayout {
    pub rows: i64,
    pub scales: i64,
    pub idx: i64,
    pub w: i64,
    pub src: i64,
    pub capacity: i64,
}

/// `moelink::intranode::RecvPoolHeader`: where a direct dispatch's recv_x lies
/// in its receiver's pool (the pool's first bytes; `rows` -1: not there).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct RecvPoolHeader {
    pub offset: i64,
    pub rows: i64,
}

impl RecvPoolHeader {
    /// This call's recv_x is not in the pool: the rows go to the packed arrays.
    pub const ABSENT: RecvPoolHeader = RecvPoolHeader {
        offset: 0,
        rows: -1,
    };
}

#[derive(Clone, Copy, Debug)]
#[repr(C)]
struct DispatchPackedParams {
    send: DispatchSendParams,
    packed: PackedLayout,
    rank_prefix_matrix: u64,
    pools: u64,
}

#[derive(Clone, Copy, Debug)]
#[repr(C)]
struct PublishBarrierParams {
    c: IntranodeCtx,
    header: u64,
    value: RecvPoolHeader,
    calls: u64,
}

#[derive(Clone, Copy, Debug)]
#[repr(C)]
struct FinishRowsParams {
    recv: DispatchRecvParams,
    packed: PackedLayout,
    copy_scales: i32,
    pad: i32,
}

#[derive(Clone, Copy, Debug)]
#[repr(C)]
struct CombineFusedParams {
    send: CombineSendParams,
    recv: CombineRecvParams,
    calls: u64,
    error: u64,
    prof: u64,
    num_send_blocks: i32,
    barrier: i32,
}

/// `moelink::intranode::CombineDirectParams`.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
struct CombineDirectParams {
    f: CombineFusedParams,
    pools: u64,
    header_offset: i32,
    finish: i32,
}

/// Bytes into every receive pool of the first of the direct combine's two
/// headers (the other 16 bytes on; the parity of the device's count of
/// completed combines picks one), after the direct dispatch's
/// (`kCombineHeaderOffset`).
pub const COMBINE_HEADER_OFFSET: u64 = 16;

// The same numbers as the static_asserts in intranode.cuh (a CPU test reads them there).
param_layout!(
    PARAM_LAYOUT = {
        NotifyParams: 192 {
            pool_header: 168,
            epoch_value in common: 128,
            num_tokens in common: 152,
        },
        DispatchSendParams: 176 { x: 112, num_tokens: 168 },
        DispatchRecvParams: 184 { num_rows: 120, recv_src_idx: 176 },
        CombineSendParams: 128 { num_topk: 120 },
        CombineRecvParams: 144 { num_tokens: 128 },
        DispatchFusedParams: 408 { recv: 176, num_send_blocks: 400 },
        CombineFusedParams: 304 { recv: 128, num_send_blocks: 296 },
        IntranodeCtx as Ctx: 80,
        RecordLayout: 32,
        PackedLayout: 48,
        RecvPoolHeader: 16,
        DispatchPackedParams: 240 { rank_prefix_matrix: 224, pools: 232 },
        PublishBarrierParams: 112,
        CombineDirectParams: 320 { pools: 304, header_offset: 312 },
        FinishRowsParams: 240 { copy_scales: 232 },
    }
);

const fn round_up(n: i64, m: i64) -> i64 {
    (n + m - 1) / m * m
}

impl RecordLayout {
    /// Record of a dispatch: row | `num_scales` f32 | `num_topk` i64 local ids |
    /// `num_topk` f32 weights | i32 source index, padded so that the record
    /// ends in an 8-byte flag (the fused kernels') at a multiple of 16 bytes.
    pub fn dispatch(hidden_bytes: usize, num_scales: usize, num_topk: usize) -> Result<Self> {
        if hidden_bytes == 0 || hidden_bytes % ROW_BYTES_ALIGNMENT != 0 {
            return Err(CommError::invalid(
                "hidden_bytes",
                format!("{hidden_bytes} is not a positive multiple of {ROW_BYTES_ALIGNMENT}"),
            ));
        }
        if num_topk > MAX_TOPK {
            return Err(CommError::invalid(
                "num_topk",
                format!("{num_topk} is above {MAX_TOPK}"),
            ));
        }
        let h = hidden_bytes as i64;
        let idx = round_up(h + 4 * num_scales as i64, 8);
        let w = idx + 8 * num_topk as i64;
        let src = w + 4 * num_topk as i64;
        let bytes = round_up(src + 4 + FLAG_BYTES, 16);
        let fits =
            |v: i64| i32::try_from(v).map_err(|_| CommError::invalid("hidden_bytes", "too large"));
        Ok(RecordLayout {
            bytes,
            hidden_bytes: fits(h)?,
            num_scales: fits(num_scales as i64)?,
            idx_offset: fits(idx)?,
            w_offset: fits(w)?,
            src_offset: fits(src)?,
            num_topk: num_topk as i32,
        })
    }
}

/// Bytes of a combine record: a bf16 row of `hidden` plus `num_topk` f32
/// weights, padded so that it ends in an 8-byte flag at a multiple of 16 bytes.
impl PackedLayout {
    /// The arrays of a packed dispatch of records `rec` in a dispatch region
    /// of `slots` records per source rank at byte `offset` (the fixed-slot
    /// layout's region: `ranks * slots` rows of each array fit in it, since a
    /// record holds every field and more). The rows start 16-byte aligned (a
    /// multiple of 128 bytes each), the ids 8-byte aligned, the rest 4.
    pub fn new(rec: &RecordLayout, offset: u64, ranks: usize, slots: usize) -> PackedLayout {
        let capacity = (ranks * slots) as i64;
        let k = rec.num_topk as i64;
        let rows = offset as i64;
        let scales = rows + capacity * rec.hidden_bytes as i64;
        let idx = round_up(scales + capacity * 4 * rec.num_scales as i64, 8);
        let w = idx + capacity * 8 * k;
        let src = w + capacity * 4 * k;
        PackedLayout {
            rows,
            scales,
            idx,
            w,
            src,
            capacity,
        }
    }

    /// One past the last byte the arrays use.
    pub fn end(&self) -> i64 {
        self.src + 4 * self.capacity
    }
}

pub fn combine_record_bytes(hidden: usize, num_topk: usize) -> i64 {
    round_up(2 * hidden as i64 + 4 * num_topk as i64 + FLAG_BYTES, 16)
}

/// Bytes of the flag that ends every dispatch and combine record (written by
/// the fused kernels after the record, polled by the receiving warp).
pub const FLAG_BYTES: i64 = 8;

pub(crate) fn check_ctx(c: &IntranodeCtx) -> Result<()> {
    if c.num_ranks <= 0 || c.num_ranks as usize > MAX_RANKS || c.rank < 0 || c.rank >= c.num_ranks {
        return Err(CommError::invalid(
            "rank",
            format!(
                "rank {} of {} (at most {MAX_RANKS} ranks)",
                c.rank, c.num_ranks
            ),
        ));
    }
    Ok(())
}

/// Grid of a data kernel: `num_sms` blocks, fewer when there is less work.
fn data_grid(num_sms: u32, rows: i64) -> u32 {
    let warps = (THREADS / 32) as i64;
    let needed = (rows.max(1) + warps - 1) / warps;
    (num_sms as i64).min(needed).max(1) as u32
}

/// Launches kernel `id` on `blocks` blocks of [`THREADS`] threads, without
/// dynamic shared memory, on `stream` (the geometry of every data and fused
/// kernel of this module and of [`crate::internode`]).
///
/// # Safety
/// `p` mirrors kernel `id`'s argument block; its pointers are the caller's
/// contract.
pub(crate) unsafe fn launch_blocks<P: Copy>(
    k: &DeviceKernels,
    stream: StreamHandle,
    id: KernelId,
    blocks: u32,
    p: P,
) -> Result<()> {
    // SAFETY: forwarded from the caller's contract.
    unsafe { k.launch_params(id, (blocks, 1), THREADS, 0, stream, p) }
}

/// Outputs and inputs of [`dispatch_notify`].
#[derive(Clone, Copy, Debug)]
pub struct NotifyArgs {
    /// `[N, R]` bool.
    pub is_token_in_rank: u64,
    /// `[E]` int32.
    pub num_tokens_per_expert: u64,
    pub num_tokens: i32,
    pub experts_per_rank: i32,
    pub expert_alignment: i32,
    /// Out: `[R, R]` int32.
    pub rank_prefix_matrix: u64,
    /// Out: `[N, R]` int32.
    pub send_head: u64,
    /// Host-mapped int32 `[1 + E_local]` (device address).
    pub host_counts: u64,
    /// Host-mapped u64 (device address), set to `epoch_value` last.
    pub host_epoch: u64,
    pub epoch_value: u64,
    /// `[N, num_topk]` int64 expert ids, checked against `[-1, E)`; 0: none.
    pub topk_idx: u64,
    pub num_topk: i32,
    /// comm's `DeviceError` record (device address): the first id out of
    /// range, before `host_epoch` is written.
    pub error: u64,
    /// Direct dispatch: this rank's receive pool (device address), into which
    /// notify writes `pool_value` before its barrier; 0: none.
    pub pool_header: u64,
    pub pool_value: RecvPoolHeader,
}

/// Checks a notify's experts (at least one per rank, with `num_ranks` rows of
/// `row_words + experts_per_rank` int32 counts fitting one half of the
/// control region, and an alignment of at least 1) and its device error
/// record.
pub(crate) fn check_notify(a: &NotifyArgs, num_ranks: i32, row_words: i32) -> Result<()> {
    let row = row_words as u64 + a.experts_per_rank as u64;
    if row * num_ranks as u64 * 4 > CTRL_HALF_BYTES || a.experts_per_rank <= 0 {
        return Err(CommError::invalid(
            "num_experts",
            format!(
                "{} experts per rank with {} ranks do not fit the control region",
                a.experts_per_rank, num_ranks
            ),
        ));
    }
    if a.expert_alignment < 1 {
        return Err(CommError::invalid("expert_alignment", "must be at least 1"));
    }
    if a.error == 0 {
        return Err(CommError::invalid(
            "error",
            "the device error record is required",
        ));
    }
    Ok(())
}

pub(crate) fn notify_common(a: &NotifyArgs) -> NotifyCommon {
    NotifyCommon {
        host_counts: a.host_counts,
        host_epoch: a.host_epoch,
        epoch_value: a.epoch_value,
        topk_idx: a.topk_idx,
        error: a.error,
        num_tokens: a.num_tokens,
        experts_per_rank: a.experts_per_rank,
        expert_alignment: a.expert_alignment,
        num_topk: a.num_topk,
    }
}

/// # Safety
/// Every pointer must be valid on this device for the sizes documented in
/// [`NotifyArgs`]; the context's buffers and channels must be live.
pub unsafe fn dispatch_notify(
    k: &DeviceKernels,
    stream: StreamHandle,
    ctx: IntranodeCtx,
    a: NotifyArgs,
) -> Result<()> {
    check_ctx(&ctx)?;
    check_notify(&a, ctx.num_ranks, ctx.num_ranks)?;
    if a.topk_idx != 0 && !(1..=crate::limits::MAX_TOPK as i32).contains(&a.num_topk) {
        return Err(CommError::invalid(
            "topk_idx",
            format!("{} columns; 1 to {}", a.num_topk, crate::limits::MAX_TOPK),
        ));
    }
    let p = NotifyParams {
        c: ctx,
        is_token_in_rank: a.is_token_in_rank,
        num_tokens_per_expert: a.num_tokens_per_expert,
        rank_prefix_matrix: a.rank_prefix_matrix,
        send_head: a.send_head,
        common: notify_common(&a),
        pool_header: a.pool_header,
        pool_value: a.pool_value,
    };
    // SAFETY: NotifyParams mirrors the kernel's block; pointers are the caller's contract.
    unsafe {
        k.launch_params(
            KernelId::IntranodeNotify,
            (1, 1),
            NOTIFY_THREADS,
            0,
            stream,
            p,
        )
    }
}

/// The kernels that take only the [`IntranodeCtx`] (one warp).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CtxKernel {
    /// One signal and one wait per peer pair, before a cached dispatch
    /// (`moelink::intranode::barrier`).
    DispatchBarrier,
    /// The same kernel before a combine.
    CombineBarrier,
    /// One wait per peer for its end-of-send signal, after the separate
    /// dispatch send (`moelink::intranode::wait_peers`).
    DispatchWait,
    /// The same kernel after the separate combine send.
    CombineWait,
}

/// Launches `kernel` with the context alone.
///
/// # Safety
/// The context's channels must be live.
pub unsafe fn ctx_kernel(
    k: &DeviceKernels,
    stream: StreamHandle,
    ctx: IntranodeCtx,
    kernel: CtxKernel,
) -> Result<()> {
    check_ctx(&ctx)?;
    let id = match kernel {
        CtxKernel::DispatchBarrier | CtxKernel::CombineBarrier => KernelId::IntranodeBarrier,
        CtxKernel::DispatchWait | CtxKernel::CombineWait => KernelId::IntranodeWaitPeers,
    };
    // SAFETY: the kernel takes the Ctx by value; its channels are live.
    unsafe { k.launch_params(id, (1, 1), 32, 0, stream, ctx) }
}

/// The separate (not fused) data kernels, with their arguments: each on
/// `num_sms` blocks at most, fewer when there is less work.
#[derive(Clone, Copy, Debug)]
pub enum DataKernel {
    /// The send half of a dispatch (`moelink::intranode::dispatch_send`);
    /// the peers' regions must be free (after notify or a barrier).
    DispatchSend(SendArgs),
    /// The receive half of a dispatch, after `wait_peers` ([`ctx_kernel`]).
    DispatchRecv(RecvArgs),
    /// The send half of a combine; the sources' combine regions must be free.
    CombineSend(CombineSendArgs),
    /// The reduction of a combine, after `wait_peers` ([`ctx_kernel`]).
    CombineRecv(CombineRecvArgs),
}

/// Launches `kernel`.
///
/// # Safety
/// The pointers of its arguments valid for their documented sizes, in the
/// order its variant states.
pub unsafe fn data_kernel(
    k: &DeviceKernels,
    stream: StreamHandle,
    ctx: IntranodeCtx,
    kernel: DataKernel,
) -> Result<()> {
    check_ctx(&ctx)?;
    // SAFETY: every argument block mirrors its kernel's; pointers are the
    // caller's contract.
    unsafe {
        match kernel {
            DataKernel::DispatchSend(a) => {
                let p = send_params(ctx, &a)?;
                let grid = data_grid(a.num_sms, a.num_tokens as i64);
                launch_blocks(k, stream, KernelId::DispatchSend, grid, p)
            }
            DataKernel::DispatchRecv(a) => {
                let p = recv_params(ctx, &a);
                let grid = data_grid(a.num_sms, a.out.num_rows);
                launch_blocks(k, stream, KernelId::DispatchRecv, grid, p)
            }
            DataKernel::CombineSend(a) => {
                let p = combine_send_params(ctx, &a);
                let grid = data_grid(a.num_sms, a.num_rows);
                launch_blocks(k, stream, KernelId::CombineSend, grid, p)
            }
            DataKernel::CombineRecv(a) => {
                let p = combine_recv_params(ctx, &a)?;
                let grid = data_grid(a.num_sms, a.num_tokens as i64);
                launch_blocks(k, stream, KernelId::CombineRecv, grid, p)
            }
        }
    }
}

/// Inputs of [`DataKernel::DispatchSend`].
#[derive(Clone, Copy, Debug)]
pub struct SendArgs {
    pub rec: RecordLayout,
    /// `[N, hidden_bytes]`, 16-byte aligned.
    pub x: u64,
    /// f32 scales `[N, num_scales]` with element strides, or 0.
    pub scales: u64,
    pub scale_strides: (i64, i64),
    /// `[N, K]` int64 / f32, or 0 (`rec.num_topk == 0` without ids).
    pub topk_idx: u64,
    pub topk_weights: u64,
    /// `[N, R]` int32 slots.
    pub send_head: u64,
    pub num_tokens: i32,
    pub experts_per_rank: i32,
    pub num_sms: u32,
}

/// Launches `dispatch_send_packed`: [`DataKernel::DispatchSend`] with every copy of a
/// token written to its received row of the destination's packed arrays
/// (`rank_prefix_matrix` `[R, R]` int32 on the device: notify's, or the
/// handle's for a cached dispatch).
///
/// `pools` (direct dispatch): a device array `[R]` of every rank's receive
/// pool as mapped here, whose headers [`publish_barrier`] wrote; 0: packed.
///
/// # Safety
/// As [`DataKernel::DispatchSend`]; `packed` lies in every rank's dispatch region; a
/// pool header that names rows names a range of its pool that the pool's
/// owner holds for this call's recv_x.
pub unsafe fn dispatch_send_packed(
    k: &DeviceKernels,
    stream: StreamHandle,
    ctx: IntranodeCtx,
    a: SendArgs,
    packed: PackedLayout,
    rank_prefix_matrix: u64,
    pools: u64,
) -> Result<()> {
    let grid = data_grid(a.num_sms, a.num_tokens as i64);
    let p = DispatchPackedParams {
        send: send_params(ctx, &a)?,
        packed,
        rank_prefix_matrix,
        pools,
    };
    // SAFETY: as above.
    unsafe { launch_blocks(k, stream, KernelId::DispatchSendPacked, grid, p) }
}

/// Launches `publish_barrier`: `value` into this rank's receive pool header
/// (`header`, a device address), then one signal to and one wait for every
/// peer (the barrier before a direct dispatch's sends).
///
/// # Safety
/// The context's channels must be live; `header` is this rank's pool.
pub unsafe fn publish_barrier(
    k: &DeviceKernels,
    stream: StreamHandle,
    ctx: IntranodeCtx,
    header: u64,
    value: RecvPoolHeader,
) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { launch_publish_barrier(k, stream, ctx, header, value, 0) }
}

/// Launches `publish_barrier` before a direct combine ([`DirectCombine`]):
/// `value` into the combine header of this rank's receive pool (`pool`, its
/// device base address) that the device count of completed combines
/// (`state.send_calls`) picks: [`COMBINE_HEADER_OFFSET`], plus 16 bytes after
/// an odd count. The device picks it, so CUDA graph replays alternate the two
/// headers as eager calls do.
///
/// # Safety
/// As [`publish_barrier`]; `pool` is this rank's pool, and `state` the one
/// the following direct [`combine_fused`] gets.
pub unsafe fn publish_combine_barrier(
    k: &DeviceKernels,
    stream: StreamHandle,
    ctx: IntranodeCtx,
    pool: u64,
    value: RecvPoolHeader,
    state: &FusedState,
) -> Result<()> {
    if state.send_calls == 0 {
        return Err(CommError::invalid(
            "fused state",
            "the combine's device call counter is required",
        ));
    }
    let header = pool + COMBINE_HEADER_OFFSET;
    // SAFETY: the caller's contract.
    unsafe { launch_publish_barrier(k, stream, ctx, header, value, state.send_calls) }
}

/// `publish_barrier`'s launch; `calls` 0 or a device counter whose parity
/// picks `header` or the one 16 bytes after it.
unsafe fn launch_publish_barrier(
    k: &DeviceKernels,
    stream: StreamHandle,
    ctx: IntranodeCtx,
    header: u64,
    value: RecvPoolHeader,
    calls: u64,
) -> Result<()> {
    check_ctx(&ctx)?;
    let p = PublishBarrierParams {
        c: ctx,
        header,
        value,
        calls,
    };
    // SAFETY: PublishBarrierParams mirrors the kernel's block; the caller's contract.
    unsafe { k.launch_params(KernelId::PublishBarrier, (1, 1), 32, 0, stream, p) }
}

/// Launches `finish_rows` after the device copies moved a packed dispatch's
/// arrays into the outputs: padding rows, poisoned rows after a timeout, and
/// the scales when `copy_scales` (a strided `recv_scales`).
///
/// # Safety
/// As [`DataKernel::DispatchRecv`].
pub unsafe fn finish_rows(
    k: &DeviceKernels,
    stream: StreamHandle,
    ctx: IntranodeCtx,
    a: RecvArgs,
    packed: PackedLayout,
    copy_scales: bool,
) -> Result<()> {
    check_ctx(&ctx)?;
    let grid = data_grid(a.num_sms, a.out.num_rows);
    let p = FinishRowsParams {
        recv: recv_params(ctx, &a),
        packed,
        copy_scales: copy_scales as i32,
        pad: 0,
    };
    // SAFETY: as above.
    unsafe { launch_blocks(k, stream, KernelId::FinishRows, grid, p) }
}

/// The send half's argument block (checked).
pub(crate) fn send_params(ctx: IntranodeCtx, a: &SendArgs) -> Result<DispatchSendParams> {
    check_ctx(&ctx)?;
    if a.num_tokens as i64 > ctx.dispatch_slots {
        return Err(CommError::invalid(
            "x",
            format!(
                "{} tokens do not fit the buffer's {} slots per rank",
                a.num_tokens, ctx.dispatch_slots
            ),
        ));
    }
    Ok(DispatchSendParams {
        c: ctx,
        rec: a.rec,
        x: a.x,
        scales: a.scales,
        scale_strides: a.scale_strides.into(),
        topk_idx: a.topk_idx,
        topk_weights: a.topk_weights,
        send_head: a.send_head,
        num_tokens: a.num_tokens,
        experts_per_rank: a.experts_per_rank,
    })
}

/// Device addresses of a dispatch's outputs (0 = not wanted).
#[derive(Clone, Copy, Debug, Default)]
pub struct DispatchOutputs {
    /// Rows of the outputs (`num_recv` or `num_worst_tokens`).
    pub num_rows: i64,
    pub recv_x: u64,
    pub recv_scales: u64,
    pub scale_strides: (i64, i64),
    pub recv_topk_idx: u64,
    pub recv_topk_weights: u64,
    pub recv_src_idx: u64,
}

/// Arguments of [`DataKernel::DispatchRecv`].
#[derive(Clone, Copy, Debug)]
pub struct RecvArgs {
    pub rec: RecordLayout,
    /// `[R, R]` int32 (device).
    pub rank_prefix_matrix: u64,
    pub out: DispatchOutputs,
    pub num_sms: u32,
}

pub(crate) fn recv_params(ctx: IntranodeCtx, a: &RecvArgs) -> DispatchRecvParams {
    let o = a.out;
    DispatchRecvParams {
        c: ctx,
        rec: a.rec,
        rank_prefix_matrix: a.rank_prefix_matrix,
        num_rows: o.num_rows,
        recv_x: o.recv_x,
        recv_scales: o.recv_scales,
        scale_strides: o.scale_strides.into(),
        recv_topk_idx: o.recv_topk_idx,
        recv_topk_weights: o.recv_topk_weights,
        recv_src_idx: o.recv_src_idx,
    }
}

/// Inputs of [`DataKernel::CombineSend`].
#[derive(Clone, Copy, Debug)]
pub struct CombineSendArgs {
    /// bf16 `[rows, hidden]`.
    pub y: u64,
    pub hidden: i32,
    /// f32 `[rows, K]` or 0.
    pub topk_weights: u64,
    pub num_topk: i32,
    pub rank_prefix_matrix: u64,
    /// Upper bound of received rows (for the grid size).
    pub num_rows: i64,
    pub num_sms: u32,
}

pub(crate) fn combine_send_params(ctx: IntranodeCtx, a: &CombineSendArgs) -> CombineSendParams {
    CombineSendParams {
        c: ctx,
        y: a.y,
        row_bytes: 2 * a.hidden as i64,
        topk_weights: a.topk_weights,
        record_bytes: combine_record_bytes(a.hidden as usize, a.num_topk.max(0) as usize),
        rank_prefix_matrix: a.rank_prefix_matrix,
        num_topk: a.num_topk,
    }
}

/// Inputs / outputs of [`DataKernel::CombineRecv`].
#[derive(Clone, Copy, Debug)]
pub struct CombineRecvArgs {
    /// `[N, R]` int32 slots (the handle's send_head).
    pub send_head: u64,
    pub num_tokens: i32,
    pub hidden: i32,
    /// bf16 `[N, hidden]` or 0 each.
    pub bias: (u64, u64),
    /// bf16 `[N, hidden]`.
    pub out: u64,
    /// f32 `[N, K]` or 0.
    pub out_weights: u64,
    pub num_topk: i32,
    pub num_sms: u32,
}

/// The combine's receive half's argument block (checked).
pub(crate) fn combine_recv_params(
    ctx: IntranodeCtx,
    a: &CombineRecvArgs,
) -> Result<CombineRecvParams> {
    check_ctx(&ctx)?;
    if a.hidden <= 0 || a.hidden % 64 != 0 {
        return Err(CommError::invalid(
            "hidden",
            format!("{} is not a positive multiple of 64", a.hidden),
        ));
    }
    Ok(CombineRecvParams {
        c: ctx,
        send_head: a.send_head,
        record_bytes: combine_record_bytes(a.hidden as usize, a.num_topk.max(0) as usize),
        bias: a.bias.into(),
        out: a.out,
        out_weights: a.out_weights,
        num_tokens: a.num_tokens,
        hidden: a.hidden,
        num_topk: a.num_topk,
    })
}

/// Blocks of a fused kernel: `blocks` in all, the first `send_blocks` send.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FusedGrid {
    pub blocks: u32,
    pub send_blocks: u32,
}

/// Which halves one launch of the fused dispatch runs
/// (`moelink::intranode::dispatch`; a receive-only half of an internode
/// dispatch is a launch of `moelink::internode::dispatch`, see
/// [`crate::internode::internode_dispatch_recv`]), with their arguments.
#[derive(Clone, Copy, Debug)]
pub enum FusedHalves {
    /// Both, on the grid's split (one launch).
    Both(SendArgs, RecvArgs),
    /// The send half alone, on the grid's `send_blocks` blocks.
    Send(SendArgs),
    /// The receive half alone, on the grid's other blocks (it may run on
    /// another stream while the send-only launch of the same call runs).
    Recv(RecvArgs),
}

impl FusedGrid {
    /// `num_sms` blocks (at least 2), of which `recv_percent` % (rounded down,
    /// at least one, at most all but one) receive. `None` below 2 SMs: the
    /// fused kernels need a sender and a receiver block at once.
    pub fn new(num_sms: u32, recv_percent: u32) -> Option<Self> {
        if num_sms < 2 {
            return None;
        }
        let recv = (num_sms * recv_percent.min(100) / 100).clamp(1, num_sms - 1);
        Some(Self {
            blocks: num_sms,
            send_blocks: num_sms - recv,
        })
    }
}

/// Device state of the fused kernels (device addresses).
#[derive(Clone, Copy, Debug)]
pub struct FusedState {
    /// u64 counter of the calls whose send half ran (combine: of its calls).
    pub send_calls: u64,
    /// u64 counter of the calls whose receive half ran (dispatch only).
    pub recv_calls: u64,
    /// u32 last-block ticket of receive-only launches, 0 between kernels
    /// (dispatch only).
    pub recv_ticket: u64,
    /// comm's `DeviceError` record.
    pub error: u64,
    /// u64 phase stamps `[PROF_KINDS][PROF_BLOCKS][PROF_SLOTS]`
    /// (`MOELINK_INTRANODE_PROFILE=1`), or 0: none.
    pub prof: u64,
    /// This launch's senders first pass a barrier with every peer (its block
    /// 0 signals and waits for each, as the barrier kernel does; the gate at
    /// [`BARRIER_GATE_WORD`] of the context's ticket opens the other senders),
    /// so no barrier kernel is launched before it. A launch with a send half
    /// only (not a direct combine's).
    pub barrier: bool,
}

/// The u32 word of [`IntranodeCtx`]'s ticket that opens a fused launch's
/// senders after its barrier (`kBarrierGateWord`); 0 between kernels.
pub const BARRIER_GATE_WORD: u64 = 12;

/// Phase stamps of the fused kernels (intranode.cuh, `stamp`): kinds (0 / 1 a
/// dispatch sender / receiver block, 2 / 3 a combine sender / receiver block),
/// blocks kept per kind, and slots per block (globaltimer ns: start, warp 0
/// past its first row, warp 0 out of its row loop, end).
pub const PROF_KINDS: usize = 4;
pub const PROF_BLOCKS: usize = 256;
pub const PROF_SLOTS: usize = 4;

/// Launches the fused dispatch (`moelink::intranode::dispatch`) for
/// `halves`: the send half on the first `grid.send_blocks` blocks and the
/// receive half on the others, at once (each received row copied out when its
/// record's flag shows this call), or one half alone on its share of the grid.
///
/// # Safety
/// As [`DataKernel::DispatchSend`] and [`DataKernel::DispatchRecv`] together, except that no wait
/// kernel comes between them: the kernel waits per record itself. Every
/// peer's dispatch of this call must be a fused one too, and each call runs
/// both halves once (`Both`, or `Send` then `Recv`).
pub unsafe fn dispatch_fused(
    k: &DeviceKernels,
    stream: StreamHandle,
    ctx: IntranodeCtx,
    halves: FusedHalves,
    state: FusedState,
    grid: FusedGrid,
) -> Result<()> {
    let (blocks, p) = dispatch_fused_params(ctx, halves, state, grid)?;
    // SAFETY: DispatchFusedParams mirrors the kernel's block; pointers are the caller's contract.
    unsafe { launch_blocks(k, stream, KernelId::IntranodeDispatch, blocks, p) }
}

/// The checked argument block of one fused dispatch launch running `halves`,
/// and its number of blocks.
pub(crate) fn dispatch_fused_params(
    ctx: IntranodeCtx,
    halves: FusedHalves,
    state: FusedState,
    grid: FusedGrid,
) -> Result<(u32, DispatchFusedParams)> {
    check_fused(&state, grid)?;
    if state.recv_calls == 0 || state.recv_ticket == 0 {
        return Err(CommError::invalid(
            "fused state",
            "a dispatch needs its receive counter and ticket",
        ));
    }
    // The half a launch does not run gets arguments without rows.
    let (blocks, num_send_blocks, send, recv) = match halves {
        FusedHalves::Both(s, r) => (grid.blocks, grid.send_blocks, s, r),
        FusedHalves::Send(s) => (grid.send_blocks, grid.send_blocks, s, RecvArgs::none(s.rec)),
        FusedHalves::Recv(r) => (grid.blocks - grid.send_blocks, 0, SendArgs::none(r.rec), r),
    };
    if state.barrier && num_send_blocks == 0 {
        return Err(CommError::invalid(
            "fused state",
            "a receive-only launch has no senders to pass a barrier",
        ));
    }
    let p = DispatchFusedParams {
        send: send_params(ctx, &send)?,
        recv: recv_params(ctx, &recv),
        send_calls: state.send_calls,
        recv_calls: state.recv_calls,
        recv_ticket: state.recv_ticket,
        error: state.error,
        prof: state.prof,
        num_send_blocks: num_send_blocks as i32,
        barrier: i32::from(state.barrier),
    };
    Ok((blocks, p))
}

impl SendArgs {
    /// No tokens (the send half of a receive-only launch).
    pub(crate) fn none(rec: RecordLayout) -> Self {
        SendArgs {
            rec,
            x: 0,
            scales: 0,
            scale_strides: (0, 0),
            topk_idx: 0,
            topk_weights: 0,
            send_head: 0,
            num_tokens: 0,
            experts_per_rank: 1,
            num_sms: 0,
        }
    }
}

impl RecvArgs {
    /// No rows (the receive half of a send-only launch).
    pub(crate) fn none(rec: RecordLayout) -> Self {
        RecvArgs {
            rec,
            rank_prefix_matrix: 0,
            out: DispatchOutputs::default(),
            num_sms: 0,
        }
    }
}

/// What makes a fused combine launch a direct one
/// (`moelink::intranode::combine_direct`): the rows of a source whose combine
/// header (in every pool of `pools`, written by [`publish_combine_barrier`]
/// before this launch) names its x in its receive pool are read there by the
/// receivers instead of being sent, and the grid's `send_blocks` may be 0
/// (this rank's x is read and there are no weights: every block receives).
#[derive(Clone, Copy, Debug)]
pub struct DirectCombine {
    /// The `[R]` table of every rank's receive pool as mapped here.
    pub pools: u64,
    /// A send-only launch on one SM (all blocks send), to be followed by a
    /// launch with `grid.send_blocks` 0 that ends the call.
    pub send_only: bool,
    /// `combine_direct_wide` instead: blocks of [`WIDE_THREADS`] whose
    /// receivers have more loads in flight (for a rank whose own x is read in
    /// place, in a group of 4 or more ranks).
    pub wide: bool,
}

/// Launches the fused combine (`moelink::intranode::combine`): the send half
/// of `send` and the reduction of `recv` at once (each token reduced when the
/// flags of all its copies show this call); with `direct`, the direct combine
/// ([`DirectCombine`]).
///
/// # Safety
/// As [`DataKernel::CombineSend`] and [`DataKernel::CombineRecv`] together (no wait kernel between
/// them); every peer's combine of this call must be a fused one too, and a
/// direct one where this one is.
#[allow(clippy::too_many_arguments)]
pub unsafe fn combine_fused(
    k: &DeviceKernels,
    stream: StreamHandle,
    ctx: IntranodeCtx,
    send: CombineSendArgs,
    recv: CombineRecvArgs,
    state: FusedState,
    grid: FusedGrid,
    direct: Option<DirectCombine>,
) -> Result<()> {
    let Some(d) = direct else {
        check_fused(&state, grid)?;
        let p = combine_fused_params(ctx, &send, &recv, &state, grid)?;
        // SAFETY: CombineFusedParams mirrors the kernel's block; pointers are the caller's contract.
        return unsafe { launch_blocks(k, stream, KernelId::IntranodeCombine, grid.blocks, p) };
    };
    check_direct(&state, grid, d.pools, d.send_only)?;
    let p = CombineDirectParams {
        f: combine_fused_params(ctx, &send, &recv, &state, grid)?,
        pools: d.pools,
        header_offset: COMBINE_HEADER_OFFSET as i32,
        finish: i32::from(!d.send_only),
    };
    let (id, threads) = if d.wide {
        (KernelId::CombineDirectWide, WIDE_THREADS)
    } else {
        (KernelId::CombineDirect, THREADS)
    };
    // SAFETY: CombineDirectParams mirrors the kernel's block; pointers are the caller's contract.
    unsafe { k.launch_params(id, (grid.blocks, 1), threads, 0, stream, p) }
}

/// The fused combine's argument block (checked).
fn combine_fused_params(
    ctx: IntranodeCtx,
    send: &CombineSendArgs,
    recv: &CombineRecvArgs,
    state: &FusedState,
    grid: FusedGrid,
) -> Result<CombineFusedParams> {
    check_ctx(&ctx)?;
    Ok(CombineFusedParams {
        send: combine_send_params(ctx, send),
        recv: combine_recv_params(ctx, recv)?,
        calls: state.send_calls,
        error: state.error,
        prof: state.prof,
        num_send_blocks: grid.send_blocks as i32,
        barrier: i32::from(state.barrier),
    })
}

/// A direct combine's launch: the fused state and the pool table present,
/// and a grid whose sending blocks are all of it (`send_only`) or leave
/// receivers (0 sending: a launch of receivers only).
fn check_direct(state: &FusedState, grid: FusedGrid, pools: u64, send_only: bool) -> Result<()> {
    if state.barrier {
        return Err(CommError::invalid(
            "fused state",
            "a direct combine passes its barrier in publish_combine_barrier",
        ));
    }
    if state.send_calls == 0 || state.error == 0 || pools == 0 {
        return Err(CommError::invalid(
            "fused state",
            "the call counter, the device error record and the pool table are required",
        ));
    }
    let fits = if send_only {
        grid.send_blocks == grid.blocks
    } else {
        grid.send_blocks < grid.blocks
    };
    if grid.blocks == 0 || !fits {
        return Err(CommError::invalid(
            "num_sms",
            format!(
                "a direct combine launch of {} blocks cannot have {} sending ({})",
                grid.blocks,
                grid.send_blocks,
                if send_only {
                    "send-only"
                } else {
                    "receivers needed"
                }
            ),
        ));
    }
    Ok(())
}

fn check_fused(state: &FusedState, grid: FusedGrid) -> Result<()> {
    if state.send_calls == 0 || state.error == 0 {
        return Err(CommError::invalid(
            "fused state",
            "the call counter and the device error record are required",
        ));
    }
    if grid.send_blocks == 0 || grid.send_blocks >= grid.blocks {
        return Err(CommError::invalid(
            "num_sms",
            format!(
                "a fused kernel needs sender and receiver blocks ({} of {} send)",
                grid.send_blocks, grid.blocks
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A direct combine launch needs the fused state and the pool table, and
    /// its senders must be the whole grid (send-only) or leave receivers.
    #[test]
    fn direct_combine_launches_are_checked() {
        let state = FusedState {
            send_calls: 8,
            recv_calls: 0,
            recv_ticket: 0,
            error: 16,
            prof: 0,
            barrier: false,
        };
        let grid = |blocks, send_blocks| FusedGrid {
            blocks,
            send_blocks,
        };
        for (g, send_only) in [(grid(8, 4), false), (grid(8, 0), false), (grid(1, 1), true)] {
            assert!(check_direct(&state, g, 64, send_only).is_ok(), "{g:?}");
        }
        for (g, send_only) in [
            (grid(8, 8), false),
            (grid(8, 4), true),
            (grid(0, 0), false),
            (grid(1, 0), true),
        ] {
            let e = check_direct(&state, g, 64, send_only)
                .unwrap_err()
                .to_string();
            assert!(e.contains("num_sms"), "{g:?}: {e}");
        }
        assert!(check_direct(&state, grid(8, 4), 0, false).is_err());
        let no_counter = FusedState {
            send_calls: 0,
            ..state
        };
        assert!(check_direct(&no_counter, grid(8, 4), 64, false).is_err());
        let barrier = FusedState {
            barrier: true,
            ..state
        };
        assert!(check_direct(&barrier, grid(8, 4), 64, false).is_err());
    }

    /// A fused dispatch launch passes a barrier only where it has senders,
    /// and carries the request to the kernel.
    #[test]
    fn fused_dispatch_barrier_needs_senders() {
        let state = FusedState {
            send_calls: 8,
            recv_calls: 16,
            recv_ticket: 24,
            error: 32,
            prof: 0,
            barrier: true,
        };
        let grid = FusedGrid {
            blocks: 8,
            send_blocks: 4,
        };
        let ctx = IntranodeCtx {
            channels: 64,
            local: 128,
            ticket: 256,
            epoch: 512,
            dispatch_offset: 0,
            combine_offset: 0,
            dispatch_slots: 4,
            combine_slots: 4,
            timeout_ns: 1,
            rank: 0,
            num_ranks: 2,
        };
        let rec = RecordLayout::dispatch(256, 0, 0).unwrap();
        let (send, recv) = (SendArgs::none(rec), RecvArgs::none(rec));
        let both = FusedHalves::Both(send, recv);
        let (_, p) = dispatch_fused_params(ctx, both, state, grid).unwrap();
        assert_eq!(p.barrier, 1);
        let e = dispatch_fused_params(ctx, FusedHalves::Recv(recv), state, grid)
            .unwrap_err()
            .to_string();
        assert!(e.contains("barrier"), "{e}");
        let open = FusedState {
            barrier: false,
            ..state
        };
        let (_, p) = dispatch_fused_params(ctx, FusedHalves::Recv(recv), open, grid).unwrap();
        assert_eq!(p.barrier, 0);
    }

    #[test]
    fn record_layout_offsets() {
        let r = RecordLayout::dispatch(14336, 0, 8).unwrap();
        assert_eq!(
            (r.idx_offset, r.w_offset, r.src_offset, r.bytes),
            (14336, 14400, 14432, 14448)
        );
        // The flag: the last 8 bytes, after the source index.
        assert!(r.src_offset as i64 + 4 <= r.bytes - FLAG_BYTES);
        // fp8 with 56 scales: ids 8-aligned after the scales.
        let r = RecordLayout::dispatch(7168, 56, 8).unwrap();
        assert_eq!(r.idx_offset, 7168 + 224);
        assert_eq!(r.bytes % 16, 0);
        let r = RecordLayout::dispatch(128, 1, 0).unwrap();
        assert_eq!((r.idx_offset, r.src_offset, r.bytes), (136, 136, 160));
        assert!(RecordLayout::dispatch(100, 0, 1).is_err());
        assert!(RecordLayout::dispatch(128, 0, 33).is_err());
        assert_eq!(combine_record_bytes(7168, 8), 14384);
        assert_eq!(combine_record_bytes(64, 0), 144);
    }

    /// The packed arrays lie in the fixed-slot dispatch region they replace
    /// (records of every field plus a flag), aligned for their element and disjoint.
    #[test]
    fn packed_arrays_fit_the_dispatch_region() {
        for (h, s, k) in [
            (14336, 0, 8),
            (7168, 56, 8),
            (128, 1, 0),
            (256, 3, 1),
            (7168, 0, 0),
        ] {
            let rec = RecordLayout::dispatch(h, s, k).unwrap();
            for (ranks, slots) in [(1, 1), (2, 3), (4, 4096), (8, 777), (32, 5)] {
                let offset = CTRL_BYTES;
                let p = PackedLayout::new(&rec, offset, ranks, slots);
                let cap = (ranks * slots) as i64;
                assert_eq!(p.capacity, cap);
                assert_eq!(p.rows, offset as i64);
                let arrays = [
                    (p.rows, cap * h as i64),
                    (p.scales, cap * 4 * s as i64),
                    (p.idx, cap * 8 * k as i64),
                    (p.w, cap * 4 * k as i64),
                    (p.src, cap * 4),
                ];
                for w in arrays.windows(2) {
                    assert!(
                        w[0].0 + w[0].1 <= w[1].0,
                        "{rec:?} {ranks}x{slots}: overlap"
                    );
                }
                for ((start, _), align) in arrays.iter().zip([16, 4, 8, 4, 4]) {
                    assert_eq!(start % align, 0, "{rec:?}: unaligned array");
                }
                assert_eq!(p.end(), p.src + 4 * cap);
                assert!(
                    p.end() <= offset as i64 + cap * rec.bytes,
                    "{rec:?} {ranks}x{slots}: {} past the region",
                    p.end()
                );
            }
        }
    }

    #[test]
    fn param_blocks_match_the_kernels_static_asserts() {
        let cu = include_str!("../cuda/intranode.cuh");
        crate::check_static_asserts("intranode.cuh", cu, PARAM_LAYOUT);
    }

    #[test]
    fn fused_grid_splits_senders_and_receivers() {
        let grid = |blocks, send_blocks| {
            Some(FusedGrid {
                blocks,
                send_blocks,
            })
        };
        assert_eq!(FusedGrid::new(1, 25), None);
        assert_eq!(FusedGrid::new(2, 25), grid(2, 1));
        assert_eq!(FusedGrid::new(48, 25), grid(48, 36));
        assert_eq!(FusedGrid::new(24, 0), grid(24, 23));
        assert_eq!(FusedGrid::new(24, 100), grid(24, 1));
        assert_eq!(FusedGrid::new(24, 50), grid(24, 12));
    }

    #[test]
    fn grid_is_bounded_by_work_and_sms() {
        assert_eq!(data_grid(24, 0), 1);
        assert_eq!(data_grid(24, 32), 1);
        assert_eq!(data_grid(24, 33), 2);
        assert_eq!(data_grid(24, 1 << 20), 24);
    }
}
