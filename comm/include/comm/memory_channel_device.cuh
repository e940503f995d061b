// Memory channel: this GPU loads from and stores to a peer's registered memory
// mapped into its address space (NVLink), and synchronises through a
// device-to-device semaphore. No CPU involvement.
#pragma once

#include "copy_device.cuh"
#include "packet_device.cuh"
#include "semaphore_device.cuh"

namespace comm {

struct MemoryChannelDeviceHandle {
  SemaphoreDeviceHandle semaphore;  // device-to-device (remote_inbound mapped over NVLink)
  char* dst;                        // the peer's registered memory, mapped here; written/read here
  char* src;                        // this GPU's registered memory
  char* packets;                    // this GPU's memory that the peer writes packets into

#if defined(__CUDACC__)
  // Cooperative copy of `bytes` from src + src_offset to the peer's dst + dst_offset.
  __device__ __forceinline__ void put(uint64_t dst_offset, uint64_t src_offset, uint64_t bytes,
                                      size_t tid, size_t nthreads) {
    copy(dst + dst_offset, src + src_offset, bytes, tid, nthreads);
  }
  // Cooperative copy of `bytes` from the peer's dst + dst_offset to src + src_offset.
  __device__ __forceinline__ void get(uint64_t dst_offset, uint64_t src_offset, uint64_t bytes,
                                      size_t tid, size_t nthreads) {
    copy(src + src_offset, dst + dst_offset, bytes, tid, nthreads);
  }

  // Packs src + src_offset into packets at the peer's dst + dst_offset (the
  // packet region takes 2x `bytes`).
  template <typename Packet>
  __device__ __forceinline__ void put_packets(uint64_t dst_offset, uint64_t src_offset,
                                              uint64_t bytes, uint32_t flag, size_t tid,
                                              size_t nthreads) {
    comm::put_packets(reinterpret_cast<Packet*>(dst + dst_offset), src + src_offset, bytes, flag,
                      tid, nthreads);
  }
  // Waits for the packets the peer wrote at packets + packet_offset and unpacks
  // them into src + src_offset.
  template <typename Packet>
  __device__ __forceinline__ bool read_packets(uint64_t packet_offset, uint64_t src_offset,
                                               uint64_t bytes, uint32_t flag, size_t tid,
                                               size_t nthreads,
                                               int64_t timeout_ns = kDefaultTimeoutNs) {
    return comm::read_packets(src + src_offset,
                              reinterpret_cast<const Packet*>(packets + packet_offset), bytes,
                              flag, tid, nthreads, semaphore.error, semaphore.rank,
                              semaphore.peer, timeout_ns);
  }

  __device__ __forceinline__ void signal() { semaphore.signal(); }
  __device__ __forceinline__ void relaxed_signal() { semaphore.relaxed_signal(); }
  __device__ __forceinline__ bool wait(int64_t timeout_ns = kDefaultTimeoutNs) {
    return semaphore.wait(timeout_ns);
  }
  __device__ __forceinline__ bool poll() { return semaphore.poll(); }
#endif
};
static_assert(sizeof(MemoryChannelDeviceHandle) == 80, "mirrored in Rust");
static_assert(offsetof(MemoryChannelDeviceHandle, dst) == 56, "mirrored in Rust");
static_assert(offsetof(MemoryChannelDeviceHandle, packets) == 72, "mirrored in Rust");

}  // namespace comm
