//! Errors of the transport stack. Every variant carries the context a user needs
//! to act on it: which CUDA call, which argument, which rank waited for what.

use cudarc::driver::DriverError;

#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// A CUDA driver call failed (or the driver library could not be loaded).
    #[error("CUDA call {call} failed: {source}")]
    Cuda {
        call: &'static str,
        #[source]
        source: DriverError,
    },
    /// The CUDA driver library (libcuda.so) is not present on this machine.
    #[error("no CUDA driver available: {reason}")]
    NoDriver { reason: String },
    /// A caller passed something that cannot work; nothing was launched.
    #[error("invalid argument `{name}`: {reason}")]
    InvalidArgument { name: &'static str, reason: String },
    /// A bounded wait ran out. `waited_ms` is 0 for a GPU wait, which is bounded
    /// by a spin count rather than a clock.
    #[error("rank {rank} timed out waiting for {what}{}", waited_suffix(*.waited_ms))]
    Timeout {
        rank: i64,
        what: String,
        waited_ms: u64,
    },
    #[error("I/O error during {context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

fn waited_suffix(ms: u64) -> String {
    if ms == 0 {
        " (its spin bound ran out)".into()
    } else {
        format!(" (waited {ms} ms)")
    }
}

pub type Result<T, E = CommError> = std::result::Result<T, E>;

/// Attach the name of the failed driver call to a cudarc error.
pub trait CudaResultExt<T> {
    fn call(self, call: &'static str) -> Result<T>;
}

impl<T> CudaResultExt<T> for std::result::Result<T, DriverError> {
    fn call(self, call: &'static str) -> Result<T> {
        self.map_err(|source| CommError::Cuda { call, source })
    }
}

impl CommError {
    pub fn invalid(name: &'static str, reason: impl Into<String>) -> Self {
        CommError::InvalidArgument {
            name,
            reason: reason.into(),
        }
    }
}
