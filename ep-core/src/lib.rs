//! `ep-core`: what moelink does, on top of `comm` (transports) and
//! `ep-kernels` (the kernels).
//!
//! | module | what it does |
//! |---|---|
//! | [`calls`] | every call's argument checks and output shapes, on torch-free tensor descriptions (shared by the Python binding and the Rust tch API); the Buffer constructor's checks, the NVLink size hint, AllReduce's tensor checks |
//! | [`diagnostics`] | peer-write check: every GPU stores a pattern into every peer over NVLink |
//! | [`ep_buffer`] | [`EpBuffer`], the Rust half of one `moelink.Buffer`: its intranode and low-latency parts (either may be absent), each an object of one `comm::Group`, and what they share (joining the group, device-error checks, barrier, destroy order) |
//! | [`limits`] | every limit of the EP API in one place (from `ep_kernels::limits`), and their table as `moelink._native.limits()` exports it |
//! | [`internode`] | the intranode part of an [`EpBuffer`] whose group spans nodes: one region (NVL slots plus cross-node staging), memory channels to this node's ranks, port channels (proxy threads) to the others, dispatch (send, forward, receive) and combine (send, in-node reduce, cross-node sum) launch sequences |
//! | [`intranode`] | the intranode part of an [`EpBuffer`]: NVL buffer layout, memory channels to every peer, dispatch/combine launch sequences |
//! | [`low_latency`] | the low-latency part of an [`EpBuffer`]: buffer mapped by every peer and its layout, optional proxy port channels, dispatch/combine launches |
//!
//! The CPU reference semantics of these calls (the test oracle) are the crate
//! `ep-reference`, beside this one.

pub mod calls;
pub mod diagnostics;
pub mod ep_buffer;
pub mod internode;
pub mod intranode;
pub mod limits;
pub mod low_latency;

pub use comm::{CommError as Error, Result};
pub use ep_buffer::{BufferPart, EpBuffer, EpBufferOptions, PartBase, PartKind};
pub use ep_kernels::compiled_archs;
