//! `moelink-tch`: moelink's Rust API on [`tch`] tensors, for Rust code that
//! trains or serves MoE models with tch (and mixed Rust/Python stacks):
//! DeepEP's Buffer (normal-mode dispatch/combine within a node or across
//! nodes, and low-latency dispatch/combine) and
//! moelink's AllReduce, with the semantics, argument checks and error kinds
//! of the Python API (`moelink.Buffer`, `moelink.AllReduce`).
//!
//! Everything is behind the feature `tch` (off by default, so that the
//! workspace builds without compiling libtorch's C++ wrapper). Build it
//! against the torch of `scripts/setup.sh`:
//! `LIBTORCH_USE_PYTORCH=1 PATH=$PWD/.venv/bin:$PATH cargo build -p moelink-tch --features tch`.
//!
//! | module | what it does |
//! |---|---|
//! | [`group`] | [`Group`]: the ranks and their shared bootstrap, from torchrun's environment or a unique id |
//! | [`buffer`] | [`Buffer`]: layout, dispatch (full, cached), combine (intranode, or internode where the group spans nodes), low-latency dispatch/combine (with receive hooks) |
//! | [`args`] | the call argument types that [`buffer`], [`checks`] and [`reference`](mod@reference) share: [`DispatchX`], [`DispatchArgs`] (from a [`Layout`]), [`Handle`] (with its [`InternodeHandle`]), [`Bias`], [`LlHandle`], [`LlDispatchOptions`], [`LlCombineOptions`], [`RecvX`]; `checks` and `reference` import it, never `buffer` |
//! | [`allreduce`] | [`AllReduce`]: allreduce and allgather on the current stream, the tuning file |
//! | `engine` (private) | ep-core's engine on tch tensors: the intranode layout, dispatch and combine run through it, with outputs tch allocates |
//! | [`checks`] | every call's argument checks (ep-core's `calls`, plus the Python layer's; stream arguments; the host-side expert-id check), usable without a GPU |
//! | [`reference`] | the CPU reference semantics (`ep-reference`, the oracle) on tch tensors |
//! | [`tensor`] | tch tensors as the core sees them; outputs allocated through tch |
//! | [`event`] | [`EventOverlap`] (a call's event, `async_finish`) and [`StreamArgs`] (`previous_event`, `async_finish`, `allocate_on_comm_stream`) |
//! | [`graph`] | [`CudaGraph`]: torch's CUDA graph (capture on a side stream, replay) |
//! | [`stream`] | torch's current CUDA stream (libtorch's C shim), `record_stream`, capture status |
//! | [`error`] | [`Error`], with the Python exception class of each failure |
//!
//! Layers: this crate sits beside `ep-python` on `ep-core` and `collectives`
//! (docs/architecture.md), and on `ep-reference` for [`reference`]; it calls
//! them as the Python package does, through the same checks and launches.

// The table above links the feature's modules: they resolve when the docs are
// built with `--features tch`; without it there is nothing to link to.
#![cfg_attr(not(feature = "tch"), allow(rustdoc::broken_intra_doc_links))]

/// Every item of the crate is behind the feature `tch`.
macro_rules! with_tch {
    ($($item:item)*) => {
        $(
            #[cfg(feature = "tch")]
            $item
        )*
    };
}

with_tch! {
    pub mod allreduce;
    pub mod args;
    pub mod buffer;
    pub mod checks;
    mod engine;
    pub mod error;
    pub mod event;
    pub mod graph;
    pub mod group;
    pub mod reference;
    pub mod stream;
    pub mod tensor;

    pub use allreduce::{AllReduce, AllReduceArgs, AllReduceOptions, ReduceOp, TuneFile};
    pub use args::{
        Bias, DispatchArgs, DispatchX, Handle, InternodeHandle, Layout, LlCombineOptions,
        LlDispatchOptions, LlHandle, RecvX,
    };
    pub use buffer::{
        default_num_sms, default_ranks_per_node, Buffer, BufferOptions, Dispatched, LlDispatched,
        RecvHook,
    };
    pub use ep_core::calls::SmsCall;
    pub use checks::set_check_ids;
    pub use error::{Error, Result};
    pub use event::{EventOverlap, StreamArgs};
    pub use graph::CudaGraph;
    pub use group::{local_device, Group};
    pub use tch;
}
