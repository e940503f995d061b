// Kernels the transports launch themselves: remote atomics. A CUDA IPC
// connection's proxy launches these on its stream so an atomic_add from a port
// channel is a real atomic on the target GPU's memory (over NVLink), ordered
// after the puts issued before it on the same stream.
#include <cstdint>

extern "C" __global__ void comm_atomic_add64(unsigned long long* target, long long value) {
  atomicAdd(target, static_cast<unsigned long long>(value));
  __threadfence_system();
}

extern "C" __global__ void comm_atomic_add32(unsigned int* target, int value) {
  atomicAdd(target, static_cast<unsigned int>(value));
  __threadfence_system();
}
