//! `_native.EpBuffer`: the Rust half of `moelink.Buffer` (`ep_core::EpBuffer`):
//! its intranode part and its low-latency part, either absent where the
//! Buffer has none. A method of one part only has that part's name
//! (`dispatch_send`, `wait_counts`, ... intranode; `ll_dispatch`, `clean`, ...
//! low-latency); what both parts have (`local_buffer`, `check_device`,
//! `check_device_timeout`, `barrier`) takes the part: "intranode" or
//! "low_latency". Pointers arrive as ints (`tensor.data_ptr()`, 0 = absent)
//! after the call's plan (`calls.rs`, `ep_core::calls`) checked every tensor;
//! streams as raw `cudaStream_t` ints. Layout, dispatch and combine take that
//! plan object ([`LayoutPlan`], [`DispatchPlan`], [`CombinePlan`]) for every
//! size, and only the call's addresses, grouped in tuples, besides; so do the
//! low-latency dispatch and combine ([`LlDispatchPlan`], [`LlCombinePlan`]),
//! with the phases to launch.

use comm::StreamHandle;
use ep_core::calls::{self, LlGeometry};
use ep_core::internode::XInputs;
use ep_core::intranode::{
    CombineArgs, DispatchInputs, DispatchOutputs, DispatchShape, IntranodeBuffer, LayoutCall,
};
use ep_core::low_latency::{
    size_hint, CallShape, CombineCall, DispatchCall, DispatchOutputs as LlDispatchOutputs, LlCall,
    LowLatencyBuffer, Phases,
};
use ep_core::{
    BufferPart, EpBuffer as Inner, EpBufferOptions, LowLatencyOptions, NormalPart, PartKind,
};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::calls::{CombinePlan, DispatchPlan, LayoutPlan, LlCombinePlan, LlDispatchPlan};
use crate::group::{timeout_arg, Group};
use crate::{drop_detached, to_py};

#[pyclass(module = "moelink._native")]
pub struct EpBuffer {
    inner: Inner,
}

/// The part named `name` in Python.
fn part_kind(name: &str) -> PyResult<PartKind> {
    match name {
        "intranode" => Ok(PartKind::Intranode),
        "low_latency" => Ok(PartKind::LowLatency),
        _ => Err(PyValueError::new_err(format!(
            "part must be 'intranode' or 'low_latency', got {name:?}"
        ))),
    }
}

/// The error of a call on part `kind` where it is absent.
fn absent(destroyed: bool, kind: PartKind) -> PyErr {
    if destroyed {
        PyRuntimeError::new_err("the Buffer was destroyed")
    } else {
        PyRuntimeError::new_err(format!("the Buffer has no {} part", kind.name()))
    }
}

impl EpBuffer {
    /// ep-core's buffer, for the engine's calls (`normal_calls.rs`).
    pub(crate) fn core_mut(&mut self) -> &mut Inner {
        &mut self.inner
    }

    fn part(&self, name: &str) -> PyResult<&dyn BufferPart> {
        let kind = part_kind(name)?;
        self.inner
            .part(kind)
            .ok_or_else(|| absent(self.inner.is_empty(), kind))
    }

    /// The parts `part` names (every part present where None); the Buffer
    /// must not be destroyed.
    fn parts(&self, part: Option<&str>) -> PyResult<Vec<&dyn BufferPart>> {
        match part {
            Some(name) => Ok(vec![self.part(name)?]),
            None if self.inner.is_empty() => Err(absent(true, PartKind::Intranode)),
            None => Ok(self.inner.parts().collect()),
        }
    }

    fn intranode(&mut self) -> PyResult<&mut IntranodeBuffer> {
        let destroyed = self.inner.is_empty();
        self.inner
            .intranode_mut()
            .ok_or_else(|| absent(destroyed, PartKind::Intranode))
    }

    /// The part that serves layout, dispatch and combine (internode where the
    /// group spans nodes, else intranode).
    fn normal(&mut self) -> PyResult<NormalPart<'_>> {
        let destroyed = self.inner.is_empty();
        self.inner
            .normal()
            .ok_or_else(|| absent(destroyed, PartKind::Intranode))
    }

    pub(crate) fn ll(&self) -> PyResult<&LowLatencyBuffer> {
        self.inner
            .low_latency()
            .ok_or_else(|| absent(self.inner.is_empty(), PartKind::LowLatency))
    }

    /// Launches `phases` of the low-latency call `call` on `stream`
    /// (`ep_core::LowLatencyBuffer::call`). Raises, launching nothing, once a
    /// device wait of the part ran out; returns the error the kernels
    /// recorded (an exception object, for the caller to raise after its
    /// bookkeeping) or None.
    pub(crate) fn launch_ll(
        &self,
        py: Python<'_>,
        stream: usize,
        call: &LlCall,
        phases: Phases,
    ) -> PyResult<Option<Py<PyAny>>> {
        let recorded = self
            .ll()?
            .call(StreamHandle(stream), call, phases)
            .map_err(to_py)?;
        Ok(recorded.map(|e| to_py(e).into_value(py).into_any()))
    }

    /// ValueError where a low-latency call of geometry `g` does not fit the
    /// kernels or this buffer (`check_shape`).
    pub(crate) fn check_ll_shape(&self, g: &LlGeometry, num_topk: i64) -> PyResult<()> {
        self.ll()?
            .check_shape(&CallShape::of(g, num_topk))
            .map_err(to_py)
    }

    /// The device address of the zero-copy combine input of geometry `g`.
    pub(crate) fn ll_zero_copy_ptr(&self, g: &LlGeometry) -> PyResult<u64> {
        let (ptr, _) = self
            .ll()?
            .zero_copy_buffer(
                g.max_tokens as usize,
                g.hidden as usize,
                g.num_experts as usize,
            )
            .map_err(to_py)?;
        Ok(ptr)
    }
}

fn phases(p: u8) -> PyResult<Phases> {
    match p {
        1 => Ok(Phases::Send),
        2 => Ok(Phases::Recv),
        3 => Ok(Phases::Both),
        _ => Err(PyValueError::new_err(format!(
            "phases {p}: must be 1, 2 or 3"
        ))),
    }
}

fn shape(
    num_tokens: usize,
    hidden_bytes: usize,
    num_scales: usize,
    num_topk: usize,
    num_experts: usize,
) -> DispatchShape {
    DispatchShape {
        num_tokens,
        hidden_bytes,
        num_scales,
        num_topk,
        num_experts,
    }
}

/// The `DispatchShape` of a dispatch's plan. A cached dispatch moves no
/// top-k and reads no expert count: its `num_experts` is the group size, a
/// valid count.
fn dispatch_shape(plan: &DispatchPlan) -> DispatchShape {
    let p = &plan.plan;
    let num_experts = if p.cached {
        plan.num_ranks
    } else {
        p.num_experts
    };
    shape(
        p.num_tokens as usize,
        p.hidden_bytes as usize,
        p.num_scales as usize,
        p.num_topk as usize,
        num_experts as usize,
    )
}

/// The addresses a full dispatch has and a cached one lacks (`routing`), or
/// zeros for a cached one; refuses a call that does not match its plan.
fn routing_of<T: Default>(plan: &DispatchPlan, routing: Option<T>) -> PyResult<T> {
    match (routing, plan.plan.cached) {
        (Some(r), false) => Ok(r),
        (None, true) => Ok(T::default()),
        (Some(_), true) => Err(PyValueError::new_err(
            "a cached dispatch (a plan with a handle) takes no routing addresses",
        )),
        (None, false) => Err(PyValueError::new_err(
            "a dispatch without a handle needs its routing addresses",
        )),
    }
}

/// `dispatch_send`'s addresses every dispatch has: `x`, its scales,
/// `rank_prefix_matrix`, `send_head`.
type SendTensors = (u64, u64, u64, u64);
/// `dispatch_send`'s addresses of a full dispatch only: `topk_idx`,
/// `topk_weights`, `is_token_in_rank`, `num_tokens_per_expert`.
type SendRouting = (u64, u64, u64, u64);
/// `dispatch_recv`'s addresses every dispatch has: `rank_prefix_matrix`,
/// `recv_x`, `recv_x_scales`.
type RecvTensors = (u64, u64, u64);
/// `dispatch_recv`'s addresses of a full dispatch only: `recv_topk_idx`,
/// `recv_topk_weights`, `recv_src_idx`.
type RecvRouting = (u64, u64, u64);
/// `combine`'s addresses: `x`, `topk_weights`, `rank_prefix_matrix`,
/// `send_head`, the two biases, the outputs `combined_x` and
/// `combined_topk_weights`.
type CombineTensors = (u64, u64, u64, u64, u64, u64, u64, u64);
/// `layout`'s outputs: `num_tokens_per_rank`, `num_tokens_per_expert`,
/// `is_token_in_rank`, the scratch `layout_scratch`.
type LayoutOutputs = (u64, u64, u64, u64);

/// An internode call's handle tensors: node heads, counts, forwarding records,
/// their tokens per node, and `recv_rdma_rank_prefix_sum` (0: not written).
type XTensors = (u64, u64, u64, usize, u64);
type XArg = Option<XTensors>;

fn x_inputs(x: XTensors) -> XInputs {
    let (node_head, xcounts, fwd_meta, meta_slots, recv_rdma_rank_prefix_sum) = x;
    XInputs {
        node_head,
        xcounts,
        fwd_meta,
        meta_slots,
        recv_rdma_rank_prefix_sum,
    }
}

/// The dispatch call of plan `p` at the addresses of `ll_dispatch`'s tuple.
pub(crate) fn ll_dispatch_call(p: &calls::LlDispatchPlan, t: LlDispatchTensors) -> DispatchCall {
    let (x, topk_idx, recv_x, recv_scales, recv_count, src_info, layout_range, count, wait) = t;
    let out = LlDispatchOutputs {
        recv_x,
        recv_scales,
        recv_count,
        src_info,
        layout_range,
        stats_count: count,
        stats_wait: wait,
    };
    DispatchCall::planned(p, x, topk_idx, out)
}

/// `ll_dispatch`'s addresses: `x`, `topk_idx` (0 without tokens), the outputs
/// `recv_x`, `recv_x_scales` (0 for bf16), `recv_count`, `src_info`,
/// `layout_range`, then `cumulative_local_expert_recv_stats` and
/// `dispatch_wait_recv_cost_stats` (0: absent).
pub(crate) type LlDispatchTensors = (u64, u64, u64, u64, u64, u64, u64, u64, u64);
/// `ll_combine`'s addresses: `x`, the handle's `layout_range`, `topk_idx`,
/// `topk_weights`, `out` (these three 0 without tokens),
/// `combine_wait_recv_cost_stats` (0: absent).
pub(crate) type LlCombineTensors = (u64, u64, u64, u64, u64, u64);

/// Bytes of low-latency buffer a rank needs (DeepEP's
/// `get_low_latency_rdma_size_hint`).
#[pyfunction]
pub fn low_latency_size_hint(
    max_tokens: usize,
    hidden: usize,
    num_ranks: usize,
    num_experts: usize,
) -> PyResult<usize> {
    size_hint(max_tokens, hidden, num_ranks, num_experts).map_err(to_py)
}

#[pymethods]
impl EpBuffer {
    /// *Collective.* The group's next objects: the intranode part (an NVL
    /// buffer of `num_nvl_bytes` and its channels; none where 0), then the
    /// low-latency part (a buffer of `num_ll_bytes`, and the proxy's port
    /// channels when NVLink is not used; none where 0), on CUDA device
    /// `device`. Device waits are bounded by `device_timeout_ns` (intranode)
    /// and `ll_device_timeout_ns` (low-latency), host waits by `timeout_s`.
    /// `num_internode_bytes`: the cross-node regions added to the intranode
    /// part where the group spans nodes (needed there; unused within one).
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (group, device, num_nvl_bytes, num_ll_bytes, timeout_s,
        device_timeout_ns, ll_device_timeout_ns, allow_nvlink, shrink, num_internode_bytes=0))]
    fn new(
        py: Python<'_>,
        group: PyRef<'_, Group>,
        device: i32,
        num_nvl_bytes: usize,
        num_ll_bytes: usize,
        timeout_s: f64,
        device_timeout_ns: i64,
        ll_device_timeout_ns: i64,
        allow_nvlink: bool,
        shrink: bool,
        num_internode_bytes: usize,
    ) -> PyResult<Self> {
        let opts = EpBufferOptions {
            num_nvl_bytes,
            num_internode_bytes,
            num_ll_bytes,
            timeout: timeout_arg("timeout_s", timeout_s)?,
            device_timeout_ns,
            low_latency: LowLatencyOptions {
                allow_nvlink,
                shrink,
                device_timeout_ns: ll_device_timeout_ns,
            },
        };
        let inner = group.make(py, device, |group, dev| Inner::new(group, dev, &opts))?;
        Ok(Self { inner })
    }

    // ----- both parts ---------------------------------------------------------

    #[getter]
    fn rank(&self) -> PyResult<usize> {
        Ok(self.parts(None)?[0].base().rank())
    }

    #[getter]
    fn num_ranks(&self) -> PyResult<usize> {
        Ok(self.parts(None)?[0].base().num_ranks())
    }

    /// Whether part `part` ("intranode", "low_latency") is there (made, and
    /// not destroyed).
    fn has_part(&self, part: &str) -> PyResult<bool> {
        Ok(self.inner.part(part_kind(part)?).is_some())
    }

    /// (device address, bytes) of this rank's buffer of part `part`.
    fn local_buffer(&self, part: &str) -> PyResult<(u64, usize)> {
        Ok(self.part(part)?.local_buffer())
    }

    /// This rank's share of its GPU: (ranks on the GPU, the GPU's SMs, the SM
    /// limit of this rank's context (MPS) or None, SMs per grid, the smallest
    /// SMs per grid of any rank).
    fn device_share(&self) -> PyResult<(usize, u32, Option<u32>, u32, u32)> {
        let s = self.parts(None)?[0].base().device_share();
        Ok((
            s.ranks_on_device,
            s.device_sms,
            s.context_sms,
            s.sms,
            s.group_sms,
        ))
    }

    /// Raises what a kernel of part `part` (every part, intranode first,
    /// where None) recorded: moelink.TimeoutError for a device wait that ran
    /// out, ValueError for an expert id out of range (once); for the
    /// low-latency part also what its proxy or FIFO reported.
    #[pyo3(signature = (part=None))]
    fn check_device(&self, part: Option<&str>) -> PyResult<()> {
        self.parts(part)?
            .into_iter()
            .try_for_each(|p| p.check_device())
            .map_err(to_py)
    }

    /// Raises moelink.TimeoutError (or the proxy's error) if a device wait of
    /// part `part` ran out (an expert id out of range is left for
    /// check_device).
    fn check_device_timeout(&self, part: &str) -> PyResult<()> {
        self.part(part)?.check_device_timeout().map_err(to_py)
    }

    /// *Collective* host barrier of part `part` (of every part, intranode
    /// first, where None).
    #[pyo3(signature = (part=None))]
    fn barrier(&self, py: Python<'_>, part: Option<&str>) -> PyResult<()> {
        let parts = self.parts(part)?;
        py.detach(|| parts.into_iter().try_for_each(|p| p.barrier()))
            .map_err(to_py)
    }

    /// Frees both parts (idempotent), intranode first. With `collective`
    /// (every rank calls it): per part, reads its device error, meets the
    /// other ranks in a barrier, and frees it; raises the first device error
    /// after both are freed. A shrink Buffer meets nobody: each rank frees
    /// its parts when it gets there (`ep_core::EpBuffer::destroy`). The
    /// caller synchronised the streams that used the buffer. The GIL is
    /// released.
    #[pyo3(signature = (collective=false))]
    fn destroy(&mut self, py: Python<'_>, collective: bool) -> PyResult<()> {
        if collective {
            let inner = &mut self.inner;
            return py.detach(|| inner.destroy()).map_err(to_py);
        }
        drop_detached(py, std::mem::take(&mut self.inner));
        Ok(())
    }

    #[getter]
    fn destroyed(&self) -> bool {
        self.inner.is_empty()
    }

    // ----- intranode ----------------------------------------------------------

    /// `(nodes, ranks per node)` of an internode Buffer, None within one node.
    fn nodes(&self) -> Option<(usize, usize)> {
        self.inner
            .internode()
            .map(|b| (b.num_nodes(), b.ranks_per_node()))
    }

    /// Tokens per rank an internode dispatch of these records fits (the
    /// second dimension of the handle's forwarding records).
    fn internode_capacity(
        &self,
        hidden_bytes: usize,
        num_scales: usize,
        num_topk: usize,
    ) -> PyResult<usize> {
        let b = self.inner.internode().ok_or_else(|| {
            PyRuntimeError::new_err("the Buffer's group has one node (no internode part)")
        })?;
        b.dispatch_capacity(&shape(0, hidden_bytes, num_scales, num_topk, 1))
            .map_err(to_py)
    }

    /// Layout of `plan`'s `topk_idx` into `outputs` (across nodes also the
    /// tokens per node).
    #[pyo3(signature = (stream, plan, topk_idx, outputs, num_tokens_per_node=0))]
    fn layout(
        &mut self,
        stream: usize,
        plan: PyRef<'_, LayoutPlan>,
        topk_idx: u64,
        outputs: LayoutOutputs,
        num_tokens_per_node: u64,
    ) -> PyResult<()> {
        let p = &plan.0;
        let (num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank, partials) = outputs;
        let call = LayoutCall {
            topk_idx,
            num_tokens: p.num_tokens as usize,
            num_topk: p.num_topk as usize,
            num_experts: p.num_experts as usize,
            num_tokens_per_rank,
            num_tokens_per_expert,
            is_token_in_rank,
            partials,
        };
        self.normal()?
            .layout(StreamHandle(stream), &call, num_tokens_per_node)
            .map_err(to_py)
    }

    /// Notify + send half of a dispatch of `plan` (cached where the plan has
    /// a handle: then no `routing`). Returns the epoch to wait for (0 for
    /// cached).
    #[pyo3(signature = (stream, plan, num_sms, tensors, routing=None, xnode=None))]
    fn dispatch_send(
        &mut self,
        stream: usize,
        plan: PyRef<'_, DispatchPlan>,
        num_sms: u32,
        tensors: SendTensors,
        routing: Option<SendRouting>,
        xnode: XArg,
    ) -> PyResult<u64> {
        let (x, scales, rank_prefix_matrix, send_head) = tensors;
        let (topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert) =
            routing_of(&plan, routing)?;
        let p = &plan.plan;
        let s = dispatch_shape(&plan);
        let inp = DispatchInputs {
            x,
            scales,
            scale_strides: p.scale_strides,
            topk_idx,
            topk_weights,
            is_token_in_rank,
            num_tokens_per_expert,
            rank_prefix_matrix,
            send_head,
        };
        // A cached dispatch computes no counts: no alignment.
        let expert_alignment = if p.cached { 1 } else { p.expert_alignment };
        let xi = xnode.map(x_inputs);
        self.normal()?
            .dispatch_send(
                StreamHandle(stream),
                &s,
                &inp,
                xi.as_ref(),
                p.cached,
                expert_alignment as usize,
                num_sms,
            )
            .map_err(to_py)
    }

    /// Bounded CPU wait for the counts of dispatch `epoch` (of `plan`):
    /// (received tokens, per-local-expert counts). Releases the GIL.
    fn wait_counts(
        &mut self,
        py: Python<'_>,
        epoch: u64,
        plan: PyRef<'_, DispatchPlan>,
    ) -> PyResult<(usize, Vec<i32>)> {
        let num_experts = plan.plan.num_experts as usize;
        let b = self.normal()?;
        py.detach(|| b.wait_counts(epoch, num_experts))
            .map_err(to_py)
    }

    /// Receive half of a dispatch of `plan` into the outputs of `tensors`
    /// and `routing` (none for a cached dispatch), `rows` rows: those
    /// `wait_counts` returned, or None where the plan knows them (cached, or
    /// `num_worst_tokens`).
    #[pyo3(signature = (stream, plan, num_sms, tensors, routing=None, rows=None))]
    fn dispatch_recv(
        &mut self,
        stream: usize,
        plan: PyRef<'_, DispatchPlan>,
        num_sms: u32,
        tensors: RecvTensors,
        routing: Option<RecvRouting>,
        rows: Option<i64>,
    ) -> PyResult<()> {
        let (rank_prefix_matrix, recv_x, recv_scales) = tensors;
        let (recv_topk_idx, recv_topk_weights, recv_src_idx) = routing_of(&plan, routing)?;
        let num_rows = rows.unwrap_or(plan.plan.num_recv_rows);
        if num_rows < 0 {
            return Err(PyValueError::new_err(format!(
                "rows must be given for this dispatch (its plan knows them once the counts \
                 arrive), got {num_rows}"
            )));
        }
        let s = dispatch_shape(&plan);
        let out = DispatchOutputs {
            num_rows,
            recv_x,
            recv_scales,
            scale_strides: plan.recv_scale_strides(num_rows),
            recv_topk_idx,
            recv_topk_weights,
            recv_src_idx,
        };
        self.normal()?
            .dispatch_recv(StreamHandle(stream), &s, rank_prefix_matrix, &out, num_sms)
            .map_err(to_py)
    }

    /// A whole combine of `plan` (across nodes with the handle's `xnode` and
    /// `recv_src_idx`).
    #[pyo3(signature = (stream, plan, num_sms, tensors, xnode=None, recv_src_idx=0))]
    fn combine(
        &mut self,
        stream: usize,
        plan: PyRef<'_, CombinePlan>,
        num_sms: u32,
        tensors: CombineTensors,
        xnode: XArg,
        recv_src_idx: u64,
    ) -> PyResult<()> {
        let (y, topk_weights, rank_prefix_matrix, send_head, bias0, bias1, out, out_weights) =
            tensors;
        let p = &plan.0;
        let a = CombineArgs {
            y,
            num_recv_rows: p.num_recv_rows,
            hidden: p.hidden as usize,
            topk_weights,
            num_topk: p.num_topk as usize,
            rank_prefix_matrix,
            send_head,
            num_tokens: p.num_tokens as usize,
            bias: (bias0, bias1),
            out,
            out_weights,
        };
        let xi = xnode.map(x_inputs);
        self.normal()?
            .combine(StreamHandle(stream), &a, xi.as_ref(), recv_src_idx, num_sms)
            .map_err(to_py)
    }

    // ----- low-latency --------------------------------------------------------

    #[getter]
    fn uses_proxy(&self) -> PyResult<bool> {
        Ok(self.ll()?.uses_proxy())
    }

    /// Device address of the int32 `[R]` rank mask.
    fn mask_ptr(&self) -> PyResult<u64> {
        Ok(self.ll()?.mask_ptr())
    }

    /// ValueError where a call of this shape does not fit the kernels or this
    /// buffer (checked before the caller allocates the call's outputs).
    fn check_shape(
        &self,
        max_tokens: usize,
        hidden: usize,
        num_experts: usize,
        num_topk: usize,
    ) -> PyResult<()> {
        let s = CallShape::new(max_tokens, hidden, num_experts, num_topk);
        self.ll()?.check_shape(&s).map_err(to_py)
    }

    /// (device address, bytes) of the zero-copy combine input for this shape.
    fn zero_copy_buffer(
        &self,
        max_tokens: usize,
        hidden: usize,
        num_experts: usize,
    ) -> PyResult<(u64, usize)> {
        self.ll()?
            .zero_copy_buffer(max_tokens, hidden, num_experts)
            .map_err(to_py)
    }

    #[getter]
    fn num_blocks(&self) -> PyResult<u32> {
        Ok(self.ll()?.num_blocks())
    }

    fn set_num_blocks(&mut self, n: u32) -> PyResult<()> {
        let destroyed = self.inner.is_empty();
        self.inner
            .low_latency_mut()
            .ok_or_else(|| absent(destroyed, PartKind::LowLatency))?
            .set_num_blocks(n);
        Ok(())
    }

    /// Phase stamps of the latest launches (`MOELINK_LL_PROFILE=1` at creation):
    /// u64 `[2][256][16]`, see `ep_kernels::low_latency::PROF_SLOTS` (through ep-core).
    fn profile(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        let ll = self.ll()?;
        py.detach(|| ll.profile()).map_err(to_py)
    }

    /// Phase stamps of the fused intranode kernels' latest launch of each kind
    /// since the previous read, which zeroed them (`MOELINK_INTRANODE_PROFILE=1`
    /// at creation): u64 globaltimer ns `[4][256][4]`, see
    /// `ep_kernels::intranode::PROF_KINDS`.
    fn intranode_profile(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        let destroyed = self.inner.is_empty();
        let part = self
            .inner
            .intranode()
            .ok_or_else(|| absent(destroyed, PartKind::Intranode))?;
        py.detach(|| part.profile()).map_err(to_py)
    }

    /// The SMs a dispatch or combine asked for `num_sms` launches with (capped
    /// to this rank's share of its GPU), or None without a normal-mode part.
    fn launch_sms(&mut self, num_sms: u32) -> Option<u32> {
        self.inner.normal().map(|b| b.launch_sms(num_sms))
    }

    /// The direct dispatch's receive pool (`MOELINK_INTRANODE_RECV=direct`):
    /// (base, length, bytes held by leases, dispatches written into recv_x
    /// directly, dispatches that copied it, combines, combines whose x lay in
    /// the pool and was read there by the peers), or None without one.
    fn recv_pool_stats(&self) -> Option<(u64, u64, u64, u64, u64, u64, u64)> {
        let s = self.inner.intranode()?.recv_pool_stats()?;
        Some((
            s.base,
            s.len,
            s.used,
            s.direct_calls,
            s.copied_calls,
            s.combine_calls,
            s.combines_read,
        ))
    }

    /// Direct dispatch: reserves the receive pool range of the next
    /// dispatch's recv_x, `rows` rows of `hidden_bytes` (None: as many as the
    /// buffer can receive for records of this shape, for a dispatch whose
    /// count comes later), published at its send; False without a pool or
    /// when the pool cannot hold them (that recv_x is then received by a copy).
    #[pyo3(signature = (hidden_bytes, num_scales, num_topk, rows=None))]
    fn recv_pool_reserve(
        &mut self,
        hidden_bytes: usize,
        num_scales: usize,
        num_topk: usize,
        rows: Option<usize>,
    ) -> PyResult<bool> {
        let b = self.intranode()?;
        let rows = match rows {
            Some(r) => r,
            None => b
                .max_recv_rows(hidden_bytes, num_scales, num_topk)
                .map_err(to_py)?,
        };
        Ok(b.recv_pool_reserve((rows * hidden_bytes) as u64))
    }

    /// Direct dispatch: the range reserved by `recv_pool_reserve`, cut to
    /// `nbytes`, as a DLPack capsule of a 1-D uint8 CUDA tensor (the range
    /// returns to the pool when torch frees it); None when nothing was
    /// reserved or `nbytes` is 0.
    fn recv_pool_take(&mut self, py: Python<'_>, nbytes: u64) -> PyResult<Option<Py<PyAny>>> {
        let b = self.intranode()?;
        let device = b.base().device().ordinal;
        match b.recv_pool_take(nbytes) {
            Some(lease) => crate::dlpack::bytes_capsule(py, lease, device).map(Some),
            None => Ok(None),
        }
    }

    /// `nbytes` of the direct dispatch's receive pool as a DLPack capsule of
    /// a 1-D uint8 CUDA tensor (the range returns to the pool when torch frees
    /// the tensor), or None without a pool, for 0 bytes, or when the pool
    /// cannot serve them.
    fn recv_pool_tensor(&self, py: Python<'_>, nbytes: usize) -> PyResult<Option<Py<PyAny>>> {
        let Some(b) = self.inner.intranode() else {
            return Ok(None);
        };
        if nbytes == 0 {
            return Ok(None);
        }
        let Some(lease) = b.recv_pool_lease(nbytes as u64) else {
            return Ok(None);
        };
        crate::dlpack::bytes_capsule(py, lease, b.base().device().ordinal).map(Some)
    }

    /// (triggers popped, [per peer: (triggers of its channel performed, copies
    /// in flight or None, ms since its latest trigger or None, longest ms an
    /// operation took to complete (0 where the transport cannot tell)) or None]) of
    /// the proxy, or None where peers are reached over NVLink (diagnostics).
    #[allow(clippy::type_complexity)]
    fn proxy_progress(
        &self,
    ) -> PyResult<Option<(u64, Vec<Option<(u64, Option<bool>, Option<u64>, u64)>>)>> {
        Ok(self.ll()?.proxy_progress().map(|(tail, peers)| {
            let peers = peers
                .into_iter()
                .map(|p| p.map(|c| (c.handled, c.busy, c.idle_ms, c.max_flight_ms)))
                .collect();
            (tail, peers)
        }))
    }

    /// Launches `phases_` (1 send, 2 receive, 3 both) of a low-latency
    /// dispatch of `plan` on `stream` ([`Self::launch_ll`]).
    fn ll_dispatch(
        &self,
        py: Python<'_>,
        stream: usize,
        plan: PyRef<'_, LlDispatchPlan>,
        tensors: LlDispatchTensors,
        phases_: u8,
    ) -> PyResult<Option<Py<PyAny>>> {
        let call = ll_dispatch_call(&plan.0, tensors);
        self.launch_ll(py, stream, &LlCall::Dispatch(call), phases(phases_)?)
    }

    /// Launches `phases_` of a low-latency combine of `plan` on `stream`
    /// ([`Self::launch_ll`]).
    fn ll_combine(
        &self,
        py: Python<'_>,
        stream: usize,
        plan: PyRef<'_, LlCombinePlan>,
        tensors: LlCombineTensors,
        phases_: u8,
    ) -> PyResult<Option<Py<PyAny>>> {
        let (x, layout_range, topk_idx, topk_weights, out, stats_wait) = tensors;
        let p = &plan.0;
        let call =
            CombineCall::planned(p, x, layout_range, topk_idx, topk_weights, out, stats_wait);
        self.launch_ll(py, stream, &LlCall::Combine(call), phases(phases_)?)
    }

    /// *Collective.* Resets the low-latency flags and call counters
    /// (device-synchronous). With shrink, masked ranks are not waited for and
    /// a rank that does not come within the device-wait bound is masked.
    fn clean(&self, py: Python<'_>) -> PyResult<()> {
        let ll = self.ll()?;
        py.detach(|| ll.clean()).map_err(to_py)
    }
}
