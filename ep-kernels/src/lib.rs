//! `ep-kernels`: every CUDA kernel of moelink and its typed launcher.
//!
//! | layer | module | what it does |
//! |---|---|---|
//! | build | `build.rs` | nvcc compiles every `.cu` under `cuda/` (one unity TU) into a fatbin |
//! | module | [`module`] | embedded fatbin, [`KernelId`] table, one lazily loaded module per device |
//! | launchers | [`launch`], [`intranode`], [`low_latency`] | one typed, checked launcher per kernel, on a caller-given raw stream |
//! | limits | [`limits`] | every limit of the EP API (ranks, top-k, experts, tokens, row sizes), defined once |

pub mod error;
pub mod intranode;
pub mod launch;
pub mod limits;
pub mod low_latency;
pub mod module;

pub use module::{compiled_archs, DeviceKernels, KernelId, FATBIN};
