//! The argument checks and output shapes of every call of the EP API, once,
//! without torch, so that every front end (the Python `Buffer` through
//! `moelink._native`, the Rust API on tch tensors) refuses the same arguments
//! with the same message and allocates the same outputs.
//!
//! A tensor argument arrives as a [`TensorMeta`] (dtype, shape, strides,
//! device). Each call has one pure function that takes the group size, this
//! rank's device, the metas (`None` for an absent optional tensor) and the
//! scalars, and returns the call's plan, the normalized values its launch
//! needs and the [`OutputSpec`]s of the tensors it allocates, or an
//! [`ArgError`] whose message names the argument. A front end checks only
//! what its language leaves open: in Python, that an argument is a tensor, an
//! int or a bool, the structure of tuples (`x` as a pair, a handle), and the
//! values of `topk_idx`, which only a device read (a sync) can see. What
//! depends on a buffer's size (the slots of an intranode dispatch, the bytes
//! of a low-latency call) is checked by the buffer at launch
//! ([`crate::intranode`], [`crate::low_latency`]). The numbers are
//! [`crate::limits`]'.
//!
//! | function | call |
//! |---|---|
//! | [`layout`] | `get_dispatch_layout` |
//! | [`dispatch`] | `dispatch`, full or cached (with a handle, checked by [`intranode_handle`]) |
//! | [`combine`] | `combine` |
//! | [`ll_geometry`] | the `(T, H, E)` of every low-latency call, `clean_low_latency_buffer` and the size hint |
//! | [`ll_dispatch`] | `low_latency_dispatch` |
//! | [`ll_handle`] | a low-latency handle; the shape of `get_next_low_latency_combine_buffer` |
//! | [`ll_combine`] | `low_latency_combine` |
//! | [`buffer_options`], [`num_sms`] | the Buffer's constructor; the SMs of a `Config` and `Buffer.set_num_sms` |
//! | [`nvl_buffer_size_hint`], [`rdma_buffer_size_hint`], [`token_record_bytes`], [`combine_record_bytes`] | `Config.get_nvl_buffer_size_hint` / `get_rdma_buffer_size_hint` and the record sizes of the NVLink buffer (module `sizing`) |
//! | [`all_reduce`], [`all_gather`], [`all_reduce_register`] | the tensor checks of `AllReduce.all_reduce`, `all_gather`, `register` |
//!
//! Checks run in the order of the arguments they read, each tensor's in the
//! order dtype, rank, shape, device, layout; the first failure is returned.

use std::fmt;

mod allreduce;
mod buffer;
mod sizing;

pub use allreduce::{
    all_gather, all_reduce, all_reduce_register, AllGatherPlan, AllReducePlan, ALL_REDUCE_DTYPES,
};
pub use buffer::{buffer_options, default_num_sms, num_sms, BufferArgs, BufferPlan, SmsCall};
pub use sizing::{
    combine_record_bytes, nvl_buffer_size_hint, rdma_buffer_size_hint, token_record_bytes,
    COMBINE_RECORD_TOPK, COUNTER_BYTES,
};

use crate::limits::{
    FP8_GROUP_SIZE, LL_MAX_HIDDEN, LL_MAX_TOKENS_PER_RANK, MAX_EXPERTS, MAX_EXPERTS_PER_RANK,
    MAX_EXPERT_ALIGNMENT, MAX_HIDDEN_BYTES, MAX_RANKS, MAX_RECV_TOKENS, MAX_TOPK,
    ROW_BYTES_ALIGNMENT,
};

// ----- tensors ------------------------------------------------------------------

/// The element type of a tensor, by torch's names.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    Bool,
    U8,
    I8,
    I16,
    I32,
    I64,
    F16,
    BF16,
    F32,
    F64,
    /// `float8_e4m3fn`, the fp8 of dispatch and low-latency dispatch.
    F8E4M3,
    F8E5M2,
    /// Any other dtype, by its torch name: never accepted, named in messages.
    Other(String),
}

/// Every named dtype, and torch's names of them in the same order.
const NAMED: [DType; 12] = {
    use DType::*;
    [
        Bool, U8, I8, I16, I32, I64, F16, BF16, F32, F64, F8E4M3, F8E5M2,
    ]
};
const NAMES: &str = "bool uint8 int8 int16 int32 int64 float16 bfloat16 float32 float64 \
                     float8_e4m3fn float8_e5m2";

impl DType {
    /// The dtype torch calls `name` (`"bfloat16"`, or `"torch.bfloat16"` as
    /// `str(dtype)` gives it); [`DType::Other`] for any other name.
    pub fn from_torch_name(name: &str) -> DType {
        let name = name.strip_prefix("torch.").unwrap_or(name);
        let mut named = NAMED.iter().zip(NAMES.split_whitespace());
        match named.find(|(_, n)| *n == name) {
            Some((d, _)) => d.clone(),
            None => DType::Other(name.to_string()),
        }
    }

    /// Every named dtype (all but [`DType::Other`]) with torch's name of it.
    pub fn named() -> impl Iterator<Item = (DType, &'static str)> {
        NAMED.iter().cloned().zip(NAMES.split_whitespace())
    }

    /// torch's name (`torch.<name>` is the dtype).
    pub fn torch_name(&self) -> &str {
        match self {
            DType::Other(name) => name,
            d => {
                let mut names = NAMES.split_whitespace().zip(&NAMED);
                let (name, _) = names.find(|(_, v)| *v == d).expect("every dtype is named");
                name
            }
        }
    }

    /// Bytes of one element (None for [`DType::Other`]).
    pub fn element_size(&self) -> Option<i64> {
        Some(match self {
            DType::Bool | DType::U8 | DType::I8 | DType::F8E4M3 | DType::F8E5M2 => 1,
            DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
            DType::Other(_) => return None,
        })
    }
}

/// As torch prints it: `torch.bfloat16`.
impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "torch.{}", self.torch_name())
    }
}

/// [`TensorMeta::device`] of a tensor in CPU memory (a CUDA tensor's is its
/// device index).
pub const CPU: i32 = -1;
/// [`TensorMeta::device`] of a tensor on a device that is neither CUDA nor
/// the CPU (`meta`, ...).
pub const OTHER_DEVICE: i32 = -2;

/// A device as torch names it (`cuda:0`, `cpu`).
fn device_name(device: i32) -> String {
    match device {
        d if d >= 0 => format!("cuda:{d}"),
        CPU => "cpu".into(),
        _ => "a device that is neither CUDA nor the CPU".into(),
    }
}

/// What the checks read of a tensor argument.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorMeta {
    pub dtype: DType,
    pub shape: Vec<i64>,
    /// In elements, one per dimension.
    pub strides: Vec<i64>,
    /// CUDA device index, [`CPU`] or [`OTHER_DEVICE`].
    pub device: i32,
}

impl TensorMeta {
    /// A contiguous tensor of `shape`.
    pub fn contiguous(dtype: DType, shape: &[i64], device: i32) -> Self {
        TensorMeta {
            dtype,
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            device,
        }
    }

    pub fn dim(&self) -> usize {
        self.shape.len()
    }

    /// torch's `is_contiguous()`: row-major, where dimensions of size 1 may
    /// have any stride and an empty tensor always is.
    pub fn is_contiguous(&self) -> bool {
        if self.shape.contains(&0) {
            return true;
        }
        let mut expected = 1;
        for (&size, &stride) in self.shape.iter().zip(&self.strides).rev() {
            if size != 1 {
                if stride != expected {
                    return false;
                }
                expected = expected.saturating_mul(size);
            }
        }
        true
    }
}

/// The strides torch gives a new contiguous tensor of `shape` (a size 0
/// counts as 1).
pub fn contiguous_strides(shape: &[i64]) -> Vec<i64> {
    let mut strides = vec![0; shape.len()];
    let mut next = 1i64;
    for (s, &size) in strides.iter_mut().zip(shape).rev() {
        *s = next;
        next = next.saturating_mul(size.max(1));
    }
    strides
}

// ----- errors -------------------------------------------------------------------

/// What kind of argument error a check found; each front end maps it to its
/// exception (Python: `TypeError`, `moelink.DtypeError`, `ValueError`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgErrorKind {
    /// An argument of the wrong kind (a tensor missing where the call needs
    /// one).
    Type,
    /// A tensor of the wrong dtype.
    Dtype,
    /// A wrong value: a size, a shape, a device, a layout, a combination.
    Value,
}

/// An argument a call refuses; `message` names the argument, says what was
/// expected and what was given.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ArgError {
    pub kind: ArgErrorKind,
    pub message: String,
}

pub type ArgResult<T> = std::result::Result<T, ArgError>;

fn value_err<T>(message: String) -> ArgResult<T> {
    Err(ArgError {
        kind: ArgErrorKind::Value,
        message,
    })
}

// ----- outputs ------------------------------------------------------------------

/// A dimension or stride of an [`OutputSpec`] that is the number of rows a
/// dispatch receives, known only once its counts arrive (a dispatch without
/// `num_worst_tokens`); [`OutputSpec::resolve`] fills it in.
pub const RECV_ROWS: i64 = -1;

/// A tensor a call allocates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutputSpec {
    /// The output's name in the API (`recv_x`, `src_info`, ...).
    pub name: &'static str,
    pub dtype: DType,
    pub shape: Vec<i64>,
    pub strides: Vec<i64>,
    /// Zero-filled (the kernels never write it), else uninitialized.
    pub zeroed: bool,
}

impl OutputSpec {
    /// A contiguous output (a [`RECV_ROWS`] dimension only first).
    fn new(name: &'static str, dtype: DType, shape: &[i64]) -> Self {
        debug_assert!(!shape.iter().skip(1).any(|&d| d == RECV_ROWS));
        OutputSpec {
            name,
            dtype,
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            zeroed: false,
        }
    }

    fn strided(name: &'static str, dtype: DType, shape: &[i64], strides: &[i64]) -> Self {
        OutputSpec {
            name,
            dtype,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            zeroed: false,
        }
    }

    fn zeroed(mut self) -> Self {
        self.zeroed = true;
        self
    }

    /// Bytes of a contiguous output of this shape (resolved rows).
    pub fn bytes(&self) -> i64 {
        self.shape.iter().product::<i64>() * self.dtype.element_size().unwrap_or(0)
    }

    /// This spec with `rows` received rows: a [`RECV_ROWS`] dimension becomes
    /// `rows`, a [`RECV_ROWS`] stride `max(rows, 1)` (as torch strides a new
    /// tensor).
    pub fn resolve(&self, rows: i64) -> OutputSpec {
        OutputSpec {
            shape: self
                .shape
                .iter()
                .map(|&d| if d == RECV_ROWS { rows } else { d })
                .collect(),
            strides: self.strides.iter().map(|&d| stride_at(d, rows)).collect(),
            ..self.clone()
        }
    }
}

/// A spec's stride `d` with `rows` received rows: a [`RECV_ROWS`] stride is
/// `max(rows, 1)`, as torch strides a new tensor ([`OutputSpec::resolve`]).
pub fn stride_at(d: i64, rows: i64) -> i64 {
    if d == RECV_ROWS {
        rows.max(1)
    } else {
        d
    }
}

/// The output called `name` of `outputs`.
pub fn output<'a>(outputs: &'a [OutputSpec], name: &str) -> Option<&'a OutputSpec> {
    outputs.iter().find(|o| o.name == name)
}

// ----- checks -------------------------------------------------------------------

/// What a tensor argument must be: `dtype`, `shape` (a `None` size: any; its
/// length is the rank), on this Buffer's device unless `anywhere`, contiguous
/// unless `any_strides`.
#[derive(Clone, Debug)]
struct Want<'s> {
    dtype: DType,
    shape: &'s [Option<i64>],
    device: Option<i32>,
    contiguous: bool,
}

impl<'s> Want<'s> {
    /// `dtype` and `shape`, on `device`, contiguous: what most tensor
    /// arguments must be.
    fn new(dtype: DType, shape: &'s [Option<i64>], device: i32) -> Self {
        Want {
            dtype,
            shape,
            device: Some(device),
            contiguous: true,
        }
    }

    fn any_strides(mut self) -> Self {
        self.contiguous = false;
        self
    }

    fn anywhere(mut self) -> Self {
        self.device = None;
        self
    }

    /// The first way `t` (called `name`) is not as wanted, in the order
    /// dtype, rank, shape, device, layout.
    fn check(&self, name: &str, t: &TensorMeta) -> ArgResult<()> {
        if t.dtype != self.dtype {
            return Err(ArgError {
                kind: ArgErrorKind::Dtype,
                message: format!("{name} must have dtype {}, got {}", self.dtype, t.dtype),
            });
        }
        let dims = self.shape.len();
        if t.dim() != dims {
            return value_err(format!(
                "{name} must be {dims}-D, got {}-D with shape {:?}",
                t.dim(),
                t.shape
            ));
        }
        let differs = |(w, s): (&Option<i64>, &i64)| w.is_some_and(|w| w != *s);
        if self.shape.iter().zip(&t.shape).any(differs) {
            let want: Vec<String> = self
                .shape
                .iter()
                .map(|w| w.map_or_else(|| "*".to_string(), |w| w.to_string()))
                .collect();
            return value_err(format!(
                "{name} must have shape [{}], got {:?}",
                want.join(", "),
                t.shape
            ));
        }
        if let Some(device) = self.device {
            if t.device != device {
                return value_err(format!(
                    "{name} must be on this Buffer's device {}, got {}",
                    device_name(device),
                    device_name(t.device)
                ));
            }
        }
        if self.contiguous && !t.is_contiguous() {
            return value_err(format!(
                "{name} must be contiguous, got shape {:?} with strides {:?}",
                t.shape, t.strides
            ));
        }
        Ok(())
    }
}

/// `value` (called `name`) within `min..=max`.
fn int_in(name: &str, value: i64, min: i64, max: i64) -> ArgResult<i64> {
    if value < min {
        let what = if min == 1 {
            "positive".to_string()
        } else {
            format!(">= {min}")
        };
        return value_err(format!("{name} must be {what}, got {value}"));
    }
    if value > max {
        return value_err(format!("{name} must be <= {max}, got {value}"));
    }
    Ok(value)
}

const fn lim(v: usize) -> i64 {
    v as i64
}

/// Experts per rank: `num_ranks` (called `ranks_name`) within `1..=MAX_RANKS`,
/// `num_experts` within `1..=MAX_EXPERTS`, a multiple of `num_ranks`, at most
/// `MAX_EXPERTS_PER_RANK` per rank.
fn split_experts(num_experts: i64, num_ranks: i64, ranks_name: &str) -> ArgResult<i64> {
    let r = int_in(ranks_name, num_ranks, 1, lim(MAX_RANKS))?;
    let e = int_in("num_experts", num_experts, 1, lim(MAX_EXPERTS))?;
    if e % r != 0 {
        return value_err(format!(
            "num_experts must be a multiple of {ranks_name}, got num_experts={e} and \
             {ranks_name}={r}"
        ));
    }
    let per_rank = e / r;
    if per_rank > lim(MAX_EXPERTS_PER_RANK) {
        return value_err(format!(
            "num_experts must be at most {MAX_EXPERTS_PER_RANK} per rank, got num_experts={e} \
             over {ranks_name}={r} ({per_rank} per rank)"
        ));
    }
    Ok(per_rank)
}

/// Bytes of a row of the 2-D token tensor `t` (called `name`): a positive
/// multiple of `ROW_BYTES_ALIGNMENT`, at most `MAX_HIDDEN_BYTES`.
fn row_bytes(name: &str, t: &TensorMeta) -> ArgResult<i64> {
    let hidden = t.shape[1];
    let bytes = hidden * t.dtype.element_size().expect("the dtype was checked");
    let (align, max) = (lim(ROW_BYTES_ALIGNMENT), lim(MAX_HIDDEN_BYTES));
    if bytes == 0 || bytes % align != 0 || bytes > max {
        return value_err(format!(
            "{name} rows must be a positive multiple of {align} bytes up to {max}, got \
             hidden={hidden} of {} ({bytes} bytes)",
            t.dtype
        ));
    }
    Ok(bytes)
}

/// `topk_idx` (called `name`): int64 `[rows, K]` with `1 <= K <= MAX_TOPK`,
/// contiguous, on `device`. Returns `(N, K)`. Its values (ids in
/// `[-1, num_experts)`) are the kernels' to check, or the host's with a sync.
fn topk_form(name: &str, t: &TensorMeta, rows: Option<i64>, device: i32) -> ArgResult<(i64, i64)> {
    Want::new(DType::I64, &[None; 2], device)
        .any_strides()
        .anywhere()
        .check(name, t)?;
    let k = t.shape[1];
    if !(1..=lim(MAX_TOPK)).contains(&k) {
        return value_err(format!(
            "{name} must have 1 to {MAX_TOPK} columns (experts per token), got shape {:?}",
            t.shape
        ));
    }
    Want::new(DType::I64, &[rows, None], device).check(name, t)?;
    Ok((t.shape[0], k))
}

// ----- layout -------------------------------------------------------------------

/// `get_dispatch_layout`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayoutPlan {
    pub num_tokens: i64,
    pub num_topk: i64,
    pub num_experts: i64,
    /// Outputs: `num_tokens_per_rank` int32 `[R]`, `num_tokens_per_expert`
    /// int32 `[E]`, `is_token_in_rank` bool `[N, R]`, and the kernel's int32
    /// scratch `layout_scratch`.
    pub outputs: Vec<OutputSpec>,
}

/// Checks `get_dispatch_layout(topk_idx, num_experts)` on a Buffer of
/// `num_ranks` ranks on `device`.
pub fn layout(
    num_ranks: i64,
    device: i32,
    topk_idx: &TensorMeta,
    num_experts: i64,
) -> ArgResult<LayoutPlan> {
    split_experts(num_experts, num_ranks, "num_ranks")?;
    let (n, k) = topk_form("topk_idx", topk_idx, None, device)?;
    let scratch = ep_kernels::launch::layout_scratch_elems(
        n as usize,
        num_experts as usize,
        num_ranks as usize,
    );
    Ok(LayoutPlan {
        num_tokens: n,
        num_topk: k,
        num_experts,
        outputs: vec![
            OutputSpec::new("num_tokens_per_rank", DType::I32, &[num_ranks]),
            OutputSpec::new("num_tokens_per_expert", DType::I32, &[num_experts]),
            OutputSpec::new("is_token_in_rank", DType::Bool, &[n, num_ranks]),
            OutputSpec::new("layout_scratch", DType::I32, &[scratch as i64]),
        ],
    })
}

// ----- intranode dispatch and combine -------------------------------------------

/// A tensor argument as the checks read it: its meta. ep-core's engine passes
/// each meta with the tensor's address (`engine::TensorArg`).
pub trait HasMeta {
    fn meta(&self) -> &TensorMeta;
}

impl HasMeta for TensorMeta {
    fn meta(&self) -> &TensorMeta {
        self
    }
}

impl HasMeta for (TensorMeta, u64) {
    fn meta(&self) -> &TensorMeta {
        &self.0
    }
}

/// The tensors of an intranode handle that the calls read (its entries 0, 3,
/// 4 and 5; the channel matrices are zeros kept for DeepEP's shape), as
/// [`TensorMeta`]s (what the checks take) or as a front end's tensors `T`
/// (ep-core's engine: each meta with its address).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IntranodeHandle<T = TensorMeta> {
    pub rank_prefix_matrix: T,
    pub recv_src_idx: T,
    pub is_token_in_rank: T,
    pub send_head: T,
}

/// The entries in the handle tuple's order: `rank_prefix_matrix`,
/// `recv_src_idx`, `is_token_in_rank`, `send_head` (its 0, 3, 4 and 5).
impl<T> From<[T; 4]> for IntranodeHandle<T> {
    fn from([rank_prefix_matrix, recv_src_idx, is_token_in_rank, send_head]: [T; 4]) -> Self {
        IntranodeHandle {
            rank_prefix_matrix,
            recv_src_idx,
            is_token_in_rank,
            send_head,
        }
    }
}

impl<T> IntranodeHandle<T> {
    /// The same entries, each as `f` gives it (its meta, for the checks).
    pub fn map<U>(&self, f: impl Fn(&T) -> U) -> IntranodeHandle<U> {
        IntranodeHandle {
            rank_prefix_matrix: f(&self.rank_prefix_matrix),
            recv_src_idx: f(&self.recv_src_idx),
            is_token_in_rank: f(&self.is_token_in_rank),
            send_head: f(&self.send_head),
        }
    }
}

/// What an intranode handle says of its dispatch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HandleShape {
    /// Rows this rank received (`recv_src_idx`'s length).
    pub num_recv_rows: i64,
    /// Tokens this rank sent (`send_head`'s rows).
    pub num_tokens: i64,
}

/// Checks an intranode handle of a Buffer of `num_ranks` ranks on `device`;
/// with `num_tokens`, that it was made for that many tokens (those of `x`).
pub fn intranode_handle(
    num_ranks: i64,
    device: i32,
    h: &IntranodeHandle,
    num_tokens: Option<i64>,
) -> ArgResult<HandleShape> {
    Want::new(DType::I32, &[Some(num_ranks), Some(num_ranks)], device)
        .check("handle[0] (rank_prefix_matrix)", &h.rank_prefix_matrix)?;
    Want::new(DType::I32, &[None; 1], device).check("handle[3] (recv_src_idx)", &h.recv_src_idx)?;
    Want::new(DType::Bool, &[None; 2], device)
        .any_strides()
        .anywhere()
        .check("handle[4] (is_token_in_rank)", &h.is_token_in_rank)?;
    let send_head = &h.send_head;
    Want::new(DType::I32, &[None; 2], device).check("handle[5] (send_head)", send_head)?;
    if send_head.shape[1] != num_ranks {
        return value_err(format!(
            "handle[5] (send_head) must have {num_ranks} columns, got {:?}",
            send_head.shape
        ));
    }
    let made_for = send_head.shape[0];
    if let Some(n) = num_tokens.filter(|&n| n != made_for) {
        return value_err(format!(
            "x has {n} tokens but the handle was made for {made_for}"
        ));
    }
    Ok(HandleShape {
        num_recv_rows: h.recv_src_idx.shape[0],
        num_tokens: made_for,
    })
}

/// The arguments of `dispatch`. `x` is bf16 `[N, H]`, or with `scales` the
/// fp8 data of the pair `(x, scales)` (called `x[0]` and `x[1] (scales)`).
/// Tensors are [`TensorMeta`]s (what the checks take) or a front end's `T`
/// (ep-core's engine: each meta with its address; [`DispatchArgs::map`]).
#[derive(Debug)]
pub struct DispatchArgs<'a, T = TensorMeta> {
    pub x: &'a T,
    pub scales: Option<&'a T>,
    /// A cached dispatch's handle (then no top-k arguments).
    pub handle: Option<&'a IntranodeHandle<T>>,
    pub num_tokens_per_rank: Option<&'a T>,
    /// Whether `num_tokens_per_rdma_rank` was given: it must not be within one
    /// node (a group that spans nodes passes it to the internode path, whose
    /// checks are its own).
    pub num_tokens_per_rdma_rank: bool,
    pub is_token_in_rank: Option<&'a T>,
    pub num_tokens_per_expert: Option<&'a T>,
    pub topk_idx: Option<&'a T>,
    pub topk_weights: Option<&'a T>,
    pub expert_alignment: i64,
    pub num_worst_tokens: i64,
}

// Copy whatever `T` is: the arguments hold references to it.
impl<T> Clone for DispatchArgs<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for DispatchArgs<'_, T> {}

impl<'a, T> DispatchArgs<'a, T> {
    /// A cached dispatch of `x` (with `scales` for fp8) by an earlier
    /// dispatch's `handle`, every other argument at its default (the checks
    /// refuse any other in a cached dispatch).
    pub fn cached(x: &'a T, scales: Option<&'a T>, handle: &'a IntranodeHandle<T>) -> Self {
        DispatchArgs {
            handle: Some(handle),
            ..DispatchArgs::new(x, scales)
        }
    }

    /// A dispatch of `x` (with `scales` for fp8) with every other argument
    /// at its default: no handle and no routing yet (a full dispatch takes
    /// the layout's tensors and `topk_idx`).
    pub fn new(x: &'a T, scales: Option<&'a T>) -> Self {
        DispatchArgs {
            x,
            scales,
            handle: None,
            num_tokens_per_rank: None,
            num_tokens_per_rdma_rank: false,
            is_token_in_rank: None,
            num_tokens_per_expert: None,
            topk_idx: None,
            topk_weights: None,
            expert_alignment: 1,
            num_worst_tokens: 0,
        }
    }

    /// The same arguments with `tensor` of each tensor (its meta, for the
    /// checks) and `handle` for the handle (the caller's
    /// [`IntranodeHandle::map`] of it, which it keeps).
    pub fn map<'b, U>(
        &self,
        tensor: impl Fn(&'a T) -> &'b U,
        handle: Option<&'b IntranodeHandle<U>>,
    ) -> DispatchArgs<'b, U> {
        DispatchArgs {
            x: tensor(self.x),
            scales: self.scales.map(&tensor),
            handle,
            num_tokens_per_rank: self.num_tokens_per_rank.map(&tensor),
            num_tokens_per_rdma_rank: self.num_tokens_per_rdma_rank,
            is_token_in_rank: self.is_token_in_rank.map(&tensor),
            num_tokens_per_expert: self.num_tokens_per_expert.map(&tensor),
            topk_idx: self.topk_idx.map(&tensor),
            topk_weights: self.topk_weights.map(&tensor),
            expert_alignment: self.expert_alignment,
            num_worst_tokens: self.num_worst_tokens,
        }
    }
}

/// `dispatch`, full or cached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DispatchPlan {
    /// With a handle.
    pub cached: bool,
    pub num_tokens: i64,
    pub hidden_bytes: i64,
    /// f32 scales per token (0 for bf16).
    pub num_scales: i64,
    /// The input scales' strides (`(0, 0)` for bf16).
    pub scale_strides: (i64, i64),
    pub expert_alignment: i64,
    pub num_worst_tokens: i64,
    /// 0 for a cached dispatch.
    pub num_experts: i64,
    /// 0 for a cached dispatch or without `topk_idx`.
    pub num_topk: i64,
    /// Rows this rank receives: the handle's (cached), `num_worst_tokens`
    /// where positive, else [`RECV_ROWS`] (known once the counts arrive).
    pub num_recv_rows: i64,
    /// Outputs. A full dispatch: `rank_prefix_matrix` int32 `[R, R]` and
    /// `send_head` int32 `[N, R]` (before the send), the received
    /// `recv_x` `[rows, H]` (x's dtype), `recv_x_scales` f32 `[rows, S]`
    /// (fp8; column-major where the input's are), `recv_topk_idx` int64
    /// `[rows, K]` and `recv_topk_weights` f32 `[rows, K]` (where given),
    /// `recv_src_idx` int32 `[rows]`, and the zero `channel_prefix_matrix`
    /// and `recv_channel_prefix_matrix` int32 `[R, 1]`. A cached dispatch:
    /// `recv_x` and `recv_x_scales`. `rows` is `num_recv_rows`.
    pub outputs: Vec<OutputSpec>,
}

/// Checks `dispatch` on a Buffer of `num_ranks` ranks on `device` (the
/// metas of `a`'s tensors).
pub fn dispatch<T: HasMeta>(
    num_ranks: i64,
    device: i32,
    a: &DispatchArgs<'_, T>,
) -> ArgResult<DispatchPlan> {
    let handle = a.handle.map(|h| h.map(|t| t.meta().clone()));
    let a = &a.map(|t| t.meta(), handle.as_ref());
    let (x_name, x_dtype) = match a.scales {
        Some(_) => ("x[0]", DType::F8E4M3),
        None => ("x", DType::BF16),
    };
    let x = a.x;
    Want::new(x_dtype.clone(), &[None; 2], device).check(x_name, x)?;
    let (n, hidden) = (x.shape[0], x.shape[1]);
    let hidden_bytes = row_bytes(x_name, x)?;
    // Scales may have any strides (column-major views are common).
    let scales = a.scales;
    if let Some(s) = scales {
        let shape = [Some(n), Some(hidden / lim(FP8_GROUP_SIZE))];
        Want::new(DType::F32, &shape, device)
            .any_strides()
            .check("x[1] (scales)", s)?;
    }
    let expert_alignment = int_in(
        "expert_alignment",
        a.expert_alignment,
        1,
        lim(MAX_EXPERT_ALIGNMENT),
    )?;
    let num_worst_tokens = int_in(
        "num_worst_tokens",
        a.num_worst_tokens,
        0,
        lim(MAX_RECV_TOKENS),
    )?;
    if a.num_tokens_per_rdma_rank {
        return value_err("num_tokens_per_rdma_rank must be None within one node".into());
    }
    let mut plan = DispatchPlan {
        cached: a.handle.is_some(),
        num_tokens: n,
        hidden_bytes,
        num_scales: scales.map_or(0, |s| s.shape[1]),
        scale_strides: scales.map_or((0, 0), |s| (s.strides[0], s.strides[1])),
        expert_alignment,
        num_worst_tokens,
        num_experts: 0,
        num_topk: 0,
        num_recv_rows: RECV_ROWS,
        outputs: Vec::new(),
    };
    // A column-major input (DeepGEMM's) gives column-major received scales.
    let column_major = scales.is_some_and(|s| s.strides[0] == 1 && s.strides[1] != 1);
    let recv = |rows: i64, topk: Option<(i64, bool)>| {
        let mut out = vec![OutputSpec::new("recv_x", x_dtype.clone(), &[rows, hidden])];
        if let Some(s) = scales {
            let shape = [rows, s.shape[1]];
            out.push(if column_major {
                let rows_stride = if rows == RECV_ROWS { rows } else { rows.max(1) };
                OutputSpec::strided("recv_x_scales", DType::F32, &shape, &[1, rows_stride])
            } else {
                OutputSpec::new("recv_x_scales", DType::F32, &shape)
            });
        }
        if let Some((k, weights)) = topk {
            out.push(OutputSpec::new("recv_topk_idx", DType::I64, &[rows, k]));
            if weights {
                out.push(OutputSpec::new("recv_topk_weights", DType::F32, &[rows, k]));
            }
        }
        out
    };

    if let Some(h) = a.handle {
        if a.topk_idx.is_some() || a.topk_weights.is_some() {
            return value_err(
                "cached dispatch (handle given) takes no topk_idx / topk_weights".into(),
            );
        }
        let rows = intranode_handle(num_ranks, device, h, Some(n))?.num_recv_rows;
        plan.num_recv_rows = rows;
        plan.outputs = recv(rows, None);
        return Ok(plan);
    }
    let (Some(per_rank), Some(in_rank), Some(per_expert)) = (
        a.num_tokens_per_rank,
        a.is_token_in_rank,
        a.num_tokens_per_expert,
    ) else {
        return value_err(
            "dispatch without a handle needs num_tokens_per_rank, is_token_in_rank and \
             num_tokens_per_expert (from get_dispatch_layout)"
                .into(),
        );
    };
    Want::new(DType::I32, &[Some(num_ranks)], device)
        .any_strides()
        .check("num_tokens_per_rank", per_rank)?;
    Want::new(DType::Bool, &[Some(n), Some(num_ranks)], device)
        .check("is_token_in_rank", in_rank)?;
    Want::new(DType::I32, &[None; 1], device).check("num_tokens_per_expert", per_expert)?;
    let num_experts = per_expert.shape[0];
    split_experts(num_experts, num_ranks, "num_ranks")?;
    let topk = match (a.topk_idx, a.topk_weights) {
        (Some(idx), w) => {
            let (_, k) = topk_form("topk_idx", idx, Some(n), device)?;
            if let Some(w) = w {
                Want::new(DType::F32, &[Some(n), Some(k)], device).check("topk_weights", w)?;
            }
            Some((k, w.is_some()))
        }
        (None, Some(_)) => return value_err("topk_weights needs topk_idx".into()),
        (None, None) => None,
    };
    let rows = if num_worst_tokens > 0 {
        num_worst_tokens
    } else {
        RECV_ROWS
    };
    plan.num_experts = num_experts;
    plan.num_topk = topk.map_or(0, |(k, _)| k);
    plan.num_recv_rows = rows;
    plan.outputs = [
        OutputSpec::new("rank_prefix_matrix", DType::I32, &[num_ranks, num_ranks]),
        OutputSpec::new("send_head", DType::I32, &[n, num_ranks]),
    ]
    .into_iter()
    .chain(recv(rows, topk))
    .chain([
        OutputSpec::new("recv_src_idx", DType::I32, &[rows]),
        OutputSpec::new("channel_prefix_matrix", DType::I32, &[num_ranks, 1]).zeroed(),
        OutputSpec::new("recv_channel_prefix_matrix", DType::I32, &[num_ranks, 1]).zeroed(),
    ])
    .collect();
    Ok(plan)
}

/// `bias` of `combine`: one tensor (called `bias`) or a pair (called
/// `bias[0]`, `bias[1]`), each bf16 `[N, H]` (tensors as in
/// [`DispatchArgs`]).
#[derive(Debug)]
pub enum Bias<'a, T = TensorMeta> {
    One(&'a T),
    Pair(Option<&'a T>, Option<&'a T>),
}

impl<T> Clone for Bias<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Bias<'_, T> {}

impl<'a, T> Bias<'a, T> {
    /// Its two addends, each with the name the checks give it.
    pub fn named(&self) -> [Option<(&'static str, &'a T)>; 2] {
        match *self {
            Bias::One(b) => [Some(("bias", b)), None],
            Bias::Pair(b0, b1) => [b0.map(|b| ("bias[0]", b)), b1.map(|b| ("bias[1]", b))],
        }
    }

    /// The same bias with `tensor` of each tensor.
    pub fn map<'b, U>(&self, tensor: impl Fn(&'a T) -> &'b U) -> Bias<'b, U> {
        match *self {
            Bias::One(b) => Bias::One(tensor(b)),
            Bias::Pair(b0, b1) => Bias::Pair(b0.map(&tensor), b1.map(&tensor)),
        }
    }
}

/// The arguments of `combine` (tensors as in [`DispatchArgs`]).
#[derive(Debug)]
pub struct CombineArgs<'a, T = TensorMeta> {
    /// bf16 `[rows, H]`: what dispatch delivered, after the experts.
    pub x: &'a T,
    pub handle: &'a IntranodeHandle<T>,
    pub topk_weights: Option<&'a T>,
    pub bias: Option<Bias<'a, T>>,
}

impl<T> Clone for CombineArgs<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for CombineArgs<'_, T> {}

impl<'a, T> CombineArgs<'a, T> {
    /// The same arguments with `tensor` of each tensor and `handle` for the
    /// handle (as [`DispatchArgs::map`]).
    pub fn map<'b, U>(
        &self,
        tensor: impl Fn(&'a T) -> &'b U,
        handle: &'b IntranodeHandle<U>,
    ) -> CombineArgs<'b, U> {
        CombineArgs {
            x: tensor(self.x),
            handle,
            topk_weights: self.topk_weights.map(&tensor),
            bias: self.bias.map(|b| b.map(&tensor)),
        }
    }
}

/// `combine`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CombinePlan {
    pub num_recv_rows: i64,
    pub hidden: i64,
    pub num_tokens: i64,
    /// 0 without `topk_weights`.
    pub num_topk: i64,
    /// Outputs: `combined_x` bf16 `[N, H]`, and `combined_topk_weights` f32
    /// `[N, K]` with `topk_weights`.
    pub outputs: Vec<OutputSpec>,
}

/// Checks `combine` on a Buffer of `num_ranks` ranks on `device` (the metas
/// of `a`'s tensors).
pub fn combine<T: HasMeta>(
    num_ranks: i64,
    device: i32,
    a: &CombineArgs<'_, T>,
) -> ArgResult<CombinePlan> {
    let handle = a.handle.map(|t| t.meta().clone());
    let a = &a.map(|t| t.meta(), &handle);
    let h = intranode_handle(num_ranks, device, a.handle, None)?;
    let (rows, n) = (h.num_recv_rows, h.num_tokens);
    let x = a.x;
    Want::new(DType::BF16, &[None; 2], device).check("x", x)?;
    if x.shape[0] != rows {
        return value_err(format!(
            "x must have the {rows} rows dispatch delivered, got {}",
            x.shape[0]
        ));
    }
    let hidden = x.shape[1];
    row_bytes("x", x)?;
    let mut num_topk = 0;
    if let Some(w) = a.topk_weights {
        Want::new(DType::F32, &[None; 2], device).check("topk_weights", w)?;
        if w.shape[0] != rows || !(1..=lim(MAX_TOPK)).contains(&w.shape[1]) {
            return value_err(format!(
                "topk_weights must be [{rows}, K] with 1 <= K <= {MAX_TOPK}, got {:?}",
                w.shape
            ));
        }
        num_topk = w.shape[1];
    }
    let biases = a.bias.map_or([None, None], |b| b.named());
    for (name, b) in biases.into_iter().flatten() {
        Want::new(DType::BF16, &[Some(n), Some(hidden)], device).check(name, b)?;
    }
    let mut outputs = vec![OutputSpec::new("combined_x", DType::BF16, &[n, hidden])];
    if a.topk_weights.is_some() {
        outputs.push(OutputSpec::new(
            "combined_topk_weights",
            DType::F32,
            &[n, num_topk],
        ));
    }
    Ok(CombinePlan {
        num_recv_rows: rows,
        hidden,
        num_tokens: n,
        num_topk,
        outputs,
    })
}

// ----- low latency --------------------------------------------------------------

/// The shape every low-latency call of one configuration shares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlGeometry {
    /// `num_max_dispatch_tokens_per_rank` (T).
    pub max_tokens: i64,
    pub hidden: i64,
    pub num_experts: i64,
    pub experts_per_rank: i64,
}

/// Checks `(T, H, E)` of a low-latency call over `num_ranks` ranks (called
/// `ranks_name` in messages: "group size" for a Buffer's calls, "num_ranks"
/// for the size hint): `1 <= T <= LL_MAX_TOKENS_PER_RANK`, `H` a positive
/// multiple of `FP8_GROUP_SIZE` up to `LL_MAX_HIDDEN`, `E` split evenly.
pub fn ll_geometry(
    num_ranks: i64,
    ranks_name: &str,
    max_tokens: i64,
    hidden: i64,
    num_experts: i64,
) -> ArgResult<LlGeometry> {
    let max_tokens = int_in(
        "num_max_dispatch_tokens_per_rank",
        max_tokens,
        1,
        lim(LL_MAX_TOKENS_PER_RANK),
    )?;
    let (unit, max) = (lim(FP8_GROUP_SIZE), lim(LL_MAX_HIDDEN));
    if hidden <= 0 || hidden % unit != 0 || hidden > max {
        return value_err(format!(
            "hidden must be a positive multiple of {unit} up to {max}, got {hidden}"
        ));
    }
    let experts_per_rank = split_experts(num_experts, num_ranks, ranks_name)?;
    Ok(LlGeometry {
        max_tokens,
        hidden,
        num_experts,
        experts_per_rank,
    })
}

/// The arguments of `low_latency_dispatch`.
#[derive(Clone, Copy, Debug)]
pub struct LlDispatchArgs<'a> {
    /// bf16 `[N, H]`, `N <= T`.
    pub x: &'a TensorMeta,
    pub topk_idx: &'a TensorMeta,
    pub num_max_dispatch_tokens_per_rank: i64,
    pub num_experts: i64,
    pub cumulative_local_expert_recv_stats: Option<&'a TensorMeta>,
    pub dispatch_wait_recv_cost_stats: Option<&'a TensorMeta>,
    pub use_fp8: bool,
    pub round_scale: bool,
    pub use_ue8m0: bool,
}

/// `low_latency_dispatch`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LlDispatchPlan {
    pub geometry: LlGeometry,
    pub num_tokens: i64,
    pub num_topk: i64,
    pub use_fp8: bool,
    pub round_scale: bool,
    pub use_ue8m0: bool,
    /// Outputs (`E_local` experts, `R*T` rows each): `recv_x`
    /// `[E_local, R*T, H]` (fp8 e4m3 or bf16), with fp8 `recv_x_scales`,
    /// column-major in its last two dimensions (f32 `[E_local, R*T, H/128]`,
    /// or with ue8m0 int32 `[E_local, R*T, ceil(H/512)]` of packed exponents),
    /// `recv_count` int32 `[E_local]`, `src_info` int32 `[E_local, R*T]`,
    /// `layout_range` int64 `[E_local, R]`.
    pub outputs: Vec<OutputSpec>,
}

/// Checks `low_latency_dispatch` on a Buffer of `num_ranks` ranks on
/// `device` (whether the low-latency buffer holds the shape is the buffer's
/// check).
pub fn ll_dispatch(
    num_ranks: i64,
    device: i32,
    a: &LlDispatchArgs<'_>,
) -> ArgResult<LlDispatchPlan> {
    let x = a.x;
    Want::new(DType::BF16, &[None; 2], device).check("x", x)?;
    let (n, hidden) = (x.shape[0], x.shape[1]);
    let g = ll_geometry(
        num_ranks,
        "group size",
        a.num_max_dispatch_tokens_per_rank,
        hidden,
        a.num_experts,
    )?;
    let (t, el) = (g.max_tokens, g.experts_per_rank);
    if n > t {
        return value_err(format!(
            "x has {n} tokens, more than num_max_dispatch_tokens_per_rank={t}"
        ));
    }
    let (_, k) = topk_form("topk_idx", a.topk_idx, Some(n), device)?;
    if let Some(s) = a.cumulative_local_expert_recv_stats {
        Want::new(DType::I32, &[Some(el)], device)
            .check("cumulative_local_expert_recv_stats", s)?;
    }
    if let Some(s) = a.dispatch_wait_recv_cost_stats {
        Want::new(DType::I64, &[Some(num_ranks)], device)
            .check("dispatch_wait_recv_cost_stats", s)?;
    }
    if a.use_ue8m0 && !a.use_fp8 {
        return value_err("use_ue8m0=True needs use_fp8=True (bf16 dispatch has no scales)".into());
    }
    if a.use_ue8m0 && !a.round_scale {
        return value_err("use_ue8m0=True needs round_scale=True".into());
    }
    let rt = num_ranks * t;
    let x_dtype = if a.use_fp8 {
        DType::F8E4M3
    } else {
        DType::BF16
    };
    let mut outputs = vec![OutputSpec::new("recv_x", x_dtype, &[el, rt, hidden])];
    if a.use_fp8 {
        // Allocated as [E_local, cols, R*T] and viewed transposed.
        let groups = hidden / lim(FP8_GROUP_SIZE);
        let (dtype, cols) = if a.use_ue8m0 {
            (DType::I32, (groups + 3) / 4)
        } else {
            (DType::F32, groups)
        };
        outputs.push(OutputSpec::strided(
            "recv_x_scales",
            dtype,
            &[el, rt, cols],
            &[cols * rt, 1, rt],
        ));
    }
    outputs.extend([
        OutputSpec::new("recv_count", DType::I32, &[el]),
        OutputSpec::new("src_info", DType::I32, &[el, rt]),
        OutputSpec::new("layout_range", DType::I64, &[el, num_ranks]),
    ]);
    Ok(LlDispatchPlan {
        geometry: g,
        num_tokens: n,
        num_topk: k,
        use_fp8: a.use_fp8,
        round_scale: a.round_scale,
        use_ue8m0: a.use_ue8m0,
        outputs,
    })
}

/// A low-latency handle: `(src_info, layout_range,
/// num_max_dispatch_tokens_per_rank, hidden, num_experts)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LlHandle {
    pub src_info: TensorMeta,
    pub layout_range: TensorMeta,
    pub num_max_dispatch_tokens_per_rank: i64,
    pub hidden: i64,
    pub num_experts: i64,
}

/// A checked low-latency handle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LlHandlePlan {
    pub geometry: LlGeometry,
    /// `combine_buffer`, the bf16 `[E_local, R*T, H]` view of the buffer a
    /// zero-copy combine reads (`get_next_low_latency_combine_buffer`).
    pub outputs: Vec<OutputSpec>,
}

/// Checks a low-latency handle of a Buffer of `num_ranks` ranks on `device`.
pub fn ll_handle(num_ranks: i64, device: i32, h: &LlHandle) -> ArgResult<LlHandlePlan> {
    let g = ll_geometry(
        num_ranks,
        "group size",
        h.num_max_dispatch_tokens_per_rank,
        h.hidden,
        h.num_experts,
    )?;
    let (el, rt) = (g.experts_per_rank, num_ranks * g.max_tokens);
    Want::new(DType::I32, &[Some(el), Some(rt)], device)
        .check("handle[0] (src_info)", &h.src_info)?;
    Want::new(DType::I64, &[Some(el), Some(num_ranks)], device)
        .check("handle[1] (layout_range)", &h.layout_range)?;
    Ok(LlHandlePlan {
        geometry: g,
        outputs: vec![OutputSpec::new(
            "combine_buffer",
            DType::BF16,
            &[el, rt, g.hidden],
        )],
    })
}

/// The arguments of `low_latency_combine`.
#[derive(Clone, Copy, Debug)]
pub struct LlCombineArgs<'a> {
    /// The dispatch's handle: its shape is the combine's.
    pub handle: &'a LlHandle,
    pub use_logfmt: bool,
    pub zero_copy: bool,
    /// bf16 `[E_local, R*T, H]`; not read with `zero_copy` (None there).
    pub x: Option<&'a TensorMeta>,
    pub topk_idx: &'a TensorMeta,
    pub topk_weights: &'a TensorMeta,
    pub out: Option<&'a TensorMeta>,
    pub combine_wait_recv_cost_stats: Option<&'a TensorMeta>,
}

/// `low_latency_combine`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LlCombinePlan {
    pub geometry: LlGeometry,
    pub num_tokens: i64,
    pub num_topk: i64,
    /// Outputs: with `zero_copy`, `combine_buffer` (the view it reads as `x`,
    /// as [`ll_handle`] gives it); `combined_x` bf16 `[N, H]`, unless `out`
    /// is given.
    pub outputs: Vec<OutputSpec>,
}

/// Checks `low_latency_combine` on a Buffer of `num_ranks` ranks on `device`.
pub fn ll_combine(num_ranks: i64, device: i32, a: &LlCombineArgs<'_>) -> ArgResult<LlCombinePlan> {
    if a.use_logfmt {
        return value_err("use_logfmt=True is not supported by moelink (bf16 combine only)".into());
    }
    let handle = ll_handle(num_ranks, device, a.handle)?;
    let g = handle.geometry;
    let (t, hidden, el) = (g.max_tokens, g.hidden, g.experts_per_rank);
    if !a.zero_copy {
        let Some(x) = a.x else {
            return Err(ArgError {
                kind: ArgErrorKind::Type,
                message: "x must be a tensor unless zero_copy=True".into(),
            });
        };
        Want::new(
            DType::BF16,
            &[Some(el), Some(num_ranks * t), Some(hidden)],
            device,
        )
        .check("x", x)?;
    }
    let (n, k) = topk_form("topk_idx", a.topk_idx, None, device)?;
    if n > t {
        return value_err(format!(
            "topk_idx has {n} tokens, more than num_max_dispatch_tokens_per_rank={t}"
        ));
    }
    Want::new(DType::F32, &[Some(n), Some(k)], device).check("topk_weights", a.topk_weights)?;
    if let Some(s) = a.combine_wait_recv_cost_stats {
        Want::new(DType::I64, &[Some(num_ranks)], device)
            .check("combine_wait_recv_cost_stats", s)?;
    }
    let mut outputs = Vec::new();
    if a.zero_copy {
        outputs.extend(handle.outputs);
    }
    match a.out {
        Some(out) => Want::new(DType::BF16, &[Some(n), Some(hidden)], device).check("out", out)?,
        None => outputs.push(OutputSpec::new("combined_x", DType::BF16, &[n, hidden])),
    }
    Ok(LlCombinePlan {
        geometry: g,
        num_tokens: n,
        num_topk: k,
        outputs,
    })
}

/// Assertions of the tests here and in the submodules.
#[cfg(test)]
mod test_util {
    use super::{ArgErrorKind, ArgResult};
    use std::fmt;

    /// `r` is refused with exactly this kind and message.
    #[track_caller]
    pub(super) fn fails<T: fmt::Debug>(r: ArgResult<T>, kind: ArgErrorKind, message: &str) {
        let e = r.expect_err("the call must be refused");
        assert_eq!((e.kind, e.message.as_str()), (kind, message));
    }

    /// `r` is refused as a bad value with exactly this message.
    #[track_caller]
    pub(super) fn value<T: fmt::Debug>(r: ArgResult<T>, message: &str) {
        fails(r, ArgErrorKind::Value, message)
    }
}

#[cfg(test)]
mod tests {
    use super::test_util::{fails, value};
    use super::*;

    /// This rank's device, and the sizes of the calls: ranks, tokens, hidden,
    /// experts, top-k; low latency: T, experts per rank, rows per expert.
    const DEV: i32 = 0;
    const R: i64 = 4;
    const N: i64 = 32;
    const H: i64 = 256;
    const E: i64 = 16;
    const K: i64 = 4;
    const T: i64 = 16;
    const EL: i64 = E / R;
    const RT: i64 = R * T;

    fn t(dtype: DType, shape: &[i64]) -> TensorMeta {
        TensorMeta::contiguous(dtype, shape, DEV)
    }

    /// `t` with its last two dimensions' strides swapped (a transposed view of
    /// a contiguous tensor, not itself contiguous).
    fn col_major(dtype: DType, shape: &[i64]) -> TensorMeta {
        let mut m = t(dtype, shape);
        let d = m.dim();
        let mut rev = shape.to_vec();
        rev.swap(d - 2, d - 1);
        let mut s = contiguous_strides(&rev);
        s.swap(d - 2, d - 1);
        m.strides = s;
        m
    }

    fn on(mut m: TensorMeta, device: i32) -> TensorMeta {
        m.device = device;
        m
    }

    #[track_caller]
    fn dtype<T: fmt::Debug>(r: ArgResult<T>, message: &str) {
        fails(r, ArgErrorKind::Dtype, message)
    }

    /// `args` with `change` made.
    fn changed<A: Copy>(args: A, change: impl FnOnce(&mut A)) -> A {
        let mut a = args;
        change(&mut a);
        a
    }

    /// The outputs as `name dtype shape strides` (` zeroed` where so), joined
    /// by `; `.
    fn described(o: &[OutputSpec]) -> String {
        let one = |s: &OutputSpec| {
            let z = if s.zeroed { " zeroed" } else { "" };
            let (shape, strides) = (&s.shape, &s.strides);
            format!(
                "{} {} {shape:?} {strides:?}{z}",
                s.name,
                s.dtype.torch_name()
            )
        };
        o.iter().map(one).collect::<Vec<_>>().join("; ")
    }

    // ----- tensors ---------------------------------------------------------------

    #[test]
    fn dtypes_by_torch_name() {
        for (d, name) in NAMED.iter().zip(NAMES.split_whitespace()) {
            assert_eq!(DType::from_torch_name(name), *d);
            assert_eq!(DType::from_torch_name(&format!("torch.{name}")), *d);
            assert_eq!(d.torch_name(), name);
        }
        let c = DType::from_torch_name("torch.complex64");
        assert_eq!(c, DType::Other("complex64".into()));
        assert_eq!(
            (c.to_string(), c.element_size()),
            ("torch.complex64".into(), None)
        );
        assert_eq!(DType::BF16.to_string(), "torch.bfloat16");
        assert_eq!(DType::F8E4M3.to_string(), "torch.float8_e4m3fn");
        let sizes: Vec<_> = [
            DType::Bool,
            DType::BF16,
            DType::F32,
            DType::I64,
            DType::F8E4M3,
        ]
        .iter()
        .map(|d| d.element_size().unwrap())
        .collect();
        assert_eq!(sizes, [1, 2, 4, 8, 1]);
    }

    #[test]
    fn contiguity_as_torch_sees_it() {
        assert_eq!(contiguous_strides(&[2, 3, 4]), [12, 4, 1]);
        assert_eq!(contiguous_strides(&[0, 3]), [3, 1]);
        assert_eq!(contiguous_strides(&[3, 0]), [1, 1]);
        assert!(t(DType::F32, &[4, 8]).is_contiguous());
        assert!(!col_major(DType::F32, &[4, 8]).is_contiguous());
        // Size-1 dimensions may have any stride; empty tensors always are.
        let mut m = t(DType::F32, &[4, 1]);
        m.strides = vec![1, 99];
        assert!(m.is_contiguous());
        m = col_major(DType::F32, &[0, 8]);
        assert!(m.is_contiguous());
        m = t(DType::F32, &[4, 8]);
        m.strides = vec![16, 1]; // every other row
        assert!(!m.is_contiguous());
    }

    #[test]
    fn resolve_fills_the_received_rows() {
        let s = OutputSpec::strided("s", DType::F32, &[RECV_ROWS, 4], &[1, RECV_ROWS]);
        let r = s.resolve(10);
        assert_eq!((r.shape, r.strides), (vec![10, 4], vec![1, 10]));
        assert_eq!(s.resolve(0).strides, [1, 1]); // as torch strides an empty tensor
        let x = OutputSpec::new("x", DType::BF16, &[RECV_ROWS, 256]).resolve(3);
        assert_eq!((x.shape, x.strides), (vec![3, 256], vec![256, 1]));
    }

    // ----- layout ----------------------------------------------------------------

    #[test]
    fn layout_outputs() {
        let p = layout(R, DEV, &t(DType::I64, &[32, 8]), 16).unwrap();
        assert_eq!((p.num_tokens, p.num_topk, p.num_experts), (32, 8, 16));
        let scratch = ep_kernels::launch::layout_scratch_elems(32, 16, 4);
        let want = format!(
            "num_tokens_per_rank int32 [4] [1]; num_tokens_per_expert int32 [16] [1]; \
             is_token_in_rank bool [32, 4] [4, 1]; layout_scratch int32 [{scratch}] [1]"
        );
        assert_eq!(described(&p.outputs), want);
        let empty = layout(R, DEV, &t(DType::I64, &[0, 1]), 4).unwrap();
        assert_eq!(empty.num_tokens, 0);
    }

    #[test]
    fn layout_refuses() {
        let idx = t(DType::I64, &[32, 8]);
        value(
            layout(R, DEV, &idx, 0),
            "num_experts must be positive, got 0",
        );
        value(
            layout(R, DEV, &idx, 32769),
            "num_experts must be <= 32768, got 32769",
        );
        value(
            layout(R, DEV, &idx, 10),
            "num_experts must be a multiple of num_ranks, got num_experts=10 and num_ranks=4",
        );
        value(
            layout(1, DEV, &idx, 2048),
            "num_experts must be at most 1024 per rank, got num_experts=2048 over num_ranks=1 \
             (2048 per rank)",
        );
        value(layout(0, DEV, &idx, 8), "num_ranks must be positive, got 0");
        value(layout(33, DEV, &idx, 66), "num_ranks must be <= 32, got 33");
        value(
            layout(R, 1, &on(idx, OTHER_DEVICE), 16),
            "topk_idx must be on this Buffer's device cuda:1, got a device that is neither CUDA \
             nor the CPU",
        );
    }

    /// One call with one tensor argument replaced; `Ok(())` where it passes.
    type Call<'a> = Box<dyn Fn(&TensorMeta) -> ArgResult<()> + 'a>;

    #[test]
    fn x_is_checked_alike_by_every_call() {
        let (i, l, h) = (inputs(), ll(), ll_handle_of());
        let (idx, w) = (t(DType::I64, &[T, K]), t(DType::F32, &[T, K]));
        let combine_x: Call<'_> = Box::new(|x| {
            let (handle, topk_weights, bias) = (&i.handle, None, None);
            combine(
                R,
                DEV,
                &CombineArgs {
                    x,
                    handle,
                    topk_weights,
                    bias,
                },
            )
            .map(drop)
        });
        let ll_combine_x: Call<'_> = Box::new(|x| {
            let mut a = ll_combine_args(&h, &idx, &w);
            (a.x, a.zero_copy) = (Some(x), false);
            ll_combine(R, DEV, &a).map(drop)
        });
        let calls: [(Call<'_>, &[i64]); 4] = [
            (
                Box::new(|x| dispatch(R, DEV, &DispatchArgs { x, ..full(&i) }).map(drop)),
                &[N, H],
            ),
            (combine_x, &[50, H]),
            (
                Box::new(|x| ll_dispatch(R, DEV, &LlDispatchArgs { x, ..ll_args(&l) }).map(drop)),
                &[T, H],
            ),
            (ll_combine_x, &[EL, RT, H]),
        ];
        for (call, shape) in &calls {
            call(&t(DType::BF16, shape)).unwrap();
            let f32 = "x must have dtype torch.bfloat16, got torch.float32";
            dtype(call(&t(DType::F32, shape)), f32);
            let cpu = "x must be on this Buffer's device cuda:0, got cpu";
            value(call(&on(t(DType::BF16, shape), CPU)), cpu);
            let strided = col_major(DType::BF16, shape);
            let (dims, strides) = (shape.to_vec(), &strided.strides);
            let msg = format!("x must be contiguous, got shape {dims:?} with strides {strides:?}");
            value(call(&strided), &msg);
        }
    }

    #[test]
    fn topk_idx_is_checked_alike_by_every_call() {
        let (i, l, h) = (inputs(), ll(), ll_handle_of());
        let w = t(DType::F32, &[T, K]);
        let dispatch_idx: Call<'_> = Box::new(|idx| {
            let (topk_idx, topk_weights) = (Some(idx), None);
            dispatch(
                R,
                DEV,
                &DispatchArgs {
                    topk_idx,
                    topk_weights,
                    ..full(&i)
                },
            )
            .map(drop)
        });
        let ll_dispatch_idx: Call<'_> = Box::new(|idx| {
            let topk_idx = idx;
            ll_dispatch(
                R,
                DEV,
                &LlDispatchArgs {
                    topk_idx,
                    ..ll_args(&l)
                },
            )
            .map(drop)
        });
        let calls: [(Call<'_>, i64); 4] = [
            (Box::new(|idx| layout(R, DEV, idx, E).map(drop)), N),
            (dispatch_idx, N),
            (ll_dispatch_idx, T),
            (
                Box::new(|idx| ll_combine(R, DEV, &ll_combine_args(&h, idx, &w)).map(drop)),
                T,
            ),
        ];
        for (call, n) in &calls {
            let n = *n;
            call(&t(DType::I64, &[n, K])).unwrap();
            let i32 = "topk_idx must have dtype torch.int64, got torch.int32";
            dtype(call(&t(DType::I32, &[n, K])), i32);
            let one_d = format!("topk_idx must be 2-D, got 1-D with shape [{n}]");
            value(call(&t(DType::I64, &[n])), &one_d);
            for k in [0, 33] {
                let cols = "topk_idx must have 1 to 32 columns (experts per token), got shape";
                value(call(&t(DType::I64, &[n, k])), &format!("{cols} [{n}, {k}]"));
            }
            let cpu = "topk_idx must be on this Buffer's device cuda:0, got cpu";
            value(call(&on(t(DType::I64, &[n, K]), CPU)), cpu);
            let strided =
                format!("topk_idx must be contiguous, got shape [{n}, 4] with strides [1, {n}]");
            value(call(&col_major(DType::I64, &[n, K])), &strided);
        }
    }

    // ----- dispatch --------------------------------------------------------------

    /// A full dispatch's tensors (bf16 x, top-k with weights) and a handle.
    struct Inputs {
        x: TensorMeta,
        x8: TensorMeta,
        scales: TensorMeta,
        per_rank: TensorMeta,
        in_rank: TensorMeta,
        per_expert: TensorMeta,
        idx: TensorMeta,
        w: TensorMeta,
        handle: IntranodeHandle,
    }

    fn inputs() -> Inputs {
        Inputs {
            x: t(DType::BF16, &[N, H]),
            x8: t(DType::F8E4M3, &[N, H]),
            scales: t(DType::F32, &[N, H / 128]),
            per_rank: t(DType::I32, &[R]),
            in_rank: t(DType::Bool, &[N, R]),
            per_expert: t(DType::I32, &[E]),
            idx: t(DType::I64, &[N, K]),
            w: t(DType::F32, &[N, K]),
            handle: IntranodeHandle {
                rank_prefix_matrix: t(DType::I32, &[R, R]),
                recv_src_idx: t(DType::I32, &[50]),
                is_token_in_rank: t(DType::Bool, &[N, R]),
                send_head: t(DType::I32, &[N, R]),
            },
        }
    }

    fn full(i: &Inputs) -> DispatchArgs<'_> {
        DispatchArgs {
            x: &i.x,
            scales: None,
            handle: None,
            num_tokens_per_rank: Some(&i.per_rank),
            num_tokens_per_rdma_rank: false,
            is_token_in_rank: Some(&i.in_rank),
            num_tokens_per_expert: Some(&i.per_expert),
            topk_idx: Some(&i.idx),
            topk_weights: Some(&i.w),
            expert_alignment: 1,
            num_worst_tokens: 0,
        }
    }

    fn cached(i: &Inputs) -> DispatchArgs<'_> {
        DispatchArgs {
            handle: Some(&i.handle),
            num_tokens_per_rank: None,
            is_token_in_rank: None,
            num_tokens_per_expert: None,
            topk_idx: None,
            topk_weights: None,
            ..full(i)
        }
    }

    fn fp8<'a>(i: &'a Inputs, a: DispatchArgs<'a>) -> DispatchArgs<'a> {
        DispatchArgs {
            x: &i.x8,
            scales: Some(&i.scales),
            ..a
        }
    }

    #[test]
    fn full_dispatch_outputs() {
        let i = inputs();
        let p = dispatch(R, DEV, &full(&i)).unwrap();
        assert!(!p.cached);
        let values = (p.num_tokens, p.hidden_bytes, p.num_scales, p.scale_strides);
        assert_eq!(values, (N, 2 * H, 0, (0, 0)));
        let counts = (p.num_experts, p.num_topk, p.num_recv_rows);
        assert_eq!(counts, (E, K, RECV_ROWS));
        let head = "rank_prefix_matrix int32 [4, 4] [4, 1]; send_head int32 [32, 4] [4, 1]";
        let tail = "channel_prefix_matrix int32 [4, 1] [1, 1] zeroed; \
                    recv_channel_prefix_matrix int32 [4, 1] [1, 1] zeroed";
        let recv = "recv_x bfloat16 [-1, 256] [256, 1]; recv_topk_idx int64 [-1, 4] [4, 1]; \
                    recv_topk_weights float32 [-1, 4] [4, 1]; recv_src_idx int32 [-1] [1]";
        assert_eq!(described(&p.outputs), format!("{head}; {recv}; {tail}"));

        // num_worst_tokens fixes the rows; no weights, no top-k.
        let mut a = full(&i);
        (a.num_worst_tokens, a.topk_weights) = (64, None);
        let p = dispatch(R, DEV, &a).unwrap();
        assert_eq!(p.num_recv_rows, 64);
        let recv = "recv_x bfloat16 [64, 256] [256, 1]; recv_topk_idx int64 [64, 4] [4, 1]; \
                    recv_src_idx int32 [64] [1]";
        assert_eq!(described(&p.outputs), format!("{head}; {recv}; {tail}"));
        (a.num_worst_tokens, a.topk_idx, a.expert_alignment) = (0, None, 128);
        let p = dispatch(R, DEV, &a).unwrap();
        assert_eq!((p.num_topk, p.expert_alignment), (0, 128));
        let recv = "recv_x bfloat16 [-1, 256] [256, 1]; recv_src_idx int32 [-1] [1]";
        assert_eq!(described(&p.outputs), format!("{head}; {recv}; {tail}"));
    }

    #[test]
    fn fp8_dispatch_keeps_the_scales_layout() {
        let mut i = inputs();
        let p = dispatch(R, DEV, &fp8(&i, full(&i))).unwrap();
        assert_eq!(
            (p.hidden_bytes, p.num_scales, p.scale_strides),
            (H, 2, (2, 1))
        );
        let recv = "recv_x float8_e4m3fn [-1, 256] [256, 1]; recv_x_scales float32 [-1, 2] [2, 1]";
        assert_eq!(described(&p.outputs[2..4]), recv);
        // Column-major scales (DeepGEMM's) come back column-major.
        i.scales = col_major(DType::F32, &[N, H / 128]);
        let p = dispatch(R, DEV, &fp8(&i, full(&i))).unwrap();
        assert_eq!(p.scale_strides, (1, N));
        let scales = &p.outputs[3];
        assert_eq!(
            described(&p.outputs[3..4]),
            "recv_x_scales float32 [-1, 2] [1, -1]"
        );
        assert_eq!(scales.resolve(7).strides, [1, 7]);
        let mut a = fp8(&i, full(&i));
        a.num_worst_tokens = 64;
        let p = dispatch(R, DEV, &a).unwrap();
        assert_eq!(
            described(&p.outputs[3..4]),
            "recv_x_scales float32 [64, 2] [1, 64]"
        );
        // A cached fp8 dispatch: the handle's rows.
        let p = dispatch(R, DEV, &fp8(&i, cached(&i))).unwrap();
        let recv = "recv_x float8_e4m3fn [50, 256] [256, 1]; recv_x_scales float32 [50, 2] [1, 50]";
        assert_eq!(described(&p.outputs), recv);
    }

    #[test]
    fn cached_dispatch_outputs() {
        let i = inputs();
        let p = dispatch(R, DEV, &cached(&i)).unwrap();
        assert!(p.cached);
        assert_eq!((p.num_recv_rows, p.num_experts, p.num_topk), (50, 0, 0));
        assert_eq!(described(&p.outputs), "recv_x bfloat16 [50, 256] [256, 1]");
    }

    #[test]
    fn dispatch_refuses_x() {
        let mut i = inputs();
        let d = |i: &Inputs| dispatch(R, DEV, &full(i));
        i.x = t(DType::F8E4M3, &[N, H]); // fp8 without scales
        dtype(
            d(&i),
            "x must have dtype torch.bfloat16, got torch.float8_e4m3fn",
        );
        i.x = t(DType::BF16, &[2, N, H]);
        value(d(&i), "x must be 2-D, got 3-D with shape [2, 32, 256]");
        i.x = t(DType::BF16, &[N, 100]);
        value(
            d(&i),
            "x rows must be a positive multiple of 128 bytes up to 1048576, got hidden=100 of \
             torch.bfloat16 (200 bytes)",
        );
        i.x = t(DType::BF16, &[N, 0]);
        value(
            d(&i),
            "x rows must be a positive multiple of 128 bytes up to 1048576, got hidden=0 of \
             torch.bfloat16 (0 bytes)",
        );
        i.x = t(DType::BF16, &[N, (1 << 19) + 64]);
        value(
            d(&i),
            "x rows must be a positive multiple of 128 bytes up to 1048576, got hidden=524352 \
             of torch.bfloat16 (1048704 bytes)",
        );
        i.x = t(DType::BF16, &[N, 64]); // 128 bytes: the smallest row
        assert_eq!(d(&i).unwrap().hidden_bytes, 128);
    }

    #[test]
    fn dispatch_refuses_fp8_x() {
        let mut i = inputs();
        let d = |i: &Inputs| dispatch(R, DEV, &fp8(i, full(i)));
        i.x8 = t(DType::BF16, &[N, H]);
        dtype(
            d(&i),
            "x[0] must have dtype torch.float8_e4m3fn, got torch.bfloat16",
        );
        i.x8 = t(DType::F8E5M2, &[N, H]);
        dtype(
            d(&i),
            "x[0] must have dtype torch.float8_e4m3fn, got torch.float8_e5m2",
        );
        i.x8 = t(DType::F8E4M3, &[N, 192]);
        value(
            d(&i),
            "x[0] rows must be a positive multiple of 128 bytes up to 1048576, got hidden=192 \
             of torch.float8_e4m3fn (192 bytes)",
        );
        i.x8 = t(DType::F8E4M3, &[N, H]);
        i.scales = t(DType::BF16, &[N, 2]);
        dtype(
            d(&i),
            "x[1] (scales) must have dtype torch.float32, got torch.bfloat16",
        );
        i.scales = t(DType::F32, &[N, 3]);
        value(d(&i), "x[1] (scales) must have shape [32, 2], got [32, 3]");
        i.scales = col_major(DType::F32, &[2, N]);
        value(d(&i), "x[1] (scales) must have shape [32, 2], got [2, 32]");
        i.scales = t(DType::F32, &[N]);
        value(d(&i), "x[1] (scales) must be 2-D, got 1-D with shape [32]");
        i.scales = on(t(DType::F32, &[N, 2]), CPU);
        value(
            d(&i),
            "x[1] (scales) must be on this Buffer's device cuda:0, got cpu",
        );
        // Any strides: a broadcast row is fine.
        i.scales = t(DType::F32, &[N, 2]);
        i.scales.strides = vec![0, 1];
        assert_eq!(d(&i).unwrap().scale_strides, (0, 1));
    }

    #[test]
    fn dispatch_refuses_scalars() {
        let i = inputs();
        let d = |a: DispatchArgs<'_>| dispatch(R, DEV, &a);
        let a = full(&i);
        value(
            d(DispatchArgs {
                expert_alignment: 0,
                ..a
            }),
            "expert_alignment must be positive, got 0",
        );
        value(
            d(DispatchArgs {
                expert_alignment: 1 << 31,
                ..a
            }),
            "expert_alignment must be <= 2147483647, got 2147483648",
        );
        value(
            d(DispatchArgs {
                num_worst_tokens: -1,
                ..a
            }),
            "num_worst_tokens must be >= 0, got -1",
        );
        value(
            d(DispatchArgs {
                num_worst_tokens: lim(MAX_RECV_TOKENS) + 1,
                ..a
            }),
            "num_worst_tokens must be <= 2147483616, got 2147483617",
        );
        value(
            d(DispatchArgs {
                num_tokens_per_rdma_rank: true,
                ..a
            }),
            "num_tokens_per_rdma_rank must be None within one node",
        );
    }

    #[test]
    fn dispatch_refuses_layout_and_topk() {
        let mut i = inputs();
        let d = |a: DispatchArgs<'_>| dispatch(R, DEV, &a);
        let missing = "dispatch without a handle needs num_tokens_per_rank, is_token_in_rank and \
                       num_tokens_per_expert (from get_dispatch_layout)";
        let a = full(&i);
        value(
            d(DispatchArgs {
                num_tokens_per_rank: None,
                ..a
            }),
            missing,
        );
        value(
            d(DispatchArgs {
                is_token_in_rank: None,
                ..a
            }),
            missing,
        );
        value(
            d(DispatchArgs {
                num_tokens_per_expert: None,
                ..a
            }),
            missing,
        );
        value(
            d(DispatchArgs {
                topk_idx: None,
                ..a
            }),
            "topk_weights needs topk_idx",
        );
        let f = |i: &Inputs| dispatch(R, DEV, &full(i));
        i.per_rank = t(DType::I32, &[R + 1]);
        value(f(&i), "num_tokens_per_rank must have shape [4], got [5]");
        i.per_rank = t(DType::I64, &[R]);
        dtype(
            f(&i),
            "num_tokens_per_rank must have dtype torch.int32, got torch.int64",
        );
        i.per_rank = t(DType::I32, &[R]);
        i.per_rank.strides = vec![2]; // read for its shape only: any strides
        assert!(f(&i).is_ok());
        i.in_rank = t(DType::Bool, &[N - 1, R]);
        value(
            f(&i),
            "is_token_in_rank must have shape [32, 4], got [31, 4]",
        );
        i.in_rank = t(DType::I32, &[N, R]);
        dtype(
            f(&i),
            "is_token_in_rank must have dtype torch.bool, got torch.int32",
        );
        i.in_rank = col_major(DType::Bool, &[N, R]);
        value(
            f(&i),
            "is_token_in_rank must be contiguous, got shape [32, 4] with strides [1, 32]",
        );
        i.in_rank = on(t(DType::Bool, &[N, R]), 1);
        value(
            f(&i),
            "is_token_in_rank must be on this Buffer's device cuda:0, got cuda:1",
        );
        i.in_rank = t(DType::Bool, &[N, R]);
        i.per_expert = t(DType::I32, &[E + 1]);
        value(
            f(&i),
            "num_experts must be a multiple of num_ranks, got num_experts=17 and num_ranks=4",
        );
        i.per_expert = t(DType::I32, &[0]);
        value(f(&i), "num_experts must be positive, got 0");
        i.per_expert = t(DType::I32, &[R, R]);
        value(
            f(&i),
            "num_tokens_per_expert must be 1-D, got 2-D with shape [4, 4]",
        );
        i.per_expert = t(DType::I32, &[E]);
        i.idx = t(DType::I64, &[N - 1, K]);
        value(f(&i), "topk_idx must have shape [32, *], got [31, 4]");
        i.idx = t(DType::I64, &[N, K]);
        i.w = t(DType::F32, &[N, K - 1]);
        value(f(&i), "topk_weights must have shape [32, 4], got [32, 3]");
        i.w = t(DType::BF16, &[N, K]);
        dtype(
            f(&i),
            "topk_weights must have dtype torch.float32, got torch.bfloat16",
        );
        i.w = col_major(DType::F32, &[N, K]);
        value(
            f(&i),
            "topk_weights must be contiguous, got shape [32, 4] with strides [1, 32]",
        );
    }

    #[test]
    fn dispatch_refuses_handles() {
        let mut i = inputs();
        let d = |a: DispatchArgs<'_>| dispatch(R, DEV, &a);
        let no_topk = "cached dispatch (handle given) takes no topk_idx / topk_weights";
        let a = cached(&i);
        value(
            d(DispatchArgs {
                topk_idx: Some(&i.idx),
                ..a
            }),
            no_topk,
        );
        value(
            d(DispatchArgs {
                topk_weights: Some(&i.w),
                ..a
            }),
            no_topk,
        );
        let x16 = t(DType::BF16, &[16, H]);
        value(
            d(DispatchArgs { x: &x16, ..a }),
            "x has 16 tokens but the handle was made for 32",
        );
        let c = |i: &Inputs| dispatch(R, DEV, &cached(i));
        i.handle.rank_prefix_matrix = t(DType::I32, &[R, R + 1]);
        value(
            c(&i),
            "handle[0] (rank_prefix_matrix) must have shape [4, 4], got [4, 5]",
        );
        i.handle.rank_prefix_matrix = t(DType::I64, &[R, R]);
        dtype(
            c(&i),
            "handle[0] (rank_prefix_matrix) must have dtype torch.int32, got torch.int64",
        );
        i.handle.rank_prefix_matrix = t(DType::I32, &[R, R]);
        i.handle.recv_src_idx = t(DType::I32, &[50, 1]);
        value(
            c(&i),
            "handle[3] (recv_src_idx) must be 1-D, got 2-D with shape [50, 1]",
        );
        i.handle.recv_src_idx = t(DType::I32, &[50]);
        i.handle.is_token_in_rank = t(DType::I32, &[N, R]);
        dtype(
            c(&i),
            "handle[4] (is_token_in_rank) must have dtype torch.bool, got torch.int32",
        );
        i.handle.is_token_in_rank = on(col_major(DType::Bool, &[N, R]), CPU);
        assert!(c(&i).is_ok(), "is_token_in_rank is not read by the kernels");
        i.handle.send_head = t(DType::I32, &[N, R + 1]);
        value(
            c(&i),
            "handle[5] (send_head) must have 4 columns, got [32, 5]",
        );
        i.handle.send_head = t(DType::I32, &[N]);
        value(
            c(&i),
            "handle[5] (send_head) must be 2-D, got 1-D with shape [32]",
        );
        i.handle.send_head = on(t(DType::I32, &[N, R]), CPU);
        value(
            c(&i),
            "handle[5] (send_head) must be on this Buffer's device cuda:0, got cpu",
        );
        i.handle.send_head = t(DType::I32, &[N, R]);
        let h = intranode_handle(R, DEV, &i.handle, None).unwrap();
        assert_eq!((h.num_recv_rows, h.num_tokens), (50, N));
    }

    // ----- combine ---------------------------------------------------------------

    #[test]
    fn combine_outputs() {
        let i = inputs();
        let (y, w) = (t(DType::BF16, &[50, H]), t(DType::F32, &[50, K]));
        let b = t(DType::BF16, &[N, H]);
        let a = CombineArgs {
            x: &y,
            handle: &i.handle,
            topk_weights: Some(&w),
            bias: Some(Bias::Pair(None, Some(&b))),
        };
        let p = combine(R, DEV, &a).unwrap();
        let values = (p.num_recv_rows, p.hidden, p.num_tokens, p.num_topk);
        assert_eq!(values, (50, H, N, K));
        let out = "combined_x bfloat16 [32, 256] [256, 1]";
        let w = "combined_topk_weights float32 [32, 4] [4, 1]";
        assert_eq!(described(&p.outputs), format!("{out}; {w}"));
        let a = CombineArgs {
            topk_weights: None,
            bias: Some(Bias::One(&b)),
            ..a
        };
        let p = combine(R, DEV, &a).unwrap();
        assert_eq!(p.num_topk, 0);
        assert_eq!(described(&p.outputs), out);
    }

    #[test]
    fn combine_refuses() {
        let mut i = inputs();
        let w = t(DType::F32, &[50, K]);
        let c = |i: &Inputs, y: &TensorMeta, w: Option<&TensorMeta>, bias: Option<Bias<'_>>| {
            let a = CombineArgs {
                x: y,
                handle: &i.handle,
                topk_weights: w,
                bias,
            };
            combine(R, DEV, &a)
        };
        let y = t(DType::BF16, &[50, H]);
        value(
            c(&i, &t(DType::BF16, &[51, H]), None, None),
            "x must have the 50 rows dispatch delivered, got 51",
        );
        value(
            c(&i, &t(DType::BF16, &[50, 100]), None, None),
            "x rows must be a positive multiple of 128 bytes up to 1048576, got hidden=100 of \
             torch.bfloat16 (200 bytes)",
        );
        value(
            c(&i, &y, Some(&t(DType::F32, &[51, K])), None),
            "topk_weights must be [50, K] with 1 <= K <= 32, got [51, 4]",
        );
        value(
            c(&i, &y, Some(&t(DType::F32, &[50, 33])), None),
            "topk_weights must be [50, K] with 1 <= K <= 32, got [50, 33]",
        );
        dtype(
            c(&i, &y, Some(&t(DType::F64, &[50, K])), None),
            "topk_weights must have dtype torch.float32, got torch.float64",
        );
        let b = t(DType::BF16, &[N + 1, H]);
        value(
            c(&i, &y, Some(&w), Some(Bias::One(&b))),
            "bias must have shape [32, 256], got [33, 256]",
        );
        let (b0, b1) = (t(DType::BF16, &[N, H]), t(DType::BF16, &[N, 2 * H]));
        value(
            c(&i, &y, None, Some(Bias::Pair(Some(&b0), Some(&b1)))),
            "bias[1] must have shape [32, 256], got [32, 512]",
        );
        let b = t(DType::F16, &[N, H]);
        dtype(
            c(&i, &y, None, Some(Bias::Pair(Some(&b), None))),
            "bias[0] must have dtype torch.bfloat16, got torch.float16",
        );
        let b = col_major(DType::BF16, &[N, H]);
        value(
            c(&i, &y, None, Some(Bias::Pair(Some(&b), None))),
            "bias[0] must be contiguous, got shape [32, 256] with strides [1, 32]",
        );
        i.handle.send_head = t(DType::I32, &[N, R - 1]);
        value(
            c(&i, &y, None, None),
            "handle[5] (send_head) must have 4 columns, got [32, 3]",
        );
    }

    // ----- low latency -----------------------------------------------------------

    #[test]
    fn ll_geometry_refuses() {
        let g = ll_geometry(R, "group size", T, 7168, 288).unwrap();
        assert_eq!(
            (g.max_tokens, g.hidden, g.num_experts, g.experts_per_rank),
            (T, 7168, 288, 72)
        );
        let gs = |t, h, e| ll_geometry(R, "group size", t, h, e);
        value(
            gs(0, H, E),
            "num_max_dispatch_tokens_per_rank must be positive, got 0",
        );
        value(
            gs(lim(LL_MAX_TOKENS_PER_RANK) + 1, H, E),
            "num_max_dispatch_tokens_per_rank must be <= 2097151, got 2097152",
        );
        for h in [0, 100, 8320, -128] {
            value(
                gs(T, h, E),
                &format!("hidden must be a positive multiple of 128 up to 8192, got {h}"),
            );
        }
        value(
            gs(T, H, 17),
            "num_experts must be a multiple of group size, got num_experts=17 and group size=4",
        );
        value(
            ll_geometry(33, "num_ranks", T, H, 66),
            "num_ranks must be <= 32, got 33",
        );
    }

    struct Ll {
        x: TensorMeta,
        idx: TensorMeta,
        count: TensorMeta,
        wait: TensorMeta,
    }

    fn ll() -> Ll {
        Ll {
            x: t(DType::BF16, &[T, H]),
            idx: t(DType::I64, &[T, K]),
            count: t(DType::I32, &[EL]),
            wait: t(DType::I64, &[R]),
        }
    }

    fn ll_args(l: &Ll) -> LlDispatchArgs<'_> {
        LlDispatchArgs {
            x: &l.x,
            topk_idx: &l.idx,
            num_max_dispatch_tokens_per_rank: T,
            num_experts: E,
            cumulative_local_expert_recv_stats: Some(&l.count),
            dispatch_wait_recv_cost_stats: Some(&l.wait),
            use_fp8: true,
            round_scale: false,
            use_ue8m0: false,
        }
    }

    #[test]
    fn ll_dispatch_outputs() {
        let l = ll();
        let p = ll_dispatch(R, DEV, &ll_args(&l)).unwrap();
        let values = (p.num_tokens, p.num_topk, p.geometry.experts_per_rank);
        assert_eq!(values, (T, K, EL));
        let tail = "recv_count int32 [4] [1]; src_info int32 [4, 64] [64, 1]; \
                    layout_range int64 [4, 4] [4, 1]";
        // The scales are column-major in their last two dimensions.
        let fp8 = "recv_x float8_e4m3fn [4, 64, 256] [16384, 256, 1]; \
                   recv_x_scales float32 [4, 64, 2] [128, 1, 64]";
        assert_eq!(described(&p.outputs), format!("{fp8}; {tail}"));
        // ue8m0: exponents packed 4 per int32.
        let mut l = ll();
        l.x = t(DType::BF16, &[T, 2048]);
        let mut a = ll_args(&l);
        (a.round_scale, a.use_ue8m0) = (true, true);
        let p = ll_dispatch(R, DEV, &a).unwrap();
        assert!(p.use_ue8m0 && p.round_scale && p.use_fp8);
        let scales = "recv_x_scales int32 [4, 64, 4] [256, 1, 64]";
        assert_eq!(described(&p.outputs[1..2]), scales);
        let x640 = t(DType::BF16, &[T, 640]);
        let p = ll_dispatch(R, DEV, &LlDispatchArgs { x: &x640, ..a }).unwrap();
        let scales = "recv_x_scales int32 [4, 64, 2] [128, 1, 64]";
        assert_eq!(described(&p.outputs[1..2]), scales);
        // bf16: no scales.
        a.use_fp8 = false;
        (a.round_scale, a.use_ue8m0) = (false, false);
        let p = ll_dispatch(R, DEV, &a).unwrap();
        let bf16 = "recv_x bfloat16 [4, 64, 2048] [131072, 2048, 1]";
        assert_eq!(described(&p.outputs), format!("{bf16}; {tail}"));
    }

    #[test]
    fn ll_dispatch_refuses() {
        let mut l = ll();
        let d = |l: &Ll| ll_dispatch(R, DEV, &ll_args(l));
        l.x = t(DType::BF16, &[T, 100]);
        value(
            d(&l),
            "hidden must be a positive multiple of 128 up to 8192, got 100",
        );
        l.x = t(DType::BF16, &[T + 1, H]);
        l.idx = t(DType::I64, &[T + 1, K]);
        value(
            d(&l),
            "x has 17 tokens, more than num_max_dispatch_tokens_per_rank=16",
        );
        l.x = t(DType::BF16, &[T, H]);
        value(d(&l), "topk_idx must have shape [16, *], got [17, 4]");
        l.idx = t(DType::I64, &[T, K]);
        l.count = t(DType::I32, &[EL + 1]);
        value(
            d(&l),
            "cumulative_local_expert_recv_stats must have shape [4], got [5]",
        );
        l.count = t(DType::I64, &[EL]);
        dtype(
            d(&l),
            "cumulative_local_expert_recv_stats must have dtype torch.int32, got torch.int64",
        );
        l.count = t(DType::I32, &[EL]);
        l.wait = t(DType::I32, &[R]);
        dtype(
            d(&l),
            "dispatch_wait_recv_cost_stats must have dtype torch.int64, got torch.int32",
        );
        l.wait = on(t(DType::I64, &[R]), CPU);
        value(
            d(&l),
            "dispatch_wait_recv_cost_stats must be on this Buffer's device cuda:0, got cpu",
        );
        l.wait = t(DType::I64, &[R]);
        let e = |a: LlDispatchArgs<'_>| ll_dispatch(R, DEV, &a);
        let a = ll_args(&l);
        value(
            e(LlDispatchArgs {
                num_experts: E + 1,
                ..a
            }),
            "num_experts must be a multiple of group size, got num_experts=17 and group size=4",
        );
        value(
            e(LlDispatchArgs {
                num_max_dispatch_tokens_per_rank: 8,
                ..a
            }),
            "x has 16 tokens, more than num_max_dispatch_tokens_per_rank=8",
        );
        value(
            e(LlDispatchArgs {
                use_fp8: false,
                round_scale: true,
                use_ue8m0: true,
                ..a
            }),
            "use_ue8m0=True needs use_fp8=True (bf16 dispatch has no scales)",
        );
        value(
            e(LlDispatchArgs {
                use_ue8m0: true,
                ..a
            }),
            "use_ue8m0=True needs round_scale=True",
        );
    }

    /// A low-latency combine of `handle`'s shape (zero-copy: x is not read).
    fn ll_combine_args<'a>(
        handle: &'a LlHandle,
        topk_idx: &'a TensorMeta,
        topk_weights: &'a TensorMeta,
    ) -> LlCombineArgs<'a> {
        LlCombineArgs {
            handle,
            use_logfmt: false,
            zero_copy: true,
            x: None,
            topk_idx,
            topk_weights,
            out: None,
            combine_wait_recv_cost_stats: None,
        }
    }

    fn ll_handle_of() -> LlHandle {
        LlHandle {
            src_info: t(DType::I32, &[EL, RT]),
            layout_range: t(DType::I64, &[EL, R]),
            num_max_dispatch_tokens_per_rank: T,
            hidden: H,
            num_experts: E,
        }
    }

    #[test]
    fn ll_handle_checks_and_combine_buffer() {
        let mut h = ll_handle_of();
        let p = ll_handle(R, DEV, &h).unwrap();
        assert_eq!(p.geometry.max_tokens, T);
        let buffer = "combine_buffer bfloat16 [4, 64, 256] [16384, 256, 1]";
        assert_eq!(described(&p.outputs), buffer);
        h.src_info = t(DType::I64, &[EL, RT]);
        dtype(
            ll_handle(R, DEV, &h),
            "handle[0] (src_info) must have dtype torch.int32, got torch.int64",
        );
        h.src_info = t(DType::I32, &[EL, RT / 2]);
        value(
            ll_handle(R, DEV, &h),
            "handle[0] (src_info) must have shape [4, 64], got [4, 32]",
        );
        h.src_info = on(t(DType::I32, &[EL, RT]), CPU);
        value(
            ll_handle(R, DEV, &h),
            "handle[0] (src_info) must be on this Buffer's device cuda:0, got cpu",
        );
        h.src_info = t(DType::I32, &[EL, RT]);
        h.layout_range = t(DType::I64, &[EL, R + 1]);
        value(
            ll_handle(R, DEV, &h),
            "handle[1] (layout_range) must have shape [4, 4], got [4, 5]",
        );
        h.layout_range = t(DType::I32, &[EL, R]);
        dtype(
            ll_handle(R, DEV, &h),
            "handle[1] (layout_range) must have dtype torch.int64, got torch.int32",
        );
        h.layout_range = t(DType::I64, &[EL, R]);
        h.hidden = 100;
        value(
            ll_handle(R, DEV, &h),
            "hidden must be a positive multiple of 128 up to 8192, got 100",
        );
    }

    #[test]
    fn ll_combine_outputs_and_refusals() {
        let h = ll_handle_of();
        let bad_h = LlHandle {
            num_max_dispatch_tokens_per_rank: 0,
            ..ll_handle_of()
        };
        let (y, out) = (t(DType::BF16, &[EL, RT, H]), t(DType::BF16, &[T, H]));
        let (idx, w) = (t(DType::I64, &[T, K]), t(DType::F32, &[T, K]));
        let stats = t(DType::I64, &[R]);
        let a = LlCombineArgs {
            x: Some(&y),
            zero_copy: false,
            combine_wait_recv_cost_stats: Some(&stats),
            ..ll_combine_args(&h, &idx, &w)
        };
        let c = |a: LlCombineArgs<'_>| ll_combine(R, DEV, &a);
        let p = c(a).unwrap();
        assert_eq!((p.num_tokens, p.num_topk, p.geometry.hidden), (T, K, H));
        let combined = "combined_x bfloat16 [16, 256] [256, 1]";
        assert_eq!(described(&p.outputs), combined);
        assert!(c(changed(a, |a| a.out = Some(&out)))
            .unwrap()
            .outputs
            .is_empty());
        // zero_copy reads the buffer, not x.
        let p = c(changed(a, |a| (a.x, a.zero_copy) = (None, true))).unwrap();
        let buffer = "combine_buffer bfloat16 [4, 64, 256] [16384, 256, 1]";
        assert_eq!(described(&p.outputs), format!("{buffer}; {combined}"));

        let logfmt = "use_logfmt=True is not supported by moelink (bf16 combine only)";
        value(c(changed(a, |a| a.use_logfmt = true)), logfmt);
        fails(
            c(changed(a, |a| a.x = None)),
            ArgErrorKind::Type,
            "x must be a tensor unless zero_copy=True",
        );
        let half = t(DType::BF16, &[EL, RT / 2, H]);
        let x_shape = "x must have shape [4, 64, 256], got [4, 32, 256]";
        value(c(changed(a, |a| a.x = Some(&half))), x_shape);
        let t0 = "num_max_dispatch_tokens_per_rank must be positive, got 0";
        value(c(changed(a, |a| a.handle = &bad_h)), t0);
        let idx17 = t(DType::I64, &[T + 1, K]);
        let over = "topk_idx has 17 tokens, more than num_max_dispatch_tokens_per_rank=16";
        value(c(changed(a, |a| a.topk_idx = &idx17)), over);
        let w3 = t(DType::F32, &[T, K - 1]);
        let w_shape = "topk_weights must have shape [16, 4], got [16, 3]";
        value(c(changed(a, |a| a.topk_weights = &w3)), w_shape);
        let w64 = t(DType::F64, &[T, K]);
        let w_dtype = "topk_weights must have dtype torch.float32, got torch.float64";
        dtype(c(changed(a, |a| a.topk_weights = &w64)), w_dtype);
        let stats5 = t(DType::I64, &[R + 1]);
        let s_shape = "combine_wait_recv_cost_stats must have shape [4], got [5]";
        value(
            c(changed(a, |a| {
                a.combine_wait_recv_cost_stats = Some(&stats5)
            })),
            s_shape,
        );
        let out32 = t(DType::F32, &[T, H]);
        let o_dtype = "out must have dtype torch.bfloat16, got torch.float32";
        dtype(c(changed(a, |a| a.out = Some(&out32))), o_dtype);
        let wide = t(DType::BF16, &[T, 2 * H]);
        let o_shape = "out must have shape [16, 256], got [16, 512]";
        value(c(changed(a, |a| a.out = Some(&wide))), o_shape);
    }
}
