//! The intranode part of `moelink.Buffer`: one NVL buffer per rank mapped by
//! every peer, memory channels to every peer, and the launch sequences of
//! dispatch and combine (docs/design-intranode.md has the design; the kernels
//! are `ep-kernels/cuda/intranode.cu`).
//!
//! All tensors are passed as raw device addresses: the Python layer checks
//! dtypes, shapes, devices and contiguity before calling in, and allocates
//! the outputs; the buffer's capacity for a call is checked here, before any
//! launch. Every method launches on the stream it is given and returns
//! without waiting, except [`IntranodeBuffer::wait_counts`] (bounded).
//!
//! Region reuse: a rank may write into a peer's dispatch (combine) region only
//! when the peer no longer reads it. `dispatch_notify` is a barrier (every
//! peer signals it only after its stream finished its earlier calls); a
//! cached dispatch always, and a combine that follows a combine without a
//! notify or barrier in between, first run a barrier kernel. Which one is needed is tracked on the
//! host: every rank makes the same sequence of calls.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use comm::channel::MemoryChannel;
use comm::error::{CommError, Result};
use comm::host_memory::HostMemory;
use comm::{Device, DeviceMemory, Group, StreamHandle, SymmetricRegion};
use ep_kernels::intranode::CtxKernel::{
    CombineBarrier, CombineWait, DispatchBarrier, DispatchWait,
};
use ep_kernels::intranode::{
    self as k, CombineRecvArgs, CombineSendArgs, IntranodeCtx, NotifyArgs, RecordLayout, RecvArgs,
    SendArgs, CTRL_BYTES,
};

use crate::ep_buffer::{BufferPart, EpBufferOptions, PartBase, PartKind};

/// Largest number of experts per rank (`E / R`) the host-mapped counts hold
/// (one of the [`limits`](crate::limits)).
pub use crate::limits::MAX_EXPERTS_PER_RANK;
const HOST_COUNTS_OFFSET: usize = 64;
const HOST_BYTES: usize = HOST_COUNTS_OFFSET + 4 * (1 + MAX_EXPERTS_PER_RANK);

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
    /// receive kernels poison what came from them), `[8..16)`: notify epoch (u64).
    scratch: DeviceMemory,
    host: HostMemory,
    host_epoch: u64,
    combine_dirty: bool,
    timeout: Duration,
}

impl IntranodeBuffer {
    /// *Collective.* The group's next object: allocates `opts.num_nvl_bytes`
    /// of NVL buffer on `device`, maps every peer's, and builds memory
    /// channels to every peer, on the group's Communicator (made now if this
    /// is the group's first object, with `opts.timeout` bounding its host
    /// waits). `opts.timeout` also bounds [`wait_counts`](Self::wait_counts);
    /// every device wait is bounded by `opts.device_timeout_ns`.
    pub(crate) fn new(group: &Group, device: Device, opts: &EpBufferOptions) -> Result<Self> {
        let (mut part, nvl) = PartBase::join(group, device, opts, PartKind::Intranode)?;
        let comm = part.comm().clone();
        let (channels, channel_table) =
            nvl.memory_channel_table(&comm, 1, part.member().device_error())?;
        let scratch = DeviceMemory::alloc(device, 16)?;
        scratch.fill(0)?;
        let host = HostMemory::pinned(device, HOST_BYTES)?;
        // Everybody has mapped everybody's buffer before anyone launches.
        part.ready()?;
        Ok(Self {
            part,
            nvl,
            _channels: channels,
            channel_table,
            scratch,
            host,
            host_epoch: 0,
            combine_dirty: false,
            timeout: opts.timeout,
        })
    }

    /// `num_sms` of a data kernel, capped to this rank's share of its GPU (so
    /// that ranks sharing a GPU never wait on peers whose blocks cannot start).
    fn sms(&self, num_sms: u32) -> u32 {
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
        let r = self.part.num_ranks();
        if num_experts == 0 || num_experts % r != 0 {
            return Err(CommError::invalid(
                "num_experts",
                format!("{num_experts} experts cannot be split evenly over {r} ranks"),
            ));
        }
        let e = num_experts / r;
        if e > MAX_EXPERTS_PER_RANK {
            return Err(CommError::invalid(
                "num_experts",
                format!("{e} experts per rank; at most {MAX_EXPERTS_PER_RANK}"),
            ));
        }
        Ok(e)
    }

    fn check_dispatch_fits(&self, shape: &DispatchShape) -> Result<usize> {
        let cap = self.dispatch_capacity(shape)?;
        if shape.num_tokens > cap {
            return Err(CommError::invalid(
                "x",
                format!(
                    "{} tokens on rank {}, but the buffer of {} bytes holds {cap} tokens per rank \
                     for rows of {} bytes; size it with Config.get_nvl_buffer_size_hint",
                    shape.num_tokens,
                    self.part.rank(),
                    self.nvl.len(),
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
        let notify = NotifyArgs {
            is_token_in_rank: inp.is_token_in_rank,
            num_tokens_per_expert: inp.num_tokens_per_expert,
            num_tokens: shape.num_tokens as i32,
            experts_per_rank: epr as i32,
            expert_alignment: i32::try_from(expert_alignment)
                .map_err(|_| CommError::invalid("expert_alignment", "too large"))?,
            rank_prefix_matrix: inp.rank_prefix_matrix,
            send_head: inp.send_head,
            host_counts: self.host.device_ptr() + HOST_COUNTS_OFFSET as u64,
            host_epoch: self.host.device_ptr(),
            epoch_value: epoch,
            topk_idx: if shape.num_topk > 0 { inp.topk_idx } else { 0 },
            num_topk: shape.num_topk as i32,
            error: self.part.error_ptr(),
        };
        // SAFETY: the caller (the Python layer) checked every tensor.
        unsafe { k::dispatch_notify(self.part.kernels(), stream, ctx, notify) }?;
        self.host_epoch = epoch;
        self.combine_dirty = false;
        self.launch_send(stream, ctx, rec, shape, inp, epr, num_sms)?;
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
        // SAFETY: channels are live.
        unsafe { k::ctx_kernel(self.part.kernels(), stream, ctx, DispatchBarrier) }?;
        self.combine_dirty = false;
        let shape = DispatchShape {
            num_topk: 0,
            ..*shape
        };
        let inp = DispatchInputs {
            topk_idx: 0,
            topk_weights: 0,
            ..*inp
        };
        self.launch_send(stream, ctx, rec, &shape, &inp, 1, num_sms)
    }

    #[allow(clippy::too_many_arguments)]
    fn launch_send(
        &self,
        stream: StreamHandle,
        ctx: IntranodeCtx,
        rec: RecordLayout,
        shape: &DispatchShape,
        inp: &DispatchInputs,
        experts_per_rank: usize,
        num_sms: u32,
    ) -> Result<()> {
        let num_sms = self.sms(num_sms);
        let send = SendArgs {
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
        };
        // SAFETY: as above.
        unsafe { k::dispatch_send(self.part.kernels(), stream, ctx, send) }
    }

    /// Waits (bounded, CPU) for the counts of the notify of `epoch`: returns
    /// the number of received tokens and the per-local-expert counts
    /// (rounded to the dispatch's `expert_alignment`).
    pub fn wait_counts(&self, epoch: u64, num_experts: usize) -> Result<(usize, Vec<i32>)> {
        let epr = self.experts_per_rank(num_experts)?;
        let start = Instant::now();
        let flag = self.host.atomic_u64(0);
        let mut spins = 0u64;
        while flag.load(Ordering::Acquire) < epoch {
            spins += 1;
            if spins % 1024 == 0 {
                self.part.member().check_device_timeout()?;
                if start.elapsed() > self.timeout {
                    return Err(CommError::Timeout {
                        rank: self.part.rank() as i64,
                        what: format!(
                            "the dispatch counts of its peers (notify kernel of call {epoch} \
                             not finished: a peer did not reach this dispatch, or its GPU is \
                             stuck)"
                        ),
                        waited_ms: start.elapsed().as_millis() as u64,
                    });
                }
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        let base = self.host.as_ptr() as *const i32;
        // SAFETY: the counts region lies inside `host`, written before the epoch.
        let read =
            |i: usize| unsafe { std::ptr::read_volatile(base.add(HOST_COUNTS_OFFSET / 4 + i)) };
        let num_recv = read(0);
        let counts = (0..epr).map(|e| read(1 + e)).collect();
        Ok((num_recv.max(0) as usize, counts))
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
        let num_sms = self.sms(num_sms);
        let cap = self.dispatch_capacity(shape)?;
        let rec = RecordLayout::dispatch(shape.hidden_bytes, shape.num_scales, shape.num_topk)?;
        let ctx = self.ctx(cap, 0);
        // SAFETY: as above.
        unsafe { k::ctx_kernel(self.part.kernels(), stream, ctx, DispatchWait) }?;
        let recv = RecvArgs {
            rec,
            rank_prefix_matrix,
            out: *out,
            num_sms,
        };
        // SAFETY: as above.
        unsafe { k::dispatch_recv(self.part.kernels(), stream, ctx, recv) }?;
        Ok(())
    }

    /// Launches a whole combine on `stream`.
    pub fn combine(&mut self, stream: StreamHandle, a: &CombineArgs, num_sms: u32) -> Result<()> {
        let num_sms = self.sms(num_sms);
        let cap = self.combine_capacity(a.hidden, a.num_topk);
        if a.num_tokens > cap {
            return Err(CommError::invalid(
                "handle",
                format!(
                    "{} tokens on rank {}, but the buffer of {} bytes holds {cap} combined \
                     tokens per rank for hidden {}",
                    a.num_tokens,
                    self.part.rank(),
                    self.nvl.len(),
                    a.hidden
                ),
            ));
        }
        let ctx = self.ctx(0, cap);
        if self.combine_dirty {
            // SAFETY: channels are live.
            unsafe { k::ctx_kernel(self.part.kernels(), stream, ctx, CombineBarrier) }?;
        }
        let send = CombineSendArgs {
            y: a.y,
            hidden: a.hidden as i32,
            topk_weights: a.topk_weights,
            num_topk: a.num_topk as i32,
            rank_prefix_matrix: a.rank_prefix_matrix,
            num_rows: a.num_recv_rows,
            num_sms,
        };
        // SAFETY: the caller checked every tensor.
        unsafe { k::combine_send(self.part.kernels(), stream, ctx, send) }?;
        // SAFETY: as above.
        unsafe { k::ctx_kernel(self.part.kernels(), stream, ctx, CombineWait) }?;
        let recv = CombineRecvArgs {
            send_head: a.send_head,
            num_tokens: a.num_tokens as i32,
            hidden: a.hidden as i32,
            bias: a.bias,
            out: a.out,
            out_weights: a.out_weights,
            num_topk: a.num_topk as i32,
            num_sms,
        };
        // SAFETY: as above.
        unsafe { k::combine_recv(self.part.kernels(), stream, ctx, recv) }?;
        self.combine_dirty = true;
        Ok(())
    }

    /// Launches the layout kernel (`get_dispatch_layout`).
    pub fn layout(&self, stream: StreamHandle, c: &LayoutCall) -> Result<()> {
        self.experts_per_rank(c.num_experts)?;
        // SAFETY: the caller checked every tensor.
        unsafe {
            ep_kernels::launch::layout_dispatch(
                self.part.kernels(),
                stream,
                ep_kernels::launch::LayoutParams {
                    topk_idx: c.topk_idx,
                    num_tokens_per_rank: c.num_tokens_per_rank,
                    num_tokens_per_expert: c.num_tokens_per_expert,
                    is_token_in_rank: c.is_token_in_rank,
                    partials: c.partials,
                    ticket: self.scratch.ptr(),
                    error: self.part.error_ptr(),
                    num_tokens: c.num_tokens as i32,
                    num_topk: c.num_topk as i32,
                    num_experts: c.num_experts as i32,
                    num_ranks: self.part.num_ranks() as i32,
                    rank: self.part.rank() as i32,
                },
            )
        }
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
