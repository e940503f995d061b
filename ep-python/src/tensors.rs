//! Tensor arguments read natively from the Python objects, for the calls that
//! run whole in one native call (`ll_calls.rs`): a plain `torch.Tensor`'s
//! meta (`ep_core::calls::TensorMeta`: dtype, shape, strides, device) and
//! data address. Anything else (a tensor subclass, a dtype or device the
//! calls do not name) reads as None, and the caller leaves the call to the
//! checked path in Python, which names the argument in its refusal.
//!
//! A call reads all its tensors at once ([`read_all`]): through torch's C
//! shim where it is loaded (`torch_alloc::read_tensors`, one Python call for
//! them all), else by attribute lookups. Where a torch function mode is on
//! (`torch.set_default_device`, any `TorchFunctionMode`), torch sends every
//! such lookup through the mode's Python `__torch_function__`, about ten
//! times its cost: those reads therefore run under [`plain_torch`], as a C++
//! extension's arguments are read, past the modes (the shim's reads never
//! meet a mode).

use std::sync::OnceLock;

use ep_core::calls::{DType, TensorMeta, CPU};

use crate::torch_alloc;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyInt, PyType};

struct Torch {
    tensor: Py<PyType>,
    /// `torch.<name>` with its [`DType`], for each named one torch has.
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
    let dtypes = DType::named()
        .filter_map(|(d, n)| m.getattr(n).ok().map(|t| (t.unbind(), d)))
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

/// A tensor argument as the calls take it: its meta and data address.
pub(crate) type Read = (TensorMeta, u64);

/// Each of `objs` read: None for Python's None, else its meta and data
/// address. None for the whole where one is anything else than a plain
/// `torch.Tensor` of a named dtype on the CPU or a CUDA device.
pub(crate) fn read_all(
    py: Python<'_>,
    objs: &[&Bound<'_, PyAny>],
) -> PyResult<Option<Vec<Option<Read>>>> {
    let t = torch(py)?;
    let mut tensors = Vec::with_capacity(objs.len());
    for obj in objs {
        if obj.is_none() {
            continue;
        }
        if !obj.get_type().is(t.tensor.bind(py)) {
            return Ok(None);
        }
        tensors.push(*obj);
    }
    let read = match torch_alloc::read_tensors(py, &tensors)? {
        Some(r) => r,
        None => {
            let _plain = plain_torch(py)?;
            let mut r = Vec::with_capacity(tensors.len());
            for obj in &tensors {
                match read(obj)? {
                    Some(m) => r.push(m),
                    None => return Ok(None),
                }
            }
            r
        }
    };
    let mut read = read.into_iter();
    Ok(Some(
        objs.iter()
            .map(|o| if o.is_none() { None } else { read.next() })
            .collect(),
    ))
}

/// [`read_all`] of a fixed number of objects, as an array.
pub(crate) fn read_n<const N: usize>(
    py: Python<'_>,
    objs: &[&Bound<'_, PyAny>; N],
) -> PyResult<Option<[Option<Read>; N]>> {
    Ok(read_all(py, objs)?.and_then(|r| <[Option<Read>; N]>::try_from(r).ok()))
}

/// An exact Python int (not a bool) as i64; None for anything else (the
/// checked path then names the argument in its refusal).
pub(crate) fn int(obj: &Bound<'_, PyAny>) -> Option<i64> {
    if obj.is_exact_instance_of::<PyInt>() {
        obj.extract().ok()
    } else {
        None
    }
}

/// `obj`'s meta and data address where it is a plain `torch.Tensor` of a
/// named dtype on the CPU or a CUDA device; else None.
fn read(obj: &Bound<'_, PyAny>) -> PyResult<Option<(TensorMeta, u64)>> {
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

/// What the one-call paths read of `objs` ([`read_all`]): per object None
/// (for None) or `(dtype name, shape, strides, device, data address)`; None
/// for the whole where the calls would decline.
#[pyfunction]
#[allow(clippy::type_complexity)]
pub fn tensor_args(
    py: Python<'_>,
    objs: Vec<Bound<'_, PyAny>>,
) -> PyResult<Option<Vec<Option<(String, Vec<i64>, Vec<i64>, i32, u64)>>>> {
    let refs: Vec<&Bound<'_, PyAny>> = objs.iter().collect();
    Ok(read_all(py, &refs)?.map(|r| {
        r.into_iter()
            .map(|t| {
                t.map(|(m, p)| {
                    (
                        m.dtype.torch_name().to_string(),
                        m.shape,
                        m.strides,
                        m.device,
                        p,
                    )
                })
            })
            .collect()
    }))
}
