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
    /// A bounded wait ran out. `waited_ms` is 0 for a GPU wait: its bound is a
    /// time on the GPU's clock that the device record does not carry.
    #[error("rank {rank} timed out waiting for {what}{}", waited_suffix(*.waited_ms))]
    Timeout {
        rank: i64,
        what: String,
        waited_ms: u64,
    },
    /// No RDMA (IB verbs) device can be used here: libibverbs is missing, or
    /// it finds no device, or none that `MOELINK_IB_HCA` allows.
    #[error("no RDMA device available: {reason}")]
    NoRdma { reason: String },
    /// An RDMA operation towards `peer` failed (a completion with an error
    /// status, a verbs call that failed).
    #[error("RDMA to rank {peer} failed: {what}")]
    Rdma { peer: usize, what: String },
    #[error("I/O error during {context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

fn waited_suffix(ms: u64) -> String {
    if ms == 0 {
        " (its time bound on the GPU ran out)".into()
    } else {
        format!(" (waited {ms} ms)")
    }
}

pub type Result<T, E = CommError> = std::result::Result<T, E>;

/// Bound of a device-side wait when the user sets none: 30 s of GPU time
/// (`kDefaultTimeoutNs` of `common_device.cuh`), below the hosts' 60 s bounds so
/// that the device's error, which names the rank, the peer and the counter, is
/// the one the user sees.
pub const DEFAULT_DEVICE_TIMEOUT_NS: i64 = 30_000_000_000;

/// `timeout_ns` if it can bound a device wait (positive nanoseconds), else
/// `InvalidArgument("timeout")`: no public setter takes an unbounded wait.
pub fn check_device_timeout_ns(timeout_ns: i64) -> Result<i64> {
    if timeout_ns > 0 {
        Ok(timeout_ns)
    } else {
        Err(CommError::invalid(
            "timeout",
            format!("a device wait's bound must be positive nanoseconds, got {timeout_ns}"),
        ))
    }
}

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

/// Environment variable `name` as a whole number >= 1 of `unit`s; `None` when
/// unset, `InvalidArgument` naming the variable when it is anything else.
pub fn env_count(name: &'static str, unit: &str) -> Result<Option<u64>> {
    match crate::env::var(name) {
        None => Ok(None),
        Some(v) => match v.trim().parse::<u64>() {
            Ok(n) if n >= 1 => Ok(Some(n)),
            _ => Err(CommError::invalid(
                name,
                format!("{v:?}: expected a whole number of {unit}, at least 1"),
            )),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_timeout_must_be_positive() {
        for bad in [0, -1, i64::MIN] {
            let e = check_device_timeout_ns(bad).unwrap_err();
            assert!(
                matches!(
                    e,
                    CommError::InvalidArgument {
                        name: "timeout",
                        ..
                    }
                ),
                "{e}"
            );
            assert!(e.to_string().contains(&bad.to_string()), "{e}");
        }
        assert_eq!(check_device_timeout_ns(1).unwrap(), 1);
        assert_eq!(
            check_device_timeout_ns(DEFAULT_DEVICE_TIMEOUT_NS).unwrap(),
            DEFAULT_DEVICE_TIMEOUT_NS
        );
    }

    #[test]
    fn a_gpu_timeout_says_its_time_bound_ran_out() {
        let e = CommError::Timeout {
            rank: 2,
            what: "(on the GPU) a signal".into(),
            waited_ms: 0,
        };
        assert_eq!(
            e.to_string(),
            "rank 2 timed out waiting for (on the GPU) a signal (its time bound on the GPU ran out)"
        );
    }
}
