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
use crate::intranode::CombineArgs;
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
}

/// An eager call's streams: the caller's current stream and the Buffer's
/// communication stream, and the order between them.
pub struct Eager<'a> {
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

/// `combine`'s tensors (a group within one node: the intranode handle).
pub struct CombineTensors<'a> {
    pub x: &'a TensorArg,
    pub rank_prefix_matrix: &'a TensorArg,
    pub recv_src_idx: &'a TensorArg,
    pub is_token_in_rank: &'a TensorArg,
    pub send_head: &'a TensorArg,
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

impl EpBuffer {
    /// `combine(x, handle, topk_weights, bias)` eager and whole on a Buffer of
    /// `num_ranks` ranks on `device` whose group is within one node, with
    /// `num_sms` SMs: `(combined_x, combined_topk_weights)`.
    pub fn combine_eager<O: Outputs>(
        &mut self,
        num_ranks: i64,
        device: i32,
        s: &Eager<'_>,
        num_sms: u32,
        t: &CombineTensors<'_>,
        out: &mut O,
    ) -> CallResult<(O::Tensor, Option<O::Tensor>)> {
        let handle = calls::IntranodeHandle {
            rank_prefix_matrix: t.rank_prefix_matrix.0.clone(),
            recv_src_idx: t.recv_src_idx.0.clone(),
            is_token_in_rank: t.is_token_in_rank.0.clone(),
            send_head: t.send_head.0.clone(),
        };
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
        let p = calls::combine(num_ranks, device, &args).map_err(CallError::Arg)?;
        let biases = t.bias.as_ref().map(CombineBias::pair);
        aligned("x", Some(t.x))?;
        for (name, b) in biases.iter().flatten() {
            aligned(name, *b)?;
        }
        if self.internode().is_some() {
            return Err(CallError::Arg(ArgError {
                kind: ArgErrorKind::Value,
                message: "a Buffer whose group spans nodes takes the 10-tuple handle of an \
                          internode dispatch"
                    .into(),
            }));
        }
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
            rank_prefix_matrix: t.rank_prefix_matrix.1,
            send_head: t.send_head.1,
            num_tokens: p.num_tokens as usize,
            bias: bias_at,
            out: out_ptr,
            out_weights: weights_ptr,
        };
        let part = self
            .intranode_mut()
            .ok_or_else(|| CommError::InvalidArgument {
                name: "self",
                reason: "the Buffer has no intranode part (it was destroyed?)".into(),
            })?;
        s.order.after(s.comm, s.compute)?;
        part.combine(s.comm, &a, num_sms)?;
        s.order.after(s.compute, s.comm)?;
        part.check_device()?;
        Ok((combined, weights))
    }
}
