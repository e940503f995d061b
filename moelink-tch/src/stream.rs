//! torch's current CUDA stream, which tch does not expose: read (and set)
//! through libtorch's stable C entry points of AOTInductor
//! (`torch/csrc/inductor/aoti_torch/c/shim.h`, exported by `libtorch_cuda`):
//! `aoti_torch_get_current_cuda_stream`, what `torch.cuda.current_stream()`
//! reads, and `aoti_torch_create_cuda_stream_guard`, a
//! `c10::cuda::CUDAStreamGuard` over an external stream. No C++ of our own:
//! the symbols are plain C, linked from the torch that torch-sys links.
//! What the shim has no entry point for (marking a tensor used on a stream,
//! `Tensor.record_stream`) comes from this crate's C++ shim (`src/shim.cpp`).

use std::ffi::c_void;

use comm::StreamHandle;

use crate::error::{Error, Result};

extern "C" {
    // AOTITorchError (int32_t, 0 = success) aoti_torch_get_current_cuda_stream(
    //     int32_t device_index, void** ret_stream);
    fn aoti_torch_get_current_cuda_stream(device_index: i32, ret_stream: *mut *mut c_void) -> i32;
    fn aoti_torch_create_cuda_stream_guard(
        stream: *mut c_void,
        device_index: i32,
        ret_guard: *mut *mut c_void,
    ) -> i32;
    fn aoti_torch_delete_cuda_stream_guard(guard: *mut c_void) -> i32;
}

extern "C" {
    // src/shim.cpp
    fn moelink_tch_record_stream(
        tensor: *mut c_void,
        stream: *mut c_void,
        device: i32,
        err: *mut *mut std::ffi::c_char,
    ) -> i32;
    pub(crate) fn moelink_tch_free_error(err: *mut std::ffi::c_char);
}

/// The result of a shim call: its error message, if it returned one.
pub(crate) fn shim_result(call: &str, code: i32, err: *mut std::ffi::c_char) -> Result<()> {
    if code == 0 {
        return Ok(());
    }
    let message = if err.is_null() {
        String::from("unknown error")
    } else {
        // SAFETY: the shim returns a NUL-terminated string from strdup, freed once here.
        unsafe {
            let m = std::ffi::CStr::from_ptr(err).to_string_lossy().into_owned();
            moelink_tch_free_error(err);
            m
        }
    };
    Err(Error::state(format!("libtorch {call} failed: {message}")))
}

fn check(call: &str, code: i32) -> Result<()> {
    if code == 0 {
        Ok(())
    } else {
        Err(Error::state(format!(
            "libtorch {call} failed (error {code})"
        )))
    }
}

/// The raw `cudaStream_t` of CUDA device `device`'s current stream in torch
/// (0: the default stream), the stream tch's operations on that device run on.
pub fn current_stream(device: i32) -> Result<StreamHandle> {
    let mut stream = std::ptr::null_mut();
    // SAFETY: a plain C call writing one pointer; it raises no C++ exception
    // (the shim catches them into its error code).
    let code = unsafe { aoti_torch_get_current_cuda_stream(device, &mut stream) };
    check("aoti_torch_get_current_cuda_stream", code)?;
    Ok(StreamHandle(stream as usize))
}

/// Whether a CUDA graph is being captured on torch's current stream of
/// `device` (`torch.cuda.is_current_stream_capturing()`).
pub fn is_current_stream_capturing(device: i32) -> Result<bool> {
    Ok(current_stream(device)?.is_capturing()?)
}

/// `t.record_stream(stream)`: torch's caching allocator does not hand `t`'s
/// memory out again, once `t` is freed, before the work issued to `stream`
/// (a raw stream of `device`) so far has completed. Nothing for an undefined
/// or empty tensor (as the Python Buffer skips them).
pub fn record_stream(t: &tch::Tensor, stream: StreamHandle, device: i32) -> Result<()> {
    if !t.defined() || t.numel() == 0 {
        return Ok(());
    }
    let mut err = std::ptr::null_mut();
    // SAFETY: `t` is a live tensor (tch's pointer is an `at::Tensor*`, which
    // the shim only reads); the stream is the caller's live stream.
    let code = unsafe {
        moelink_tch_record_stream(
            t.as_ptr() as *mut c_void,
            stream.0 as *mut c_void,
            device,
            &mut err,
        )
    };
    shim_result("Tensor.record_stream", code, err)
}

/// While alive, torch's current stream on `device` is `stream` (a raw
/// `cudaStream_t`, e.g. a `comm::OwnedStream`'s): tch's operations and
/// allocations on that device go to it. Restores the previous one on drop.
/// Guards nest like `torch.cuda.stream(...)`: drop them in reverse order, on
/// the thread that made them.
pub struct StreamGuard {
    guard: *mut c_void,
}

impl StreamGuard {
    pub fn new(stream: StreamHandle, device: i32) -> Result<Self> {
        let mut guard = std::ptr::null_mut();
        // SAFETY: as above; the guard is deleted once, in drop.
        let code = unsafe {
            aoti_torch_create_cuda_stream_guard(stream.0 as *mut c_void, device, &mut guard)
        };
        check("aoti_torch_create_cuda_stream_guard", code)?;
        Ok(Self { guard })
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        // SAFETY: made in new(), deleted once.
        unsafe {
            aoti_torch_delete_cuda_stream_guard(self.guard);
        }
    }
}
