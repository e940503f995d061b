//! `_native.LlCalls`: the low-latency calls of one `moelink.Buffer` as the
//! binding runs them. It keeps the calls' bookkeeping (the receive hooks not
//! yet called, oldest first, and the call count that names them) for every
//! path, and runs an eager call (`async_finish=False`) whole in one native
//! call ([`LlCalls::dispatch`], [`LlCalls::combine`]): the checks
//! (`ep_core::calls`), the outputs (torch's caching allocator through its C
//! shim, `torch_alloc.rs`), the launch and the hook, with no Python between
//! them (docs/architecture.md, "One native call per low-latency call").
//!
//! Such a call declines (returns None, having done nothing) where any check
//! refuses, an argument is not what the fast path reads (a tensor subclass, a
//! non-int size), a hook rule would refuse, or torch's shim cannot make an
//! output: Python then runs the checked path, which raises the refusal that
//! names the argument, or torch's own error.

use ep_core::calls;
use ep_core::ll_hooks::{Hook, HookBook, HookError};
use ep_core::low_latency::{CombineCall, LlCall, Phases};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyTuple};
use pyo3::{PyTraverseError, PyVisit};

use crate::ep_buffer::{ll_dispatch_call, EpBuffer};
use crate::tensors::{int, read_n, Read};
use crate::torch_alloc::{self, Spec};

#[pyclass(module = "moelink._native")]
pub struct LlCalls {
    /// The Buffer's native part (None where it is not an `EpBuffer`: a test's
    /// stand-in, with which every call takes the Python path).
    ep: Option<Py<EpBuffer>>,
    num_ranks: i64,
    device: i32,
    /// `device index -> raw current stream` (`moelink._streams.current_raw_stream`).
    stream_of: Py<PyAny>,
    /// `moelink.EventOverlap`: an eager call returns `EventOverlap(None)`.
    event: Py<PyAny>,
    /// The pending hooks and the call count (`ep_core::ll_hooks`).
    book: HookBook,
    /// The hook objects of `book`'s pending hooks.
    hooks: Vec<(u64, Py<LlHook>)>,
}

/// What a hook launches: a Python callable `launch(stream)` (the checked
/// path's), or the receive phase of a native call.
enum Receive {
    Python(Py<PyAny>),
    Native(LlCall),
}

/// The receive half of a low-latency call (`return_recv_hook=True`).
#[pyclass(module = "moelink._native")]
pub struct LlHook {
    owner: Py<LlCalls>,
    hook: Hook,
    #[pyo3(get)]
    called: bool,
    receive: Option<Receive>,
    /// What the launched kernels read or write until the receive ran.
    keep: Option<Py<PyAny>>,
}

fn flag(obj: &Bound<'_, PyAny>) -> Option<bool> {
    obj.cast::<PyBool>().ok().map(|b| b.is_true())
}

impl LlCalls {
    fn current_stream(&self, py: Python<'_>) -> PyResult<usize> {
        self.stream_of.call1(py, (self.device,))?.extract(py)
    }

    /// The native part, and the call's `return_recv_hook`, where a call may
    /// run whole now: the flag is a bool, the hook rules let the call start
    /// (else the Python path raises their error) and torch's shim makes
    /// outputs.
    fn ready(
        &self,
        py: Python<'_>,
        return_recv_hook: &Bound<'_, PyAny>,
    ) -> Option<(Py<EpBuffer>, bool)> {
        let hook = flag(return_recv_hook)?;
        if self.book.begin(false, hook).is_err() || !torch_alloc::torch_alloc_ready() {
            return None;
        }
        self.ep.as_ref().map(|e| (e.clone_ref(py), hook))
    }

    /// After a native call's launch: its bookkeeping ([`Self::launched`]),
    /// then `(EventOverlap(None), hook or None)`, or what the kernels
    /// recorded, raised.
    fn finish<'py>(
        slf: &Bound<'py, Self>,
        kind: &str,
        receive: Option<Receive>,
        keep: Bound<'py, PyTuple>,
        recorded: Option<Py<PyAny>>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        let py = slf.py();
        let hook = Self::launched(slf, kind, receive, keep.into_any().unbind())?;
        let event = slf.borrow().event.bind(py).call1((py.None(),))?;
        raise(py, recorded)?;
        let hook = match hook {
            Some(h) => h.into_bound(py).into_any(),
            None => py.None().into_bound(py),
        };
        Ok((event, hook))
    }

    /// The bookkeeping of a call just launched: its hook (pending until
    /// called) where `receive` is given, else only the count.
    fn launched(
        slf: &Bound<'_, Self>,
        kind: &str,
        receive: Option<Receive>,
        keep: Py<PyAny>,
    ) -> PyResult<Option<Py<LlHook>>> {
        let py = slf.py();
        let mut me = slf.borrow_mut();
        let Some(hook) = me.book.launched(kind, receive.is_some()) else {
            return Ok(None);
        };
        let id = hook.id;
        let obj = Py::new(
            py,
            LlHook {
                owner: slf.clone().unbind(),
                hook,
                called: false,
                receive,
                keep: Some(keep),
            },
        )?;
        me.hooks.push((id, obj.clone_ref(py)));
        Ok(Some(obj))
    }
}

/// The phases an eager call launches: its send only where its hook receives.
fn phases(return_recv_hook: bool) -> Phases {
    if return_recv_hook {
        Phases::Send
    } else {
        Phases::Both
    }
}

/// A refusal of the hook rules as Python raises it.
fn hook_err(e: HookError) -> PyErr {
    match e {
        HookError::Arg(m) => PyValueError::new_err(m),
        HookError::State(m) => PyRuntimeError::new_err(m),
    }
}

/// Raises `recorded` (an exception object a launch returned) where given.
fn raise(py: Python<'_>, recorded: Option<Py<PyAny>>) -> PyResult<()> {
    match recorded {
        Some(e) => Err(PyErr::from_value(e.into_bound(py))),
        None => Ok(()),
    }
}

#[pymethods]
impl LlCalls {
    #[new]
    fn new(
        ep: &Bound<'_, PyAny>,
        num_ranks: i64,
        device: i32,
        stream_of: Py<PyAny>,
        event: Py<PyAny>,
    ) -> Self {
        LlCalls {
            ep: ep.extract::<Py<EpBuffer>>().ok(),
            num_ranks,
            device,
            stream_of,
            event,
            book: HookBook::new(),
            hooks: Vec::new(),
        }
    }

    // A pending hook and its LlCalls refer to each other: the cycle collector
    // must see both (a Buffer dropped with a hook pending frees what it kept).
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Some(ep) = &self.ep {
            visit.call(ep)?;
        }
        visit.call(&self.stream_of)?;
        visit.call(&self.event)?;
        for (_, h) in &self.hooks {
            visit.call(h)?;
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        self.hooks.clear();
    }

    /// The receive hooks not yet called, oldest first.
    #[getter]
    fn pending<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let of = |id: u64| {
            let found = self.hooks.iter().find(|(i, _)| *i == id);
            found.map(|(_, h)| h.clone_ref(py))
        };
        let hooks: Vec<_> = self
            .book
            .pending()
            .iter()
            .filter_map(|h| of(h.id))
            .collect();
        PyTuple::new(py, hooks)
    }

    /// Checks that a low-latency call may start now (`ep_core::ll_hooks`):
    /// `ValueError` for `async_finish` with a hook, `RuntimeError` naming the
    /// pending hooks where they forbid it.
    fn begin(
        &self,
        async_finish: &Bound<'_, PyAny>,
        return_recv_hook: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        // Python's truth values, as the Python path has always read them.
        let (a, h) = (async_finish.is_truthy()?, return_recv_hook.is_truthy()?);
        self.book.begin(a, h).map_err(hook_err)
    }

    /// The bookkeeping of a call the Python path launched: with `launch` (a
    /// callable `launch(stream)` of its receive half) its hook, pending
    /// until called, which keeps `keep`; else None (the call is counted).
    #[pyo3(signature = (kind, launch, keep))]
    fn record(
        slf: &Bound<'_, Self>,
        kind: &str,
        launch: Option<Py<PyAny>>,
        keep: Py<PyAny>,
    ) -> PyResult<Option<Py<LlHook>>> {
        Self::launched(slf, kind, launch.map(Receive::Python), keep)
    }

    /// `Buffer.low_latency_dispatch` with `async_finish=False`, whole:
    /// DeepEP's `(recv_x or (recv_x, scales), recv_count, handle, event,
    /// hook)`, or None where the call declines (module docs).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
        cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
        round_scale, use_ue8m0, return_recv_hook))]
    fn dispatch<'py>(
        slf: &Bound<'py, Self>,
        x: &Bound<'py, PyAny>,
        topk_idx: &Bound<'py, PyAny>,
        num_max_dispatch_tokens_per_rank: &Bound<'py, PyAny>,
        num_experts: &Bound<'py, PyAny>,
        cumulative_local_expert_recv_stats: &Bound<'py, PyAny>,
        dispatch_wait_recv_cost_stats: &Bound<'py, PyAny>,
        use_fp8: &Bound<'py, PyAny>,
        round_scale: &Bound<'py, PyAny>,
        use_ue8m0: &Bound<'py, PyAny>,
        return_recv_hook: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let py = slf.py();
        let me = slf.borrow();
        let Some((ep, return_recv_hook)) = me.ready(py, return_recv_hook) else {
            return Ok(None);
        };
        let (Some(t), Some(e), Some(fp8), Some(round), Some(ue8m0)) = (
            int(num_max_dispatch_tokens_per_rank),
            int(num_experts),
            flag(use_fp8),
            flag(round_scale),
            flag(use_ue8m0),
        ) else {
            return Ok(None);
        };
        let objs = [
            x,
            topk_idx,
            cumulative_local_expert_recv_stats,
            dispatch_wait_recv_cost_stats,
        ];
        let Some([Some((xm, x_ptr)), Some((im, idx_ptr)), count, wait]) = read_n(py, &objs)? else {
            return Ok(None);
        };
        let meta = |m: &Option<Read>| m.as_ref().map(|(m, _)| m.clone());
        let (count_meta, wait_meta) = (meta(&count), meta(&wait));
        let args = calls::LlDispatchArgs {
            x: &xm,
            topk_idx: &im,
            num_max_dispatch_tokens_per_rank: t,
            num_experts: e,
            cumulative_local_expert_recv_stats: count_meta.as_ref(),
            dispatch_wait_recv_cost_stats: wait_meta.as_ref(),
            use_fp8: fp8,
            round_scale: round,
            use_ue8m0: ue8m0,
        };
        let Ok(plan) = calls::ll_dispatch(me.num_ranks, me.device, &args) else {
            return Ok(None);
        };
        let epb = ep.borrow(py);
        if epb.check_ll_shape(&plan.geometry, plan.num_topk).is_err() {
            return Ok(None);
        }
        let o = &plan.outputs;
        let (Some(rx), Some(rc), Some(si), Some(lr)) = (
            calls::output(o, "recv_x"),
            calls::output(o, "recv_count"),
            calls::output(o, "src_info"),
            calls::output(o, "layout_range"),
        ) else {
            return Ok(None);
        };
        let scales = calls::output(o, "recv_x_scales");
        let mut specs = vec![Spec::of(rx)?, Spec::of(rc)?, Spec::of(si)?, Spec::of(lr)?];
        if let Some(s) = scales {
            specs.push(Spec::of(s)?);
        }
        let stream = me.current_stream(py)?;
        // recv_x an allocation of its own (it is freed apart from the
        // handle's tensors), the small outputs views of one.
        let specs: Vec<&Spec> = specs.iter().collect();
        let Some(made) = torch_alloc::empty(py, &specs, 1, me.device)? else {
            return Ok(None);
        };
        let [recv_x, recv_count, src_info, layout_range, rest @ ..] = &made[..] else {
            return Ok(None);
        };
        let recv_scales = rest.first();
        let n = plan.num_tokens > 0;
        let ptr = |m: &Option<Read>| m.as_ref().map_or(0, |(_, p)| *p);
        let (x_at, idx_at) = if n { (x_ptr, idx_ptr) } else { (0, 0) };
        let addresses = (
            x_at,
            idx_at,
            recv_x.1,
            recv_scales.map_or(0, |s| s.1),
            recv_count.1,
            src_info.1,
            layout_range.1,
            ptr(&count),
            ptr(&wait),
        );
        let call = LlCall::Dispatch(ll_dispatch_call(&plan, addresses));
        drop(me);
        let recorded = epb.launch_ll(py, stream, &call, phases(return_recv_hook))?;
        drop(epb);
        let scales_obj = recv_scales.map_or_else(|| py.None().into_bound(py), |s| s.0.clone());
        let keep = PyTuple::new(
            py,
            [
                x.clone(),
                topk_idx.clone(),
                recv_x.0.clone(),
                scales_obj.clone(),
                recv_count.0.clone(),
                src_info.0.clone(),
                layout_range.0.clone(),
                cumulative_local_expert_recv_stats.clone(),
                dispatch_wait_recv_cost_stats.clone(),
            ],
        )?;
        let g = plan.geometry;
        let receive = return_recv_hook.then_some(Receive::Native(call));
        let (event, hook) = Self::finish(slf, "dispatch", receive, keep, recorded)?;
        let out = if fp8 {
            PyTuple::new(py, [recv_x.0.clone(), scales_obj])?.into_any()
        } else {
            recv_x.0.clone()
        };
        let handle = (
            src_info.0.clone(),
            layout_range.0.clone(),
            g.max_tokens,
            g.hidden,
            g.num_experts,
        )
            .into_pyobject(py)?;
        PyTuple::new(
            py,
            [out, recv_count.0.clone(), handle.into_any(), event, hook],
        )
        .map(Some)
    }

    /// `Buffer.low_latency_combine` with `async_finish=False`, whole:
    /// `(combined_x, event, hook)`, or None where the call declines.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (x, topk_idx, topk_weights, handle, use_logfmt, zero_copy,
        return_recv_hook, out, combine_wait_recv_cost_stats))]
    fn combine<'py>(
        slf: &Bound<'py, Self>,
        x: &Bound<'py, PyAny>,
        topk_idx: &Bound<'py, PyAny>,
        topk_weights: &Bound<'py, PyAny>,
        handle: &Bound<'py, PyAny>,
        use_logfmt: &Bound<'py, PyAny>,
        zero_copy: &Bound<'py, PyAny>,
        return_recv_hook: &Bound<'py, PyAny>,
        out: &Bound<'py, PyAny>,
        combine_wait_recv_cost_stats: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let py = slf.py();
        let me = slf.borrow();
        let Some((ep, return_recv_hook)) = me.ready(py, return_recv_hook) else {
            return Ok(None);
        };
        let (Some(logfmt), Some(zero_copy)) = (flag(use_logfmt), flag(zero_copy)) else {
            return Ok(None);
        };
        let Ok(h) = handle.cast::<PyTuple>() else {
            return Ok(None);
        };
        if !handle.is_exact_instance_of::<PyTuple>() || h.len() != 5 {
            return Ok(None);
        }
        let (src_info, layout_range) = (h.get_item(0)?, h.get_item(1)?);
        let (Some(ht), Some(hh), Some(he)) = (
            int(&h.get_item(2)?),
            int(&h.get_item(3)?),
            int(&h.get_item(4)?),
        ) else {
            return Ok(None);
        };
        let none = py.None().into_bound(py);
        let objs = [
            if zero_copy { &none } else { x },
            topk_idx,
            topk_weights,
            &src_info,
            &layout_range,
            out,
            combine_wait_recv_cost_stats,
        ];
        let Some(
            [xr, Some((im, idx_ptr)), Some((wm, w_ptr)), Some((sm, _)), Some((lm, lr_ptr)), out_r, stats],
        ) = read_n(py, &objs)?
        else {
            return Ok(None);
        };
        // x None is the zero-copy buffer's; anything else is refused there.
        if xr.is_none() && !zero_copy {
            return Ok(None);
        }
        let ll_handle = calls::LlHandle {
            src_info: sm,
            layout_range: lm,
            num_max_dispatch_tokens_per_rank: ht,
            hidden: hh,
            num_experts: he,
        };
        let meta = |m: &Option<Read>| m.as_ref().map(|(m, _)| m.clone());
        let (x_meta, out_meta, stats_meta) = (meta(&xr), meta(&out_r), meta(&stats));
        let args = calls::LlCombineArgs {
            handle: &ll_handle,
            use_logfmt: logfmt,
            zero_copy,
            x: x_meta.as_ref(),
            topk_idx: &im,
            topk_weights: &wm,
            out: out_meta.as_ref(),
            combine_wait_recv_cost_stats: stats_meta.as_ref(),
        };
        let Ok(plan) = calls::ll_combine(me.num_ranks, me.device, &args) else {
            return Ok(None);
        };
        let epb = ep.borrow(py);
        let x_ptr = match &xr {
            Some((_, p)) => *p,
            None => match epb.ll_zero_copy_ptr(&plan.geometry) {
                Ok(p) => p,
                Err(_) => return Ok(None),
            },
        };
        let stream = me.current_stream(py)?;
        let (out_obj, out_ptr) = match &out_r {
            Some((_, p)) => (out.clone(), *p),
            None => {
                let Some(s) = calls::output(&plan.outputs, "combined_x") else {
                    return Ok(None);
                };
                let Some(mut made) = torch_alloc::empty(py, &[&Spec::of(s)?], 1, me.device)? else {
                    return Ok(None);
                };
                made.remove(0)
            }
        };
        let n = plan.num_tokens > 0;
        let (idx_at, w_at, out_at) = if n {
            (idx_ptr, w_ptr, out_ptr)
        } else {
            (0, 0, 0)
        };
        let stats_at = stats.as_ref().map_or(0, |(_, p)| *p);
        let call = LlCall::Combine(CombineCall::planned(
            &plan, x_ptr, lr_ptr, idx_at, w_at, out_at, stats_at,
        ));
        drop(me);
        let recorded = epb.launch_ll(py, stream, &call, phases(return_recv_hook))?;
        drop(epb);
        let keep = PyTuple::new(
            py,
            [
                if zero_copy {
                    py.None().into_bound(py)
                } else {
                    x.clone()
                },
                topk_idx.clone(),
                topk_weights.clone(),
                src_info,
                layout_range,
                out_obj.clone(),
                combine_wait_recv_cost_stats.clone(),
            ],
        )?;
        let receive = return_recv_hook.then_some(Receive::Native(call));
        let (event, hook) = Self::finish(slf, "combine", receive, keep, recorded)?;
        PyTuple::new(py, [out_obj, event, hook]).map(Some)
    }
}

#[pymethods]
impl LlHook {
    #[getter]
    fn name(&self) -> &str {
        &self.hook.name
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.owner)?;
        if let Some(keep) = &self.keep {
            visit.call(keep)?;
        }
        if let Some(Receive::Python(launch)) = &self.receive {
            visit.call(launch)?;
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        self.keep = None;
        self.receive = None;
    }

    fn __repr__(&self) -> String {
        let state = if self.called { "called" } else { "pending" };
        format!("<low-latency receive hook of {}, {state}>", self.hook.name)
    }

    /// Launches the receive half (`ep_core::ll_hooks`: once, in call order,
    /// else `RuntimeError`). Refuses (raising, nothing launched) once a
    /// device wait ran out; raises what a kernel recorded (an expert id out
    /// of range, in this call or an earlier one) once the hook's bookkeeping
    /// is done: the receive half is launched, the ranks stay in step.
    fn __call__(slf: &Bound<'_, Self>) -> PyResult<()> {
        let py = slf.py();
        let (owner, hook) = {
            let me = slf.borrow();
            (me.owner.clone_ref(py), me.hook.clone())
        };
        let (stream, ep) = {
            let o = owner.borrow(py);
            o.book.may_run(&hook).map_err(hook_err)?;
            (
                o.current_stream(py)?,
                o.ep.as_ref().map(|e| e.clone_ref(py)),
            )
        };
        let recorded = {
            let me = slf.borrow();
            match me.receive.as_ref() {
                Some(Receive::Python(launch)) => {
                    let launch = launch.clone_ref(py);
                    drop(me);
                    let r = launch.call1(py, (stream,))?;
                    (!r.is_none(py)).then_some(r)
                }
                Some(Receive::Native(call)) => {
                    let ep = ep.ok_or_else(|| {
                        PyRuntimeError::new_err("this Buffer has no low-latency buffer")
                    })?;
                    let recorded = ep.borrow(py).launch_ll(py, stream, call, Phases::Recv)?;
                    recorded
                }
                None => None,
            }
        };
        {
            let mut me = slf.borrow_mut();
            me.called = true;
            me.receive = None;
            me.keep = None;
        }
        let mut o = owner.borrow_mut(py);
        o.book.ran(&hook);
        o.hooks.retain(|(id, _)| *id != hook.id);
        drop(o);
        raise(py, recorded)
    }
}
