//! `ep-reference`: the CPU reference semantics of moelink's expert-parallel
//! calls, the test oracle that every GPU test of them compares with. Any
//! number of ranks is simulated in one process; no GPU is needed.
//!
//! It stands beside `ep-core` (the engine), not on it: from `ep-kernels` it
//! takes the limits of the EP API and the low-latency kernels' shape check,
//! from `comm` the error type. Its users are the Python binding
//! (`moelink.reference`), `moelink-tch`'s `reference` module and ep-core's
//! GPU layout test.
//!
//! | module | what it does |
//! |---|---|
//! | [`normal`] | CPU reference semantics of layout, dispatch and combine (intranode, and internode for nodes of consecutive ranks), any number of ranks |
//! | [`low_latency`] | CPU reference semantics of low-latency dispatch (with its fp8 cast) and combine, any number of ranks |
//! | [`limits`] | the limits of the EP API (from `ep_kernels::limits`), the argument checks that apply them, and the output budget of one reference call |

pub mod limits;
pub mod low_latency;
pub mod normal;
#[cfg(test)]
mod test_support;
