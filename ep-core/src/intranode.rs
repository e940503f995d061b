//! The intranode part of `moelink.Buffer`: one NVL buffer per rank mapped by
//! every peer, memory channels to every peer, and the launch sequences of
//! dispatch and combine (docs/design-intranode.md has the design; the kernels
//! are `ep-kernels/cuda/intranode.cu`).
//!
//! All tensors are passed as raw device addresses: `crate::calls` checks
//! dtypes, shapes, devices and contiguity first (the call's plan, which the
//! front ends make before calling in), and the front end allocates the
//! outputs; the buffer's capacity for a call is checked here, before any
//! launch. Every method launches on the stream it is given and returns
//! without waiting, except [`IntranodeBuffer::wait_counts`] (bounded).
//!
//! Region reuse: a rank may write into a peer's dispatch (combine) region only
//! when the peer no longer reads it. `dispatch_notify` is a barrier (every
//! peer signals it only after its stream finished its earlier calls); a
//! cached dispatch always, and a combine that follows a combine without a
//! notify or barrier in between, first run a barrier kernel. Which one is needed is tracked on the
//! host: every rank makes the same sequence of calls.
//!
//! Fused kernels (the default; a packed or direct dispatch, [`RecvPolicy`],
//! sends otherwise, and its combine is fused too): the send and the receive
//! half of a dispatch (a combine) run at the same time on disjoint blocks, the
//! receivers copying (reducing) each record once its flag shows the call, so
//! the local pass overlaps the NVLink transfer. A normal dispatch launches the
//! send half right after notify (it overlaps the host's wait for the counts, as
//! before) and [`IntranodeBuffer::dispatch_recv`] the receive half on the
//! Buffer's side stream, which waits for notify only and which the caller's
//! stream then waits for. A cached dispatch keeps the send's arguments and
//! launches both halves as one kernel; so does a combine. Half of the blocks
//! receive ([`DEFAULT_SHARES`], the best split measured). A fused kernel needs a
//! sender and a receiver block at once, so a call on one SM (a rank whose share
//! of its GPU is one SM) runs the separate send, wait and receive kernels
//! instead.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use comm::channel::MemoryChannel;
use comm::cuda::{OwnedStream, StreamOrder};
use comm::error::{CommError, Result};
use comm::host_memory::HostMemory;
use comm::{DeviceMemory, StreamHandle, SymmetricRegion};
use ep_kernels::intranode::CtxKernel::{
    CombineBarrier, CombineWait, DispatchBarrier, DispatchWait,
};
use ep_kernels::intranode::DataKernel::{CombineRecv, CombineSend, DispatchRecv, DispatchSend};
use ep_kernels::intranode::{
    self as k, CombineRecvArgs, CombineSendArgs, FusedGrid, FusedHalves, FusedState, IntranodeCtx,
    NotifyArgs, PackedLayout, RecordLayout, RecvArgs, RecvPoolHeader, SendArgs, CTRL_BYTES,
};

use crate::part::{BufferPart, EpBufferOptions, PartBase, PhaseStamps};
use crate::recv_pool::{self, RecvPool};

/// Largest number of experts per rank (`E / R`) the host-mapped counts hold
/// (one of the [`limits`](crate::limits)).
pub use crate::limits::MAX_EXPERTS_PER_RANK;
const HOST_COUNTS_OFFSET: usize = 64;
/// The smallest group whose direct combine, for a rank whose x is read in
/// place, runs `combine_direct_wide` (with 2 ranks a token has at most two
/// copies, and the 1024-thread kernel's two sources in flight suffice).
const WIDE_MIN_RANKS: usize = 4;
/// Bytes of the host-mapped memory notify writes the counts and epoch into.
pub(crate) const HOST_BYTES: usize = HOST_COUNTS_OFFSET + 4 * (1 + MAX_EXPERTS_PER_RANK);
/// Byte offsets in `scratch` of the fused kernels' call counters (u64) and of
/// the receive-only launches' ticket (u32).
/// (The internode part's scratch starts with the same words.)
pub(crate) const DISPATCH_SEND_CALLS_OFFSET: u64 = 16;
pub(crate) const DISPATCH_RECV_CALLS_OFFSET: u64 = 24;
pub(crate) const COMBINE_CALLS_OFFSET: u64 = 32;
pub(crate) const RECV_TICKET_OFFSET: u64 = 40;
/// The fused senders' unit counter (u32, 0 between kernels; `kSendWorkWord`
/// of intranode.cuh counts u32 words from the ticket at 0).
pub(crate) const SEND_WORK_OFFSET: u64 = 44;
const _: () = assert!(SEND_WORK_OFFSET == 4 * 11);
/// The gate a fused kernel's block 0 opens for the other senders once it
/// passed its barrier (u32, 0 between kernels; `kBarrierGateWord`).
pub(crate) const BARRIER_GATE_OFFSET: u64 = 48;
const _: () = assert!(BARRIER_GATE_OFFSET == 4 * k::BARRIER_GATE_WORD);
pub(crate) const SCRATCH_BYTES: usize = 52;

/// Experts per rank of `num_experts` split evenly over `num_ranks` ranks
/// (at most [`MAX_EXPERTS_PER_RANK`]).
pub(crate) fn experts_per_rank(num_ranks: usize, num_experts: usize) -> Result<usize> {
    if num_experts == 0 || num_experts % num_ranks != 0 {
        return Err(CommError::invalid(
            "num_experts",
            format!("{num_experts} experts cannot be split evenly over {num_ranks} ranks"),
        ));
    }
    let e = num_experts / num_ranks;
    if e > MAX_EXPERTS_PER_RANK {
        return Err(CommError::invalid(
            "num_experts",
            format!("{e} experts per rank; at most {MAX_EXPERTS_PER_RANK}"),
        ));
    }
    Ok(e)
}

/// The host-mapped counts a notify kernel writes (its epoch word at 0, the
/// received token count and the per-expert counts at `HOST_COUNTS_OFFSET`).
pub(crate) struct HostCounts;

impl HostCounts {
    /// The device address notify writes the counts to.
    pub(crate) fn counts_ptr(host: &HostMemory) -> u64 {
        host.device_ptr() + HOST_COUNTS_OFFSET as u64
    }

    /// Waits (bounded by `timeout`, CPU; the part's device timeouts checked
    /// on the way) for the counts of the notify of `epoch`: returns the number
    /// of received tokens and the `epr` per-local-expert counts. `kind` names
    /// the dispatch in the timeout's message.
    pub(crate) fn wait(
        host: &HostMemory,
        part: &PartBase,
        epoch: u64,
        epr: usize,
        timeout: Duration,
        kind: &str,
    ) -> Result<(usize, Vec<i32>)> {
        let start = Instant::now();
        let flag = host.atomic_u64(0);
        let mut spins = 0u64;
        while flag.load(Ordering::Acquire) < epoch {
            spins += 1;
            if spins % 1024 == 0 {
                part.member().check_device_timeout()?;
                if start.elapsed() > timeout {
                    return Err(CommError::Timeout {
                        rank: part.rank() as i64,
                        what: format!(
                            "the {kind} counts of its peers (notify kernel of call {epoch} not \
                             finished: a peer did not reach this dispatch, or its GPU is stuck)"
                        ),
                        waited_ms: start.elapsed().as_millis() as u64,
                    });
                }
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        let base = host.as_ptr() as *const i32;
        // SAFETY: the counts region lies inside `host`, written before the epoch.
        let read =
            |i: usize| unsafe { std::ptr::read_volatile(base.add(HOST_COUNTS_OFFSET / 4 + i)) };
        let num_recv = read(0);
        let counts = (0..epr).map(|e| read(1 + e)).collect();
        Ok((num_recv.max(0) as usize, counts))
    }
}

/// The notify kernel's arguments of a normal dispatch (intranode, and the
/// internode notify's common part): the counts go to `host` and its epoch
/// word is set to `epoch` last.
pub(crate) fn notify_args(
    shape: &DispatchShape,
    inp: &DispatchInputs,
    experts_per_rank: usize,
    expert_alignment: usize,
    host: &HostMemory,
    epoch: u64,
    error: u64,
) -> Result<NotifyArgs> {
    Ok(NotifyArgs {
        is_token_in_rank: inp.is_token_in_rank,
        num_tokens_per_expert: inp.num_tokens_per_expert,
        num_tokens: shape.num_tokens as i32,
        experts_per_rank: experts_per_rank as i32,
        expert_alignment: i32::try_from(expert_alignment)
            .map_err(|_| CommError::invalid("expert_alignment", "too large"))?,
        rank_prefix_matrix: inp.rank_prefix_matrix,
        send_head: inp.send_head,
        host_counts: HostCounts::counts_ptr(host),
        host_epoch: host.device_ptr(),
        epoch_value: epoch,
        topk_idx: if shape.num_topk > 0 { inp.topk_idx } else { 0 },
        num_topk: shape.num_topk as i32,
        error,
        pool_header: 0,
        pool_value: RecvPoolHeader::ABSENT,
    })
}

/// The send half's arguments of a dispatch of records `rec` (intranode, and
/// the internode send side's intranode part).
pub(crate) fn send_args(
    rec: RecordLayout,
    shape: &DispatchShape,
    inp: &DispatchInputs,
    experts_per_rank: usize,
    num_sms: u32,
) -> SendArgs {
    SendArgs {
        rec,
        x: inp.x,
        scales: inp.scales,
        scale_strides: inp.scale_strides,
        topk_idx: inp.topk_idx,
        topk_weights: inp.topk_weights,
        send_head: inp.send_head,
        num_tokens: shape.num_tokens as i32,
        experts_per_rank: experts_per_rank as i32,
        num_sms,
    }
}

/// The shape and inputs a cached dispatch sends: no top-k.
pub(crate) fn without_topk(
    shape: &DispatchShape,
    inp: &DispatchInputs,
) -> (DispatchShape, DispatchInputs) {
    let shape = DispatchShape {
        num_topk: 0,
        ..*shape
    };
    let inp = DispatchInputs {
        topk_idx: 0,
        topk_weights: 0,
        ..*inp
    };
    (shape, inp)
}

/// The fused dispatch's device state: the call counters and the receive
/// ticket in `scratch` (a device address), the error record, the phase
/// stamps (0: none).
pub(crate) fn dispatch_state(scratch: u64, error: u64, prof: u64) -> FusedState {
    FusedState {
        send_calls: scratch + DISPATCH_SEND_CALLS_OFFSET,
        recv_calls: scratch + DISPATCH_RECV_CALLS_OFFSET,
        recv_ticket: scratch + RECV_TICKET_OFFSET,
        error,
        prof,
        barrier: false,
    }
}

/// Percent of a fused kernel's blocks that receive, per phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecvShares {
    pub dispatch: u32,
    pub combine: u32,
}

/// The split: half of the blocks receive, dispatch and combine alike. Both
/// halves move about 40 GB/s per SM, so the bandwidth is the smaller half's SMs
/// times that: on 2 x H200 (4096 tokens of hidden 7168, top-8 of 256) 50 % was
/// the best of 25 / 34 / 50 / 67 at 4, 8, 16 and 24 SMs
/// (benches/results/2026-11-27_h200x4-h200x2_bulk-copy-dispatch), as it was of
/// 25 / 40 / 50 / 60 on 2 x H100 at 24 and 48 SMs.
pub const DEFAULT_SHARES: RecvShares = RecvShares {
    dispatch: 50,
    combine: 50,
};

/// The fused kernels' grid for `num_sms` (already capped) with the phase's
/// receiver share of [`DEFAULT_SHARES`], or `None` below 2 SMs, where the
/// separate send, wait and receive kernels run.
fn fused_grid(num_sms: u32, share: impl Fn(&RecvShares) -> u32) -> Option<FusedGrid> {
    FusedGrid::new(num_sms, share(&DEFAULT_SHARES))
}

/// `MOELINK_INTRANODE_PROFILE=1`: the fused kernels record phase stamps
/// ([`IntranodeBuffer::profile`]).
pub const PROFILE_ENV: &str = "MOELINK_INTRANODE_PROFILE";
const PROF_WORDS: usize = k::PROF_KINDS * k::PROF_BLOCKS * k::PROF_SLOTS;

/// How a dispatch receives (`MOELINK_INTRANODE_RECV`, read at Buffer
/// creation; every rank must make the same choice).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecvPolicy {
    /// The receive kernels (fused beside the send; separate on one SM): the
    /// default.
    Kernels,
    /// Packed: every SM of the call sends, each copy of a token straight to
    /// its received row on the destination, and one contiguous device copy
    /// per output field receives. Every SM that stores moves at most about 47
    /// GB/s (benches/probe/local_copy_probe.cu on H200: 16-byte stores and
    /// bulk copies alike), and the receive kernels store every received byte
    /// once more, so giving all SMs to the senders nearly doubles the
    /// bandwidth at 4-12 SMs. But the driver runs a same-device copy on SMs,
    /// with or without its prefer-copy-engine hint (it waited for a kernel
    /// that held every SM): it needs about 100 us of the whole GPU after the
    /// sends, and it waits for a persistent kernel beside it to end. Hence
    /// opt-in, for a GPU that does nothing else during the dispatch.
    Packed,
    /// Direct: packed, with `recv_x` a range of this rank's receive pool
    /// ([`crate::recv_pool`], a region every peer maps), so the senders write
    /// every row straight into the output and no copy of the rows follows.
    /// The front end reserves the range before the send
    /// ([`IntranodeBuffer::recv_pool_reserve`]; as many rows as can come when
    /// the count is not known yet), the send's barrier (notify's, or
    /// `publish_barrier` for a cached dispatch) publishes it, and
    /// [`IntranodeBuffer::recv_pool_take`] cuts it to the received rows. A
    /// rank without a reserved range (full pool, CUDA graph capture, the Rust
    /// front end) receives as in `Packed`. Its combine is the direct one
    /// ([`IntranodeBuffer::combine`]): an `x` that lies in the pool is read by
    /// the peers where it lies.
    Direct,
}

/// Selects how an intranode dispatch receives: `kernels` (the default),
/// `packed` or `direct`.
pub const RECV_ENV: &str = "MOELINK_INTRANODE_RECV";
/// Bytes of the direct dispatch's receive pool (default: the NVL buffer's).
pub const RECV_POOL_ENV: &str = "MOELINK_INTRANODE_RECV_POOL_BYTES";

impl RecvPolicy {
    pub fn from_env() -> Result<RecvPolicy> {
        Self::parse(comm::env::var(RECV_ENV).as_deref())
    }

    fn parse(v: Option<&str>) -> Result<RecvPolicy> {
        match v.map(str::trim) {
            None | Some("") | Some("kernels") => Ok(RecvPolicy::Kernels),
            Some("packed") => Ok(RecvPolicy::Packed),
            Some("direct") => Ok(RecvPolicy::Direct),
            Some(v) => Err(CommError::invalid(
                RECV_ENV,
                format!("{v:?}: expected kernels, packed or direct"),
            )),
        }
    }
}

/// A dispatch whose receive half comes next (fused kernels, or packed).
#[derive(Clone, Copy, Debug)]
struct PendingSend {
    send: SendArgs,
    dispatch_slots: usize,
    /// The send half is running (normal dispatch: the receive half follows on
    /// the side stream; packed: always), else it waits to be launched with
    /// the receive half.
    launched: bool,
    /// Packed (`dispatch_send_packed` filled these arrays): device copies
    /// receive.
    packed: Option<PackedLayout>,
    /// Direct: the byte offset in this rank's receive pool where the senders
    /// wrote the rows (the published header's), or `None` (the packed arrays).
    rows_at: Option<u64>,
    /// The launch of both halves passes the barrier the send half owes (a
    /// cached dispatch on the fused kernel launches no barrier kernel).
    barrier: bool,
}

impl PendingSend {
    /// The send half `send` of a dispatch in `ctx` (its slots per rank).
    fn new(
        send: SendArgs,
        ctx: &IntranodeCtx,
        launched: bool,
        packed: Option<PackedLayout>,
        rows_at: Option<u64>,
    ) -> Self {
        PendingSend {
            send,
            dispatch_slots: ctx.dispatch_slots as usize,
            launched,
            packed,
            rows_at,
            barrier: false,
        }
    }
}

/// The direct dispatch's receive pool and what kernels read of it.
struct DirectPool {
    pool: Arc<RecvPool>,
    /// `[R]` u64: every rank's pool as mapped here.
    table: DeviceMemory,
    /// Dispatches whose recv_x lay in the pool, and those that copied it.
    direct_calls: u64,
    copied_calls: u64,
    /// Combines launched (the parity picks the header of the call), and those
    /// whose x lay in the pool (read by the peers where it is).
    combine_calls: u64,
    combines_read: u64,
    /// The range reserved for the next dispatch's recv_x
    /// ([`IntranodeBuffer::recv_pool_reserve`]), published at its send.
    reserved: Option<recv_pool::Lease>,
}

/// Usage of a direct dispatch's receive pool
/// ([`IntranodeBuffer::recv_pool_stats`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecvPoolStats {
    /// This rank's pool: base address and length.
    pub base: u64,
    pub len: u64,
    /// Bytes held by leases (live `recv_x` tensors and a reservation).
    pub used: u64,
    /// Dispatches whose `recv_x` lay in the pool (written by the senders
    /// directly), and those whose `recv_x` did not (received by a copy).
    pub direct_calls: u64,
    pub copied_calls: u64,
    /// Combines, and those whose x lay in the pool (read by the peers where
    /// it is).
    pub combine_calls: u64,
    pub combines_read: u64,
}

/// The fused dispatch's streams: the receive half of a normal dispatch runs
/// on `side` while the send half still runs on the caller's stream.
struct SideStream {
    side: OwnedStream,
    /// `side` after notify; the caller's stream after the receive half.
    after_notify: StreamOrder,
    after_recv: StreamOrder,
}

/// What a dispatch moves per token (the same on every rank).
#[derive(Clone, Copy, Debug)]
pub struct DispatchShape {
    pub num_tokens: usize,
    pub hidden_bytes: usize,
    pub num_scales: usize,
    /// Columns of `topk_idx` carried (0: no top-k).
    pub num_topk: usize,
    pub num_experts: usize,
}

/// Device addresses of a dispatch's inputs.
#[derive(Clone, Copy, Debug, Default)]
pub struct DispatchInputs {
    pub x: u64,
    pub scales: u64,
    pub scale_strides: (i64, i64),
    pub topk_idx: u64,
    pub topk_weights: u64,
    /// `[N, R]` bool (normal dispatch) — unused for cached.
    pub is_token_in_rank: u64,
    /// `[E]` int32 (normal dispatch).
    pub num_tokens_per_expert: u64,
    /// `[R, R]` int32: written by notify (normal), read (cached).
    pub rank_prefix_matrix: u64,
    /// `[N, R]` int32: written by notify (normal), read (cached).
    pub send_head: u64,
}

/// Device addresses of a dispatch's outputs (0 = not wanted).
pub use ep_kernels::intranode::DispatchOutputs;

/// A layout call's device addresses and sizes (`get_dispatch_layout`).
#[derive(Clone, Copy, Debug, Default)]
pub struct LayoutCall {
    /// `[num_tokens, num_topk]` int64 expert ids (-1 = none).
    pub topk_idx: u64,
    pub num_tokens: usize,
    pub num_topk: usize,
    pub num_experts: usize,
    /// Out: `[R]` int32.
    pub num_tokens_per_rank: u64,
    /// Out: `[num_experts]` int32.
    pub num_tokens_per_expert: u64,
    /// Out: `[num_tokens, R]` bool.
    pub is_token_in_rank: u64,
    /// int32 scratch of `ep_kernels::launch::layout_scratch_elems` elements (the
    /// `layout_scratch` output of [`crate::calls::layout`]).
    pub partials: u64,
}

/// A combine's arguments.
#[derive(Clone, Copy, Debug, Default)]
pub struct CombineArgs {
    /// bf16 `[num_recv_rows, hidden]`.
    pub y: u64,
    pub num_recv_rows: i64,
    pub hidden: usize,
    /// f32 `[num_recv_rows, K]` or 0.
    pub topk_weights: u64,
    pub num_topk: usize,
    pub rank_prefix_matrix: u64,
    /// `[N, R]` int32.
    pub send_head: u64,
    pub num_tokens: usize,
    pub bias: (u64, u64),
    pub out: u64,
    pub out_weights: u64,
}

impl CombineArgs {
    /// The combine's send half's arguments (intranode and internode).
    pub(crate) fn send_args(&self, num_sms: u32) -> CombineSendArgs {
        CombineSendArgs {
            y: self.y,
            hidden: self.hidden as i32,
            topk_weights: self.topk_weights,
            num_topk: self.num_topk as i32,
            rank_prefix_matrix: self.rank_prefix_matrix,
            num_rows: self.num_recv_rows,
            num_sms,
        }
    }

    /// The combine's receive half's arguments (intranode and internode).
    pub(crate) fn recv_args(&self, num_sms: u32) -> CombineRecvArgs {
        CombineRecvArgs {
            send_head: self.send_head,
            num_tokens: self.num_tokens as i32,
            hidden: self.hidden as i32,
            bias: self.bias,
            out: self.out,
            out_weights: self.out_weights,
            num_topk: self.num_topk as i32,
            num_sms,
        }
    }
}

/// The intranode part of an [`EpBuffer`](crate::EpBuffer).
pub struct IntranodeBuffer {
    /// The group's Communicator, this part's scope, device error record and
    /// device-wait bound; the device and its kernels.
    part: PartBase,
    nvl: SymmetricRegion,
    _channels: Vec<Vec<Option<MemoryChannel>>>,
    channel_table: DeviceMemory,
    /// `[0..4)`: ticket (u32, 0 between kernels; layout and the send kernels),
    /// `[4..8)`: peers whose device wait timed out (u32 bit mask, sticky: the
    /// receive kernels poison what came from them), `[8..16)`: notify epoch (u64),
    /// `[16..24)` / `[24..32)` / `[32..40)`: fused dispatch send / dispatch
    /// receive / combine calls (u64), `[40..44)`: ticket of receive-only launches,
    /// `[44..48)`: the fused senders' unit counter (u32, 0 between kernels).
    scratch: DeviceMemory,
    /// Whether a dispatch is packed (`MOELINK_INTRANODE_RECV`).
    recv_policy: RecvPolicy,
    /// Direct: the receive pool.
    direct: Option<DirectPool>,
    /// The fused dispatch's side stream and its orderings.
    side: SideStream,
    /// The send half of the dispatch whose receive half comes next (fused
    /// kernels, or packed).
    pending: Option<PendingSend>,
    host: HostMemory,
    host_epoch: u64,
    combine_dirty: bool,
    timeout: Duration,
    /// Phase stamps of the fused kernels (`MOELINK_INTRANODE_PROFILE=1`).
    prof: PhaseStamps,
}

impl IntranodeBuffer {
    /// *Collective.* The intranode part over `part` (the group's next object,
    /// joined by [`EpBuffer::new`](crate::EpBuffer::new); the group has one
    /// node) and its region `nvl`: memory channels to every peer, on the
    /// group's Communicator. `opts.timeout` bounds
    /// [`wait_counts`](Self::wait_counts); every device wait is bounded by
    /// `opts.device_timeout_ns`.
    pub(crate) fn over(
        mut part: PartBase,
        nvl: SymmetricRegion,
        opts: &EpBufferOptions,
    ) -> Result<Self> {
        let recv_policy = RecvPolicy::from_env()?;
        let device = part.device();
        let comm = part.comm().clone();
        let (channels, channel_table) =
            nvl.memory_channel_table(&comm, 1, part.member().device_error())?;
        let scratch = DeviceMemory::alloc(device, SCRATCH_BYTES)?;
        scratch.fill(0)?;
        let host = HostMemory::pinned(device, HOST_BYTES)?;
        let prof = PhaseStamps::from_env(device, PROFILE_ENV, PROF_WORDS)?;
        let direct = match recv_policy {
            RecvPolicy::Direct => Some(direct_pool(&comm, nvl.len())?),
            _ => None,
        };
        // Everybody has mapped everybody's buffer before anyone launches.
        part.ready()?;
        Ok(Self {
            part,
            nvl,
            _channels: channels,
            channel_table,
            scratch,
            side: SideStream {
                side: OwnedStream::new(device)?,
                after_notify: StreamOrder::new(device)?,
                after_recv: StreamOrder::new(device)?,
            },
            recv_policy,
            direct,
            pending: None,
            host,
            host_epoch: 0,
            combine_dirty: false,
            timeout: opts.timeout,
            prof,
        })
    }

    /// The fused kernels' phase stamps of the latest launch of each kind since
    /// the previous call, `[PROF_KINDS][PROF_BLOCKS][PROF_SLOTS]` globaltimer ns
    /// (see `ep_kernels::intranode::PROF_KINDS`; 0: not stamped since), after
    /// synchronising the device; then zeroes them. Errors unless the Buffer was
    /// created with `MOELINK_INTRANODE_PROFILE=1`.
    pub fn profile(&self) -> Result<Vec<u64>> {
        self.prof.take(self.part.device())
    }

    /// `num_sms` of a data kernel, the SMs (blocks) a dispatch or combine asked
    /// for `num_sms` launches with: capped to this rank's share of its GPU (so
    /// that ranks sharing a GPU never wait on peers whose blocks cannot start).
    pub fn launch_sms(&self, num_sms: u32) -> u32 {
        self.part.device_share().cap("intranode num_sms", num_sms)
    }

    /// Bytes of each data region (dispatch, combine): half of what follows
    /// the control region, rounded down to 16.
    fn region_bytes(&self) -> u64 {
        (self.nvl.len() - CTRL_BYTES) / 2 / 16 * 16
    }

    /// Slots per source rank of a dispatch with records of `rec` bytes.
    pub fn dispatch_capacity(&self, shape: &DispatchShape) -> Result<usize> {
        let rec = RecordLayout::dispatch(shape.hidden_bytes, shape.num_scales, shape.num_topk)?;
        Ok((self.region_bytes() / (self.part.num_ranks() as u64 * rec.bytes as u64)) as usize)
    }

    /// Slots per destination rank of a combine of `hidden` bf16 + `num_topk` weights.
    pub fn combine_capacity(&self, hidden: usize, num_topk: usize) -> usize {
        let rec = k::combine_record_bytes(hidden, num_topk) as u64;
        (self.region_bytes() / (self.part.num_ranks() as u64 * rec)) as usize
    }

    fn ctx(&self, dispatch_slots: usize, combine_slots: usize) -> IntranodeCtx {
        let region = self.region_bytes();
        IntranodeCtx {
            channels: self.channel_table.ptr(),
            local: self.nvl.ptr(),
            ticket: self.scratch.ptr(),
            epoch: self.scratch.ptr() + 8,
            dispatch_offset: CTRL_BYTES,
            combine_offset: CTRL_BYTES + region,
            dispatch_slots: dispatch_slots as i64,
            combine_slots: combine_slots as i64,
            timeout_ns: self.part.device_timeout_ns(),
            rank: self.part.rank() as i32,
            num_ranks: self.part.num_ranks() as i32,
        }
    }

    fn experts_per_rank(&self, num_experts: usize) -> Result<usize> {
        experts_per_rank(self.part.num_ranks(), num_experts)
    }

    fn check_dispatch_fits(&self, shape: &DispatchShape) -> Result<usize> {
        let cap = self.dispatch_capacity(shape)?;
        if shape.num_tokens > cap {
            return Err(self.part.too_many_tokens(
                "x",
                shape.num_tokens,
                &self.nvl,
                format_args!(
                    "{cap} tokens per rank for rows of {} bytes; size it with \
                     Config.get_nvl_buffer_size_hint",
                    shape.hidden_bytes
                ),
            ));
        }
        Ok(cap)
    }

    /// Launches notify and the send half of a normal dispatch on `stream`.
    /// Returns the epoch to pass to [`wait_counts`](Self::wait_counts).
    pub fn dispatch_send(
        &mut self,
        stream: StreamHandle,
        shape: &DispatchShape,
        inp: &DispatchInputs,
        expert_alignment: usize,
        num_sms: u32,
    ) -> Result<u64> {
        let epr = self.experts_per_rank(shape.num_experts)?;
        let cap = self.check_dispatch_fits(shape)?;
        let rec = RecordLayout::dispatch(shape.hidden_bytes, shape.num_scales, shape.num_topk)?;
        let ctx = self.ctx(cap, 0);
        let epoch = self.host_epoch + 1;
        let err = self.part.error_ptr();
        let mut notify = notify_args(shape, inp, epr, expert_alignment, &self.host, epoch, err)?;
        // Direct: notify's barrier publishes where this rank's recv_x will lie.
        let rows_at = self
            .publish_header(shape.hidden_bytes)
            .map(|(base, value)| {
                notify.pool_header = base;
                notify.pool_value = value;
                value.offset as u64
            });
        let rows_at = rows_at.filter(|_| notify.pool_value.rows >= 0);
        // SAFETY: the caller checked every tensor (crate::calls' plan).
        unsafe { k::dispatch_notify(self.part.kernels(), stream, ctx, notify) }?;
        self.host_epoch = epoch;
        self.combine_dirty = false;
        self.launch_send(stream, ctx, rec, shape, inp, epr, num_sms, true, rows_at)?;
        Ok(epoch)
    }

    /// Launches the send half of a cached dispatch (the layout of an earlier
    /// dispatch: its `send_head`), after a barrier when needed.
    pub fn cached_dispatch_send(
        &mut self,
        stream: StreamHandle,
        shape: &DispatchShape,
        inp: &DispatchInputs,
        num_sms: u32,
    ) -> Result<()> {
        let cap = self.check_dispatch_fits(shape)?;
        let rec = RecordLayout::dispatch(shape.hidden_bytes, shape.num_scales, 0)?;
        let ctx = self.ctx(cap, 0);
        // Direct: the barrier publishes where this rank's recv_x will lie.
        let mut rows_at = None;
        // The fused kernel (both halves in one launch, in dispatch_recv)
        // passes the barrier itself.
        let fused = self.recv_policy == RecvPolicy::Kernels
            && fused_grid(self.launch_sms(num_sms), |s| s.dispatch).is_some();
        if let Some((base, value)) = self.publish_header(shape.hidden_bytes) {
            // SAFETY: channels are live; `base` is this rank's pool, and a
            // header with rows names a range reserved for this call's recv_x.
            unsafe { k::publish_barrier(self.part.kernels(), stream, ctx, base, value) }?;
            rows_at = (value.rows >= 0).then_some(value.offset as u64);
        } else if !fused {
            // SAFETY: channels are live.
            unsafe { k::ctx_kernel(self.part.kernels(), stream, ctx, DispatchBarrier) }?;
        }
        self.combine_dirty = false;
        let (shape, inp) = without_topk(shape, inp);
        self.launch_send(stream, ctx, rec, &shape, &inp, 1, num_sms, false, rows_at)?;
        if fused && rows_at.is_none() {
            match self.pending.as_mut() {
                Some(p) if !p.launched && p.packed.is_none() => p.barrier = true,
                _ => {
                    return Err(CommError::invalid(
                        "num_sms",
                        "a cached dispatch on the fused kernel kept no send half",
                    ))
                }
            }
        }
        Ok(())
    }

    /// Launches the send half. Fused kernels: `early` (a normal dispatch: the
    /// host waits for the counts next) launches it alone, the side stream
    /// ordered after notify; else it is kept for
    /// [`dispatch_recv`](Self::dispatch_recv), which launches both halves.
    /// One SM: the separate send kernel, launched now. Packed and direct:
    /// launched now (`rows_at`: where a direct dispatch's rows go in this
    /// rank's pool, as published).
    #[allow(clippy::too_many_arguments)]
    fn launch_send(
        &mut self,
        stream: StreamHandle,
        ctx: IntranodeCtx,
        rec: RecordLayout,
        shape: &DispatchShape,
        inp: &DispatchInputs,
        experts_per_rank: usize,
        num_sms: u32,
        early: bool,
        rows_at: Option<u64>,
    ) -> Result<()> {
        let num_sms = self.launch_sms(num_sms);
        let send = send_args(rec, shape, inp, experts_per_rank, num_sms);
        self.pending = None;
        if self.recv_policy != RecvPolicy::Kernels {
            let packed = self.packed_layout(&ctx, &rec);
            let pools = self.direct.as_ref().map_or(0, |d| d.table.ptr());
            // SAFETY: as above; rank_prefix_matrix is notify's (written before
            // this launch on the same stream) or the handle's; direct: every
            // rank's pool header was published by the barrier before.
            unsafe {
                k::dispatch_send_packed(
                    self.part.kernels(),
                    stream,
                    ctx,
                    send,
                    packed,
                    inp.rank_prefix_matrix,
                    pools,
                )
            }?;
            self.pending = Some(PendingSend::new(send, &ctx, true, Some(packed), rows_at));
            return Ok(());
        }
        let Some(grid) = fused_grid(num_sms, |s| s.dispatch) else {
            // SAFETY: as above.
            return unsafe { k::data_kernel(self.part.kernels(), stream, ctx, DispatchSend(send)) };
        };
        if early {
            let side = &self.side;
            side.after_notify.after(side.side.handle(), stream)?;
            // SAFETY: as above; the receive half follows in dispatch_recv.
            unsafe {
                k::dispatch_fused(
                    self.part.kernels(),
                    stream,
                    ctx,
                    FusedHalves::Send(send),
                    self.dispatch_state(),
                    grid,
                )
            }?;
        }
        self.pending = Some(PendingSend::new(send, &ctx, early, None, None));
        Ok(())
    }

    fn dispatch_state(&self) -> FusedState {
        dispatch_state(self.scratch.ptr(), self.part.error_ptr(), self.prof.ptr())
    }

    fn combine_state(&self) -> FusedState {
        FusedState {
            send_calls: self.scratch.ptr() + COMBINE_CALLS_OFFSET,
            recv_calls: 0,
            recv_ticket: 0,
            error: self.part.error_ptr(),
            prof: self.prof.ptr(),
            barrier: false,
        }
    }

    /// Waits (bounded, CPU) for the counts of the notify of `epoch`: returns
    /// the number of received tokens and the per-local-expert counts
    /// (rounded to the dispatch's `expert_alignment`).
    pub fn wait_counts(&self, epoch: u64, num_experts: usize) -> Result<(usize, Vec<i32>)> {
        let epr = self.experts_per_rank(num_experts)?;
        HostCounts::wait(&self.host, &self.part, epoch, epr, self.timeout, "dispatch")
    }

    /// Launches the receive half of a dispatch (normal or cached): waits for
    /// every peer's send, then fills the outputs.
    pub fn dispatch_recv(
        &mut self,
        stream: StreamHandle,
        shape: &DispatchShape,
        rank_prefix_matrix: u64,
        out: &DispatchOutputs,
        num_sms: u32,
    ) -> Result<()> {
        let num_sms = self.launch_sms(num_sms);
        let cap = self.dispatch_capacity(shape)?;
        let rec = RecordLayout::dispatch(shape.hidden_bytes, shape.num_scales, shape.num_topk)?;
        let ctx = self.ctx(cap, 0);
        let recv = RecvArgs {
            rec,
            rank_prefix_matrix,
            out: *out,
            num_sms,
        };
        if let Some(pending) = self.pending.take() {
            if let Some(packed) = pending.packed {
                if pending.dispatch_slots != cap {
                    return Err(CommError::invalid(
                        "x",
                        "the receive half of a dispatch does not match its send half",
                    ));
                }
                return self.packed_recv(stream, ctx, recv, packed, pending.rows_at);
            }
            let grid = fused_grid(num_sms, |s| s.dispatch).ok_or_else(|| {
                CommError::invalid(
                    "num_sms",
                    "the receive half of a fused dispatch needs 2 SMs",
                )
            })?;
            if pending.dispatch_slots != cap {
                return Err(CommError::invalid(
                    "x",
                    "the receive half of a dispatch does not match its send half",
                ));
            }
            let state = FusedState {
                barrier: pending.barrier,
                ..self.dispatch_state()
            };
            if !pending.launched {
                // SAFETY: the send half's arguments were checked when it was
                // prepared; the caller checked the outputs.
                return unsafe {
                    k::dispatch_fused(
                        self.part.kernels(),
                        stream,
                        ctx,
                        FusedHalves::Both(pending.send, recv),
                        state,
                        grid,
                    )
                };
            }
            // The send half runs on `stream` since dispatch_send; the receive
            // half runs beside it on the side stream (ordered after notify),
            // and `stream` continues after it.
            let side = &self.side;
            // SAFETY: as above; the outputs were allocated before this launch
            // (on the caller's stream, which `stream` follows, or on `stream`
            // itself), and `stream` waits for the side stream before it goes on.
            unsafe {
                k::dispatch_fused(
                    self.part.kernels(),
                    side.side.handle(),
                    ctx,
                    FusedHalves::Recv(recv),
                    state,
                    grid,
                )
            }?;
            return side.after_recv.after(stream, side.side.handle());
        }
        if fused_grid(num_sms, |s| s.dispatch).is_some() {
            return Err(CommError::invalid(
                "handle",
                "a dispatch's receive half without its send half (dispatch_send first)",
            ));
        }
        // SAFETY: as above.
        unsafe { k::ctx_kernel(self.part.kernels(), stream, ctx, DispatchWait) }?;
        // SAFETY: as above.
        unsafe { k::data_kernel(self.part.kernels(), stream, ctx, DispatchRecv(recv)) }?;
        Ok(())
    }

    /// Direct: this rank's pool (device address) and the header to publish
    /// before this call's sends: the range reserved for its recv_x (taken from
    /// the reservation, which the next `recv_pool_take` truncates), or
    /// [`RecvPoolHeader::ABSENT`] when none was reserved. `None` otherwise.
    fn publish_header(&mut self, hidden_bytes: usize) -> Option<(u64, RecvPoolHeader)> {
        let rank = self.part.rank();
        let d = self.direct.as_mut()?;
        let (base, _) = d.pool.range();
        let value = match d.reserved.as_ref() {
            Some(lease) if hidden_bytes > 0 => {
                d.direct_calls += 1;
                RecvPoolHeader {
                    offset: (lease.ptr() - base) as i64,
                    rows: (lease.bytes() / hidden_bytes as u64) as i64,
                }
            }
            _ => {
                if d.copied_calls == 0 {
                    tracing::warn!(
                        "rank {rank}: a direct dispatch found no receive pool range reserved \
                         for its recv_x (the pool is full, a CUDA graph is being captured, or \
                         the caller allocates recv_x itself): it is received by a copy; \
                         {RECV_POOL_ENV} sizes the pool (said once per Buffer)"
                    );
                }
                d.copied_calls += 1;
                RecvPoolHeader::ABSENT
            }
        };
        Some((base, value))
    }

    /// The most rows a dispatch of records of this shape can receive here
    /// (every source's slots).
    pub fn max_recv_rows(
        &self,
        hidden_bytes: usize,
        num_scales: usize,
        num_topk: usize,
    ) -> Result<usize> {
        let shape = DispatchShape {
            num_tokens: 0,
            hidden_bytes,
            num_scales,
            num_topk,
            num_experts: 0,
        };
        Ok(self.dispatch_capacity(&shape)? * self.part.num_ranks())
    }

    /// Direct: reserves `bytes` of the receive pool for the next dispatch's
    /// recv_x (an earlier reservation not taken is returned first). `false`
    /// without a pool or when it cannot hold them: that dispatch's recv_x is
    /// then received by a copy.
    pub fn recv_pool_reserve(&mut self, bytes: u64) -> bool {
        let Some(d) = self.direct.as_mut() else {
            return false;
        };
        d.reserved = None;
        d.reserved = d.pool.lease(bytes.max(1));
        d.reserved.is_some()
    }

    /// Direct: the reserved range, cut to its first `bytes` (the rest goes
    /// back to the pool), for the dispatch's recv_x; `None` when nothing was
    /// reserved or `bytes` is 0 or more than was reserved.
    pub fn recv_pool_take(&mut self, bytes: u64) -> Option<recv_pool::Lease> {
        let mut lease = self.direct.as_mut()?.reserved.take()?;
        if bytes == 0 || bytes > lease.bytes() {
            return None;
        }
        lease.truncate(bytes);
        Some(lease)
    }

    /// Usage of the direct dispatch's receive pool (`None` unless
    /// `MOELINK_INTRANODE_RECV=direct`).
    pub fn recv_pool_stats(&self) -> Option<RecvPoolStats> {
        self.direct.as_ref().map(|d| {
            let (base, len) = d.pool.range();
            RecvPoolStats {
                base,
                len,
                used: d.pool.used(),
                direct_calls: d.direct_calls,
                copied_calls: d.copied_calls,
                combine_calls: d.combine_calls,
                combines_read: d.combines_read,
            }
        })
    }

    /// `bytes` of the direct dispatch's receive pool for a `recv_x`, held
    /// until the lease is dropped; `None` without a pool or when it cannot
    /// serve them (that `recv_x` is then allocated elsewhere and received by
    /// a copy).
    pub fn recv_pool_lease(&self, bytes: u64) -> Option<recv_pool::Lease> {
        self.direct.as_ref()?.pool.lease(bytes)
    }

    /// The packed arrays of a dispatch of records `rec` in `ctx`'s dispatch region.
    fn packed_layout(&self, ctx: &IntranodeCtx, rec: &RecordLayout) -> PackedLayout {
        PackedLayout::new(
            rec,
            ctx.dispatch_offset,
            self.part.num_ranks(),
            ctx.dispatch_slots as usize,
        )
    }

    /// The receive of a packed dispatch: wait for every peer's send, copy
    /// each wanted packed array into its output with one device copy (one
    /// contiguous range each: the senders wrote received-row order; the driver
    /// runs such a same-device copy on SMs), then
    /// `finish_rows` (padding, poisoning, strided scales; nothing otherwise).
    fn packed_recv(
        &self,
        stream: StreamHandle,
        ctx: IntranodeCtx,
        recv: RecvArgs,
        packed: PackedLayout,
        rows_at: Option<u64>,
    ) -> Result<()> {
        let rec = recv.rec;
        // SAFETY: channels are live.
        unsafe { k::ctx_kernel(self.part.kernels(), stream, ctx, DispatchWait) }?;
        let o = recv.out;
        // Rows past the arrays are padding (num_worst_tokens): finish_rows writes them.
        let rows = o.num_rows.clamp(0, packed.capacity) as usize;
        let base = self.nvl.ptr();
        let copy = |dst: u64, offset: i64, row_bytes: usize| -> Result<()> {
            if dst == 0 || row_bytes == 0 || rows == 0 {
                return Ok(());
            }
            // SAFETY: the output holds `num_rows` rows of `row_bytes` (the
            // caller checked it); the array holds `capacity` rows, in this
            // rank's NVL buffer, complete once the wait above returned.
            unsafe { stream.copy_async(dst, base + offset as u64, rows * row_bytes) }
        };
        let s = rec.num_scales as usize;
        let topk = rec.num_topk as usize;
        // Direct: the senders wrote the rows at `rows_at` in this rank's pool,
        // which is recv_x itself unless recv_x was allocated elsewhere.
        match (rows_at, self.direct.as_ref()) {
            (Some(at), Some(d)) => {
                let (pool, _) = d.pool.range();
                if o.recv_x != pool + at && o.recv_x != 0 && rows > 0 {
                    // SAFETY: as below; the published range holds `rows` rows.
                    unsafe {
                        stream.copy_async(o.recv_x, pool + at, rows * rec.hidden_bytes as usize)
                    }?;
                }
            }
            _ => copy(o.recv_x, packed.rows, rec.hidden_bytes as usize)?,
        }
        let scales_packed = o.scale_strides == (s as i64, 1);
        if scales_packed {
            copy(o.recv_scales, packed.scales, 4 * s)?;
        }
        copy(o.recv_topk_idx, packed.idx, 8 * topk)?;
        copy(o.recv_topk_weights, packed.w, 4 * topk)?;
        copy(o.recv_src_idx, packed.src, 4)?;
        let copy_scales = s > 0 && o.recv_scales != 0 && !scales_packed;
        // SAFETY: as above.
        unsafe { k::finish_rows(self.part.kernels(), stream, ctx, recv, packed, copy_scales) }
    }

    /// Launches a whole combine on `stream`. With a receive pool (direct),
    /// the direct combine: `publish_barrier`, then `combine_direct`.
    pub fn combine(&mut self, stream: StreamHandle, a: &CombineArgs, num_sms: u32) -> Result<()> {
        let num_sms = self.launch_sms(num_sms);
        let cap = self.combine_capacity(a.hidden, a.num_topk);
        if a.num_tokens > cap {
            return Err(self.part.too_many_tokens(
                "handle",
                a.num_tokens,
                &self.nvl,
                format_args!("{cap} combined tokens per rank for hidden {}", a.hidden),
            ));
        }
        let ctx = self.ctx(0, cap);
        if self.direct.is_some() {
            self.combine_direct(stream, ctx, a, num_sms)?;
            self.combine_dirty = true;
            return Ok(());
        }
        let send = a.send_args(num_sms);
        let recv = a.recv_args(num_sms);
        if let Some(grid) = fused_grid(num_sms, |s| s.combine) {
            // After a combine, the senders pass a barrier first (no dispatch
            // came between, whose notify or barrier would have been one).
            let state = FusedState {
                barrier: self.combine_dirty,
                ..self.combine_state()
            };
            let kernels = self.part.kernels();
            // SAFETY: the caller checked every tensor.
            unsafe { k::combine_fused(kernels, stream, ctx, send, recv, state, grid, None) }?;
        } else {
            if self.combine_dirty {
                // SAFETY: channels are live.
                unsafe { k::ctx_kernel(self.part.kernels(), stream, ctx, CombineBarrier) }?;
            }
            // SAFETY: the caller checked every tensor.
            unsafe { k::data_kernel(self.part.kernels(), stream, ctx, CombineSend(send)) }?;
            // SAFETY: as above.
            unsafe { k::ctx_kernel(self.part.kernels(), stream, ctx, CombineWait) }?;
            // SAFETY: as above.
            unsafe { k::data_kernel(self.part.kernels(), stream, ctx, CombineRecv(recv)) }?;
        }
        self.combine_dirty = true;
        Ok(())
    }

    /// A direct combine: `publish_barrier` (this call's combine header: where
    /// `x` lies in this rank's receive pool, or absent; it is also the barrier
    /// before the combine's sends), then `combine_direct`, whose receivers read
    /// the rows of every source whose x lies in its pool where they are. This
    /// rank sends no rows when its own x lies in the pool, so with no weights
    /// every block receives.
    fn combine_direct(
        &mut self,
        stream: StreamHandle,
        ctx: IntranodeCtx,
        a: &CombineArgs,
        num_sms: u32,
    ) -> Result<()> {
        let state = self.combine_state();
        let d = self
            .direct
            .as_mut()
            .expect("a direct combine has a receive pool");
        let (base, _) = d.pool.range();
        let bytes = a.num_recv_rows.max(0) as u64 * 2 * a.hidden as u64;
        let header = match d.pool.offset_of(a.y, bytes) {
            Some(offset) if bytes > 0 => RecvPoolHeader {
                offset: offset as i64,
                rows: a.num_recv_rows,
            },
            _ => RecvPoolHeader::ABSENT,
        };
        d.combine_calls += 1;
        let read = header.rows >= 0;
        d.combines_read += u64::from(read);
        let pools = d.table.ptr();
        let kernels = self.part.kernels();
        // SAFETY: channels are live; the header lies in this rank's pool.
        unsafe { k::publish_combine_barrier(kernels, stream, ctx, base, header, &state) }?;
        let (send, recv) = (a.send_args(num_sms), a.recv_args(num_sms));
        let sends = !read || a.topk_weights != 0;
        // This rank's blocks send no rows: wider loads in flight per receiver
        // where a token has up to 4 copies (the pull probe and the SM sweep,
        // docs/design-intranode.md).
        let wide = read && self.part.num_ranks() >= WIDE_MIN_RANKS;
        let launch = |grid: FusedGrid, send_only: bool| {
            let direct = k::DirectCombine {
                pools,
                send_only,
                wide,
            };
            // SAFETY: the caller checked every tensor; every rank published
            // this call's header before this launch.
            unsafe { k::combine_fused(kernels, stream, ctx, send, recv, state, grid, Some(direct)) }
        };
        match fused_grid(num_sms, |s| s.combine) {
            Some(grid) if sends => launch(grid, false),
            Some(grid) => launch(
                FusedGrid {
                    send_blocks: 0,
                    ..grid
                },
                false,
            ),
            // One SM: a send-only launch first (when there is anything to send).
            None => {
                if sends {
                    launch(
                        FusedGrid {
                            blocks: 1,
                            send_blocks: 1,
                        },
                        true,
                    )?;
                }
                launch(
                    FusedGrid {
                        blocks: 1,
                        send_blocks: 0,
                    },
                    false,
                )
            }
        }
    }

    /// Launches the layout kernel (`get_dispatch_layout`).
    pub fn layout(&self, stream: StreamHandle, c: &LayoutCall) -> Result<()> {
        launch_layout(&self.part, stream, c, self.scratch.ptr(), 0, 0)
    }
}

/// *Collective.* The direct dispatch's receive pool: `MOELINK_INTRANODE_RECV_POOL_BYTES`
/// bytes (default `nvl_bytes`, the NVL buffer's size) on every rank, each
/// mapped by every peer.
fn direct_pool(comm: &comm::Communicator, nvl_bytes: u64) -> Result<DirectPool> {
    let bytes = match comm::env::var(RECV_POOL_ENV) {
        Some(v) => v
            .trim()
            .parse::<u64>()
            .ok()
            .filter(|&b| b > recv_pool::HEADER_BYTES)
            .ok_or_else(|| {
                CommError::invalid(
                    RECV_POOL_ENV,
                    format!(
                        "{v:?}: expected a byte count above {}",
                        recv_pool::HEADER_BYTES
                    ),
                )
            })?,
        None => nvl_bytes,
    };
    let device = comm
        .device()
        .ok_or_else(|| CommError::invalid("device", "a receive pool needs a device"))?;
    let region = SymmetricRegion::new(comm, bytes as usize, recv_pool::HEADER_BYTES as usize)?;
    if !region.all_mapped() {
        return Err(CommError::invalid(
            RECV_ENV,
            "direct needs every peer's receive pool mapped (one node, peer access)",
        ));
    }
    let table = comm::device_table(device, &region.bases())?;
    Ok(DirectPool {
        pool: RecvPool::new(region),
        table,
        direct_calls: 0,
        copied_calls: 0,
        combine_calls: 0,
        combines_read: 0,
        reserved: None,
    })
}

/// Checks the experts of `c` against `part`'s ranks and launches the layout
/// kernel for `c` (`ticket`: a device u32 left 0 between kernels); `per_node`,
/// when not 0, receives the tokens per node of `ranks_per_node` consecutive
/// ranks.
pub(crate) fn launch_layout(
    part: &PartBase,
    stream: StreamHandle,
    c: &LayoutCall,
    ticket: u64,
    per_node: u64,
    ranks_per_node: usize,
) -> Result<()> {
    experts_per_rank(part.num_ranks(), c.num_experts)?;
    let (kernels, error) = (part.kernels(), part.error_ptr());
    let (num_ranks, rank) = (part.num_ranks(), part.rank());
    // SAFETY: the caller checked every tensor.
    unsafe {
        ep_kernels::launch::layout_dispatch(
            kernels,
            stream,
            ep_kernels::launch::LayoutParams {
                topk_idx: c.topk_idx,
                num_tokens_per_rank: c.num_tokens_per_rank,
                num_tokens_per_expert: c.num_tokens_per_expert,
                is_token_in_rank: c.is_token_in_rank,
                partials: c.partials,
                ticket,
                error,
                num_tokens: c.num_tokens as i32,
                num_topk: c.num_topk as i32,
                num_experts: c.num_experts as i32,
                num_ranks: num_ranks as i32,
                rank: rank as i32,
                num_tokens_per_node: per_node,
                ranks_per_node: ranks_per_node as i32,
                pad: 0,
            },
        )
    }
}

impl BufferPart for IntranodeBuffer {
    fn base(&self) -> &PartBase {
        &self.part
    }

    /// Device address and length of this rank's NVL buffer.
    fn local_buffer(&self) -> (u64, usize) {
        (self.nvl.ptr(), self.nvl.len() as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_of_two_or_more_sms_receive_and_one_sm_runs_separately() {
        assert_eq!(DEFAULT_SHARES.dispatch, 50);
        assert_eq!(DEFAULT_SHARES.combine, 50);
        assert!(fused_grid(1, |s| s.dispatch).is_none());
        assert!(fused_grid(0, |s| s.combine).is_none());
        let g = fused_grid(48, |s| s.dispatch).unwrap();
        assert_eq!((g.blocks, g.send_blocks), (48, 24));
        let g = fused_grid(2, |s| s.combine).unwrap();
        assert_eq!((g.blocks, g.send_blocks), (2, 1));
    }

    #[test]
    fn recv_policy_parses() {
        assert_eq!(RecvPolicy::parse(None).unwrap(), RecvPolicy::Kernels);
        assert_eq!(RecvPolicy::parse(Some("")).unwrap(), RecvPolicy::Kernels);
        assert_eq!(
            RecvPolicy::parse(Some(" kernels ")).unwrap(),
            RecvPolicy::Kernels
        );
        assert_eq!(
            RecvPolicy::parse(Some("packed")).unwrap(),
            RecvPolicy::Packed
        );
        assert_eq!(
            RecvPolicy::parse(Some("direct")).unwrap(),
            RecvPolicy::Direct
        );
        for v in ["1", "auto", "Packed", "copy", "Direct"] {
            let e = RecvPolicy::parse(Some(v)).unwrap_err().to_string();
            assert!(
                e.contains(RECV_ENV) && e.contains("kernels, packed or direct"),
                "{e}"
            );
        }
    }
}
