//! `Group`: the shared core of one torch process group (comm::Group): one
//! bootstrap and one Communicator (made by the group's first object) under
//! every Buffer half and AllReduce made on the group.

use std::sync::Arc;
use std::time::Duration;

use comm::{Device, TcpBootstrap, UniqueId};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::to_py;

/// A fresh bootstrap id (rank 0 creates it, every rank passes it to
/// `Group`). Its root listens on 127.0.0.1: ranks of one host only.
#[pyfunction]
pub fn bootstrap_unique_id(py: Python<'_>) -> PyResult<Bound<'_, PyBytes>> {
    let id = UniqueId::new(None).map_err(to_py)?;
    Ok(PyBytes::new(py, &id.to_bytes()))
}

#[pyclass(module = "moelink._native", frozen)]
pub struct Group {
    inner: Arc<comm::Group>,
}

impl Group {
    /// *Collective.* What every native object's constructor does: with the
    /// GIL released, binds CUDA device `device` to this thread and calls
    /// `make` with the group the object is made on (it takes the group's next
    /// number, and its shared Communicator) and the device.
    pub(crate) fn make<T: Send>(
        &self,
        py: Python<'_>,
        device: i32,
        make: impl FnOnce(&comm::Group, Device) -> comm::Result<T> + Send,
    ) -> PyResult<T> {
        py.detach(|| make(&self.inner, Device::bind(device)?))
            .map_err(to_py)
    }
}

/// `timeout_s` as a Duration, ValueError unless finite and positive.
pub(crate) fn timeout_arg(name: &str, timeout_s: f64) -> PyResult<Duration> {
    if !(timeout_s.is_finite() && timeout_s > 0.0) {
        return Err(PyValueError::new_err(format!(
            "{name} must be positive, got {timeout_s}"
        )));
    }
    Ok(Duration::from_secs_f64(timeout_s))
}

#[pymethods]
impl Group {
    /// *Collective.* Connects `size` ranks through the bootstrap id (rank 0
    /// made it with `bootstrap_unique_id`); every bootstrap wait of the group's
    /// objects, and a constructor's wait for another thread's object on the
    /// group, is bounded by `timeout_s`.
    #[new]
    fn new(
        py: Python<'_>,
        unique_id: Vec<u8>,
        rank: usize,
        size: usize,
        timeout_s: f64,
    ) -> PyResult<Self> {
        let timeout = timeout_arg("timeout_s", timeout_s)?;
        let inner = py
            .detach(|| {
                let id = UniqueId::from_bytes(&unique_id)?;
                let boot = TcpBootstrap::new(&id, rank, size, timeout)?;
                comm::Group::with_timeout(Arc::new(boot), timeout)
            })
            .map_err(to_py)?;
        Ok(Self {
            inner: Arc::new(inner),
        })
    }

    #[getter]
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    #[getter]
    fn size(&self) -> usize {
        self.inner.size()
    }

    /// Objects (Buffer halves, AllReduce) made on this group so far.
    #[getter]
    fn objects(&self) -> u64 {
        self.inner.objects()
    }
}
