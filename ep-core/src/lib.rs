//! `ep-core`: what moelink does, on top of `comm` (transports) and
//! `ep-kernels` (the kernels).
//!
//! | module | what it does |
//! |---|---|
//! | [`diagnostics`] | peer-write check: every GPU stores a pattern into every peer over NVLink |

pub mod diagnostics;

pub use comm::{CommError as Error, Result};
