//! `collectives`: moelink's allreduce and allgather among the GPUs of one host,
//! on comm's memory channels and LL packets (docs/design-allreduce.md).
//!
//! | layer | module | what it does |
//! |---|---|---|
//! | build | `build.rs` | nvcc compiles every `.cu` under `cuda/` (one unity TU) into a fatbin |
//! | kernels | [`module`], [`args`] | embedded fatbin, kernel table (family x variant), the `CollArgs` block every kernel takes |
//! | types | [`dtype`] | element types, operators, accumulation types, kernel variants |
//! | algorithms | [`algorithm`] | the collection: applicability, default geometry |
//! | selection | [`select`] | pin / tuned table / size thresholds, checked overrides |
//! | tuning file | [`tune_file`] | the tuned table's JSON file (`MOELINK_AR_TUNE_FILE`): path, reader, table |
//! | zero copy | [`registration`] | users' tensors exported by CUDA IPC and mapped by every peer |
//! | communicator | [`allreduce`] | [`AllReduceComm`]: scratch, channels, counter, launches |
//!
//! Allreduce: `oneshot_ll`, `twoshot_ll`, `rsag`, `rsag_zc`, `rsag_push`; allgather: `ag_ll`,
//! `ag_mesh`. sum / min / max of bf16, fp16, fp32, int32, fp8 (e4m3, e5m2;
//! sums accumulated in fp16 or fp32). No NVLink multicast anywhere.

pub mod algorithm;
pub mod allreduce;
pub mod args;
pub mod dtype;
pub mod module;
pub mod registration;
pub mod select;
pub mod tune_file;

pub use algorithm::{Algorithm, Collective, Limits, Request};
pub use allreduce::{
    AllGatherCall, AllReduceCall, AllReduceComm, AllReduceConfig, ScratchLayout, TestHooks,
};
pub use dtype::{Accum, DType, ReduceOp};
pub use module::{compiled_archs, CollKernels, Kernel, FATBIN};
pub use select::{Choice, TableKey, TunedTable};
