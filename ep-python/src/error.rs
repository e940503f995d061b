//! The one mapping from moelink's errors to Python exceptions: a bad argument
//! is a ValueError, a bounded wait that ran out `moelink.TimeoutError` (a
//! TimeoutError), a CUDA failure `moelink.CudaError` (a RuntimeError), an I/O
//! or RDMA failure a RuntimeError.

use comm::CommError;
use pyo3::exceptions::{PyRuntimeError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;

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
        CommError::Io { .. } | CommError::NoRdma { .. } | CommError::Rdma { .. } => {
            PyRuntimeError::new_err(e.to_string())
        }
    }
}
