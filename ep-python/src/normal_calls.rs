//! `_native.NormalCalls`: a Buffer's eager normal-mode calls whole in one
//! native call each, through ep-core's engine (`ep_core::engine`): the
//! tensors are read at once (`tensors::read_all`), the outputs made through
//! torch's C shim, and the engine checks, orders the streams, launches and
//! reports what a kernel recorded.
//!
//! A call declines (returns None, having done nothing) for anything the
//! engine or the reads refuse: a tensor subclass, a refused check, a refused
//! allocation, a handle of the other kind, a destroyed Buffer. Python's
//! checked path then runs the call, and raises its own error where there is
//! one.

use comm::StreamHandle;
use ep_core::engine::CallResult;
use ep_core::engine::{
    CallError, CombineBias, CombineTensors, DispatchTensors, HandleTensors, StreamArgs, Streams,
};
use ep_core::EpBuffer as Core;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::ep_buffer::EpBuffer;
use crate::streams::StreamOrder;
use crate::tensors::{int, read_n};
use crate::to_py;
use crate::torch_alloc::{self, EngineOutputs};

#[pyclass(module = "moelink._native")]
pub struct NormalCalls {
    ep: Py<EpBuffer>,
    num_ranks: i64,
    device: i32,
    /// The Buffer's communication stream (raw `cudaStream_t`).
    comm: usize,
    /// The Buffer's `StreamOrder` (one event, shared with the checked path).
    order: Py<StreamOrder>,
    /// `device index -> raw current stream` (`moelink._streams.current_raw_stream`).
    stream_of: Py<PyAny>,
    /// `moelink.EventOverlap`: an eager call returns `EventOverlap(None)`.
    event: Py<PyAny>,
}

#[pymethods]
impl NormalCalls {
    #[new]
    fn new(
        ep: Py<EpBuffer>,
        num_ranks: i64,
        device: i32,
        comm: usize,
        order: Py<StreamOrder>,
        stream_of: Py<PyAny>,
        event: Py<PyAny>,
    ) -> Self {
        NormalCalls {
            ep,
            num_ranks,
            device,
            comm,
            order,
            stream_of,
            event,
        }
    }

    /// `Buffer.get_dispatch_layout(topk_idx, num_experts)` eager within one
    /// node, whole: `(num_tokens_per_rank, None, num_tokens_per_expert,
    /// is_token_in_rank, EventOverlap(None))`, or None where it declines.
    fn layout<'py>(
        &self,
        py: Python<'py>,
        topk_idx: &Bound<'py, PyAny>,
        num_experts: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let Some(e) = int(num_experts) else {
            return Ok(None);
        };
        if !torch_alloc::torch_alloc_ready() {
            return Ok(None);
        }
        let Some([Some(idx)]) = read_n(py, &[topk_idx])? else {
            return Ok(None);
        };
        let run = |core: &mut Core, eager: &Streams<'_>, out: &mut EngineOutputs<'py>| {
            core.layout_call(eager, &idx, e, out)
        };
        // The layout kernel's grid is its own: no SMs to pick.
        let Some((per_rank, per_expert, in_rank)) = self.run(py, 0, run)? else {
            return Ok(None);
        };
        let event = self.event.bind(py).call1((py.None(),))?;
        let none = py.None().into_bound(py);
        PyTuple::new(py, [per_rank, none, per_expert, in_rank, event]).map(Some)
    }

    /// `Buffer.combine(x, handle, topk_weights, bias)` eager (no event, no
    /// `async_finish`, outputs on the current stream) within one node, with
    /// `num_sms` SMs, whole: `(combined_x, combined_topk_weights,
    /// EventOverlap(None))`, or None where the call declines.
    #[pyo3(signature = (x, handle, topk_weights, bias, num_sms))]
    fn combine<'py>(
        &self,
        py: Python<'py>,
        x: &Bound<'py, PyAny>,
        handle: &Bound<'py, PyAny>,
        topk_weights: &Bound<'py, PyAny>,
        bias: &Bound<'py, PyAny>,
        num_sms: u32,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        if !torch_alloc::torch_alloc_ready() {
            return Ok(None);
        }
        let Some([rpm, src, in_rank, head]) = handle_of(handle)? else {
            return Ok(None);
        };
        let none = py.None().into_bound(py);
        let (b0, b1, one) = if bias.is_none() {
            (none.clone(), none.clone(), false)
        } else if bias.is_exact_instance_of::<PyTuple>() {
            let b = bias.cast::<PyTuple>()?;
            if b.len() != 2 {
                return Ok(None);
            }
            (b.get_item(0)?, b.get_item(1)?, false)
        } else {
            (bias.clone(), none.clone(), true)
        };
        let objs = [x, topk_weights, &rpm, &src, &in_rank, &head, &b0, &b1];
        let Some([Some(xr), w, Some(rpm), Some(src), Some(in_rank), Some(head), b0, b1]) =
            read_n(py, &objs)?
        else {
            return Ok(None);
        };
        let bias = if one {
            match &b0 {
                Some(b) => Some(CombineBias::One(b)),
                None => return Ok(None),
            }
        } else if bias.is_none() {
            None
        } else {
            Some(CombineBias::Pair(b0.as_ref(), b1.as_ref()))
        };
        let handle = HandleTensors::from([rpm, src, in_rank, head]);
        let tensors = CombineTensors {
            x: &xr,
            handle: &handle,
            topk_weights: w.as_ref(),
            bias,
        };
        let run = |core: &mut Core, eager: &Streams<'_>, out: &mut EngineOutputs<'py>| {
            core.combine_call(eager, &tensors, out)
        };
        let Some((combined, weights)) = self.run(py, num_sms, run)? else {
            return Ok(None);
        };
        let event = self.event.bind(py).call1((py.None(),))?;
        let weights = weights.unwrap_or(none);
        PyTuple::new(py, [combined, weights, event]).map(Some)
    }

    /// `Buffer.dispatch(x, handle, ...)` eager within one node, with `num_sms`
    /// SMs, whole: DeepEP's `(recv_x or (recv_x, recv_x_scales),
    /// recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
    /// handle, EventOverlap(None))` (a cached dispatch: `(recv_x..., None,
    /// None, None, None, event)`); or None where the call declines
    /// (`num_tokens_per_rdma_rank` must be None within one node, and a cached
    /// dispatch takes no routing arguments: the checked path refuses them).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
        is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
        num_worst_tokens, num_sms))]
    fn dispatch<'py>(
        &self,
        py: Python<'py>,
        x: &Bound<'py, PyAny>,
        handle: &Bound<'py, PyAny>,
        num_tokens_per_rank: &Bound<'py, PyAny>,
        num_tokens_per_rdma_rank: &Bound<'py, PyAny>,
        is_token_in_rank: &Bound<'py, PyAny>,
        num_tokens_per_expert: &Bound<'py, PyAny>,
        topk_idx: &Bound<'py, PyAny>,
        topk_weights: &Bound<'py, PyAny>,
        expert_alignment: &Bound<'py, PyAny>,
        num_worst_tokens: &Bound<'py, PyAny>,
        num_sms: u32,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let (Some(alignment), Some(worst)) = (int(expert_alignment), int(num_worst_tokens)) else {
            return Ok(None);
        };
        if !num_tokens_per_rdma_rank.is_none() || !torch_alloc::torch_alloc_ready() {
            return Ok(None);
        }
        let none = py.None().into_bound(py);
        let Some((data, scales, fp8)) = x_of(x, &none)? else {
            return Ok(None);
        };
        let routing = [
            num_tokens_per_rank,
            is_token_in_rank,
            num_tokens_per_expert,
            topk_idx,
            topk_weights,
        ];
        let x = (&data, &scales, fp8);
        let done = if handle.is_none() {
            self.full_dispatch(py, x, routing, (alignment, worst), num_sms)?
        } else if routing.iter().all(|r| r.is_none()) {
            self.cached_dispatch(py, x, handle, (alignment, worst), num_sms)?
        } else {
            None
        };
        let Some((out_x, rest)) = done else {
            return Ok(None);
        };
        let event = self.event.bind(py).call1((py.None(),))?;
        let [idx, w, per_expert, handle] = rest.unwrap_or_else(|| [(); 4].map(|_| none.clone()));
        PyTuple::new(py, [out_x, idx, w, per_expert, handle, event]).map(Some)
    }
}

/// dispatch's `x` as read: `(data, scales or None, fp8)`.
type XArgs<'a, 'py> = (&'a Bound<'py, PyAny>, &'a Bound<'py, PyAny>, bool);
/// A dispatch's outputs before its event: `recv_x` (or the pair with its
/// scales), then (a full dispatch) `recv_topk_idx`, `recv_topk_weights`, the
/// per-expert list and the handle.
type Dispatched<'py> = (Bound<'py, PyAny>, Option<[Bound<'py, PyAny>; 4]>);

impl NormalCalls {
    /// A full dispatch of [`NormalCalls::dispatch`]: `routing` is
    /// `num_tokens_per_rank`, `is_token_in_rank`, `num_tokens_per_expert`,
    /// `topk_idx`, `topk_weights`; `scalars` `(expert_alignment,
    /// num_worst_tokens)`.
    fn full_dispatch<'py>(
        &self,
        py: Python<'py>,
        (data, scales, fp8): XArgs<'_, 'py>,
        routing: [&Bound<'py, PyAny>; 5],
        (alignment, worst): (i64, i64),
        num_sms: u32,
    ) -> PyResult<Option<Dispatched<'py>>> {
        let [per_rank, in_rank_obj, per_expert, idx, w] = routing;
        let objs = [data, scales, per_rank, in_rank_obj, per_expert, idx, w];
        let Some([Some(xr), sr, per_rank, in_rank, per_expert, idx, w]) = read_n(py, &objs)? else {
            return Ok(None);
        };
        if fp8 && sr.is_none() {
            return Ok(None);
        }
        let tensors = DispatchTensors {
            num_tokens_per_rank: per_rank.as_ref(),
            is_token_in_rank: in_rank.as_ref(),
            num_tokens_per_expert: per_expert.as_ref(),
            topk_idx: idx.as_ref(),
            topk_weights: w.as_ref(),
            expert_alignment: alignment,
            num_worst_tokens: worst,
            ..DispatchTensors::new(&xr, sr.as_ref())
        };
        let run = |core: &mut Core, eager: &Streams<'_>, out: &mut EngineOutputs<'py>| {
            core.dispatch_call(eager, &tensors, out)
        };
        let Some(d) = self.run(py, num_sms, run)? else {
            return Ok(None);
        };
        let none = py.None().into_bound(py);
        let handle = PyTuple::new(
            py,
            [
                d.rank_prefix_matrix,
                d.channel_prefix_matrix,
                d.recv_channel_prefix_matrix,
                d.recv_src_idx,
                in_rank_obj.clone(),
                d.send_head,
            ],
        )?;
        let per_expert = PyList::new(py, d.num_recv_tokens_per_expert)?;
        let rest = [
            d.recv_topk_idx.unwrap_or_else(|| none.clone()),
            d.recv_topk_weights.unwrap_or(none),
            per_expert.into_any(),
            handle.into_any(),
        ];
        Ok(Some((
            out_x(py, d.recv_x, d.recv_x_scales, fp8)?,
            Some(rest),
        )))
    }

    /// A cached dispatch of [`NormalCalls::dispatch`].
    fn cached_dispatch<'py>(
        &self,
        py: Python<'py>,
        (data, scales, fp8): XArgs<'_, 'py>,
        handle: &Bound<'py, PyAny>,
        (alignment, worst): (i64, i64),
        num_sms: u32,
    ) -> PyResult<Option<Dispatched<'py>>> {
        let Some(h) = handle_of(handle)? else {
            return Ok(None);
        };
        let objs = [data, scales, &h[0], &h[1], &h[2], &h[3]];
        let Some([Some(xr), sr, Some(rpm), Some(src), Some(in_rank), Some(head)]) =
            read_n(py, &objs)?
        else {
            return Ok(None);
        };
        if fp8 && sr.is_none() {
            return Ok(None);
        }
        let handle = HandleTensors::from([rpm, src, in_rank, head]);
        // The checks refuse a cached dispatch's other alignment or row count.
        let tensors = DispatchTensors {
            expert_alignment: alignment,
            num_worst_tokens: worst,
            ..DispatchTensors::cached(&xr, sr.as_ref(), &handle)
        };
        let run = |core: &mut Core, eager: &Streams<'_>, out: &mut EngineOutputs<'py>| {
            core.cached_dispatch_call(eager, &tensors, out)
        };
        let Some((recv_x, recv_scales)) = self.run(py, num_sms, run)? else {
            return Ok(None);
        };
        Ok(Some((out_x(py, recv_x, recv_scales, fp8)?, None)))
    }
}

/// A dispatch's `recv_x`, or `(recv_x, recv_x_scales)` for fp8.
fn out_x<'py>(
    py: Python<'py>,
    recv_x: Bound<'py, PyAny>,
    scales: Option<Bound<'py, PyAny>>,
    fp8: bool,
) -> PyResult<Bound<'py, PyAny>> {
    Ok(match scales {
        Some(s) if fp8 => PyTuple::new(py, [recv_x, s])?.into_any(),
        _ => recv_x,
    })
}

impl NormalCalls {
    /// `call` on ep-core's buffer with this Buffer's streams and torch's
    /// outputs: its outputs, None where it declines (a refused check or
    /// allocation, no intranode part, a group across nodes), or its error.
    fn run<'py, T>(
        &self,
        py: Python<'py>,
        num_sms: u32,
        call: impl FnOnce(&mut Core, &Streams<'_>, &mut EngineOutputs<'py>) -> CallResult<T>,
    ) -> PyResult<Option<T>> {
        // Refused (RuntimeError) while another thread's call holds it (a
        // full dispatch waits for its counts without the GIL).
        let mut ep = self.ep.try_borrow_mut(py)?;
        let core = ep.core_mut();
        if core.intranode().is_none() || core.internode().is_some() {
            return Ok(None);
        }
        let compute: usize = self.stream_of.call1(py, (self.device,))?.extract(py)?;
        let order = self.order.borrow(py);
        let eager = Streams {
            num_ranks: self.num_ranks,
            device: self.device,
            num_sms,
            compute: StreamHandle(compute),
            comm: StreamHandle(self.comm),
            order: order.inner(),
            args: StreamArgs::default(),
        };
        let mut outputs = EngineOutputs {
            py,
            device: self.device,
        };
        match call(core, &eager, &mut outputs) {
            Ok(r) => Ok(Some(r)),
            Err(CallError::Arg(_) | CallError::NoOutputs) => Ok(None),
            Err(CallError::AfterLaunch(m)) => Err(PyRuntimeError::new_err(m)),
            Err(CallError::Comm(e)) => Err(to_py(e)),
        }
    }
}

/// An intranode handle's entries the calls read (rank_prefix_matrix,
/// recv_src_idx, is_token_in_rank, send_head), where `handle` is an exact
/// 6-tuple (`(rank_prefix_matrix, channel_prefix_matrix,
/// recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, send_head)`).
fn handle_of<'py>(handle: &Bound<'py, PyAny>) -> PyResult<Option<[Bound<'py, PyAny>; 4]>> {
    if !handle.is_exact_instance_of::<PyTuple>() {
        return Ok(None);
    }
    let h = handle.cast::<PyTuple>()?;
    if h.len() != 6 {
        return Ok(None);
    }
    Ok(Some([
        h.get_item(0)?,
        h.get_item(3)?,
        h.get_item(4)?,
        h.get_item(5)?,
    ]))
}

/// dispatch's `x`: a tensor, or an exact `(data, scales)` pair (fp8), as
/// `(data, scales or none, fp8)`; None for a tuple of another length.
#[allow(clippy::type_complexity)]
fn x_of<'py>(
    x: &Bound<'py, PyAny>,
    none: &Bound<'py, PyAny>,
) -> PyResult<Option<(Bound<'py, PyAny>, Bound<'py, PyAny>, bool)>> {
    if !x.is_exact_instance_of::<PyTuple>() {
        return Ok(Some((x.clone(), none.clone(), false)));
    }
    let pair = x.cast::<PyTuple>()?;
    if pair.len() != 2 {
        return Ok(None);
    }
    Ok(Some((pair.get_item(0)?, pair.get_item(1)?, true)))
}
