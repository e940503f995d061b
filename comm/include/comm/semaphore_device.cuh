// Semaphores: monotonic 64-bit counters. A signal adds one to the peer's
// `inbound` counter; a wait expects its `inbound` to reach one more than the
// previous wait did (the n-th wait returns once the n-th signal arrived).
// Counters are never reset (slots are not reused).
//
// Device-to-device (memory channels): the signalling GPU adds to the peer's
// `inbound` directly over NVLink (`remote_inbound`) with one fire-and-forget
// reduction (`red.add`), so a signal needs no local counter and no load: it is
// one posted remote operation. Host-to-device (port channels): a CPU proxy
// writes `inbound` through a connection; `remote_inbound` is null and signals
// go through the FIFO instead.
#pragma once

#include "common_device.cuh"

namespace comm {

struct SemaphoreDeviceHandle {
  uint64_t* inbound;           // written by the peer (GPU or proxy), read here: this GPU's memory,
                               // or (CUDA IPC port channels) shared host memory the peer's proxy
                               // stores into from its CPU
  uint64_t* expected_inbound;  // this GPU's memory; read/written only here (waits done so far)
  uint64_t* reserved;          // unused (was the local count of signals sent); kept for the layout
  uint64_t* remote_inbound;    // the peer's `inbound` mapped here (device-to-device), else null
  DeviceError* error;          // host-mapped; written here on timeout, read by the host
  int32_t rank;                // this rank (for error reports)
  int32_t peer;                // the peer this semaphore pairs with
  uint64_t id;                 // identifies the semaphore in error reports (and for the proxy)

#if defined(__CUDACC__)
  // Signals the peer: every write this thread made before (and, by the
  // release's cumulativity, every write it observed, e.g. its block's writes
  // before a __syncthreads) is visible to the peer once its acquire sees the
  // new counter value. One release reduction on the peer's counter: the same
  // ordering as the release store it replaces, without reading or writing a
  // local counter first. Being an atomic add, concurrent signals from several
  // threads are counted exactly (one thread per semaphore is still the usage).
  __device__ __forceinline__ void signal() { red_add_release_sys(remote_inbound, 1); }

  // As signal(), without ordering earlier writes (for pure synchronisation).
  __device__ __forceinline__ void relaxed_signal() { red_add_relaxed_sys(remote_inbound, 1); }

  // True (and the wait counted) if the peer's next signal has arrived.
  __device__ __forceinline__ bool poll() {
    const uint64_t want = *expected_inbound + 1;
    if (load_acquire_sys(inbound) < want) return false;
    *expected_inbound = want;
    return true;
  }

  // Waits for the peer's next signal, at most `timeout_ns` of GPU time. On
  // timeout it records the failure in `error` (rank, peer, id, expected,
  // observed), still counts the wait, and returns false. One thread calls it.
  __device__ __forceinline__ bool wait(int64_t timeout_ns = kDefaultTimeoutNs) {
    const uint64_t want = *expected_inbound + 1;
    *expected_inbound = want;
    bool ok;
    // Acquire loads while polling. (Measured on 4 x H200: relaxed polling plus
    // one fence.acq_rel.sys after it raised the memory-channel round trip from
    // 3.0 to 4.2 us; the system-scope fence costs more than acquire loads.)
    const uint64_t seen = spin_until([&] { return load_acquire_sys(inbound); },
                                     [&](uint64_t v) { return v >= want; }, timeout_ns, ok);
    if (!ok) report_error(error, kErrorTimeout, kWaitSemaphore, rank, peer, id, want, seen);
    return ok;
  }
#endif
};
static_assert(sizeof(SemaphoreDeviceHandle) == 56, "mirrored in Rust");
static_assert(offsetof(SemaphoreDeviceHandle, reserved) == 16, "mirrored in Rust");
static_assert(offsetof(SemaphoreDeviceHandle, error) == 32, "mirrored in Rust");
static_assert(offsetof(SemaphoreDeviceHandle, id) == 48, "mirrored in Rust");

}  // namespace comm
