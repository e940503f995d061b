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
//!
//! The same shim reads a call's tensor arguments ([`read_tensors`]): torch's
//! tensor-to-handle function
//! (`torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors`) gives a handle per
//! tensor in one Python call, and the shim's getters read its meta and data
//! address (about 0.1 us a tensor against about 1 us for the attribute
//! lookups, which also go through any torch function mode).

use std::ffi::{c_int, c_void};
use std::ptr;
use std::sync::{Mutex, OnceLock};

use libloading::os::unix::{Library, RTLD_NOW};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use ep_core::calls::{DType, TensorMeta, CPU};

/// torch's `AtenTensorHandle`: a heap `at::Tensor*`.
type Handle = *mut c_void;
type EmptyStrided =
    unsafe extern "C" fn(i64, *const i64, *const i64, i32, i32, i32, *mut Handle) -> i32;
type HandleFn = unsafe extern "C" fn(Handle) -> i32;
type DataPtr = unsafe extern "C" fn(Handle, *mut *mut c_void) -> i32;
type Reinterpret =
    unsafe extern "C" fn(Handle, i64, *const i64, *const i64, i64, *mut Handle) -> i32;
type ViewDtype = unsafe extern "C" fn(Handle, i32, *mut Handle) -> i32;
type Code = unsafe extern "C" fn() -> i32;
type GetI64 = unsafe extern "C" fn(Handle, *mut i64) -> i32;
type GetI64s = unsafe extern "C" fn(Handle, *mut *mut i64) -> i32;
type GetI32 = unsafe extern "C" fn(Handle, *mut i32) -> i32;

/// The shim's getters of a tensor's meta, and torch's tensor-to-handle
/// function ([`read_tensors`]).
struct Reader {
    /// `torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors`.
    borrow: Py<PyAny>,
    dim: GetI64,
    sizes: GetI64s,
    strides: GetI64s,
    dtype: GetI32,
    device_type: GetI32,
    device_index: GetI32,
    /// The shim's dtype codes of the dtypes [`DType`] names.
    dtypes: Vec<(i32, DType)>,
}

struct Shim {
    lib: Library,
    empty_strided: EmptyStrided,
    delete: HandleFn,
    zero: HandleFn,
    data_ptr: DataPtr,
    reinterpret: Reinterpret,
    /// `aoti_torch_cpu_view_dtype` and, where libtorch_cuda is loaded,
    /// `aoti_torch_cuda_view_dtype`: a tensor's bytes as another dtype.
    view_dtype_cpu: ViewDtype,
    view_dtype_cuda: Option<ViewDtype>,
    /// libtorch_cuda, kept open while its symbol is used.
    _cuda_lib: Option<Library>,
    /// `aoti_torch_device_type_cuda()` and `aoti_torch_device_type_cpu()`.
    cuda: i32,
    cpu: i32,
    /// `torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs`.
    steal: Py<PyAny>,
    /// None where torch lacks the tensor-to-handle function or a getter.
    reader: Option<Reader>,
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
/// process loaded) and keeps `steal` and `borrow` (torch's tensor-to-handle
/// function, for [`read_tensors`]; None: tensors are read by attribute).
/// Idempotent; an error leaves it unset.
#[pyfunction]
#[pyo3(signature = (libtorch_cpu, steal, borrow=None))]
pub fn torch_alloc_init(
    libtorch_cpu: &str,
    steal: Py<PyAny>,
    borrow: Option<Py<PyAny>>,
) -> PyResult<()> {
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
        // The CUDA half of the shim lives beside libtorch_cpu, loaded with it
        // by a CUDA build of torch (absent from a CPU-only one).
        let cuda_path = std::path::Path::new(libtorch_cpu).with_file_name("libtorch_cuda.so");
        let cuda_lib = Library::open(Some(&cuda_path), RTLD_NOW as c_int | RTLD_NOLOAD).ok();
        let view_dtype_cuda = match &cuda_lib {
            Some(l) => symbol(l, "aoti_torch_cuda_view_dtype").ok(),
            None => None,
        };
        Shim {
            reinterpret: symbol(&lib, "aoti_torch__reinterpret_tensor")?,
            view_dtype_cpu: symbol(&lib, "aoti_torch_cpu_view_dtype")?,
            view_dtype_cuda,
            _cuda_lib: cuda_lib,
            empty_strided: symbol(&lib, "aoti_torch_empty_strided")?,
            delete: symbol(&lib, "aoti_torch_delete_tensor_object")?,
            zero: symbol(&lib, "aoti_torch_zero_")?,
            data_ptr: symbol(&lib, "aoti_torch_get_data_ptr")?,
            cuda: cuda(),
            cpu: cpu(),
            steal,
            reader: borrow.and_then(|b| reader(&lib, b).ok()),
            lib,
        }
    };
    let _ = SHIM.set(shim);
    Ok(())
}

/// The getters of `lib` with `borrow`, and the dtype codes.
///
/// # Safety
/// `lib` is libtorch_cpu (the getters' signatures are the shim's).
unsafe fn reader(lib: &Library, borrow: Py<PyAny>) -> PyResult<Reader> {
    let mut dtypes = Vec::new();
    for (dtype, name) in DType::named() {
        // SAFETY: aoti_torch_dtype_* take nothing and return the code.
        if let Ok(code) = unsafe { symbol::<Code>(lib, &format!("aoti_torch_dtype_{name}")) } {
            dtypes.push((unsafe { code() }, dtype));
        }
    }
    // SAFETY: the caller's contract.
    unsafe {
        Ok(Reader {
            borrow,
            dim: symbol(lib, "aoti_torch_get_dim")?,
            sizes: symbol(lib, "aoti_torch_get_sizes")?,
            strides: symbol(lib, "aoti_torch_get_strides")?,
            dtype: symbol(lib, "aoti_torch_get_dtype")?,
            device_type: symbol(lib, "aoti_torch_get_device_type")?,
            device_index: symbol(lib, "aoti_torch_get_device_index")?,
            dtypes,
        })
    }
}

/// The meta and data address of each of `tensors` (plain `torch.Tensor`s,
/// the caller checked), read through torch's shim; None where the shim has
/// no reader or a tensor has a dtype or device [`TensorMeta`] does not name.
pub(crate) fn read_tensors(
    py: Python<'_>,
    tensors: &[&Bound<'_, PyAny>],
) -> PyResult<Option<Vec<(TensorMeta, u64)>>> {
    let Some(shim) = SHIM.get() else {
        return Ok(None);
    };
    let Some(r) = &shim.reader else {
        return Ok(None);
    };
    if tensors.is_empty() {
        return Ok(Some(Vec::new()));
    }
    let list = PyList::new(py, tensors)?;
    let handles = r.borrow.bind(py).call1((list,))?;
    let handles = handles.cast::<PyList>()?;
    let mut raw: Vec<Handle> = Vec::with_capacity(tensors.len());
    for h in handles.iter() {
        // SAFETY: a capsule torch made around a new handle (no name).
        let p = unsafe { ffi::PyCapsule_GetPointer(h.as_ptr(), ptr::null()) };
        if p.is_null() {
            delete_all(shim, &raw);
            return Err(PyErr::fetch(py));
        }
        raw.push(p);
    }
    let out = raw.iter().map(|&h| read_one(shim, r, h)).collect();
    delete_all(shim, &raw);
    Ok(out)
}

/// One handle's meta and data address ([`read_tensors`]).
fn read_one(shim: &Shim, r: &Reader, h: Handle) -> Option<(TensorMeta, u64)> {
    let (mut dim, mut code, mut kind, mut index) = (0i64, 0i32, 0i32, 0i32);
    let (mut sizes, mut strides): (*mut i64, *mut i64) = (ptr::null_mut(), ptr::null_mut());
    let mut data: *mut c_void = ptr::null_mut();
    // SAFETY: h is a live handle; sizes and strides point into the tensor,
    // which lives until the handle is deleted, after the copies below.
    unsafe {
        let ok = (r.dim)(h, &mut dim) == 0
            && (r.sizes)(h, &mut sizes) == 0
            && (r.strides)(h, &mut strides) == 0
            && (r.dtype)(h, &mut code) == 0
            && (r.device_type)(h, &mut kind) == 0
            && (r.device_index)(h, &mut index) == 0
            && (shim.data_ptr)(h, &mut data) == 0;
        if !ok || (dim > 0 && (sizes.is_null() || strides.is_null())) {
            return None;
        }
        let n = dim as usize;
        let (shape, strides) = if n == 0 {
            (Vec::new(), Vec::new())
        } else {
            (
                std::slice::from_raw_parts(sizes, n).to_vec(),
                std::slice::from_raw_parts(strides, n).to_vec(),
            )
        };
        let (_, dtype) = r.dtypes.iter().find(|(c, _)| *c == code)?;
        let device = if kind == shim.cuda {
            index
        } else if kind == shim.cpu {
            CPU
        } else {
            return None;
        };
        Some((
            TensorMeta {
                dtype: dtype.clone(),
                shape,
                strides,
                device,
            },
            data as u64,
        ))
    }
}

/// Whether [`torch_alloc_init`] succeeded.
#[pyfunction]
pub fn torch_alloc_ready() -> bool {
    SHIM.get().is_some()
}

/// An output as Python gives it: shape, strides, dtype name, zero-filled.
type SpecArg = (Vec<i64>, Vec<i64>, String, bool);

/// One output: shape, strides, torch's dtype code and element size,
/// zero-filled or not.
pub(crate) struct Spec {
    shape: Vec<i64>,
    strides: Vec<i64>,
    dtype: i32,
    elem: i64,
    zeroed: bool,
}

impl Spec {
    /// Bytes from the first element to one past the last (0 when empty).
    fn span(&self) -> i64 {
        if self.shape.contains(&0) {
            return 0;
        }
        let last: i64 = self
            .shape
            .iter()
            .zip(&self.strides)
            .map(|(n, s)| (n - 1) * s)
            .sum();
        (last + 1) * self.elem
    }
}

impl Spec {
    /// The output a plan's spec describes.
    pub(crate) fn of(o: &ep_core::calls::OutputSpec) -> PyResult<Spec> {
        Spec::new(
            o.shape.clone(),
            o.strides.clone(),
            o.dtype.torch_name(),
            o.zeroed,
        )
    }

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
        let code = dtype_code(dtype)?;
        let elem = ep_core::calls::DType::from_torch_name(dtype)
            .element_size()
            .ok_or_else(|| PyValueError::new_err(format!("dtype {dtype:?} has no element size")))?;
        Ok(Spec {
            shape,
            strides,
            dtype: code,
            elem,
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

/// Alignment of each output inside a shared allocation (bytes).
const GROUP_ALIGN: i64 = 256;

/// The tensors of `specs` on CUDA device `device` (the CPU for -1), on its
/// current stream, each with its data address. The first `separate` are an
/// allocation each; the rest are views of one allocation, each at an offset
/// aligned to 256 bytes (torch's `at::empty_strided` costs about 2 us a
/// tensor; a view a fraction of that). None when torch's shim refused one
/// (out of memory, say): the caller then allocates through Python, which
/// raises torch's own error.
pub(crate) fn empty<'py>(
    py: Python<'py>,
    specs: &[&Spec],
    separate: usize,
    device: i32,
) -> PyResult<Option<Made<'py>>> {
    let shim = shim()?;
    let (kind, index) = (if device < 0 { shim.cpu } else { shim.cuda }, device.max(0));
    let view_dtype = if device < 0 {
        Some(shim.view_dtype_cpu)
    } else {
        shim.view_dtype_cuda
    };
    // A group of fewer than two, or without the dtype view, is separate.
    let grouped = &specs[separate.min(specs.len())..];
    let separate = if grouped.len() < 2 || view_dtype.is_none() {
        specs.len()
    } else {
        separate
    };
    let mut handles = Vec::with_capacity(specs.len());
    let mut ptrs = Vec::with_capacity(specs.len());
    // Where a step fails: what was made is freed, and the caller falls back.
    let fail = |handles: &[Handle], extra: &[Handle]| {
        delete_all(shim, handles);
        delete_all(shim, extra);
        Ok(None)
    };
    let empty_strided = |shape: &[i64], strides: &[i64], dtype: i32, h: &mut Handle| {
        // SAFETY: shape and strides hold ndim values each; h receives a new handle.
        unsafe {
            (shim.empty_strided)(
                shape.len() as i64,
                shape.as_ptr(),
                strides.as_ptr(),
                dtype,
                kind,
                index,
                h,
            )
        }
    };
    // The output `h` made for `spec`: zero-filled where asked, its address kept.
    let finish = |spec: &Spec, h: Handle, ptrs: &mut Vec<u64>| -> bool {
        let mut data: *mut c_void = ptr::null_mut();
        // SAFETY: h is a live handle of ours.
        let ok = (!spec.zeroed || unsafe { (shim.zero)(h) } == 0)
            && unsafe { (shim.data_ptr)(h, &mut data) } == 0;
        ptrs.push(data as u64);
        ok
    };
    for spec in &specs[..separate] {
        let mut h: Handle = ptr::null_mut();
        if empty_strided(&spec.shape, &spec.strides, spec.dtype, &mut h) != 0 {
            return fail(&handles, &[]);
        }
        handles.push(h);
        if !finish(spec, h, &mut ptrs) {
            return fail(&handles, &[]);
        }
    }
    if let (Some(view_dtype), true) = (view_dtype, separate < specs.len()) {
        let mut offsets = Vec::with_capacity(specs.len() - separate);
        let mut end = 0;
        for spec in &specs[separate..] {
            let at = (end + GROUP_ALIGN - 1) / GROUP_ALIGN * GROUP_ALIGN;
            offsets.push(at);
            end = at + spec.span();
        }
        let total = ((end + GROUP_ALIGN - 1) / GROUP_ALIGN * GROUP_ALIGN).max(GROUP_ALIGN);
        let mut base: Handle = ptr::null_mut();
        if empty_strided(&[total], &[1], dtype_code("uint8")?, &mut base) != 0 {
            return fail(&handles, &[]);
        }
        for (spec, at) in specs[separate..].iter().zip(offsets) {
            let (mut typed, mut view): (Handle, Handle) = (ptr::null_mut(), ptr::null_mut());
            // SAFETY: base is a live 1-D byte tensor of `total` bytes, a
            // multiple of every element size; the view spans `span()` bytes
            // from `at`, inside it, and `at` is a multiple of its element size.
            let rc = unsafe {
                let rc = view_dtype(base, spec.dtype, &mut typed);
                if rc != 0 {
                    rc
                } else {
                    let rc = (shim.reinterpret)(
                        typed,
                        spec.shape.len() as i64,
                        spec.shape.as_ptr(),
                        spec.strides.as_ptr(),
                        at / spec.elem,
                        &mut view,
                    );
                    (shim.delete)(typed);
                    rc
                }
            };
            if rc != 0 {
                return fail(&handles, &[base]);
            }
            handles.push(view);
            if !finish(spec, view, &mut ptrs) {
                return fail(&handles, &[base]);
            }
        }
        // The views keep the storage; the base handle is ours to drop.
        // SAFETY: base is a live handle of ours, not handed to torch.
        unsafe { (shim.delete)(base) };
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
        // The first output (a call's recv_x, when it has one) is an
        // allocation of its own; the rest share one.
        let specs: Vec<&Spec> = self.specs.iter().flatten().collect();
        let Some(made) = empty(py, &specs, 1, device)? else {
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

/// A call's outputs made through the shim for the engine
/// (`ep_core::engine::Outputs`) on CUDA device `device` (the CPU for -1):
/// the first an allocation of its own, the rest views of one ([`empty`]).
pub(crate) struct EngineOutputs<'py> {
    pub py: Python<'py>,
    pub device: i32,
}

impl<'py> ep_core::engine::Outputs for EngineOutputs<'py> {
    type Tensor = Bound<'py, PyAny>;

    fn empty(&mut self, specs: &[&ep_core::calls::OutputSpec]) -> Option<Made<'py>> {
        let specs: Vec<Spec> = specs
            .iter()
            .map(|o| Spec::of(o))
            .collect::<PyResult<_>>()
            .ok()?;
        let refs: Vec<&Spec> = specs.iter().collect();
        empty(self.py, &refs, 1, self.device).ok().flatten()
    }

    /// `NormalCalls` passes no `async_finish` (Python's checked path runs
    /// those calls): refused, should a call ever ask.
    fn finish_async(
        &mut self,
        _comm: comm::StreamHandle,
        _made: &[&Self::Tensor],
    ) -> ep_core::engine::CallResult<()> {
        Err(ep_core::engine::CallError::AfterLaunch(
            "NormalCalls makes no asynchronous calls".into(),
        ))
    }

    fn waiting<T: Send>(&mut self, wait: impl FnOnce() -> T + Send) -> T {
        self.py.detach(wait)
    }
}
