// Shared device-side basics of comm: the error record a bounded wait fills in
// when it runs out, memory-order helpers, the GPU clock, and the spin loop
// every wait uses (bounded by time, so that time-slicing between contexts
// neither trips a wait early nor holds it past its bound).
//
// Structs here are plain data for the host compiler (Rust mirrors them with
// #[repr(C)]; sizes and offsets are asserted on both sides and by a GPU test);
// methods exist only under __CUDACC__.
#pragma once

#include <cstddef>
#include <cstdint>

namespace comm {

// Codes of DeviceError::code.
enum : uint32_t { kErrorNone = 0, kErrorTimeout = 1, kErrorInvalid = 2 };
// What a timed-out wait was waiting for (DeviceError::kind).
enum : uint32_t {
  kWaitSemaphore = 1,   // Semaphore::wait: the peer's signal
  kWaitFifoSpace = 2,   // Fifo::push: a free slot (the proxy is not popping)
  kWaitFifoDrain = 3,   // Fifo::sync: the proxy to process a trigger (flush)
  kWaitPacket = 4,      // packet read: the peer's packet with the expected flag
  kInvalidOffset = 5,   // a port-channel offset or size that does not fit a trigger
  kWaitLlDispatch = 6,  // low-latency dispatch: a source's data flag
  kWaitLlCombine = 7,   // low-latency combine: an expert rank's data flag
  kLlOverflow = 8,      // low-latency dispatch: more rows for a local expert than slots
  kInvalidExpertId = 9, // an expert id outside [-1, E): id = token << 8 | column
  kWaitIntranodeDispatch = 10,  // fused intranode dispatch: a record's flag (slot in id)
  kWaitIntranodeCombine = 11,   // fused intranode combine: a record's flag (slot in id)
  kWaitInternodeChunk = 12,     // internode: a chunk of a peer's cross-node stream (chunk in id)
  kWaitInternodeLocal = 13,     // internode: this rank's own warps to fill a chunk (node, chunk in id)
  kWaitInternodeForward = 14,   // internode combine: a same-node rank's row for the forwarder (token in id)
  kWaitInternodePoisoned = 15,  // internode combine: a partial its forwarder poisoned (node, slot in id)
  kWaitIntranodeGate = 16,      // fused intranode kernel: its block 0 to pass the barrier with the peers
};

// Bound of a wait whose caller passes none: 30 s of GPU time (shorter than the
// hosts' 60 s bounds, so the device's error, which names rank, peer and
// counter, is the one the user sees). Every bound is in nanoseconds.
constexpr int64_t kDefaultTimeoutNs = int64_t(30) * 1000 * 1000 * 1000;
// A wait reads the clock once every kPollsPerClockRead polls.
constexpr uint32_t kPollsPerClockRead = 16;

// The first failure of a kernel, in host-mapped memory: written once by the
// device (first writer wins), read by the host, which turns it into an error
// naming the rank and the object. Reset by the host.
struct DeviceError {
  uint32_t code;      // device writes (last, after the other fields); host reads / resets
  uint32_t kind;      // what was awaited (kWait*)
  int32_t rank;       // the rank whose GPU waited
  int32_t peer;       // the peer it waited on, -1 if none
  uint64_t id;        // the semaphore / channel / fifo id
  uint64_t expected;  // the value it waited for
  uint64_t observed;  // the last value it saw
};
static_assert(sizeof(DeviceError) == 40, "DeviceError layout is mirrored in Rust");
static_assert(offsetof(DeviceError, id) == 16, "DeviceError layout is mirrored in Rust");

#if defined(__CUDACC__)

// Set to 1 by the host at module load when MOELINK_TRAP_ON_TIMEOUT=1
// (comm::module): a wait that times out then traps its kernel after recording
// what it waited for. One copy per module (every crate compiles one unit).
// C linkage: the host finds it by this exact name (cuModuleGetGlobal); inside
// the namespace a C++ name would be mangled and the switch never found.
extern "C" {
__device__ int comm_trap_on_timeout;
}

__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t load_relaxed_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void store_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void store_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Fire-and-forget atomic adds (no value returned: the issuing thread does not
// wait for the target, which may be a peer's memory over NVLink).
__device__ __forceinline__ void red_add_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void red_add_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Records the first failure into `err` (if not null). Later failures are dropped.
__device__ __forceinline__ void report_error(DeviceError* err, uint32_t code, uint32_t kind,
                                             int32_t rank, int32_t peer, uint64_t id,
                                             uint64_t expected, uint64_t observed) {
  if (err == nullptr) return;
  // Claim the record with a sentinel, fill it, then publish the code.
  if (atomicCAS(reinterpret_cast<unsigned int*>(&err->code), kErrorNone, 0xFFFFFFFFu) !=
      kErrorNone)
    return;
  err->kind = kind;
  err->rank = rank;
  err->peer = peer;
  err->id = id;
  err->expected = expected;
  err->observed = observed;
  __threadfence_system();
  atomicExch(reinterpret_cast<unsigned int*>(&err->code), code);
  if (code == kErrorTimeout && *reinterpret_cast<volatile int*>(&comm_trap_on_timeout)) __trap();
}

// The last-block ticket: thread 0 of every block calls it once, after the
// block's writes are fenced. True in the last block of the grid to get here,
// which also resets the ticket to 0 for the next kernel (no block of this grid
// touches it after the last one has).
__device__ __forceinline__ bool last_block_ticket(unsigned int* ticket) {
  if (atomicAdd(ticket, 1u) != gridDim.x - 1) return false;
  *ticket = 0;
  return true;
}

// Nanoseconds of the GPU's global timer (%globaltimer: wall-clock time, so it
// advances while this context is switched out).
__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The time bound of one thread's waits: `timeout_ns` from the first poll that
// found nothing (the clock is not read while every poll succeeds). Either one
// wait's (spin_until) or a series' (a kernel's packet reads share one).
// expired() is called after each failed poll and reads the clock on the first
// call and then once every kPollsPerClockRead calls.
struct WaitClock {
  int64_t timeout_ns;
  uint64_t start = 0;
  uint32_t polls = 0;
  bool started = false;

  __device__ __forceinline__ explicit WaitClock(int64_t timeout) : timeout_ns(timeout) {}

  __device__ __forceinline__ bool expired() {
    if (polls++ % kPollsPerClockRead != 0) return false;
    const uint64_t t = now_ns();
    if (!started) {
      started = true;
      start = t;
      return false;
    }
    return int64_t(t - start) >= timeout_ns;
  }
};

// Spins until `done(observed)` holds for the value `load()` returns, for at
// most `timeout_ns` of GPU time after the first poll that failed. Returns the
// last observed value and sets `ok`. The caller reports a timeout with the
// context it has.
template <typename Load, typename Done>
__device__ __forceinline__ uint64_t spin_until(Load load, Done done, int64_t timeout_ns, bool& ok) {
  uint64_t v = load();
  WaitClock clock(timeout_ns);
  while (!done(v)) {
    if (clock.expired()) {
      ok = false;
      return v;
    }
    v = load();
  }
  ok = true;
  return v;
}

#endif  // __CUDACC__

}  // namespace comm
