// Kernels the transports launch themselves: remote atomics. A CUDA
// IPC connection's proxy launches these on its stream so an atomic_add from a
// port channel is a real atomic on the target GPU's memory (over NVLink),
// ordered after the puts issued before it on the same stream.
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

