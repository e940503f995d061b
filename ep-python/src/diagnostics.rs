//! The diagnostics of `moelink.diagnostics`: the peer-write check, the bf16
//! row reduction and the CPU twin of the pattern the check writes.

use comm::{Device, StreamHandle};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::to_py;

/// (src_rank, first_bad_word, bad_words, expected, got) of one bad slot.
type MismatchTuple = (usize, u64, u64, u64, u64);

/// One rank's side of the peer-write diagnostic (see ep_core::diagnostics).
#[pyclass(module = "moelink._native")]
pub(crate) struct PeerWriteCheck {
    inner: ep_core::diagnostics::PeerWriteCheck,
}

#[pymethods]
impl PeerWriteCheck {
    #[new]
    fn new(py: Python<'_>, device: i32, rank: usize, nranks: usize, words: u64) -> PyResult<Self> {
        let inner = py
            .detach(|| {
                let dev = Device::bind(device)?;
                ep_core::diagnostics::PeerWriteCheck::new(dev, rank, nranks, words)
            })
            .map_err(to_py)?;
        Ok(Self { inner })
    }

    /// This rank's buffer handle, to be sent to every peer.
    fn export<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let b = self.inner.export().map_err(to_py)?;
        Ok(PyBytes::new(py, &b))
    }

    /// Maps the peers' buffers; `handles[p]` is what rank p exported.
    fn connect(&mut self, py: Python<'_>, handles: Vec<Vec<u8>>) -> PyResult<()> {
        py.detach(|| self.inner.connect(&handles)).map_err(to_py)
    }

    /// Launches this rank's writes on the raw CUDA stream `stream`.
    fn write(&self, stream: usize, seed: u64) -> PyResult<()> {
        self.inner.write(StreamHandle(stream), seed).map_err(to_py)
    }

    /// Compares this rank's buffer with the expected patterns. Returns a list of
    /// (src_rank, first_bad_word, bad_words, expected, got), empty when all is right.
    fn verify(&self, py: Python<'_>, seed: u64) -> PyResult<Vec<MismatchTuple>> {
        let m = py.detach(|| self.inner.verify(seed)).map_err(to_py)?;
        Ok(m.into_iter()
            .map(|m| (m.src, m.first_bad_word, m.bad_words, m.expected, m.got))
            .collect())
    }
}

/// `out[c] = bf16(sum_r input[r, c])` in float32 on `device`, launched on `stream`.
/// Pointers are device addresses of contiguous bf16 tensors (checked by the caller).
#[pyfunction]
pub(crate) fn reduce_rows_bf16(
    device: i32,
    stream: usize,
    input: u64,
    out: u64,
    rows: i64,
    cols: i64,
) -> PyResult<()> {
    let dev = Device::bind(device).map_err(to_py)?;
    // SAFETY: the Python wrapper checked dtype, shape, contiguity and device.
    unsafe {
        ep_core::diagnostics::reduce_rows_bf16(dev, StreamHandle(stream), input, out, rows, cols)
    }
    .map_err(to_py)
}

/// Pattern word `i` written by `src` into `dst` (the CPU twin of the kernel's).
#[pyfunction]
pub(crate) fn pattern_word(seed: u64, src: u32, dst: u32, i: u64) -> u64 {
    ep_core::diagnostics::pattern_word(seed, src, dst, i)
}
