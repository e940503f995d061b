//! Errors of kernel loading and launching.

pub use comm::error::{CommError as KernelError, Result};
