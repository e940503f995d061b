//! The internode part of `moelink.Buffer` (docs/design-internode.md):
//! what replaces the intranode part when the group spans more than one node
//! (hosts, or emulated nodes of `MOELINK_RANKS_PER_NODE` consecutive ranks).
//! One region per rank (`num_nvl_bytes + num_rdma_bytes`), memory channels to
//! this node's ranks only, port channels (the CPU proxy, one or more threads:
//! `MOELINK_PROXY_THREADS`) to every other rank, and the launch sequences of
//! the kernels of `ep-kernels/cuda/internode.cu`.
//!
//! As [`crate::intranode`], all tensors are raw device addresses checked by
//! the caller, every method launches on the given stream and returns without
//! waiting except [`InternodeBuffer::wait_counts`], and every rank makes the
//! same sequence of calls. A dispatch runs its send side (senders, the
//! coordinators of the cross-node streams, forwarders) on the caller's stream
//! and the receive side (intranode's receivers: forwarded records land in the
//! same fixed slots) on the Buffer's side stream at the same time.

use std::time::Duration;

use comm::channel::{MemoryChannel, PortChannel};
use comm::cuda::{OwnedStream, StreamOrder};
use comm::error::{CommError, Result};
use comm::host_memory::HostMemory;
use comm::proxy::ChannelProgress;
use comm::proxy_pool::{Placement, PooledChannel, ProxyPool};
use comm::topology::Reach;
use comm::transport::{CrossNode, Transport, TRANSPORT_ENV};
use comm::{device_table, DeviceMemory, StreamHandle, SymmetricRegion};
use ep_kernels::internode::{
    self as x, CombineGrid, SendGrid, XCombineArgs, XCtx, XDispatchArgs, XNotifyArgs,
    XRecordLayout, MAX_CHUNK, MAX_NODES, STAGE_BYTES,
};
use ep_kernels::intranode::{
    self as k, FusedGrid, IntranodeCtx, RecordLayout, RecvArgs, CTRL_BYTES,
};

use crate::intranode::{
    dispatch_state, experts_per_rank, notify_args, send_args, without_topk, CombineArgs,
    DispatchInputs, DispatchOutputs, DispatchShape, HostCounts, LayoutCall, COMBINE_CALLS_OFFSET,
    DISPATCH_SEND_CALLS_OFFSET, HOST_BYTES,
};
use crate::part::{BufferPart, EpBufferOptions, PartBase};

/// The scratch words are the intranode part's (ticket, timed-out peers,
/// epoch, call counters, receive ticket), then the landed words.
const EPOCH_OFFSET: u64 = 8;
const LANDED_OFFSET: u64 = 64;
const _: () = assert!(LANDED_OFFSET as usize >= crate::intranode::SCRATCH_BYTES);
const SCRATCH_BYTES: usize = (LANDED_OFFSET + x::LANDED_BYTES) as usize;
/// Trigger slots of each proxy thread's FIFO.
const FIFO_SLOTS: usize = 1024;
/// Records per port-channel put: at hidden 7168 bf16 one put moves ~115 KB.
/// (It was an environment switch while the internode stall was hunted; no
/// size changed the stall, whose cause was elsewhere: docs/design-internode.md.)
pub const CHUNK: usize = 8;
const _: () = assert!(CHUNK >= 1 && CHUNK <= MAX_CHUNK);
/// Receiving share of a dispatch's and a combine's blocks, percent.
const RECV_PERCENT: u32 = 50;

/// What an internode dispatch adds to the intranode inputs: device addresses
/// of the handle's extra tensors.
#[derive(Clone, Copy, Debug, Default)]
pub struct XInputs {
    /// `[N_tok, nodes]` int32: written by notify (normal), read (cached, combine).
    pub node_head: u64,
    /// `[2 * nodes]` int32: likewise.
    pub xcounts: u64,
    /// `[nodes][meta_slots][1 + L]` int32: written by the forwarders, read by combine.
    pub fwd_meta: u64,
    pub meta_slots: usize,
    /// `[nodes]` int32 written by notify (normal dispatch), or 0 (none):
    /// DeepEP's `recv_rdma_rank_prefix_sum`, see
    /// [`ep_kernels::internode::XNotifyArgs::recv_rdma_rank_prefix_sum`].
    pub recv_rdma_rank_prefix_sum: u64,
}

/// Region offsets and slot counts of one dispatch (or combine) geometry.
#[derive(Clone, Copy, Debug)]
struct Geometry {
    slots: usize,
    first: u64,
    second: u64,
    third: u64,
}

/// How one rank's region of `region_len` bytes is split (the same on every
/// rank): control and notify staging, then a dispatch half and a combine
/// half whose slot counts follow from the call's record sizes.
#[derive(Clone, Copy, Debug)]
struct Split {
    region_len: u64,
    ranks: u64,
    nodes: u64,
    ranks_per_node: u64,
}

impl Split {
    /// Bytes of each half (dispatch, combine) after control and staging.
    fn half_bytes(&self) -> u64 {
        self.region_len.saturating_sub(CTRL_BYTES + STAGE_BYTES) / 2 / 16 * 16
    }

    /// The NVL record of a dispatch of `shape` and its cross-node record.
    fn records(&self, shape: &DispatchShape) -> Result<(RecordLayout, XRecordLayout)> {
        let rec = RecordLayout::dispatch(shape.hidden_bytes, shape.num_scales, shape.num_topk)?;
        let xrec = XRecordLayout::new(&rec, self.ranks_per_node as usize)?;
        Ok((rec, xrec))
    }

    /// Dispatch geometry: slots per source (and per node); the NVL slots
    /// `[R][T]`, xsend `[N][T]`, xrecv `[N][T]` offsets.
    fn dispatch(&self, rec: &RecordLayout, xrec: &XRecordLayout) -> Geometry {
        let (r, n) = (self.ranks, self.nodes);
        let per_token = r * rec.bytes as u64 + 2 * n * xrec.rec.bytes as u64;
        let slots = self.half_bytes() / per_token;
        let first = CTRL_BYTES + STAGE_BYTES;
        let xsend = first + r * slots * rec.bytes as u64;
        Geometry {
            slots: slots as usize,
            first,
            second: xsend,
            third: xsend + n * slots * xrec.rec.bytes as u64,
        }
    }

    /// Combine geometry: slots; the combine slots `[R][T]`, fwd `[L][N][T]`,
    /// psend `[N][T]` offsets; and where precv `[N][T]` ends.
    fn combine(&self, hidden: usize, num_topk: usize) -> (Geometry, u64) {
        let crec = k::combine_record_bytes(hidden, num_topk) as u64;
        let (r, n, l) = (self.ranks, self.nodes, self.ranks_per_node);
        let per_token = (r + l * n + 2 * n) * crec;
        let slots = self.half_bytes() / per_token;
        let first = CTRL_BYTES + STAGE_BYTES + self.half_bytes();
        let fwd = first + r * slots * crec;
        let psend = fwd + l * n * slots * crec;
        (
            Geometry {
                slots: slots as usize,
                first,
                second: fwd,
                third: psend,
            },
            psend + n * slots * crec,
        )
    }
}

/// The send side of a dispatch, launched with its receive half by
/// [`InternodeBuffer::dispatch_recv`].
#[derive(Clone, Copy, Debug)]
struct PendingRecv {
    xc: XCtx,
    send: XDispatchArgs,
}

/// The internode part of an [`EpBuffer`](crate::EpBuffer).
pub struct InternodeBuffer {
    // Dropped first: the proxy threads stop before the memory they copy goes.
    pool: ProxyPool,
    _ports: Vec<Option<PortChannel>>,
    ports_table: DeviceMemory,
    part: PartBase,
    region: SymmetricRegion,
    _channels: Vec<Option<MemoryChannel>>,
    channel_table: DeviceMemory,
    /// `[0..4)` ticket, `[4..8)` timed-out peers, `[8..16)` notify epoch,
    /// `[16..40)` dispatch send / dispatch receive / combine calls,
    /// `[40..44)` receive-only ticket, `[64..)` landed words.
    scratch: DeviceMemory,
    side: OwnedStream,
    after_notify: StreamOrder,
    after_recv: StreamOrder,
    pending: Option<PendingRecv>,
    host: HostMemory,
    host_epoch: u64,
    combine_dirty: bool,
    timeout: Duration,
    ranks_per_node: usize,
    num_nodes: usize,
    transport: Transport,
}

/// Where this rank's Ethernet receiver listens, for a Communicator made by an
/// internode-capable Buffer: `MOELINK_ETHERNET_ADDR` (`host:port`, port 0: any;
/// an address the other hosts reach), else `127.0.0.1:0` when
/// `MOELINK_TRANSPORT=ethernet` (enough for emulated nodes of one host; the
/// Buffer refuses it when another host is in the group), else none (CUDA IPC
/// between emulated nodes, IB verbs between hosts).
pub fn ethernet_receiver() -> Result<Option<std::net::SocketAddr>> {
    let parse = |name: &str, v: &str| {
        v.parse().map(Some).map_err(|_| {
            CommError::invalid(
                "MOELINK_ETHERNET_ADDR",
                format!("{name}: {v:?} is not host:port"),
            )
        })
    };
    if let Some(v) = comm::env::var("MOELINK_ETHERNET_ADDR") {
        if !v.trim().is_empty() {
            return parse("MOELINK_ETHERNET_ADDR", v.trim());
        }
    }
    match CrossNode::from_env()? {
        CrossNode::Ethernet => parse(TRANSPORT_ENV, "127.0.0.1:0"),
        _ => Ok(None),
    }
}

/// Whether a rank of another node is on another host (not an emulated node
/// of this one).
fn other_host(topo: &comm::topology::Topology) -> bool {
    topo.peers()
        .iter()
        .any(|p| p.node != topo.node() && !p.same_host)
}

/// The other nodes are reached over Ethernet: this rank's receiver must be
/// one they reach. None at all, or the loopback default of
/// `MOELINK_TRANSPORT=ethernet` (`ethernet_receiver`) with another host in
/// the group, is refused naming `MOELINK_ETHERNET_ADDR`.
fn check_ethernet_receiver(comm: &comm::Communicator) -> Result<()> {
    if !comm.has_ethernet() {
        return Err(CommError::invalid(
            "MOELINK_ETHERNET_ADDR",
            "the other nodes are reached over Ethernet, but this rank's Communicator has \
             no Ethernet receiver: set MOELINK_ETHERNET_ADDR=host:port (an address the \
             other hosts reach) on every rank before its first Buffer or AllReduce",
        ));
    }
    if other_host(comm.topology()) && comm::env::var("MOELINK_ETHERNET_ADDR").is_none() {
        return Err(CommError::invalid(
            "MOELINK_ETHERNET_ADDR",
            format!(
                "{TRANSPORT_ENV}=ethernet with another host in the group: set \
                 MOELINK_ETHERNET_ADDR=host:port (an address the other hosts reach) on every \
                 rank"
            ),
        ));
    }
    Ok(())
}

/// The cross-node transport: the one `MOELINK_TRANSPORT` forces (`ethernet`,
/// or `cuda_ipc` where every other node is on this host), else the one the
/// topology gives every rank of another node (they must agree).
fn transport_of(comm: &comm::Communicator) -> Result<Transport> {
    let topo = comm.topology();
    match CrossNode::from_env()? {
        CrossNode::Ethernet => return Ok(Transport::Ethernet),
        CrossNode::CudaIpc if other_host(topo) => {
            return Err(CommError::invalid(
                TRANSPORT_ENV,
                "cuda_ipc reaches the emulated nodes of one host only, and another host is \
                 in the group",
            ))
        }
        CrossNode::CudaIpc => return Ok(Transport::CudaIpc),
        CrossNode::Auto | CrossNode::Ib => {}
    }
    let mut found: Option<Transport> = None;
    for p in topo.peers() {
        if p.node == topo.node() {
            continue;
        }
        let Reach::Port(t) = p.reach else {
            return Err(CommError::invalid(
                "topology",
                "a rank of another node is mapped, not reached through the proxy",
            ));
        };
        match found {
            Some(f) if f != t => {
                return Err(CommError::invalid(
                    "topology",
                    format!("the other nodes are reached by {f:?} and {t:?}: one transport only"),
                ))
            }
            _ => found = Some(t),
        }
    }
    found.ok_or_else(|| CommError::invalid("topology", "the group has one node"))
}

impl InternodeBuffer {
    /// *Collective.* Builds the internode part over `part`'s region (joined
    /// as the intranode part; the group spans more than one node, of equal
    /// consecutive ranks): memory channels to this node's ranks, port
    /// channels to every rank over the cross-node transport, the proxy threads.
    pub(crate) fn new(
        mut part: PartBase,
        region: SymmetricRegion,
        opts: &EpBufferOptions,
    ) -> Result<Self> {
        let comm = part.comm().clone();
        let topo = comm.topology().clone();
        let ranks_per_node = topo.uniform_ranks_per_node().ok_or_else(|| {
            CommError::invalid(
                "group",
                "its nodes must hold the same number of consecutive ranks",
            )
        })?;
        let num_nodes = topo.num_nodes();
        if num_nodes > MAX_NODES {
            return Err(CommError::invalid(
                "group",
                format!("{num_nodes} nodes; the internode kernels handle at most {MAX_NODES}"),
            ));
        }
        if region.len() > u64::from(u32::MAX) {
            return Err(CommError::invalid(
                "num_rdma_bytes",
                "num_nvl_bytes + num_rdma_bytes above 4 GiB: the proxy addresses at most 4 GiB",
            ));
        }
        let transport = transport_of(&comm)?;
        if transport == Transport::Ethernet {
            check_ethernet_receiver(&comm)?;
        }
        let device = part.device();
        let rank = comm.rank();
        let my_node = topo.node();
        let error = part.member().device_error();
        // Memory channels: this node's ranks only (the others are not used,
        // and over real hosts not mapped).
        let channels = region.memory_channels(&comm, None)?;
        let handles = channels
            .iter()
            .enumerate()
            .map(|(p, c)| match c {
                Some(c) if topo.peer(p).node == my_node => c.device_handle(error).map(Some),
                _ => Ok(None),
            })
            .collect::<Result<Vec<_>>>()?;
        let channel_table = device_table(device, &handles)?;
        let threads = ProxyPool::threads_from_env()?;
        let mut pool = ProxyPool::new(
            rank,
            Some(device),
            threads,
            FIFO_SLOTS,
            (rank as u64) << 8,
            Placement::ByPeer,
        )?;
        let ports = comm.port_channels_pooled(&pool, region.local(), transport)?;
        let port_handles: Vec<_> = ports
            .iter()
            .enumerate()
            .map(|(p, c)| {
                c.as_ref()
                    .filter(|_| topo.peer(p).node != my_node)
                    .map(|c| c.device_handle(error))
            })
            .collect();
        let ports_table = device_table(device, &port_handles)?;
        pool.start()?;
        let scratch = DeviceMemory::alloc(device, SCRATCH_BYTES)?;
        scratch.fill(0)?;
        let host = HostMemory::pinned(device, HOST_BYTES)?;
        part.ready()?;
        tracing::debug!(
            rank,
            num_nodes,
            ranks_per_node,
            ?transport,
            threads,
            chunk = CHUNK,
            "internode buffer"
        );
        Ok(Self {
            pool,
            _ports: ports,
            ports_table,
            part,
            region,
            _channels: channels,
            channel_table,
            scratch,
            side: OwnedStream::new(device)?,
            after_notify: StreamOrder::new(device)?,
            after_recv: StreamOrder::new(device)?,
            pending: None,
            host,
            host_epoch: 0,
            combine_dirty: false,
            timeout: opts.timeout,
            ranks_per_node,
            num_nodes,
            transport,
        })
    }

    pub fn num_nodes(&self) -> usize {
        self.num_nodes
    }

    pub fn ranks_per_node(&self) -> usize {
        self.ranks_per_node
    }

    /// The transport of the port channels (to the other nodes).
    pub fn transport(&self) -> Transport {
        self.transport
    }

    /// Proxy threads of this buffer.
    pub fn proxy_threads(&self) -> usize {
        self.pool.threads()
    }

    /// How far the proxy got: triggers performed by all its threads, and per
    /// rank of another node (None for this node's ranks) its channel's
    /// triggers performed, whether its copies are still in flight, how long
    /// since its last trigger and its longest flight. When a wait for a chunk
    /// times out this tells a trigger the proxy never got (its `handled` is
    /// short) from a copy that stayed in flight (`busy`, a long flight).
    pub fn proxy_progress(&self) -> (u64, Vec<Option<ChannelProgress>>) {
        let my_node = self.part.rank() / self.ranks_per_node;
        let per_peer = self
            ._ports
            .iter()
            .enumerate()
            .map(|(p, c)| {
                let c = c.as_ref().filter(|_| p / self.ranks_per_node != my_node)?;
                let service = self.pool.service_of_fifo(c.fifo.id)?;
                self.pool.channel_state(PooledChannel {
                    service,
                    channel: c.channel,
                })
            })
            .collect();
        (self.pool.processed(), per_peer)
    }

    /// [`proxy_progress`](Self::proxy_progress) as one line for error messages.
    pub fn proxy_report(&self) -> String {
        let (processed, peers) = self.proxy_progress();
        proxy_report(self.part.rank(), processed, &peers)
    }

    /// Blocks of a dispatch's two launches together (or of a combine) besides
    /// the one coordinating block: `num_sms` capped to this rank's share of
    /// its GPU, less that block, so that a call uses `num_sms` SMs in all
    /// and every rank's blocks are resident together with the share's spare
    /// SMs left free. Where ranks share a GPU the proxy's copies between them
    /// run as kernels on that GPU: with every SM held by a spinning block
    /// (measured: 4 ranks x 33 blocks on 132 SMs under MPS) they never start.
    ///
    /// Ranks sharing a GPU (emulated nodes) get at most a quarter of its SMs
    /// between them: measured on one H200 under MPS, 2x2 with 8 SMs per rank
    /// passed dispatch and combine, while with 16 or 32 per rank the proxy's
    /// copies stayed in flight (some chunks never landed within the 5 s
    /// bound) while the ranks' blocks spun.
    fn sms(&self, num_sms: u32) -> u32 {
        let share = self.part.device_share();
        let mut capped = share.cap("internode num_sms", num_sms);
        if share.ranks_on_device > 1 {
            let quarter = share.device_sms / (4 * share.ranks_on_device as u32);
            capped = capped.min(quarter.max(3));
        }
        capped.saturating_sub(1).max(2)
    }

    /// The SMs a dispatch or combine asked for `num_sms` holds: [`Self::sms`]'s
    /// blocks and the coordinating one.
    pub fn launch_sms(&self, num_sms: u32) -> u32 {
        self.sms(num_sms) + 1
    }

    /// The region's split for this group.
    fn split(&self) -> Split {
        Split {
            region_len: self.region.len(),
            ranks: self.part.num_ranks() as u64,
            nodes: self.num_nodes as u64,
            ranks_per_node: self.ranks_per_node as u64,
        }
    }

    fn records(&self, shape: &DispatchShape) -> Result<(RecordLayout, XRecordLayout)> {
        self.split().records(shape)
    }

    fn dispatch_geometry(&self, rec: &RecordLayout, xrec: &XRecordLayout) -> Geometry {
        self.split().dispatch(rec, xrec)
    }

    fn combine_geometry(&self, hidden: usize, num_topk: usize) -> (Geometry, u64) {
        self.split().combine(hidden, num_topk)
    }

    /// Tokens per rank a dispatch of `shape` fits (also `fwd_meta`'s second dimension).
    pub fn dispatch_capacity(&self, shape: &DispatchShape) -> Result<usize> {
        let (rec, xrec) = self.records(shape)?;
        Ok(self.dispatch_geometry(&rec, &xrec).slots)
    }

    /// Tokens per rank a combine of `hidden` bf16 + `num_topk` weights fits.
    pub fn combine_capacity(&self, hidden: usize, num_topk: usize) -> usize {
        self.combine_geometry(hidden, num_topk).0.slots
    }

    fn xctx(&self, c: IntranodeCtx, xslots: usize, meta_slots: usize) -> XCtx {
        XCtx {
            c,
            ports: self.ports_table.ptr(),
            landed: self.scratch.ptr() + LANDED_OFFSET,
            stage_offset: CTRL_BYTES,
            xsend_offset: 0,
            xrecv_offset: 0,
            fwd_offset: 0,
            psend_offset: 0,
            precv_offset: 0,
            xslots: xslots as i64,
            meta_slots: meta_slots as i64,
            ranks_per_node: self.ranks_per_node as i32,
            num_nodes: self.num_nodes as i32,
            chunk: CHUNK as i32,
            pad: 0,
        }
    }

    fn ctx(&self) -> IntranodeCtx {
        IntranodeCtx {
            channels: self.channel_table.ptr(),
            local: self.region.ptr(),
            ticket: self.scratch.ptr(),
            epoch: self.scratch.ptr() + EPOCH_OFFSET,
            dispatch_offset: 0,
            combine_offset: 0,
            dispatch_slots: 0,
            combine_slots: 0,
            timeout_ns: self.part.device_timeout_ns(),
            rank: self.part.rank() as i32,
            num_ranks: self.part.num_ranks() as i32,
        }
    }

    /// The dispatch context for records of `shape` (and the slots).
    fn dispatch_ctx(
        &self,
        shape: &DispatchShape,
        meta_slots: usize,
    ) -> Result<(XCtx, XRecordLayout)> {
        let (rec, xrec) = self.records(shape)?;
        let g = self.dispatch_geometry(&rec, &xrec);
        if shape.num_tokens > g.slots {
            return Err(self.part.too_many_tokens(
                "x",
                shape.num_tokens,
                &self.region,
                format_args!(
                    "{} tokens per rank for rows of {} bytes across {} nodes; size it with \
                     Config.get_nvl_buffer_size_hint + get_rdma_buffer_size_hint",
                    g.slots, shape.hidden_bytes, self.num_nodes
                ),
            ));
        }
        let c = IntranodeCtx {
            dispatch_offset: g.first,
            dispatch_slots: g.slots as i64,
            ..self.ctx()
        };
        let mut xc = self.xctx(c, g.slots, meta_slots);
        xc.xsend_offset = g.second;
        xc.xrecv_offset = g.third;
        Ok((xc, xrec))
    }

    /// The SMs of a dispatch (see `sms`) and its fused grid.
    fn dispatch_grid(&self, num_sms: u32) -> Result<(u32, FusedGrid)> {
        let num_sms = self.sms(num_sms);
        let grid = FusedGrid::new(num_sms, RECV_PERCENT).ok_or_else(|| {
            CommError::invalid("num_sms", "an internode dispatch needs at least 2 SMs")
        })?;
        Ok((num_sms, grid))
    }

    fn experts_per_rank(&self, num_experts: usize) -> Result<usize> {
        experts_per_rank(self.part.num_ranks(), num_experts)
    }

    fn check_meta(&self, xi: &XInputs, num_tokens: usize) -> Result<()> {
        // A rank without tokens has an empty node_head (address 0).
        if (xi.node_head == 0 && num_tokens > 0) || xi.xcounts == 0 || xi.fwd_meta == 0 {
            return Err(CommError::invalid(
                "handle",
                "an internode dispatch needs its node heads, counts and forwarding records",
            ));
        }
        if xi.meta_slots < num_tokens {
            return Err(CommError::invalid(
                "handle",
                format!(
                    "its forwarding records hold {} tokens per node, the dispatch sends {}",
                    xi.meta_slots, num_tokens
                ),
            ));
        }
        Ok(())
    }

    /// Launches notify on `stream` and prepares the send side of a normal
    /// dispatch (launched by [`dispatch_recv`](Self::dispatch_recv));
    /// returns the epoch for [`wait_counts`](Self::wait_counts).
    pub fn dispatch_send(
        &mut self,
        stream: StreamHandle,
        shape: &DispatchShape,
        inp: &DispatchInputs,
        xi: &XInputs,
        expert_alignment: usize,
        num_sms: u32,
    ) -> Result<u64> {
        let epr = self.experts_per_rank(shape.num_experts)?;
        let (xc, xrec) = self.dispatch_ctx(shape, xi.meta_slots)?;
        self.check_meta(xi, shape.num_tokens)?;
        let epoch = self.host_epoch + 1;
        let err = self.part.error_ptr();
        let notify = XNotifyArgs {
            n: notify_args(shape, inp, epr, expert_alignment, &self.host, epoch, err)?,
            node_head: xi.node_head,
            xcounts: xi.xcounts,
            recv_rdma_rank_prefix_sum: xi.recv_rdma_rank_prefix_sum,
        };
        // SAFETY: the caller (the Python layer) checked every tensor.
        unsafe { x::internode_notify(self.part.kernels(), stream, xc, notify) }?;
        self.host_epoch = epoch;
        self.combine_dirty = false;
        self.prepare_send(stream, xc, xrec, shape, inp, xi, epr, num_sms)?;
        Ok(epoch)
    }

    /// Launches the barrier of a cached dispatch (an earlier dispatch's
    /// handle) and prepares its send side (launched by
    /// [`dispatch_recv`](Self::dispatch_recv)).
    pub fn cached_dispatch_send(
        &mut self,
        stream: StreamHandle,
        shape: &DispatchShape,
        inp: &DispatchInputs,
        xi: &XInputs,
        num_sms: u32,
    ) -> Result<()> {
        let (shape, inp) = without_topk(shape, inp);
        let (xc, xrec) = self.dispatch_ctx(&shape, xi.meta_slots)?;
        self.check_meta(xi, shape.num_tokens)?;
        // SAFETY: channels are live.
        unsafe { x::internode_barrier(self.part.kernels(), stream, xc) }?;
        self.combine_dirty = false;
        self.prepare_send(stream, xc, xrec, &shape, &inp, xi, 1, num_sms)
    }

    /// Checks the send side of a dispatch and keeps it for
    /// [`dispatch_recv`](Self::dispatch_recv), which launches it.
    ///
    /// The senders are not launched here, ahead of the caller's allocation of
    /// the outputs: a `cudaMalloc` while a kernel of the process runs holds
    /// back every CUDA operation issued after it until that kernel ends
    /// (measured, the internode stall: the receivers and the proxy's CUDA IPC copies did
    /// not start, so senders waiting for them spun out their time bound). The
    /// outputs are allocated between the two calls; once they are, nothing of
    /// this dispatch is issued behind an allocation.
    #[allow(clippy::too_many_arguments)]
    fn prepare_send(
        &mut self,
        stream: StreamHandle,
        xc: XCtx,
        xrec: XRecordLayout,
        shape: &DispatchShape,
        inp: &DispatchInputs,
        xi: &XInputs,
        experts_per_rank: usize,
        num_sms: u32,
    ) -> Result<()> {
        let (num_sms, grid) = self.dispatch_grid(num_sms)?;
        // The receive side (launched by dispatch_recv) waits for notify only.
        self.after_notify.after(self.side.handle(), stream)?;
        let send = XDispatchArgs {
            send: send_args(xrec.rec_nvl(), shape, inp, experts_per_rank, num_sms),
            xrec,
            node_head: xi.node_head,
            xcounts: xi.xcounts,
            fwd_meta: xi.fwd_meta,
            calls: self.scratch.ptr() + DISPATCH_SEND_CALLS_OFFSET,
            error: self.part.error_ptr(),
            grid: SendGrid::new(grid.send_blocks, self.num_nodes as u32),
        };
        self.pending = Some(PendingRecv { xc, send });
        Ok(())
    }

    /// Waits (bounded, CPU) for the counts of the notify of `epoch`: the
    /// number of received tokens and the per-local-expert counts.
    pub fn wait_counts(&self, epoch: u64, num_experts: usize) -> Result<(usize, Vec<i32>)> {
        let epr = self.experts_per_rank(num_experts)?;
        HostCounts::wait(
            &self.host,
            &self.part,
            epoch,
            epr,
            self.timeout,
            "internode dispatch",
        )
    }

    /// Launches the receive side of a dispatch on the side stream (ordered
    /// after notify), and orders `stream` after it.
    pub fn dispatch_recv(
        &mut self,
        stream: StreamHandle,
        shape: &DispatchShape,
        rank_prefix_matrix: u64,
        out: &DispatchOutputs,
        num_sms: u32,
    ) -> Result<()> {
        let pending = self.pending.take().ok_or_else(|| {
            CommError::invalid(
                "handle",
                "a dispatch's receive half without its send half (dispatch_send first)",
            )
        })?;
        let (num_sms, grid) = self.dispatch_grid(num_sms)?;
        let (xc, xrec) = self.dispatch_ctx(shape, 0)?;
        if xc.xslots != pending.xc.xslots {
            return Err(CommError::invalid(
                "x",
                "the receive half of a dispatch does not match its send half",
            ));
        }
        // SAFETY: the caller checked every tensor (they live until the
        // receive half is ordered back onto `stream`); the peers' regions are
        // free after notify (or the barrier).
        unsafe { x::internode_dispatch(self.part.kernels(), stream, pending.xc, pending.send) }?;
        let recv = RecvArgs {
            rec: xrec.rec_nvl(),
            rank_prefix_matrix,
            out: *out,
            num_sms,
        };
        let state = dispatch_state(self.scratch.ptr(), self.part.error_ptr(), 0);
        // SAFETY: the caller checked the outputs, allocated on `stream`, which
        // waits for the side stream before it goes on.
        unsafe {
            x::internode_dispatch_recv(
                self.part.kernels(),
                self.side.handle(),
                xc.c,
                recv,
                state,
                grid,
            )
        }?;
        self.after_recv.after(stream, self.side.handle())
    }

    /// Launches a whole combine on `stream`.
    pub fn combine(
        &mut self,
        stream: StreamHandle,
        a: &CombineArgs,
        xi: &XInputs,
        recv_src_idx: u64,
        num_sms: u32,
    ) -> Result<()> {
        let num_sms = self.sms(num_sms);
        let (g, _) = self.combine_geometry(a.hidden, a.num_topk);
        if a.num_tokens > g.slots {
            return Err(self.part.too_many_tokens(
                "handle",
                a.num_tokens,
                &self.region,
                format_args!(
                    "{} combined tokens per rank for hidden {} across {} nodes",
                    g.slots, a.hidden, self.num_nodes
                ),
            ));
        }
        if (xi.node_head == 0 && a.num_tokens > 0)
            || xi.xcounts == 0
            || xi.fwd_meta == 0
            || (recv_src_idx == 0 && a.num_recv_rows > 0)
        {
            return Err(CommError::invalid(
                "handle",
                "an internode combine needs the dispatch's source indices, node heads, counts \
                 and forwarding records",
            ));
        }
        let c = IntranodeCtx {
            combine_offset: g.first,
            combine_slots: g.slots as i64,
            ..self.ctx()
        };
        let crec = k::combine_record_bytes(a.hidden, a.num_topk) as u64;
        let mut xc = self.xctx(c, g.slots, xi.meta_slots);
        xc.fwd_offset = g.second;
        xc.psend_offset = g.third;
        xc.precv_offset = g.third + self.num_nodes as u64 * g.slots as u64 * crec;
        if self.combine_dirty {
            // SAFETY: channels are live.
            unsafe { x::internode_barrier(self.part.kernels(), stream, xc) }?;
        }
        let args = XCombineArgs {
            send: a.send_args(num_sms),
            recv: a.recv_args(num_sms),
            recv_src_idx,
            node_head: xi.node_head,
            xcounts: xi.xcounts,
            fwd_meta: xi.fwd_meta,
            calls: self.scratch.ptr() + COMBINE_CALLS_OFFSET,
            error: self.part.error_ptr(),
            grid: CombineGrid::new(num_sms, RECV_PERCENT, self.num_nodes as u32),
        };
        // SAFETY: the caller checked every tensor.
        unsafe { x::internode_combine(self.part.kernels(), stream, xc, args) }?;
        self.combine_dirty = true;
        Ok(())
    }

    /// Launches the layout kernel (`get_dispatch_layout`), with the tokens
    /// per node (`num_tokens_per_rdma_rank`).
    pub fn layout(&self, stream: StreamHandle, c: &LayoutCall, per_node: u64) -> Result<()> {
        let ticket = self.scratch.ptr();
        crate::intranode::launch_layout(
            &self.part,
            stream,
            c,
            ticket,
            per_node,
            self.ranks_per_node,
        )
    }
}

/// One line of a proxy's progress: `rank`'s proxy performed `processed`
/// triggers; per peer with a channel (index = rank) its state.
fn proxy_report(rank: usize, processed: u64, peers: &[Option<ChannelProgress>]) -> String {
    let per_peer: Vec<String> = peers
        .iter()
        .enumerate()
        .filter_map(|(p, s)| {
            let s = s.as_ref()?;
            Some(format!(
                "rank {p}: {} triggers, in flight {}, idle {} ms, longest flight {} ms",
                s.handled,
                s.busy.map_or("unknown".into(), |b| b.to_string()),
                s.idle_ms.map_or("-".into(), |v| v.to_string()),
                s.max_flight_ms
            ))
        })
        .collect();
    // Copies still queued on the proxy's stream a second after its last trigger:
    // the GPU is not running them (what 2 x 2 on 4 GPUs showed; see
    // docs/design-internode.md, "Status"), not a trigger the proxy never got.
    let held = peers
        .iter()
        .flatten()
        .filter(|s| s.busy == Some(true))
        .filter_map(|s| s.idle_ms)
        .filter(|&ms| ms >= HELD_COPIES_MS)
        .max();
    let hint = held.map_or(String::new(), |ms| {
        format!(
            " (every trigger was performed and copies have stayed queued on the proxy's \
             CUDA stream for {ms} ms since the last one: the GPU did not run them while the \
             kernels waited)"
        )
    });
    format!(
        "proxy of rank {rank}: {processed} triggers performed; {}{hint}",
        per_peer.join("; ")
    )
}

/// Idle time after which copies still in flight count as held (see proxy_report).
const HELD_COPIES_MS: u64 = 1000;

impl BufferPart for InternodeBuffer {
    fn base(&self) -> &PartBase {
        &self.part
    }

    /// A device wait that ran out names the proxy's progress too (see
    /// [`InternodeBuffer::proxy_progress`]).
    fn check_device_timeout(&self) -> Result<()> {
        self.part
            .member()
            .check_device_timeout()
            .map_err(|e| match e {
                CommError::Timeout {
                    rank,
                    what,
                    waited_ms,
                } => CommError::Timeout {
                    rank,
                    what: format!("{what} [{}]", self.proxy_report()),
                    waited_ms,
                },
                other => other,
            })?;
        self.check_transport()
    }

    fn local_buffer(&self) -> (u64, usize) {
        (self.region.ptr(), self.region.len() as usize)
    }

    fn check_transport(&self) -> Result<()> {
        for s in self.pool.services() {
            s.fifo().error().check()?;
            s.check()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calls::{nvl_buffer_size_hint, rdma_buffer_size_hint};

    fn shape(hidden_bytes: usize, num_scales: usize, num_topk: usize) -> DispatchShape {
        DispatchShape {
            num_tokens: 0,
            hidden_bytes,
            num_scales,
            num_topk,
            num_experts: 1,
        }
    }

    /// A region of `num_nvl_bytes + num_rdma_bytes` from the two size hints
    /// for `tokens` tokens per rank fits that many tokens in every dispatch
    /// (bf16 with up to 32 top-k, fp8 with its scales, cached without top-k)
    /// and combine, and the areas of each half stay inside it, in order.
    #[test]
    fn the_size_hints_cover_every_dispatch_and_combine() {
        for (ranks, per_node) in [(2, 1), (4, 2), (6, 3), (8, 2), (8, 4), (32, 8), (16, 1)] {
            for hidden in [128usize, 2048, 7168] {
                for tokens in [1usize, 7, 300, 4096] {
                    let hb = (2 * hidden) as i64;
                    let (r, t, l) = (ranks as i64, tokens as i64, per_node as i64);
                    let bytes = nvl_buffer_size_hint(hb, r, t).unwrap()
                        + rdma_buffer_size_hint(hb, r, t, l).unwrap();
                    let split = Split {
                        region_len: bytes as u64,
                        ranks: ranks as u64,
                        nodes: (ranks / per_node) as u64,
                        ranks_per_node: per_node as u64,
                    };
                    let case = format!("R={ranks} L={per_node} hidden={hidden} T={tokens}");
                    let half_end = CTRL_BYTES + STAGE_BYTES + split.half_bytes();
                    for s in [
                        shape(2 * hidden, 0, 32),
                        shape(2 * hidden, 0, 1),
                        shape(hidden, hidden / 128, 8),
                        shape(hidden, hidden / 128, 0),
                        shape(2 * hidden, 0, 0),
                    ] {
                        let (rec, xrec) = split.records(&s).unwrap();
                        let g = split.dispatch(&rec, &xrec);
                        assert!(
                            g.slots >= tokens,
                            "{case} {s:?}: {} dispatch slots",
                            g.slots
                        );
                        let end = g.third + split.nodes * g.slots as u64 * xrec.rec.bytes as u64;
                        assert!(g.first <= g.second && g.second <= g.third && end <= half_end);
                    }
                    for k in [0, 8, 32] {
                        let (g, end) = split.combine(hidden, k);
                        assert!(g.slots >= tokens, "{case} K={k}: {} combine slots", g.slots);
                        assert!(half_end <= g.first && g.second <= g.third);
                        assert!(
                            end <= bytes as u64,
                            "{case} K={k}: ends at {end} of {bytes}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_proxy_report_names_every_peer_channel() {
        let state = |handled, busy| {
            Some(ChannelProgress {
                handled,
                busy,
                idle_ms: Some(12),
                max_flight_ms: 3,
            })
        };
        let line = proxy_report(1, 40, &[None, None, state(17, Some(true)), state(9, None)]);
        assert_eq!(
            line,
            "proxy of rank 1: 40 triggers performed; rank 2: 17 triggers, in flight true, \
             idle 12 ms, longest flight 3 ms; rank 3: 9 triggers, in flight unknown, idle 12 \
             ms, longest flight 3 ms"
        );
    }

    #[test]
    fn copies_held_past_a_second_are_named() {
        let state = |busy, idle_ms| {
            Some(ChannelProgress {
                handled: 512,
                busy,
                idle_ms: Some(idle_ms),
                max_flight_ms: 0,
            })
        };
        let held = proxy_report(0, 513, &[None, state(Some(true), 7998)]);
        assert!(held.ends_with("for 7998 ms since the last one: the GPU did not run them while the kernels waited)"), "{held}");
        for quiet in [
            state(Some(false), 7998),
            state(Some(true), 12),
            state(None, 9000),
        ] {
            let line = proxy_report(0, 513, &[None, quiet]);
            assert!(!line.contains("stayed queued"), "{line}");
        }
    }

    /// A region smaller than control and staging holds no token (no underflow).
    #[test]
    fn a_tiny_region_has_no_slots() {
        let split = Split {
            region_len: 4096,
            ranks: 4,
            nodes: 2,
            ranks_per_node: 2,
        };
        let (rec, xrec) = split.records(&shape(256, 0, 8)).unwrap();
        assert_eq!(split.dispatch(&rec, &xrec).slots, 0);
        assert_eq!(split.combine(128, 8).0.slots, 0);
    }
}
