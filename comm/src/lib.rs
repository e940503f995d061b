//! `comm`: the transport stack of moelink.
//!
//! | layer | module | what it does |
//! |---|---|---|
//! | driver | [`cuda`] | loads libcuda at run time, binds threads to a device's primary context |
//! | memory | [`memory`] | device allocations, CUDA IPC export/import of peers' memory (RAII) |
//! | errors | [`error`] | [`CommError`]: which call, which argument, which rank waited for what |
//!
//! Device-side API: CUDA headers under `include/comm/`, published to dependants
//! as `DEP_MOELINK_COMM_INCLUDE`.

pub mod cuda;
pub mod error;
pub mod memory;

pub use cuda::{device_count, init_driver, Device, StreamHandle};
pub use error::{CommError, Result};
pub use memory::{DeviceMemory, IpcHandle, PeerMemory};

/// Directory of the device-side headers (`#include <comm/...>`).
pub const INCLUDE_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/include");
