//! The one mapping from moelink's errors to Python exceptions: a bad argument
//! is a ValueError, a bounded wait that ran out `moelink.TimeoutError` (a
//! TimeoutError), a CUDA failure `moelink.CudaError` (a RuntimeError), an I/O
//! or RDMA failure a RuntimeError. An argument a call's checks refuse
//! (`ep_core::calls::ArgError`) is a TypeError, `moelink.DtypeError` (a
//! TypeError and a ValueError, defined in `moelink/checks.py`) or a
//! ValueError, by its kind.

use comm::CommError;
use ep_core::calls::{ArgError, ArgErrorKind};
use pyo3::exceptions::{PyRuntimeError, PyTimeoutError, PyTypeError, PyValueError};
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

pyo3::import_exception!(moelink.checks, DtypeError);

pub(crate) fn arg_to_py(e: ArgError) -> PyErr {
    match e.kind {
        ArgErrorKind::Type => PyTypeError::new_err(e.message),
        ArgErrorKind::Dtype => DtypeError::new_err(e.message),
        ArgErrorKind::Value => PyValueError::new_err(e.message),
    }
}

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
