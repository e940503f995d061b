//! Tensor arguments read natively from the Python objects, for the calls that
//! run whole in one native call (`ll_calls.rs`): a plain `torch.Tensor`'s
//! meta (`ep_core::calls::TensorMeta`: dtype, shape, strides, device) and
//! data address. Anything else (a tensor subclass, a dtype or device the
//! calls do not name) reads as None, and the caller leaves the call to the
//! checked path in Python, which names the argument in its refusal.

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
    let _ = TORCH.set(Torch { tensor, dtypes });
    Ok(TORCH.get().expect("just set"))
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
