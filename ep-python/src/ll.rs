//! `_native.LowLatencyBuffer`: the Rust half of `moelink.Buffer`'s low-latency
//! mode. Pointers arrive as ints (`tensor.data_ptr()`, 0 = absent) after the
//! Python layer checked every tensor; streams as raw `cudaStream_t` ints.

use comm::StreamHandle;
use ep_core::low_latency::Phases;
use ep_core::low_latency::{
    size_hint, CombineCall, DispatchCall, LowLatencyBuffer as Inner, LowLatencyOptions,
};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::group::{timeout_arg, Group};
use crate::to_py;

#[pyclass(module = "moelink._native")]
pub struct LowLatencyBuffer {
    inner: Option<Inner>,
}

impl LowLatencyBuffer {
    fn get(&self) -> PyResult<&Inner> {
        self.inner
            .as_ref()
            .ok_or_else(|| PyRuntimeError::new_err("the Buffer was destroyed"))
    }
}

fn phases(p: u8) -> PyResult<Phases> {
    match p {
        1 => Ok(Phases::Send),
        2 => Ok(Phases::Recv),
        3 => Ok(Phases::Both),
        _ => Err(PyValueError::new_err(format!(
            "phases {p}: must be 1, 2 or 3"
        ))),
    }
}

/// Bytes of low-latency buffer a rank needs (DeepEP's
/// `get_low_latency_rdma_size_hint`).
#[pyfunction]
pub fn low_latency_size_hint(
    max_tokens: usize,
    hidden: usize,
    num_ranks: usize,
    num_experts: usize,
) -> PyResult<usize> {
    size_hint(max_tokens, hidden, num_ranks, num_experts).map_err(to_py)
}

#[pymethods]
impl LowLatencyBuffer {
    /// *Collective.* The group's next object: builds the buffer (and the
    /// proxy's port channels when NVLink is not used).
    #[new]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        group: PyRef<'_, Group>,
        device: i32,
        num_bytes: usize,
        timeout_s: f64,
        device_timeout_s: f64,
        allow_nvlink: bool,
        shrink: bool,
    ) -> PyResult<Self> {
        let timeout = timeout_arg("timeout_s", timeout_s)?;
        let opts = LowLatencyOptions {
            allow_nvlink,
            shrink,
            timeout,
            device_timeout: timeout_arg("device_timeout_s", device_timeout_s)?,
        };
        let group: &Group = &group;
        let inner = py
            .detach(|| {
                let (dev, group) = group.bind(device)?;
                Inner::new(group, dev, num_bytes, opts)
            })
            .map_err(to_py)?;
        Ok(Self { inner: Some(inner) })
    }

    #[getter]
    fn uses_proxy(&self) -> PyResult<bool> {
        Ok(self.get()?.uses_proxy())
    }

    /// (device address, bytes) of this rank's buffer.
    fn local_buffer(&self) -> PyResult<(u64, usize)> {
        Ok(self.get()?.local_buffer())
    }

    /// Device address of the int32 `[R]` rank mask.
    fn mask_ptr(&self) -> PyResult<u64> {
        Ok(self.get()?.mask_ptr())
    }

    /// ValueError where a call of this shape does not fit the kernels or this
    /// buffer (checked before the caller allocates the call's outputs).
    fn check_shape(
        &self,
        max_tokens: usize,
        hidden: usize,
        num_experts: usize,
        num_topk: usize,
    ) -> PyResult<()> {
        self.get()?
            .check_shape(max_tokens, hidden, num_experts, num_topk)
            .map_err(to_py)
    }

    /// (device address, bytes) of the zero-copy combine input for this shape.
    fn zero_copy_buffer(
        &self,
        max_tokens: usize,
        hidden: usize,
        num_experts: usize,
    ) -> PyResult<(u64, usize)> {
        self.get()?
            .zero_copy_buffer(max_tokens, hidden, num_experts)
            .map_err(to_py)
    }

    #[getter]
    fn num_blocks(&self) -> PyResult<u32> {
        Ok(self.get()?.num_blocks())
    }

    /// This rank's share of its GPU: (ranks on the GPU, the GPU's SMs, the SM
    /// limit of this rank's context (MPS) or None, SMs per grid, the smallest
    /// SMs per grid of any rank).
    fn device_share(&self) -> PyResult<(usize, u32, Option<u32>, u32, u32)> {
        let s = self.get()?.device_share();
        Ok((
            s.ranks_on_device,
            s.device_sms,
            s.context_sms,
            s.sms,
            s.group_sms,
        ))
    }

    fn set_num_blocks(&mut self, n: u32) -> PyResult<()> {
        self.inner
            .as_mut()
            .ok_or_else(|| PyRuntimeError::new_err("the Buffer was destroyed"))?
            .set_num_blocks(n);
        Ok(())
    }

    /// Phase stamps of the latest launches (`MOELINK_LL_PROFILE=1` at creation):
    /// u64 `[2][256][16]`, see `ep_kernels::low_latency::PROF_SLOTS` (through ep-core).
    fn profile(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        let inner = self.get()?;
        py.detach(|| inner.profile()).map_err(to_py)
    }

    /// (triggers popped, [per peer: (triggers of its channel performed, copies
    /// in flight or None, ms since its latest trigger or None, longest ms an
    /// operation took to complete (MOELINK_PROXY_QUERY=1, else 0)) or None]) of
    /// the proxy, or None where peers are reached over NVLink (diagnostics).
    #[allow(clippy::type_complexity)]
    fn proxy_progress(
        &self,
    ) -> PyResult<Option<(u64, Vec<Option<(u64, Option<bool>, Option<u64>, u64)>>)>> {
        Ok(self.get()?.proxy_progress().map(|(tail, peers)| {
            let peers = peers
                .into_iter()
                .map(|p| p.map(|c| (c.handled, c.busy, c.idle_ms, c.max_flight_ms)))
                .collect();
            (tail, peers)
        }))
    }

    /// Raises TimeoutError / RuntimeError if a device wait, the proxy or its
    /// FIFO reported a failure.
    fn check_device(&self) -> PyResult<()> {
        self.get()?.check_device().map_err(to_py)
    }

    fn check_device_timeout(&self) -> PyResult<()> {
        self.get()?.check_device_timeout().map_err(to_py)
    }

    #[allow(clippy::too_many_arguments)]
    fn dispatch(
        &self,
        stream: usize,
        max_tokens: usize,
        hidden: usize,
        num_experts: usize,
        num_topk: usize,
        num_tokens: usize,
        x: u64,
        topk_idx: u64,
        use_fp8: bool,
        round_scale: bool,
        use_ue8m0: bool,
        recv_x: u64,
        recv_scales: u64,
        recv_count: u64,
        src_info: u64,
        layout_range: u64,
        stats_count: u64,
        stats_wait: u64,
        phases_: u8,
    ) -> PyResult<()> {
        let call = DispatchCall {
            x,
            topk_idx,
            num_tokens,
            use_fp8,
            round_scale,
            use_ue8m0,
            recv_x,
            recv_scales,
            recv_count,
            src_info,
            layout_range,
            stats_count,
            stats_wait,
        };
        self.get()?
            .dispatch(
                StreamHandle(stream),
                max_tokens,
                hidden,
                num_experts,
                num_topk,
                &call,
                phases(phases_)?,
            )
            .map_err(to_py)
    }

    #[allow(clippy::too_many_arguments)]
    fn combine(
        &self,
        stream: usize,
        max_tokens: usize,
        hidden: usize,
        num_experts: usize,
        num_topk: usize,
        num_tokens: usize,
        x: u64,
        layout_range: u64,
        topk_idx: u64,
        topk_weights: u64,
        out: u64,
        stats_wait: u64,
        phases_: u8,
    ) -> PyResult<()> {
        let call = CombineCall {
            x,
            layout_range,
            topk_idx,
            topk_weights,
            num_tokens,
            out,
            stats_wait,
        };
        self.get()?
            .combine(
                StreamHandle(stream),
                max_tokens,
                hidden,
                num_experts,
                num_topk,
                &call,
                phases(phases_)?,
            )
            .map_err(to_py)
    }

    /// *Collective.* Resets flags and call counters (device-synchronous).
    fn clean(&self, py: Python<'_>) -> PyResult<()> {
        let inner = self.get()?;
        py.detach(|| inner.clean()).map_err(to_py)
    }

    /// *Collective.* A host barrier.
    fn barrier(&self, py: Python<'_>) -> PyResult<()> {
        let inner = self.get()?;
        py.detach(|| inner.barrier()).map_err(to_py)
    }

    /// Frees everything now (idempotent).
    /// Frees the buffer; the proxy thread is joined and the memory freed with
    /// the GIL released (as the other buffers do).
    fn destroy(&mut self, py: Python<'_>) {
        if let Some(b) = self.inner.take() {
            py.detach(move || drop(b));
        }
    }
}
