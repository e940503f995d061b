//! Element types, reduction operators and accumulation types of the
//! allreduce kernels, and which kernel variant a combination maps to.

use comm::{CommError, Result};

/// Element type of an allreduce (allgather moves bytes and takes any dtype).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    Bf16,
    Fp16,
    Fp32,
    Int32,
    Fp8E4m3,
    Fp8E5m2,
}

impl DType {
    pub const ALL: [DType; 6] = [
        DType::Bf16,
        DType::Fp16,
        DType::Fp32,
        DType::Int32,
        DType::Fp8E4m3,
        DType::Fp8E5m2,
    ];

    /// The names the Python layer passes (`"bf16"`, `"fp8_e4m3"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::Bf16 => "bf16",
            DType::Fp16 => "fp16",
            DType::Fp32 => "fp32",
            DType::Int32 => "int32",
            DType::Fp8E4m3 => "fp8_e4m3",
            DType::Fp8E5m2 => "fp8_e5m2",
        }
    }

    pub fn parse(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| {
                CommError::invalid(
                    "dtype",
                    format!(
                        "{s:?} is not supported; supported: {}",
                        Self::ALL.map(|d| d.name()).join(", ")
                    ),
                )
            })
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::Bf16 | DType::Fp16 => 2,
            DType::Fp32 | DType::Int32 => 4,
            DType::Fp8E4m3 | DType::Fp8E5m2 => 1,
        }
    }

    pub fn is_fp8(self) -> bool {
        matches!(self, DType::Fp8E4m3 | DType::Fp8E5m2)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Min,
    Max,
}

impl ReduceOp {
    pub const ALL: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max];

    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
        }
    }

    pub fn parse(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|o| o.name() == s)
            .ok_or_else(|| {
                CommError::invalid(
                    "op",
                    format!("{s:?} is not supported; supported: sum, min, max"),
                )
            })
    }
}

/// Type the kernels reduce in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Accum {
    Fp16,
    Fp32,
    Int32,
}

impl Accum {
    pub fn name(self) -> &'static str {
        match self {
            Accum::Fp16 => "fp16",
            Accum::Fp32 => "fp32",
            Accum::Int32 => "int32",
        }
    }

    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "fp16" => Ok(Accum::Fp16),
            "fp32" => Ok(Accum::Fp32),
            "int32" => Ok(Accum::Int32),
            _ => Err(CommError::invalid(
                "accum_dtype",
                format!("{s:?} is not an accumulation type (fp16, fp32, int32)"),
            )),
        }
    }

    /// The accumulation a dtype uses when the caller names none: fp32 for every
    /// float type (fp8 included), int32 for int32.
    pub fn default_for(dtype: DType) -> Accum {
        match dtype {
            DType::Int32 => Accum::Int32,
            _ => Accum::Fp32,
        }
    }
}

/// Number of kernel variants per allreduce family.
pub const NUM_VARIANTS: usize = 20;

/// Suffixes of the kernel variants, in kernel-table order (the same list as
/// `MOELINK_AR_VARIANTS` in `cuda/allreduce.cu`; a test compares them).
pub const VARIANT_SUFFIXES: [&str; NUM_VARIANTS] = [
    "bf16_sum",
    "bf16_min",
    "bf16_max",
    "fp16_sum",
    "fp16_min",
    "fp16_max",
    "fp32_sum",
    "fp32_min",
    "fp32_max",
    "int32_sum",
    "int32_min",
    "int32_max",
    "fp8e4m3_sum_acc16",
    "fp8e4m3_sum_acc32",
    "fp8e4m3_min",
    "fp8e4m3_max",
    "fp8e5m2_sum_acc16",
    "fp8e5m2_sum_acc32",
    "fp8e5m2_min",
    "fp8e5m2_max",
];

/// The kernel variant (index into [`VARIANT_SUFFIXES`]) reducing `dtype` with
/// `op` in `accum` (None: [`Accum::default_for`]). bf16/fp16/fp32 accumulate in
/// fp32 and int32 in int32 only; fp8 sums accumulate in fp16 or fp32; fp8
/// min/max are exact in any accumulation type.
pub fn variant(dtype: DType, op: ReduceOp, accum: Option<Accum>) -> Result<usize> {
    let accum = accum.unwrap_or_else(|| Accum::default_for(dtype));
    let bad = || {
        CommError::invalid(
            "accum_dtype",
            format!(
                "{} cannot accumulate a {} {}; allowed: {}",
                accum.name(),
                dtype.name(),
                op.name(),
                match dtype {
                    DType::Int32 => "int32",
                    d if d.is_fp8() => "fp16, fp32",
                    _ => "fp32",
                }
            ),
        )
    };
    let op_index = match op {
        ReduceOp::Sum => 0,
        ReduceOp::Min => 1,
        ReduceOp::Max => 2,
    };
    match dtype {
        DType::Bf16 | DType::Fp16 | DType::Fp32 => {
            if accum != Accum::Fp32 {
                return Err(bad());
            }
            let base = match dtype {
                DType::Bf16 => 0,
                DType::Fp16 => 3,
                _ => 6,
            };
            Ok(base + op_index)
        }
        DType::Int32 => {
            if accum != Accum::Int32 {
                return Err(bad());
            }
            Ok(9 + op_index)
        }
        DType::Fp8E4m3 | DType::Fp8E5m2 => {
            let base = if dtype == DType::Fp8E4m3 { 12 } else { 16 };
            match (op, accum) {
                (_, Accum::Int32) => Err(bad()),
                (ReduceOp::Sum, Accum::Fp16) => Ok(base),
                (ReduceOp::Sum, Accum::Fp32) => Ok(base + 1),
                (ReduceOp::Min, _) => Ok(base + 2),
                (ReduceOp::Max, _) => Ok(base + 3),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_combination_maps_to_its_own_suffix() {
        let mut seen = std::collections::HashSet::new();
        for d in DType::ALL {
            for o in ReduceOp::ALL {
                let accs: &[Option<Accum>] = if d.is_fp8() && o == ReduceOp::Sum {
                    &[None, Some(Accum::Fp16), Some(Accum::Fp32)]
                } else {
                    &[None]
                };
                for &a in accs {
                    let v = variant(d, o, a).unwrap();
                    let suffix = VARIANT_SUFFIXES[v];
                    let dt = d.name().replace('_', "");
                    assert!(suffix.starts_with(&dt), "{d:?} {o:?} -> {suffix}");
                    assert!(suffix.contains(o.name()), "{d:?} {o:?} -> {suffix}");
                    if d.is_fp8() && o == ReduceOp::Sum {
                        let want = if a == Some(Accum::Fp16) {
                            "acc16"
                        } else {
                            "acc32"
                        };
                        assert!(suffix.ends_with(want), "{d:?} {a:?} -> {suffix}");
                    }
                    seen.insert(v);
                }
            }
        }
        assert_eq!(seen.len(), NUM_VARIANTS);
    }

    #[test]
    fn accumulation_types_are_checked() {
        assert!(variant(DType::Bf16, ReduceOp::Sum, Some(Accum::Fp16)).is_err());
        assert!(variant(DType::Fp32, ReduceOp::Max, Some(Accum::Int32)).is_err());
        assert!(variant(DType::Int32, ReduceOp::Sum, Some(Accum::Fp32)).is_err());
        assert!(variant(DType::Fp8E5m2, ReduceOp::Sum, Some(Accum::Int32)).is_err());
        // fp32 is the default accumulation of fp8 sums.
        assert_eq!(
            VARIANT_SUFFIXES[variant(DType::Fp8E4m3, ReduceOp::Sum, None).unwrap()],
            "fp8e4m3_sum_acc32"
        );
    }

    #[test]
    fn names_round_trip() {
        for d in DType::ALL {
            assert_eq!(DType::parse(d.name()).unwrap(), d);
        }
        for o in ReduceOp::ALL {
            assert_eq!(ReduceOp::parse(o.name()).unwrap(), o);
        }
        assert!(DType::parse("fp64").is_err());
        assert!(ReduceOp::parse("prod").is_err());
        assert!(Accum::parse("bf16").is_err());
    }
}
