//! `ep-kernels`: every CUDA kernel of moelink and its typed launcher.
//!
//! | layer | module | what it does |
//! |---|---|---|
//! | build | `build.rs` | nvcc compiles every `.cu` under `cuda/` (one unity TU) into a fatbin |
//! | module | [`module`] | embedded fatbin, [`KernelId`] table, one lazily loaded module per device |
//! | launchers | [`launch`], [`intranode`], [`internode`], [`low_latency`] | one typed, checked launcher per kernel, on a caller-given raw stream |
//! | limits | [`limits`] | every limit of the EP API (ranks, top-k, experts, tokens, row sizes), defined once |

/// A row of a `param_layout!` table: `(the .cu file's expression, Rust's
/// value, the number)`. `sizeof!(T == n)`; `sizeof!(T as C == n)` where the
/// .cu file names the struct `C`.
macro_rules! sizeof {
    ($t:ident == $n:expr) => {
        sizeof!($t as $t == $n)
    };
    ($t:ident as $c:ident == $n:expr) => {
        (
            concat!("sizeof(", stringify!($c), ")"),
            ::core::mem::size_of::<$t>(),
            $n,
        )
    };
}

/// A row of a `param_layout!` table: `offsetof!(T, field == n)`;
/// `offsetof!(T as C, field == n)` where the .cu file names the struct `C`.
macro_rules! offsetof {
    ($t:ident, $f:ident == $n:expr) => {
        offsetof!($t as $t, $f == $n)
    };
    ($t:ident as $c:ident, $f:ident == $n:expr) => {
        (
            concat!("offsetof(", stringify!($c), ", ", stringify!($f), ")"),
            ::core::mem::offset_of!($t, $f),
            $n,
        )
    };
}

/// `const NAME: &[(&str, usize, usize)]` of `sizeof!` / `offsetof!` rows: the
/// same numbers as the kernels' `static_assert`s (Rust's values are asserted
/// at compile time; [`check_static_asserts`] finds the .cu file's).
macro_rules! param_layout {
    ($name:ident = [$($row:expr),* $(,)?]) => {
        const $name: &[(&str, usize, usize)] = &[$($row),*];
        const _: () = {
            let mut i = 0;
            while i < $name.len() {
                assert!($name[i].1 == $name[i].2);
                i += 1;
            }
        };
    };
}

/// Every row of `table` is a `static_assert` of `file` (`cu`, its text).
#[cfg(test)]
fn check_static_asserts(file: &str, cu: &str, table: &[(&str, usize, usize)]) {
    for (what, _, n) in table {
        let line = format!("static_assert({what} == {n}, \"mirrored in Rust\");");
        assert!(cu.contains(&line), "{file} lacks `{line}`");
    }
}

pub mod error;
pub mod internode;
pub mod intranode;
pub mod launch;
pub mod limits;
pub mod low_latency;
pub mod module;

pub use module::{compiled_archs, DeviceKernels, KernelId, FATBIN};
