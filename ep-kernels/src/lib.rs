//! `ep-kernels`: every CUDA kernel of moelink and its typed launcher.
//!
//! | layer | module | what it does |
//! |---|---|---|
//! | build | `build.rs` | nvcc compiles every `.cu` under `cuda/` (one unity TU) into a fatbin |
//! | module | [`module`] | embedded fatbin, [`KernelId`] table, one lazily loaded module per device |
//! | launchers | [`launch`], [`intranode`], [`internode`], [`low_latency`] | one typed, checked launcher per kernel, on a caller-given raw stream |
//! | limits | [`limits`] | every limit of the EP API (ranks, top-k, experts, tokens, row sizes), defined once |

/// `const NAME: &[(&str, usize, usize)]`, the same numbers as the kernels'
/// `static_assert`s, one entry per struct: `T: size { field: offset, .. }`
/// (the braces where offsets are asserted), `T as C: ..` where the .cu file
/// names the struct `C`, `field in member: offset` for a field that Rust
/// groups in a nested struct where the .cu file lists it in `T` itself. Each row is `(the .cu file's expression, Rust's
/// value, the number)`; Rust's values are asserted at compile time, and
/// [`check_static_asserts`] finds the .cu file's.
macro_rules! param_layout {
    ($name:ident = { $($body:tt)* }) => {
        param_layout!(@rows $name [] $($body)*);
    };
    (@rows $name:ident [$($row:expr,)*] $t:ident as $c:ident: $n:literal
        $({ $($f:ident $(in $p:ident)?: $m:literal),* $(,)? })? $(, $($rest:tt)*)?) => {
        param_layout!(@rows $name [
            $($row,)*
            (concat!("sizeof(", stringify!($c), ")"), ::core::mem::size_of::<$t>(), $n),
            $($((
                concat!("offsetof(", stringify!($c), ", ", stringify!($f), ")"),
                ::core::mem::offset_of!($t, $($p.)? $f),
                $m,
            ),)*)?
        ] $($($rest)*)?);
    };
    (@rows $name:ident [$($row:expr,)*] $t:ident: $($rest:tt)*) => {
        param_layout!(@rows $name [$($row,)*] $t as $t: $($rest)*);
    };
    (@rows $name:ident [$($row:expr,)*]) => {
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
