//! Normal-mode API calls whole, for the front ends: the checks
//! ([`crate::calls`]), the outputs (made by the front end's [`Outputs`]), the
//! stream ordering, the launches and what a kernel recorded, in one function
//! per call. A front end reads its tensors (meta and data address), picks the
//! SMs and hands its allocator over; it keeps no copy of the sequence.
//!
//! These are the eager calls (no `previous_event`, no `async_finish`, outputs
//! on the caller's stream): the communication stream waits for the caller's
//! stream, the kernels run on it, and the caller's stream waits for them.

use comm::cuda::StreamOrder;
use comm::error::CommError;
use comm::StreamHandle;

use crate::calls::{self, ArgError, ArgErrorKind, OutputSpec, TensorMeta};
use crate::ep_buffer::EpBuffer;
use crate::intranode::{
    CombineArgs, DispatchInputs, DispatchOutputs, DispatchShape, IntranodeBuffer, LayoutCall,
};
use crate::part::BufferPart;

/// A tensor argument: its meta and data address.
pub type TensorArg = (TensorMeta, u64);

/// Why an engine call did not complete.
#[derive(Debug)]
pub enum CallError {
    /// An argument the checks refused; nothing was allocated or launched.
    Arg(ArgError),
    /// The front end made no outputs (its allocator refused; nothing was
    /// launched).
    NoOutputs,
    /// The call could not finish after its first launch: a full dispatch
    /// whose received outputs could not be made once its counts arrived (out
    /// of memory). Its send was launched, so the front end must raise (a
    /// second attempt would send again), and the ranks are out of step.
    AfterLaunch(String),
    /// A CUDA or communication error, or what a kernel recorded (raised after
    /// the launches and the stream ordering, so the ranks stay in step).
    Comm(CommError),
}

impl From<CommError> for CallError {
    fn from(e: CommError) -> Self {
        CallError::Comm(e)
    }
}

pub type CallResult<T> = std::result::Result<T, CallError>;

/// The front end's output tensors: `specs` made on the caller's current
/// stream of the Buffer's device, each with its data address; None where it
/// made none (the call then fails with [`CallError::NoOutputs`]).
pub trait Outputs {
    type Tensor;
    fn empty(&mut self, specs: &[&OutputSpec]) -> Option<Vec<(Self::Tensor, u64)>>;

    /// Runs `wait` (a bounded CPU wait for the GPU, as a full dispatch's for
    /// its counts) where the front end lets other threads run meanwhile
    /// (Python: without the GIL).
    fn waiting<T: Send>(&mut self, wait: impl FnOnce() -> T + Send) -> T {
        wait()
    }
}

/// An eager call on a Buffer of `num_ranks` ranks on `device` (whose group is
/// within one node) with `num_sms` SMs: the caller's current stream, the
/// Buffer's communication stream and the order between them.
pub struct Eager<'a> {
    pub num_ranks: i64,
    pub device: i32,
    pub num_sms: u32,
    pub compute: StreamHandle,
    pub comm: StreamHandle,
    pub order: &'a StreamOrder,
}

/// The kernels read rows with 16-byte vector accesses.
const ROW_ALIGN: u64 = 16;

/// `name` (its meta and address) starts on a 16-byte boundary, or is empty.
fn aligned(name: &str, arg: Option<&TensorArg>) -> CallResult<()> {
    match arg {
        Some((m, p)) if !m.shape.contains(&0) && p % ROW_ALIGN != 0 => {
            Err(CallError::Arg(ArgError {
                kind: ArgErrorKind::Value,
                message: format!(
                "{name} must start on a {ROW_ALIGN}-byte boundary (it is a view at an odd offset)"
            ),
            }))
        }
        _ => Ok(()),
    }
}

/// The intranode handle's entries the calls read, each with its address.
pub struct HandleTensors<'a> {
    pub rank_prefix_matrix: &'a TensorArg,
    pub recv_src_idx: &'a TensorArg,
    pub is_token_in_rank: &'a TensorArg,
    pub send_head: &'a TensorArg,
}

impl HandleTensors<'_> {
    fn metas(&self) -> calls::IntranodeHandle {
        calls::IntranodeHandle {
            rank_prefix_matrix: self.rank_prefix_matrix.0.clone(),
            recv_src_idx: self.recv_src_idx.0.clone(),
            is_token_in_rank: self.is_token_in_rank.0.clone(),
            send_head: self.send_head.0.clone(),
        }
    }
}

/// A cached `dispatch`'s tensors: `x` (with its scales for fp8) and the
/// handle, and the arguments a cached dispatch takes as given (the checks
/// refuse any other than their defaults).
pub struct CachedDispatchTensors<'a> {
    pub x: &'a TensorArg,
    pub scales: Option<&'a TensorArg>,
    pub handle: HandleTensors<'a>,
    pub expert_alignment: i64,
    pub num_worst_tokens: i64,
}

/// A full `dispatch`'s tensors and scalars (no handle).
pub struct DispatchTensors<'a> {
    pub x: &'a TensorArg,
    pub scales: Option<&'a TensorArg>,
    pub num_tokens_per_rank: Option<&'a TensorArg>,
    pub is_token_in_rank: Option<&'a TensorArg>,
    pub num_tokens_per_expert: Option<&'a TensorArg>,
    pub topk_idx: Option<&'a TensorArg>,
    pub topk_weights: Option<&'a TensorArg>,
    pub expert_alignment: i64,
    pub num_worst_tokens: i64,
}

/// What a full dispatch gives: its outputs by name (None where the call
/// makes none: scales for bf16, the top-k outputs without `topk_idx`), and
/// the received tokens per local expert (empty with `num_worst_tokens`).
pub struct Dispatched<T> {
    pub recv_x: T,
    pub recv_x_scales: Option<T>,
    pub recv_topk_idx: Option<T>,
    pub recv_topk_weights: Option<T>,
    pub recv_src_idx: T,
    pub channel_prefix_matrix: T,
    pub recv_channel_prefix_matrix: T,
    pub rank_prefix_matrix: T,
    pub send_head: T,
    pub num_recv_tokens_per_expert: Vec<i32>,
}

/// The outputs a full dispatch makes once its rows are known, in this order.
const RECEIVED: [&str; 7] = [
    "recv_x",
    "recv_x_scales",
    "recv_topk_idx",
    "recv_topk_weights",
    "recv_src_idx",
    "channel_prefix_matrix",
    "recv_channel_prefix_matrix",
];

/// `outputs`' specs of [`RECEIVED`] with `rows` rows, each with its name.
fn received(outputs: &[OutputSpec], rows: i64) -> Vec<OutputSpec> {
    RECEIVED
        .iter()
        .filter_map(|n| calls::output(outputs, n))
        .map(|o| o.resolve(rows))
        .collect()
}

/// `combine`'s tensors (a group within one node: the intranode handle).
pub struct CombineTensors<'a> {
    pub x: &'a TensorArg,
    pub handle: HandleTensors<'a>,
    pub topk_weights: Option<&'a TensorArg>,
    /// `bias` as one tensor (`One`) or a pair, with each one's address.
    pub bias: Option<CombineBias<'a>>,
}

/// `combine`'s `bias`: one tensor, or a pair of optional ones.
pub enum CombineBias<'a> {
    One(&'a TensorArg),
    Pair(Option<&'a TensorArg>, Option<&'a TensorArg>),
}

impl CombineBias<'_> {
    /// Its two addends with the names the checks give them.
    fn pair(&self) -> [(&'static str, Option<&TensorArg>); 2] {
        match self {
            CombineBias::One(b) => [("bias", Some(b)), ("bias[1]", None)],
            CombineBias::Pair(b0, b1) => [("bias[0]", *b0), ("bias[1]", *b1)],
        }
    }
}

/// Refuses a group that spans nodes: the engine's calls are those within one
/// node (the front ends take their checked paths across nodes).
fn within_one_node(b: &EpBuffer) -> CallResult<()> {
    if b.internode().is_some() {
        return Err(CallError::Arg(ArgError {
            kind: ArgErrorKind::Value,
            message: "a Buffer whose group spans nodes takes the 10-tuple handle of an \
                      internode dispatch"
                .into(),
        }));
    }
    Ok(())
}

fn no_intranode_part() -> CommError {
    CommError::InvalidArgument {
        name: "self",
        reason: "the Buffer has no intranode part (it was destroyed?)".into(),
    }
}

impl EpBuffer {
    /// The launches of an eager call whose outputs are all made: `launch` on
    /// the communication stream, ordered after the caller's stream and the
    /// caller's after it, then what a kernel recorded (raised after that
    /// ordering, so the ranks stay in step). A full dispatch, which waits for
    /// its counts between its launches, spells the same steps out.
    fn on_comm(
        &mut self,
        s: &Eager<'_>,
        launch: impl FnOnce(&mut IntranodeBuffer) -> comm::Result<()>,
    ) -> CallResult<()> {
        let part = self.intranode_mut().ok_or_else(no_intranode_part)?;
        s.order.after(s.comm, s.compute)?;
        launch(part)?;
        s.order.after(s.compute, s.comm)?;
        part.check_device()?;
        Ok(())
    }

    /// `get_dispatch_layout(topk_idx, num_experts)` eager and whole
    /// ([`Eager`]; the SMs are the kernel's own):
    /// `(num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank)`. The
    /// kernel's scratch is made with them (a view of their allocation where
    /// the front end groups outputs) and dropped.
    pub fn layout_eager<O: Outputs>(
        &mut self,
        s: &Eager<'_>,
        topk_idx: &TensorArg,
        num_experts: i64,
        out: &mut O,
    ) -> CallResult<(O::Tensor, O::Tensor, O::Tensor)> {
        let p = calls::layout(s.num_ranks, s.device, &topk_idx.0, num_experts)
            .map_err(CallError::Arg)?;
        within_one_node(self)?;
        let names = [
            "num_tokens_per_rank",
            "num_tokens_per_expert",
            "is_token_in_rank",
            "layout_scratch",
        ];
        let specs: Option<Vec<&OutputSpec>> =
            names.iter().map(|n| calls::output(&p.outputs, n)).collect();
        let specs = specs.ok_or(CallError::NoOutputs)?;
        let made = out.empty(&specs).ok_or(CallError::NoOutputs)?;
        let Ok([per_rank, per_expert, in_rank, scratch]) = <[_; 4]>::try_from(made) else {
            return Err(CallError::NoOutputs);
        };
        let call = LayoutCall {
            topk_idx: topk_idx.1,
            num_tokens: p.num_tokens as usize,
            num_topk: p.num_topk as usize,
            num_experts: p.num_experts as usize,
            num_tokens_per_rank: per_rank.1,
            num_tokens_per_expert: per_expert.1,
            is_token_in_rank: in_rank.1,
            partials: scratch.1,
        };
        self.on_comm(s, |part| part.layout(s.comm, &call))?;
        Ok((per_rank.0, per_expert.0, in_rank.0))
    }

    /// `dispatch(x, handle=handle)` (a cached dispatch) eager and whole
    /// ([`Eager`]): `recv_x`, and `recv_x_scales` for fp8. It sends no
    /// routing: the handle's `rank_prefix_matrix` and `send_head` say where
    /// each row goes.
    pub fn cached_dispatch_eager<O: Outputs>(
        &mut self,
        s: &Eager<'_>,
        t: &CachedDispatchTensors<'_>,
        out: &mut O,
    ) -> CallResult<(O::Tensor, Option<O::Tensor>)> {
        let handle = t.handle.metas();
        let args = calls::DispatchArgs {
            x: &t.x.0,
            scales: t.scales.map(|(m, _)| m),
            handle: Some(&handle),
            num_tokens_per_rank: None,
            num_tokens_per_rdma_rank: false,
            is_token_in_rank: None,
            num_tokens_per_expert: None,
            topk_idx: None,
            topk_weights: None,
            expert_alignment: t.expert_alignment,
            num_worst_tokens: t.num_worst_tokens,
        };
        let p = calls::dispatch(s.num_ranks, s.device, &args).map_err(CallError::Arg)?;
        let name = if t.scales.is_some() { "x[0]" } else { "x" };
        aligned(name, Some(t.x))?;
        within_one_node(self)?;
        let rows = p.num_recv_rows;
        let specs: Vec<OutputSpec> = ["recv_x", "recv_x_scales"]
            .iter()
            .filter_map(|n| calls::output(&p.outputs, n))
            .map(|o| o.resolve(rows))
            .collect();
        let scale_strides = match specs.get(1) {
            Some(o) => (o.strides[0], o.strides[1]),
            None => (0, 0),
        };
        let refs: Vec<&OutputSpec> = specs.iter().collect();
        let mut made = out.empty(&refs).ok_or(CallError::NoOutputs)?.into_iter();
        let (recv_x, recv_x_ptr) = made.next().ok_or(CallError::NoOutputs)?;
        let (scales, scales_ptr) = match made.next() {
            Some((t, ptr)) => (Some(t), ptr),
            None => (None, 0),
        };
        let shape = DispatchShape {
            num_tokens: p.num_tokens as usize,
            hidden_bytes: p.hidden_bytes as usize,
            num_scales: p.num_scales as usize,
            num_topk: p.num_topk as usize,
            // A cached dispatch counts per rank (its plan has no experts).
            num_experts: s.num_ranks as usize,
        };
        let rpm = t.handle.rank_prefix_matrix.1;
        let inp = DispatchInputs {
            x: t.x.1,
            scales: t.scales.map_or(0, |(_, ptr)| *ptr),
            scale_strides: p.scale_strides,
            topk_idx: 0,
            topk_weights: 0,
            is_token_in_rank: 0,
            num_tokens_per_expert: 0,
            rank_prefix_matrix: rpm,
            send_head: t.handle.send_head.1,
        };
        let outputs = DispatchOutputs {
            num_rows: rows,
            recv_x: recv_x_ptr,
            recv_scales: scales_ptr,
            scale_strides,
            recv_topk_idx: 0,
            recv_topk_weights: 0,
            recv_src_idx: 0,
        };
        self.on_comm(s, |part| {
            part.cached_dispatch_send(s.comm, &shape, &inp, s.num_sms)?;
            part.dispatch_recv(s.comm, &shape, rpm, &outputs, s.num_sms)
        })?;
        Ok((recv_x, scales))
    }

    /// `dispatch(x, ...)` without a handle (a full dispatch) eager and whole
    /// ([`Eager`]). Every output is made while no kernel of the
    /// dispatch waits on other work: the rank prefix matrix and `send_head`
    /// before the send, the received outputs before it too with
    /// `num_worst_tokens`, else once the counts arrived (the CPU waits for
    /// them, in [`Outputs::waiting`]).
    pub fn dispatch_eager<O: Outputs>(
        &mut self,
        s: &Eager<'_>,
        t: &DispatchTensors<'_>,
        out: &mut O,
    ) -> CallResult<Dispatched<O::Tensor>> {
        fn meta(a: Option<&TensorArg>) -> Option<&TensorMeta> {
            a.map(|(m, _)| m)
        }
        let args = calls::DispatchArgs {
            x: &t.x.0,
            scales: meta(t.scales),
            handle: None,
            num_tokens_per_rank: meta(t.num_tokens_per_rank),
            num_tokens_per_rdma_rank: false,
            is_token_in_rank: meta(t.is_token_in_rank),
            num_tokens_per_expert: meta(t.num_tokens_per_expert),
            topk_idx: meta(t.topk_idx),
            topk_weights: meta(t.topk_weights),
            expert_alignment: t.expert_alignment,
            num_worst_tokens: t.num_worst_tokens,
        };
        let p = calls::dispatch(s.num_ranks, s.device, &args).map_err(CallError::Arg)?;
        let name = if t.scales.is_some() { "x[0]" } else { "x" };
        aligned(name, Some(t.x))?;
        within_one_node(self)?;
        let (Some(rpm_spec), Some(head_spec)) = (
            calls::output(&p.outputs, "rank_prefix_matrix"),
            calls::output(&p.outputs, "send_head"),
        ) else {
            return Err(CallError::NoOutputs);
        };
        let mut before = out
            .empty(&[rpm_spec, head_spec])
            .ok_or(CallError::NoOutputs)?
            .into_iter();
        let ((rpm, rpm_ptr), (send_head, head_ptr)) = match (before.next(), before.next()) {
            (Some(a), Some(b)) => (a, b),
            _ => return Err(CallError::NoOutputs),
        };
        let worst = p.num_worst_tokens > 0;
        let mut made = None;
        if worst {
            let specs = received(&p.outputs, p.num_recv_rows);
            let refs: Vec<&OutputSpec> = specs.iter().collect();
            let m = out.empty(&refs).ok_or(CallError::NoOutputs)?;
            made = Some((specs, m, p.num_recv_rows));
        }
        let shape = DispatchShape {
            num_tokens: p.num_tokens as usize,
            hidden_bytes: p.hidden_bytes as usize,
            num_scales: p.num_scales as usize,
            num_topk: p.num_topk as usize,
            num_experts: p.num_experts as usize,
        };
        let addr = |a: Option<&TensorArg>| a.map_or(0, |(_, ptr)| *ptr);
        let inp = DispatchInputs {
            x: t.x.1,
            scales: addr(t.scales),
            scale_strides: p.scale_strides,
            topk_idx: addr(t.topk_idx),
            topk_weights: addr(t.topk_weights),
            is_token_in_rank: addr(t.is_token_in_rank),
            num_tokens_per_expert: addr(t.num_tokens_per_expert),
            rank_prefix_matrix: rpm_ptr,
            send_head: head_ptr,
        };
        let part = self.intranode_mut().ok_or_else(no_intranode_part)?;
        s.order.after(s.comm, s.compute)?;
        let epoch =
            part.dispatch_send(s.comm, &shape, &inp, p.expert_alignment as usize, s.num_sms)?;
        let mut per_expert = Vec::new();
        let (specs, made, rows) = match made {
            Some(m) => m,
            None => {
                // notify has ended (its counts are in): no kernel of this
                // dispatch that waits on other work runs while the received
                // outputs are made (the send half may run; it waits on nothing).
                let part: &IntranodeBuffer = part;
                let num_experts = p.num_experts as usize;
                let (rows, counts) = out.waiting(|| part.wait_counts(epoch, num_experts))?;
                per_expert = counts;
                let rows = rows as i64;
                let specs = received(&p.outputs, rows);
                let refs: Vec<&OutputSpec> = specs.iter().collect();
                let Some(m) = out.empty(&refs) else {
                    let bytes: i64 = specs
                        .iter()
                        .map(|o| {
                            o.shape.iter().product::<i64>() * o.dtype.element_size().unwrap_or(0)
                        })
                        .sum();
                    return Err(CallError::AfterLaunch(format!(
                        "rank {}: dispatch could not make its received outputs ({rows} rows, \
                         {bytes} bytes) after its send was launched (out of GPU memory?)",
                        part.base().rank()
                    )));
                };
                (specs, m, rows)
            }
        };
        let mut by_name: Vec<(&str, O::Tensor, u64)> = specs
            .iter()
            .zip(made)
            .map(|(spec, (t, ptr))| (spec.name, t, ptr))
            .collect();
        let mut take = |name: &str| {
            by_name
                .iter()
                .position(|(n, _, _)| *n == name)
                .map(|i| by_name.remove(i))
                .map(|(_, t, ptr)| (t, ptr))
        };
        let scales_spec = specs.iter().find(|o| o.name == "recv_x_scales");
        let scale_strides = scales_spec.map_or((0, 0), |o| (o.strides[0], o.strides[1]));
        let (Some(recv_x), Some(src_idx), Some(cpm), Some(rcpm)) = (
            take("recv_x"),
            take("recv_src_idx"),
            take("channel_prefix_matrix"),
            take("recv_channel_prefix_matrix"),
        ) else {
            return Err(CallError::AfterLaunch(
                "dispatch's plan lacks a received output".into(),
            ));
        };
        let (scales, idx, weights) = (
            take("recv_x_scales"),
            take("recv_topk_idx"),
            take("recv_topk_weights"),
        );
        let ptr = |o: &Option<(O::Tensor, u64)>| o.as_ref().map_or(0, |(_, p)| *p);
        let outputs = DispatchOutputs {
            num_rows: rows,
            recv_x: recv_x.1,
            recv_scales: ptr(&scales),
            scale_strides,
            recv_topk_idx: ptr(&idx),
            recv_topk_weights: ptr(&weights),
            recv_src_idx: src_idx.1,
        };
        let part = self.intranode_mut().ok_or_else(no_intranode_part)?;
        part.dispatch_recv(s.comm, &shape, rpm_ptr, &outputs, s.num_sms)?;
        s.order.after(s.compute, s.comm)?;
        part.check_device()?;
        Ok(Dispatched {
            recv_x: recv_x.0,
            recv_x_scales: scales.map(|(t, _)| t),
            recv_topk_idx: idx.map(|(t, _)| t),
            recv_topk_weights: weights.map(|(t, _)| t),
            recv_src_idx: src_idx.0,
            channel_prefix_matrix: cpm.0,
            recv_channel_prefix_matrix: rcpm.0,
            rank_prefix_matrix: rpm,
            send_head,
            num_recv_tokens_per_expert: per_expert,
        })
    }

    /// `combine(x, handle, topk_weights, bias)` eager and whole ([`Eager`]):
    /// `(combined_x, combined_topk_weights)`.
    pub fn combine_eager<O: Outputs>(
        &mut self,
        s: &Eager<'_>,
        t: &CombineTensors<'_>,
        out: &mut O,
    ) -> CallResult<(O::Tensor, Option<O::Tensor>)> {
        let handle = t.handle.metas();
        let bias = t.bias.as_ref().map(|b| match b {
            CombineBias::One(b) => calls::Bias::One(&b.0),
            CombineBias::Pair(b0, b1) => calls::Bias::Pair(b0.map(|(m, _)| m), b1.map(|(m, _)| m)),
        });
        let args = calls::CombineArgs {
            x: &t.x.0,
            handle: &handle,
            topk_weights: t.topk_weights.map(|(m, _)| m),
            bias,
        };
        let p = calls::combine(s.num_ranks, s.device, &args).map_err(CallError::Arg)?;
        let biases = t.bias.as_ref().map(CombineBias::pair);
        aligned("x", Some(t.x))?;
        for (name, b) in biases.iter().flatten() {
            aligned(name, *b)?;
        }
        within_one_node(self)?;
        let specs: Vec<&OutputSpec> = p.outputs.iter().collect();
        let mut made = out.empty(&specs).ok_or(CallError::NoOutputs)?.into_iter();
        let (combined, out_ptr) = made.next().ok_or(CallError::NoOutputs)?;
        let (weights, weights_ptr) = match made.next() {
            Some((w, ptr)) => (Some(w), ptr),
            None => (None, 0),
        };
        let addr = |a: Option<&TensorArg>| a.map_or(0, |(_, ptr)| *ptr);
        let bias_at = biases.map_or((0, 0), |[(_, b0), (_, b1)]| (addr(b0), addr(b1)));
        let a = CombineArgs {
            y: t.x.1,
            num_recv_rows: p.num_recv_rows,
            hidden: p.hidden as usize,
            topk_weights: addr(t.topk_weights),
            num_topk: p.num_topk as usize,
            rank_prefix_matrix: t.handle.rank_prefix_matrix.1,
            send_head: t.handle.send_head.1,
            num_tokens: p.num_tokens as usize,
            bias: bias_at,
            out: out_ptr,
            out_weights: weights_ptr,
        };
        self.on_comm(s, |part| part.combine(s.comm, &a, s.num_sms))?;
        Ok((combined, weights))
    }
}
