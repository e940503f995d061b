//! `moelink._native`: the PyO3 extension module. Thin: argument plumbing and
//! error mapping only; everything else lives in ep-core. The GIL is released
//! around every call that waits on the GPU.

mod allreduce;
mod calls;
mod diagnostics;
mod dlpack;
mod ep_buffer;
mod error;
mod group;
mod ll_calls;
mod normal_calls;
mod reference;
mod reference_ll;
mod streams;
mod tensors;
mod torch_alloc;

use std::sync::Once;

use pyo3::prelude::*;

pub(crate) use error::{to_py, CudaError, TimeoutError};

/// Drops `value` (a native object's Rust half: frees device memory, joins
/// threads) with the GIL released.
pub(crate) fn drop_detached<T: Send>(py: Python<'_>, value: T) {
    py.detach(move || drop(value));
}

fn init_logging() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let filter = comm::env::var("MOELINK_LOG")
            .and_then(|v| tracing_subscriber::EnvFilter::try_new(v).ok())
            .unwrap_or_else(|| tracing_subscriber::EnvFilter::new("warn"));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .try_init();
    });
}

/// Number of visible CUDA devices (0 without a driver).
#[pyfunction]
fn device_count() -> usize {
    comm::device_count()
}

/// Receive pools alive in this process (held by a Buffer, or by a
/// `recv_x` of one).
#[pyfunction]
fn live_recv_pools() -> usize {
    ep_core::recv_pool::live_pools()
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

/// Every environment switch as `(name, kind, default, meaning)`, sorted by
/// name: `comm::env::SWITCHES`. `moelink._env` checks the names it reads
/// against it; docs/environment.md is its table.
#[pyfunction]
fn env_switches() -> Vec<(&'static str, &'static str, &'static str, &'static str)> {
    comm::env::SWITCHES
        .iter()
        .map(|s| (s.name, s.kind.as_str(), s.default, s.meaning))
        .collect()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    init_logging();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("CudaError", m.py().get_type::<CudaError>())?;
    m.add("TimeoutError", m.py().get_type::<TimeoutError>())?;
    m.add_function(wrap_pyfunction!(device_count, m)?)?;
    m.add_function(wrap_pyfunction!(live_recv_pools, m)?)?;
    m.add_function(wrap_pyfunction!(compiled_archs, m)?)?;
    m.add_function(wrap_pyfunction!(local_sm_counts, m)?)?;
    m.add_function(wrap_pyfunction!(device_share_sms, m)?)?;
    m.add_function(wrap_pyfunction!(diagnostics::reduce_rows_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(diagnostics::pattern_word, m)?)?;
    m.add_function(wrap_pyfunction!(limits, m)?)?;
    m.add_function(wrap_pyfunction!(env_switches, m)?)?;
    m.add_function(wrap_pyfunction!(torch_alloc::torch_alloc_init, m)?)?;
    m.add_function(wrap_pyfunction!(torch_alloc::torch_alloc_ready, m)?)?;
    m.add_function(wrap_pyfunction!(tensors::tensor_args, m)?)?;
    m.add_class::<torch_alloc::TorchOutputs>()?;
    m.add_class::<diagnostics::PeerWriteCheck>()?;
    m.add_class::<allreduce::AllReduceComm>()?;
    reference::register(m)?;
    calls::register(m)?;
    m.add_function(wrap_pyfunction!(group::bootstrap_unique_id, m)?)?;
    m.add_class::<group::Group>()?;
    m.add_class::<ep_buffer::EpBuffer>()?;
    m.add_class::<ll_calls::LlCalls>()?;
    m.add_class::<ll_calls::LlHook>()?;
    m.add_class::<normal_calls::NormalCalls>()?;
    m.add_class::<streams::StreamOrder>()?;
    m.add_function(wrap_pyfunction!(ep_buffer::low_latency_size_hint, m)?)?;
    m.add_function(wrap_pyfunction!(reference_ll::ref_ll_dispatch, m)?)?;
    m.add_function(wrap_pyfunction!(reference_ll::ref_ll_combine, m)?)?;
    Ok(())
}
