//! `ep-core`: what moelink does, on top of `comm` (transports) and
//! `ep-kernels` (the kernels).
//!
//! | module | what it does |
//! |---|---|
//! | [`calls`] | every call's argument checks and output shapes, on torch-free tensor descriptions (shared by the Python binding and the Rust tch API); the Buffer constructor's checks, the NVLink size hint, AllReduce's tensor checks |
//! | [`diagnostics`] | peer-write check: every GPU stores a pattern into every peer over NVLink |
//! | [`ep_buffer`] | [`EpBuffer`], the Rust half of one `moelink.Buffer`: its intranode and low-latency parts (either may be absent), each an object of one `comm::Group`; which parts are made, the device-size check, destroy order |
//! | [`part`] | what the parts share with [`EpBuffer`]: [`EpBufferOptions`] (with [`LowLatencyOptions`]), [`PartKind`], [`PartBase`] (joining the group, the part's region), [`BufferPart`] (device-error checks, barrier), phase stamps; the parts import it, never `ep_buffer` |
//! | [`limits`] | every limit of the EP API in one place (from `ep_kernels::limits`), and their table as `moelink._native.limits()` exports it |
//! | [`internode`] | the intranode part of an [`EpBuffer`] whose group spans nodes: one region (NVL slots plus cross-node staging), memory channels to this node's ranks, port channels (proxy threads) to the others, dispatch (send, forward, receive) and combine (send, in-node reduce, cross-node sum) launch sequences |
//! | [`intranode`] | the intranode part of an [`EpBuffer`]: NVL buffer layout, memory channels to every peer, dispatch/combine launch sequences |
//! | [`recv_pool`] | the direct dispatch's receive pool: a region every peer maps, leased out first fit as `recv_x` tensors (the pool lives while its Buffer or any of its tensors does) |
//! | [`low_latency`] | the low-latency part of an [`EpBuffer`]: buffer mapped by every peer and its layout, optional proxy port channels, dispatch/combine launches |
//!
//! The CPU reference semantics of these calls (the test oracle) are the crate
//! `ep-reference`, beside this one.

pub mod calls;
pub mod diagnostics;
pub mod engine;
pub mod ep_buffer;
pub mod internode;
pub mod intranode;
pub mod limits;
pub mod ll_hooks;
pub mod low_latency;
pub mod normal;
pub mod part;
pub mod recv_pool;

pub use comm::{CommError as Error, Result};
pub use ep_buffer::EpBuffer;
pub use ep_kernels::compiled_archs;
pub use normal::NormalPart;
pub use part::{BufferPart, EpBufferOptions, LowLatencyOptions, PartBase, PartKind};
