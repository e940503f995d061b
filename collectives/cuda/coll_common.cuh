// Shared device code of moelink's collectives (docs/design-allreduce.md):
//
// - `CollArgs`, the one argument block every collective kernel takes by value
//   (`__grid_constant__`, so its pointer tables are indexed in place); mirrored
//   in Rust (collectives::args::CollArgs), layout asserted on both sides and by
//   `coll_layout_probe`;
// - element types and reduction operators (`Pack`: a 4/8/16-byte vector of
//   elements reduced in an accumulation type, in rank order 0..R-1, so every
//   rank that reduces the same element computes the same bits);
// - tail-safe 8-byte loads/stores, LL16 packet writes and bounded reads;
// - the device-side LL call counter (one flag per call, CUDA-graph safe);
// - the per-block barrier over memory-channel semaphores.
//
// Every wait is bounded by `CollArgs::timeout_ns` of GPU time and reports into
// the communicator's host-mapped DeviceError record (rank, peer, what, values).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <comm/memory_channel_device.cuh>

namespace moelink::coll {

constexpr int kMaxRanks = 8;
// Blocks a barrier-synchronised kernel may use: the channel table holds one
// memory channel per (block, peer).
constexpr int kMaxBlocks = 128;

// CollArgs::flags
enum : int32_t {
  kFlagAligned = 1,  // every pointer the kernel vectorises over is aligned (8 B for LL, 16 B else)
  kFlagCopyIn = 2,   // rsag / ag_mesh: copy the input into this rank's scratch first
  kFlagCopyOut = 4,  // rsag family: copy the other ranks' result slices, which their owners
                     // stored into this rank's result region, to the output
  kFlagPush = 8,     // rsag_push: store the input slices into the owners' scratch (no copy-in)
};
// Reduction operators (template argument of the allreduce kernels).
enum : int { kSum = 0, kMin = 1, kMax = 2 };

// The argument block of every collective kernel. Pointers marked "mapped" are
// peers' memory mapped into this process (NVLink); `p == rank` entries are our own.
struct CollArgs {
  const char* input;                          // user input (device), read here
  char* output;                               // user output (device), written here (may == input)
  char* scratch;                              // this rank's registered scratch, base
  char* peer_scratch[kMaxRanks];              // every rank's scratch base, mapped (own: scratch)
  char* peer_in[kMaxRanks];                   // rsag/ag_mesh: where rank p's data is read from
  char* peer_out[kMaxRanks];                  // rsag: where rank p receives our result slice
  comm::MemoryChannelDeviceHandle* channels;  // [kMaxBlocks][num_ranks]; (b, rank) unused
  comm::DeviceError* error;                   // host-mapped; written on timeout
  unsigned long long* counter;                // LL calls so far (device; last block bumps it)
  unsigned int* ticket;                       // last-block ticket (device; 0 between kernels)
  uint64_t nbytes;                            // bytes per rank: allreduce message, allgather input
  uint64_t ll_offset;                         // LL region: two halves of ll_half_bytes
  uint64_t ll_half_bytes;
  uint64_t data_offset;                       // data region (copy-in of rsag / ag_mesh)
  uint64_t result_offset;                     // result region (rsag results, read by copy-out)
  int64_t timeout_ns;                         // bound of every wait, ns of GPU time (> 0)
  int32_t rank;
  int32_t num_ranks;
  int32_t flags;
  int32_t test_delay_us;                      // tests only: rsag blocks wait this long before
                                              // copying out (0: never)
};
static_assert(sizeof(CollArgs) == 312, "mirrored in Rust");
static_assert(offsetof(CollArgs, peer_scratch) == 24, "mirrored in Rust");
static_assert(offsetof(CollArgs, peer_in) == 88, "mirrored in Rust");
static_assert(offsetof(CollArgs, peer_out) == 152, "mirrored in Rust");
static_assert(offsetof(CollArgs, channels) == 216, "mirrored in Rust");
static_assert(offsetof(CollArgs, nbytes) == 248, "mirrored in Rust");
static_assert(offsetof(CollArgs, result_offset) == 280, "mirrored in Rust");
static_assert(offsetof(CollArgs, timeout_ns) == 288, "mirrored in Rust");
static_assert(offsetof(CollArgs, rank) == 296, "mirrored in Rust");
static_assert(offsetof(CollArgs, flags) == 304, "mirrored in Rust");

#if defined(__CUDACC__)

__host__ __device__ __forceinline__ uint64_t ceil_div(uint64_t a, uint64_t b) {
  return (a + b - 1) / b;
}
__host__ __device__ __forceinline__ uint64_t round_up(uint64_t a, uint64_t b) {
  return ceil_div(a, b) * b;
}
// Bytes of slice `s` when `n` bytes are cut into slices of `slice` bytes.
__device__ __forceinline__ uint64_t slice_len(uint64_t n, uint64_t slice, int s) {
  const uint64_t begin = uint64_t(s) * slice;
  return begin >= n ? 0 : (n - begin < slice ? n - begin : slice);
}
// (rank + k) mod R for 0 <= k < R: peers in an order that differs per rank.
__device__ __forceinline__ int rotate(int rank, int k, int R) {
  const int p = rank + k;
  return p >= R ? p - R : p;
}

// ---------------------------------------------------------------------------
// Element types, accumulation, operators
// ---------------------------------------------------------------------------

template <int Bytes>
struct Bits;
template <>
struct Bits<1> {
  using type = unsigned char;
};
template <>
struct Bits<2> {
  using type = unsigned short;
};
template <>
struct Bits<4> {
  using type = unsigned int;
};

// The (element, accumulator) pairs the kernels reduce in: bf16, fp16, fp32 and
// fp8 in float; fp8 also in half (the acc16 sums); int in int.
template <typename T>
constexpr bool kIsFp8 = std::is_same_v<T, __nv_fp8_e4m3> || std::is_same_v<T, __nv_fp8_e5m2>;
template <typename T, typename Acc>
constexpr bool kAccPair =
    std::is_same_v<Acc, float>
        ? std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half> ||
              std::is_same_v<T, float> || kIsFp8<T>
        : (std::is_same_v<Acc, __half> && kIsFp8<T>) ||
              (std::is_same_v<Acc, int> && std::is_same_v<T, int>);

// Both directions are the conversions the CUDA types define, one cast for
// every pair. Element -> accumulator widens exactly. Accumulator -> element
// rounds to nearest even (__float2bfloat16, __float2half); fp8 with satfinite
// (the fp8 constructors pass __NV_SATFINITE: values beyond the largest finite
// fp8 become that value, NaN stays NaN).
template <typename T, typename Acc>
__device__ __forceinline__ Acc to_acc(T x) {
  static_assert(kAccPair<T, Acc>, "not an accumulation type of this element type");
  return static_cast<Acc>(x);
}
template <typename T, typename Acc>
__device__ __forceinline__ T from_acc(Acc x) {
  static_assert(kAccPair<T, Acc>, "not an accumulation type of this element type");
  return static_cast<T>(x);
}

// a (op) b in the accumulation type; every operation rounds to nearest even.
template <int Op>
__device__ __forceinline__ float combine(float a, float b) {
  if constexpr (Op == kSum) return __fadd_rn(a, b);
  if constexpr (Op == kMin) return fminf(a, b);
  if constexpr (Op == kMax) return fmaxf(a, b);
}
template <int Op>
__device__ __forceinline__ __half combine(__half a, __half b) {
  if constexpr (Op == kSum) return __hadd(a, b);
  if constexpr (Op == kMin) return __hmin(a, b);
  if constexpr (Op == kMax) return __hmax(a, b);
}
template <int Op>
__device__ __forceinline__ int combine(int a, int b) {
  // Sums wrap around (two's complement), as integer tensors do.
  if constexpr (Op == kSum) return int(unsigned(a) + unsigned(b));
  if constexpr (Op == kMin) return a < b ? a : b;
  if constexpr (Op == kMax) return a > b ? a : b;
}

// W bytes of elements of T (W a multiple of sizeof(T)) reduced in Acc. Raw is
// the register type carrying the W bytes (an integer or a vector type).
template <typename T, typename Acc, int Op, int W>
struct Pack {
  static constexpr int N = W / int(sizeof(T));
  static_assert(N * int(sizeof(T)) == W, "pack width must hold whole elements");
  Acc acc[N];

  // The first value (`First`: acc = r) or the next one (acc = acc op r).
  template <bool First, typename Raw>
  __device__ __forceinline__ void take(const Raw& r) {
    static_assert(sizeof(Raw) == W, "raw width");
    T x[N];
    memcpy(x, &r, W);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      if constexpr (First) acc[j] = to_acc<T, Acc>(x[j]);
      else acc[j] = combine<Op>(acc[j], to_acc<T, Acc>(x[j]));
    }
  }
  template <typename Raw>
  __device__ __forceinline__ void init(const Raw& r) { take<true>(r); }
  template <typename Raw>
  __device__ __forceinline__ void add(const Raw& r) { take<false>(r); }
  // A value of a reduction in rank order: init for the first, add for the rest.
  template <typename Raw>
  __device__ __forceinline__ void add(const Raw& r, bool first) {
    if (first) {
      init(r);
    } else {
      add(r);
    }
  }
  template <typename Raw>
  __device__ __forceinline__ Raw result() const {
    static_assert(sizeof(Raw) == W, "raw width");
    T y[N];
#pragma unroll
    for (int j = 0; j < N; ++j) y[j] = from_acc<T, Acc>(acc[j]);
    Raw r;
    memcpy(&r, y, W);
    return r;
  }
};

// ---------------------------------------------------------------------------
// Loads and stores
// ---------------------------------------------------------------------------

// Bytes [off, off + 8) of `src` (n bytes long) as one word, zero-padded past n.
// Vector load when `aligned` (src 8-byte aligned) and the word is whole.
__device__ __forceinline__ uint64_t load8(const char* src, uint64_t off, uint64_t n, bool aligned) {
  if (aligned && off + 8 <= n) return *reinterpret_cast<const uint64_t*>(src + off);
  uint64_t v = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (off + j < n) v |= uint64_t(static_cast<unsigned char>(src[off + j])) << (8 * j);
  return v;
}

// Stores the bytes of `v` that fall inside [0, n) at dst + off.
__device__ __forceinline__ void store8(char* dst, uint64_t off, uint64_t n, uint64_t v,
                                       bool aligned) {
  if (aligned && off + 8 <= n) {
    *reinterpret_cast<uint64_t*>(dst + off) = v;
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (off + j < n) dst[off + j] = static_cast<char>(v >> (8 * j));
}

// L1-bypassing loads for data another GPU wrote (or may write) during this kernel.
__device__ __forceinline__ uint4 ld_cg(const uint4* p) { return __ldcg(p); }
__device__ __forceinline__ uint2 ld_cg(const uint2* p) { return __ldcg(p); }
__device__ __forceinline__ unsigned int ld_cg(const unsigned int* p) { return __ldcg(p); }
__device__ __forceinline__ unsigned short ld_cg(const unsigned short* p) { return __ldcg(p); }
__device__ __forceinline__ unsigned char ld_cg(const unsigned char* p) { return __ldcg(p); }

template <bool kCg, typename W>
__device__ __forceinline__ W ld(const W* p) {
  if constexpr (kCg) {
    return ld_cg(p);
  } else {
    return *p;
  }
}

// Block-cooperative copy of `bytes`, with the widest access both pointers
// allow; 4 words in flight per thread. kCg: the source is read past L1.
template <bool kCg, typename W>
__device__ __forceinline__ uint64_t copy_words(char* dst, const char* src, uint64_t bytes) {
  const uint64_t n = bytes / sizeof(W);
  const W* s = reinterpret_cast<const W*>(src);
  W* d = reinterpret_cast<W*>(dst);
  const uint64_t t = threadIdx.x, T = blockDim.x;
  uint64_t i = t;
  for (; i + 3 * T < n; i += 4 * T) {
    const W a = ld<kCg>(s + i), b = ld<kCg>(s + i + T), c = ld<kCg>(s + i + 2 * T),
            e = ld<kCg>(s + i + 3 * T);
    d[i] = a;
    d[i + T] = b;
    d[i + 2 * T] = c;
    d[i + 3 * T] = e;
  }
  for (; i < n; i += T) d[i] = ld<kCg>(s + i);
  return n * sizeof(W);
}

// Block-cooperative copy of kN ranges at once, 16-byte words (every pointer
// 16-aligned): range k is words[k] words from src[k] to dst[k]. Each thread
// loads its word of every range before it stores any, so the ranges' load
// latencies overlap instead of adding up as one block_copy after another
// would. kCg: the sources are read past L1.
template <bool kCg, int kN>
__device__ __forceinline__ void copy_ranges16(char* const (&dst)[kN], const char* const (&src)[kN],
                                              const uint64_t (&words)[kN]) {
  uint64_t most = 0;
#pragma unroll
  for (int k = 0; k < kN; ++k) most = words[k] > most ? words[k] : most;
  for (uint64_t i = threadIdx.x; i < most; i += blockDim.x) {
    uint4 v[kN];
#pragma unroll
    for (int k = 0; k < kN; ++k)
      if (i < words[k]) v[k] = ld<kCg>(reinterpret_cast<const uint4*>(src[k]) + i);
#pragma unroll
    for (int k = 0; k < kN; ++k)
      if (i < words[k]) reinterpret_cast<uint4*>(dst[k])[i] = v[k];
  }
}

template <bool kCg>
__device__ __forceinline__ void block_copy(char* dst, const char* src, uint64_t bytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src);
  uint64_t done;
  if (a % 16 == 0) {
    done = copy_words<kCg, uint4>(dst, src, bytes);
  } else if (a % 8 == 0) {
    done = copy_words<kCg, uint2>(dst, src, bytes);
  } else if (a % 4 == 0) {
    done = copy_words<kCg, unsigned int>(dst, src, bytes);
  } else if (a % 2 == 0) {
    done = copy_words<kCg, unsigned short>(dst, src, bytes);
  } else {
    done = 0;
  }
  const auto* s = reinterpret_cast<const unsigned char*>(src);
  auto* d = reinterpret_cast<unsigned char*>(dst);
  for (uint64_t i = done + threadIdx.x; i < bytes; i += blockDim.x) d[i] = ld<kCg>(s + i);
}

// ---------------------------------------------------------------------------
// LL16 packets and the per-call flag
// ---------------------------------------------------------------------------

// The flag of this LL call and where its half of the LL region starts.
struct LlCall {
  uint32_t flag;    // never 0 (the region starts zeroed)
  uint64_t region;  // byte offset in every rank's scratch
};

// Every block reads the device counter at its start; the last block to finish
// (ll_end) bumps it, so the next call (eager or a graph replay) gets the next
// flag and the other half of the region.
__device__ __forceinline__ LlCall ll_begin(const CollArgs& a) {
  const unsigned long long c = *reinterpret_cast<const volatile unsigned long long*>(a.counter);
  LlCall call;
  call.flag = uint32_t(c % 0xFFFFFFFFull) + 1u;
  call.region = a.ll_offset + (c & 1ull) * a.ll_half_bytes;
  return call;
}

__device__ __forceinline__ void ll_end(const CollArgs& a) {
  __syncthreads();
  if (threadIdx.x == 0 && comm::last_block_ticket(a.ticket)) *a.counter += 1ull;
}

// One 16-byte store: 8 data bytes and the flag twice, so a reader that sees
// both flags sees the data.
__device__ __forceinline__ void ll_write(char* dst, uint64_t v, uint32_t flag) {
  reinterpret_cast<comm::LL16Packet*>(dst)->write64(v, flag);
}

// Waits for the packet at `src` (written by rank `peer`) to carry `flag` and
// returns its data. `clock` is this thread's bound for the whole kernel
// (`a.timeout_ns` from its first poll that found nothing); when it runs out
// the failure is reported (rank, peer, packet index, expected and seen flag)
// and this thread stops waiting for the rest of the kernel (`ok` false), so
// the kernel still ends.
__device__ __forceinline__ uint64_t ll_read(const char* src, uint32_t flag, const CollArgs& a,
                                            int peer, uint64_t index, comm::WaitClock& clock,
                                            bool& ok) {
  const comm::LL16Packet* packet = reinterpret_cast<const comm::LL16Packet*>(src);
  uint32_t f0, f1;
  uint64_t v;
  for (;;) {
    v = packet->load(f0, f1);
    if (f0 == flag && f1 == flag) break;
    if (!ok) return 0;
    if (clock.expired()) {
      comm::report_error(a.error, comm::kErrorTimeout, comm::kWaitPacket, a.rank, peer, index,
                         flag, f0 != flag ? f0 : f1);
      ok = false;
      return 0;
    }
  }
  return v;
}

// ---------------------------------------------------------------------------
// Per-block barrier
// ---------------------------------------------------------------------------

// Block b of every rank meets block b of every peer: after a __syncthreads,
// one thread per peer signals the peer's semaphore of channel (b, peer) with a
// release that orders the block's earlier writes (local and remote), and waits
// for the peer's signal (bounded; a timeout is reported by the semaphore and
// the kernel carries on to its end).
// Tests only (CollArgs::test_delay_us): the block waits `us` microseconds of
// GPU time, so that its peers run ahead into their next call.
__device__ __forceinline__ void delay_block(int32_t us) {
  if (threadIdx.x == 0) {
    const uint64_t until = comm::now_ns() + uint64_t(us) * 1000;
    while (comm::now_ns() < until) {
    }
  }
  __syncthreads();
}

// No fence per thread: the signalling thread's release reduction is
// cumulative, so it orders every write of the block that the __syncthreads
// before it made visible to that thread (comm's SemaphoreDeviceHandle::signal).
__device__ __forceinline__ void block_barrier(const CollArgs& a) {
  __syncthreads();
  const int p = threadIdx.x;
  if (p < a.num_ranks && p != a.rank) {
    comm::MemoryChannelDeviceHandle& ch = a.channels[blockIdx.x * a.num_ranks + p];
    ch.signal();
    ch.wait(a.timeout_ns);
  }
  __syncthreads();
}

#endif  // __CUDACC__

}  // namespace moelink::coll
