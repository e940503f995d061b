// Kernels the transports launch themselves: remote atomics, and copies. A CUDA
// IPC connection's proxy launches these on its stream so an atomic_add from a
// port channel is a real atomic on the target GPU's memory (over NVLink),
// ordered after the puts issued before it on the same stream; with
// MOELINK_IPC_COPY=kernel its puts are comm_copy launches instead of
// copy-engine transfers.
#include <cstddef>
#include <cstdint>

// The argument block of both kernels, mirrored in Rust (comm::kernels).
struct AtomicParams {
  uint64_t target;  // the word's address (64-bit: 8-aligned, 32-bit: 4-aligned)
  int64_t value;    // the 32-bit kernel adds its low 32 bits
};
static_assert(sizeof(AtomicParams) == 16, "mirrored in Rust");

extern "C" __global__ void comm_atomic_add64(const __grid_constant__ AtomicParams a) {
  atomicAdd(reinterpret_cast<unsigned long long*>(a.target), static_cast<unsigned long long>(a.value));
  __threadfence_system();
}

extern "C" __global__ void comm_atomic_add32(const __grid_constant__ AtomicParams a) {
  atomicAdd(reinterpret_cast<unsigned int*>(a.target),
            static_cast<unsigned int>(static_cast<int32_t>(a.value)));
  __threadfence_system();
}

// The argument block of comm_copy, mirrored in Rust (comm::kernels).
struct CopyParams {
  uint64_t dst;    // device or peer-mapped address
  uint64_t src;    // device address of this GPU
  uint64_t bytes;
};
static_assert(sizeof(CopyParams) == 24, "mirrored in Rust");

// Copies `bytes` from src to dst, grid-stride: 16-byte vectors where dst and src
// agree modulo 16 (bytes before and after), else byte by byte. Source loads go
// through L2 (the bytes were written by another kernel that may still run), and
// every thread fences at system scope before the kernel ends, so a signal
// ordered after the launch on the stream (or a CPU store made once the stream
// is idle) follows the data.
extern "C" __global__ void comm_copy(const __grid_constant__ CopyParams a) {
  const uint64_t tid = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t n = uint64_t(gridDim.x) * blockDim.x;
  char* d = reinterpret_cast<char*>(a.dst);
  const char* s = reinterpret_cast<const char*>(a.src);
  uint64_t head = a.bytes, body = 0;
  if (((a.dst ^ a.src) & 15) == 0) {
    head = (16 - (a.dst & 15)) & 15;
    if (head > a.bytes) head = a.bytes;
    body = (a.bytes - head) / 16;
  }
  for (uint64_t i = tid; i < head; i += n) d[i] = __ldcg(s + i);
  int4* dv = reinterpret_cast<int4*>(d + head);
  const int4* sv = reinterpret_cast<const int4*>(s + head);
  for (uint64_t i = tid; i < body; i += n) dv[i] = __ldcg(sv + i);
  for (uint64_t i = head + body * 16 + tid; i < a.bytes; i += n) d[i] = __ldcg(s + i);
  __threadfence_system();
}
