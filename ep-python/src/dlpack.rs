//! A device range as a DLPack capsule (`"dltensor"`, the protocol's
//! `DLManagedTensor`), which `torch.utils.dlpack.from_dlpack` turns into a
//! tensor without a copy and without torch's allocator: the capsule owns the
//! range (a receive pool [`Lease`]) until torch calls its deleter, when the
//! tensor's storage is freed.

use std::ffi::{c_char, c_void, CStr};

use ep_core::recv_pool::Lease;
use pyo3::prelude::*;
use pyo3::{ffi, PyErr};

/// DLPack's `DLDevice` (`kDLCUDA` = 2).
#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

/// DLPack's `DLDataType` (`kDLUInt` = 1).
#[repr(C)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

/// DLPack's `DLManagedTensor`; `manager_ctx` is the [`Owner`].
#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// What a capsule's tensor keeps alive: the range and its shape array.
struct Owner {
    _lease: Lease,
    shape: [i64; 1],
}

const CAPSULE: &CStr = c"dltensor";

/// The consumer (or the capsule's destructor, when nobody consumed it) is
/// done with the tensor: frees the managed tensor and returns the range.
unsafe extern "C" fn delete_managed(m: *mut DlManagedTensor) {
    if m.is_null() {
        return;
    }
    // SAFETY: `m` and its owner were made by Box::into_raw in bytes_capsule,
    // and DLPack calls the deleter once.
    unsafe {
        let m = Box::from_raw(m);
        drop(Box::from_raw(m.manager_ctx as *mut Owner));
    }
}

/// The capsule's destructor: a capsule still named "dltensor" was never
/// consumed, so its tensor is freed here (a consumer renames it).
unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: called by Python with the capsule; the name check comes first.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, CAPSULE.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(capsule, CAPSULE.as_ptr()) as *mut DlManagedTensor;
            delete_managed(m);
        }
    }
}

/// `lease` on CUDA device `device` as a DLPack capsule of a 1-D uint8 tensor
/// of its bytes.
pub(crate) fn bytes_capsule(py: Python<'_>, lease: Lease, device: i32) -> PyResult<Py<PyAny>> {
    let bytes = lease.bytes() as i64;
    let data = lease.ptr() as *mut c_void;
    let owner = Box::into_raw(Box::new(Owner {
        _lease: lease,
        shape: [bytes],
    }));
    let managed = Box::into_raw(Box::new(DlManagedTensor {
        dl_tensor: DlTensor {
            data,
            device: DlDevice {
                device_type: 2,
                device_id: device,
            },
            ndim: 1,
            dtype: DlDataType {
                code: 1,
                bits: 8,
                lanes: 1,
            },
            // SAFETY: `owner` is live until the deleter runs.
            shape: unsafe { (*owner).shape.as_mut_ptr() },
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        },
        manager_ctx: owner as *mut c_void,
        deleter: Some(delete_managed),
    }));
    // SAFETY: the pointer is a live DLManagedTensor, the name a static C
    // string, the destructor frees it unless a consumer took it.
    let capsule = unsafe {
        ffi::PyCapsule_New(
            managed as *mut c_void,
            CAPSULE.as_ptr() as *const c_char,
            Some(capsule_destructor),
        )
    };
    if capsule.is_null() {
        // SAFETY: the capsule was not made, so nobody else owns `managed`.
        unsafe { delete_managed(managed) };
        return Err(PyErr::fetch(py));
    }
    // SAFETY: a new reference, checked non-null.
    Ok(unsafe { Py::from_owned_ptr(py, capsule) })
}
