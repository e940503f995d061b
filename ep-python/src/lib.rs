//! `moelink._native`: the PyO3 extension module. Thin: argument plumbing and
//! error mapping only; everything else lives in ep-core. The GIL is released
//! around every call that waits on the GPU.

mod allreduce;
mod buffer;
mod ll;
mod reference;
mod reference_ll;

use std::sync::Once;

use comm::{CommError, Device, StreamHandle};
use pyo3::exceptions::{PyRuntimeError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

pyo3::create_exception!(
    _native,
    CudaError,
    PyRuntimeError,
    "A CUDA driver call failed."
);
pyo3::create_exception!(
    _native,
    TimeoutError,
    PyTimeoutError,
    "A bounded wait ran out; the message names the rank and what it waited for."
);

pub(crate) fn to_py(e: CommError) -> PyErr {
    match e {
        CommError::InvalidArgument { .. } => PyValueError::new_err(e.to_string()),
        CommError::Timeout { .. } => TimeoutError::new_err(e.to_string()),
        CommError::Cuda { .. } | CommError::NoDriver { .. } => CudaError::new_err(e.to_string()),
        CommError::Io { .. } => PyRuntimeError::new_err(e.to_string()),
    }
}

fn init_logging() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_env("MOELINK_LOG")
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .try_init();
    });
}

/// Number of visible CUDA devices (0 without a driver).
/// (src_rank, first_bad_word, bad_words, expected, got) of one bad slot.
type MismatchTuple = (usize, u64, u64, u64, u64);

#[pyfunction]
fn device_count() -> usize {
    comm::device_count()
}

/// (SMs of GPU `device`, the SM limit of this process's context there or
/// None): the driver's (MPS) limit lowered by MOELINK_SMS_PER_RANK, as every
/// Buffer and AllReduce reads them.
#[pyfunction]
fn local_sm_counts(py: Python<'_>, device: i32) -> PyResult<(u32, Option<u32>)> {
    py.detach(|| comm::device_share::local_sm_counts(comm::Device::get(device)?))
        .map_err(to_py)
}

/// SMs one rank's grids may use with `ranks_on_device` ranks on a GPU of
/// `device_sms` SMs whose context allows `context_sms` (None: no limit): the
/// library's share rule (comm::DeviceShare).
#[pyfunction]
fn device_share_sms(device_sms: u32, context_sms: Option<u32>, ranks_on_device: usize) -> u32 {
    comm::DeviceShare::new(device_sms, context_sms, ranks_on_device, 0).sms
}

/// CUDA targets the embedded kernels were compiled for, e.g. ["90a"].
#[pyfunction]
fn compiled_archs() -> Vec<&'static str> {
    ep_core::compiled_archs()
}

/// One rank's side of the peer-write diagnostic (see ep_core::diagnostics).
#[pyclass(module = "moelink._native")]
struct PeerWriteCheck {
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
fn reduce_rows_bf16(
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

/// Every limit of the API as `(name, value, what)`: `ep_core::limits::TABLE`
/// and the allreduce communicator's (`collectives::args`). The Python checks
/// and the table in docs/api-notes.md read them from here.
#[pyfunction]
fn limits() -> Vec<(&'static str, u64, &'static str)> {
    use collectives::args::{MAX_BLOCKS, MAX_BYTES, MAX_RANKS};
    let allreduce = [
        (
            "allreduce_max_ranks",
            MAX_RANKS as u64,
            "ranks of an AllReduce (one host)",
        ),
        (
            "allreduce_max_blocks",
            MAX_BLOCKS as u64,
            "blocks of an allreduce kernel (max_blocks)",
        ),
        (
            "allreduce_max_bytes",
            MAX_BYTES as u64,
            "max_bytes of an AllReduce",
        ),
    ];
    ep_core::limits::TABLE
        .iter()
        .map(|l| (l.name, l.value, l.what))
        .chain(allreduce)
        .collect()
}

/// Pattern word `i` written by `src` into `dst` (the CPU twin of the kernel's).
#[pyfunction]
fn pattern_word(seed: u64, src: u32, dst: u32, i: u64) -> u64 {
    ep_core::diagnostics::pattern_word(seed, src, dst, i)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    init_logging();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("CudaError", m.py().get_type::<CudaError>())?;
    m.add("TimeoutError", m.py().get_type::<TimeoutError>())?;
    m.add_function(wrap_pyfunction!(device_count, m)?)?;
    m.add_function(wrap_pyfunction!(compiled_archs, m)?)?;
    m.add_function(wrap_pyfunction!(local_sm_counts, m)?)?;
    m.add_function(wrap_pyfunction!(device_share_sms, m)?)?;
    m.add_function(wrap_pyfunction!(reduce_rows_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(pattern_word, m)?)?;
    m.add_function(wrap_pyfunction!(limits, m)?)?;
    m.add_class::<PeerWriteCheck>()?;
    m.add_class::<allreduce::AllReduceComm>()?;
    reference::register(m)?;
    m.add_function(wrap_pyfunction!(buffer::bootstrap_unique_id, m)?)?;
    m.add_class::<buffer::IntranodeBuffer>()?;
    m.add_class::<ll::LowLatencyBuffer>()?;
    m.add_function(wrap_pyfunction!(ll::low_latency_size_hint, m)?)?;
    m.add_function(wrap_pyfunction!(reference_ll::ref_ll_dispatch, m)?)?;
    m.add_function(wrap_pyfunction!(reference_ll::ref_ll_combine, m)?)?;
    Ok(())
}
