// Port channel: the GPU asks a CPU proxy to move data to a peer (through the
// FIFO), and waits on a semaphore the peer's proxy updates (over CUDA IPC the
// counter is in shared host memory: the peer's proxy signals with a CPU store
// when nothing of its connection is in flight, else a stream write behind it).
// The proxy performs the operation on whatever connection links the two ranks
// (CUDA IPC copies on a proxy stream, Ethernet, IB verbs).
//
// Memory ids index the proxy's tables of registered memory: `dst_mem` a peer's
// memory, `src_mem` a local one. Offsets and sizes are 32-bit (< 4 GiB).
#pragma once

#include "fifo_device.cuh"
#include "semaphore_device.cuh"

namespace comm {

struct PortChannelDeviceHandle {
  FifoDeviceHandle fifo;             // the proxy's FIFO
  SemaphoreDeviceHandle semaphore;   // inbound written by the peer's proxy; signals go via fifo
  uint32_t channel;                  // this channel's id in the proxy (selects connection + semaphore)
  uint32_t dst_mem;                  // default destination memory id (the peer's buffer)
  uint32_t src_mem;                  // default source memory id (the local buffer)
  uint32_t pad_;

#if defined(__CUDACC__)
  __device__ __forceinline__ bool fits(uint64_t dst_offset, uint64_t src_offset, uint64_t size) {
    if (dst_offset <= kTriggerMaxOffset && src_offset <= kTriggerMaxOffset &&
        size <= kTriggerMaxOffset)
      return true;
    report_error(fifo.error, kErrorInvalid, kInvalidOffset, fifo.rank, semaphore.peer, channel,
                 kTriggerMaxOffset, dst_offset > src_offset ? dst_offset : src_offset);
    return false;
  }

  // Copies `size` bytes from local memory `src_mem` at `src_offset` to the
  // peer's `dst_mem` at `dst_offset`. Returns the FIFO position.
  __device__ __forceinline__ uint64_t put(uint32_t dmem, uint64_t dst_offset, uint32_t smem,
                                          uint64_t src_offset, uint64_t size) {
    if (!fits(dst_offset, src_offset, size)) return 0;
    return fifo.push(make_data_trigger(kTriggerData, channel, dmem, dst_offset, smem, src_offset, size));
  }
  __device__ __forceinline__ uint64_t put(uint64_t dst_offset, uint64_t src_offset, uint64_t size) {
    return put(dst_mem, dst_offset, src_mem, src_offset, size);
  }
  __device__ __forceinline__ uint64_t put(uint64_t offset, uint64_t size) {
    return put(dst_mem, offset, src_mem, offset, size);
  }

  // Increments the peer's semaphore after every earlier put of this channel landed.
  __device__ __forceinline__ uint64_t signal() {
    return fifo.push(make_data_trigger(kTriggerSignal, channel, dst_mem, 0, src_mem, 0, 0));
  }

  __device__ __forceinline__ uint64_t put_with_signal(uint64_t dst_offset, uint64_t src_offset,
                                                      uint64_t size) {
    if (!fits(dst_offset, src_offset, size)) return 0;
    return fifo.push(make_data_trigger(kTriggerData | kTriggerSignal, channel, dst_mem, dst_offset,
                                       src_mem, src_offset, size));
  }

  // put + signal, then waits until the proxy has completed both.
  __device__ __forceinline__ bool put_with_signal_and_flush(
      uint64_t dst_offset, uint64_t src_offset, uint64_t size,
      int64_t timeout_ns = kDefaultTimeoutNs) {
    if (!fits(dst_offset, src_offset, size)) return false;
    const uint64_t pos = fifo.push(make_data_trigger(kTriggerData | kTriggerSignal | kTriggerFlush,
                                                     channel, dst_mem, dst_offset, src_mem,
                                                     src_offset, size));
    return fifo.sync(pos, timeout_ns);
  }

  // Waits until every operation this channel pushed before has completed.
  __device__ __forceinline__ bool flush(int64_t timeout_ns = kDefaultTimeoutNs) {
    const uint64_t pos =
        fifo.push(make_data_trigger(kTriggerFlush, channel, dst_mem, 0, src_mem, 0, 0));
    return fifo.sync(pos, timeout_ns);
  }

  // Atomically adds `value` to the 64-bit (or 32-bit) integer at `dst_offset` of
  // the peer's `dst_mem`, performed as an atomic on the target.
  __device__ __forceinline__ uint64_t atomic_add(uint64_t dst_offset, int64_t value) {
    if (!fits(dst_offset, 0, 0)) return 0;
    return fifo.push(make_atomic_trigger(kTriggerAtomicAdd64, channel, dst_mem, dst_offset, value));
  }
  __device__ __forceinline__ uint64_t atomic_add32(uint64_t dst_offset, int32_t value) {
    if (!fits(dst_offset, 0, 0)) return 0;
    return fifo.push(make_atomic_trigger(kTriggerAtomicAdd32, channel, dst_mem, dst_offset, value));
  }

  __device__ __forceinline__ bool wait(int64_t timeout_ns = kDefaultTimeoutNs) {
    return semaphore.wait(timeout_ns);
  }
  __device__ __forceinline__ bool poll() { return semaphore.poll(); }
#endif
};
static_assert(sizeof(PortChannelDeviceHandle) == 128, "mirrored in Rust");
static_assert(offsetof(PortChannelDeviceHandle, semaphore) == 56, "mirrored in Rust");
static_assert(offsetof(PortChannelDeviceHandle, channel) == 112, "mirrored in Rust");

}  // namespace comm
