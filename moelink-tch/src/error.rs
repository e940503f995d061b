//! [`Error`]: what a call of this crate returns when it fails, with the same
//! kinds as the Python API's exceptions ([`Error::python_class`]): an
//! argument a call's checks refuse (`ep_core::calls::ArgError`: a `TypeError`,
//! `moelink.DtypeError` or `ValueError` in Python, by its kind), an error of
//! the core (`comm::CommError`, mapped as `ep-python/src/error.rs` maps it),
//! a call the object's state does not allow (a `RuntimeError`), and an error
//! of libtorch itself (`tch::TchError`).

use comm::CommError;
use ep_core::calls::{ArgError, ArgErrorKind};
use ep_core::ll_hooks::HookError;

/// An error of a call of the moelink tch API.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An argument the call's checks (`ep_core::calls`, or this crate's own
    /// where ep-core has none) refuse; `kind` says how Python raises it.
    #[error("{0}")]
    Arg(#[from] ArgError),
    /// An error of the core: a bad argument only the core can see
    /// (`InvalidArgument`: a shape the buffer cannot hold, ...), a bounded wait
    /// that ran out (`Timeout`, naming the rank and what it waited for), a
    /// CUDA driver call that failed, an I/O or RDMA failure.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A call the object's state does not allow (destroyed, no such part, a
    /// receive hook still pending).
    #[error("{0}")]
    State(String),
    /// libtorch refused an operation (an allocation, a copy).
    #[error(transparent)]
    Torch(#[from] tch::TchError),
}

/// The result of a call of the moelink tch API.
pub type Result<T> = std::result::Result<T, Error>;

/// A refusal of the low-latency hook rules (`ep_core::ll_hooks`), as the
/// Python API raises it: `ValueError` or `RuntimeError`.
impl From<HookError> for Error {
    fn from(e: HookError) -> Self {
        match e {
            HookError::Arg(m) => Error::value(m),
            HookError::State(m) => Error::state(m),
        }
    }
}

impl Error {
    /// A `TypeError`-kind argument error (as `moelink.checks` raises one).
    pub(crate) fn type_error(message: impl Into<String>) -> Self {
        Error::Arg(ArgError {
            kind: ArgErrorKind::Type,
            message: message.into(),
        })
    }

    /// A `DtypeError`-kind argument error.
    pub(crate) fn dtype(message: impl Into<String>) -> Self {
        Error::Arg(ArgError {
            kind: ArgErrorKind::Dtype,
            message: message.into(),
        })
    }

    /// A `ValueError`-kind argument error.
    pub(crate) fn value(message: impl Into<String>) -> Self {
        Error::Arg(ArgError {
            kind: ArgErrorKind::Value,
            message: message.into(),
        })
    }

    pub(crate) fn state(message: impl Into<String>) -> Self {
        Error::State(message.into())
    }

    /// The Python exception class the same failure raises in the Python API:
    /// `TypeError`, `moelink.DtypeError`, `ValueError` (bad arguments),
    /// `moelink.TimeoutError` (a bounded wait ran out), `moelink.CudaError`
    /// (a CUDA call failed), `RuntimeError` (anything else).
    pub fn python_class(&self) -> &'static str {
        match self {
            Error::Arg(a) => match a.kind {
                ArgErrorKind::Type => "TypeError",
                ArgErrorKind::Dtype => "moelink.DtypeError",
                ArgErrorKind::Value => "ValueError",
            },
            Error::Comm(c) => match c {
                CommError::InvalidArgument { .. } => "ValueError",
                CommError::Timeout { .. } => "moelink.TimeoutError",
                CommError::Cuda { .. } | CommError::NoDriver { .. } => "moelink.CudaError",
                CommError::Io { .. } | CommError::NoRdma { .. } | CommError::Rdma { .. } => {
                    "RuntimeError"
                }
            },
            Error::State(_) | Error::Torch(_) => "RuntimeError",
        }
    }

    /// Whether this is a refused argument (a `TypeError` or `ValueError` in
    /// Python: `Arg`, or the core's `InvalidArgument`).
    pub fn is_argument_error(&self) -> bool {
        matches!(
            self,
            Error::Arg(_) | Error::Comm(CommError::InvalidArgument { .. })
        )
    }

    /// The argument error's kind, if this is one of the checks' refusals.
    pub fn arg_kind(&self) -> Option<ArgErrorKind> {
        match self {
            Error::Arg(a) => Some(a.kind),
            _ => None,
        }
    }
}
