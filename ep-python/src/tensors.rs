//! Tensor arguments read natively from the Python objects, for the calls that
//! run whole in one native call (`ll_calls.rs`): a plain `torch.Tensor`'s
//! meta (`ep_core::calls::TensorMeta`: dtype, shape, strides, device) and
//! data address. Anything else (a tensor subclass, a dtype or device the
//! calls do not name) reads as None, and the caller leaves the call to the
//! checked path in Python, which names the argument in its refusal.
//!
//! Each read is a few attribute lookups. Where a torch function mode is on
//! (`torch.set_default_device`, any `TorchFunctionMode`), torch sends every
//! one of them through the mode's Python `__torch_function__`, about ten
//! times their cost: a call therefore reads under [`plain_torch`], as a C++
//! extension's arguments are read, past the modes.

use std::sync::OnceLock;

use ep_core::calls::{DType, TensorMeta, CPU};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyType;

/// torch's names of the dtypes [`DType`] names.
const NAMES: [&str; 12] = [
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
];

struct Torch {
    tensor: Py<PyType>,
    /// `torch.<name>` with its [`DType`], for each of [`NAMES`] torch has.
    dtypes: Vec<(Py<PyAny>, DType)>,
    /// `torch._C._is_torch_function_mode_enabled` and
    /// `torch._C.DisableTorchFunction`, where this torch has both.
    modes: Option<(Py<PyAny>, Py<PyAny>)>,
}

static TORCH: OnceLock<Torch> = OnceLock::new();

fn torch(py: Python<'_>) -> PyResult<&'static Torch> {
    if let Some(t) = TORCH.get() {
        return Ok(t);
    }
    let m = py.import("torch")?;
    let tensor = m.getattr("Tensor")?.cast_into::<PyType>()?.unbind();
    let dtypes = NAMES
        .iter()
        .filter_map(|n| {
            m.getattr(*n)
                .ok()
                .map(|d| (d.unbind(), DType::from_torch_name(n)))
        })
        .collect();
    let c = m.getattr("_C")?;
    let modes = match (
        c.getattr("_is_torch_function_mode_enabled"),
        c.getattr("DisableTorchFunction"),
    ) {
        (Ok(on), Ok(off)) => Some((on.unbind(), off.unbind())),
        _ => None,
    };
    let _ = TORCH.set(Torch {
        tensor,
        dtypes,
        modes,
    });
    Ok(TORCH.get().expect("just set"))
}

/// torch's function modes turned off while it lives (where one was on; see
/// the module's text). What a call makes itself names its device and dtype,
/// so no mode changes its outputs.
pub(crate) struct PlainTorch<'py>(Option<Bound<'py, PyAny>>);

pub(crate) fn plain_torch(py: Python<'_>) -> PyResult<PlainTorch<'_>> {
    if let Some((on, off)) = &torch(py)?.modes {
        if on.bind(py).call0()?.is_truthy()? {
            let guard = off.bind(py).call0()?;
            guard.call_method0(intern!(py, "__enter__"))?;
            return Ok(PlainTorch(Some(guard)));
        }
    }
    Ok(PlainTorch(None))
}

impl Drop for PlainTorch<'_> {
    fn drop(&mut self) {
        if let Some(guard) = self.0.take() {
            let py = guard.py();
            let none = py.None();
            // Restoring a flag: it does not fail.
            let _ = guard.call_method1(intern!(py, "__exit__"), (&none, &none, &none));
        }
    }
}

/// `obj`'s meta and data address where it is a plain `torch.Tensor` of a
/// named dtype on the CPU or a CUDA device; else None.
pub(crate) fn read(obj: &Bound<'_, PyAny>) -> PyResult<Option<(TensorMeta, u64)>> {
    let py = obj.py();
    let t = torch(py)?;
    if !obj.get_type().is(t.tensor.bind(py)) {
        return Ok(None);
    }
    let dtype = obj.getattr(intern!(py, "dtype"))?;
    let Some((_, dtype)) = t.dtypes.iter().find(|(d, _)| d.bind(py).is(&dtype)) else {
        return Ok(None);
    };
    let device = if obj.getattr(intern!(py, "is_cuda"))?.extract::<bool>()? {
        obj.call_method0(intern!(py, "get_device"))?
            .extract::<i32>()?
    } else if obj.getattr(intern!(py, "is_cpu"))?.extract::<bool>()? {
        CPU
    } else {
        return Ok(None);
    };
    let meta = TensorMeta {
        dtype: dtype.clone(),
        shape: obj.getattr(intern!(py, "shape"))?.extract()?,
        strides: obj.call_method0(intern!(py, "stride"))?.extract()?,
        device,
    };
    let ptr = obj
        .call_method0(intern!(py, "data_ptr"))?
        .extract::<u64>()?;
    Ok(Some((meta, ptr)))
}

/// [`read`] of an optional argument: `Some(None)` for None.
pub(crate) fn read_optional(obj: &Bound<'_, PyAny>) -> PyResult<Option<Option<(TensorMeta, u64)>>> {
    if obj.is_none() {
        return Ok(Some(None));
    }
    Ok(read(obj)?.map(Some))
}
