//! The CPU reference semantics (`ep_reference::normal`,
//! `ep_reference::low_latency`: the oracle of every GPU test) on tch tensors,
//! as `moelink.reference` is in Python: inputs of any device (copied to the
//! CPU), every result a fresh CPU tensor. The semantics, the value checks and
//! their messages are the core's; this module checks only what describing a
//! tensor to it needs (its dtype and rank), with the Python module's messages.

use ep_reference::low_latency::{
    self as rl, LlCombineInput, LlRankInput, LowLatencyArgs, RecvScales,
};
use ep_reference::normal::{self as r, CombineInput, DispatchArgs, RankInput};
use tch::kind::Element;
use tch::{Device, Kind, Tensor};

use crate::args::{Bias, DispatchX, Layout, RecvX};
use crate::error::{Error, Result};
use crate::tensor::dtype_of;

// ----- tensors <-> vectors ----------------------------------------------------------

/// `t` (called `name`) of dtype `kind` with `dims` dimensions, as a contiguous
/// CPU tensor.
fn cpu(name: &str, t: &Tensor, kind: Kind, dims: usize) -> Result<Tensor> {
    if !t.defined() {
        return Err(Error::type_error(format!(
            "{name} must be a torch.Tensor, got an undefined tensor"
        )));
    }
    if t.kind() != kind {
        return Err(Error::dtype(format!(
            "{name} must have dtype {}, got {}",
            dtype_of(kind),
            dtype_of(t.kind())
        )));
    }
    if t.dim() != dims {
        return Err(Error::value(format!(
            "{name} must be {dims}-D, got {}-D with shape {:?}",
            t.dim(),
            t.size()
        )));
    }
    Ok(t.f_to_device(Device::Cpu)?.f_contiguous()?)
}

/// The values of a CPU tensor of element type `T`, in order.
fn copied<T: Element + Default + Clone>(t: &Tensor) -> Result<Vec<T>> {
    let mut v = vec![T::default(); t.numel()];
    let len = v.len();
    t.f_copy_data(&mut v, len)?;
    Ok(v)
}

fn i64s(name: &str, t: &Tensor, dims: usize) -> Result<Vec<i64>> {
    copied(&cpu(name, t, Kind::Int64, dims)?)
}

fn i32s(name: &str, t: &Tensor, dims: usize) -> Result<Vec<i32>> {
    copied(&cpu(name, t, Kind::Int, dims)?)
}

/// A bf16 or f32 tensor's values as f32 (bf16 converts exactly).
fn f32s(name: &str, t: &Tensor, dims: usize) -> Result<Vec<f32>> {
    let kind = if t.defined() && t.kind() == Kind::BFloat16 {
        Kind::BFloat16
    } else {
        Kind::Float
    };
    copied(&cpu(name, t, kind, dims)?.f_to_kind(Kind::Float)?)
}

/// The raw bytes of `t` (row-major).
fn bytes(name: &str, t: &Tensor, kind: Kind, dims: usize) -> Result<Vec<u8>> {
    let t = cpu(name, t, kind, dims)?;
    let mut v = vec![0u8; t.numel() * kind.elt_size_in_bytes()];
    t.f_copy_data_u8(&mut v, t.numel())?;
    Ok(v)
}

fn from_bytes(b: &[u8], shape: &[i64], kind: Kind) -> Result<Tensor> {
    Ok(Tensor::f_from_data_size(b, shape, kind)?)
}

fn from_i32(v: &[i32], shape: &[i64]) -> Result<Tensor> {
    Ok(Tensor::from_slice(v).f_reshape(shape)?)
}

fn from_i64(v: &[i64], shape: &[i64]) -> Result<Tensor> {
    Ok(Tensor::from_slice(v).f_reshape(shape)?)
}

fn from_f32(v: &[f32], shape: &[i64]) -> Result<Tensor> {
    Ok(Tensor::from_slice(v).f_reshape(shape)?)
}

fn size(t: &Tensor, dim: usize) -> i64 {
    t.size()[dim]
}

/// Size `dim` of `t`, or of its last dimension where it has fewer (a wrong
/// shape, which the checks that follow refuse).
fn size_or_last(t: &Tensor, dim: usize) -> i64 {
    size(t, dim.min(t.dim().saturating_sub(1)))
}

/// [`size_or_last`] of the first of `ts`; 0 without any.
fn first_size(ts: &[&Tensor], dim: usize) -> i64 {
    ts.first().map_or(0, |t| size_or_last(t, dim))
}

// ----- normal path -------------------------------------------------------------------

/// `get_dispatch_layout` of one rank's int64 `topk_idx` `[N, K]` among
/// `num_ranks` ranks within one node: `(num_tokens_per_rank,
/// num_tokens_per_expert, is_token_in_rank)` as CPU tensors
/// (`num_tokens_per_rdma_rank` None).
pub fn layout(topk_idx: &Tensor, num_experts: i64, num_ranks: i64) -> Result<Layout> {
    layout_of(topk_idx, num_experts, num_ranks, None)
}

/// [`layout`] of a group that spans nodes of `ranks_per_node` consecutive
/// ranks: with `num_tokens_per_rdma_rank` int32 `[R / ranks_per_node]`, the
/// tokens with an expert on a rank of each node.
pub fn layout_internode(
    topk_idx: &Tensor,
    num_experts: i64,
    num_ranks: i64,
    ranks_per_node: usize,
) -> Result<Layout> {
    layout_of(topk_idx, num_experts, num_ranks, Some(ranks_per_node))
}

fn layout_of(
    topk_idx: &Tensor,
    num_experts: i64,
    num_ranks: i64,
    ranks_per_node: Option<usize>,
) -> Result<Layout> {
    let idx = i64s("topk_idx", topk_idx, 2)?;
    let (n, k) = (size(topk_idx, 0), size(topk_idx, 1));
    let (k, e, ranks) = (k as usize, num_experts as usize, num_ranks as usize);
    let l = match ranks_per_node {
        None => r::layout(&idx, k, e, ranks)?,
        Some(per_node) => r::layout_internode(&idx, k, e, ranks, per_node)?,
    };
    let in_rank: Vec<u8> = l.is_token_in_rank.iter().map(|&b| u8::from(b)).collect();
    let per_node = l
        .num_tokens_per_rdma_rank
        .as_ref()
        .map(|v| from_i32(v, &[v.len() as i64]))
        .transpose()?;
    Ok(Layout {
        num_tokens_per_rank: from_i32(&l.num_tokens_per_rank, &[num_ranks])?,
        num_tokens_per_expert: from_i32(&l.num_tokens_per_expert, &[num_experts])?,
        is_token_in_rank: from_bytes(&in_rank, &[n, num_ranks], Kind::Bool)?,
        num_tokens_per_rdma_rank: per_node,
    })
}

/// One source rank's dispatch inputs.
#[derive(Clone, Copy, Debug)]
pub struct RankTokens<'a> {
    pub x: DispatchX<'a>,
    pub topk_idx: &'a Tensor,
    pub topk_weights: Option<&'a Tensor>,
}

/// What one destination rank receives in [`dispatch`] (CPU tensors).
#[derive(Debug)]
pub struct RankReceived {
    pub recv_x: RecvX,
    pub recv_topk_idx: Tensor,
    pub recv_topk_weights: Option<Tensor>,
    /// int32 `[rows]`: each row's token index on its source rank.
    pub recv_src_idx: Tensor,
    /// int32 `[rows]`: each row's source rank.
    pub recv_src_rank: Tensor,
    pub num_recv_tokens_per_expert: Vec<i64>,
}

/// A reference dispatch of every rank: the routing [`combine`] takes, and
/// what each rank received.
#[derive(Debug)]
pub struct RefDispatched {
    pub core: r::Dispatched,
    pub ranks: Vec<RankReceived>,
}

/// Dispatch over all ranks at once (`inputs[r]` is rank `r`'s): every token
/// goes once to each rank hosting one of its experts, in source rank then
/// token order; nothing is converted.
pub fn dispatch(
    inputs: &[RankTokens<'_>],
    num_experts: i64,
    expert_alignment: i64,
    num_worst_tokens: i64,
) -> Result<RefDispatched> {
    let Some(first) = inputs.first() else {
        return Err(Error::value(
            "inputs must have one entry per rank, 1 to 32, got 0",
        ));
    };
    let (x0, s0) = first.x.parts();
    let kind = if s0.is_some() {
        Kind::Float8e4m3fn
    } else {
        Kind::BFloat16
    };
    let hidden = size_or_last(x0, 1);
    let num_scales = s0.map_or(0, |s| size_or_last(s, 1));
    let num_topk = size(
        first.topk_idx,
        1.min(first.topk_idx.dim().saturating_sub(1)),
    );
    let mut data = Vec::with_capacity(inputs.len());
    for (rank, input) in inputs.iter().enumerate() {
        let (x, s) = input.x.parts();
        let xb = bytes(&format!("xs[{rank}]"), x, kind, 2)?;
        let sv = s
            .map(|s| f32s_exact(&format!("xs[{rank}][1] (scales)"), s))
            .transpose()?;
        let idx = i64s(&format!("topk_idx[{rank}]"), input.topk_idx, 2)?;
        let w = input
            .topk_weights
            .map(|w| f32s_exact(&format!("topk_weights[{rank}]"), w))
            .transpose()?;
        data.push((xb, sv, idx, w));
    }
    let ins: Vec<RankInput<'_>> = data
        .iter()
        .map(|(x, s, idx, w)| RankInput {
            topk_idx: idx,
            topk_weights: w.as_deref(),
            x,
            scales: s.as_deref(),
        })
        .collect();
    let args = DispatchArgs {
        num_experts: num_experts.max(0) as usize,
        num_topk: num_topk.max(0) as usize,
        hidden_bytes: (hidden * kind.elt_size_in_bytes() as i64).max(0) as usize,
        num_scales: num_scales.max(0) as usize,
        expert_alignment: expert_alignment.max(0) as usize,
        num_worst_tokens: num_worst_tokens.max(0) as usize,
    };
    let core = r::dispatch(&ins, &args)?;
    let mut ranks = Vec::with_capacity(core.ranks.len());
    for out in &core.ranks {
        let rows = out.num_rows() as i64;
        ranks.push(RankReceived {
            recv_x: RecvX {
                x: from_bytes(&out.recv_x, &[rows, hidden], kind)?,
                scales: out
                    .recv_scales
                    .as_ref()
                    .map(|s| from_f32(s, &[rows, num_scales]))
                    .transpose()?,
            },
            recv_topk_idx: from_i64(&out.recv_topk_idx, &[rows, num_topk])?,
            recv_topk_weights: out
                .recv_topk_weights
                .as_ref()
                .map(|w| from_f32(w, &[rows, num_topk]))
                .transpose()?,
            recv_src_idx: from_i32(&out.recv_src_idx, &[rows])?,
            recv_src_rank: from_i32(&out.recv_src_rank, &[rows])?,
            num_recv_tokens_per_expert: out
                .num_recv_tokens_per_expert
                .iter()
                .map(|&c| i64::from(c))
                .collect(),
        });
    }
    Ok(RefDispatched { core, ranks })
}

/// An f32 tensor's values (scales, weights: moved bit for bit).
fn f32s_exact(name: &str, t: &Tensor) -> Result<Vec<f32>> {
    copied(&cpu(name, t, Kind::Float, 2)?)
}

/// Combine over all ranks at once: `ys[r]` (bf16 or f32 `[rows_r, H]`) is
/// what rank `r` returns for the rows it received, `topk_weights[r]` f32
/// `[rows_r, K]`, `biases[r]` rank `r`'s own tokens' bias. Returns per
/// source rank `(combined_x f32 [N_r, H], combined_topk_weights f32
/// [N_r, K])`, summed in f32 as the core documents: round with
/// `to_kind(Kind::BFloat16)` for what a GPU bf16 output holds. This is the
/// model of the intranode kernels (a group within one node); across nodes
/// use [`combine_internode`].
pub fn combine(
    d: &RefDispatched,
    ys: &[&Tensor],
    topk_weights: Option<&[&Tensor]>,
    biases: Option<&[Bias<'_>]>,
) -> Result<Vec<(Tensor, Option<Tensor>)>> {
    combine_of(d, ys, topk_weights, biases, None)
}

/// [`combine`] as the internode kernels reduce, for a group that spans
/// nodes of `ranks_per_node` consecutive ranks: each node's copies summed in
/// f32 and rounded to bf16, then the biases and those partials summed in
/// node order (`ep_reference::normal::combine_internode`). The dispatch is
/// the same for every split: [`dispatch`]'s.
pub fn combine_internode(
    d: &RefDispatched,
    ys: &[&Tensor],
    topk_weights: Option<&[&Tensor]>,
    biases: Option<&[Bias<'_>]>,
    ranks_per_node: usize,
) -> Result<Vec<(Tensor, Option<Tensor>)>> {
    combine_of(d, ys, topk_weights, biases, Some(ranks_per_node))
}

fn combine_of(
    d: &RefDispatched,
    ys: &[&Tensor],
    topk_weights: Option<&[&Tensor]>,
    biases: Option<&[Bias<'_>]>,
    ranks_per_node: Option<usize>,
) -> Result<Vec<(Tensor, Option<Tensor>)>> {
    let hidden = first_size(ys, 1);
    let mut data = Vec::with_capacity(ys.len());
    for (rank, y) in ys.iter().enumerate() {
        let yv = f32s(&format!("ys[{rank}]"), y, 2)?;
        let w = topk_weights
            .and_then(|w| w.get(rank))
            .map(|w| f32s_exact(&format!("topk_weights[{rank}]"), w))
            .transpose()?;
        let (b0, b1) = biases
            .and_then(|b| b.get(rank).copied())
            .unwrap_or_default()
            .pair();
        let b0 = b0
            .map(|b| f32s(&format!("biases[{rank}][0]"), b, 2))
            .transpose()?;
        let b1 = b1
            .map(|b| f32s(&format!("biases[{rank}][1]"), b, 2))
            .transpose()?;
        data.push((yv, w, b0, b1));
    }
    let ins: Vec<CombineInput<'_>> = data
        .iter()
        .map(|(y, w, b0, b1)| CombineInput {
            y,
            topk_weights: w.as_deref(),
            bias: [b0.as_deref(), b1.as_deref()],
        })
        .collect();
    let hidden_n = hidden.max(0) as usize;
    let out = match ranks_per_node {
        None => r::combine(&d.core, &ins, hidden_n)?,
        Some(per_node) => r::combine_internode(&d.core, &ins, hidden_n, per_node)?,
    };
    let k = d.core.args.num_topk as i64;
    out.iter()
        .enumerate()
        .map(|(rank, o)| {
            let n = d.core.layouts[rank].num_tokens() as i64;
            Ok((
                from_f32(&o.combined_x, &[n, hidden])?,
                o.combined_topk_weights
                    .as_ref()
                    .map(|w| from_f32(w, &[n, k]))
                    .transpose()?,
            ))
        })
        .collect()
}

// ----- low latency -------------------------------------------------------------------

/// What one rank receives in [`ll_dispatch`] (CPU tensors, the GPU call's
/// shapes and layouts; only the first `recv_count[e]` rows of expert `e`
/// are specified).
#[derive(Debug)]
pub struct LlReceived {
    pub recv_x: RecvX,
    pub recv_count: Tensor,
    pub src_info: Tensor,
    pub layout_range: Tensor,
}

/// `low_latency_dispatch` over all ranks at once: `xs[r]` bf16 `[T_r, H]`,
/// `topk_idx[r]` int64 `[T_r, K]`.
pub fn ll_dispatch(
    xs: &[&Tensor],
    topk_idx: &[&Tensor],
    num_max_dispatch_tokens_per_rank: i64,
    num_experts: i64,
    use_fp8: bool,
    round_scale: bool,
    use_ue8m0: bool,
) -> Result<Vec<LlReceived>> {
    let hidden = first_size(xs, 1);
    let k = first_size(topk_idx, 1);
    let mut data = Vec::with_capacity(xs.len());
    for (rank, (x, t)) in xs.iter().zip(topk_idx).enumerate() {
        let xv = f32s(
            &format!("xs[{rank}]"),
            &cpu(&format!("xs[{rank}]"), x, Kind::BFloat16, 2)?,
            2,
        )?;
        data.push((xv, i64s(&format!("topk_idxs[{rank}]"), t, 2)?));
    }
    let ins: Vec<LlRankInput<'_>> = data
        .iter()
        .map(|(x, t)| LlRankInput { x, topk_idx: t })
        .collect();
    let args = LowLatencyArgs {
        num_max_dispatch_tokens_per_rank: num_max_dispatch_tokens_per_rank.max(0) as usize,
        hidden: hidden.max(0) as usize,
        num_experts: num_experts.max(0) as usize,
        num_topk: k.max(0) as usize,
        use_fp8,
        round_scale,
        use_ue8m0,
    };
    let out = rl::low_latency_dispatch(&ins, &args)?;
    let s = out.shape;
    let (el, rt, h) = (
        s.num_local_experts as i64,
        s.rows_per_expert() as i64,
        s.hidden as i64,
    );
    let r = s.num_ranks as i64;
    out.ranks
        .iter()
        .map(|o| {
            let recv_x = match &o.recv_x {
                rl::RecvX::Bf16(v) => RecvX {
                    x: from_f32(v, &[el, rt, h])?.f_to_kind(Kind::BFloat16)?,
                    scales: None,
                },
                rl::RecvX::Fp8 { x, scales } => {
                    // Column-major last two dimensions: stored [E_local, G, RT].
                    let scales = match scales {
                        RecvScales::F32(v) => {
                            from_f32(v, &[el, s.num_scales() as i64, rt])?.f_transpose(1, 2)?
                        }
                        RecvScales::Ue8m0(v) => {
                            from_i32(v, &[el, s.num_packed_scales() as i64, rt])?
                                .f_transpose(1, 2)?
                        }
                    };
                    RecvX {
                        x: from_bytes(x, &[el, rt, h], Kind::Float8e4m3fn)?,
                        scales: Some(scales),
                    }
                }
            };
            Ok(LlReceived {
                recv_x,
                recv_count: from_i32(&o.recv_count, &[el])?,
                src_info: from_i32(&o.src_info, &[el, rt])?,
                layout_range: from_i64(&o.layout_range, &[el, r])?,
            })
        })
        .collect()
}

/// `low_latency_combine` over all ranks at once: `ys[r]` bf16
/// `[E_local, R*T, H]` in the row layout of rank `r`'s handle
/// (`src_info[r]`, `layout_range[r]`), `topk_idx[r]` / `topk_weights[r]`
/// rank `r`'s routing. Returns each rank's bf16 `[T_r, H]`.
pub fn ll_combine(
    ys: &[&Tensor],
    topk_idx: &[&Tensor],
    topk_weights: &[&Tensor],
    handles: &[(&Tensor, &Tensor)],
    num_max_dispatch_tokens_per_rank: i64,
    num_experts: i64,
) -> Result<Vec<Tensor>> {
    let hidden = first_size(ys, 2);
    let k = first_size(topk_idx, 1);
    let mut data = Vec::with_capacity(ys.len());
    for rank in 0..ys.len() {
        let (Some(t), Some(w), Some((s, l))) = (
            topk_idx.get(rank),
            topk_weights.get(rank),
            handles.get(rank),
        ) else {
            return Err(Error::value(format!(
                "ys, topk_idx, topk_weights and handles must have one entry per rank, got \
                 {}, {}, {}, {}",
                ys.len(),
                topk_idx.len(),
                topk_weights.len(),
                handles.len()
            )));
        };
        let y = cpu(&format!("ys[{rank}]"), ys[rank], Kind::BFloat16, 3)?;
        data.push((
            f32s(
                &format!("ys[{rank}]"),
                &y.f_reshape([-1, hidden.max(1)])?,
                2,
            )?,
            i64s(&format!("topk_idx[{rank}]"), t, 2)?,
            f32s_exact(&format!("topk_weights[{rank}]"), w)?,
            i32s(&format!("handles[{rank}][0] (src_info)"), s, 2)?,
            i64s(&format!("handles[{rank}][1] (layout_range)"), l, 2)?,
        ));
    }
    let ins: Vec<LlCombineInput<'_>> = data
        .iter()
        .map(|(y, t, w, s, l)| LlCombineInput::new(y, t, w, s, l))
        .collect();
    let args = LowLatencyArgs::new(
        num_max_dispatch_tokens_per_rank.max(0) as usize,
        hidden.max(0) as usize,
        num_experts.max(0) as usize,
        k.max(0) as usize,
    )
    .bf16();
    let out = rl::low_latency_combine(&ins, &args)?;
    out.iter()
        .zip(&data)
        .map(|(o, (_, t, _, _, _))| {
            let n = t.len() as i64 / k.max(1);
            from_f32(&o.combined_x, &[n, hidden])?
                .f_to_kind(Kind::BFloat16)
                .map_err(Error::from)
        })
        .collect()
}
