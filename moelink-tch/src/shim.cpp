// moelink-tch's C++ shim (compiled by build.rs against the headers of the
// torch that torch-sys links): what neither tch nor libtorch's C entry points
// (stream.rs) expose, as plain C functions. Every function catches C++
// exceptions and returns their message (free it with moelink_tch_free_error).
//
// - torch's CUDA graph (at::cuda::CUDAGraph, what torch.cuda.CUDAGraph wraps):
//   capture on torch's current stream with the caching allocator's private
//   pool for the capture's allocations, replay on the current stream.
// - Tensor.record_stream on an external stream (a comm::OwnedStream).
//
// Only symbols of libtorch_cpu, libtorch_cuda and libc10_cuda are used (no
// CUDA runtime call of our own: the binary links no libcudart).

#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdlib>
#include <cstring>
#include <exception>

namespace {

char* message(const char* what) {
  char* m = strdup(what ? what : "unknown C++ exception");
  return m;
}

template <typename F>
int guarded(char** err, F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    *err = message(e.what());
  } catch (...) {
    *err = message(nullptr);
  }
  return 1;
}

at::cuda::CUDAGraph* graph(void* g) { return static_cast<at::cuda::CUDAGraph*>(g); }

}  // namespace

extern "C" {

void moelink_tch_free_error(char* err) { free(err); }

int moelink_tch_graph_new(void** out, char** err) {
  return guarded(err, [&] { *out = new at::cuda::CUDAGraph(false); });
}

// Starts capturing torch's current stream (it must not be the default
// stream); relaxed: cudaStreamCaptureModeRelaxed, else Global (torch's default).
int moelink_tch_graph_capture_begin(void* g, int relaxed, char** err) {
  return guarded(err, [&] {
    graph(g)->capture_begin(
        {0, 0}, relaxed ? cudaStreamCaptureModeRelaxed : cudaStreamCaptureModeGlobal);
  });
}

int moelink_tch_graph_capture_end(void* g, char** err) {
  return guarded(err, [&] { graph(g)->capture_end(); });
}

int moelink_tch_graph_replay(void* g, char** err) {
  return guarded(err, [&] { graph(g)->replay(); });
}

void moelink_tch_graph_delete(void* g) {
  try {
    delete graph(g);
  } catch (...) {
  }
}

// tensor->record_stream(stream): the caching allocator does not hand the
// tensor's memory out again before the work issued to `stream` so far is done.
int moelink_tch_record_stream(void* tensor, void* stream, int device, char** err) {
  return guarded(err, [&] {
    auto s = c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream),
                                              static_cast<c10::DeviceIndex>(device));
    static_cast<at::Tensor*>(tensor)->record_stream(s.unwrap());
  });
}

}  // extern "C"
