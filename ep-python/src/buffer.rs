//! `_native.IntranodeBuffer`: the Rust half of `moelink.Buffer` (intranode).
//! Pointers arrive as ints (`tensor.data_ptr()`, 0 = absent) after the Python
//! layer checked every tensor; streams as raw `cudaStream_t` ints.

use comm::StreamHandle;
use ep_core::intranode::{
    CombineArgs, DispatchInputs, DispatchOutputs, DispatchShape, IntranodeBuffer as Inner,
};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

use crate::group::{timeout_arg, Group};
use crate::to_py;

#[pyclass(module = "moelink._native")]
pub struct IntranodeBuffer {
    inner: Option<Inner>,
}

impl IntranodeBuffer {
    fn get(&mut self) -> PyResult<&mut Inner> {
        self.inner
            .as_mut()
            .ok_or_else(|| PyRuntimeError::new_err("the Buffer was destroyed"))
    }
}

fn shape(
    num_tokens: usize,
    hidden_bytes: usize,
    num_scales: usize,
    num_topk: usize,
    num_experts: usize,
) -> DispatchShape {
    DispatchShape {
        num_tokens,
        hidden_bytes,
        num_scales,
        num_topk,
        num_experts,
    }
}

#[pymethods]
impl IntranodeBuffer {
    /// *Collective.* The group's next object: builds the NVL buffer and
    /// channels on CUDA device `device`.
    #[new]
    fn new(
        py: Python<'_>,
        group: PyRef<'_, Group>,
        device: i32,
        num_nvl_bytes: usize,
        timeout_s: f64,
    ) -> PyResult<Self> {
        let timeout = timeout_arg("timeout_s", timeout_s)?;
        let group: &Group = &group;
        let inner = py
            .detach(|| {
                let (dev, group) = group.bind(device)?;
                Inner::new(group, dev, num_nvl_bytes, timeout)
            })
            .map_err(to_py)?;
        Ok(Self { inner: Some(inner) })
    }

    #[getter]
    fn rank(&mut self) -> PyResult<usize> {
        Ok(self.get()?.rank())
    }

    #[getter]
    fn num_ranks(&mut self) -> PyResult<usize> {
        Ok(self.get()?.num_ranks())
    }

    /// (device address, bytes) of this rank's NVL buffer.
    fn local_buffer(&mut self) -> PyResult<(u64, usize)> {
        Ok(self.get()?.local_buffer())
    }

    /// Bound of every device wait of this buffer, nanoseconds of GPU time
    /// (positive; ValueError otherwise).
    fn set_device_timeout_ns(&mut self, timeout_ns: i64) -> PyResult<()> {
        self.get()?.set_device_timeout_ns(timeout_ns).map_err(to_py)
    }

    #[getter]
    fn device_timeout_ns(&mut self) -> PyResult<i64> {
        Ok(self.get()?.device_timeout_ns())
    }

    /// Raises TimeoutError if a device wait of this buffer ran out.
    fn check_device(&mut self) -> PyResult<()> {
        self.get()?.check_device().map_err(to_py)
    }

    /// Raises TimeoutError if a device wait ran out (an expert id out of range
    /// is left for check_device).
    fn check_device_timeout(&mut self) -> PyResult<()> {
        self.get()?.check_device_timeout().map_err(to_py)
    }

    #[allow(clippy::too_many_arguments)]
    fn layout(
        &mut self,
        stream: usize,
        topk_idx: u64,
        num_tokens: usize,
        num_topk: usize,
        num_experts: usize,
        num_tokens_per_rank: u64,
        num_tokens_per_expert: u64,
        is_token_in_rank: u64,
        partials: u64,
    ) -> PyResult<()> {
        self.get()?
            .layout(
                StreamHandle(stream),
                topk_idx,
                num_tokens,
                num_topk,
                num_experts,
                num_tokens_per_rank,
                num_tokens_per_expert,
                is_token_in_rank,
                partials,
            )
            .map_err(to_py)
    }

    /// int32 elements of the scratch `layout` needs.
    fn layout_scratch_elems(&mut self, num_tokens: usize, num_experts: usize) -> PyResult<usize> {
        Ok(self.get()?.layout_scratch_elems(num_tokens, num_experts))
    }

    /// Notify + send half of a dispatch (cached when `cached`). Returns the
    /// epoch to wait for (0 for cached).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (stream, cached, num_tokens, hidden_bytes, num_scales, num_topk,
        num_experts, x, scales, scale_strides, topk_idx, topk_weights, is_token_in_rank,
        num_tokens_per_expert, rank_prefix_matrix, send_head, expert_alignment, num_sms))]
    fn dispatch_send(
        &mut self,
        stream: usize,
        cached: bool,
        num_tokens: usize,
        hidden_bytes: usize,
        num_scales: usize,
        num_topk: usize,
        num_experts: usize,
        x: u64,
        scales: u64,
        scale_strides: (i64, i64),
        topk_idx: u64,
        topk_weights: u64,
        is_token_in_rank: u64,
        num_tokens_per_expert: u64,
        rank_prefix_matrix: u64,
        send_head: u64,
        expert_alignment: usize,
        num_sms: u32,
    ) -> PyResult<u64> {
        let s = shape(num_tokens, hidden_bytes, num_scales, num_topk, num_experts);
        let inp = DispatchInputs {
            x,
            scales,
            scale_strides,
            topk_idx,
            topk_weights,
            is_token_in_rank,
            num_tokens_per_expert,
            rank_prefix_matrix,
            send_head,
        };
        let b = self.get()?;
        let st = StreamHandle(stream);
        if cached {
            b.cached_dispatch_send(st, &s, &inp, num_sms)
                .map_err(to_py)?;
            Ok(0)
        } else {
            b.dispatch_send(st, &s, &inp, expert_alignment, num_sms)
                .map_err(to_py)
        }
    }

    /// Bounded CPU wait for the counts of dispatch `epoch`: (received tokens,
    /// per-local-expert counts). Releases the GIL.
    fn wait_counts(
        &mut self,
        py: Python<'_>,
        epoch: u64,
        num_experts: usize,
    ) -> PyResult<(usize, Vec<i32>)> {
        let b = self.get()?;
        py.detach(|| b.wait_counts(epoch, num_experts))
            .map_err(to_py)
    }

    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (stream, num_tokens, hidden_bytes, num_scales, num_topk, num_experts,
        rank_prefix_matrix, num_rows, recv_x, recv_scales, scale_strides, recv_topk_idx,
        recv_topk_weights, recv_src_idx, num_sms))]
    fn dispatch_recv(
        &mut self,
        stream: usize,
        num_tokens: usize,
        hidden_bytes: usize,
        num_scales: usize,
        num_topk: usize,
        num_experts: usize,
        rank_prefix_matrix: u64,
        num_rows: i64,
        recv_x: u64,
        recv_scales: u64,
        scale_strides: (i64, i64),
        recv_topk_idx: u64,
        recv_topk_weights: u64,
        recv_src_idx: u64,
        num_sms: u32,
    ) -> PyResult<()> {
        let s = shape(num_tokens, hidden_bytes, num_scales, num_topk, num_experts);
        let out = DispatchOutputs {
            num_rows,
            recv_x,
            recv_scales,
            scale_strides,
            recv_topk_idx,
            recv_topk_weights,
            recv_src_idx,
        };
        self.get()?
            .dispatch_recv(StreamHandle(stream), &s, rank_prefix_matrix, &out, num_sms)
            .map_err(to_py)
    }

    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (stream, y, num_recv_rows, hidden, topk_weights, num_topk,
        rank_prefix_matrix, send_head, num_tokens, bias0, bias1, out, out_weights, num_sms))]
    fn combine(
        &mut self,
        stream: usize,
        y: u64,
        num_recv_rows: i64,
        hidden: usize,
        topk_weights: u64,
        num_topk: usize,
        rank_prefix_matrix: u64,
        send_head: u64,
        num_tokens: usize,
        bias0: u64,
        bias1: u64,
        out: u64,
        out_weights: u64,
        num_sms: u32,
    ) -> PyResult<()> {
        let a = CombineArgs {
            y,
            num_recv_rows,
            hidden,
            topk_weights,
            num_topk,
            rank_prefix_matrix,
            send_head,
            num_tokens,
            bias: (bias0, bias1),
            out,
            out_weights,
        };
        self.get()?
            .combine(StreamHandle(stream), &a, num_sms)
            .map_err(to_py)
    }

    /// *Collective* host barrier.
    fn barrier(&mut self, py: Python<'_>) -> PyResult<()> {
        let b = self.get()?;
        py.detach(|| b.barrier()).map_err(to_py)
    }

    /// Frees everything (idempotent). The caller synchronised the streams
    /// that used the buffer.
    fn destroy(&mut self, py: Python<'_>) {
        if let Some(b) = self.inner.take() {
            py.detach(move || drop(b));
        }
    }

    #[getter]
    fn destroyed(&self) -> bool {
        self.inner.is_none()
    }
}
