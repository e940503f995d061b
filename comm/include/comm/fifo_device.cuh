// FIFO of 16-byte triggers from GPU threads to a CPU proxy thread.
//
// The ring lives in host-mapped memory. A producer claims a slot with an atomic
// add on `head` (GPU memory), waits while the ring is full (bounded), writes
// `fst` then `snd` (release): a slot is full when its `snd` is non-zero (every
// trigger type is non-zero and lives in `snd`'s top bits). The proxy pops slots
// in order, clears them, and publishes how many it has finished in `tail`
// (host memory).
//
// Room check: `tail_replica` (GPU memory) is a lower bound of `tail` that the
// proxy refreshes with a stream write every quarter ring it pops (posted
// writes into GPU memory, no GPU read of host memory) and that producers raise
// with what they read from `tail`. A push compares with the replica only; only
// when the ring looks full does it wait, polling the replica and, every
// kHostTailPollEvery-th poll (the first included), the host `tail` itself (a
// PCIe read round trip), so progress never depends on the proxy's refresh.
// A push that times out (the proxy stopped popping) leaves its claimed slot
// unwritten, so the FIFO cannot make progress past it: such a timeout is
// fatal for the FIFO, and the error record says which rank and FIFO.
//
// Trigger layout (both words little-endian u64, packed with shifts):
//   data ops (put / signal / flush, any combination of the type bits):
//     fst = size (bits 0..32) | src_offset (bits 32..64)
//   atomic ops: fst = the value to add (two's complement)
//   snd = dst_offset (bits 0..32) | channel (bits 32..44) | src_mem (bits 44..52)
//         | dst_mem (bits 52..60) | type (bits 60..64)
#pragma once

#include "common_device.cuh"

namespace comm {

// Trigger types (snd bits 60..64). Data/signal/flush combine; atomics stand alone.
enum : uint64_t {
  kTriggerData = 1,
  kTriggerSignal = 2,
  kTriggerFlush = 4,
  kTriggerAtomicAdd64 = 8,
  kTriggerAtomicAdd32 = 9,
};
constexpr int kTriggerChannelBits = 12;
constexpr int kTriggerMemBits = 8;
constexpr uint64_t kTriggerMaxOffset = 0xFFFFFFFFull;  // offsets and sizes are 32-bit

struct ProxyTrigger {
  uint64_t fst;
  uint64_t snd;
};
static_assert(sizeof(ProxyTrigger) == 16, "mirrored in Rust");

__host__ __device__ __forceinline__ ProxyTrigger make_data_trigger(uint64_t type, uint32_t channel,
                                                                   uint32_t dst_mem,
                                                                   uint64_t dst_offset,
                                                                   uint32_t src_mem,
                                                                   uint64_t src_offset,
                                                                   uint64_t size) {
  ProxyTrigger t;
  t.fst = (size & 0xFFFFFFFFull) | ((src_offset & 0xFFFFFFFFull) << 32);
  t.snd = (dst_offset & 0xFFFFFFFFull) | (uint64_t(channel & 0xFFF) << 32) |
          (uint64_t(src_mem & 0xFF) << 44) | (uint64_t(dst_mem & 0xFF) << 52) | (type << 60);
  return t;
}

__host__ __device__ __forceinline__ ProxyTrigger make_atomic_trigger(uint64_t type,
                                                                     uint32_t channel,
                                                                     uint32_t dst_mem,
                                                                     uint64_t dst_offset,
                                                                     int64_t value) {
  ProxyTrigger t;
  t.fst = uint64_t(value);
  t.snd = (dst_offset & 0xFFFFFFFFull) | (uint64_t(channel & 0xFFF) << 32) |
          (uint64_t(dst_mem & 0xFF) << 52) | (type << 60);
  return t;
}

// While the ring looks full, one poll in this many reads the host `tail`
// (the others read the GPU replica).
constexpr uint32_t kHostTailPollEvery = 8;

#if defined(__CUDACC__)
__device__ __forceinline__ uint64_t load_relaxed_gpu(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
#endif

struct FifoDeviceHandle {
  ProxyTrigger* triggers;  // host-mapped ring of `size` slots; GPU writes, proxy reads and clears
  uint64_t* head;          // GPU memory; producers claim slots with atomicAdd; proxy never reads
  uint64_t* tail;          // host-mapped; proxy writes (slots finished), GPU reads
  uint64_t* tail_replica;  // GPU memory; a lower bound of `tail`: written by the proxy (stream
                           // write) and raised by producers (atomicMax of what they read)
  DeviceError* error;      // host-mapped; GPU writes on timeout, host reads
  int32_t size;            // slots in the ring
  int32_t rank;            // for error reports
  uint64_t id;             // which FIFO (proxy index), for error reports

#if defined(__CUDACC__)
  // Waits (at most `timeout_ns` of GPU time) until the ring has room for
  // position `pos` (claimed from `head`). False: timed out, reported.
  __device__ __forceinline__ bool wait_for_room(uint64_t pos, int64_t timeout_ns) {
    if (pos < uint64_t(size) + load_relaxed_gpu(tail_replica)) return true;
    bool ok;
    uint32_t polls = 0;
    bool from_host = false;
    const uint64_t seen = spin_until(
        [&] {
          from_host = polls++ % kHostTailPollEvery == 0;
          return from_host ? load_acquire_sys(tail) : load_relaxed_gpu(tail_replica);
        },
        [&](uint64_t v) { return pos < uint64_t(size) + v; }, timeout_ns, ok);
    if (!ok) {
      report_error(error, kErrorTimeout, kWaitFifoSpace, rank, -1, id, pos - size + 1, seen);
      return false;
    }
    if (from_host) atomicMax(reinterpret_cast<unsigned long long*>(tail_replica), seen);
    return true;
  }

  // Pushes a trigger; returns its position (for sync()). Waits (at most
  // `timeout_ns` of GPU time) while the ring is full. Any thread may call it;
  // each call claims its own slot.
  __device__ __forceinline__ uint64_t push(ProxyTrigger t,
                                          int64_t timeout_ns = kDefaultTimeoutNs) {
    const uint64_t pos = atomicAdd(reinterpret_cast<unsigned long long*>(head), 1ull);
    if (!wait_for_room(pos, timeout_ns)) return pos;  // dropped; the host reports the error
    ProxyTrigger* slot = &triggers[pos % uint64_t(size)];
    store_relaxed_sys(&slot->fst, t.fst);
    store_release_sys(&slot->snd, t.snd);
    return pos;
  }

  // Pushes t[0..n) from one thread into consecutive slots (the proxy performs
  // them in this order); returns the position of the last (for sync()). Per
  // batch of up to `size` triggers it pays once what push() pays per trigger:
  // one atomicAdd on `head`, one room check (for the batch's last position,
  // which implies room for the others) and one system-scope fence, between
  // all the `fst` stores and all the `snd` stores (the proxy reads a slot
  // once its `snd` is non-zero, so every `fst` of the batch is visible
  // before any `snd`). A timed-out wait drops the rest of the batch (fatal
  // for the FIFO, as for push()).
  __device__ __forceinline__ uint64_t push_batch(const ProxyTrigger* t, uint32_t n,
                                                int64_t timeout_ns = kDefaultTimeoutNs) {
    uint64_t last = 0;
    for (uint32_t done = 0; done < n;) {
      const uint32_t k = min(n - done, uint32_t(size));
      const uint64_t first = atomicAdd(reinterpret_cast<unsigned long long*>(head),
                                       static_cast<unsigned long long>(k));
      last = first + k - 1;
      if (!wait_for_room(last, timeout_ns)) return last;
      for (uint32_t j = 0; j < k; ++j)
        store_relaxed_sys(&triggers[(first + j) % uint64_t(size)].fst, t[done + j].fst);
      asm volatile("fence.acq_rel.sys;" ::: "memory");
      for (uint32_t j = 0; j < k; ++j)
        store_relaxed_sys(&triggers[(first + j) % uint64_t(size)].snd, t[done + j].snd);
      done += k;
    }
    return last;
  }

  // Waits (at most `timeout_ns` of GPU time) until the proxy has finished the
  // trigger at `pos`.
  __device__ __forceinline__ bool sync(uint64_t pos, int64_t timeout_ns = kDefaultTimeoutNs) {
    bool ok;
    const uint64_t seen = spin_until([&] { return load_acquire_sys(tail); },
                                     [&](uint64_t v) { return v > pos; }, timeout_ns, ok);
    if (!ok) report_error(error, kErrorTimeout, kWaitFifoDrain, rank, -1, id, pos + 1, seen);
    return ok;
  }
#endif
};
static_assert(sizeof(FifoDeviceHandle) == 56, "mirrored in Rust");
static_assert(offsetof(FifoDeviceHandle, size) == 40, "mirrored in Rust");

}  // namespace comm
