//! [`CudaGraph`]: torch's CUDA graph (`at::cuda::CUDAGraph`, what
//! `torch.cuda.CUDAGraph` / `torch.cuda.graph(g)` use in Python) from Rust,
//! through this crate's C++ shim (`src/shim.cpp`; tch does not expose
//! graphs). A capture runs on a side stream made torch's current stream, so
//! the Buffer's and AllReduce's calls (which read torch's current stream) and
//! tch's operations are captured, and torch's caching allocator serves the
//! capture's allocations from the graph's private pool, as in Python:
//! tensors made during the capture stay valid for replays while they are
//! alive.

use std::ffi::{c_char, c_void};

use comm::OwnedStream;
use tch::Device;

use crate::error::Result;
use crate::group::CudaDevice;
use crate::stream::{current_stream, shim_result, StreamGuard};

extern "C" {
    fn moelink_tch_graph_new(out: *mut *mut c_void, err: *mut *mut c_char) -> i32;
    fn moelink_tch_graph_capture_begin(g: *mut c_void, relaxed: i32, err: *mut *mut c_char) -> i32;
    fn moelink_tch_graph_capture_end(g: *mut c_void, err: *mut *mut c_char) -> i32;
    fn moelink_tch_graph_replay(g: *mut c_void, err: *mut *mut c_char) -> i32;
    fn moelink_tch_graph_delete(g: *mut c_void);
}

/// A captured CUDA graph of one device; [`replay`](Self::replay) launches it
/// on torch's current stream. Dropping it frees the graph (and its private
/// memory pool once no tensor made during the capture is alive).
pub struct CudaGraph {
    raw: *mut c_void,
    // The stream the capture ran on (torch's graph remembers it): dropped
    // after the graph.
    _stream: OwnedStream,
}

impl std::fmt::Debug for CudaGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaGraph").finish_non_exhaustive()
    }
}

impl CudaGraph {
    /// Captures what `f` issues on CUDA device `device` (torch's
    /// `with torch.cuda.graph(g):` on a side stream, capture mode global):
    /// the side stream first waits for the current stream; during `f` it is
    /// torch's current stream. Returns the graph and `f`'s result (the
    /// tensors it made: keep them, the replays write them). The capture is
    /// ended even where `f` fails (its error is returned). Nothing captured
    /// runs before the first replay.
    pub fn capture<T>(device: Device, f: impl FnOnce() -> Result<T>) -> Result<(Self, T)> {
        let cuda = CudaDevice::bind(device, "a CUDA graph")?;
        let (dev, core) = (cuda.index, cuda.core);
        let side = OwnedStream::new(core)?;
        let order = comm::cuda::StreamOrder::new(core)?;
        let compute = current_stream(dev)?;
        order.after(side.handle(), compute)?;
        let mut raw = std::ptr::null_mut();
        let mut err = std::ptr::null_mut();
        // SAFETY: a plain C call writing one pointer (or an error message).
        let code = unsafe { moelink_tch_graph_new(&mut raw, &mut err) };
        shim_result("CUDAGraph()", code, err)?;
        let graph = CudaGraph { raw, _stream: side };
        let result = {
            let _guard = StreamGuard::new(graph._stream.handle(), dev)?;
            let mut err = std::ptr::null_mut();
            // SAFETY: raw is a live graph; the current stream is the side stream.
            let code = unsafe { moelink_tch_graph_capture_begin(graph.raw, 0, &mut err) };
            shim_result("CUDAGraph.capture_begin", code, err)?;
            let result = f();
            let mut err = std::ptr::null_mut();
            // SAFETY: as above, on the stream the capture began on.
            let code = unsafe { moelink_tch_graph_capture_end(graph.raw, &mut err) };
            let ended = shim_result("CUDAGraph.capture_end", code, err);
            let value = result?;
            ended?;
            value
        };
        order.after(compute, graph._stream.handle())?;
        Ok((graph, result))
    }

    /// Launches the graph on torch's current stream.
    pub fn replay(&self) -> Result<()> {
        let mut err = std::ptr::null_mut();
        // SAFETY: raw is a live, captured graph.
        let code = unsafe { moelink_tch_graph_replay(self.raw, &mut err) };
        shim_result("CUDAGraph.replay", code, err)
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        // SAFETY: made in capture(), deleted once.
        unsafe { moelink_tch_graph_delete(self.raw) }
    }
}
