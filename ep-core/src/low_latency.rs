//! The low-latency part of `moelink.Buffer`: one buffer per rank mapped by
//! every peer (NVLink) and, when the proxy transport is used, port channels
//! over it; the launch sequences of `low_latency_dispatch` / `combine`
//! (docs/design-low-latency.md has the design; the kernels are
//! `ep-kernels/cuda/low_latency.cu`).
//!
//! Tensors are raw device addresses checked by the Python layer; the buffer's
//! capacity for a call is checked here, before any launch. Every launch is
//! asynchronous on the caller's stream.

use comm::channel::PortChannel;
use comm::device_handles::PortChannelDeviceHandle;
use comm::error::{CommError, Result};
use comm::proxy::ProxyService;
use comm::transport::Transport;
use comm::{device_table, Device, DeviceMemory, Group, StreamHandle, SymmetricRegion};
pub use ep_kernels::low_latency::DispatchOutputs;
/// Which halves of a low-latency call a launch runs (send, receive, both).
pub use ep_kernels::low_latency::Phases;
use ep_kernels::low_latency::{
    self as k, CombineArgs, DispatchArgs, Launch, LlCtx, LlShape, LlSizes, FLAGS_BYTES, STATE_WORDS,
};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::calls::{LlCombinePlan, LlDispatchPlan, LlGeometry};
use crate::part::{BufferPart, EpBufferOptions, PartBase, PartKind, PhaseStamps};

/// Trigger slots of the proxy's FIFO: per peer and call at most three are
/// used (the inbox, its flag, the release counts), two calls may be in flight
/// (a receive hook pending): 6 x 32 peers is well within.
const FIFO_SLOTS: usize = 1024;
const _: () = assert!(6 * k::MAX_RANKS <= FIFO_SLOTS);

/// Byte offset in the flags region of the words of the shrink `clean`'s rank
/// barrier: u32 `[R]`, entry `s` the latest barrier epoch rank `s` entered
/// (written by `s` from its host, read by this rank's host). They lie between
/// the data flags (`[2][32]` u64 at 0) and the release counts, where no
/// kernel reads or writes, and `clean` leaves them as they are.
pub const SYNC_OFFSET: u64 = 512;
/// End of the barrier words.
const SYNC_END: u64 = SYNC_OFFSET + 4 * k::MAX_RANKS as u64;
const _: () = assert!(2 * 8 * k::MAX_RANKS as u64 <= SYNC_OFFSET);
const _: () = assert!(SYNC_END <= k::RELEASE_OFFSET);

/// The shape of a low-latency call (what its handle carries):
/// `num_max_dispatch_tokens_per_rank`, hidden, experts and top-k.
#[derive(Clone, Copy, Debug, Default)]
pub struct CallShape {
    pub max_tokens: usize,
    pub hidden: usize,
    pub num_experts: usize,
    pub num_topk: usize,
}

/// A low-latency dispatch's device addresses (0 = absent where allowed).
#[derive(Clone, Copy, Debug, Default)]
pub struct DispatchCall {
    pub shape: CallShape,
    pub x: u64,
    pub topk_idx: u64,
    pub num_tokens: usize,
    pub use_fp8: bool,
    pub round_scale: bool,
    pub use_ue8m0: bool,
    pub out: DispatchOutputs,
}

/// A low-latency combine's device addresses.
#[derive(Clone, Copy, Debug, Default)]
pub struct CombineCall {
    pub shape: CallShape,
    /// bf16 `[E_local, R*T, H]` (may be the zero-copy region).
    pub x: u64,
    pub layout_range: u64,
    pub topk_idx: u64,
    pub topk_weights: u64,
    pub num_tokens: usize,
    pub out: u64,
    pub stats_wait: u64,
}

impl CallShape {
    pub fn new(max_tokens: usize, hidden: usize, num_experts: usize, num_topk: usize) -> Self {
        CallShape {
            max_tokens,
            hidden,
            num_experts,
            num_topk,
        }
    }

    /// The launch shape of a checked low-latency call: its plan's geometry
    /// and top-k.
    pub fn of(g: &LlGeometry, num_topk: i64) -> Self {
        CallShape {
            max_tokens: g.max_tokens as usize,
            hidden: g.hidden as usize,
            num_experts: g.num_experts as usize,
            num_topk: num_topk as usize,
        }
    }
}

impl DispatchCall {
    /// The dispatch `p` checked (every size and flag its own) at these
    /// addresses: `x` and `topk_idx` (0 without tokens), and the outputs.
    pub fn planned(p: &LlDispatchPlan, x: u64, topk_idx: u64, out: DispatchOutputs) -> Self {
        DispatchCall {
            shape: CallShape::of(&p.geometry, p.num_topk),
            x,
            topk_idx,
            num_tokens: p.num_tokens as usize,
            use_fp8: p.use_fp8,
            round_scale: p.round_scale,
            use_ue8m0: p.use_ue8m0,
            out,
        }
    }
}

impl CombineCall {
    /// The combine `p` checked at these addresses (`topk_idx`, `topk_weights`
    /// and `out` 0 without tokens, `stats_wait` 0 where absent).
    pub fn planned(
        p: &LlCombinePlan,
        x: u64,
        layout_range: u64,
        topk_idx: u64,
        topk_weights: u64,
        out: u64,
        stats_wait: u64,
    ) -> Self {
        CombineCall {
            shape: CallShape::of(&p.geometry, p.num_topk),
            x,
            layout_range,
            topk_idx,
            topk_weights,
            num_tokens: p.num_tokens as usize,
            out,
            stats_wait,
        }
    }
}

/// A low-latency call as a receive hook keeps it, to launch its receive half.
#[derive(Clone, Copy, Debug)]
pub enum LlCall {
    Dispatch(DispatchCall),
    Combine(CombineCall),
}

/// The low-latency part of an [`EpBuffer`](crate::EpBuffer).
pub struct LowLatencyBuffer {
    // Dropped first: the proxy thread stops before the memory it copies goes.
    proxy: Option<ProxyService>,
    ports: Vec<Option<PortChannel>>,
    ports_table: Option<DeviceMemory>,
    /// Bit d: peer d is reached through the proxy (the kernels' `use_proxy`).
    proxied: u32,
    peers_table: DeviceMemory,
    /// This rank's buffer and every peer's (imported, mapped where reachable).
    mem: SymmetricRegion,
    state: DeviceMemory,
    mask: DeviceMemory,
    /// Phase stamps of every launch (`MOELINK_LL_PROFILE=1`).
    prof: PhaseStamps,
    /// The group's Communicator (whose CUDA IPC connections the proxy uses),
    /// this part's scope, device error record and device-wait bound; the
    /// device and its kernels.
    part: PartBase,
    shrink: bool,
    num_blocks: u32,
    /// Epoch of this rank's latest shrink-`clean` barrier.
    sync_epoch: AtomicU32,
}

/// Bytes a buffer needs for calls up to this shape (any top-k), including the
/// staging regions of the proxy transport: DeepEP's
/// `get_low_latency_rdma_size_hint`.
pub fn size_hint(
    max_tokens: usize,
    hidden: usize,
    num_ranks: usize,
    num_experts: usize,
) -> Result<usize> {
    let call = CallShape::new(max_tokens, hidden, num_experts, k::MAX_TOPK);
    Ok(hint_bytes(&checked_shape(num_ranks, &call)?) as usize)
}

/// Call `s` on `num_ranks` ranks, checked against the kernels' limits and
/// their shared memory (a shape whose blocks cannot hold it never runs).
fn checked_shape(num_ranks: usize, s: &CallShape) -> Result<LlShape> {
    let shape = LlShape {
        num_ranks,
        max_tokens: s.max_tokens,
        hidden: s.hidden,
        num_experts: s.num_experts,
        num_topk: s.num_topk,
    };
    shape.check()?;
    shape.check_smem()?;
    Ok(shape)
}

/// The size hint of `shape`'s (T, hidden, ranks, experts): its layout with
/// the proxy's staging regions at the largest top-k, in multiples of 128.
fn hint_bytes(shape: &LlShape) -> u64 {
    let worst = LlShape {
        num_topk: k::MAX_TOPK,
        ..*shape
    };
    worst.layout(true).total.div_ceil(128) * 128
}

/// The most experts (a multiple of the rank count, 0 if none) that a call of
/// `shape`'s other dimensions fits into `bytes` of low-latency buffer (the
/// size hint's layout).
fn max_experts_fitting(shape: &LlShape, bytes: u64) -> usize {
    let r = shape.num_ranks.max(1);
    let fits = |e: usize| {
        hint_bytes(&LlShape {
            num_experts: e,
            ..*shape
        }) <= bytes
    };
    // The layout grows with the experts: the largest count of experts per
    // rank that fits, by bisection.
    let (mut lo, mut hi) = (0usize, shape.num_experts / r + 1);
    while lo + 1 < hi {
        let mid = (lo + hi) / 2;
        if fits(mid * r) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo * r
}

/// The peers (bit per rank) the low-latency kernels reach through the proxy:
/// every other rank when `all` (forced proxy, or peers not mapped), else the
/// ranks of other nodes (mixed transports: NVLink inside the node), none
/// within one node.
fn proxied_peers(topo: &comm::topology::Topology, all: bool) -> u32 {
    let me = topo.rank();
    let mut bits = 0u32;
    for (p, peer) in topo.peers().iter().enumerate() {
        if p != me && (all || peer.node != topo.node()) {
            bits |= 1 << p;
        }
    }
    bits
}

impl LowLatencyBuffer {
    /// *Collective.* The group's next object: allocates `opts.num_ll_bytes` on
    /// `device`, maps every peer's buffer, and (when the proxy transport is
    /// needed) builds port channels and starts the proxy, on the group's
    /// Communicator (made now, with `opts.timeout` bounding its host waits, if
    /// this is the group's first object). The proxy's connections are CUDA
    /// IPC ones: the Communicator needs no Ethernet receiver.
    pub(crate) fn new(group: &Group, device: Device, opts: &EpBufferOptions) -> Result<Self> {
        let ll = &opts.low_latency;
        let (mut part, region) =
            PartBase::join(group, device, opts, PartKind::LowLatency, || Ok(None))?;
        let comm = part.comm().clone();
        let rank = comm.rank();
        // Peers through the proxy: every one (forced, or some not mapped), the
        // ranks of other nodes (a group that spans nodes: mixed transports),
        // or none.
        let proxied = proxied_peers(comm.topology(), !ll.allow_nvlink || !region.all_mapped());
        let use_proxy = proxied != 0;
        if use_proxy && region.len() > u64::from(u32::MAX) {
            return Err(CommError::invalid(
                "num_rdma_bytes",
                "the proxy transport addresses at most 4 GiB per buffer",
            ));
        }
        // Every rank's buffer as mapped here (0: not mapped, reached by the proxy).
        let peers_table = device_table(device, &region.bases())?;
        let (proxy, ports, ports_table) = if use_proxy {
            let mut proxy = ProxyService::new(rank, Some(device), FIFO_SLOTS, rank as u64)?;
            let ports = comm.port_channels(&proxy, region.local(), Transport::CudaIpc)?;
            let handles: Vec<Option<PortChannelDeviceHandle>> = ports
                .iter()
                .map(|p| {
                    p.as_ref()
                        .map(|c| c.device_handle(part.member().device_error()))
                })
                .collect();
            let table = device_table(device, &handles)?;
            proxy.start()?;
            (Some(proxy), ports, Some(table))
        } else {
            (None, Vec::new(), None)
        };
        let state = DeviceMemory::alloc(device, 4 * STATE_WORDS)?;
        state.fill(0)?;
        let mask = DeviceMemory::alloc(device, 4 * k::MAX_RANKS)?;
        mask.fill(0)?;
        // One block per SM of this rank's share of the GPU: every rank's blocks
        // are resident together, also where ranks share a GPU (under MPS).
        let num_blocks = comm.device_share().sms.max(1);
        let prof = PhaseStamps::from_env(
            device,
            "MOELINK_LL_PROFILE",
            2 * k::PROF_BLOCKS * k::PROF_SLOTS,
        )?;
        part.ready()?;
        Ok(Self {
            proxy,
            ports,
            ports_table,
            peers_table,
            proxied,
            mem: region,
            state,
            mask,
            prof,
            part,
            shrink: ll.shrink,
            num_blocks,
            sync_epoch: AtomicU32::new(0),
        })
    }

    /// Whether peers are reached through the CPU proxy (port channels).
    pub fn uses_proxy(&self) -> bool {
        self.proxy.is_some()
    }

    /// Device address of the int32 `[R]` rank mask.
    pub fn mask_ptr(&self) -> u64 {
        self.mask.ptr()
    }

    /// Blocks of every launch (default: one per SM of this rank's share of its
    /// GPU; more is capped to that share, so ranks sharing a GPU stay resident).
    pub fn set_num_blocks(&mut self, n: u32) {
        self.num_blocks = self
            .part
            .device_share()
            .cap("low-latency num_blocks", n.max(1));
    }

    pub fn num_blocks(&self) -> u32 {
        self.num_blocks
    }

    /// How far the proxy got (None: peers are reached over NVLink): triggers
    /// popped from its FIFO, and per peer (None for this rank) the triggers of
    /// its channel performed and whether its copies are still in flight. With
    /// the flags of the buffer this tells a lost trigger from a copy that never
    /// ran when a receive times out.
    pub fn proxy_progress(&self) -> Option<(u64, Vec<Option<comm::proxy::ChannelProgress>>)> {
        let proxy = self.proxy.as_ref()?;
        let per_peer = self
            .ports
            .iter()
            .map(|p| p.as_ref().and_then(|c| proxy.channel_state(c.channel)))
            .collect();
        Some((proxy.fifo().tail(), per_peer))
    }

    fn shape(&self, s: &CallShape) -> Result<LlShape> {
        let CallShape {
            max_tokens,
            hidden,
            num_experts,
            num_topk,
        } = *s;
        let shape = checked_shape(self.part.num_ranks(), s)?;
        // What the size hint asks for this (T, hidden, experts), whatever
        // this buffer's transport and the call's top-k: a Buffer takes the
        // calls that the hint it was sized by covers, as DeepEP's does, not
        // more experts or tokens because NVLink or a small top-k needs less.
        let need = hint_bytes(&shape);
        if need > self.mem.len() {
            let most = max_experts_fitting(&shape, self.mem.len());
            let (name, most) = if most < num_experts {
                (
                    "num_experts",
                    format!(" (at most {most} experts at this size)"),
                )
            } else {
                ("num_rdma_bytes", String::new())
            };
            return Err(CommError::invalid(
                name,
                format!(
                    "rank {}: the low-latency buffer has {} bytes{most}, this call needs {need} \
                     (T={max_tokens}, hidden={hidden}, experts={num_experts}, top-k={num_topk}); \
                     size it with Buffer.get_low_latency_rdma_size_hint",
                    self.part.rank(),
                    self.mem.len()
                ),
            ));
        }
        Ok(shape)
    }

    /// Checks a call's shape against the kernels' limits and this buffer's
    /// size, so that a caller can refuse it before allocating its outputs.
    pub fn check_shape(&self, s: &CallShape) -> Result<()> {
        self.shape(s).map(|_| ())
    }

    /// Device address of the zero-copy combine input for this shape.
    pub fn zero_copy_buffer(
        &self,
        max_tokens: usize,
        hidden: usize,
        num_experts: usize,
    ) -> Result<(u64, usize)> {
        let shape = self.shape(&CallShape::new(max_tokens, hidden, num_experts, 1))?;
        let l = shape.layout(self.uses_proxy());
        Ok((
            self.mem.ptr() + l.zero_copy,
            shape.zero_copy_bytes() as usize,
        ))
    }

    fn ctx(&self, shape: &LlShape) -> LlCtx {
        let l = shape.layout(self.uses_proxy());
        LlCtx {
            peers: self.peers_table.ptr(),
            ports: self.ports_table.as_ref().map_or(0, |t| t.ptr()),
            local: self.mem.ptr(),
            state: self.state.ptr(),
            mask: self.mask.ptr(),
            error: self.part.error_ptr(),
            zc_offset: l.zero_copy,
            recv_offset: l.recv,
            stage_offset: l.stage,
            timeout_ns: self.part.device_timeout_ns() as u64,
            rank: self.part.rank() as i32,
            num_ranks: self.part.num_ranks() as i32,
            use_proxy: self.proxied as i32,
            shrink: i32::from(self.shrink),
            prof: self.prof.ptr(),
        }
    }

    /// The phase stamps of the latest launches, `[2][PROF_BLOCKS][PROF_SLOTS]`
    /// (dispatch, combine), after synchronising the device. Errors unless the
    /// buffer was created with `MOELINK_LL_PROFILE=1`.
    pub fn profile(&self) -> Result<Vec<u64>> {
        self.prof.read(self.part.device())
    }

    /// The launch of a call of shape `s` with `num_tokens` tokens (`arg`
    /// names them in the error where they are more than `s.max_tokens`).
    fn launch(
        &self,
        stream: StreamHandle,
        s: &CallShape,
        num_tokens: usize,
        arg: &'static str,
    ) -> Result<Launch<'_>> {
        let shape = self.shape(s)?;
        if num_tokens > s.max_tokens {
            return Err(CommError::invalid(
                arg,
                format!(
                    "{num_tokens} tokens > num_max_dispatch_tokens_per_rank {}",
                    s.max_tokens
                ),
            ));
        }
        Ok(Launch {
            kernels: self.part.kernels(),
            stream,
            ctx: self.ctx(&shape),
            shape,
            num_blocks: self.num_blocks,
        })
    }

    /// Launches `phases` of a low-latency dispatch on `stream`.
    pub fn dispatch(
        &self,
        stream: StreamHandle,
        call: &DispatchCall,
        phases: Phases,
    ) -> Result<()> {
        let s = &call.shape;
        let l = self.launch(stream, s, call.num_tokens, "x")?;
        if call.use_ue8m0 && !call.round_scale {
            return Err(CommError::invalid(
                "use_ue8m0",
                "use_ue8m0=True needs round_scale=True",
            ));
        }
        let a = DispatchArgs {
            x: call.x,
            topk: call.topk_idx,
            out: call.out,
            msg_bytes: l.shape.msg_bytes(call.use_fp8, call.use_ue8m0) as i64,
            inbox_bytes: l.shape.dispatch_inbox_bytes(call.use_fp8, call.use_ue8m0) as i64,
            sizes: LlSizes::new(call.num_tokens, &l.shape),
            use_fp8: i32::from(call.use_fp8),
            round_scale: i32::from(call.use_fp8 && call.round_scale),
            use_ue8m0: i32::from(call.use_fp8 && call.use_ue8m0),
            phases: phases as i32,
            pad_: 0,
        };
        // SAFETY: the Python layer checked every tensor against this shape.
        unsafe { k::dispatch(&l, a) }
    }

    /// Launches `phases` of a low-latency combine on `stream`.
    pub fn combine(&self, stream: StreamHandle, call: &CombineCall, phases: Phases) -> Result<()> {
        let s = &call.shape;
        let l = self.launch(stream, s, call.num_tokens, "topk_idx")?;
        let a = CombineArgs {
            x: call.x,
            layout_range: call.layout_range,
            topk: call.topk_idx,
            weights: call.topk_weights,
            out: call.out,
            stats_wait: call.stats_wait,
            inbox_bytes: l.shape.combine_inbox_bytes() as i64,
            sizes: LlSizes::new(call.num_tokens, &l.shape),
            phases: phases as i32,
        };
        // SAFETY: as above.
        unsafe { k::combine(&l, a) }
    }

    /// [`Self::dispatch`] or [`Self::combine`] of `call` as an API call runs
    /// it: refuses to launch once a device wait of this part ran out (the
    /// ranks are out of step; nothing is launched), launches `phases`, and
    /// where they include the receive returns what the kernels recorded (an
    /// expert id out of range, in this call or an earlier one) for the caller
    /// to raise after its own bookkeeping: the launch happened, so the ranks
    /// stay in step. Without a receive it returns None: a send-only launch is
    /// followed by its hook, which reports.
    pub fn call(
        &self,
        stream: StreamHandle,
        call: &LlCall,
        phases: Phases,
    ) -> Result<Option<CommError>> {
        self.check_device_timeout()?;
        match call {
            LlCall::Dispatch(c) => self.dispatch(stream, c, phases),
            LlCall::Combine(c) => self.combine(stream, c, phases),
        }?;
        Ok(match phases {
            Phases::Send => None,
            Phases::Recv | Phases::Both => self.check_device().err(),
        })
    }

    /// *Collective.* Resets the flags, release counts and the send and
    /// receive counters of every rank (the caller has synchronised its streams:
    /// no low-latency kernel runs, no receive hook is pending) and
    /// forgets a recorded device error (a timeout): the ranks are in step again.
    /// The rank mask is kept.
    ///
    /// With shrink, the two barriers around the reset are rank-mask aware
    /// (`masked_barrier`): masked ranks are not waited for, and a rank that
    /// does not enter within the device-wait bound is masked; the clean then
    /// completes for the others. Without shrink they are the bootstrap's
    /// barriers (bounded by the host timeout, an error when a rank is missing).
    pub fn clean(&self) -> Result<()> {
        self.part.device().synchronize()?;
        self.clean_barrier()?;
        let device = self.part.device();
        // SAFETY: the ranges are ours and idle (the barrier words stay).
        unsafe {
            device.memset_sync(self.mem.ptr(), SYNC_OFFSET as usize, 0)?;
            device.memset_sync(
                self.mem.ptr() + SYNC_END,
                (FLAGS_BYTES - SYNC_END) as usize,
                0,
            )?;
            device.memset_sync(self.state.ptr(), 4 * STATE_WORDS, 0)?;
        }
        self.part.member().device_error().reset();
        self.clean_barrier()
    }

    /// A barrier of `clean`: rank-mask aware with shrink, else the bootstrap's.
    fn clean_barrier(&self) -> Result<()> {
        if !self.shrink {
            return self.barrier();
        }
        let epoch = self
            .sync_epoch
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_add(1);
        let bound = self.device_bound();
        let masked = masked_barrier(&BufferSync(self), epoch, bound)?;
        for p in masked {
            tracing::warn!(
                "rank {}: rank {p} did not enter clean_low_latency_buffer within {bound:?} \
                 (the low-latency device-wait bound): masked",
                self.part.rank()
            );
        }
        Ok(())
    }

    /// The device-wait bound of this part as a host duration: how long a
    /// shrink `clean` waits for a rank, and a shrink `destroy` for the proxy.
    fn device_bound(&self) -> Duration {
        Duration::from_nanos(self.part.device_timeout_ns().max(1) as u64)
    }

    /// Whether the buffer was made with shrink (a silent peer is masked).
    pub fn shrink(&self) -> bool {
        self.shrink
    }

    /// Waits until the proxy (if any) has performed every trigger the
    /// kernels pushed and has no copy in flight, at most the device-wait
    /// bound: a shrink `destroy` frees the part without a barrier, and the
    /// proxy's queued triggers (the last call's sends to its peers) must not
    /// go with it. The caller synchronised the device (no kernel pushes any
    /// more). `Ok(false)`: not drained within the bound.
    pub fn drain_proxy(&self) -> Result<bool> {
        let Some(proxy) = &self.proxy else {
            return Ok(true);
        };
        let mut head = [0u64];
        let head_ptr = proxy.fifo_handle().head;
        if head_ptr != 0 {
            // SAFETY: the FIFO's head word, device memory of this process.
            unsafe { k::host::read(self.part.device(), head_ptr, &mut head) }?;
        }
        let (start, bound) = (Instant::now(), self.device_bound());
        loop {
            proxy.check()?;
            let idle = self.ports.iter().flatten().all(|c| {
                proxy
                    .channel_state(c.channel)
                    .is_none_or(|state| state.busy != Some(true))
            });
            if idle && proxy.processed() >= head[0] {
                return Ok(true);
            }
            if start.elapsed() >= bound {
                return Ok(false);
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    /// Clears the rank mask (synchronously).
    pub fn clean_mask(&self) -> Result<()> {
        self.mask.fill(0)
    }
}

/// One rank's view of a rank barrier whose ranks signal each other through
/// words of each other's memory (the shrink `clean`'s: [`masked_barrier`]).
pub(crate) trait RankSync {
    fn rank(&self) -> usize;
    fn num_ranks(&self) -> usize;
    /// Writes `epoch` into peer `peer`'s word for this rank.
    fn post(&self, peer: usize, epoch: u32) -> Result<()>;
    /// This rank's words: entry `s`, the latest epoch rank `s` posted here.
    fn words(&self, out: &mut [u32]) -> Result<()>;
    /// The rank mask (non-zero: masked).
    fn mask(&self, out: &mut [i32]) -> Result<()>;
    /// Masks rank `peer`.
    fn set_masked(&self, peer: usize) -> Result<()>;
}

/// Whether a word shows epoch `epoch` entered (or a later one: the peer
/// left this barrier and entered the next), with wrap-around.
fn reached(word: u32, epoch: u32) -> bool {
    (word.wrapping_sub(epoch) as i32) >= 0
}

/// A rank-mask aware barrier, DeepEP's shrink barrier done by the host: this
/// rank posts `epoch` to every other rank (masked ones too: a peer that
/// masked nobody does not wait in vain), then waits until every rank that is
/// not masked here posted `epoch` (or later) to it; the ranks still missing
/// after `bound` are masked. Returns those. The ranks that enter take the
/// same epochs as long as none of them skipped a barrier: a rank that missed
/// one (it was masked) is masked again at the next, so that a failed rank
/// stays out until the Buffer is made anew.
pub(crate) fn masked_barrier(
    sync: &impl RankSync,
    epoch: u32,
    bound: Duration,
) -> Result<Vec<usize>> {
    let (me, n) = (sync.rank(), sync.num_ranks());
    for p in (0..n).filter(|&p| p != me) {
        sync.post(p, epoch)?;
    }
    let mut mask = vec![0i32; n];
    sync.mask(&mut mask)?;
    let mut waiting: Vec<usize> = (0..n).filter(|&p| p != me && mask[p] == 0).collect();
    let mut words = vec![0u32; n];
    let start = Instant::now();
    let mut pause = Duration::from_micros(10);
    loop {
        if waiting.is_empty() {
            return Ok(Vec::new());
        }
        sync.words(&mut words)?;
        waiting.retain(|&p| !reached(words[p], epoch));
        if waiting.is_empty() {
            return Ok(Vec::new());
        }
        if start.elapsed() >= bound {
            for &p in &waiting {
                sync.set_masked(p)?;
            }
            return Ok(waiting);
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_micros(200));
    }
}

/// [`RankSync`] over a low-latency buffer: the words at [`SYNC_OFFSET`] of
/// every rank's buffer (peers' as mapped here), the device rank mask.
struct BufferSync<'a>(&'a LowLatencyBuffer);

impl RankSync for BufferSync<'_> {
    fn rank(&self) -> usize {
        self.0.part.rank()
    }

    fn num_ranks(&self) -> usize {
        self.0.part.num_ranks()
    }

    fn post(&self, peer: usize, epoch: u32) -> Result<()> {
        let base = self.0.mem.bases()[peer].ok_or_else(|| {
            CommError::invalid(
                "enable_shrink",
                format!(
                    "rank {}: rank {peer}'s low-latency buffer is not mapped here; a shrink \
                     clean needs every peer's buffer mapped (one host)",
                    self.rank()
                ),
            )
        })?;
        let ptr = base + SYNC_OFFSET + 4 * self.rank() as u64;
        // SAFETY: our word in peer's buffer, mapped here (a peer that freed
        // its buffer early: our mapping keeps the memory); no kernel uses it.
        unsafe { k::host::write(self.0.part.device(), ptr, &[epoch]) }
    }

    fn words(&self, out: &mut [u32]) -> Result<()> {
        // SAFETY: R words of our own buffer.
        unsafe { k::host::read(self.0.part.device(), self.0.mem.ptr() + SYNC_OFFSET, out) }
    }

    fn mask(&self, out: &mut [i32]) -> Result<()> {
        self.0.mask.copy_to_host(0, out)
    }

    fn set_masked(&self, peer: usize) -> Result<()> {
        self.0.mask.copy_from_host(4 * peer, &[1i32])
    }
}

impl BufferPart for LowLatencyBuffer {
    fn base(&self) -> &PartBase {
        &self.part
    }

    /// Device address and length of this rank's buffer.
    fn local_buffer(&self) -> (u64, usize) {
        (self.mem.ptr(), self.mem.len() as usize)
    }

    /// Errors the proxy or its FIFO reported, if any.
    fn check_transport(&self) -> Result<()> {
        if let Some(p) = &self.proxy {
            p.fifo().error().check()?;
            p.check()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    mod rank_sync {
        use super::super::{masked_barrier, reached, RankSync};
        use comm::error::Result;
        use std::sync::atomic::{AtomicI32, AtomicU32, Ordering};
        use std::sync::Arc;
        use std::time::{Duration, Instant};

        /// Every rank's barrier words and rank mask, in host memory.
        struct Shared {
            words: Vec<Vec<AtomicU32>>,
            masks: Vec<Vec<AtomicI32>>,
        }

        fn shared(n: usize) -> Arc<Shared> {
            fn grid<T: Default>(n: usize) -> Vec<Vec<T>> {
                (0..n)
                    .map(|_| (0..n).map(|_| T::default()).collect())
                    .collect()
            }
            Arc::new(Shared {
                words: grid(n),
                masks: grid(n),
            })
        }

        struct Fake {
            rank: usize,
            s: Arc<Shared>,
        }

        impl RankSync for Fake {
            fn rank(&self) -> usize {
                self.rank
            }
            fn num_ranks(&self) -> usize {
                self.s.words.len()
            }
            fn post(&self, peer: usize, epoch: u32) -> Result<()> {
                self.s.words[peer][self.rank].store(epoch, Ordering::Release);
                Ok(())
            }
            fn words(&self, out: &mut [u32]) -> Result<()> {
                for (o, w) in out.iter_mut().zip(&self.s.words[self.rank]) {
                    *o = w.load(Ordering::Acquire);
                }
                Ok(())
            }
            fn mask(&self, out: &mut [i32]) -> Result<()> {
                for (o, m) in out.iter_mut().zip(&self.s.masks[self.rank]) {
                    *o = m.load(Ordering::Acquire);
                }
                Ok(())
            }
            fn set_masked(&self, peer: usize) -> Result<()> {
                self.s.masks[self.rank][peer].store(1, Ordering::Release);
                Ok(())
            }
        }

        fn masked(s: &Shared, rank: usize) -> Vec<usize> {
            (0..s.masks.len())
                .filter(|&p| s.masks[rank][p].load(Ordering::Acquire) != 0)
                .collect()
        }

        /// Runs `f(rank, sync)` on every rank of `n` but `absent`, in threads.
        fn on_ranks<T: Send + 'static>(
            s: &Arc<Shared>,
            absent: &[usize],
            f: impl Fn(usize, &Fake) -> T + Send + Sync + 'static,
        ) -> Vec<(usize, T)> {
            let f = Arc::new(f);
            let threads: Vec<_> = (0..s.words.len())
                .filter(|r| !absent.contains(r))
                .map(|rank| {
                    let (s, f) = (s.clone(), f.clone());
                    std::thread::spawn(move || (rank, f(rank, &Fake { rank, s })))
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        }

        const BOUND: Duration = Duration::from_millis(400);

        #[test]
        fn epochs_compare_across_wrap_around() {
            assert!(reached(5, 5) && reached(6, 5) && !reached(4, 5));
            assert!(reached(0, u32::MAX) && reached(1, u32::MAX));
            assert!(!reached(u32::MAX, 0));
        }

        #[test]
        fn ranks_that_enter_late_within_the_bound_meet_and_nobody_is_masked() {
            let s = shared(4);
            let got = on_ranks(&s, &[], |rank, sync| {
                let mut out = Vec::new();
                for epoch in 1..=3 {
                    // Staggered arrivals, well within the bound.
                    std::thread::sleep(Duration::from_millis(20 * rank as u64));
                    out.extend(masked_barrier(sync, epoch, BOUND).unwrap());
                }
                out
            });
            assert!(got.iter().all(|(_, m)| m.is_empty()), "{got:?}");
            assert!((0..4).all(|r| masked(&s, r).is_empty()));
        }

        #[test]
        fn a_rank_that_never_enters_is_masked_by_the_others_after_the_bound() {
            let s = shared(4);
            let got = on_ranks(&s, &[2], |_, sync| {
                let t0 = Instant::now();
                let newly = masked_barrier(sync, 1, BOUND).unwrap();
                // The next barrier no longer waits for it.
                let t1 = Instant::now();
                let again = masked_barrier(sync, 2, BOUND).unwrap();
                (newly, again, t0.elapsed() - t1.elapsed(), t1.elapsed())
            });
            for (rank, (newly, again, first, second)) in got {
                assert_eq!(newly, vec![2], "rank {rank}");
                assert!(again.is_empty(), "rank {rank}");
                assert!(
                    first >= BOUND && first < BOUND * 5,
                    "rank {rank}: {first:?}"
                );
                assert!(second < BOUND / 2, "rank {rank}: {second:?}");
                assert_eq!(masked(&s, rank), vec![2]);
            }
        }

        #[test]
        fn masked_ranks_are_not_waited_for_but_are_still_told() {
            let s = shared(3);
            // Rank 0 masked rank 1 (a timeout of its own); rank 1 masked nobody.
            s.masks[0][1].store(1, Ordering::Release);
            // Rank 2 is gone and masked everywhere.
            s.masks[0][2].store(1, Ordering::Release);
            s.masks[1][2].store(1, Ordering::Release);
            let got = on_ranks(&s, &[2], |rank, sync| {
                if rank == 1 {
                    std::thread::sleep(BOUND / 4);
                }
                let t0 = Instant::now();
                (masked_barrier(sync, 1, BOUND).unwrap(), t0.elapsed())
            });
            for (rank, (newly, took)) in got {
                assert!(newly.is_empty(), "rank {rank}: {newly:?}");
                assert!(took < BOUND, "rank {rank}: {took:?}");
            }
            // Rank 1 met rank 0 (which posted to it though it masked it).
            assert_eq!(masked(&s, 1), vec![2]);
        }

        #[test]
        fn a_rank_that_skipped_a_barrier_is_masked_again_at_the_next() {
            let s = shared(2);
            // Rank 1 misses epoch 1: rank 0 masks it.
            let got = on_ranks(&s, &[1], |_, sync| masked_barrier(sync, 1, BOUND).unwrap());
            assert_eq!(got[0].1, vec![1]);
            // Everything unmasked; rank 1 comes back at its epoch 1, rank 0 is at 2.
            s.masks[0][1].store(0, Ordering::Release);
            let got = on_ranks(&s, &[], |rank, sync| {
                masked_barrier(sync, if rank == 0 { 2 } else { 1 }, BOUND).unwrap()
            });
            assert_eq!(got[0].1, vec![1], "rank 0 masks the rank behind it");
            assert!(got[1].1.is_empty(), "rank 1 sees epoch 2 >= 1");
        }
    }

    #[test]
    fn proxied_peers_are_all_other_nodes_or_everyone() {
        use comm::topology::Topology;
        let one_gpu = vec![(7u64, [1u8; 16]); 8];
        let t = Topology::new(5, &one_gpu, |_| true, Some(4), false).unwrap();
        assert_eq!(
            proxied_peers(&t, false),
            0b0000_1111,
            "node 0's ranks from rank 5"
        );
        assert_eq!(proxied_peers(&t, true), 0b1101_1111, "every rank but 5");
        let t = Topology::new(2, &one_gpu, |_| true, None, false).unwrap();
        assert_eq!(proxied_peers(&t, false), 0, "one node: NVLink only");
        assert_eq!(proxied_peers(&t, true), 0b1111_1011);
        let t = Topology::new(31, &vec![(7u64, [1u8; 16]); 32], |_| true, Some(16), false).unwrap();
        assert_eq!(proxied_peers(&t, false), 0x0000_ffff);
    }

    #[test]
    fn the_experts_a_hinted_buffer_fits_are_the_hinted_ones() {
        let hint = size_hint(128, 7168, 4, 288).unwrap() as u64;
        let s = LlShape {
            num_ranks: 4,
            max_tokens: 128,
            hidden: 7168,
            num_experts: 576,
            num_topk: 8,
        };
        // Twice the experts: the call's own layout (top-k 8, NVLink) would
        // fit, but the hint for 576 experts is more than the buffer has.
        assert!(s.layout(false).total <= hint);
        assert!(hint_bytes(&s) > hint);
        assert_eq!(max_experts_fitting(&s, hint), 288);
        assert_eq!(max_experts_fitting(&s, hint - 128), 284);
        assert_eq!(max_experts_fitting(&s, 0), 0);
    }

    #[test]
    fn size_hint_covers_every_topk_and_both_transports() {
        let hint = size_hint(128, 7168, 4, 288).unwrap();
        assert_eq!(hint % 128, 0);
        for k in [1, 8, 32] {
            let s = LlShape {
                num_ranks: 4,
                max_tokens: 128,
                hidden: 7168,
                num_experts: 288,
                num_topk: k,
            };
            assert!(s.layout(true).total as usize <= hint);
            assert!(s.layout(false).total as usize <= hint);
        }
        assert!(size_hint(128, 7168, 4, 287).is_err());
        assert!(size_hint(128, 100, 4, 288).is_err());
    }

    #[test]
    fn size_hint_applies_the_limits() {
        use crate::limits::{LL_MAX_HIDDEN, LL_MAX_TOKENS_PER_RANK, MAX_RANKS};
        let name = |r: Result<usize>| match r {
            Err(CommError::InvalidArgument { name, .. }) => name,
            other => panic!("expected InvalidArgument, got {other:?}"),
        };
        assert_eq!(name(size_hint(128, 2 * LL_MAX_HIDDEN, 4, 16)), "hidden");
        assert_eq!(
            name(size_hint(LL_MAX_TOKENS_PER_RANK + 1, 128, 4, 16)),
            "num_max_dispatch_tokens_per_rank"
        );
        assert_eq!(name(size_hint(128, 128, MAX_RANKS + 1, 66)), "group");
        assert_eq!(name(size_hint(128, 128, 2, 4096)), "num_experts");
        // Shared memory: 8192 experts do not fit a block at any hidden.
        assert_eq!(name(size_hint(128, 128, 8, 8192)), "num_experts");
        // The largest shape within the limits does not overflow.
        let big = size_hint(LL_MAX_TOKENS_PER_RANK, LL_MAX_HIDDEN, MAX_RANKS, 3840).unwrap();
        assert!(big > 1 << 40);
    }
}
