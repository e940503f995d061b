//! Every call's argument checks, as the Buffer and AllReduce run them before
//! anything is allocated or launched, usable without a GPU (the CPU tests
//! call them on CPU tensors). The EP calls' checks and output shapes are
//! `ep_core::calls`' (the Python Buffer's, through `moelink._native`): this
//! module only describes tch tensors to them ([`crate::tensor::meta`]) and adds
//! what the Python layer adds (a row tensor's 16-byte alignment). The
//! AllReduce checks are `ep_core::calls::all_reduce` and `all_gather` (the
//! Python `check_all_reduce_args` and `check_all_gather_args` run them too;
//! the communicator of crate `collectives` checks the rest: dtype/op
//! combinations, algorithms and launch geometry).
//!
//! Also here: the internode handle's entries ([`internode_handle`], the
//! Python Buffer's `_x_handle`), a call's stream arguments ([`stream_args`], [`ll_stream_args`],
//! the Python Buffer's `_prologue` and `_ll_begin`), and the host-side
//! expert-id check ([`topk_values`], Python's `check_topk_values`) with its
//! switch ([`set_check_ids`], `MOELINK_CHECK_IDS=1`).

use collectives::DType as ArDType;
use ep_core::calls::{self, CombinePlan, DispatchPlan, LayoutPlan, LlCombinePlan, LlDispatchPlan};
use ep_core::ll_hooks::HookBook;
use tch::{Device, Kind, Tensor};

use crate::args::{
    Bias, DispatchArgs, DispatchX, Handle, LlCombineOptions, LlDispatchOptions, LlHandle,
};
use crate::engine::{CombineArgsOf, DispatchArgsOf};
use crate::error::{Error, Result};
use crate::event::StreamArgs;
use crate::tensor::{device_index, dtype_of, meta, opt_meta};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// Kernels read and write rows with 16-byte vector accesses.
const ALIGN: u64 = 16;

/// What a Buffer's calls are checked against: its group size and device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Target {
    pub num_ranks: i64,
    pub device: Device,
}

impl Target {
    pub fn new(num_ranks: usize, device: Device) -> Self {
        Self {
            num_ranks: num_ranks as i64,
            device,
        }
    }

    fn dev(&self) -> i32 {
        device_index(self.device)
    }
}

/// `buffer._check_aligned`: a row tensor starts on a 16-byte boundary.
fn check_aligned(name: &str, t: &Tensor) -> Result<()> {
    if t.defined() && t.numel() > 0 && (t.data_ptr() as u64) % ALIGN != 0 {
        return Err(Error::value(format!(
            "{name} must start on a {ALIGN}-byte boundary (it is a view at an odd offset)"
        )));
    }
    Ok(())
}

/// `get_dispatch_layout(topk_idx, num_experts)`.
pub fn layout(t: &Target, topk_idx: &Tensor, num_experts: i64) -> Result<LayoutPlan> {
    Ok(calls::layout(
        t.num_ranks,
        t.dev(),
        &meta(topk_idx),
        num_experts,
    )?)
}

/// `dispatch(x, ...)` without a handle.
pub fn dispatch(t: &Target, x: DispatchX<'_>, a: &DispatchArgs<'_>) -> Result<DispatchPlan> {
    dispatch_plan(t, x, None, Some(a))
}

/// `dispatch(x, handle=handle)`: a cached dispatch.
pub fn dispatch_cached(t: &Target, x: DispatchX<'_>, handle: &Handle) -> Result<DispatchPlan> {
    dispatch_plan(t, x, Some(handle), None)
}

/// `dispatch` with `handle` (cached) or the arguments `a` (absent ones None),
/// on the tensors as ep-core's engine takes them ([`DispatchArgsOf`]).
fn dispatch_plan(
    t: &Target,
    x: DispatchX<'_>,
    handle: Option<&Handle>,
    a: Option<&DispatchArgs<'_>>,
) -> Result<DispatchPlan> {
    let args = DispatchArgsOf::new(x, handle, a);
    let p = calls::dispatch(t.num_ranks, t.dev(), &args.tensors())?;
    check_aligned("x", x.parts().0)?;
    Ok(p)
}

/// `combine(x, handle, topk_weights, bias)`, on the tensors as ep-core's
/// engine takes them ([`CombineArgsOf`]).
pub fn combine(
    t: &Target,
    x: &Tensor,
    handle: &Handle,
    topk_weights: Option<&Tensor>,
    bias: Bias<'_>,
) -> Result<CombinePlan> {
    let args = CombineArgsOf::new(x, handle, topk_weights, bias);
    let p = calls::combine(t.num_ranks, t.dev(), &args.tensors())?;
    let (b0, b1) = bias.pair();
    for (name, t) in [("x", Some(x)), ("bias[0]", b0), ("bias[1]", b1)] {
        if let Some(t) = t {
            check_aligned(name, t)?;
        }
    }
    Ok(p)
}

/// A device as torch names it (`cuda:0`, `cpu`).
fn device_name(d: Device) -> String {
    match d {
        Device::Cuda(i) => format!("cuda:{i}"),
        Device::Cpu => "cpu".into(),
        d => format!("{d:?}"),
    }
}

/// The handle of a cached dispatch or a combine on rank `rank` of a Buffer
/// whose group spans `nodes` (`(nodes, ranks per node)`, as
/// [`Buffer::nodes`](crate::Buffer::nodes); None within one node), after
/// [`dispatch_cached`] / [`combine`] checked its intranode entries: the
/// Python Buffer's `_x_handle`. Within one node `handle.internode` must be
/// None; across nodes it must be there, with the node heads, counts and
/// forwarding records a dispatch of this Buffer made (contiguous int32 on
/// the Buffer's device, their shapes for `send_head`'s tokens): a
/// `ValueError` naming the entry otherwise (a `TypeError` for an undefined
/// tensor).
pub fn internode_handle(
    t: &Target,
    rank: usize,
    nodes: Option<(usize, usize)>,
    handle: &Handle,
) -> Result<()> {
    let (x, (num_nodes, per_node)) = match (&handle.internode, nodes) {
        (None, None) => return Ok(()),
        (Some(_), None) => {
            return Err(Error::value(format!(
                "rank {rank}: handle.internode is set (an internode dispatch's handle); a \
                 Buffer within one node takes the handle of an intranode dispatch"
            )))
        }
        (None, Some((n, _))) => {
            return Err(Error::value(format!(
                "rank {rank}: handle.internode is None; a Buffer whose group spans {n} nodes \
                 takes the handle of an internode dispatch"
            )))
        }
        (Some(x), Some(n)) => (x, n),
    };
    let n = handle.send_head.size().first().copied().unwrap_or(0);
    let (nodes_i, per_node_i) = (num_nodes as i64, per_node as i64);
    let entries: [(&str, &Tensor, Option<Vec<i64>>); 3] = [
        ("node_head", &x.node_head, Some(vec![n, nodes_i])),
        ("xcounts", &x.xcounts, Some(vec![2 * nodes_i])),
        ("fwd_meta", &x.fwd_meta, None),
    ];
    for (field, tensor, want) in entries {
        let name = format!("handle.internode.{field}");
        defined(&name, tensor)?;
        let m = meta(tensor);
        if tensor.kind() != Kind::Int || tensor.device() != t.device || !m.is_contiguous() {
            return Err(Error::value(format!(
                "rank {rank}: {name} must be a contiguous int32 tensor on {}, got {} on {}",
                device_name(t.device),
                dtype_of(tensor.kind()),
                device_name(tensor.device())
            )));
        }
        let shape = tensor.size();
        let ok = match want {
            Some(w) => shape == w,
            None => shape.len() == 3 && shape[0] == nodes_i && shape[2] == 1 + per_node_i,
        };
        if !ok {
            return Err(Error::value(format!(
                "rank {rank}: {name} has shape {shape:?}: not the one this Buffer's dispatch \
                 made ({num_nodes} nodes of {per_node} ranks, {n} tokens)"
            )));
        }
    }
    Ok(())
}

/// `low_latency_dispatch(x, topk_idx, T, E, ...)` (whether the Buffer's
/// low-latency memory holds the shape is the Buffer's check).
pub fn ll_dispatch(
    t: &Target,
    x: &Tensor,
    topk_idx: &Tensor,
    num_max_dispatch_tokens_per_rank: i64,
    num_experts: i64,
    o: &LlDispatchOptions<'_>,
) -> Result<LlDispatchPlan> {
    let (x_m, idx_m) = (meta(x), meta(topk_idx));
    let count_m = opt_meta(o.cumulative_local_expert_recv_stats);
    let wait_m = opt_meta(o.dispatch_wait_recv_cost_stats);
    Ok(calls::ll_dispatch(
        t.num_ranks,
        t.dev(),
        &calls::LlDispatchArgs {
            x: &x_m,
            topk_idx: &idx_m,
            num_max_dispatch_tokens_per_rank,
            num_experts,
            cumulative_local_expert_recv_stats: count_m.as_ref(),
            dispatch_wait_recv_cost_stats: wait_m.as_ref(),
            use_fp8: o.use_fp8,
            round_scale: o.round_scale,
            use_ue8m0: o.use_ue8m0,
        },
    )?)
}

/// `low_latency_combine(x, topk_idx, topk_weights, handle, ...)`.
pub fn ll_combine(
    t: &Target,
    x: &Tensor,
    topk_idx: &Tensor,
    topk_weights: &Tensor,
    handle: &LlHandle,
    o: &LlCombineOptions<'_>,
) -> Result<LlCombinePlan> {
    let (x_m, idx_m, w_m, h) = (meta(x), meta(topk_idx), meta(topk_weights), handle.metas());
    let (out_m, stats_m) = (opt_meta(o.out), opt_meta(o.combine_wait_recv_cost_stats));
    Ok(calls::ll_combine(
        t.num_ranks,
        t.dev(),
        &calls::LlCombineArgs {
            x: (!o.zero_copy).then_some(&x_m),
            topk_idx: &idx_m,
            topk_weights: &w_m,
            handle: &h,
            use_logfmt: o.use_logfmt,
            zero_copy: o.zero_copy,
            out: out_m.as_ref(),
            combine_wait_recv_cost_stats: stats_m.as_ref(),
        },
    )?)
}

// ----- allreduce ------------------------------------------------------------------

/// The allreduce element type of a tch kind (`ep_core::calls::ALL_REDUCE_DTYPES`,
/// what `moelink.allreduce` accepts).
pub fn allreduce_dtype(kind: Kind) -> Option<ArDType> {
    let dtype = dtype_of(kind);
    let (_, name) = calls::ALL_REDUCE_DTYPES.iter().find(|(d, _)| *d == dtype)?;
    ArDType::parse(name).ok()
}

/// `t` (called `name`) is a tensor: tch can hold an undefined one, which
/// Python cannot (its `TypeError` for a non-tensor).
fn defined(name: &str, t: &Tensor) -> Result<()> {
    if !t.defined() {
        return Err(Error::type_error(format!(
            "{name} must be a torch.Tensor, got an undefined tensor"
        )));
    }
    Ok(())
}

/// A byte count as the core's checks take it.
fn max_bytes_i64(max_bytes: usize) -> i64 {
    i64::try_from(max_bytes).unwrap_or(i64::MAX)
}

/// `check_all_reduce_args`' tensor checks (`ep_core::calls::all_reduce`):
/// `tensor` of a supported dtype, on `device`, contiguous, at most
/// `max_bytes` (the communicator's); `out` likewise, of the same dtype and
/// size. Returns the kernel dtype. (The dtype/op/accumulation combination is
/// the communicator's check.)
pub fn all_reduce(
    tensor: &Tensor,
    out: Option<&Tensor>,
    device: Device,
    max_bytes: usize,
) -> Result<ArDType> {
    defined("tensor", tensor)?;
    if let Some(out) = out {
        defined("out", out)?;
    }
    let p = calls::all_reduce(
        device_index(device),
        &meta(tensor),
        opt_meta(out).as_ref(),
        max_bytes_i64(max_bytes),
    )?;
    Ok(ArDType::parse(p.dtype)?)
}

/// `check_all_gather_args`' tensor checks (`ep_core::calls::all_gather`):
/// `out` and `inp` on `device`, contiguous, of one dtype, `out` holding
/// `world_size` times `inp`, at most `max_bytes`. Returns the bytes per rank.
pub fn all_gather(
    out: &Tensor,
    inp: &Tensor,
    world_size: usize,
    device: Device,
    max_bytes: usize,
) -> Result<u64> {
    defined("out", out)?;
    defined("inp", inp)?;
    let p = calls::all_gather(
        device_index(device),
        &meta(out),
        &meta(inp),
        inp.kind().elt_size_in_bytes() as i64,
        world_size as i64,
        max_bytes_i64(max_bytes),
    )?;
    Ok(p.nbytes as u64)
}

// ----- stream arguments ---------------------------------------------------------

/// The stream arguments of a normal-mode call (the Python Buffer's
/// `_prologue`, ep-core's `engine::StreamArgs::check`):
/// `allocate_on_comm_stream` needs `previous_event` and `async_finish` (a
/// `ValueError` otherwise).
pub fn stream_args(s: &StreamArgs<'_>) -> Result<()> {
    Ok(s.engine().check()?)
}

/// A low-latency call's `async_finish` and `return_recv_hook` (the Python
/// `_ll_begin`): not both (a `ValueError`).
pub fn ll_stream_args(async_finish: bool, return_recv_hook: bool) -> Result<()> {
    // A book without pending hooks checks only the arguments.
    Ok(HookBook::new().begin(async_finish, return_recv_hook)?)
}

// ----- the host-side expert-id check ------------------------------------------------

fn check_ids_flag() -> &'static AtomicBool {
    static FLAG: OnceLock<AtomicBool> = OnceLock::new();
    FLAG.get_or_init(|| {
        AtomicBool::new(comm::env::var("MOELINK_CHECK_IDS").is_some_and(|v| v == "1"))
    })
}

/// Turns the host-side expert-id check on or off (Python's
/// `moelink._buffer_common.set_check_ids`); returns the previous setting.
/// Its initial setting is `MOELINK_CHECK_IDS=1` in the environment when a
/// process first asks (Python reads it at import).
pub fn set_check_ids(enabled: bool) -> bool {
    check_ids_flag().swap(enabled, Ordering::Relaxed)
}

/// Whether the host-side expert-id check is on ([`set_check_ids`]). The
/// Buffer runs it only outside CUDA-graph capture: a debug switch, it costs
/// a device sync per call. The kernels check every id anyway (the call, or
/// the next one, or `check()`, raises the `ValueError` naming the rank,
/// token and column).
pub fn check_ids() -> bool {
    check_ids_flag().load(Ordering::Relaxed)
}

/// Every id of the int64 tensor `topk_idx` is in `[-1, num_experts)`
/// (Python's `check_topk_values`: one min/max reduction, whose read waits for
/// the device): a `ValueError` naming the first offending value and its
/// position otherwise.
pub fn topk_values(topk_idx: &Tensor, num_experts: i64) -> Result<()> {
    if !topk_idx.defined() || topk_idx.numel() == 0 {
        return Ok(());
    }
    let (lo, hi) = topk_idx.f_aminmax(None::<i64>, false)?;
    let (lo, hi) = (lo.f_int64_value(&[])?, hi.f_int64_value(&[])?);
    let bad = if lo < -1 {
        lo
    } else if hi >= num_experts {
        hi
    } else {
        return Ok(());
    };
    let at = topk_idx
        .f_eq(bad)?
        .f_nonzero()?
        .f_get(0)?
        .f_to_device(Device::Cpu)?;
    let at: Vec<i64> = Vec::try_from(&at)?;
    let at: Vec<String> = at.iter().map(i64::to_string).collect();
    Err(Error::value(format!(
        "topk_idx values must be in [-1, num_experts={num_experts}), got {bad} at [{}]",
        at.join(", ")
    )))
}
