//! Access to the CUDA driver: loading it (at run time, so nothing here needs a GPU
//! to build or to run CPU tests), binding a thread to a device's primary context
//! (the one torch uses), and small queries.

use std::sync::OnceLock;

use cudarc::driver::{result, sys, DriverError};

use crate::error::{CommError, CudaResultExt, Result};

/// Loads libcuda and runs `cuInit` once per process. Returns a clear error on a
/// machine without a driver instead of panicking inside cudarc's loader.
pub fn init_driver() -> Result<()> {
    static INIT: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: only probes whether the shared library can be opened.
        if !unsafe { sys::is_culib_present() } {
            return Err("libcuda.so could not be loaded (no NVIDIA driver on this machine)".into());
        }
        result::init().map_err(|e| format!("cuInit failed: {e}"))
    })
    .clone()
    .map_err(|reason| CommError::NoDriver { reason })
}

/// Logs a failed driver call `call` of a destructor (which has no caller to
/// return the error to).
pub(crate) fn warn_if_failed(call: &str, result: std::result::Result<(), DriverError>) {
    if let Err(e) = result {
        tracing::warn!("{call} failed: {e}");
    }
}

/// Lets the calling thread make CUDA calls while another thread of the process
/// captures a CUDA graph in the global mode (torch's default). The library's own
/// threads (proxies, transport receivers) never capture, and their calls touch
/// only their own streams and memory; in the default mode the driver refuses
/// them during such a capture (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, e.g. a
/// receiver's `cuStreamQuery`) and invalidates the user's capture. Every thread
/// that the library starts and that calls CUDA runs this first
/// ([`Device::bind_library_thread`]).
pub fn relax_capture_mode() -> Result<()> {
    init_driver()?;
    let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: `mode` is a valid in/out pointer for the call's duration.
    unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) }
        .result()
        .call("cuThreadExchangeStreamCaptureMode")
}

/// Number of visible CUDA devices; 0 when there is no driver or no device.
pub fn device_count() -> usize {
    if init_driver().is_err() {
        return 0;
    }
    result::device::get_count().map(|n| n as usize).unwrap_or(0)
}

/// A retained primary context of one device. Primary contexts are retained
/// once per process and kept for its lifetime, so binding is cheap and never
/// races with a release while torch or another thread still uses the context.
#[derive(Clone, Copy, Debug)]
pub struct Device {
    pub ordinal: i32,
    pub(crate) ctx: sys::CUcontext,
    /// The context is the proxy's own ([`Device::proxy_context`]), not the
    /// primary one (modules are loaded per context: see `module.rs`).
    pub(crate) own: bool,
}

// SAFETY: a CUcontext handle may be made current on any thread.
unsafe impl Send for Device {}
// SAFETY: see above; the handle itself is immutable.
unsafe impl Sync for Device {}

const MAX_DEVICES: usize = 64;

impl Device {
    /// The device `ordinal`, with its primary context made current on this thread.
    pub fn bind(ordinal: i32) -> Result<Device> {
        let dev = Self::get(ordinal)?;
        dev.make_current()?;
        Ok(dev)
    }

    /// The device `ordinal` without touching this thread's current context.
    pub fn get(ordinal: i32) -> Result<Device> {
        init_driver()?;
        let count = device_count();
        if ordinal < 0 || ordinal as usize >= count.min(MAX_DEVICES) {
            return Err(CommError::invalid(
                "device",
                format!("device {ordinal} does not exist ({count} visible)"),
            ));
        }
        static CTXS: [OnceLock<usize>; MAX_DEVICES] = [const { OnceLock::new() }; MAX_DEVICES];
        let slot = &CTXS[ordinal as usize];
        if let Some(ctx) = slot.get() {
            return Ok(Device {
                ordinal,
                ctx: *ctx as sys::CUcontext,
                own: false,
            });
        }
        let cu_dev = result::device::get(ordinal).call("cuDeviceGet")?;
        // SAFETY: cu_dev was returned by cuDeviceGet. The retained reference is
        // intentionally kept for the life of the process (see type docs).
        let ctx =
            unsafe { result::primary_ctx::retain(cu_dev) }.call("cuDevicePrimaryCtxRetain")?;
        let ctx = *slot.get_or_init(|| ctx as usize);
        Ok(Device {
            ordinal,
            ctx: ctx as sys::CUcontext,
            own: false,
        })
    }

    /// This device with a context of its own for the CUDA IPC proxy's work
    /// (the default; `MOELINK_IPC_CONTEXT=primary` does without it): one per
    /// device and process, kept for its life, made without changing this
    /// thread's current context.
    ///
    /// Why: while a CUDA call of the process waits on the GPU inside the
    /// primary context (a pageable host-to-device copy on a stream ordered
    /// after a running kernel syncs that stream first), copies and kernels
    /// other threads issue in that context do not reach the GPU, the proxy's
    /// included; a kernel waiting for them then spins out its time bound
    /// (the internode stall of docs/design-internode.md). Another context's work goes through. Only memory mapped
    /// through the VMM API and portable host memory are addressable from
    /// both contexts.
    pub fn proxy_context(&self) -> Result<Device> {
        static CTXS: [OnceLock<usize>; MAX_DEVICES] = [const { OnceLock::new() }; MAX_DEVICES];
        let slot = &CTXS[self.ordinal as usize];
        let ctx = match slot.get() {
            Some(c) => *c,
            None => {
                let cu_dev = result::device::get(self.ordinal).call("cuDeviceGet")?;
                let mut ctx: sys::CUcontext = std::ptr::null_mut();
                // SAFETY: cu_dev is valid; no creation parameters. The new
                // context is pushed on this thread's stack and popped below.
                unsafe { sys::cuCtxCreate_v4(&mut ctx, std::ptr::null_mut(), 0, cu_dev) }
                    .result()
                    .call("cuCtxCreate")?;
                let mut popped: sys::CUcontext = std::ptr::null_mut();
                // SAFETY: pops the context just pushed (the previous current
                // context, if any, becomes current again).
                unsafe { sys::cuCtxPopCurrent_v2(&mut popped) }
                    .result()
                    .call("cuCtxPopCurrent")?;
                let kept = *slot.get_or_init(|| ctx as usize);
                if kept != ctx as usize {
                    // Another thread made one first: keep one per device.
                    // SAFETY: ours, never made current nor used.
                    let _ = unsafe { sys::cuCtxDestroy_v2(ctx) };
                }
                kept
            }
        };
        Ok(Device {
            ordinal: self.ordinal,
            ctx: ctx as sys::CUcontext,
            own: true,
        })
    }

    /// Whether this is a [`proxy_context`](Self::proxy_context) device.
    pub fn is_proxy_context(&self) -> bool {
        self.own
    }

    /// The device to issue a proxy's GPU work on (`what`, for the warning):
    /// for memory mapped process-wide (`process_wide`: cuMem or host memory,
    /// [`MemoryInfo::process_wide`]) the [`proxy_context`](Self::proxy_context)
    /// where wanted ([`proxy_context_wanted`]) and it can be made; else this
    /// (primary) one. A failure is warned about once per device and not retried.
    ///
    /// [`MemoryInfo::process_wide`]: crate::registered_memory::MemoryInfo::process_wide
    pub fn proxy_context_or_primary(&self, process_wide: bool, what: &str) -> Device {
        use std::sync::atomic::{AtomicBool, Ordering};
        static FAILED: [AtomicBool; MAX_DEVICES] = [const { AtomicBool::new(false) }; MAX_DEVICES];
        let failed = &FAILED[self.ordinal as usize];
        if !process_wide || !proxy_context_wanted() || failed.load(Ordering::Acquire) {
            return *self;
        }
        match self.proxy_context() {
            Ok(own) => own,
            Err(e) => {
                if !failed.swap(true, Ordering::AcqRel) {
                    tracing::warn!(
                        "{e}; {what} go on GPU {}'s primary context (a CUDA call of this \
                         process that waits on the GPU can then hold them back)",
                        self.ordinal
                    );
                }
                *self
            }
        }
    }

    /// The start of a thread the library owns that calls CUDA (a proxy, a
    /// transport's receiver): makes this device's context current and relaxes
    /// the thread's stream-capture mode ([`relax_capture_mode`]; its failure is
    /// logged, not raised: the thread still works, only a user's concurrent
    /// capture may then be refused). Returns `make_current`'s result.
    pub fn bind_library_thread(&self, thread: &str) -> Result<()> {
        let bound = self.make_current();
        if let Err(e) = relax_capture_mode() {
            tracing::warn!("{thread}: cannot relax the stream-capture mode: {e}");
        }
        bound
    }

    /// Make this device's context current on the calling thread: the primary
    /// one, or for a [`proxy_context`](Self::proxy_context) device the
    /// proxy's (then restore the caller's afterwards: [`RestoreCurrent`]).
    pub fn make_current(&self) -> Result<()> {
        // SAFETY: ctx is a retained primary context, or the proxy's, neither
        // ever released.
        unsafe { result::ctx::set_current(self.ctx) }.call("cuCtxSetCurrent")
    }

    pub fn name(&self) -> Result<String> {
        let cu_dev = result::device::get(self.ordinal).call("cuDeviceGet")?;
        result::device::get_name(cu_dev).call("cuDeviceGetName")
    }

    pub fn attribute(&self, attr: sys::CUdevice_attribute) -> Result<i32> {
        let cu_dev = result::device::get(self.ordinal).call("cuDeviceGet")?;
        // SAFETY: cu_dev is valid; attr is a driver enum value.
        unsafe { result::device::get_attribute(cu_dev, attr) }.call("cuDeviceGetAttribute")
    }

    /// (major, minor) compute capability.
    pub fn compute_capability(&self) -> Result<(i32, i32)> {
        use sys::CUdevice_attribute::*;
        Ok((
            self.attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            self.attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ))
    }

    pub fn sm_count(&self) -> Result<i32> {
        self.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
    }

    /// The device's UUID (the same in every process that sees the device).
    pub fn uuid(&self) -> Result<[u8; 16]> {
        let cu_dev = result::device::get(self.ordinal).call("cuDeviceGet")?;
        let u = result::device::get_uuid(cu_dev).call("cuDeviceGetUuid")?;
        Ok(u.bytes.map(|b| b as u8))
    }

    /// A dma-buf file descriptor of device memory `[ptr, ptr + len)` (what an
    /// RDMA NIC registers with `ibv_reg_dmabuf_mr`; docs/ib.md). `ptr` and `len`
    /// must be multiples of the host page size; `InvalidArgument("device")`
    /// where the driver or device has no dma-buf support.
    pub fn dmabuf_fd(&self, ptr: u64, len: usize) -> Result<std::os::fd::OwnedFd> {
        use std::os::fd::FromRawFd;
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
        if len == 0 || ptr % page != 0 || len as u64 % page != 0 {
            return Err(CommError::invalid(
                "range",
                format!("[{ptr:#x}, +{len}) is not a non-empty range of whole {page}-byte pages"),
            ));
        }
        if self.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)? == 0 {
            return Err(CommError::invalid(
                "device",
                format!("GPU {} (or its driver) cannot export dma-buf", self.ordinal),
            ));
        }
        self.make_current()?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: `fd` is the out-parameter the call writes an int into; the
        // range was checked above and belongs to the caller.
        unsafe {
            sys::cuMemGetHandleForAddressRange(
                (&mut fd as *mut std::ffi::c_int).cast(),
                ptr,
                len,
                sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        }
        .result()
        .call("cuMemGetHandleForAddressRange")?;
        // SAFETY: the driver returned a new descriptor that we now own.
        Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
    }

    /// Whether this device can access the memory of the device with UUID
    /// `uuid` (P2P over NVLink or PCIe); false where no visible device has it.
    pub fn can_access_peer_uuid(&self, uuid: &[u8; 16]) -> Result<bool> {
        let me = result::device::get(self.ordinal).call("cuDeviceGet")?;
        for i in 0..result::device::get_count().call("cuDeviceGetCount")? {
            let d = result::device::get(i).call("cuDeviceGet")?;
            let u = result::device::get_uuid(d).call("cuDeviceGetUuid")?;
            if u.bytes.map(|b| b as u8) != *uuid {
                continue;
            }
            if d == me {
                return Ok(true);
            }
            let mut can = 0i32;
            // SAFETY: both handles come from cuDeviceGet; `can` is an out-parameter.
            unsafe { sys::cuDeviceCanAccessPeer(&mut can, me, d) }
                .result()
                .call("cuDeviceCanAccessPeer")?;
            return Ok(can != 0);
        }
        Ok(false)
    }

    /// SMs this process's context of the device may use where the driver
    /// limits them (an MPS client with `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`);
    /// `None` where the driver does not say.
    pub fn context_sm_count(&self) -> Result<Option<u32>> {
        self.make_current()?;
        // SAFETY: a zeroed param struct is a valid out-parameter; the current
        // context is this device's retained primary context.
        let mut p: sys::CUexecAffinityParam = unsafe { std::mem::zeroed() };
        let r = unsafe {
            sys::cuCtxGetExecAffinity(
                &mut p,
                sys::CUexecAffinityType::CU_EXEC_AFFINITY_TYPE_SM_COUNT,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Ok(None);
        }
        // SAFETY: the SM-count type fills the smCount member of the union.
        let n = unsafe { p.param.smCount.val };
        Ok((n > 0).then_some(n))
    }

    /// (free, total) bytes of device memory, as the driver reports them.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.make_current()?;
        result::mem_get_info().call("cuMemGetInfo")
    }

    /// Blocks until all work on the device's primary context is done.
    pub fn synchronize(&self) -> Result<()> {
        self.make_current()?;
        result::ctx::synchronize().call("cuCtxSynchronize")
    }

    /// Sets `len` bytes at device address `ptr` to `value`; complete on return.
    /// (cuMemsetD8 may return before the device has finished, and kernels on
    /// non-blocking streams do not wait for the legacy stream, so this
    /// synchronises the context.)
    ///
    /// # Safety
    /// `ptr..ptr + len` must be device memory mapped in this device's context.
    pub unsafe fn memset_sync(&self, ptr: u64, len: usize, value: u8) -> Result<()> {
        self.make_current()?;
        // SAFETY: the caller's contract.
        unsafe { result::memset_d8_sync(ptr, value, len) }.call("cuMemsetD8")?;
        self.synchronize()
    }
}

/// Whether the proxies issue their GPU work (CUDA IPC puts, Ethernet's copies
/// out of and into GPU memory) in a context of their own
/// ([`Device::proxy_context`], the default) for memory mapped process-wide.
/// `MOELINK_IPC_CONTEXT=primary` keeps all of it in the primary context.
pub fn proxy_context_wanted() -> bool {
    crate::env::var("MOELINK_IPC_CONTEXT").is_none_or(|v| v != "primary")
}

/// Puts back, when dropped, the context that was current on the calling
/// thread when it was made. Work in the proxy's own context
/// ([`Device::proxy_context`]) done from a caller's thread (creating or
/// dropping its stream, a hang report's stream query) must not leave that
/// context current there: torch's next runtime call would issue into it.
pub struct RestoreCurrent(sys::CUcontext);

impl RestoreCurrent {
    pub fn new() -> Result<Self> {
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes the calling thread's current context (or null).
        unsafe { sys::cuCtxGetCurrent(&mut ctx) }
            .result()
            .call("cuCtxGetCurrent")?;
        Ok(Self(ctx))
    }
}

impl Drop for RestoreCurrent {
    fn drop(&mut self) {
        // SAFETY: a context that was current on this thread (moelink never
        // releases its contexts, and a caller's is alive while current), or
        // null: then none is current again, as before.
        let _ = unsafe { sys::cuCtxSetCurrent(self.0) };
    }
}

/// A raw CUDA stream handle passed in by a caller (torch's `cuda_stream`).
/// 0 is the legacy default stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamHandle(pub usize);

impl StreamHandle {
    pub fn raw(self) -> sys::CUstream {
        self.0 as sys::CUstream
    }

    pub fn synchronize(self) -> Result<()> {
        // SAFETY: the caller guarantees the handle is a live stream of the current context.
        unsafe { result::stream::synchronize(self.raw()) }.call("cuStreamSynchronize")
    }

    /// Enqueues a copy of `len` bytes from device address `src` to `dst` on
    /// the stream (`cuMemcpyAsync`; between two addresses of one device the
    /// driver runs it on SMs, measured on H200); a copy node when
    /// the stream is capturing.
    ///
    /// # Safety
    /// Both ranges are device memory mapped in the stream's context, live
    /// until the copy ran, and do not overlap.
    pub unsafe fn copy_async(self, dst: u64, src: u64, len: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { sys::cuMemcpyAsync(dst, src, len, self.raw()) }
            .result()
            .call("cuMemcpyAsync")
    }

    /// Sets `len` bytes from `dst` to zero on the stream
    /// (`cuMemsetD8Async`; a memset node when the stream is capturing).
    ///
    /// # Safety
    /// The range is device memory mapped in the stream's context, live until
    /// the memset ran.
    pub unsafe fn zero_async(self, dst: u64, len: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { sys::cuMemsetD8Async(dst, 0, len, self.raw()) }
            .result()
            .call("cuMemsetD8Async")
    }
}

/// The answer of a query that never waits (`cuStreamQuery`, `cuEventQuery`,
/// named by `call`): whether the work asked about has completed; "not ready"
/// is an answer, not an error.
fn completed(r: sys::CUresult, call: &'static str) -> Result<bool> {
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        e => Err(CommError::Cuda {
            call,
            source: cudarc::driver::DriverError(e),
        }),
    }
}

/// A CUDA stream this crate created (non-blocking w.r.t. the legacy stream),
/// destroyed on drop.
#[derive(Debug)]
pub struct OwnedStream {
    device: Device,
    stream: sys::CUstream,
}

// SAFETY: stream handles are context-global and usable from any thread.
unsafe impl Send for OwnedStream {}
// SAFETY: as above; the handle is never mutated.
unsafe impl Sync for OwnedStream {}

impl OwnedStream {
    pub fn new(device: Device) -> Result<Self> {
        device.make_current()?;
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
            .call("cuStreamCreate")?;
        Ok(Self { device, stream })
    }

    pub fn handle(&self) -> StreamHandle {
        StreamHandle(self.stream as usize)
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// Whether work issued to the stream has not completed yet (never waits).
    pub fn is_busy(&self) -> Result<bool> {
        self.device.make_current()?;
        self.query_busy()
    }

    /// `is_busy` with the device's context already current on this thread.
    fn query_busy(&self) -> Result<bool> {
        // SAFETY: the stream is live for the life of self.
        let done = completed(unsafe { sys::cuStreamQuery(self.stream) }, "cuStreamQuery")?;
        Ok(!done)
    }

    /// Waits until the stream's work is done, polling at most `timeout`.
    pub fn synchronize_bounded(
        &self,
        timeout: std::time::Duration,
        rank: i64,
        what: &str,
    ) -> Result<()> {
        self.device.make_current()?;
        let start = std::time::Instant::now();
        loop {
            if !self.query_busy()? {
                return Ok(());
            }
            if start.elapsed() > timeout {
                return Err(CommError::Timeout {
                    rank,
                    what: what.to_string(),
                    waited_ms: start.elapsed().as_millis() as u64,
                });
            }
            std::thread::yield_now();
        }
    }
}

impl Drop for OwnedStream {
    fn drop(&mut self) {
        if self.device.make_current().is_ok() {
            // SAFETY: created in new(), destroyed once; pending work completes first.
            unsafe {
                let _ = result::stream::synchronize(self.stream);
                let _ = result::stream::destroy(self.stream);
            }
        }
    }
}

/// Orders one caller stream after another without a host wait: one reusable
/// event (no timing), recorded on the stream to wait for and waited on by the
/// other. What `torch.cuda.Stream.wait_stream` does, from raw handles and
/// without creating an event per call (also inside CUDA-graph capture, where
/// the pair becomes a graph edge).
#[derive(Debug)]
pub struct StreamOrder {
    // An `Event` is exactly the record/wait pair, and dropping it while a
    // wait on it is pending is fine (the driver defers the release).
    event: Event,
}

impl StreamOrder {
    pub fn new(device: Device) -> Result<Self> {
        Ok(Self {
            event: Event::new(device)?,
        })
    }

    /// Work issued to `waiter` from now on starts after everything issued to
    /// `signaler` so far.
    pub fn after(&self, waiter: StreamHandle, signaler: StreamHandle) -> Result<()> {
        // Two calls at once could interleave their records and waits on the
        // one event: callers order their own calls (one Buffer's calls come
        // from one thread).
        self.event.record(signaler)?;
        self.event.wait(waiter)
    }
}

impl StreamHandle {
    /// Whether a CUDA-graph capture is active on this stream (what
    /// `torch.cuda.is_current_stream_capturing()` asks of torch's current
    /// stream). Legal during a capture.
    pub fn is_capturing(self) -> Result<bool> {
        // SAFETY: the caller guarantees the handle is a live stream of the
        // current context (0: the legacy stream).
        let status =
            unsafe { result::stream::is_capturing(self.raw()) }.call("cuStreamIsCapturing")?;
        Ok(status == sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE)
    }
}

/// A CUDA event of one device (no timing), destroyed on drop: what a
/// `torch.cuda.Event()` is, from the driver, for callers without torch's
/// Python objects (the Rust API's `EventOverlap`). Recording it inside a
/// CUDA-graph capture makes it a graph node that a wait joins.
#[derive(Debug)]
pub struct Event {
    device: Device,
    event: sys::CUevent,
}

// SAFETY: event handles are context-global and usable from any thread.
unsafe impl Send for Event {}
// SAFETY: as above; every method is a single driver call on the handle.
unsafe impl Sync for Event {}

impl Event {
    pub fn new(device: Device) -> Result<Self> {
        device.make_current()?;
        let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .call("cuEventCreate")?;
        Ok(Self { device, event })
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// Captures the work issued to `stream` so far.
    pub fn record(&self, stream: StreamHandle) -> Result<()> {
        self.device.make_current()?;
        // SAFETY: the event lives as long as self; the stream is the caller's
        // live stream of this device.
        unsafe { result::event::record(self.event, stream.raw()) }.call("cuEventRecord")
    }

    /// Work issued to `stream` from now on starts after the recorded work
    /// (the stream may be of another device: the driver allows it).
    pub fn wait(&self, stream: StreamHandle) -> Result<()> {
        // SAFETY: as in record.
        unsafe {
            result::stream::wait_event(
                stream.raw(),
                self.event,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .call("cuStreamWaitEvent")
    }

    /// Whether the recorded work has completed (never waits).
    pub fn query(&self) -> Result<bool> {
        self.device.make_current()?;
        // SAFETY: the event lives as long as self.
        completed(unsafe { sys::cuEventQuery(self.event) }, "cuEventQuery")
    }

    /// Waits on the host for the recorded work.
    pub fn synchronize(&self) -> Result<()> {
        self.device.make_current()?;
        // SAFETY: the event lives as long as self.
        unsafe { result::event::synchronize(self.event) }.call("cuEventSynchronize")
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.device.make_current().is_ok() {
            // SAFETY: created in new(), destroyed once; the driver releases a
            // pending event once its work completes.
            unsafe {
                let _ = result::event::destroy(self.event);
            }
        }
    }
}
