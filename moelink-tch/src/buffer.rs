//! [`Buffer`]: `moelink.Buffer` on tch tensors. Its calls run the sequence
//! the Python Buffer runs (`python/moelink/buffer.py`, `low_latency.py`):
//! the checks and output shapes of `ep_core::calls`, outputs allocated
//! through tch, the launches of `ep_core::EpBuffer`, on the same streams.
//!
//! Layout, dispatch (full, cached) and combine within one node run whole
//! through ep-core's engine (`ep_core::engine`, the Python binding's too),
//! with tch's outputs (`crate::engine`): this file only reads the tensors,
//! picks the SMs and builds the results. Where the group spans nodes
//! (hosts, or `MOELINK_RANKS_PER_NODE`'s emulated ones) they go to the
//! internode part (`ep_core::NormalPart`), with this file's own sequence
//! (`begin`, `finish`).
//!
//! Streams: an intranode or internode call (layout, dispatch, combine) runs on the
//! Buffer's communication stream, which first waits for torch's current
//! stream on the Buffer's device (or for its `previous_event`); that stream
//! then waits for the communication stream before the call returns
//! (`async_finish=False`), or the call returns an [`EventOverlap`] recorded
//! on the communication stream (`async_finish=True`, see [`StreamArgs`]). A
//! low-latency call runs on the current stream, or with `async_finish` on
//! the communication stream after it waited for the current one. Outputs
//! are allocated by tch on the current stream (with
//! `allocate_on_comm_stream`, and for an asynchronous low-latency call, on
//! the communication stream, made torch's current stream meanwhile), as the
//! Python API allocates them.

use std::sync::atomic::{AtomicU64, Ordering};

use comm::{OwnedStream, StreamHandle};
use ep_core::calls::{self, LayoutPlan, OutputSpec, SmsCall};
use ep_core::engine::{launch_shape, CallResult, Streams};
use ep_core::internode::XInputs;
use ep_core::intranode::{
    CombineArgs as CoreCombineArgs, DispatchInputs, DispatchOutputs, DispatchShape, LayoutCall,
};
use ep_core::ll_hooks::{Hook, HookBook};
use ep_core::low_latency::{
    size_hint, CallShape, CombineCall, DispatchCall, DispatchOutputs as LlDispatchOutputs, LlCall,
    LowLatencyBuffer, Phases,
};
use ep_core::{EpBuffer, EpBufferOptions, LowLatencyOptions, NormalPart, PartKind};
use tch::{Device, Kind, Tensor};

use crate::args::{
    Bias, DispatchArgs, DispatchX, Handle, InternodeHandle, Layout, LlCombineOptions,
    LlDispatchOptions, LlHandle, RecvX,
};
use crate::checks::{self, Target};
use crate::engine::{arg, CombineArgsOf, DispatchArgsOf, TchOutputs};
use crate::error::{Error, Result};
pub use crate::event::{EventOverlap, StreamArgs};
use crate::group::{timeout_or_env, CudaDevice, Group};
use crate::stream::{current_stream, record_stream, StreamGuard};
use crate::tensor::{output, ptr, required};

/// SMs of a normal-mode (intranode or internode) dispatch or combine where neither the Buffer's options
/// nor the call name them: the Python API's default config for the rank count
/// (`ep_core::calls::default_num_sms`; this front end has no receive pool, so
/// a combine takes the count of `x` sent as records).
pub fn default_num_sms(call: SmsCall, num_ranks: usize) -> u32 {
    calls::default_num_sms(call, num_ranks as i64) as u32
}

/// Seconds of GPU time a device wait may take where nothing sets it (the
/// Python API's `DEFAULT_DEVICE_TIMEOUT_S`).
pub const DEFAULT_DEVICE_TIMEOUT_S: f64 = 30.0;

/// The bound environment variable `env` sets (seconds), else the default, in
/// nanoseconds (`moelink._device_timeout.env_device_timeout_ns`).
pub fn env_device_timeout_ns(env: &str) -> Result<i64> {
    device_timeout_ns_of(env, comm::env::var(env))
}

/// [`env_device_timeout_ns`] of the value `raw` of variable `env` (None: unset).
fn device_timeout_ns_of(env: &str, raw: Option<String>) -> Result<i64> {
    let seconds = match raw {
        None => DEFAULT_DEVICE_TIMEOUT_S,
        Some(raw) => raw
            .trim()
            .parse::<f64>()
            .map_err(|_| Error::value(format!("{env} must be a number of seconds, got {raw:?}")))?,
    };
    let ns = if seconds.is_finite() {
        (seconds * 1e9).round()
    } else {
        0.0
    };
    if !(ns > 0.0 && ns <= i64::MAX as f64) {
        return Err(Error::value(format!(
            "{env} must be a positive, finite number of seconds, got {seconds}"
        )));
    }
    Ok(ns as i64)
}

/// How to make a [`Buffer`]: `moelink.Buffer`'s arguments.
#[derive(Clone, Debug)]
pub struct BufferOptions {
    /// Bytes of NVLink buffer (intranode dispatch/combine; 0: none). Size it
    /// with [`Buffer::nvl_buffer_size_hint`] (Python's
    /// `Config.get_nvl_buffer_size_hint`) for the largest batch.
    pub num_nvl_bytes: usize,
    /// In `low_latency_mode`: bytes of low-latency buffer (> 0 there); size
    /// it with [`Buffer::get_low_latency_rdma_size_hint`]. Wherever there is
    /// an NVLink buffer (`num_nvl_bytes > 0`), also the bytes of the
    /// internode part's cross-node regions, needed where the group spans
    /// nodes and unused within one; size it with
    /// [`Buffer::rdma_buffer_size_hint`] (Python's
    /// `Config.get_rdma_buffer_size_hint`). A Buffer serving both modes
    /// across nodes takes the larger of both hints (each part gets
    /// `num_rdma_bytes` of its own).
    pub num_rdma_bytes: usize,
    pub low_latency_mode: bool,
    pub allow_nvlink_for_low_latency_mode: bool,
    pub enable_shrink: bool,
    /// SMs of normal-mode dispatch/combine (even; the Python `Config.num_sms`),
    /// where a call does not name them; None: [`default_num_sms`] per call.
    pub num_sms: Option<u32>,
    /// Bound of host waits; None: `MOELINK_TIMEOUT_S`, else 60 s.
    pub timeout: Option<std::time::Duration>,
    /// Bound of every intranode device wait (ns of GPU time); None:
    /// `MOELINK_DEVICE_TIMEOUT_S`, else 30 s.
    pub device_timeout_ns: Option<i64>,
    /// Bound of every low-latency receive (ns); None: `MOELINK_LL_TIMEOUT_S`,
    /// else the intranode one.
    pub ll_device_timeout_ns: Option<i64>,
}

impl BufferOptions {
    /// Both parts, each sized by its hint for calls of up to
    /// `max_tokens_per_rank` bf16 tokens of `hidden` among `num_ranks` ranks
    /// and `num_experts` experts ([`Buffer::nvl_buffer_size_hint`]; for
    /// `num_rdma_bytes` the larger of [`Buffer::get_low_latency_rdma_size_hint`]
    /// and [`Buffer::rdma_buffer_size_hint`] for nodes of
    /// [`default_ranks_per_node`] ranks, 0 within one node); the rest as
    /// [`Default`].
    pub fn sized_for(
        max_tokens_per_rank: i64,
        hidden: i64,
        num_ranks: usize,
        num_experts: i64,
    ) -> Result<Self> {
        Self::sized_for_nodes(
            max_tokens_per_rank,
            hidden,
            num_ranks,
            num_experts,
            default_ranks_per_node()?,
        )
    }

    /// [`sized_for`](Self::sized_for) for nodes of `ranks_per_node` ranks.
    fn sized_for_nodes(
        max_tokens_per_rank: i64,
        hidden: i64,
        num_ranks: usize,
        num_experts: i64,
        ranks_per_node: usize,
    ) -> Result<Self> {
        // A negative count is beyond every limit too: the hint refuses it.
        let count = |n: i64| usize::try_from(n).unwrap_or(usize::MAX);
        let hidden_bytes = count(hidden).saturating_mul(2);
        let max_tokens = count(max_tokens_per_rank);
        let ll = Buffer::get_low_latency_rdma_size_hint(
            max_tokens_per_rank,
            hidden,
            num_ranks as i64,
            num_experts,
        )?;
        let internode =
            Buffer::rdma_buffer_size_hint(hidden_bytes, num_ranks, max_tokens, ranks_per_node)?;
        Ok(Self {
            num_nvl_bytes: Buffer::nvl_buffer_size_hint(hidden_bytes, num_ranks, max_tokens)?,
            num_rdma_bytes: ll.max(internode),
            low_latency_mode: true,
            ..Self::default()
        })
    }
}

/// A size hint's argument as ep-core takes it: a value beyond i64 is beyond
/// every limit, so it is refused as i64::MAX.
fn hint_arg(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// The ranks per node that [`Buffer::rdma_buffer_size_hint`] assumes where
/// the caller does not know them, as Python's `Config.get_rdma_buffer_size_hint`:
/// `MOELINK_RANKS_PER_NODE` (emulated nodes), else torchrun's
/// `LOCAL_WORLD_SIZE`, else 8 (DeepEP's NVLink domain). A value of
/// `MOELINK_RANKS_PER_NODE` that is not a positive integer is a `ValueError`.
pub fn default_ranks_per_node() -> Result<usize> {
    ranks_per_node_of(
        comm::env::var("MOELINK_RANKS_PER_NODE"),
        std::env::var("LOCAL_WORLD_SIZE").ok(),
    )
}

/// [`default_ranks_per_node`] of the two variables' values (None: unset).
fn ranks_per_node_of(emulated: Option<String>, local: Option<String>) -> Result<usize> {
    if let Some(raw) = emulated.filter(|v| !v.trim().is_empty()) {
        return match raw.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(Error::value(format!(
                "MOELINK_RANKS_PER_NODE must be a positive integer, got {raw:?}"
            ))),
        };
    }
    let local = local.and_then(|v| v.trim().parse::<usize>().ok());
    Ok(local.unwrap_or(8))
}

impl Default for BufferOptions {
    fn default() -> Self {
        Self {
            num_nvl_bytes: 0,
            num_rdma_bytes: 0,
            low_latency_mode: false,
            allow_nvlink_for_low_latency_mode: true,
            enable_shrink: false,
            num_sms: None,
            timeout: None,
            device_timeout_ns: None,
            ll_device_timeout_ns: None,
        }
    }
}

/// `num_sms` (of a Buffer or a call) as `moelink.Config` checks it
/// (`ep_core::calls::num_sms`).
fn check_num_sms(n: u32) -> Result<u32> {
    Ok(calls::num_sms("num_sms", i64::from(n))? as u32)
}

/// A byte count of the options as the core's checks take it (64 bits).
fn byte_count(name: &str, n: usize) -> Result<i64> {
    i64::try_from(n).map_err(|_| Error::value(format!("{name} must be below 2**63 bytes, got {n}")))
}

/// `moelink.Buffer.__init__`'s checks of its byte counts and modes
/// (`ep_core::calls::buffer_options`), then of `num_sms`.
fn check_options(o: &BufferOptions) -> Result<calls::BufferPlan> {
    let plan = calls::buffer_options(&calls::BufferArgs {
        num_nvl_bytes: byte_count("num_nvl_bytes", o.num_nvl_bytes)?,
        num_rdma_bytes: byte_count("num_rdma_bytes", o.num_rdma_bytes)?,
        low_latency_mode: o.low_latency_mode,
        enable_shrink: o.enable_shrink,
        ..calls::BufferArgs::default()
    })?;
    if let Some(n) = o.num_sms {
        check_num_sms(n)?;
    }
    Ok(plan)
}

/// What [`Buffer::dispatch`] returns: `Buffer.dispatch`'s tuple.
#[derive(Debug)]
pub struct Dispatched {
    pub recv_x: RecvX,
    /// int64 `[rows, K]` (local expert ids, -1 elsewhere), with `topk_idx`.
    pub recv_topk_idx: Option<Tensor>,
    /// f32 `[rows, K]`, with `topk_weights`.
    pub recv_topk_weights: Option<Tensor>,
    /// Per local expert, received tokens rounded up to `expert_alignment`
    /// (empty with `num_worst_tokens`).
    pub num_recv_tokens_per_expert: Vec<i64>,
    pub handle: Handle,
    /// With `async_finish`: the event marking the call's end (else empty).
    pub event: EventOverlap,
}

/// What [`Buffer::low_latency_dispatch`] returns.
#[derive(Debug)]
pub struct LlDispatched {
    /// `[E_local, R*T, H]` (fp8 e4m3 or bf16) and, with fp8, its scales.
    pub recv_x: RecvX,
    /// int32 `[E_local]`: valid rows per local expert.
    pub recv_count: Tensor,
    pub handle: LlHandle,
    /// With `return_recv_hook`: the receive half, to run with
    /// [`Buffer::run_recv_hook`] before the outputs are read.
    pub hook: Option<RecvHook>,
    /// With `async_finish`: the event marking the call's end (else empty).
    pub event: EventOverlap,
}

/// The receive half of a low-latency call made with `return_recv_hook`: run
/// it with [`Buffer::run_recv_hook`] of the Buffer that made it, once. The
/// rules are Python's (`ep_core::ll_hooks`): while one hook is pending, the
/// next call may send with a hook of its own (two calls in flight), and hooks
/// run in call order. It keeps the call's tensors alive.
pub struct RecvHook {
    /// The Buffer that made it ([`Buffer`]'s `ll_owner`).
    owner: u64,
    hook: Hook,
    call: LlCall,
    _keep: Vec<Tensor>,
}

impl RecvHook {
    /// "low-latency dispatch call #N" (or combine), as errors name it.
    pub fn name(&self) -> &str {
        &self.hook.name
    }
}

impl std::fmt::Debug for RecvHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecvHook")
            .field("name", &self.hook.name)
            .finish()
    }
}

/// `phases` of `call` as ep-core runs an API launch
/// (`LowLatencyBuffer::call`): refused, nothing launched, once a device wait
/// ran out; else launched, returning what the kernels recorded, for the
/// caller to raise after its bookkeeping.
fn run_ll(
    ll: &LowLatencyBuffer,
    stream: StreamHandle,
    call: &LlCall,
    phases: Phases,
) -> Result<Option<Error>> {
    Ok(ll.call(stream, call, phases)?.map(Error::from))
}

/// Distinguishes the Buffers of this process, so that a hook runs only on
/// the Buffer that made it.
static NEXT_OWNER: AtomicU64 = AtomicU64::new(1);

/// DeepEP's Buffer (normal mode within a node or across nodes, and
/// low-latency mode) on tch tensors, made on a [`Group`]: every rank makes
/// the same Buffers and calls in the same order.
pub struct Buffer {
    // Dropped after Drop::drop synchronised the device.
    inner: EpBuffer,
    cuda: CudaDevice,
    num_ranks: i64,
    rank: usize,
    num_sms: Option<u32>,
    /// What the last dispatch and combine took ([`Buffer::num_sms_used`]).
    sms_used: std::cell::Cell<(Option<u32>, Option<u32>)>,
    comm_stream: OwnedStream,
    order: comm::cuda::StreamOrder,
    /// The low-latency calls' pending receive hooks and call count.
    ll_hooks: HookBook,
    /// This Buffer among the process's ([`RecvHook`]'s `owner`).
    ll_owner: u64,
    enable_shrink: bool,
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Buffer")
            .field("rank", &self.rank)
            .field("num_ranks", &self.num_ranks)
            .field("device", &self.cuda.device)
            .field("parts", &self.inner)
            .finish()
    }
}

impl Buffer {
    /// *Collective.* A Buffer on CUDA device `device` among `group`'s ranks
    /// (the group's next objects: the normal-mode part where `num_nvl_bytes >
    /// 0`, then the low-latency part in `low_latency_mode`). The normal-mode
    /// part is the internode one where the group spans nodes (with
    /// `num_rdma_bytes` of cross-node regions, which must then be positive),
    /// else the intranode one, as in Python. Binds `device`'s primary
    /// context to this thread (torch's).
    pub fn new(group: &Group, device: Device, opts: &BufferOptions) -> Result<Self> {
        let parts = check_options(opts)?;
        let device_timeout_ns = match opts.device_timeout_ns {
            Some(ns) => ns,
            None => env_device_timeout_ns("MOELINK_DEVICE_TIMEOUT_S")?,
        };
        let ll_device_timeout_ns = match opts.ll_device_timeout_ns {
            Some(ns) => ns,
            None if opts.low_latency_mode && comm::env::is_set("MOELINK_LL_TIMEOUT_S") => {
                env_device_timeout_ns("MOELINK_LL_TIMEOUT_S")?
            }
            None => device_timeout_ns,
        };
        let timeout = timeout_or_env(opts.timeout)?;
        let cuda = CudaDevice::bind(device, "moelink.Buffer")?;
        let eopts = EpBufferOptions {
            num_nvl_bytes: parts.num_nvl_bytes as usize,
            num_internode_bytes: parts.num_internode_bytes as usize,
            num_ll_bytes: parts.num_ll_bytes as usize,
            timeout,
            device_timeout_ns,
            low_latency: LowLatencyOptions {
                allow_nvlink: opts.allow_nvlink_for_low_latency_mode,
                shrink: opts.enable_shrink,
                device_timeout_ns: ll_device_timeout_ns,
            },
        };
        let comm_stream = OwnedStream::new(cuda.core)?;
        let order = comm::cuda::StreamOrder::new(cuda.core)?;
        let inner = EpBuffer::new(group.core(), cuda.core, &eopts)?;
        Ok(Self {
            inner,
            cuda,
            num_ranks: group.size() as i64,
            rank: group.rank(),
            num_sms: opts.num_sms,
            sms_used: Default::default(),
            comm_stream,
            order,
            ll_hooks: HookBook::new(),
            ll_owner: NEXT_OWNER.fetch_add(1, Ordering::Relaxed),
            enable_shrink: opts.enable_shrink,
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn num_ranks(&self) -> usize {
        self.num_ranks as usize
    }

    pub fn device(&self) -> Device {
        self.cuda.device
    }

    /// What this Buffer's calls are checked against ([`checks`]).
    pub fn target(&self) -> Target {
        Target {
            num_ranks: self.num_ranks,
            device: self.cuda.device,
        }
    }

    /// The communication stream normal-mode calls run on.
    pub fn comm_stream(&self) -> StreamHandle {
        self.comm_stream.handle()
    }

    /// `(nodes, ranks per node)` where the group spans nodes (hosts, or
    /// `MOELINK_RANKS_PER_NODE`'s emulated ones): layout, dispatch and
    /// combine then take the internode path and a dispatch's handle has its
    /// [`InternodeHandle`]. None within one node or without an NVLink
    /// buffer. Python's `Buffer.nodes`.
    pub fn nodes(&self) -> Option<(usize, usize)> {
        self.inner
            .internode()
            .map(|b| (b.num_nodes(), b.ranks_per_node()))
    }

    /// Bytes of low-latency buffer each rank needs for calls up to this
    /// shape (`Buffer.get_low_latency_rdma_size_hint`).
    pub fn get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: i64,
        hidden: i64,
        num_ranks: i64,
        num_experts: i64,
    ) -> Result<usize> {
        let g = calls::ll_geometry(
            num_ranks,
            "num_ranks",
            num_max_dispatch_tokens_per_rank,
            hidden,
            num_experts,
        )?;
        Ok(size_hint(
            g.max_tokens as usize,
            g.hidden as usize,
            num_ranks as usize,
            g.num_experts as usize,
        )?)
    }

    /// Bytes of NVLink buffer (`num_nvl_bytes`) for intranode dispatch and
    /// combine of rows of `hidden_bytes` among `num_ranks` ranks, each sending
    /// at most `max_tokens_per_rank` tokens: Python's
    /// `Config.get_nvl_buffer_size_hint`, both `ep_core::calls::nvl_buffer_size_hint`
    /// (64 KiB of counters, then two regions of a slot per possible token,
    /// each slot the larger of a worst-case dispatch record and a combine
    /// record).
    pub fn nvl_buffer_size_hint(
        hidden_bytes: usize,
        num_ranks: usize,
        max_tokens_per_rank: usize,
    ) -> Result<usize> {
        let bytes = calls::nvl_buffer_size_hint(
            hint_arg(hidden_bytes),
            hint_arg(num_ranks),
            hint_arg(max_tokens_per_rank),
        )?;
        Ok(bytes as usize)
    }

    /// Bytes of `num_rdma_bytes` for internode dispatch and combine: what
    /// the internode part adds to [`nvl_buffer_size_hint`](Self::nvl_buffer_size_hint)'s
    /// bytes (the same `hidden_bytes`, `num_ranks` and `max_tokens_per_rank`)
    /// when the ranks span nodes of `ranks_per_node` ranks; 0 within one
    /// node. Python's `Config.get_rdma_buffer_size_hint`, both
    /// `ep_core::calls::rdma_buffer_size_hint`; [`default_ranks_per_node`]
    /// gives Python's default for `ranks_per_node`.
    pub fn rdma_buffer_size_hint(
        hidden_bytes: usize,
        num_ranks: usize,
        max_tokens_per_rank: usize,
        ranks_per_node: usize,
    ) -> Result<usize> {
        let bytes = calls::rdma_buffer_size_hint(
            hint_arg(hidden_bytes),
            hint_arg(num_ranks),
            hint_arg(max_tokens_per_rank),
            hint_arg(ranks_per_node),
        )?;
        Ok(bytes as usize)
    }

    /// Whether the kernels were compiled for sm_90 (`Buffer.is_sm90_compiled`).
    pub fn is_sm90_compiled() -> bool {
        ep_core::compiled_archs()
            .iter()
            .any(|a| a.starts_with("90"))
    }

    // ----- state ------------------------------------------------------------

    fn absent(&self, kind: PartKind) -> Error {
        if self.inner.is_empty() {
            Error::state("the Buffer was destroyed")
        } else {
            match kind {
                PartKind::Intranode => Error::state(
                    "this Buffer has no NVLink buffer (destroyed, or created with \
                     num_nvl_bytes=0)",
                ),
                PartKind::LowLatency => Error::state(
                    "this Buffer has no low-latency buffer (destroyed, or created without \
                     low_latency_mode=True and num_rdma_bytes > 0)",
                ),
            }
        }
    }

    /// Raises a device wait of an earlier normal-mode call that timed out
    /// (it leaves the ranks out of step), or the part's absence.
    fn check_normal(&self) -> Result<()> {
        let part = self
            .inner
            .part(PartKind::Intranode)
            .ok_or_else(|| self.absent(PartKind::Intranode))?;
        Ok(part.check_device_timeout()?)
    }

    /// The part serving layout, dispatch and combine (`EpBuffer::normal`:
    /// internode where the group spans nodes, else intranode), without the
    /// device check (made at the call's start).
    fn normal(&mut self) -> Result<NormalPart<'_>> {
        if self.inner.part(PartKind::Intranode).is_none() {
            return Err(self.absent(PartKind::Intranode));
        }
        Ok(self.inner.normal().expect("checked above"))
    }

    fn ll(&self) -> Result<&LowLatencyBuffer> {
        self.inner
            .low_latency()
            .ok_or_else(|| self.absent(PartKind::LowLatency))
    }

    /// Raises what a kernel of this Buffer recorded, if anything (an expert
    /// id out of range, a device wait that timed out), every part.
    pub fn check(&self) -> Result<()> {
        for p in self.inner.parts() {
            p.check_device()?;
        }
        Ok(())
    }

    /// torch's current stream on this Buffer's device.
    fn compute_stream(&self) -> Result<StreamHandle> {
        current_stream(self.cuda.index)
    }

    /// An event recorded now on torch's current stream of `device`
    /// (`Buffer.capture()`): a call's `previous_event`.
    pub fn capture(device: Device) -> Result<EventOverlap> {
        EventOverlap::capture(device)
    }

    /// Whether this call checks expert ids on the host
    /// ([`checks::set_check_ids`], never under CUDA-graph capture).
    fn check_ids_now(&self) -> Result<bool> {
        Ok(checks::check_ids() && !self.compute_stream()?.is_capturing()?)
    }

    /// The outputs `alloc` makes, made (with `on_comm`) while torch's current
    /// stream is the communication stream: tch allocates there.
    fn allocate<T>(&self, on_comm: bool, alloc: impl FnOnce() -> Result<T>) -> Result<T> {
        let _guard = on_comm
            .then(|| StreamGuard::new(self.comm_stream.handle(), self.cuda.index))
            .transpose()?;
        alloc()
    }

    /// Python's `_prologue`: the stream arguments checked, torch's current
    /// (compute) stream.
    fn prologue(&self, s: &StreamArgs<'_>) -> Result<StreamHandle> {
        checks::stream_args(s)?;
        self.compute_stream()
    }

    /// The start of an intranode call whose outputs are made before its
    /// launches: [`prologue`](Self::prologue), the outputs `alloc` makes
    /// (on the communication stream with `allocate_on_comm_stream`), then
    /// [`enter_comm`](Self::enter_comm). Returns the compute stream, the
    /// outputs and the communication stream.
    fn begin<T>(
        &self,
        s: &StreamArgs<'_>,
        alloc: impl FnOnce() -> Result<T>,
    ) -> Result<(StreamHandle, T, StreamHandle)> {
        let compute = self.prologue(s)?;
        let outputs = self.allocate(s.allocate_on_comm_stream, alloc)?;
        let comm = self.enter_comm(compute, s.previous_event)?;
        Ok((compute, outputs, comm))
    }

    /// The communication stream, after it waited for `previous_event` where
    /// that holds an event, else for `compute` (Python's `_enter_comm`).
    fn enter_comm(
        &self,
        compute: StreamHandle,
        previous_event: Option<&EventOverlap>,
    ) -> Result<StreamHandle> {
        let comm = self.comm_stream.handle();
        match previous_event.and_then(EventOverlap::event) {
            Some(e) => e.wait(comm)?,
            None => self.order.after(comm, compute)?,
        }
        Ok(comm)
    }

    /// The end of an intranode call (Python's `_epilogue`): outputs made on
    /// the communication stream are marked used on `compute`; then either
    /// (`async_finish`) every tensor of the call is marked used on the
    /// communication stream and kept by an event recorded there, or
    /// `compute` waits for the communication stream. Last, a kernel's
    /// recorded error (an expert id out of range) is raised, after the
    /// launches (the ranks stay in step).
    fn finish(
        &self,
        compute: StreamHandle,
        s: &StreamArgs<'_>,
        inputs: &[Option<&Tensor>],
        outputs: &[Option<&Tensor>],
    ) -> Result<EventOverlap> {
        let comm = self.comm_stream.handle();
        if s.allocate_on_comm_stream {
            for t in outputs.iter().flatten() {
                record_stream(t, compute, self.cuda.index)?;
            }
        }
        let event = if s.async_finish {
            let tensors = inputs.iter().chain(outputs).flatten().copied();
            EventOverlap::keeping(self.cuda.core, comm, self.cuda.index, tensors)?
        } else {
            self.order.after(compute, comm)?;
            EventOverlap::none()
        };
        if let Some(b) = self.inner.part(PartKind::Intranode) {
            b.check_device()?;
        }
        Ok(event)
    }

    /// `call` through ep-core's engine on the intranode part, with this
    /// Buffer's streams, the stream arguments `s`, `num_sms` SMs and tch's
    /// outputs: its value and event, or its error as this crate's. With
    /// `async_finish` the event keeps `inputs` (the call's tensors) and the
    /// outputs.
    fn run_engine<T>(
        &mut self,
        s: &StreamArgs<'_>,
        num_sms: u32,
        inputs: &[Option<&Tensor>],
        call: impl FnOnce(&mut EpBuffer, &Streams<'_>, &mut TchOutputs) -> CallResult<T>,
    ) -> Result<(T, EventOverlap)> {
        let streams = Streams {
            num_ranks: self.num_ranks,
            device: self.cuda.index,
            num_sms,
            compute: self.compute_stream()?,
            comm: self.comm_stream.handle(),
            order: &self.order,
            args: s.engine(),
        };
        let mut out = TchOutputs::new(self.cuda, s.async_finish, inputs);
        let r = call(&mut self.inner, &streams, &mut out);
        out.result(r)
    }

    /// The host-side expert-id check of `topk_idx` where it is on
    /// ([`checks::set_check_ids`], never under capture), once `plan` (the
    /// call's argument checks, which come first) gave the expert count.
    fn check_ids(
        &self,
        topk_idx: Option<&Tensor>,
        plan: impl FnOnce() -> Result<i64>,
    ) -> Result<()> {
        match topk_idx {
            Some(idx) if self.check_ids_now()? => checks::topk_values(idx, plan()?),
            _ => Ok(()),
        }
    }

    /// A call's SMs (recorded for [`Buffer::num_sms_used`]): the call's, else
    /// the Buffer's option, else the default for `call` and the rank count.
    fn call_sms(&mut self, num_sms: Option<u32>, call: SmsCall) -> Result<u32> {
        let n = match num_sms {
            Some(n) => check_num_sms(n)?,
            None => self
                .num_sms
                .unwrap_or_else(|| default_num_sms(call, self.num_ranks as usize)),
        };
        // What the kernels launch with: capped to this rank's share of its
        // GPU (internode: with its coordinating block).
        let launched = self.inner.normal().map_or(n, |b| b.launch_sms(n));
        let (d, c) = self.sms_used.get();
        self.sms_used.set(match call {
            SmsCall::Dispatch => (Some(launched), c),
            _ => (d, Some(launched)),
        });
        Ok(n)
    }

    /// The SMs the last intranode or internode dispatch and combine of this Buffer
    /// launched with (None before the first): the call's `num_sms`, the
    /// Buffer's option, or [`default_num_sms`], capped to this rank's share of
    /// its GPU where ranks share one. The Python `Buffer.num_sms_used`.
    pub fn num_sms_used(&self) -> (Option<u32>, Option<u32>) {
        self.sms_used.get()
    }

    // ----- layout -------------------------------------------------------------

    /// `get_dispatch_layout(topk_idx, num_experts)`: per-rank and per-expert
    /// token counts and `is_token_in_rank` of int64 `topk_idx` `[N, K]` (and
    /// the per-node counts where the group spans nodes).
    pub fn get_dispatch_layout(&mut self, topk_idx: &Tensor, num_experts: i64) -> Result<Layout> {
        Ok(self
            .get_dispatch_layout_with(topk_idx, num_experts, &StreamArgs::default())?
            .0)
    }

    /// [`get_dispatch_layout`](Self::get_dispatch_layout) with
    /// `previous_event`, `async_finish` and `allocate_on_comm_stream`;
    /// returns the layout and the call's event.
    pub fn get_dispatch_layout_with(
        &mut self,
        topk_idx: &Tensor,
        num_experts: i64,
        s: &StreamArgs<'_>,
    ) -> Result<(Layout, EventOverlap)> {
        self.check_normal()?;
        if self.nodes().is_some() {
            let p = checks::layout(&self.target(), topk_idx, num_experts)?;
            return self.x_layout(topk_idx, &p, s);
        }
        self.check_ids(Some(topk_idx), || {
            Ok(checks::layout(&self.target(), topk_idx, num_experts)?.num_experts)
        })?;
        let idx = arg(topk_idx);
        let ((per_rank, per_expert, in_rank), event) =
            self.run_engine(s, 0, &[Some(topk_idx)], |b, streams, out| {
                b.layout_call(streams, &idx, num_experts, out)
            })?;
        let layout = Layout {
            num_tokens_per_rank: per_rank,
            num_tokens_per_expert: per_expert,
            is_token_in_rank: in_rank,
            num_tokens_per_rdma_rank: None,
        };
        Ok((layout, event))
    }

    /// [`get_dispatch_layout_with`](Self::get_dispatch_layout_with) of
    /// `topk_idx`, checked (`p`), where the group spans nodes (the internode
    /// part; also the per-node counts).
    fn x_layout(
        &mut self,
        topk_idx: &Tensor,
        p: &LayoutPlan,
        s: &StreamArgs<'_>,
    ) -> Result<(Layout, EventOverlap)> {
        let device = self.cuda.device;
        let nodes = self.nodes();
        self.check_ids(Some(topk_idx), || Ok(p.num_experts))?;
        let (compute, (per_rank, per_expert, in_rank, scratch, per_node), comm) =
            self.begin(s, || {
                let per_node = nodes
                    .map(|(n, _)| Tensor::f_empty([n as i64], (Kind::Int, device)))
                    .transpose()?;
                Ok((
                    required(&p.outputs, "num_tokens_per_rank", device)?,
                    required(&p.outputs, "num_tokens_per_expert", device)?,
                    required(&p.outputs, "is_token_in_rank", device)?,
                    required(&p.outputs, "layout_scratch", device)?,
                    per_node,
                ))
            })?;
        let call = LayoutCall {
            topk_idx: ptr(Some(topk_idx)),
            num_tokens: p.num_tokens as usize,
            num_topk: p.num_topk as usize,
            num_experts: p.num_experts as usize,
            num_tokens_per_rank: ptr(Some(&per_rank)),
            num_tokens_per_expert: ptr(Some(&per_expert)),
            is_token_in_rank: ptr(Some(&in_rank)),
            partials: ptr(Some(&scratch)),
        };
        self.normal()?.layout(comm, &call, ptr(per_node.as_ref()))?;
        let event = self.finish(
            compute,
            s,
            &[Some(topk_idx), Some(&scratch)],
            &[
                Some(&per_rank),
                Some(&per_expert),
                Some(&in_rank),
                per_node.as_ref(),
            ],
        )?;
        // Freed on the compute stream, which waited for the kernel (or, with
        // async_finish, marked used on the communication stream).
        drop(scratch);
        Ok((
            Layout {
                num_tokens_per_rank: per_rank,
                num_tokens_per_expert: per_expert,
                is_token_in_rank: in_rank,
                num_tokens_per_rdma_rank: per_node,
            },
            event,
        ))
    }

    // ----- dispatch -------------------------------------------------------------

    /// `(nodes, tokens per rank the buffer fits)` of an internode dispatch
    /// of `shape`'s records (the forwarding records' second dimension);
    /// None within one node.
    fn internode_capacity(&self, shape: &DispatchShape) -> Result<Option<((usize, usize), usize)>> {
        let Some(b) = self.inner.internode() else {
            return Ok(None);
        };
        let records = DispatchShape {
            num_tokens: 0,
            num_experts: 1,
            ..*shape
        };
        let capacity = b.dispatch_capacity(&records)?;
        Ok(Some(((b.num_nodes(), b.ranks_per_node()), capacity)))
    }

    /// `dispatch(x, ...)` without a handle: sends each token to every rank
    /// hosting one of its experts.
    pub fn dispatch(&mut self, x: DispatchX<'_>, a: &DispatchArgs<'_>) -> Result<Dispatched> {
        self.check_normal()?;
        let num_sms = self.call_sms(a.num_sms, SmsCall::Dispatch)?;
        if self.nodes().is_some() {
            return self.x_dispatch(x, a, num_sms);
        }
        // With num_worst_tokens a dispatch never waits for the host.
        let idx = a.topk_idx.filter(|_| a.num_worst_tokens == 0);
        self.check_ids(idx, || {
            Ok(checks::dispatch(&self.target(), x, a)?.num_experts)
        })?;
        let args = DispatchArgsOf::new(x, None, Some(a));
        let t = args.tensors();
        let inputs = dispatch_inputs(x, a);
        let (d, event) = self.run_engine(&a.stream, num_sms, &inputs, |b, streams, out| {
            b.dispatch_call(streams, &t, out)
        })?;
        // The checks made the engine refuse a dispatch without it.
        let in_rank = a
            .is_token_in_rank
            .map(Tensor::shallow_clone)
            .ok_or_else(|| Error::state("dispatch's plan requires is_token_in_rank"))?;
        Ok(dispatched(d, in_rank, event))
    }

    /// [`dispatch`](Self::dispatch) where the group spans nodes (the
    /// internode part; the handle gets its [`InternodeHandle`]), with
    /// `num_sms` SMs.
    fn x_dispatch(
        &mut self,
        x: DispatchX<'_>,
        a: &DispatchArgs<'_>,
        num_sms: u32,
    ) -> Result<Dispatched> {
        let (device, rank) = (self.cuda.device, self.rank);
        let p = checks::dispatch(&self.target(), x, a)?;
        let idx = a.topk_idx.filter(|_| p.num_worst_tokens == 0);
        self.check_ids(idx, || Ok(p.num_experts))?;
        let s = &a.stream;
        let (data, scales) = x.parts();
        let shape = launch_shape(&p, self.num_ranks);
        let xnode = self.internode_capacity(&shape)?;
        let worst = p.num_worst_tokens > 0;
        // Every output is allocated while no kernel of the dispatch runs, as
        // in Python: an allocation beside a running kernel can hold back the
        // work that kernel waits for (docs/design-internode.md). With
        // num_worst_tokens the rows are known now; else after the counts.
        let (compute, (rpm, send_head, xh, early), comm) = self.begin(s, || {
            let rpm = required(&p.outputs, "rank_prefix_matrix", device)?;
            let send_head = required(&p.outputs, "send_head", device)?;
            let xh = xnode
                .map(|(nodes, cap)| {
                    new_internode_handle(device, rank, nodes, p.num_tokens, cap, &rpm)
                })
                .transpose()?;
            let early = worst
                .then(|| recv_outputs(&resolved(&p.outputs, p.num_recv_rows), device))
                .transpose()?;
            Ok((rpm, send_head, xh, early))
        })?;
        let inp = DispatchInputs {
            x: ptr(Some(data)),
            scales: ptr(scales),
            scale_strides: p.scale_strides,
            topk_idx: ptr(a.topk_idx),
            topk_weights: ptr(a.topk_weights),
            is_token_in_rank: ptr(a.is_token_in_rank),
            num_tokens_per_expert: ptr(a.num_tokens_per_expert),
            rank_prefix_matrix: ptr(Some(&rpm)),
            send_head: ptr(Some(&send_head)),
        };
        // A fresh dispatch also writes recv_rdma_rank_prefix_sum.
        let xi = xh.as_ref().map(|h| XInputs {
            recv_rdma_rank_prefix_sum: ptr(Some(&h.recv_rdma_rank_prefix_sum)),
            ..h.inputs()
        });
        let mut b = self.normal()?;
        let epoch = b.dispatch_send(
            comm,
            &shape,
            &inp,
            xi.as_ref(),
            false,
            p.expert_alignment as usize,
            num_sms,
        )?;
        let (rows, per_expert) = if worst {
            (p.num_recv_rows, Vec::new())
        } else {
            let (rows, counts) = b.wait_counts(epoch, shape.num_experts)?;
            (rows as i64, counts.into_iter().map(i64::from).collect())
        };
        let o = match early {
            Some(o) => o,
            // The counts are in (notify has ended): allocated now.
            None => self.allocate(s.allocate_on_comm_stream, || {
                recv_outputs(&resolved(&p.outputs, rows), device)
            })?,
        };
        let out = DispatchOutputs {
            num_rows: rows,
            recv_x: ptr(Some(&o.recv_x)),
            recv_scales: ptr(o.recv_scales.as_ref()),
            scale_strides: strides2(o.recv_scales.as_ref()),
            recv_topk_idx: ptr(o.recv_idx.as_ref()),
            recv_topk_weights: ptr(o.recv_w.as_ref()),
            recv_src_idx: ptr(Some(&o.recv_src_idx)),
        };
        self.normal()?
            .dispatch_recv(comm, &shape, ptr(Some(&rpm)), &out, num_sms)?;
        let mut outputs = vec![
            Some(&o.recv_x),
            o.recv_scales.as_ref(),
            o.recv_idx.as_ref(),
            o.recv_w.as_ref(),
            Some(&o.recv_src_idx),
            Some(&rpm),
            Some(&send_head),
        ];
        if let Some(h) = &xh {
            outputs.extend(h.written().map(Some));
        }
        let event = self.finish(compute, s, &dispatch_inputs(x, a), &outputs)?;
        let in_rank = a
            .is_token_in_rank
            .expect("the plan requires is_token_in_rank")
            .shallow_clone();
        Ok(Dispatched {
            recv_x: RecvX {
                x: o.recv_x,
                scales: o.recv_scales,
            },
            recv_topk_idx: o.recv_idx,
            recv_topk_weights: o.recv_w,
            num_recv_tokens_per_expert: per_expert,
            handle: Handle {
                rank_prefix_matrix: rpm,
                channel_prefix_matrix: o.cpm,
                recv_channel_prefix_matrix: o.rcpm,
                recv_src_idx: o.recv_src_idx,
                is_token_in_rank: in_rank,
                send_head,
                internode: xh,
            },
            event,
        })
    }

    /// `dispatch(x, handle=handle)`: a cached dispatch, reusing an earlier
    /// dispatch's layout (no CPU wait: CUDA-graph capturable). Returns
    /// `recv_x` (and scales).
    pub fn dispatch_cached(
        &mut self,
        x: DispatchX<'_>,
        handle: &Handle,
        num_sms: Option<u32>,
    ) -> Result<RecvX> {
        Ok(self
            .dispatch_cached_with(x, handle, num_sms, &StreamArgs::default())?
            .0)
    }

    /// [`dispatch_cached`](Self::dispatch_cached) with `previous_event`,
    /// `async_finish` and `allocate_on_comm_stream`; returns `recv_x` and
    /// the call's event.
    pub fn dispatch_cached_with(
        &mut self,
        x: DispatchX<'_>,
        handle: &Handle,
        num_sms: Option<u32>,
        s: &StreamArgs<'_>,
    ) -> Result<(RecvX, EventOverlap)> {
        self.check_normal()?;
        let num_sms = self.call_sms(num_sms, SmsCall::Dispatch)?;
        if self.nodes().is_some() {
            return self.x_dispatch_cached(x, handle, num_sms, s);
        }
        checks::internode_handle(&self.target(), self.rank, None, handle)?;
        let (data, scales) = x.parts();
        let args = DispatchArgsOf::new(x, Some(handle), None);
        let t = args.tensors();
        let (rpm, send_head) = (&handle.rank_prefix_matrix, &handle.send_head);
        let inputs = [Some(data), scales, Some(rpm), Some(send_head)];
        let ((recv_x, scales), event) =
            self.run_engine(s, num_sms, &inputs, |b, streams, out| {
                b.cached_dispatch_call(streams, &t, out)
            })?;
        Ok((RecvX { x: recv_x, scales }, event))
    }

    /// [`dispatch_cached_with`](Self::dispatch_cached_with) where the group
    /// spans nodes (the internode part), with `num_sms` SMs.
    fn x_dispatch_cached(
        &mut self,
        x: DispatchX<'_>,
        handle: &Handle,
        num_sms: u32,
        s: &StreamArgs<'_>,
    ) -> Result<(RecvX, EventOverlap)> {
        let device = self.cuda.device;
        let p = checks::dispatch_cached(&self.target(), x, handle)?;
        checks::internode_handle(&self.target(), self.rank, self.nodes(), handle)?;
        let (data, scales) = x.parts();
        let shape = launch_shape(&p, self.num_ranks);
        let (rpm, send_head) = (&handle.rank_prefix_matrix, &handle.send_head);
        // Allocated before any kernel of the dispatch runs (see `dispatch`).
        let (compute, (recv_x, recv_scales), comm) = self.begin(s, || {
            Ok((
                required(&p.outputs, "recv_x", device)?,
                output(&p.outputs, "recv_x_scales", device)?,
            ))
        })?;
        let inp = DispatchInputs {
            x: ptr(Some(data)),
            scales: ptr(scales),
            scale_strides: p.scale_strides,
            rank_prefix_matrix: ptr(Some(rpm)),
            send_head: ptr(Some(send_head)),
            ..DispatchInputs::default()
        };
        let xi = handle.internode.as_ref().map(InternodeHandle::inputs);
        self.normal()?
            .dispatch_send(comm, &shape, &inp, xi.as_ref(), true, 1, num_sms)?;
        let out = DispatchOutputs {
            num_rows: p.num_recv_rows,
            recv_x: ptr(Some(&recv_x)),
            recv_scales: ptr(recv_scales.as_ref()),
            scale_strides: strides2(recv_scales.as_ref()),
            recv_topk_idx: 0,
            recv_topk_weights: 0,
            recv_src_idx: 0,
        };
        self.normal()?
            .dispatch_recv(comm, &shape, ptr(Some(rpm)), &out, num_sms)?;
        let mut inputs = vec![Some(data), scales, Some(rpm), Some(send_head)];
        if let Some(h) = &handle.internode {
            inputs.extend(h.read().map(Some));
        }
        let event = self.finish(compute, s, &inputs, &[Some(&recv_x), recv_scales.as_ref()])?;
        Ok((
            RecvX {
                x: recv_x,
                scales: recv_scales,
            },
            event,
        ))
    }

    // ----- combine ---------------------------------------------------------------

    /// `combine(x, handle, topk_weights, bias)`: every token gets the float32
    /// sum of the copies the ranks it was dispatched to sent back (plus
    /// `bias`), as bf16. Returns `(combined_x, combined_topk_weights)`.
    pub fn combine(
        &mut self,
        x: &Tensor,
        handle: &Handle,
        topk_weights: Option<&Tensor>,
        bias: Bias<'_>,
        num_sms: Option<u32>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let (out, out_w, _) = self.combine_with(
            x,
            handle,
            topk_weights,
            bias,
            num_sms,
            &StreamArgs::default(),
        )?;
        Ok((out, out_w))
    }

    /// [`combine`](Self::combine) with `previous_event`, `async_finish` and
    /// `allocate_on_comm_stream`; returns `(combined_x,
    /// combined_topk_weights, event)` as Python does.
    pub fn combine_with(
        &mut self,
        x: &Tensor,
        handle: &Handle,
        topk_weights: Option<&Tensor>,
        bias: Bias<'_>,
        num_sms: Option<u32>,
        s: &StreamArgs<'_>,
    ) -> Result<(Tensor, Option<Tensor>, EventOverlap)> {
        self.check_normal()?;
        let c = CombineIn {
            x,
            handle,
            topk_weights,
            bias,
        };
        if self.nodes().is_some() {
            return self.x_combine(&c, num_sms, s);
        }
        checks::internode_handle(&self.target(), self.rank, None, handle)?;
        let num_sms = self.call_sms(num_sms, SmsCall::Combine)?;
        let args = CombineArgsOf::new(x, handle, topk_weights, bias);
        let t = args.tensors();
        let ((out, out_w), event) = self.run_engine(s, num_sms, &c.inputs(), |b, streams, o| {
            b.combine_call(streams, &t, o)
        })?;
        Ok((out, out_w, event))
    }

    /// [`combine_with`](Self::combine_with) where the group spans nodes (the
    /// internode part).
    fn x_combine(
        &mut self,
        c: &CombineIn<'_>,
        num_sms: Option<u32>,
        s: &StreamArgs<'_>,
    ) -> Result<(Tensor, Option<Tensor>, EventOverlap)> {
        let CombineIn {
            x,
            handle,
            topk_weights,
            bias,
        } = *c;
        let device = self.cuda.device;
        let p = checks::combine(&self.target(), x, handle, topk_weights, bias)?;
        checks::internode_handle(&self.target(), self.rank, self.nodes(), handle)?;
        let (b0, b1) = bias.pair();
        let num_sms = self.call_sms(num_sms, SmsCall::Combine)?;
        let (compute, (out, out_w), comm) = self.begin(s, || {
            Ok((
                required(&p.outputs, "combined_x", device)?,
                output(&p.outputs, "combined_topk_weights", device)?,
            ))
        })?;
        let a = CoreCombineArgs {
            y: ptr(Some(x)),
            num_recv_rows: p.num_recv_rows,
            hidden: p.hidden as usize,
            topk_weights: ptr(topk_weights),
            num_topk: p.num_topk as usize,
            rank_prefix_matrix: ptr(Some(&handle.rank_prefix_matrix)),
            send_head: ptr(Some(&handle.send_head)),
            num_tokens: p.num_tokens as usize,
            bias: (ptr(b0), ptr(b1)),
            out: ptr(Some(&out)),
            out_weights: ptr(out_w.as_ref()),
        };
        let xi = handle.internode.as_ref().map(InternodeHandle::inputs);
        let recv_src_idx = ptr(Some(&handle.recv_src_idx));
        self.normal()?
            .combine(comm, &a, xi.as_ref(), recv_src_idx, num_sms)?;
        let mut inputs = c.inputs();
        if let Some(h) = &handle.internode {
            inputs.push(Some(&handle.recv_src_idx));
            inputs.extend(h.read().map(Some));
        }
        let event = self.finish(compute, s, &inputs, &[Some(&out), out_w.as_ref()])?;
        Ok((out, out_w, event))
    }

    // ----- low latency -------------------------------------------------------------

    fn ll_begin(&self, async_finish: bool, return_recv_hook: bool) -> Result<&LowLatencyBuffer> {
        let ll = self.ll()?;
        self.ll_hooks.begin(async_finish, return_recv_hook)?;
        // A timed-out wait leaves the ranks out of step: the launch itself
        // refuses before launching (run_ll).
        Ok(ll)
    }

    /// The stream of a low-latency call (Python's `_ll_stream`): with
    /// `async_finish`, the communication stream after it waited for the
    /// current one, made torch's current stream while the outputs are
    /// allocated (the guard); else the current stream.
    fn ll_stream(&self, async_finish: bool) -> Result<(StreamHandle, Option<StreamGuard>)> {
        let compute = self.compute_stream()?;
        if !async_finish {
            return Ok((compute, None));
        }
        let comm = self.enter_comm(compute, None)?;
        Ok((comm, Some(StreamGuard::new(comm, self.cuda.index)?)))
    }

    /// `low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank,
    /// num_experts, ...)`: every (token, selected expert) goes to the
    /// expert's rank, cast to fp8 on the fly with `use_fp8`.
    pub fn low_latency_dispatch(
        &mut self,
        x: &Tensor,
        topk_idx: &Tensor,
        num_max_dispatch_tokens_per_rank: i64,
        num_experts: i64,
        o: &LlDispatchOptions<'_>,
    ) -> Result<LlDispatched> {
        let device = self.cuda.device;
        let target = self.target();
        let ll = self.ll_begin(o.async_finish, o.return_recv_hook)?;
        let p = checks::ll_dispatch(
            &target,
            x,
            topk_idx,
            num_max_dispatch_tokens_per_rank,
            num_experts,
            o,
        )?;
        let g = p.geometry;
        if self.check_ids_now()? {
            checks::topk_values(topk_idx, g.num_experts)?;
        }
        let shape = CallShape::of(&g, p.num_topk);
        // The buffer must hold this shape: refused before the outputs are
        // allocated (they can be larger than the GPU has free).
        ll.check_shape(&shape)?;
        let (stream, on_comm) = self.ll_stream(o.async_finish)?;
        let recv_x = required(&p.outputs, "recv_x", device)?;
        let scales = output(&p.outputs, "recv_x_scales", device)?;
        let recv_count = required(&p.outputs, "recv_count", device)?;
        let src_info = required(&p.outputs, "src_info", device)?;
        let layout_range = required(&p.outputs, "layout_range", device)?;
        drop(on_comm);
        let out = LlDispatchOutputs {
            recv_x: ptr(Some(&recv_x)),
            // Scales of an empty buffer still have an address.
            recv_scales: scales.as_ref().map_or(0, |s| s.data_ptr() as u64),
            recv_count: ptr(Some(&recv_count)),
            src_info: ptr(Some(&src_info)),
            layout_range: ptr(Some(&layout_range)),
            stats_count: ptr(o.cumulative_local_expert_recv_stats),
            stats_wait: ptr(o.dispatch_wait_recv_cost_stats),
        };
        let call = DispatchCall::planned(&p, ptr(Some(x)), ptr(Some(topk_idx)), out);
        let keep = [
            Some(x),
            Some(topk_idx),
            Some(&recv_x),
            scales.as_ref(),
            Some(&recv_count),
            Some(&src_info),
            Some(&layout_range),
            o.cumulative_local_expert_recv_stats,
            o.dispatch_wait_recv_cost_stats,
        ];
        let (event, hook) = self.ll_launch(
            stream,
            LlCall::Dispatch(call),
            &keep,
            o.async_finish,
            o.return_recv_hook,
        )?;
        Ok(LlDispatched {
            recv_x: RecvX { x: recv_x, scales },
            recv_count,
            handle: LlHandle {
                src_info,
                layout_range,
                num_max_dispatch_tokens_per_rank: g.max_tokens,
                hidden: g.hidden,
                num_experts: g.num_experts,
            },
            hook,
            event,
        })
    }

    /// Launches a low-latency call on `stream`: its send half only with
    /// `return_recv_hook` (the returned hook keeps `keep` and runs the
    /// receive half), else both. With `async_finish`, `keep` is also kept by
    /// the returned event, recorded on `stream`.
    fn ll_launch(
        &mut self,
        stream: StreamHandle,
        call: LlCall,
        keep: &[Option<&Tensor>],
        async_finish: bool,
        return_recv_hook: bool,
    ) -> Result<(EventOverlap, Option<RecvHook>)> {
        let phases = if return_recv_hook {
            Phases::Send
        } else {
            Phases::Both
        };
        let recorded = run_ll(self.ll()?, stream, &call, phases)?;
        let keep = keep.iter().flatten().copied();
        let event = if async_finish {
            EventOverlap::keeping(self.cuda.core, stream, self.cuda.index, keep.clone())?
        } else {
            EventOverlap::none()
        };
        let kind = match call {
            LlCall::Dispatch(_) => "dispatch",
            LlCall::Combine(_) => "combine",
        };
        let hook = self
            .ll_hooks
            .launched(kind, return_recv_hook)
            .map(|hook| RecvHook {
                owner: self.ll_owner,
                hook,
                call,
                _keep: keep.map(Tensor::shallow_clone).collect(),
            });
        // After the launch and the bookkeeping: the ranks stay in step.
        if let Some(e) = recorded {
            return Err(e);
        }
        Ok((event, hook))
    }

    /// Runs the receive half of the low-latency call that returned `hook`, on
    /// the current stream: once, in call order (else an error, the hook
    /// still pending), and only on the Buffer that made it.
    pub fn run_recv_hook(&mut self, hook: &mut RecvHook) -> Result<()> {
        if hook.owner != self.ll_owner {
            return Err(Error::state(format!(
                "the receive hook of {} belongs to another Buffer",
                hook.hook.name
            )));
        }
        self.ll_hooks.may_run(&hook.hook)?;
        let ll = self.ll()?;
        let stream = self.compute_stream()?;
        let recorded = run_ll(ll, stream, &hook.call, Phases::Recv)?;
        self.ll_hooks.ran(&hook.hook);
        // The kept tensors are freed on the current stream, after the launch.
        hook._keep.clear();
        match recorded {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// `low_latency_combine(x, topk_idx, topk_weights, handle, ...)`: every
    /// source token gets `sum_k topk_weights[t, k] * x[expert_k, row]` (f32,
    /// skipping -1) as bf16 `[N, H]`. Returns `(combined_x, event, hook)` as
    /// Python does: the result (`out` where given), the event (with
    /// `async_finish`; else empty) and the receive hook (with
    /// `return_recv_hook`).
    pub fn low_latency_combine(
        &mut self,
        x: &Tensor,
        topk_idx: &Tensor,
        topk_weights: &Tensor,
        handle: &LlHandle,
        o: &LlCombineOptions<'_>,
    ) -> Result<(Tensor, EventOverlap, Option<RecvHook>)> {
        let device = self.cuda.device;
        let target = self.target();
        let ll = self.ll_begin(o.async_finish, o.return_recv_hook)?;
        let p = checks::ll_combine(&target, x, topk_idx, topk_weights, handle, o)?;
        let g = p.geometry;
        if self.check_ids_now()? {
            checks::topk_values(topk_idx, g.num_experts)?;
        }
        let x_ptr = if o.zero_copy {
            ll.zero_copy_buffer(
                g.max_tokens as usize,
                g.hidden as usize,
                g.num_experts as usize,
            )?
            .0
        } else {
            ptr(Some(x))
        };
        let (stream, on_comm) = self.ll_stream(o.async_finish)?;
        let out = match o.out {
            Some(out) => out.shallow_clone(),
            None => required(&p.outputs, "combined_x", device)?,
        };
        drop(on_comm);
        let call = CombineCall::planned(
            &p,
            x_ptr,
            ptr(Some(&handle.layout_range)),
            ptr(Some(topk_idx)),
            ptr(Some(topk_weights)),
            ptr(Some(&out)),
            ptr(o.combine_wait_recv_cost_stats),
        );
        let keep = [
            Some(x),
            Some(topk_idx),
            Some(topk_weights),
            Some(&handle.src_info),
            Some(&handle.layout_range),
            Some(&out),
            o.combine_wait_recv_cost_stats,
        ];
        let (event, hook) = self.ll_launch(
            stream,
            LlCall::Combine(call),
            &keep,
            o.async_finish,
            o.return_recv_hook,
        )?;
        Ok((out, event, hook))
    }

    /// The bf16 `[E_local, R*T, H]` view of the buffer a zero-copy
    /// low-latency combine of `handle`'s shape reads: write the expert
    /// outputs there, then call [`low_latency_combine`](Self::low_latency_combine)
    /// with `zero_copy`.
    ///
    /// # Safety
    /// The tensor views this Buffer's memory without owning it: it must not
    /// be used after the Buffer is destroyed or dropped.
    pub unsafe fn get_next_low_latency_combine_buffer(&self, handle: &LlHandle) -> Result<Tensor> {
        let ll = self.ll()?;
        let p = calls::ll_handle(self.num_ranks, self.cuda.index, &handle.metas())?;
        let g = p.geometry;
        let spec = ep_core::calls::output(&p.outputs, "combine_buffer")
            .ok_or_else(|| Error::state("the handle's plan has no combine_buffer"))?;
        let (addr, _) = ll.zero_copy_buffer(
            g.max_tokens as usize,
            g.hidden as usize,
            g.num_experts as usize,
        )?;
        // SAFETY: the region holds the view (zero_copy_buffer sized it for
        // this shape); the caller keeps the Buffer alive.
        Ok(unsafe {
            Tensor::f_from_blob(
                addr as *const u8,
                &spec.shape,
                &spec.strides,
                Kind::BFloat16,
                self.cuda.device,
            )
        }?)
    }

    /// *Collective.* `clean_low_latency_buffer(T, H, E)`: resets the
    /// low-latency flags and call counters on every rank (waits for this
    /// device first); needed after interrupted low-latency calls.
    pub fn clean_low_latency_buffer(
        &mut self,
        num_max_dispatch_tokens_per_rank: i64,
        hidden: i64,
        num_experts: i64,
    ) -> Result<()> {
        let ll = self.ll()?;
        calls::ll_geometry(
            self.num_ranks,
            "group size",
            num_max_dispatch_tokens_per_rank,
            hidden,
            num_experts,
        )?;
        self.ll_hooks.none_pending()?;
        self.cuda.core.synchronize()?;
        Ok(ll.clean()?)
    }

    /// Masks (`mask`) or unmasks rank `rank_to_mask` for the low-latency
    /// kernels (needs `enable_shrink`), on the current stream.
    pub fn low_latency_update_mask_buffer(&mut self, rank_to_mask: i64, mask: bool) -> Result<()> {
        let view = self.mask_view()?;
        if !(0..self.num_ranks).contains(&rank_to_mask) {
            return Err(Error::value(if rank_to_mask < 0 {
                format!("rank_to_mask must be >= 0, got {rank_to_mask}")
            } else {
                format!(
                    "rank_to_mask must be <= {}, got {rank_to_mask}",
                    self.num_ranks - 1
                )
            }));
        }
        let _ = view.get(rank_to_mask).f_fill_(i64::from(mask))?;
        Ok(())
    }

    /// Unmasks every rank (on the current stream).
    pub fn low_latency_clean_mask_buffer(&mut self) -> Result<()> {
        let _ = self.mask_view()?.f_zero_()?;
        Ok(())
    }

    /// Copies the int32 `[R]` rank mask (1 = masked, by a call or a timeout)
    /// into `mask_status` (int32 `[R]` on this Buffer's device).
    pub fn low_latency_query_mask_buffer(&self, mask_status: &mut Tensor) -> Result<()> {
        let view = self.mask_view()?;
        let r = self.num_ranks;
        if mask_status.kind() != Kind::Int {
            return Err(Error::dtype(format!(
                "mask_status must have dtype torch.int32, got {}",
                crate::tensor::dtype_of(mask_status.kind())
            )));
        }
        if mask_status.size() != [r] {
            return Err(Error::value(format!(
                "mask_status must have shape [{r}], got {:?}",
                mask_status.size()
            )));
        }
        if mask_status.device() != self.cuda.device {
            return Err(Error::value(format!(
                "mask_status must be on {:?}, got {:?}",
                self.cuda.device,
                mask_status.device()
            )));
        }
        mask_status.f_copy_(&view)?;
        Ok(())
    }

    fn mask_view(&self) -> Result<Tensor> {
        let ll = self.ll()?;
        if !self.enable_shrink {
            return Err(Error::state(
                "the rank mask needs a Buffer created with enable_shrink=True",
            ));
        }
        let shape = [self.num_ranks];
        // SAFETY: int32 [R] the low-latency part owns; the view does not
        // outlive this call's caller (it is used and dropped in it).
        Ok(unsafe {
            Tensor::f_from_blob(
                ll.mask_ptr() as *const u8,
                &shape,
                &[1],
                Kind::Int,
                self.cuda.device,
            )
        }?)
    }

    // ----- lifetime ---------------------------------------------------------------

    /// *Collective.* Waits for the device, then destroys both parts: per
    /// part, raises its device error after meeting the other ranks in a
    /// barrier and freeing it. Every later call errors.
    pub fn destroy(&mut self) -> Result<()> {
        if self.inner.is_empty() {
            return Ok(());
        }
        self.cuda.core.synchronize()?;
        Ok(self.inner.destroy()?)
    }
}

impl Drop for Buffer {
    /// Frees the parts without a barrier (as the Python Buffer's collection),
    /// after the device finished what used them.
    fn drop(&mut self) {
        if !self.inner.is_empty() {
            let _ = self.cuda.core.synchronize();
        }
    }
}

/// What the engine's full dispatch `d` gave, as [`Buffer::dispatch`]
/// returns it: the handle with the caller's `is_token_in_rank`.
fn dispatched(
    d: ep_core::engine::Dispatched<Tensor>,
    is_token_in_rank: Tensor,
    event: EventOverlap,
) -> Dispatched {
    let per_expert = d.num_recv_tokens_per_expert.into_iter().map(i64::from);
    Dispatched {
        recv_x: RecvX {
            x: d.recv_x,
            scales: d.recv_x_scales,
        },
        recv_topk_idx: d.recv_topk_idx,
        recv_topk_weights: d.recv_topk_weights,
        num_recv_tokens_per_expert: per_expert.collect(),
        handle: Handle {
            rank_prefix_matrix: d.rank_prefix_matrix,
            channel_prefix_matrix: d.channel_prefix_matrix,
            recv_channel_prefix_matrix: d.recv_channel_prefix_matrix,
            recv_src_idx: d.recv_src_idx,
            is_token_in_rank,
            send_head: d.send_head,
            internode: None,
        },
        event,
    }
}

/// The tensors a full dispatch's kernels read (kept by an `async_finish`
/// call's event): `x` (and its scales), `topk_idx`, `topk_weights`,
/// `is_token_in_rank`, `num_tokens_per_expert`.
fn dispatch_inputs<'a>(x: DispatchX<'a>, a: &DispatchArgs<'a>) -> [Option<&'a Tensor>; 6] {
    let (data, scales) = x.parts();
    [
        Some(data),
        scales,
        a.topk_idx,
        a.topk_weights,
        a.is_token_in_rank,
        a.num_tokens_per_expert,
    ]
}

/// A combine's tensors, as [`Buffer::combine_with`] takes them.
#[derive(Clone, Copy)]
struct CombineIn<'a> {
    x: &'a Tensor,
    handle: &'a Handle,
    topk_weights: Option<&'a Tensor>,
    bias: Bias<'a>,
}

impl<'a> CombineIn<'a> {
    /// The tensors the kernels read (kept by an `async_finish` call's event):
    /// `x`, `topk_weights`, the bias, the handle's `rank_prefix_matrix` and
    /// `send_head`.
    fn inputs(&self) -> Vec<Option<&'a Tensor>> {
        let (b0, b1) = self.bias.pair();
        let h = self.handle;
        let (rpm, head) = (&h.rank_prefix_matrix, &h.send_head);
        vec![
            Some(self.x),
            self.topk_weights,
            b0,
            b1,
            Some(rpm),
            Some(head),
        ]
    }
}

/// `t`'s strides as the kernels take a 2-D scale tensor's (`(0, 0)` for
/// None).
fn strides2(t: Option<&Tensor>) -> (i64, i64) {
    match t {
        Some(t) => {
            let s = t.stride();
            (s[0], s[1])
        }
        None => (0, 0),
    }
}

/// A dispatch's received outputs, allocated as its plan says.
struct RecvOutputs {
    recv_x: Tensor,
    recv_scales: Option<Tensor>,
    recv_idx: Option<Tensor>,
    recv_w: Option<Tensor>,
    recv_src_idx: Tensor,
    cpm: Tensor,
    rcpm: Tensor,
}

/// `outputs` with `rows` received rows.
fn resolved(outputs: &[OutputSpec], rows: i64) -> Vec<OutputSpec> {
    outputs.iter().map(|o| o.resolve(rows)).collect()
}

/// The received outputs of a dispatch whose specs are `specs` (rows
/// resolved).
fn recv_outputs(specs: &[OutputSpec], device: Device) -> Result<RecvOutputs> {
    Ok(RecvOutputs {
        recv_x: required(specs, "recv_x", device)?,
        recv_scales: output(specs, "recv_x_scales", device)?,
        recv_idx: output(specs, "recv_topk_idx", device)?,
        recv_w: output(specs, "recv_topk_weights", device)?,
        recv_src_idx: required(specs, "recv_src_idx", device)?,
        cpm: required(specs, "channel_prefix_matrix", device)?,
        rcpm: required(specs, "recv_channel_prefix_matrix", device)?,
    })
}

/// The internode entries of the handle of a dispatch of `n` tokens on rank
/// `rank`, allocated before its launches (Python's `_x_tensors`), for
/// `(nodes, ranks per node)`: the node heads `[n, nodes]`, the counts
/// `[2 * nodes]`, the forwarding records `[nodes, max(capacity, n, 1), 1 +
/// ranks per node]` (`capacity`: the tokens per rank the buffer fits for
/// the dispatch's records) and `recv_rdma_rank_prefix_sum` `[nodes]`, int32
/// on `device`; `recv_gbl_rank_prefix_sum` is `rank_prefix_matrix`'s column
/// of `rank`.
fn new_internode_handle(
    device: Device,
    rank: usize,
    (num_nodes, per_node): (usize, usize),
    n: i64,
    capacity: usize,
    rank_prefix_matrix: &Tensor,
) -> Result<InternodeHandle> {
    let opts = (Kind::Int, device);
    let nodes = num_nodes as i64;
    let slots = (capacity as i64).max(n).max(1);
    Ok(InternodeHandle {
        node_head: Tensor::f_empty([n, nodes], opts)?,
        xcounts: Tensor::f_empty([2 * nodes], opts)?,
        fwd_meta: Tensor::f_empty([nodes, slots, 1 + per_node as i64], opts)?,
        recv_rdma_rank_prefix_sum: Tensor::f_empty([nodes], opts)?,
        recv_gbl_rank_prefix_sum: rank_prefix_matrix.f_select(1, rank as i64)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value_message<T: std::fmt::Debug>(r: Result<T>) -> String {
        match r {
            Err(e) => {
                assert_eq!(e.python_class(), "ValueError", "{e}");
                e.to_string()
            }
            Ok(v) => panic!("expected a ValueError, got {v:?}"),
        }
    }

    #[test]
    fn options_are_checked_as_python_checks_them() {
        assert!(check_options(&BufferOptions::default()).is_ok());
        let o = |f: fn(&mut BufferOptions)| {
            let mut o = BufferOptions::default();
            f(&mut o);
            check_options(&o)
        };
        assert_eq!(
            value_message(o(|o| o.num_nvl_bytes = 100)),
            "num_nvl_bytes must be a multiple of 128, got 100"
        );
        assert_eq!(
            value_message(o(|o| o.enable_shrink = true)),
            "enable_shrink=True needs low_latency_mode=True"
        );
        assert!(value_message(o(|o| o.low_latency_mode = true)).contains("num_rdma_bytes > 0"));
        // (num_rdma_bytes outside low_latency_mode sizes the internode part:
        // ep-core's calls accept it.)
        assert!(value_message(o(|o| o.num_sms = Some(7))).contains("must be even"));
        assert!(value_message(o(|o| o.num_sms = Some(100_000))).contains("<="));
        assert_eq!(
            value_message(o(|o| o.num_sms = Some(0))),
            "num_sms must be positive, got 0"
        );
        assert_eq!(
            value_message(o(|o| o.num_rdma_bytes = usize::MAX)),
            format!(
                "num_rdma_bytes must be below 2**63 bytes, got {}",
                usize::MAX
            )
        );
        // The parts: the low-latency one only in low_latency_mode.
        let both = check_options(&BufferOptions {
            num_nvl_bytes: 1 << 20,
            num_rdma_bytes: 1 << 30,
            low_latency_mode: true,
            ..BufferOptions::default()
        })
        .unwrap();
        assert_eq!((both.num_nvl_bytes, both.num_ll_bytes), (1 << 20, 1 << 30));
    }

    #[test]
    fn sized_for_sizes_both_parts_by_their_hints() {
        let o = BufferOptions::sized_for(128, 7168, 8, 256).unwrap();
        assert_eq!(
            o.num_nvl_bytes,
            Buffer::nvl_buffer_size_hint(2 * 7168, 8, 128).unwrap()
        );
        assert_eq!(
            o.num_rdma_bytes,
            Buffer::get_low_latency_rdma_size_hint(128, 7168, 8, 256).unwrap()
        );
        assert!(o.low_latency_mode);
        assert!(check_options(&o).is_ok());
        assert!(BufferOptions::sized_for(128, -1, 8, 256).is_err());
    }

    #[test]
    fn sized_for_covers_the_internode_part_across_nodes() {
        let ll = Buffer::get_low_latency_rdma_size_hint(64, 4096, 8, 64).unwrap();
        let x = Buffer::rdma_buffer_size_hint(2 * 4096, 8, 64, 2).unwrap();
        let nvl = Buffer::nvl_buffer_size_hint(2 * 4096, 8, 64).unwrap();
        // Within one node the internode hint is 0: the low-latency one.
        let one = BufferOptions::sized_for_nodes(64, 4096, 8, 64, 8).unwrap();
        assert_eq!((one.num_nvl_bytes, one.num_rdma_bytes), (nvl, ll));
        let four = BufferOptions::sized_for_nodes(64, 4096, 8, 64, 2).unwrap();
        assert_eq!((four.num_nvl_bytes, four.num_rdma_bytes), (nvl, ll.max(x)));
        assert!(x > 0 && check_options(&four).is_ok());
        // Both parts of a normal-mode and low-latency Buffer get num_rdma_bytes.
        let plan = check_options(&four).unwrap();
        assert_eq!(
            (plan.num_ll_bytes, plan.num_internode_bytes),
            (four.num_rdma_bytes as u64, four.num_rdma_bytes as u64)
        );
        let e = BufferOptions::sized_for_nodes(64, 4096, 8, 64, 3).unwrap_err();
        assert_eq!(
            e.to_string(),
            "ranks_per_node 3 does not divide num_ranks 8"
        );
    }

    #[test]
    fn ranks_per_node_as_python_defaults_it() {
        let s = |v: &str| Some(v.to_string());
        assert_eq!(ranks_per_node_of(None, None).unwrap(), 8);
        assert_eq!(ranks_per_node_of(None, s("4")).unwrap(), 4);
        assert_eq!(ranks_per_node_of(None, s("x")).unwrap(), 8);
        assert_eq!(ranks_per_node_of(s(" 2 "), s("4")).unwrap(), 2);
        assert_eq!(ranks_per_node_of(s(" "), s("4")).unwrap(), 4);
        for bad in ["0", "-1", "two"] {
            let e = ranks_per_node_of(s(bad), None).unwrap_err();
            assert_eq!(e.python_class(), "ValueError");
            assert_eq!(
                e.to_string(),
                format!("MOELINK_RANKS_PER_NODE must be a positive integer, got {bad:?}")
            );
        }
    }

    #[test]
    fn a_new_internode_handle_has_the_shapes_the_checks_take() {
        let rpm = Tensor::arange(16, (Kind::Int, Device::Cpu)).view([4, 4]);
        let h = new_internode_handle(Device::Cpu, 1, (2, 2), 5, 3, &rpm).unwrap();
        assert_eq!(h.node_head.size(), [5, 2]);
        assert_eq!(h.xcounts.size(), [4]);
        // Records of at least the dispatch's tokens.
        assert_eq!(h.fwd_meta.size(), [2, 5, 3]);
        assert_eq!(h.recv_rdma_rank_prefix_sum.size(), [2]);
        assert!(h.recv_gbl_rank_prefix_sum.equal(&rpm.select(1, 1)));
        assert_eq!(h.inputs().meta_slots, 5);
        assert_eq!(h.inputs().recv_rdma_rank_prefix_sum, 0);
        let big = new_internode_handle(Device::Cpu, 0, (2, 2), 5, 40, &rpm).unwrap();
        assert_eq!(big.fwd_meta.size(), [2, 40, 3]);
        let empty = new_internode_handle(Device::Cpu, 0, (2, 2), 0, 0, &rpm).unwrap();
        assert_eq!(empty.fwd_meta.size(), [2, 1, 3]);
        let handle = Handle {
            rank_prefix_matrix: rpm.shallow_clone(),
            channel_prefix_matrix: Tensor::zeros([4, 1], (Kind::Int, Device::Cpu)),
            recv_channel_prefix_matrix: Tensor::zeros([4, 1], (Kind::Int, Device::Cpu)),
            recv_src_idx: Tensor::zeros([3], (Kind::Int, Device::Cpu)),
            is_token_in_rank: Tensor::zeros([5, 4], (Kind::Bool, Device::Cpu)),
            send_head: Tensor::zeros([5, 4], (Kind::Int, Device::Cpu)),
            internode: Some(h),
        };
        let t = Target::new(4, Device::Cpu);
        assert!(checks::internode_handle(&t, 1, Some((2, 2)), &handle).is_ok());
    }

    #[test]
    fn device_timeouts_from_the_environment() {
        // The values as read, not the process's environment, which other
        // tests read (every MOELINK_* read is of a registered switch).
        let env = "MOELINK_DEVICE_TIMEOUT_S";
        assert_eq!(device_timeout_ns_of(env, None).unwrap(), 30_000_000_000);
        assert_eq!(
            device_timeout_ns_of(env, Some("0.5".into())).unwrap(),
            500_000_000
        );
        for bad in ["0", "-1", "inf", "x"] {
            let e = device_timeout_ns_of(env, Some(bad.into())).unwrap_err();
            assert_eq!(e.python_class(), "ValueError");
            assert!(e.to_string().starts_with(env), "{e}");
        }
    }

    #[test]
    fn size_hint_checks_its_geometry_in_the_core() {
        assert!(Buffer::get_low_latency_rdma_size_hint(128, 7168, 8, 256).unwrap() > 0);
        let e = Buffer::get_low_latency_rdma_size_hint(128, 100, 8, 256).unwrap_err();
        assert_eq!(
            e.to_string(),
            "hidden must be a positive multiple of 128 up to 8192, got 100"
        );
        let e = Buffer::get_low_latency_rdma_size_hint(128, 7168, 33, 264).unwrap_err();
        assert_eq!(e.to_string(), "num_ranks must be <= 32, got 33");
    }
}
