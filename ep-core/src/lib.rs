//! `ep-core`: what moelink does, on top of `comm` (transports) and
//! `ep-kernels` (the kernels).
//!
//! | module | what it does |
//! |---|---|
//! | [`diagnostics`] | peer-write check: every GPU stores a pattern into every peer over NVLink |
//! | [`limits`] | every limit of the EP API in one place, and the checks that apply them |
//! | [`intranode`] | the intranode `Buffer` (an object of a `comm::Group`, on the group's Communicator): NVL buffer, memory channels to every peer, dispatch/combine launch sequences |
//! | [`low_latency`] | the low-latency `Buffer` part (an object of a `comm::Group`, on the group's Communicator): buffer mapped by every peer, optional proxy port channels, dispatch/combine launches |
//! | [`reference`](mod@reference) | CPU reference semantics (the test oracle) of layout, dispatch and combine, any number of ranks |
//! | [`reference_ll`] | CPU reference semantics (the test oracle) of low-latency dispatch (with its fp8 cast) and combine, any number of ranks |

pub mod diagnostics;
pub mod intranode;
pub mod limits;
pub mod low_latency;
pub mod reference;
pub mod reference_ll;
#[cfg(test)]
mod test_support;

pub use comm::{CommError as Error, Result};
pub use ep_kernels::compiled_archs;
