//! Normal-mode API calls whole, for the front ends: the checks
//! ([`crate::calls`]), the outputs (made by the front end's [`Outputs`]), the
//! stream ordering, the launches and what a kernel recorded, in one function
//! per call. A front end reads its tensors (meta and data address), picks the
//! SMs and hands its allocator over; it keeps no copy of the sequence.
//!
//! Arguments: the checks' argument types ([`crate::calls`]) over
//! [`TensorArg`]s, a meta and an address each ([`DispatchTensors`],
//! [`CombineTensors`], [`HandleTensors`]): the engine checks their metas and
//! launches on their addresses.
//!
//! Streams ([`Streams`]): the calls run on the Buffer's communication stream.
//! With no stream arguments ([`StreamArgs::default`], an eager call) the
//! communication stream waits for the caller's stream, the outputs are made
//! on the caller's stream, the kernels run, and the caller's stream waits for
//! them. DeepEP's stream arguments ([`StreamArgs`]) change three steps:
//!
//! - `previous_event`: the communication stream waits for that event
//!   ([`PreviousEvent`]) instead of the caller's stream (an event that holds
//!   nothing, DeepEP's `EventOverlap(None)`, falls back to the caller's).
//! - `allocate_on_comm_stream` (needs both others): the outputs are made
//!   while the communication stream is the device's current one, and marked
//!   used on the caller's stream ([`Outputs::empty_on_comm`]).
//! - `async_finish`: the caller's stream does not wait; after the launches
//!   the front end records its event on the communication stream and keeps
//!   the call's tensors alive there ([`Outputs::finish_async`]), then the
//!   engine raises what a kernel recorded.

use comm::cuda::StreamOrder;
use comm::error::CommError;
use comm::StreamHandle;

use crate::calls::{self, ArgError, ArgErrorKind, DispatchPlan, OutputSpec, TensorMeta};
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
    /// of memory), or a front end that could not keep an asynchronous call's
    /// tensors ([`Outputs::finish_async`]). Its send was launched, so the
    /// front end must raise (a second attempt would send again).
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

/// The front end's output tensors and the end of an asynchronous call.
pub trait Outputs {
    type Tensor;

    /// `specs` made on the caller's current stream of the Buffer's device,
    /// each with its data address; None where it made none (the call then
    /// fails with [`CallError::NoOutputs`]).
    fn empty(&mut self, specs: &[&OutputSpec]) -> Option<Vec<(Self::Tensor, u64)>>;

    /// `specs` made while `comm` is the device's current stream (a call's
    /// `allocate_on_comm_stream`), each also marked used on `compute`, where
    /// the caller reads them. None where the front end cannot (the default):
    /// the call fails with [`CallError::NoOutputs`].
    fn empty_on_comm(
        &mut self,
        specs: &[&OutputSpec],
        comm: StreamHandle,
        compute: StreamHandle,
    ) -> Option<Vec<(Self::Tensor, u64)>> {
        let _ = (specs, comm, compute);
        None
    }

    /// The end of an `async_finish` call, after its launches on `comm`: the
    /// front end records the event it returns with the outputs on `comm`, and
    /// keeps every tensor of the call (its inputs, and `made`, each output
    /// and scratch tensor the engine had it make) alive until `comm`'s work
    /// so far is done. An error here is raised as the call's.
    fn finish_async(&mut self, comm: StreamHandle, made: &[&Self::Tensor]) -> CallResult<()>;

    /// Runs `wait` (a bounded CPU wait for the GPU, as a full dispatch's for
    /// its counts) where the front end lets other threads run meanwhile
    /// (Python: without the GIL).
    fn waiting<T: Send>(&mut self, wait: impl FnOnce() -> T + Send) -> T {
        wait()
    }
}

/// A call's `previous_event`, as the front end holds it.
pub trait PreviousEvent {
    /// `stream` waits for the event's work: true; false where it holds no
    /// event (DeepEP's `EventOverlap(None)`: the engine then orders `stream`
    /// after the caller's stream, as without a `previous_event`).
    fn wait_on(&self, stream: StreamHandle) -> comm::Result<bool>;
}

/// DeepEP's stream arguments of a call; the default (none of them) is an
/// eager call.
#[derive(Clone, Copy, Default)]
pub struct StreamArgs<'a> {
    pub previous_event: Option<&'a dyn PreviousEvent>,
    pub async_finish: bool,
    pub allocate_on_comm_stream: bool,
}

impl StreamArgs<'_> {
    /// DeepEP's rule: `allocate_on_comm_stream` needs `previous_event` (one
    /// that holds nothing counts) and `async_finish`.
    pub fn check(&self) -> Result<(), ArgError> {
        if self.allocate_on_comm_stream && (self.previous_event.is_none() || !self.async_finish) {
            return Err(ArgError {
                kind: ArgErrorKind::Value,
                message: "allocate_on_comm_stream=True needs previous_event and async_finish=True"
                    .into(),
            });
        }
        Ok(())
    }
}

/// A call on a Buffer of `num_ranks` ranks on `device` (whose group is
/// within one node) with `num_sms` SMs: the caller's current stream, the
/// Buffer's communication stream, the order between them, and the call's
/// stream arguments.
pub struct Streams<'a> {
    pub num_ranks: i64,
    pub device: i32,
    pub num_sms: u32,
    pub compute: StreamHandle,
    pub comm: StreamHandle,
    pub order: &'a StreamOrder,
    pub args: StreamArgs<'a>,
}

impl Streams<'_> {
    /// The communication stream waits for the previous event, else for the
    /// caller's stream.
    fn enter(&self) -> comm::Result<()> {
        if let Some(e) = self.args.previous_event {
            if e.wait_on(self.comm)? {
                return Ok(());
            }
        }
        self.order.after(self.comm, self.compute)
    }

    /// `specs` made by `out`, on the caller's stream or (with
    /// `allocate_on_comm_stream`) on the communication stream.
    fn make<O: Outputs>(
        &self,
        out: &mut O,
        specs: &[&OutputSpec],
    ) -> Option<Vec<(O::Tensor, u64)>> {
        if self.args.allocate_on_comm_stream {
            out.empty_on_comm(specs, self.comm, self.compute)
        } else {
            out.empty(specs)
        }
    }

    /// After the launches: the caller's stream waits for them, or (with
    /// `async_finish`) the front end keeps the call's tensors (`made`) on the
    /// communication stream with its event.
    fn leave<O: Outputs>(&self, out: &mut O, made: &[&O::Tensor]) -> CallResult<()> {
        if self.args.async_finish {
            out.finish_async(self.comm, made)
        } else {
            Ok(self.order.after(self.compute, self.comm)?)
        }
    }
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

/// The intranode handle's entries the calls read.
pub type HandleTensors = calls::IntranodeHandle<TensorArg>;

/// `dispatch`'s arguments: a full dispatch's (no handle; within one node
/// `num_tokens_per_rdma_rank` is false), or a cached one's (its handle,
/// [`calls::DispatchArgs::cached`]).
pub type DispatchTensors<'a> = calls::DispatchArgs<'a, TensorArg>;

/// `combine`'s arguments (a group within one node: the intranode handle).
pub type CombineTensors<'a> = calls::CombineArgs<'a, TensorArg>;

/// `combine`'s `bias`: one tensor, or a pair of optional ones.
pub type CombineBias<'a> = calls::Bias<'a, TensorArg>;

/// The address of an optional tensor argument (0 for None).
fn addr(a: Option<&TensorArg>) -> u64 {
    a.map_or(0, |(_, ptr)| *ptr)
}

/// The launch shape of a dispatch of plan `p` on `num_ranks` ranks (a cached
/// one counts per rank: its plan has no experts).
pub fn launch_shape(p: &DispatchPlan, num_ranks: i64) -> DispatchShape {
    let num_experts = if p.cached { num_ranks } else { p.num_experts };
    DispatchShape {
        num_tokens: p.num_tokens as usize,
        hidden_bytes: p.hidden_bytes as usize,
        num_scales: p.num_scales as usize,
        num_topk: p.num_topk as usize,
        num_experts: num_experts as usize,
    }
}

/// What the send half of a dispatch of `t` (plan `p`) reads:
/// `rank_prefix_matrix` and `send_head` are the handle's (cached) or the
/// dispatch's new ones.
fn send_inputs(
    t: &DispatchTensors<'_>,
    p: &DispatchPlan,
    (rank_prefix_matrix, send_head): (u64, u64),
) -> DispatchInputs {
    DispatchInputs {
        x: t.x.1,
        scales: addr(t.scales),
        scale_strides: p.scale_strides,
        topk_idx: addr(t.topk_idx),
        topk_weights: addr(t.topk_weights),
        is_token_in_rank: addr(t.is_token_in_rank),
        num_tokens_per_expert: addr(t.num_tokens_per_expert),
        rank_prefix_matrix,
        send_head,
    }
}

/// A call of the other kind of dispatch (a front end's mistake): refused
/// before anything is made.
fn other_dispatch(message: &str) -> CallError {
    CallError::Arg(ArgError {
        kind: ArgErrorKind::Value,
        message: message.into(),
    })
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

/// `specs` as the front end makes them: without a zero fill of its own (a
/// torch op and its kernel launch each); [`zero_fill`] fills them.
fn unfilled(specs: &[OutputSpec]) -> Vec<OutputSpec> {
    let plain = |o: &OutputSpec| OutputSpec {
        zeroed: false,
        ..o.clone()
    };
    specs.iter().map(plain).collect()
}

/// Zero-fills on `stream` each output of `specs` that its plan wants zeroed
/// (`made`: the outputs made for `specs`, in order, with their addresses),
/// one memset each, ordered before the launch that follows on `stream`.
fn zero_fill<T>(stream: StreamHandle, specs: &[OutputSpec], made: &[(T, u64)]) -> CallResult<()> {
    for (spec, (_, ptr)) in specs.iter().zip(made).filter(|(o, _)| o.zeroed) {
        let bytes = spec.bytes();
        // SAFETY: the output was just made on this device, contiguous with
        // `bytes` bytes (a zeroed output of a plan is), and the caller keeps
        // it alive past the launch that follows.
        unsafe { stream.zero_async(*ptr, bytes.max(0) as usize) }?;
    }
    Ok(())
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

/// A call's checks: its arguments' (`plan`), then its stream arguments'.
fn checked<T>(args: &StreamArgs<'_>, plan: Result<T, ArgError>) -> CallResult<T> {
    let p = plan.map_err(CallError::Arg)?;
    args.check().map_err(CallError::Arg)?;
    Ok(p)
}

fn no_intranode_part() -> CommError {
    CommError::InvalidArgument {
        name: "self",
        reason: "the Buffer has no intranode part (it was destroyed?)".into(),
    }
}

impl EpBuffer {
    /// The launches of a call whose outputs (`made`) are all made: `launch`
    /// on the communication stream, after the caller's stream or the
    /// previous event ([`Streams::enter`]), then the caller's stream ordered
    /// after it or the asynchronous end ([`Streams::leave`]), then what a
    /// kernel recorded (raised after that, so the ranks stay in step). A full
    /// dispatch, which waits for its counts between its launches, spells the
    /// same steps out.
    fn on_comm<O: Outputs>(
        &mut self,
        s: &Streams<'_>,
        out: &mut O,
        made: &[&O::Tensor],
        launch: impl FnOnce(&mut IntranodeBuffer) -> comm::Result<()>,
    ) -> CallResult<()> {
        let part = self.intranode_mut().ok_or_else(no_intranode_part)?;
        s.enter()?;
        launch(part)?;
        s.leave(out, made)?;
        part.check_device()?;
        Ok(())
    }

    /// A dispatch's checks (the metas of `t`, then the stream arguments),
    /// `x`'s alignment and the group within one node: its plan.
    fn dispatch_plan(&self, s: &Streams<'_>, t: &DispatchTensors<'_>) -> CallResult<DispatchPlan> {
        let p = checked(&s.args, calls::dispatch(s.num_ranks, s.device, t))?;
        let name = if t.scales.is_some() { "x[0]" } else { "x" };
        aligned(name, Some(t.x))?;
        within_one_node(self)?;
        Ok(p)
    }

    /// `get_dispatch_layout(topk_idx, num_experts)` whole ([`Streams`]; the
    /// SMs are the kernel's own):
    /// `(num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank)`. The
    /// kernel's scratch is made with them (a view of their allocation where
    /// the front end groups outputs) and dropped.
    pub fn layout_call<O: Outputs>(
        &mut self,
        s: &Streams<'_>,
        topk_idx: &TensorArg,
        num_experts: i64,
        out: &mut O,
    ) -> CallResult<(O::Tensor, O::Tensor, O::Tensor)> {
        let p = checked(
            &s.args,
            calls::layout(s.num_ranks, s.device, &topk_idx.0, num_experts),
        )?;
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
        let made = s.make(out, &specs).ok_or(CallError::NoOutputs)?;
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
        let made = [&per_rank.0, &per_expert.0, &in_rank.0, &scratch.0];
        self.on_comm(s, out, &made, |part| part.layout(s.comm, &call))?;
        Ok((per_rank.0, per_expert.0, in_rank.0))
    }

    /// `dispatch(x, handle=handle)` (a cached dispatch) whole ([`Streams`]):
    /// `recv_x`, and `recv_x_scales` for fp8. It sends no routing: the
    /// handle's `rank_prefix_matrix` and `send_head` say where each row goes.
    pub fn cached_dispatch_call<O: Outputs>(
        &mut self,
        s: &Streams<'_>,
        t: &DispatchTensors<'_>,
        out: &mut O,
    ) -> CallResult<(O::Tensor, Option<O::Tensor>)> {
        let Some(handle) = t.handle else {
            return Err(other_dispatch(
                "a cached dispatch needs the handle of an earlier dispatch",
            ));
        };
        let p = self.dispatch_plan(s, t)?;
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
        let mut made = s.make(out, &refs).ok_or(CallError::NoOutputs)?.into_iter();
        let (recv_x, recv_x_ptr) = made.next().ok_or(CallError::NoOutputs)?;
        let (scales, scales_ptr) = match made.next() {
            Some((t, ptr)) => (Some(t), ptr),
            None => (None, 0),
        };
        let shape = launch_shape(&p, s.num_ranks);
        let rpm = handle.rank_prefix_matrix.1;
        let inp = send_inputs(t, &p, (rpm, handle.send_head.1));
        let outputs = DispatchOutputs {
            num_rows: rows,
            recv_x: recv_x_ptr,
            recv_scales: scales_ptr,
            scale_strides,
            recv_topk_idx: 0,
            recv_topk_weights: 0,
            recv_src_idx: 0,
        };
        let made: Vec<&O::Tensor> = [Some(&recv_x), scales.as_ref()]
            .into_iter()
            .flatten()
            .collect();
        self.on_comm(s, out, &made, |part| {
            part.cached_dispatch_send(s.comm, &shape, &inp, s.num_sms)?;
            part.dispatch_recv(s.comm, &shape, rpm, &outputs, s.num_sms)
        })?;
        Ok((recv_x, scales))
    }

    /// `dispatch(x, ...)` without a handle (a full dispatch) whole
    /// ([`Streams`]). Every output is made while no kernel of the
    /// dispatch waits on other work: the rank prefix matrix and `send_head`
    /// before the send, the received outputs before it too with
    /// `num_worst_tokens`, else once the counts arrived (the CPU waits for
    /// them, in [`Outputs::waiting`]).
    pub fn dispatch_call<O: Outputs>(
        &mut self,
        s: &Streams<'_>,
        t: &DispatchTensors<'_>,
        out: &mut O,
    ) -> CallResult<Dispatched<O::Tensor>> {
        if t.handle.is_some() {
            return Err(other_dispatch(
                "a dispatch with a handle is a cached dispatch (cached_dispatch_call)",
            ));
        }
        let p = self.dispatch_plan(s, t)?;
        let (Some(rpm_spec), Some(head_spec)) = (
            calls::output(&p.outputs, "rank_prefix_matrix"),
            calls::output(&p.outputs, "send_head"),
        ) else {
            return Err(CallError::NoOutputs);
        };
        let mut before = s
            .make(out, &[rpm_spec, head_spec])
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
            let plain = unfilled(&specs);
            let refs: Vec<&OutputSpec> = plain.iter().collect();
            let m = s.make(out, &refs).ok_or(CallError::NoOutputs)?;
            made = Some((specs, m, p.num_recv_rows));
        }
        let shape = launch_shape(&p, s.num_ranks);
        let inp = send_inputs(t, &p, (rpm_ptr, head_ptr));
        let part = self.intranode_mut().ok_or_else(no_intranode_part)?;
        s.enter()?;
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
                let plain = unfilled(&specs);
                let refs: Vec<&OutputSpec> = plain.iter().collect();
                let Some(m) = s.make(out, &refs) else {
                    let bytes: i64 = specs.iter().map(OutputSpec::bytes).sum();
                    return Err(CallError::AfterLaunch(format!(
                        "rank {}: dispatch could not make its received outputs ({rows} rows, \
                         {bytes} bytes) after its send was launched (out of GPU memory?)",
                        part.base().rank()
                    )));
                };
                (specs, m, rows)
            }
        };
        // The channel matrices (zeros of DeepEP's shape), on the stream the
        // receive half follows, now that it is ordered after the caller's.
        zero_fill(s.comm, &specs, &made)?;
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
        let made = [
            Some(&rpm),
            Some(&send_head),
            Some(&recv_x.0),
            scales.as_ref().map(|(t, _)| t),
            idx.as_ref().map(|(t, _)| t),
            weights.as_ref().map(|(t, _)| t),
            Some(&src_idx.0),
            Some(&cpm.0),
            Some(&rcpm.0),
        ];
        let made: Vec<&O::Tensor> = made.into_iter().flatten().collect();
        s.leave(out, &made)?;
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

    /// `combine(x, handle, topk_weights, bias)` whole ([`Streams`]):
    /// `(combined_x, combined_topk_weights)`.
    pub fn combine_call<O: Outputs>(
        &mut self,
        s: &Streams<'_>,
        t: &CombineTensors<'_>,
        out: &mut O,
    ) -> CallResult<(O::Tensor, Option<O::Tensor>)> {
        let p = checked(&s.args, calls::combine(s.num_ranks, s.device, t))?;
        let biases = t.bias.map_or([None, None], |b| b.named());
        aligned("x", Some(t.x))?;
        for (name, b) in biases.into_iter().flatten() {
            aligned(name, Some(b))?;
        }
        within_one_node(self)?;
        let specs: Vec<&OutputSpec> = p.outputs.iter().collect();
        let mut made = s.make(out, &specs).ok_or(CallError::NoOutputs)?.into_iter();
        let (combined, out_ptr) = made.next().ok_or(CallError::NoOutputs)?;
        let (weights, weights_ptr) = match made.next() {
            Some((w, ptr)) => (Some(w), ptr),
            None => (None, 0),
        };
        let [b0, b1] = biases.map(|b| addr(b.map(|(_, t)| t)));
        let a = CombineArgs {
            y: t.x.1,
            num_recv_rows: p.num_recv_rows,
            hidden: p.hidden as usize,
            topk_weights: addr(t.topk_weights),
            num_topk: p.num_topk as usize,
            rank_prefix_matrix: t.handle.rank_prefix_matrix.1,
            send_head: t.handle.send_head.1,
            num_tokens: p.num_tokens as usize,
            bias: (b0, b1),
            out: out_ptr,
            out_weights: weights_ptr,
        };
        let made: Vec<&O::Tensor> = [Some(&combined), weights.as_ref()]
            .into_iter()
            .flatten()
            .collect();
        self.on_comm(s, out, &made, |part| part.combine(s.comm, &a, s.num_sms))?;
        Ok((combined, weights))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Waits(bool);

    impl PreviousEvent for Waits {
        fn wait_on(&self, _stream: StreamHandle) -> comm::Result<bool> {
            Ok(self.0)
        }
    }

    const NEEDS: &str = "allocate_on_comm_stream=True needs previous_event and async_finish=True";

    #[test]
    fn allocate_on_comm_stream_needs_both_other_arguments() {
        let (held, none) = (Waits(true), Waits(false));
        let ok = |a: StreamArgs<'_>| a.check().is_ok();
        assert!(ok(StreamArgs::default()));
        // An event that holds nothing counts as a previous_event (DeepEP's
        // EventOverlap(None)).
        for e in [&held as &dyn PreviousEvent, &none] {
            assert!(ok(StreamArgs {
                previous_event: Some(e),
                async_finish: true,
                allocate_on_comm_stream: true,
            }));
        }
        for (previous_event, async_finish) in [(None, true), (Some(&held as _), false)] {
            let e = StreamArgs {
                previous_event,
                async_finish,
                allocate_on_comm_stream: true,
            }
            .check()
            .unwrap_err();
            assert_eq!((e.kind, e.message.as_str()), (ArgErrorKind::Value, NEEDS));
        }
    }

    /// An allocator that makes nothing: what the default hooks do.
    struct Nothing;

    impl Outputs for Nothing {
        type Tensor = ();
        fn empty(&mut self, _specs: &[&OutputSpec]) -> Option<Vec<((), u64)>> {
            None
        }
        fn finish_async(&mut self, _comm: StreamHandle, _made: &[&()]) -> CallResult<()> {
            Err(CallError::AfterLaunch("unused".into()))
        }
    }

    #[test]
    fn a_front_end_that_cannot_switch_streams_makes_no_outputs() {
        let h = StreamHandle(0);
        assert!(Nothing.empty_on_comm(&[], h, h).is_none());
        assert_eq!(Nothing.waiting(|| 7), 7);
    }

    #[test]
    fn the_stream_arguments_are_checked_after_the_call_arguments() {
        let bad = StreamArgs {
            allocate_on_comm_stream: true,
            ..StreamArgs::default()
        };
        let refused = |message: &str| ArgError {
            kind: ArgErrorKind::Type,
            message: message.into(),
        };
        let first = checked::<()>(&bad, Err(refused("topk_idx must be a torch.Tensor")));
        let Err(CallError::Arg(e)) = first else {
            panic!("expected the call's refusal, got {first:?}");
        };
        assert_eq!(e.message, "topk_idx must be a torch.Tensor");
        let Err(CallError::Arg(e)) = checked(&bad, Ok(1)) else {
            panic!("expected the stream arguments' refusal");
        };
        assert_eq!(e.message, NEEDS);
        assert!(matches!(checked(&StreamArgs::default(), Ok(1)), Ok(1)));
    }

    /// A tensor argument of `shape` at `addr` on device 0.
    fn at(dtype: calls::DType, shape: &[i64], addr: u64) -> TensorArg {
        (TensorMeta::contiguous(dtype, shape, 0), addr)
    }

    #[test]
    fn a_cached_dispatch_is_checked_on_its_metas_and_sends_by_its_handle() {
        use calls::DType::{Bool, BF16, I32};
        let (r, n, rows) = (4, 6, 5);
        let x = at(BF16, &[n, 256], 0x1000);
        let handle = HandleTensors {
            rank_prefix_matrix: at(I32, &[r, r], 0x2000),
            recv_src_idx: at(I32, &[rows], 0x3000),
            is_token_in_rank: at(Bool, &[n, r], 0x4000),
            send_head: at(I32, &[n, r], 0x5000),
        };
        let t = DispatchTensors::cached(&x, None, &handle);
        let p = calls::dispatch(r, 0, &t).unwrap();
        assert!(p.cached && p.num_recv_rows == rows);
        // A cached dispatch counts per rank.
        assert_eq!(launch_shape(&p, r).num_experts, r as usize);
        let inp = send_inputs(&t, &p, (0x2000, 0x5000));
        assert_eq!(
            (inp.x, inp.rank_prefix_matrix, inp.send_head),
            (0x1000, 0x2000, 0x5000)
        );
        assert_eq!((inp.topk_idx, inp.is_token_in_rank, inp.scales), (0, 0, 0));
    }

    #[test]
    fn a_bias_names_its_addends_as_the_checks_do() {
        let b = at(calls::DType::BF16, &[2, 128], 0x100);
        assert_eq!(
            CombineBias::One(&b).named()[0].map(|(n, a)| (n, a.1)),
            Some(("bias", 0x100))
        );
        let [b0, b1] = CombineBias::Pair(None, Some(&b)).named();
        assert!(b0.is_none());
        assert_eq!(b1.map(|(n, _)| n), Some("bias[1]"));
        let m = CombineBias::Pair(Some(&b), None).map(|a| &a.0);
        assert!(matches!(m, calls::Bias::Pair(Some(t), None) if t.shape == [2, 128]));
    }
}
