//! Every call's argument checks, as the Buffer and AllReduce run them before
//! anything is allocated or launched, usable without a GPU (the CPU tests
//! call them on CPU tensors). The EP calls' checks and output shapes are
//! `ep_core::calls`' (the Python Buffer's, through `moelink._native`): this
//! module only describes tch tensors to them ([`crate::tensor::meta`]) and adds
//! what the Python layer adds (a row tensor's 16-byte alignment). The
//! AllReduce checks are `moelink.allreduce.check_all_reduce_args` and
//! `check_all_gather_args` (the Python layer's; the communicator of crate
//! `collectives` checks the rest: sizes, dtype/op combinations, algorithms
//! and launch geometry).

use collectives::DType as ArDType;
use ep_core::calls::{
    self, Bias as CoreBias, CombinePlan, DispatchPlan, LayoutPlan, LlCombinePlan, LlDispatchPlan,
};
use tch::{Device, Kind, Tensor};

use crate::buffer::{
    Bias, DispatchArgs, DispatchX, Handle, LlCombineOptions, LlDispatchOptions, LlHandle,
};
use crate::error::{Error, Result};
use crate::tensor::{device_index, dtype_of, meta, opt_meta};

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

/// `dispatch` with `handle` (cached) or the arguments `a` (absent ones None).
fn dispatch_plan(
    t: &Target,
    x: DispatchX<'_>,
    handle: Option<&Handle>,
    a: Option<&DispatchArgs<'_>>,
) -> Result<DispatchPlan> {
    let (data, scales) = x.parts();
    let (data_m, scales_m) = (meta(data), opt_meta(scales));
    let h = handle.map(Handle::metas);
    let per_rank = opt_meta(a.and_then(|a| a.num_tokens_per_rank));
    let in_rank = opt_meta(a.and_then(|a| a.is_token_in_rank));
    let per_expert = opt_meta(a.and_then(|a| a.num_tokens_per_expert));
    let idx = opt_meta(a.and_then(|a| a.topk_idx));
    let w = opt_meta(a.and_then(|a| a.topk_weights));
    let p = calls::dispatch(
        t.num_ranks,
        t.dev(),
        &calls::DispatchArgs {
            x: &data_m,
            scales: scales_m.as_ref(),
            handle: h.as_ref(),
            num_tokens_per_rank: per_rank.as_ref(),
            num_tokens_per_rdma_rank: false,
            is_token_in_rank: in_rank.as_ref(),
            num_tokens_per_expert: per_expert.as_ref(),
            topk_idx: idx.as_ref(),
            topk_weights: w.as_ref(),
            expert_alignment: a.map_or(1, |a| a.expert_alignment),
            num_worst_tokens: a.map_or(0, |a| a.num_worst_tokens),
        },
    )?;
    check_aligned("x", data)?;
    Ok(p)
}

/// `bias` as a pair (None, None for no bias).
pub(crate) fn bias_pair<'a>(bias: Bias<'a>) -> (Option<&'a Tensor>, Option<&'a Tensor>) {
    match bias {
        Bias::None => (None, None),
        Bias::One(b) => (Some(b), None),
        Bias::Pair(b0, b1) => (b0, b1),
    }
}

/// `combine(x, handle, topk_weights, bias)`.
pub fn combine(
    t: &Target,
    x: &Tensor,
    handle: &Handle,
    topk_weights: Option<&Tensor>,
    bias: Bias<'_>,
) -> Result<CombinePlan> {
    let (x_m, h, w_m) = (meta(x), handle.metas(), opt_meta(topk_weights));
    let (b0, b1) = bias_pair(bias);
    let (b0_m, b1_m) = (opt_meta(b0), opt_meta(b1));
    let core_bias = match bias {
        Bias::None => None,
        Bias::One(_) => b0_m.as_ref().map(CoreBias::One),
        // A pair of None is no bias.
        Bias::Pair(..) => {
            (b0.is_some() || b1.is_some()).then_some(CoreBias::Pair(b0_m.as_ref(), b1_m.as_ref()))
        }
    };
    let p = calls::combine(
        t.num_ranks,
        t.dev(),
        &calls::CombineArgs {
            x: &x_m,
            handle: &h,
            topk_weights: w_m.as_ref(),
            bias: core_bias,
        },
    )?;
    for (name, t) in [("x", Some(x)), ("bias[0]", b0), ("bias[1]", b1)] {
        if let Some(t) = t {
            check_aligned(name, t)?;
        }
    }
    Ok(p)
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

/// The allreduce element type of a tch kind (`moelink.allreduce.DTYPES`).
pub fn allreduce_dtype(kind: Kind) -> Option<ArDType> {
    Some(match kind {
        Kind::BFloat16 => ArDType::Bf16,
        Kind::Half => ArDType::Fp16,
        Kind::Float => ArDType::Fp32,
        Kind::Int => ArDType::Int32,
        Kind::Float8e4m3fn => ArDType::Fp8E4m3,
        Kind::Float8e5m2 => ArDType::Fp8E5m2,
        _ => return None,
    })
}

/// A device as torch prints it (`cuda:0`, `cpu`).
fn device_str(d: Device) -> String {
    match d {
        Device::Cuda(i) => format!("cuda:{i}"),
        Device::Cpu => "cpu".into(),
        Device::Mps => "mps".into(),
        Device::Vulkan => "vulkan".into(),
    }
}

/// `allreduce._check_tensor`: on the communicator's device, contiguous.
fn ar_tensor(name: &str, t: &Tensor, device: Device) -> Result<()> {
    if !t.defined() {
        return Err(Error::type_error(format!(
            "{name} must be a torch.Tensor, got an undefined tensor"
        )));
    }
    if t.device() != device {
        return Err(Error::value(format!(
            "{name} is on {}, but this communicator runs on {}",
            device_str(t.device()),
            device_str(device)
        )));
    }
    if !t.is_contiguous() {
        return Err(Error::value(format!(
            "{name} must be contiguous (got strides {})",
            py_tuple(&t.stride())
        )));
    }
    Ok(())
}

/// Integers as Python prints a tuple of them.
fn py_tuple(v: &[i64]) -> String {
    match v {
        [one] => format!("({one},)"),
        _ => format!(
            "({})",
            v.iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// `check_all_reduce_args`' tensor checks (the Python layer's): `tensor` of
/// a supported dtype, on `device`, contiguous; `out` likewise, of the same
/// dtype and size. Returns the kernel dtype. (The bytes against `max_bytes`
/// and the dtype/op/accumulation combination are the communicator's checks.)
pub fn all_reduce(tensor: &Tensor, out: Option<&Tensor>, device: Device) -> Result<ArDType> {
    if !tensor.defined() {
        return Err(Error::type_error(
            "tensor must be a torch.Tensor, got an undefined tensor",
        ));
    }
    let dtype = allreduce_dtype(tensor.kind()).ok_or_else(|| {
        let supported = [
            Kind::BFloat16,
            Kind::Half,
            Kind::Float,
            Kind::Int,
            Kind::Float8e4m3fn,
            Kind::Float8e5m2,
        ]
        .map(|k| dtype_of(k).to_string())
        .join(", ");
        Error::type_error(format!(
            "tensor dtype {} is not supported; supported: {supported}",
            dtype_of(tensor.kind())
        ))
    })?;
    ar_tensor("tensor", tensor, device)?;
    if let Some(out) = out {
        ar_tensor("out", out, device)?;
        if out.kind() != tensor.kind() {
            return Err(Error::type_error(format!(
                "out has dtype {}, tensor {}",
                dtype_of(out.kind()),
                dtype_of(tensor.kind())
            )));
        }
        if out.numel() != tensor.numel() {
            return Err(Error::value(format!(
                "out has {} elements, tensor {}",
                out.numel(),
                tensor.numel()
            )));
        }
    }
    Ok(dtype)
}

/// `check_all_gather_args`' tensor checks: `out` and `inp` on `device`,
/// contiguous, of one dtype, `out` holding `world_size` times `inp`. Returns
/// the bytes per rank.
pub fn all_gather(out: &Tensor, inp: &Tensor, world_size: usize, device: Device) -> Result<u64> {
    ar_tensor("out", out, device)?;
    ar_tensor("inp", inp, device)?;
    if out.kind() != inp.kind() {
        return Err(Error::type_error(format!(
            "out has dtype {}, inp {}",
            dtype_of(out.kind()),
            dtype_of(inp.kind())
        )));
    }
    if out.numel() != world_size * inp.numel() {
        return Err(Error::value(format!(
            "out must hold world_size * inp.numel() = {world_size} * {} elements, it holds {}",
            inp.numel(),
            out.numel()
        )));
    }
    Ok((inp.numel() * inp.kind().elt_size_in_bytes()) as u64)
}
