//! The tensor checks of `moelink.AllReduce`'s calls (and of the tch
//! `AllReduce`): `all_reduce`, `all_gather`, `register`. The communicator of
//! crate `collectives` checks the rest (the dtype/op/accumulation variant, the
//! algorithm, the launch geometry); a front end turns the kernel dtype name
//! of [`AllReducePlan`] into `collectives::DType` (`DType::parse`).

use super::{device_name, value_err, ArgError, ArgErrorKind, ArgResult, DType, TensorMeta};

/// The dtypes an allreduce reduces, and the kernels' name of each
/// (`collectives::DType::name`), in the order messages list them.
pub const ALL_REDUCE_DTYPES: [(DType, &str); 6] = [
    (DType::BF16, "bf16"),
    (DType::F16, "fp16"),
    (DType::F32, "fp32"),
    (DType::I32, "int32"),
    (DType::F8E4M3, "fp8_e4m3"),
    (DType::F8E5M2, "fp8_e5m2"),
];

fn type_err<T>(message: String) -> ArgResult<T> {
    Err(ArgError {
        kind: ArgErrorKind::Type,
        message,
    })
}

/// Integers as Python prints a tuple of them: `(4, 1)`, `(2,)`.
fn py_tuple(v: &[i64]) -> String {
    match v {
        [one] => format!("({one},)"),
        _ => {
            let items: Vec<String> = v.iter().map(i64::to_string).collect();
            format!("({})", items.join(", "))
        }
    }
}

/// Elements of `t`.
fn numel(t: &TensorMeta) -> i64 {
    t.shape.iter().fold(1i64, |n, &s| n.saturating_mul(s))
}

/// A tensor of a communicator's call (called `name`): on its device,
/// contiguous (the kernels take any alignment).
fn on_device(name: &str, t: &TensorMeta, device: i32) -> ArgResult<()> {
    if t.device != device {
        return value_err(format!(
            "{name} is on {}, but this communicator runs on {}",
            device_name(t.device),
            device_name(device)
        ));
    }
    if !t.is_contiguous() {
        return value_err(format!(
            "{name} must be contiguous (got strides {})",
            py_tuple(&t.strides)
        ));
    }
    Ok(())
}

/// What an allreduce reduces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllReducePlan {
    /// The kernels' name of the dtype (`"bf16"`, ...: [`ALL_REDUCE_DTYPES`]).
    pub dtype: &'static str,
    /// Elements of `tensor` (and of `out`).
    pub count: i64,
    /// Bytes of `tensor`.
    pub nbytes: i64,
}

/// An allreduce of `tensor` into `out` (None: in place) on a communicator of
/// CUDA device `device` whose largest message is `max_bytes`: `tensor` of a
/// dtype of [`ALL_REDUCE_DTYPES`] (else a `Type` error), on `device`,
/// contiguous, at most `max_bytes`; `out` likewise, of `tensor`'s dtype (else
/// a `Type` error) and number of elements (any shape).
pub fn all_reduce(
    device: i32,
    tensor: &TensorMeta,
    out: Option<&TensorMeta>,
    max_bytes: i64,
) -> ArgResult<AllReducePlan> {
    let Some(&(_, dtype)) = ALL_REDUCE_DTYPES.iter().find(|(d, _)| *d == tensor.dtype) else {
        let supported: Vec<String> = ALL_REDUCE_DTYPES
            .iter()
            .map(|(d, _)| d.to_string())
            .collect();
        return type_err(format!(
            "tensor dtype {} is not supported; supported: {}",
            tensor.dtype,
            supported.join(", ")
        ));
    };
    on_device("tensor", tensor, device)?;
    let count = numel(tensor);
    let size = tensor.dtype.element_size().expect("a named dtype");
    let nbytes = count.saturating_mul(size);
    if nbytes > max_bytes {
        return value_err(format!(
            "tensor has {nbytes} bytes, more than this communicator's max_bytes={max_bytes}"
        ));
    }
    if let Some(out) = out {
        on_device("out", out, device)?;
        if out.dtype != tensor.dtype {
            return type_err(format!(
                "out has dtype {}, tensor {}",
                out.dtype, tensor.dtype
            ));
        }
        if numel(out) != count {
            return value_err(format!("out has {} elements, tensor {count}", numel(out)));
        }
    }
    Ok(AllReducePlan {
        dtype,
        count,
        nbytes,
    })
}

/// What an allgather moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllGatherPlan {
    /// Bytes of `inp`: what each rank contributes.
    pub nbytes: i64,
}

/// An allgather of `inp` into `out` among `world_size` ranks on a
/// communicator of CUDA device `device` whose largest message is
/// `max_bytes`: both on `device`, contiguous, of one dtype (any: the
/// allgather moves bytes; else a `Type` error) of `element_size` bytes, `out`
/// holding `world_size * inp`'s elements, at most `max_bytes`.
pub fn all_gather(
    device: i32,
    out: &TensorMeta,
    inp: &TensorMeta,
    element_size: i64,
    world_size: i64,
    max_bytes: i64,
) -> ArgResult<AllGatherPlan> {
    on_device("out", out, device)?;
    on_device("inp", inp, device)?;
    if out.dtype != inp.dtype {
        return type_err(format!("out has dtype {}, inp {}", out.dtype, inp.dtype));
    }
    let (out_n, inp_n) = (numel(out), numel(inp));
    if out_n != world_size.saturating_mul(inp_n) {
        return value_err(format!(
            "out must hold world_size * inp.numel() = {world_size} * {inp_n} elements, it holds \
             {out_n}"
        ));
    }
    let total = out_n.saturating_mul(element_size);
    if total > max_bytes {
        return value_err(format!(
            "out has {total} bytes, more than this communicator's max_bytes={max_bytes}"
        ));
    }
    Ok(AllGatherPlan {
        nbytes: inp_n.saturating_mul(element_size),
    })
}

/// A tensor to register with a communicator of CUDA device `device`
/// (`AllReduce.register`): on `device`, contiguous, not empty. Returns its
/// bytes (`element_size` bytes per element).
pub fn all_reduce_register(device: i32, tensor: &TensorMeta, element_size: i64) -> ArgResult<i64> {
    on_device("tensor", tensor, device)?;
    let nbytes = numel(tensor).saturating_mul(element_size);
    if nbytes == 0 {
        return value_err("cannot register an empty tensor".into());
    }
    Ok(nbytes)
}

#[cfg(test)]
mod tests {
    use super::super::{contiguous_strides, CPU, OTHER_DEVICE};
    use super::*;
    use crate::calls::test_util::fails;

    const DEV: i32 = 0;
    const MAX: i64 = 1 << 20;

    fn t(dtype: DType, shape: &[i64]) -> TensorMeta {
        TensorMeta::contiguous(dtype, shape, DEV)
    }

    fn strided(dtype: DType, shape: &[i64], strides: &[i64]) -> TensorMeta {
        TensorMeta {
            dtype,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            device: DEV,
        }
    }

    #[test]
    fn all_reduce_plans() {
        for (dtype, name) in ALL_REDUCE_DTYPES {
            let size = dtype.element_size().unwrap();
            let p = all_reduce(DEV, &t(dtype.clone(), &[17]), None, MAX).unwrap();
            assert_eq!((p.dtype, p.count, p.nbytes), (name, 17, 17 * size));
        }
        // Any shape of out with as many elements; exactly max_bytes fits.
        let x = t(DType::BF16, &[10]);
        let p = all_reduce(DEV, &x, Some(&t(DType::BF16, &[2, 5])), 20).unwrap();
        assert_eq!((p.count, p.nbytes), (10, 20));
        // A contiguous view at an offset, a 0-D tensor, an empty one.
        assert_eq!(
            all_reduce(DEV, &t(DType::F32, &[]), None, MAX)
                .unwrap()
                .count,
            1
        );
        assert_eq!(
            all_reduce(DEV, &t(DType::F32, &[0, 4]), None, MAX)
                .unwrap()
                .count,
            0
        );
    }

    #[test]
    fn all_reduce_names_the_argument() {
        use ArgErrorKind::{Type, Value};
        fails(
            all_reduce(DEV, &t(DType::F64, &[4]), None, MAX),
            Type,
            "tensor dtype torch.float64 is not supported; supported: torch.bfloat16, \
             torch.float16, torch.float32, torch.int32, torch.float8_e4m3fn, torch.float8_e5m2",
        );
        let other = t(DType::Other("complex64".into()), &[4]);
        let e = all_reduce(DEV, &other, None, MAX).unwrap_err();
        assert!(e
            .message
            .starts_with("tensor dtype torch.complex64 is not supported"));
        fails(
            all_reduce(
                DEV,
                &TensorMeta::contiguous(DType::F32, &[8], CPU),
                None,
                MAX,
            ),
            Value,
            "tensor is on cpu, but this communicator runs on cuda:0",
        );
        fails(
            all_reduce(1, &t(DType::F32, &[8]), None, MAX),
            Value,
            "tensor is on cuda:0, but this communicator runs on cuda:1",
        );
        fails(
            all_reduce(DEV, &strided(DType::F32, &[4, 4], &[1, 4]), None, MAX),
            Value,
            "tensor must be contiguous (got strides (1, 4))",
        );
        fails(
            all_reduce(DEV, &strided(DType::F32, &[4], &[2]), None, MAX),
            Value,
            "tensor must be contiguous (got strides (2,))",
        );
        fails(
            all_reduce(DEV, &t(DType::F32, &[257]), None, 1024),
            Value,
            "tensor has 1028 bytes, more than this communicator's max_bytes=1024",
        );
        let x = t(DType::BF16, &[10]);
        fails(
            all_reduce(DEV, &x, Some(&t(DType::F16, &[10])), MAX),
            Type,
            "out has dtype torch.float16, tensor torch.bfloat16",
        );
        fails(
            all_reduce(DEV, &x, Some(&t(DType::BF16, &[11])), MAX),
            Value,
            "out has 11 elements, tensor 10",
        );
        fails(
            all_reduce(DEV, &x, Some(&strided(DType::BF16, &[10], &[2])), MAX),
            Value,
            "out must be contiguous (got strides (2,))",
        );
        let mut meta = t(DType::BF16, &[10]);
        meta.device = OTHER_DEVICE;
        fails(
            all_reduce(DEV, &x, Some(&meta), MAX),
            Value,
            "out is on a device that is neither CUDA nor the CPU, but this communicator runs on \
             cuda:0",
        );
    }

    #[test]
    fn all_gather_plans_and_names_the_argument() {
        use ArgErrorKind::{Type, Value};
        let (out, inp) = (t(DType::F32, &[20]), t(DType::F32, &[5]));
        assert_eq!(
            all_gather(DEV, &out, &inp, 4, 4, MAX),
            Ok(AllGatherPlan { nbytes: 20 })
        );
        assert_eq!(all_gather(DEV, &out, &inp, 4, 4, 80).unwrap().nbytes, 20);
        // Any dtype moves, one torch has no name for here too.
        let c = |shape: &[i64]| t(DType::Other("complex64".into()), shape);
        assert_eq!(
            all_gather(DEV, &c(&[6]), &c(&[3]), 8, 2, MAX)
                .unwrap()
                .nbytes,
            24
        );
        fails(
            all_gather(DEV, &out, &inp, 4, 3, MAX),
            Value,
            "out must hold world_size * inp.numel() = 3 * 5 elements, it holds 20",
        );
        fails(
            all_gather(DEV, &out, &t(DType::F16, &[5]), 4, 4, MAX),
            Type,
            "out has dtype torch.float32, inp torch.float16",
        );
        fails(
            all_gather(DEV, &out, &inp, 4, 4, 79),
            Value,
            "out has 80 bytes, more than this communicator's max_bytes=79",
        );
        fails(
            all_gather(1, &out, &inp, 4, 4, MAX),
            Value,
            "out is on cuda:0, but this communicator runs on cuda:1",
        );
        let mut strided_inp = inp.clone();
        strided_inp.strides = vec![2];
        fails(
            all_gather(DEV, &out, &strided_inp, 4, 4, MAX),
            Value,
            "inp must be contiguous (got strides (2,))",
        );
    }

    #[test]
    fn register_needs_a_contiguous_non_empty_tensor_here() {
        assert_eq!(
            all_reduce_register(DEV, &t(DType::BF16, &[3, 4]), 2),
            Ok(24)
        );
        fails(
            all_reduce_register(DEV, &t(DType::BF16, &[0, 4]), 2),
            ArgErrorKind::Value,
            "cannot register an empty tensor",
        );
        fails(
            all_reduce_register(DEV, &TensorMeta::contiguous(DType::BF16, &[4], CPU), 2),
            ArgErrorKind::Value,
            "tensor is on cpu, but this communicator runs on cuda:0",
        );
        let mut s = t(DType::BF16, &[4, 4]);
        s.strides = contiguous_strides(&[4, 4]).into_iter().rev().collect();
        fails(
            all_reduce_register(DEV, &s, 2),
            ArgErrorKind::Value,
            "tensor must be contiguous (got strides (1, 4))",
        );
    }
}
