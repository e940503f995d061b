//! ep-core's engine (`ep_core::engine`) on tch tensors: what the
//! [`Buffer`](crate::Buffer)'s intranode layout, dispatch and combine hand it
//! (each tensor's meta and address, [`arg`]; a handle's entries,
//! [`handle_args`]; a dispatch's and a combine's, [`DispatchArgsOf`] and
//! [`CombineArgsOf`], which the checks read too), the outputs it has made
//! ([`TchOutputs`]: allocated by tch on the Buffer's device, on the
//! communication stream with `allocate_on_comm_stream`; the event of an
//! `async_finish` call keeping the call's tensors), and its errors as this
//! crate's ([`TchOutputs::result`]).

use comm::{Device as CoreDevice, StreamHandle};
use ep_core::calls::OutputSpec;
use ep_core::engine::{
    CallError, CallResult, CombineBias, CombineTensors, DispatchTensors, HandleTensors, Outputs,
    TensorArg,
};
use tch::{Device, Tensor};

use crate::args::{Bias, DispatchArgs, DispatchX, Handle};
use crate::error::{Error, Result};
use crate::event::EventOverlap;
use crate::group::CudaDevice;
use crate::stream::{record_stream, StreamGuard};
use crate::tensor::{empty, meta, ptr};

/// `t` as the engine takes a tensor argument: its meta and address (0 for an
/// undefined or empty tensor; the checks refuse an undefined one).
pub(crate) fn arg(t: &Tensor) -> TensorArg {
    let addr = if t.defined() { ptr(Some(t)) } else { 0 };
    (meta(t), addr)
}

/// The intranode entries of a [`Handle`] that the calls read, as [`arg`]s.
pub(crate) fn handle_args(h: &Handle) -> HandleTensors {
    let entries = [
        &h.rank_prefix_matrix,
        &h.recv_src_idx,
        &h.is_token_in_rank,
        &h.send_head,
    ];
    HandleTensors::from(entries.map(arg))
}

/// A dispatch's tensors as ep-core takes them, each an [`arg`]: `x` (and its
/// scales), and the handle's entries (a cached dispatch) or the routing and
/// scalars of [`DispatchArgs`] (a full one). The checks
/// ([`crate::checks::dispatch`]) and the Buffer's engine call read the same.
pub(crate) struct DispatchArgsOf {
    x: TensorArg,
    scales: Option<TensorArg>,
    handle: Option<HandleTensors>,
    /// `num_tokens_per_rank`, `is_token_in_rank`, `num_tokens_per_expert`,
    /// `topk_idx`, `topk_weights`.
    routing: [Option<TensorArg>; 5],
    /// `expert_alignment`, `num_worst_tokens`.
    scalars: (i64, i64),
}

impl DispatchArgsOf {
    /// `x` with `handle` (a cached dispatch) or `a` (a full one; the
    /// defaults without it).
    pub(crate) fn new(
        x: DispatchX<'_>,
        handle: Option<&Handle>,
        a: Option<&DispatchArgs<'_>>,
    ) -> Self {
        let (data, scales) = x.parts();
        let routing = a.map_or_else(Default::default, |a| {
            let tensors = [
                a.num_tokens_per_rank,
                a.is_token_in_rank,
                a.num_tokens_per_expert,
                a.topk_idx,
                a.topk_weights,
            ];
            tensors.map(|t| t.map(arg))
        });
        Self {
            x: arg(data),
            scales: scales.map(arg),
            handle: handle.map(handle_args),
            routing,
            scalars: a.map_or((1, 0), |a| (a.expert_alignment, a.num_worst_tokens)),
        }
    }

    /// The arguments as the engine (and, by their metas, the checks) take
    /// them.
    pub(crate) fn tensors(&self) -> DispatchTensors<'_> {
        let [per_rank, in_rank, per_expert, idx, w] = &self.routing;
        DispatchTensors {
            handle: self.handle.as_ref(),
            num_tokens_per_rank: per_rank.as_ref(),
            is_token_in_rank: in_rank.as_ref(),
            num_tokens_per_expert: per_expert.as_ref(),
            topk_idx: idx.as_ref(),
            topk_weights: w.as_ref(),
            expert_alignment: self.scalars.0,
            num_worst_tokens: self.scalars.1,
            ..DispatchTensors::new(&self.x, self.scales.as_ref())
        }
    }
}

/// A combine's tensors as ep-core takes them, each an [`arg`]; the checks
/// ([`crate::checks::combine`]) and the Buffer's engine call read the same.
pub(crate) struct CombineArgsOf {
    x: TensorArg,
    handle: HandleTensors,
    topk_weights: Option<TensorArg>,
    /// The bias as a pair, and whether it was one tensor.
    bias: [Option<TensorArg>; 2],
    one: bool,
}

impl CombineArgsOf {
    pub(crate) fn new(
        x: &Tensor,
        handle: &Handle,
        topk_weights: Option<&Tensor>,
        bias: Bias<'_>,
    ) -> Self {
        let (b0, b1) = bias.pair();
        Self {
            x: arg(x),
            handle: handle_args(handle),
            topk_weights: topk_weights.map(arg),
            bias: [b0.map(arg), b1.map(arg)],
            one: matches!(bias, Bias::One(_)),
        }
    }

    /// The arguments as the engine (and, by their metas, the checks) take
    /// them.
    pub(crate) fn tensors(&self) -> CombineTensors<'_> {
        let [b0, b1] = &self.bias;
        let bias = match (self.one, b0) {
            (true, Some(b)) => Some(CombineBias::One(b)),
            // A pair of None is no bias.
            (false, _) if b0.is_some() || b1.is_some() => {
                Some(CombineBias::Pair(b0.as_ref(), b1.as_ref()))
            }
            _ => None,
        };
        CombineTensors {
            x: &self.x,
            handle: &self.handle,
            topk_weights: self.topk_weights.as_ref(),
            bias,
        }
    }
}

/// The engine's error as this crate's; `refused`: why the front end made no
/// outputs, where it did not.
fn error(e: CallError, refused: Option<Error>) -> Error {
    match e {
        CallError::Arg(a) => Error::Arg(a),
        CallError::NoOutputs => {
            refused.unwrap_or_else(|| Error::state("the call's outputs could not be made"))
        }
        CallError::AfterLaunch(m) => Error::State(m),
        CallError::Comm(e) => Error::Comm(e),
    }
}

/// A call's outputs made by tch on one CUDA device, for the engine.
pub(crate) struct TchOutputs {
    device: Device,
    index: i32,
    core: CoreDevice,
    /// The call's input tensors, kept by the event of an `async_finish`
    /// call (empty otherwise).
    inputs: Vec<Tensor>,
    /// The event of an `async_finish` call, once it ended (else none).
    event: EventOverlap,
    /// Why the last outputs could not be made.
    refused: Option<Error>,
}

impl TchOutputs {
    /// Outputs on `cuda`; with `async_finish`, `inputs` are kept by the
    /// call's event.
    pub(crate) fn new(cuda: CudaDevice, async_finish: bool, inputs: &[Option<&Tensor>]) -> Self {
        let inputs = if async_finish {
            inputs.iter().flatten().map(|t| t.shallow_clone()).collect()
        } else {
            Vec::new()
        };
        Self {
            device: cuda.device,
            index: cuda.index,
            core: cuda.core,
            inputs,
            event: EventOverlap::none(),
            refused: None,
        }
    }

    /// The engine's result as this crate's: the call's value and its event
    /// (none without `async_finish`), or its error (`Arg`: the argument
    /// error naming the argument; `NoOutputs`: why tch made none;
    /// `AfterLaunch`: a state error; `Comm`: the core's error).
    pub(crate) fn result<T>(self, r: CallResult<T>) -> Result<(T, EventOverlap)> {
        match r {
            Ok(v) => Ok((v, self.event)),
            Err(e) => Err(error(e, self.refused)),
        }
    }

    /// `r`'s value, or None with its error kept for [`TchOutputs::result`].
    fn kept<T>(&mut self, r: Result<T>) -> Option<T> {
        r.map_err(|e| self.refused = Some(e)).ok()
    }
}

impl Outputs for TchOutputs {
    type Tensor = Tensor;

    fn empty(&mut self, specs: &[&OutputSpec]) -> Option<Vec<(Tensor, u64)>> {
        let made: Result<Vec<(Tensor, u64)>> = specs
            .iter()
            .map(|spec| {
                let t = empty(spec, self.device)?;
                let addr = ptr(Some(&t));
                Ok((t, addr))
            })
            .collect();
        self.kept(made)
    }

    fn empty_on_comm(
        &mut self,
        specs: &[&OutputSpec],
        comm: StreamHandle,
        compute: StreamHandle,
    ) -> Option<Vec<(Tensor, u64)>> {
        let made = {
            let _on_comm = self.kept(StreamGuard::new(comm, self.index))?;
            self.empty(specs)?
        };
        for (t, _) in &made {
            self.kept(record_stream(t, compute, self.index))?;
        }
        Some(made)
    }

    fn finish_async(&mut self, comm: StreamHandle, made: &[&Tensor]) -> CallResult<()> {
        let tensors = self.inputs.iter().chain(made.iter().copied());
        match EventOverlap::keeping(self.core, comm, self.index, tensors) {
            Ok(event) => {
                self.event = event;
                Ok(())
            }
            Err(Error::Comm(e)) => Err(CallError::Comm(e)),
            Err(e) => Err(CallError::AfterLaunch(e.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use comm::CommError;
    use ep_core::calls::{ArgError, ArgErrorKind, DType, OTHER_DEVICE};
    use tch::Kind;

    #[test]
    fn an_undefined_tensor_reads_as_refused_without_an_address() {
        let (m, addr) = arg(&Tensor::new());
        assert_eq!(
            (m.dtype, m.device, addr),
            (DType::Other("undefined".into()), OTHER_DEVICE, 0)
        );
        let t = Tensor::zeros([2, 8], (Kind::BFloat16, Device::Cpu));
        let (m, addr) = arg(&t);
        assert_eq!((m.shape, addr), (vec![2, 8], t.data_ptr() as u64));
        assert_eq!(arg(&t.narrow(0, 0, 0)).1, 0);
    }

    #[test]
    fn engine_errors_keep_their_kind() {
        let refused = ArgError {
            kind: ArgErrorKind::Dtype,
            message: "x must have dtype torch.bfloat16, got torch.float32".into(),
        };
        let e = error(CallError::Arg(refused), None);
        assert_eq!(e.python_class(), "moelink.DtypeError");
        assert!(e.to_string().starts_with("x must"), "{e}");
        // No outputs: why tch made none, where it said.
        let oom = Error::state("out of memory");
        assert_eq!(
            error(CallError::NoOutputs, Some(oom)).to_string(),
            "out of memory"
        );
        assert_eq!(
            error(CallError::NoOutputs, None).python_class(),
            "RuntimeError"
        );
        let late = error(CallError::AfterLaunch("rank 1: dispatch ...".into()), None);
        assert_eq!(
            (late.python_class(), late.to_string().as_str()),
            ("RuntimeError", "rank 1: dispatch ...")
        );
        let invalid = CommError::invalid("num_sms", "too many");
        assert_eq!(
            error(CallError::Comm(invalid), None).python_class(),
            "ValueError"
        );
    }
}
