//! Output tensors made natively through torch's caching allocator, without
//! linking libtorch: torch's stable C shim (`aoti_torch_empty_strided` and its
//! neighbours, exported by `libtorch_cpu.so`) is resolved at run time from the
//! library the process already loaded, and the tensors it returns are handed
//! to Python by torch's own handle-to-tensor function
//! (`torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs`). So an output
//! is an ordinary torch tensor (its storage is the caching allocator's:
//! `record_stream`, memory statistics and graph pools behave as for
//! `torch.empty`), made on the current stream, and the wheel does not depend
//! on the torch version. It costs what `torch.empty_strided` from Python
//! does (torch's own `at::empty_strided` dominates); its use is that a native
//! call sequence can make its outputs (docs/architecture.md, "Outputs").
//!
//! Python initialises it once ([`torch_alloc_init`]); where that fails (a
//! torch without the shim) Python keeps allocating with `torch.empty_strided`.

use std::ffi::{c_int, c_void};
use std::ptr;
use std::sync::{Mutex, OnceLock};

use libloading::os::unix::{Library, RTLD_NOW};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

/// torch's `AtenTensorHandle`: a heap `at::Tensor*`.
type Handle = *mut c_void;
type EmptyStrided =
    unsafe extern "C" fn(i64, *const i64, *const i64, i32, i32, i32, *mut Handle) -> i32;
type HandleFn = unsafe extern "C" fn(Handle) -> i32;
type DataPtr = unsafe extern "C" fn(Handle, *mut *mut c_void) -> i32;
type Code = unsafe extern "C" fn() -> i32;

struct Shim {
    lib: Library,
    empty_strided: EmptyStrided,
    delete: HandleFn,
    zero: HandleFn,
    data_ptr: DataPtr,
    /// `aoti_torch_device_type_cuda()` and `aoti_torch_device_type_cpu()`.
    cuda: i32,
    cpu: i32,
    /// `torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs`.
    steal: Py<PyAny>,
}

static SHIM: OnceLock<Shim> = OnceLock::new();

/// glibc's `RTLD_NOLOAD` (libloading does not export it): open the library
/// only if the process already loaded it, so a path that names another copy
/// fails instead of loading (and initialising) a second libtorch.
const RTLD_NOLOAD: c_int = 0x4;

/// Symbol `name` of `lib` as a `T` (a function pointer type).
///
/// # Safety
/// `T` must be the symbol's C signature.
unsafe fn symbol<T: Copy>(lib: &Library, name: &str) -> PyResult<T> {
    // SAFETY: the caller's contract.
    unsafe { lib.get::<T>(name.as_bytes()) }
        .map(|s| *s)
        .map_err(|e| PyRuntimeError::new_err(format!("torch's C shim has no {name}: {e}")))
}

/// Loads the shim from `libtorch_cpu` (the path of the `libtorch_cpu.so` the
/// process loaded) and keeps `steal`. Idempotent; an error leaves it unset.
#[pyfunction]
pub fn torch_alloc_init(libtorch_cpu: &str, steal: Py<PyAny>) -> PyResult<()> {
    if SHIM.get().is_some() {
        return Ok(());
    }
    // SAFETY: RTLD_NOLOAD opens only a library the process already loaded, so
    // no initialiser runs; the symbols below are torch's C shim, with these
    // signatures (torch/csrc/inductor/aoti_torch/c/shim.h).
    let shim = unsafe {
        let lib = Library::open(Some(libtorch_cpu), RTLD_NOW as c_int | RTLD_NOLOAD)
            .map_err(|e| PyRuntimeError::new_err(format!("cannot open {libtorch_cpu}: {e}")))?;
        let cuda: Code = symbol(&lib, "aoti_torch_device_type_cuda")?;
        let cpu: Code = symbol(&lib, "aoti_torch_device_type_cpu")?;
        Shim {
            empty_strided: symbol(&lib, "aoti_torch_empty_strided")?,
            delete: symbol(&lib, "aoti_torch_delete_tensor_object")?,
            zero: symbol(&lib, "aoti_torch_zero_")?,
            data_ptr: symbol(&lib, "aoti_torch_get_data_ptr")?,
            cuda: cuda(),
            cpu: cpu(),
            steal,
            lib,
        }
    };
    let _ = SHIM.set(shim);
    Ok(())
}

/// Whether [`torch_alloc_init`] succeeded.
#[pyfunction]
pub fn torch_alloc_ready() -> bool {
    SHIM.get().is_some()
}

/// An output as Python gives it: shape, strides, dtype name, zero-filled.
type SpecArg = (Vec<i64>, Vec<i64>, String, bool);

/// One output: shape, strides, torch's dtype code, zero-filled or not.
pub(crate) struct Spec {
    shape: Vec<i64>,
    strides: Vec<i64>,
    dtype: i32,
    zeroed: bool,
}

impl Spec {
    /// An output of dtype `dtype` (torch's name); `ValueError` for a name
    /// torch's shim does not know, `RuntimeError` before [`torch_alloc_init`].
    pub(crate) fn new(
        shape: Vec<i64>,
        strides: Vec<i64>,
        dtype: &str,
        zeroed: bool,
    ) -> PyResult<Self> {
        if shape.len() != strides.len() {
            return Err(PyValueError::new_err("shape and strides differ in length"));
        }
        Ok(Spec {
            shape,
            strides,
            dtype: dtype_code(dtype)?,
            zeroed,
        })
    }
}

/// torch's code of the dtype it calls `name` (`aoti_torch_dtype_<name>()`),
/// looked up once per name.
fn dtype_code(name: &str) -> PyResult<i32> {
    static CODES: Mutex<Vec<(String, i32)>> = Mutex::new(Vec::new());
    let mut codes = CODES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, c)) = codes.iter().find(|(n, _)| n == name) {
        return Ok(*c);
    }
    let shim = shim()?;
    // SAFETY: aoti_torch_dtype_* take nothing and return the code.
    let code: Code = unsafe { symbol(&shim.lib, &format!("aoti_torch_dtype_{name}")) }
        .map_err(|_| PyValueError::new_err(format!("dtype {name:?} is not torch's")))?;
    // SAFETY: as above.
    let c = unsafe { code() };
    codes.push((name.to_string(), c));
    Ok(c)
}

fn shim() -> PyResult<&'static Shim> {
    SHIM.get()
        .ok_or_else(|| PyRuntimeError::new_err("torch_alloc_init was not called"))
}

/// A fixed list of outputs (a cached plan's), each made by [`TorchOutputs::empty`].
/// `None` entries stand for outputs a call does not make.
#[pyclass(frozen, module = "moelink._native")]
pub struct TorchOutputs {
    specs: Vec<Option<Spec>>,
}

/// Frees handles that were not handed to torch.
fn delete_all(shim: &Shim, handles: &[Handle]) {
    for &h in handles {
        // SAFETY: each handle came from empty_strided and was not stolen.
        unsafe { (shim.delete)(h) };
    }
}

/// Tensors made by [`empty`], each with its data address.
pub(crate) type Made<'py> = Vec<(Bound<'py, PyAny>, u64)>;

/// The tensors of `specs` on CUDA device `device` (the CPU for -1), on its
/// current stream, each with its data address. None when torch's shim
/// refused one (out of memory, say): the caller then allocates through
/// Python, which raises torch's own error.
pub(crate) fn empty<'py, 'a>(
    py: Python<'py>,
    specs: impl IntoIterator<Item = &'a Spec>,
    device: i32,
) -> PyResult<Option<Made<'py>>> {
    let shim = shim()?;
    let mut handles = Vec::new();
    let mut ptrs = Vec::new();
    for spec in specs {
        let mut h: Handle = ptr::null_mut();
        // SAFETY: shape and strides hold ndim values each; h receives a new handle.
        let rc = unsafe {
            (shim.empty_strided)(
                spec.shape.len() as i64,
                spec.shape.as_ptr(),
                spec.strides.as_ptr(),
                spec.dtype,
                if device < 0 { shim.cpu } else { shim.cuda },
                device.max(0),
                &mut h,
            )
        };
        if rc == 0 {
            handles.push(h);
        }
        let mut data: *mut c_void = ptr::null_mut();
        // SAFETY: h is the handle just made (where rc is 0).
        if rc != 0
            || (spec.zeroed && unsafe { (shim.zero)(h) } != 0)
            || unsafe { (shim.data_ptr)(h, &mut data) } != 0
        {
            delete_all(shim, &handles);
            return Ok(None);
        }
        ptrs.push(data as u64);
    }
    let capsules = handles
        .iter()
        .map(|&h| {
            // SAFETY: an unnamed capsule without destructor around the
            // handle, as torch's own tensor-to-handle function makes them.
            let c = unsafe { ffi::PyCapsule_New(h, ptr::null(), None) };
            // SAFETY: c is a new reference or null with an exception set.
            unsafe { Bound::from_owned_ptr_or_err(py, c) }
        })
        .collect::<PyResult<Vec<_>>>();
    let capsules = match capsules {
        Ok(c) => c,
        Err(e) => {
            delete_all(shim, &handles);
            return Err(e);
        }
    };
    // torch takes every handle (and frees it) from here on.
    let tensors = shim.steal.bind(py).call1((PyList::new(py, capsules)?,))?;
    let tensors = tensors.try_iter()?.collect::<PyResult<Vec<_>>>()?;
    if tensors.len() != ptrs.len() {
        return Err(PyRuntimeError::new_err("torch returned fewer tensors"));
    }
    Ok(Some(tensors.into_iter().zip(ptrs).collect()))
}

#[pymethods]
impl TorchOutputs {
    /// `specs`: `(shape, strides, dtype name, zeroed)` or None per output;
    /// `ValueError` for a dtype torch's shim does not name.
    #[new]
    fn new(specs: Vec<Option<SpecArg>>) -> PyResult<Self> {
        let specs = specs
            .into_iter()
            .map(|s| {
                s.map(|(shape, strides, dtype, zeroed)| Spec::new(shape, strides, &dtype, zeroed))
                    .transpose()
            })
            .collect::<PyResult<_>>()?;
        Ok(Self { specs })
    }

    /// The outputs on CUDA device `device` (the CPU for -1), on its current
    /// stream: a tuple with None where the spec is None; None where torch's
    /// shim refused one ([`empty`]).
    fn empty<'py>(&self, py: Python<'py>, device: i32) -> PyResult<Option<Bound<'py, PyTuple>>> {
        let Some(made) = empty(py, self.specs.iter().flatten(), device)? else {
            return Ok(None);
        };
        let mut made = made.into_iter();
        let mut out = Vec::with_capacity(self.specs.len());
        for spec in &self.specs {
            out.push(match spec {
                Some(_) => made.next().map(|(t, _)| t).expect("one tensor per spec"),
                None => py.None().into_bound(py),
            });
        }
        PyTuple::new(py, out).map(Some)
    }
}
