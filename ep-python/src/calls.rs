//! The argument checks and output shapes of the EP calls (`ep_core::calls`):
//! one `*_plan` function per call, which the Python `Buffer` runs when a call's
//! arguments miss its plan cache; the checks of the Buffer's constructor
//! (`buffer_options_plan`) and of a `Config`'s SMs (`check_num_sms`); the
//! NVLink size hints and record sizes of `moelink.config`; the tensor checks
//! of `moelink.AllReduce`'s calls (`all_reduce_plan`, `all_gather_plan`,
//! `all_reduce_register_plan`).
//!
//! A tensor crosses as its meta `(dtype name, shape, strides, device index)`
//! (`moelink.checks.tensor_meta`), an absent one as None, an intranode handle
//! as the metas of its entries 0, 3, 4 and 5, a low-latency handle as
//! `(meta, meta, T, H, E)`. The plans of layout, dispatch and combine come
//! back as frozen objects ([`LayoutPlan`], [`DispatchPlan`], [`CombinePlan`])
//! holding ep-core's plan, which `EpBuffer.layout`, `dispatch_send`,
//! `dispatch_recv`, `wait_counts` and `combine` take for their sizes, and so
//! do those of the low-latency dispatch and combine ([`LlDispatchPlan`],
//! [`LlCombinePlan`]; `EpBuffer.ll_dispatch`, `ll_combine`); every other plan
//! as a dict of its values. Both give `outputs`, a list of `(name, dtype name,
//! shape, strides, zeroed)` in allocation order. A refusal raises through
//! `crate::error::arg_to_py`.

use ep_core::calls::{
    self, ArgError, Bias, BufferArgs, CombineArgs, DType, DispatchArgs, IntranodeHandle,
    LlCombineArgs, LlDispatchArgs, LlGeometry, LlHandle, OutputSpec, TensorMeta,
};
use pyo3::exceptions::{PyOverflowError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::error::arg_to_py;

/// A tensor argument: `(dtype name, shape, strides, device index)`.
#[derive(FromPyObject)]
pub struct Meta(String, Vec<i64>, Vec<i64>, i32);

impl From<Meta> for TensorMeta {
    fn from(Meta(dtype, shape, strides, device): Meta) -> Self {
        TensorMeta {
            dtype: DType::from_torch_name(&dtype),
            shape,
            strides,
            device,
        }
    }
}

fn meta(m: Option<Meta>) -> Option<TensorMeta> {
    m.map(TensorMeta::from)
}

/// A Python int as i64, saturated: a value beyond i64 is far beyond every
/// limit, and is refused as `i64::MAX` / `i64::MIN` instead of overflowing.
/// The second field is the value as Python prints it where it was saturated
/// ([`as_given`] puts it back into a refusal's message).
pub struct Int(i64, Option<String>);

impl<'a, 'py> FromPyObject<'a, 'py> for Int {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        match obj.extract::<i64>() {
            Ok(v) => Ok(Int(v, None)),
            Err(e) if e.is_instance_of::<PyOverflowError>(obj.py()) => {
                let v = if obj.gt(0)? { i64::MAX } else { i64::MIN };
                Ok(Int(v, Some(obj.str()?.to_string())))
            }
            Err(e) => Err(e),
        }
    }
}

/// The mapping of a refusal ([`arg_to_py`]) whose message shows the values of
/// `ints` as given, not as saturated.
fn as_given<'a>(ints: &'a [&'a Int]) -> impl Fn(ArgError) -> PyErr + 'a {
    move |mut e| {
        for Int(v, given) in ints {
            if let Some(given) = given {
                e.message = e.message.replace(&v.to_string(), given);
            }
        }
        arg_to_py(e)
    }
}

/// A byte count (`num_nvl_bytes`, ...): an int of 64 bits. One beyond is
/// refused here, naming `name` (saturated, a multiple of 128 would be
/// refused for the wrong reason).
fn byte_count(name: &str, n: &Int) -> PyResult<i64> {
    match n {
        Int(_, Some(given)) if !given.starts_with('-') => Err(PyValueError::new_err(format!(
            "{name} must be below 2**63 bytes, got {given}"
        ))),
        Int(v, _) => Ok(*v),
    }
}

/// The metas of an intranode handle's entries 0, 3, 4 and 5.
#[derive(FromPyObject)]
pub struct HandleArg(Meta, Meta, Meta, Meta);

impl From<HandleArg> for IntranodeHandle {
    fn from(HandleArg(rpm, recv_src_idx, in_rank, send_head): HandleArg) -> Self {
        IntranodeHandle {
            rank_prefix_matrix: rpm.into(),
            recv_src_idx: recv_src_idx.into(),
            is_token_in_rank: in_rank.into(),
            send_head: send_head.into(),
        }
    }
}

/// A low-latency handle: `(src_info, layout_range, T, H, E)`.
#[derive(FromPyObject)]
pub struct LlHandleArg(Meta, Meta, Int, Int, Int);

impl From<LlHandleArg> for LlHandle {
    fn from(LlHandleArg(src_info, layout_range, t, h, e): LlHandleArg) -> Self {
        LlHandle {
            src_info: src_info.into(),
            layout_range: layout_range.into(),
            num_max_dispatch_tokens_per_rank: t.0,
            hidden: h.0,
            num_experts: e.0,
        }
    }
}

/// `bias` of combine: one meta, or a pair of metas or None.
#[derive(FromPyObject)]
pub enum BiasArg {
    One(Meta),
    Pair(Option<Meta>, Option<Meta>),
}

type Plan<'py> = Bound<'py, PyDict>;

/// An output as Python reads it: `(name, dtype name, shape, strides, zeroed)`.
type OutputArg = (&'static str, String, Vec<i64>, Vec<i64>, bool);

fn output_args(outputs: &[OutputSpec]) -> Vec<OutputArg> {
    outputs
        .iter()
        .map(|o| {
            let (shape, strides) = (o.shape.clone(), o.strides.clone());
            (
                o.name,
                o.dtype.torch_name().to_string(),
                shape,
                strides,
                o.zeroed,
            )
        })
        .collect()
}

/// A plan dict holding `outputs`.
fn plan<'py>(py: Python<'py>, outputs: &[OutputSpec]) -> PyResult<Plan<'py>> {
    let d = PyDict::new(py);
    d.set_item("outputs", output_args(outputs))?;
    Ok(d)
}

/// `get_dispatch_layout`'s plan ([`calls::LayoutPlan`]): `EpBuffer.layout`
/// reads its sizes; Python reads `num_experts` (the host id check of a cached
/// call) and `outputs`.
#[pyclass(frozen, module = "moelink._native")]
pub struct LayoutPlan(pub(crate) calls::LayoutPlan);

/// A dispatch's plan, full or cached ([`calls::DispatchPlan`], made for
/// `num_ranks` ranks): `EpBuffer.dispatch_send`, `dispatch_recv` and
/// `wait_counts` read its sizes, the input scales' strides and the received
/// scales' strides; Python reads what it allocates and reserves by.
#[pyclass(frozen, module = "moelink._native")]
pub struct DispatchPlan {
    pub(crate) plan: calls::DispatchPlan,
    pub(crate) num_ranks: i64,
    /// `recv_x_scales`' strides, [`calls::RECV_ROWS`] where they are the
    /// received rows; `(0, 0)` without scales.
    recv_scale_strides: (i64, i64),
}

impl DispatchPlan {
    fn new(plan: calls::DispatchPlan, num_ranks: i64) -> Self {
        let recv_scale_strides = match calls::output(&plan.outputs, "recv_x_scales") {
            Some(s) => (s.strides[0], s.strides[1]),
            None => (0, 0),
        };
        DispatchPlan {
            plan,
            num_ranks,
            recv_scale_strides,
        }
    }

    /// The strides of `recv_x_scales` with `rows` received rows, as
    /// [`OutputSpec::resolve`] gives them ([`calls::stride_at`]: the strides
    /// the tensor was made with), without its allocations; `(0, 0)` without
    /// scales.
    pub(crate) fn recv_scale_strides(&self, rows: i64) -> (i64, i64) {
        let (s0, s1) = self.recv_scale_strides;
        (calls::stride_at(s0, rows), calls::stride_at(s1, rows))
    }
}

/// `$plan.$field`, or `$plan.$path` where a path is given.
macro_rules! plan_field {
    ($plan:expr, $field:ident) => {
        $plan.$field
    };
    ($plan:expr, $field:ident, $($path:ident).+) => {
        $plan.$($path).+
    };
}

/// A plan class's `#[pymethods]`: a read-only getter for each `field: type`
/// of its ep-core plan (reached by `$plan`), or for each `field: type = path`
/// read at `path` within it (`geometry.hidden`), and `outputs`.
macro_rules! plan_getters {
    ($class:ident, $plan:tt; $($field:ident: $t:ty $(= $($path:ident).+)?),*) => {
        #[pymethods]
        impl $class {
            $(
                #[getter]
                fn $field(&self) -> $t {
                    plan_field!(self.$plan, $field $(, $($path).+)?)
                }
            )*

            #[getter]
            fn outputs(&self) -> Vec<OutputArg> {
                output_args(&self.$plan.outputs)
            }
        }
    };
}

// `scale_strides`: the input scales' strides, which the kernels read
// (`(0, 0)` for bf16).
plan_getters!(DispatchPlan, plan; num_tokens: i64, hidden_bytes: i64, num_scales: i64,
    scale_strides: (i64, i64), num_topk: i64, num_experts: i64, num_worst_tokens: i64,
    num_recv_rows: i64);
plan_getters!(LayoutPlan, 0; num_experts: i64);

/// A combine's plan ([`calls::CombinePlan`]): `EpBuffer.combine` reads its
/// sizes; Python reads `outputs`.
#[pyclass(frozen, module = "moelink._native")]
pub struct CombinePlan(pub(crate) calls::CombinePlan);

plan_getters!(CombinePlan, 0;);

/// A low-latency dispatch's plan ([`calls::LlDispatchPlan`]):
/// `EpBuffer.ll_dispatch` reads every size and flag; Python reads the
/// geometry (the handle's values; `num_experts` for the host id check),
/// `num_tokens` (whether x and topk_idx have an address), `num_topk` (the
/// buffer's shape check), `use_fp8` (the form of recv_x) and `outputs`.
#[pyclass(frozen, module = "moelink._native")]
pub struct LlDispatchPlan(pub(crate) calls::LlDispatchPlan);

plan_getters!(LlDispatchPlan, 0; max_tokens: i64 = geometry.max_tokens,
    hidden: i64 = geometry.hidden, num_experts: i64 = geometry.num_experts, num_tokens: i64,
    num_topk: i64, use_fp8: bool);

/// A low-latency combine's plan ([`calls::LlCombinePlan`]): `EpBuffer.ll_combine`
/// reads every size; Python reads the geometry (the zero-copy buffer's shape;
/// `num_experts` for the host id check), `num_tokens` (whether topk_idx,
/// topk_weights and out have an address) and `outputs`.
#[pyclass(frozen, module = "moelink._native")]
pub struct LlCombinePlan(pub(crate) calls::LlCombinePlan);

plan_getters!(LlCombinePlan, 0; max_tokens: i64 = geometry.max_tokens,
    hidden: i64 = geometry.hidden, num_experts: i64 = geometry.num_experts, num_tokens: i64);

/// `d[name] = p.name` for each field `name` of `p`.
macro_rules! set_fields {
    ($d:expr, $p:expr; $($field:ident),+) => {
        $($d.set_item(stringify!($field), $p.$field)?;)+
    };
}

fn set_geometry(d: &Plan<'_>, g: &LlGeometry) -> PyResult<()> {
    set_fields!(d, g; max_tokens, hidden, num_experts, experts_per_rank);
    Ok(())
}

/// `get_dispatch_layout`.
#[pyfunction]
pub fn layout_plan(
    num_ranks: i64,
    device: i32,
    topk_idx: Meta,
    num_experts: Int,
) -> PyResult<LayoutPlan> {
    let p = calls::layout(num_ranks, device, &topk_idx.into(), num_experts.0).map_err(arg_to_py)?;
    Ok(LayoutPlan(p))
}

/// `dispatch`, full or cached (`handle`); `num_recv_rows` is -1 until the
/// counts arrive.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (num_ranks, device, x, scales, handle, num_tokens_per_rank,
    num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
    expert_alignment, num_worst_tokens))]
pub fn dispatch_plan(
    num_ranks: i64,
    device: i32,
    x: Meta,
    scales: Option<Meta>,
    handle: Option<HandleArg>,
    num_tokens_per_rank: Option<Meta>,
    num_tokens_per_rdma_rank: bool,
    is_token_in_rank: Option<Meta>,
    num_tokens_per_expert: Option<Meta>,
    topk_idx: Option<Meta>,
    topk_weights: Option<Meta>,
    expert_alignment: Int,
    num_worst_tokens: Int,
) -> PyResult<DispatchPlan> {
    let x = TensorMeta::from(x);
    let (scales, handle) = (meta(scales), handle.map(IntranodeHandle::from));
    let (per_rank, in_rank) = (meta(num_tokens_per_rank), meta(is_token_in_rank));
    let per_expert = meta(num_tokens_per_expert);
    let (idx, w) = (meta(topk_idx), meta(topk_weights));
    let a = DispatchArgs {
        x: &x,
        scales: scales.as_ref(),
        handle: handle.as_ref(),
        num_tokens_per_rank: per_rank.as_ref(),
        num_tokens_per_rdma_rank,
        is_token_in_rank: in_rank.as_ref(),
        num_tokens_per_expert: per_expert.as_ref(),
        topk_idx: idx.as_ref(),
        topk_weights: w.as_ref(),
        expert_alignment: expert_alignment.0,
        num_worst_tokens: num_worst_tokens.0,
    };
    let p = calls::dispatch(num_ranks, device, &a).map_err(arg_to_py)?;
    Ok(DispatchPlan::new(p, num_ranks))
}

/// `combine`.
#[pyfunction]
pub fn combine_plan(
    num_ranks: i64,
    device: i32,
    x: Meta,
    handle: HandleArg,
    topk_weights: Option<Meta>,
    bias: Option<BiasArg>,
) -> PyResult<CombinePlan> {
    // A pair of None is no bias.
    let (one, b0, b1) = match bias {
        Some(BiasArg::One(b)) => (Some(TensorMeta::from(b)), None, None),
        Some(BiasArg::Pair(b0, b1)) => (None, meta(b0), meta(b1)),
        None => (None, None, None),
    };
    let pair = (b0.is_some() || b1.is_some()).then_some(Bias::Pair(b0.as_ref(), b1.as_ref()));
    let w = meta(topk_weights);
    let a = CombineArgs {
        x: &x.into(),
        handle: &handle.into(),
        topk_weights: w.as_ref(),
        bias: one.as_ref().map(Bias::One).or(pair),
    };
    let p = calls::combine(num_ranks, device, &a).map_err(arg_to_py)?;
    Ok(CombinePlan(p))
}

/// The `(T, H, E)` of a low-latency call over `num_ranks` ranks (called
/// `ranks_name`): `max_tokens`, `hidden`, `num_experts`, `experts_per_rank`.
#[pyfunction]
pub fn ll_geometry<'py>(
    py: Python<'py>,
    num_ranks: Int,
    max_tokens: Int,
    hidden: Int,
    num_experts: Int,
    ranks_name: &str,
) -> PyResult<Plan<'py>> {
    let g = calls::ll_geometry(
        num_ranks.0,
        ranks_name,
        max_tokens.0,
        hidden.0,
        num_experts.0,
    )
    .map_err(arg_to_py)?;
    let d = PyDict::new(py);
    set_geometry(&d, &g)?;
    Ok(d)
}

/// `low_latency_dispatch`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (num_ranks, device, x, topk_idx, num_max_dispatch_tokens_per_rank,
    num_experts, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
    round_scale, use_ue8m0))]
pub fn ll_dispatch_plan(
    num_ranks: i64,
    device: i32,
    x: Meta,
    topk_idx: Meta,
    num_max_dispatch_tokens_per_rank: Int,
    num_experts: Int,
    cumulative_local_expert_recv_stats: Option<Meta>,
    dispatch_wait_recv_cost_stats: Option<Meta>,
    use_fp8: bool,
    round_scale: bool,
    use_ue8m0: bool,
) -> PyResult<LlDispatchPlan> {
    let (x, idx) = (TensorMeta::from(x), TensorMeta::from(topk_idx));
    let count = meta(cumulative_local_expert_recv_stats);
    let wait = meta(dispatch_wait_recv_cost_stats);
    let a = LlDispatchArgs {
        x: &x,
        topk_idx: &idx,
        num_max_dispatch_tokens_per_rank: num_max_dispatch_tokens_per_rank.0,
        num_experts: num_experts.0,
        cumulative_local_expert_recv_stats: count.as_ref(),
        dispatch_wait_recv_cost_stats: wait.as_ref(),
        use_fp8,
        round_scale,
        use_ue8m0,
    };
    let p = calls::ll_dispatch(num_ranks, device, &a).map_err(arg_to_py)?;
    Ok(LlDispatchPlan(p))
}

/// A low-latency handle: the geometry and `outputs` (the zero-copy combine
/// buffer's view).
#[pyfunction]
pub fn ll_handle_plan<'py>(
    py: Python<'py>,
    num_ranks: i64,
    device: i32,
    handle: LlHandleArg,
) -> PyResult<Plan<'py>> {
    let p = calls::ll_handle(num_ranks, device, &handle.into()).map_err(arg_to_py)?;
    let d = plan(py, &p.outputs)?;
    set_geometry(&d, &p.geometry)?;
    Ok(d)
}

/// `low_latency_combine`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
#[pyo3(signature = (num_ranks, device, x, topk_idx, topk_weights, handle, use_logfmt,
    zero_copy, out, combine_wait_recv_cost_stats))]
pub fn ll_combine_plan(
    num_ranks: i64,
    device: i32,
    x: Option<Meta>,
    topk_idx: Meta,
    topk_weights: Meta,
    handle: LlHandleArg,
    use_logfmt: bool,
    zero_copy: bool,
    out: Option<Meta>,
    combine_wait_recv_cost_stats: Option<Meta>,
) -> PyResult<LlCombinePlan> {
    let (x, idx, w) = (
        meta(x),
        TensorMeta::from(topk_idx),
        TensorMeta::from(topk_weights),
    );
    let (handle, out) = (LlHandle::from(handle), meta(out));
    let stats = meta(combine_wait_recv_cost_stats);
    let a = LlCombineArgs {
        x: x.as_ref(),
        topk_idx: &idx,
        topk_weights: &w,
        handle: &handle,
        use_logfmt,
        zero_copy,
        out: out.as_ref(),
        combine_wait_recv_cost_stats: stats.as_ref(),
    };
    let p = calls::ll_combine(num_ranks, device, &a).map_err(arg_to_py)?;
    Ok(LlCombinePlan(p))
}

// ----- the Buffer's construction, Config ------------------------------------------

/// `moelink.Buffer(...)`'s checks: `num_nvl_bytes`, `num_ll_bytes` (the
/// low-latency part's bytes, 0 for none).
#[pyfunction]
pub fn buffer_options_plan<'py>(
    py: Python<'py>,
    num_nvl_bytes: Int,
    num_rdma_bytes: Int,
    low_latency_mode: bool,
    num_qps_per_rank: Int,
    enable_shrink: bool,
) -> PyResult<Plan<'py>> {
    let a = BufferArgs {
        num_nvl_bytes: byte_count("num_nvl_bytes", &num_nvl_bytes)?,
        num_rdma_bytes: byte_count("num_rdma_bytes", &num_rdma_bytes)?,
        low_latency_mode,
        num_qps_per_rank: num_qps_per_rank.0,
        enable_shrink,
    };
    let given = [&num_nvl_bytes, &num_rdma_bytes, &num_qps_per_rank];
    let p = calls::buffer_options(&a).map_err(as_given(&given))?;
    let d = PyDict::new(py);
    set_fields!(d, p; num_nvl_bytes, num_ll_bytes, num_internode_bytes);
    Ok(d)
}

/// The SMs of intranode dispatch/combine, called `name` (`num_sms` of a
/// `Config`, `new_num_sms` of `Buffer.set_num_sms`).
#[pyfunction]
pub fn check_num_sms(name: &str, num_sms: Int) -> PyResult<i64> {
    calls::num_sms(name, num_sms.0).map_err(as_given(&[&num_sms]))
}

/// The default SMs of an intranode call (`ep_core::calls::default_num_sms`):
/// `call` is "dispatch", "combine" (x sent as records) or "combine_in_pool"
/// (x read where it lies in the receive pool); `num_ranks` the group's size.
#[pyfunction]
pub fn default_num_sms(call: &str, num_ranks: i64) -> PyResult<i64> {
    let call = match call {
        "dispatch" => calls::SmsCall::Dispatch,
        "combine" => calls::SmsCall::Combine,
        "combine_in_pool" => calls::SmsCall::CombineInPool,
        other => {
            return Err(PyValueError::new_err(format!(
                "call must be 'dispatch', 'combine' or 'combine_in_pool', got {other:?}"
            )))
        }
    };
    Ok(calls::default_num_sms(call, num_ranks))
}

/// `Config.get_nvl_buffer_size_hint`.
#[pyfunction]
pub fn nvl_buffer_size_hint(
    hidden_bytes: Int,
    num_ranks: Int,
    max_tokens_per_rank: Int,
) -> PyResult<i64> {
    calls::nvl_buffer_size_hint(hidden_bytes.0, num_ranks.0, max_tokens_per_rank.0)
        .map_err(as_given(&[&hidden_bytes, &num_ranks, &max_tokens_per_rank]))
}

/// `Config.get_rdma_buffer_size_hint`: the internode part's bytes beyond the
/// NVLink hint (0 within one node).
#[pyfunction]
pub fn rdma_buffer_size_hint(
    hidden_bytes: Int,
    num_ranks: Int,
    max_tokens_per_rank: Int,
    ranks_per_node: Int,
) -> PyResult<i64> {
    calls::rdma_buffer_size_hint(
        hidden_bytes.0,
        num_ranks.0,
        max_tokens_per_rank.0,
        ranks_per_node.0,
    )
    .map_err(as_given(&[
        &hidden_bytes,
        &num_ranks,
        &max_tokens_per_rank,
        &ranks_per_node,
    ]))
}

/// `moelink.config.token_record_bytes` (`num_scales` None: `hidden_bytes // 128`).
#[pyfunction]
#[pyo3(signature = (hidden_bytes, num_topk, num_scales=None))]
pub fn token_record_bytes(
    hidden_bytes: Int,
    num_topk: Int,
    num_scales: Option<Int>,
) -> PyResult<i64> {
    let scales = num_scales.as_ref().map(|s| s.0);
    let none = Int(0, None);
    let given = [
        &hidden_bytes,
        &num_topk,
        num_scales.as_ref().unwrap_or(&none),
    ];
    calls::token_record_bytes(hidden_bytes.0, num_topk.0, scales).map_err(as_given(&given))
}

/// `moelink.config.combine_record_bytes`.
#[pyfunction]
pub fn combine_record_bytes(hidden_bytes: Int, num_topk: Int) -> PyResult<i64> {
    calls::combine_record_bytes(hidden_bytes.0, num_topk.0)
        .map_err(as_given(&[&hidden_bytes, &num_topk]))
}

// ----- AllReduce ----------------------------------------------------------------------

/// `AllReduce.all_reduce`'s tensor checks on a communicator of `device`:
/// `dtype` (the kernels' name), `count`, `nbytes`.
#[pyfunction]
pub fn all_reduce_plan<'py>(
    py: Python<'py>,
    device: i32,
    tensor: Meta,
    out: Option<Meta>,
    max_bytes: i64,
) -> PyResult<Plan<'py>> {
    let (tensor, out) = (TensorMeta::from(tensor), meta(out));
    let p = calls::all_reduce(device, &tensor, out.as_ref(), max_bytes).map_err(arg_to_py)?;
    let d = PyDict::new(py);
    set_fields!(d, p; dtype, count, nbytes);
    Ok(d)
}

/// `AllReduce.all_gather`'s tensor checks: `nbytes` (per rank).
#[pyfunction]
pub fn all_gather_plan<'py>(
    py: Python<'py>,
    device: i32,
    out: Meta,
    inp: Meta,
    element_size: i64,
    world_size: i64,
    max_bytes: i64,
) -> PyResult<Plan<'py>> {
    let (out, inp) = (TensorMeta::from(out), TensorMeta::from(inp));
    let p = calls::all_gather(device, &out, &inp, element_size, world_size, max_bytes)
        .map_err(arg_to_py)?;
    let d = PyDict::new(py);
    set_fields!(d, p; nbytes);
    Ok(d)
}

/// `AllReduce.register`'s tensor check: the tensor's bytes.
#[pyfunction]
pub fn all_reduce_register_plan(device: i32, tensor: Meta, element_size: i64) -> PyResult<i64> {
    calls::all_reduce_register(device, &tensor.into(), element_size).map_err(arg_to_py)
}

/// Adds the plans and the constants of their encoding (`RECV_ROWS`,
/// `CPU_DEVICE`, `OTHER_DEVICE`) and of the NVLink size hint
/// (`NVL_COUNTER_BYTES`, `COMBINE_RECORD_TOPK`) to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("RECV_ROWS", calls::RECV_ROWS)?;
    m.add("CPU_DEVICE", calls::CPU)?;
    m.add("OTHER_DEVICE", calls::OTHER_DEVICE)?;
    m.add("NVL_COUNTER_BYTES", calls::COUNTER_BYTES)?;
    m.add("COMBINE_RECORD_TOPK", calls::COMBINE_RECORD_TOPK)?;
    m.add_function(wrap_pyfunction!(buffer_options_plan, m)?)?;
    m.add_function(wrap_pyfunction!(check_num_sms, m)?)?;
    m.add_function(wrap_pyfunction!(default_num_sms, m)?)?;
    m.add_function(wrap_pyfunction!(nvl_buffer_size_hint, m)?)?;
    m.add_function(wrap_pyfunction!(rdma_buffer_size_hint, m)?)?;
    m.add_function(wrap_pyfunction!(token_record_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(combine_record_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(all_reduce_plan, m)?)?;
    m.add_function(wrap_pyfunction!(all_gather_plan, m)?)?;
    m.add_function(wrap_pyfunction!(all_reduce_register_plan, m)?)?;
    m.add_class::<LayoutPlan>()?;
    m.add_class::<DispatchPlan>()?;
    m.add_class::<CombinePlan>()?;
    m.add_class::<LlDispatchPlan>()?;
    m.add_class::<LlCombinePlan>()?;
    m.add_function(wrap_pyfunction!(layout_plan, m)?)?;
    m.add_function(wrap_pyfunction!(dispatch_plan, m)?)?;
    m.add_function(wrap_pyfunction!(combine_plan, m)?)?;
    m.add_function(wrap_pyfunction!(ll_geometry, m)?)?;
    m.add_function(wrap_pyfunction!(ll_dispatch_plan, m)?)?;
    m.add_function(wrap_pyfunction!(ll_handle_plan, m)?)?;
    m.add_function(wrap_pyfunction!(ll_combine_plan, m)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use ep_core::calls::{self, DType, DispatchArgs, TensorMeta, ALL_REDUCE_DTYPES};

    use super::DispatchPlan;

    /// The received scales' strides `dispatch_recv` gives the kernels are
    /// those of the `recv_x_scales` Python made (its spec resolved at the
    /// rows), for rows known by the plan or only after the counts.
    #[test]
    fn recv_scale_strides_are_the_resolved_spec() {
        let (r, n, e) = (4, 32, 16);
        let t = |dtype, shape: &[i64]| TensorMeta::contiguous(dtype, shape, 0);
        let x = t(DType::F8E4M3, &[n, 256]);
        let row_major = t(DType::F32, &[n, 2]);
        let col_major = TensorMeta {
            strides: vec![1, n],
            ..row_major.clone()
        };
        let (per_rank, in_rank) = (t(DType::I32, &[r]), t(DType::Bool, &[n, r]));
        let per_expert = t(DType::I32, &[e]);
        let bf16 = t(DType::BF16, &[n, 256]);
        // fp8 with row-major and column-major scales, then bf16 (no scales).
        for (x, scales) in [
            (&x, Some(&row_major)),
            (&x, Some(&col_major)),
            (&bf16, None),
        ] {
            for worst in [0, 64] {
                let a = DispatchArgs {
                    x,
                    scales,
                    handle: None,
                    num_tokens_per_rank: Some(&per_rank),
                    num_tokens_per_rdma_rank: false,
                    is_token_in_rank: Some(&in_rank),
                    num_tokens_per_expert: Some(&per_expert),
                    topk_idx: None,
                    topk_weights: None,
                    expert_alignment: 1,
                    num_worst_tokens: worst,
                };
                let p = calls::dispatch(r, 0, &a).unwrap();
                let spec = calls::output(&p.outputs, "recv_x_scales").cloned();
                let plan = DispatchPlan::new(p, r);
                let rows_of = if worst > 0 {
                    vec![worst]
                } else {
                    vec![0, 1, 5, 64]
                };
                for rows in rows_of {
                    let want = match &spec {
                        Some(spec) => {
                            let s = spec.resolve(rows).strides;
                            (s[0], s[1])
                        }
                        None => (0, 0),
                    };
                    assert_eq!(plan.recv_scale_strides(rows), want);
                }
            }
        }
    }

    /// The kernel dtype names `ep_core::calls::all_reduce` gives are the ones
    /// the communicator parses (ep-core does not depend on `collectives`).
    #[test]
    fn all_reduce_dtype_names_are_the_kernels() {
        for (dtype, name) in &ALL_REDUCE_DTYPES {
            let kernel = collectives::DType::parse(name).unwrap();
            assert_eq!(dtype.element_size(), Some(kernel.size() as i64), "{name}");
        }
        assert_eq!(ALL_REDUCE_DTYPES.len(), collectives::DType::ALL.len());
    }
}
