// Allreduce kernels (docs/design-allreduce.md). Three families, each
// instantiated for every (dtype, op, accumulation) variant below:
//
//   oneshot_ll  every rank writes its whole input as LL16 packets into slot
//               [rank] of every peer's LL region, then reduces all R copies
//               locally (smallest sizes: one NVLink crossing, no barrier).
//   twoshot_ll  reduce-scatter + all-gather with LL16 packets: slice p of the
//               input goes to rank p (region A), rank p reduces it and sends
//               the result to every rank (region B).
//   rsag        read-reduce-scatter + all-gather over mapped buffers: each rank
//               reads its 1/R slice from every peer's buffer, reduces it and
//               stores the result into every peer's result region (or its
//               registered output), between two per-block barriers. The buffers
//               read are the scratch's data region (input copied in, results
//               copied out: algorithm "rsag") or the users' registered tensors
//               themselves ("rsag_zc", zero copy).
//               With kFlagPush ("rsag_push") the reduce-scatter moves by stores
//               instead: each rank stores slice p of its input into rank p's
//               scratch (slot [rank]), and rank p reduces from local memory.
//
// Every element is reduced in rank order 0..R-1 in the accumulation type, so
// all ranks agree bit for bit. LL regions alternate between two halves by the
// parity of the device call counter, and the flag changes every call, so no
// buffer is ever reset (see ll_begin).
#include "coll_common.cuh"

namespace moelink::coll {

template <typename T, typename Acc, int Op>
__device__ __forceinline__ void oneshot_ll(const CollArgs& a) {
  const LlCall call = ll_begin(a);
  const int R = a.num_ranks, rank = a.rank;
  const uint64_t n = a.nbytes;
  const uint64_t P = ceil_div(n, 8);  // packets per rank
  const uint64_t slot = P * 16;       // bytes of one rank's packets
  const bool aligned = a.flags & kFlagAligned;
  const uint64_t tid = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t nth = uint64_t(gridDim.x) * blockDim.x;
  const uint64_t mine = call.region + uint64_t(rank) * slot;

  for (uint64_t i = tid; i < P; i += nth) {
    const uint64_t v = load8(a.input, i * 8, n, aligned);
    for (int k = 1; k < R; ++k) ll_write(a.peer_scratch[rotate(rank, k, R)] + mine + i * 16, v, call.flag);
  }

  comm::WaitClock clock(a.timeout_ns);
  bool ok = true;
  const char* inbox = a.scratch + call.region;
  for (uint64_t i = tid; i < P; i += nth) {
    Pack<T, Acc, Op, 8> acc;
    for (int p = 0; p < R; ++p) {
      const uint64_t v = p == rank ? load8(a.input, i * 8, n, aligned)
                                   : ll_read(inbox + uint64_t(p) * slot + i * 16, call.flag, a, p,
                                             i, clock, ok);
      acc.add(v, p == 0);
    }
    store8(a.output, i * 8, n, acc.template result<uint64_t>(), aligned);
  }
  ll_end(a);
}

template <typename T, typename Acc, int Op>
__device__ __forceinline__ void twoshot_ll(const CollArgs& a) {
  const LlCall call = ll_begin(a);
  const int R = a.num_ranks, rank = a.rank;
  const uint64_t n = a.nbytes;
  const uint64_t S = round_up(ceil_div(n, R), 8);  // slice bytes (whole elements: 8 | S)
  const uint64_t Ps = S / 8;                       // packets per slice
  const uint64_t slot = Ps * 16;
  const uint64_t region_a = call.region;                          // [R sources][slot]
  const uint64_t region_b = call.region + uint64_t(R) * slot;     // [R owners][slot]
  const bool aligned = a.flags & kFlagAligned;  // input/output 8-aligned; slices start at 8k
  const uint64_t tid = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t nth = uint64_t(gridDim.x) * blockDim.x;
  const uint64_t work = uint64_t(R - 1) * Ps;  // (peer, packet) pairs

  // Reduce-scatter, send: slice p of our input to its owner p, slot [rank].
  for (uint64_t j = tid; j < work; j += nth) {
    const int p = rotate(rank, 1 + int(j / Ps), R);
    const uint64_t i = j % Ps;
    const uint64_t len = slice_len(n, S, p);
    if (i * 8 < len) {
      const uint64_t v = load8(a.input + uint64_t(p) * S, i * 8, len, aligned);
      ll_write(a.peer_scratch[p] + region_a + uint64_t(rank) * slot + i * 16, v, call.flag);
    }
  }

  // Reduce our slice; the result goes to our output and to every peer (slot [rank] of B).
  comm::WaitClock clock(a.timeout_ns);
  bool ok = true;
  const uint64_t own = slice_len(n, S, rank);
  const uint64_t own_packets = ceil_div(own, 8);
  const char* in_a = a.scratch + region_a;
  const char* own_in = a.input + uint64_t(rank) * S;
  char* own_out = a.output + uint64_t(rank) * S;
  for (uint64_t i = tid; i < own_packets; i += nth) {
    Pack<T, Acc, Op, 8> acc;
    for (int p = 0; p < R; ++p) {
      const uint64_t v = p == rank ? load8(own_in, i * 8, own, aligned)
                                   : ll_read(in_a + uint64_t(p) * slot + i * 16, call.flag, a, p,
                                             i, clock, ok);
      acc.add(v, p == 0);
    }
    const uint64_t r = acc.template result<uint64_t>();
    store8(own_out, i * 8, own, r, aligned);
    for (int k = 1; k < R; ++k)
      ll_write(a.peer_scratch[rotate(rank, k, R)] + region_b + uint64_t(rank) * slot + i * 16, r,
               call.flag);
  }

  // All-gather, receive: the owners' reduced slices into our output.
  const char* in_b = a.scratch + region_b;
  for (uint64_t j = tid; j < work; j += nth) {
    const int p = rotate(rank, 1 + int(j / Ps), R);
    const uint64_t i = j % Ps;
    const uint64_t len = slice_len(n, S, p);
    if (i * 8 < len) {
      const uint64_t v =
          ll_read(in_b + uint64_t(p) * slot + i * 16, call.flag, a, p, Ps + i, clock, ok);
      store8(a.output + uint64_t(p) * S, i * 8, len, v, aligned);
    }
  }
  ll_end(a);
}

// Reduces bytes [begin, end) of the buffers in peer_in (rank order) and stores
// the result at the same offset of every non-null buffer in peer_out. One block.
template <typename T, typename Acc, int Op>
__device__ __forceinline__ void reduce_range(const CollArgs& a, uint64_t begin, uint64_t end) {
  const int R = a.num_ranks, rank = a.rank;
  uint64_t scalar_begin = begin;
  if (a.flags & kFlagAligned) {
    const uint64_t vend = begin + (end - begin) / 16 * 16;
    for (uint64_t o = begin + uint64_t(threadIdx.x) * 16; o < vend;
         o += uint64_t(blockDim.x) * 16) {
      uint4 v[kMaxRanks];
#pragma unroll
      for (int p = 0; p < kMaxRanks; ++p) {
        if (p < R) {
          const uint4* src = reinterpret_cast<const uint4*>(a.peer_in[p] + o);
          v[p] = p == rank ? *src : ld_cg(src);
        } else {
          v[p] = make_uint4(0, 0, 0, 0);
        }
      }
      Pack<T, Acc, Op, 16> acc;
      acc.init(v[0]);
#pragma unroll
      for (int p = 1; p < kMaxRanks; ++p)
        if (p < R) acc.add(v[p]);
      const uint4 r = acc.template result<uint4>();
#pragma unroll
      for (int k = 0; k < kMaxRanks; ++k) {
        if (k < R) {
          char* dst = a.peer_out[rotate(rank, k, R)];
          if (dst != nullptr) *reinterpret_cast<uint4*>(dst + o) = r;
        }
      }
    }
    scalar_begin = vend;
  }
  // Elements one at a time: the tail, or everything when a pointer is not 16-aligned.
  using B = typename Bits<int(sizeof(T))>::type;
  for (uint64_t o = scalar_begin + uint64_t(threadIdx.x) * sizeof(T); o < end;
       o += uint64_t(blockDim.x) * sizeof(T)) {
    Pack<T, Acc, Op, int(sizeof(T))> acc;
    for (int p = 0; p < R; ++p) {
      const B* src = reinterpret_cast<const B*>(a.peer_in[p] + o);
      const B x = p == rank ? *src : ld_cg(src);
      acc.add(x, p == 0);
    }
    const B r = acc.template result<B>();
    for (int k = 0; k < R; ++k) {
      char* dst = a.peer_out[rotate(rank, k, R)];
      if (dst != nullptr) *reinterpret_cast<B*>(dst + o) = r;
    }
  }
}

struct CopyRange {
  char* dst;
  const char* src;
  uint64_t bytes;
};

// Copies this block's part of every peer's slice s (rotate(rank, k, R), k =
// 1..R-1): range_of(s, off, len) gives the copy of `len` bytes from slice
// offset `off` (the input's offset of that part). With every pointer 16-aligned
// (kFlagAligned; slices and parts start at multiples of 16) three peers' ranges
// go at once, 16-byte words by copy_ranges16, any bytes past the last whole
// word one by one; otherwise each range by block_copy, one after another.
// kCg: the sources are read past L1.
template <bool kCg, typename RangeOf>
__device__ __forceinline__ void for_peer_groups(const CollArgs& a, uint64_t C, uint64_t lo,
                                                RangeOf range_of) {
  const int R = a.num_ranks, rank = a.rank;
  const uint64_t S = round_up(ceil_div(a.nbytes, R), 16);
  if (!(a.flags & kFlagAligned)) {
    for (int k = 1; k < R; ++k) {
      const int s = rotate(rank, k, R);
      const uint64_t len = slice_len(a.nbytes, S, s);
      if (lo < len) {
        const CopyRange r = range_of(s, uint64_t(s) * S + lo, len - lo < C ? len - lo : C);
        block_copy<kCg>(r.dst, r.src, r.bytes);
      }
    }
    return;
  }
  constexpr int kGroup = 3;
  for (int k0 = 1; k0 < R; k0 += kGroup) {
    char* dst[kGroup];
    const char* src[kGroup];
    uint64_t words[kGroup], bytes[kGroup];
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      const int k = k0 + g;
      const int s = k < R ? rotate(rank, k, R) : rank;
      const uint64_t len = slice_len(a.nbytes, S, s);
      bytes[g] = 0;
      dst[g] = nullptr;
      src[g] = nullptr;
      if (k < R && lo < len) {
        const CopyRange r = range_of(s, uint64_t(s) * S + lo, len - lo < C ? len - lo : C);
        dst[g] = r.dst;
        src[g] = r.src;
        bytes[g] = r.bytes;
      }
      words[g] = bytes[g] / 16;
    }
    copy_ranges16<kCg, kGroup>(dst, src, words);
#pragma unroll
    for (int g = 0; g < kGroup; ++g)
      for (uint64_t i = words[g] * 16 + threadIdx.x; i < bytes[g]; i += blockDim.x)
        dst[g][i] = ld<kCg>(reinterpret_cast<const unsigned char*>(src[g]) + i);
  }
}

// Block b owns bytes [b*C, (b+1)*C) of every slice, in every phase: the data
// it copies in, reads from the peers (after they copied it in: block b of each
// peer signalled), and copies out (after block b of each peer stored into it).
template <typename T, typename Acc, int Op>
__device__ __forceinline__ void rsag(const CollArgs& a) {
  const int R = a.num_ranks, rank = a.rank;
  const uint64_t n = a.nbytes;
  const uint64_t S = round_up(ceil_div(n, R), 16);
  const uint64_t C = round_up(ceil_div(S, gridDim.x), 16);
  const uint64_t lo = uint64_t(blockIdx.x) * C;
  char* data = a.scratch + a.data_offset;

  if (a.flags & kFlagPush) {
    // Reduce-scatter by stores: our part of slice p goes to slot [rank] of p's
    // data region (p reads it from local memory after the barrier).
    for_peer_groups<false>(a, C, lo, [&](int p, uint64_t off, uint64_t len) {
      return CopyRange{a.peer_scratch[p] + a.data_offset + uint64_t(rank) * S + lo, a.input + off,
                       len};
    });
  } else if (a.flags & kFlagCopyIn) {
    for (int k = 1; k < R; ++k) {
      const int s = rotate(rank, k, R);
      const uint64_t len = slice_len(n, S, s);
      if (lo < len) {
        const uint64_t off = uint64_t(s) * S + lo;
        block_copy<false>(data + off, a.input + off, len - lo < C ? len - lo : C);
      }
    }
  }
  block_barrier(a);
  {
    const uint64_t len = slice_len(n, S, rank);
    if (lo < len) {
      const uint64_t off = uint64_t(rank) * S + lo;
      reduce_range<T, Acc, Op>(a, off, off + (len - lo < C ? len - lo : C));
    }
  }
  block_barrier(a);
  if (a.flags & kFlagCopyOut) {
    if (a.test_delay_us > 0) delay_block(a.test_delay_us);
    // The owners stored their results into our result region. Never the data
    // region: a peer's next call may store into it before its first barrier
    // (push, copy-in) while we still copy out.
    for_peer_groups<true>(a, C, lo, [&](int, uint64_t off, uint64_t len) {
      return CopyRange{a.output + off, a.scratch + a.result_offset + off, len};
    });
  }
}

}  // namespace moelink::coll

// Variants: (suffix, element type, accumulation type, operator). The Rust
// kernel table (collectives::module::VARIANTS) lists the same suffixes in the
// same order; a CPU test compares the two.
#define MOELINK_AR_VARIANTS(X, family)                        \
  X(family, bf16_sum, __nv_bfloat16, float, kSum)             \
  X(family, bf16_min, __nv_bfloat16, float, kMin)             \
  X(family, bf16_max, __nv_bfloat16, float, kMax)             \
  X(family, fp16_sum, __half, float, kSum)                    \
  X(family, fp16_min, __half, float, kMin)                    \
  X(family, fp16_max, __half, float, kMax)                    \
  X(family, fp32_sum, float, float, kSum)                     \
  X(family, fp32_min, float, float, kMin)                     \
  X(family, fp32_max, float, float, kMax)                     \
  X(family, int32_sum, int, int, kSum)                        \
  X(family, int32_min, int, int, kMin)                        \
  X(family, int32_max, int, int, kMax)                        \
  X(family, fp8e4m3_sum_acc16, __nv_fp8_e4m3, __half, kSum)   \
  X(family, fp8e4m3_sum_acc32, __nv_fp8_e4m3, float, kSum)    \
  X(family, fp8e4m3_min, __nv_fp8_e4m3, float, kMin)          \
  X(family, fp8e4m3_max, __nv_fp8_e4m3, float, kMax)          \
  X(family, fp8e5m2_sum_acc16, __nv_fp8_e5m2, __half, kSum)   \
  X(family, fp8e5m2_sum_acc32, __nv_fp8_e5m2, float, kSum)    \
  X(family, fp8e5m2_min, __nv_fp8_e5m2, float, kMin)          \
  X(family, fp8e5m2_max, __nv_fp8_e5m2, float, kMax)

#define MOELINK_AR_KERNEL(family, suffix, T, Acc, Op)                                        \
  extern "C" __global__ void __launch_bounds__(1024)                                         \
      ar_##family##_##suffix(const __grid_constant__ moelink::coll::CollArgs a) {            \
    moelink::coll::family<T, Acc, moelink::coll::Op>(a);                                      \
  }

MOELINK_AR_VARIANTS(MOELINK_AR_KERNEL, oneshot_ll)
MOELINK_AR_VARIANTS(MOELINK_AR_KERNEL, twoshot_ll)
MOELINK_AR_VARIANTS(MOELINK_AR_KERNEL, rsag)
