//! `_native.StreamOrder`: one stream waits for another (raw handles), without
//! an event object per call; what the Buffer's normal path uses to move work
//! onto its communication stream and back.

use comm::cuda::StreamOrder as Inner;
use comm::{Device, StreamHandle};
use pyo3::prelude::*;

use crate::to_py;

#[pyclass(module = "moelink._native")]
pub struct StreamOrder {
    inner: Inner,
}

impl StreamOrder {
    pub(crate) fn inner(&self) -> &Inner {
        &self.inner
    }
}

#[pymethods]
impl StreamOrder {
    /// One reusable event on device `device`.
    #[new]
    fn new(device: i32) -> PyResult<Self> {
        let inner = Device::get(device).and_then(Inner::new).map_err(to_py)?;
        Ok(Self { inner })
    }

    /// Work issued to stream `waiter` from now on starts after everything
    /// issued to stream `signaler` so far (raw `cudaStream_t` ints).
    fn after(&self, waiter: usize, signaler: usize) -> PyResult<()> {
        self.inner
            .after(StreamHandle(waiter), StreamHandle(signaler))
            .map_err(to_py)
    }
}
