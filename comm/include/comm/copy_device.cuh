// Copy helpers shared by all moelink kernels: vectorised, coalesced loops over
// a range, executed cooperatively by `nthreads` threads (a warp, a block, a
// grid); thread `tid` handles elements tid, tid + nthreads, ...
#pragma once

#include <cstddef>
#include <cstdint>

namespace comm {

#if defined(__CUDACC__)

// Stores `n` 64-bit words produced by `gen(i)` into `dst`.
template <typename Gen>
__device__ __forceinline__ void store_words(uint64_t* dst, size_t n, size_t tid, size_t nthreads,
                                            Gen gen) {
  for (size_t i = tid; i < n; i += nthreads) dst[i] = gen(i);
}

template <typename T>
__device__ __forceinline__ void copy_elems(char* dst, const char* src, size_t n, size_t tid,
                                           size_t nthreads) {
  auto* d = reinterpret_cast<T*>(dst);
  const auto* s = reinterpret_cast<const T*>(src);
  for (size_t i = tid; i < n; i += nthreads) d[i] = s[i];
}

// Copies `bytes` from `src` to `dst` with the widest access both pointers and
// the length allow (16, 8, 4 bytes, else single bytes).
__device__ __forceinline__ void copy(void* dst, const void* src, size_t bytes, size_t tid,
                                     size_t nthreads) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  const uintptr_t a = reinterpret_cast<uintptr_t>(d) | reinterpret_cast<uintptr_t>(s) | bytes;
  if (a % 16 == 0) return copy_elems<int4>(d, s, bytes / 16, tid, nthreads);
  if (a % 8 == 0) return copy_elems<uint64_t>(d, s, bytes / 8, tid, nthreads);
  if (a % 4 == 0) return copy_elems<uint32_t>(d, s, bytes / 4, tid, nthreads);
  // Same misalignment on both sides: bytes up to a 16-byte boundary, then vectors.
  const uintptr_t dm = reinterpret_cast<uintptr_t>(d) % 16, sm = reinterpret_cast<uintptr_t>(s) % 16;
  if (dm == sm && bytes >= 32) {
    const size_t head = (16 - dm) % 16;
    const size_t body = (bytes - head) / 16 * 16;
    copy_elems<char>(d, s, head, tid, nthreads);
    copy_elems<int4>(d + head, s + head, body / 16, tid, nthreads);
    copy_elems<char>(d + head + body, s + head + body, bytes - head - body, tid, nthreads);
    return;
  }
  copy_elems<char>(d, s, bytes, tid, nthreads);
}

// A 16-byte load of data that is complete before the kernel (`Fresh` false:
// through the non-coherent path, not kept in L1: inputs, a peer's finished
// records) or that peers write during it (`Fresh`: at L2, never from L1).
template <bool Fresh>
__device__ __forceinline__ int4 ld_vec(const int4* p) {
  int4 v;
  if constexpr (Fresh)
    asm volatile("ld.global.cg.v4.s32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
  else
    asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
  return v;
}
// The two by name: data complete before the kernel, data peers write during it.
__device__ __forceinline__ int4 ld_nc(const int4* p) { return ld_vec<false>(p); }
__device__ __forceinline__ int4 ld_cg(const int4* p) { return ld_vec<true>(p); }

// 16-byte store that does not allocate in L1.
__device__ __forceinline__ void st_na(int4* p, const int4& v) {
  asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

// Warp copy of `bytes` (a multiple of 16, 16-byte aligned pointers) through
// ld_vec<Fresh> / st_na, four vectors per lane in flight.
template <bool Fresh = false>
__device__ __forceinline__ void warp_copy16(char* dst, const char* src, int64_t bytes, int lane) {
  const int4* s = reinterpret_cast<const int4*>(src);
  int4* d = reinterpret_cast<int4*>(dst);
  const int64_t n = bytes / 16;
  constexpr int kUnroll = 4;
  int64_t i = lane;
  for (; i + 32 * (kUnroll - 1) < n; i += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = ld_vec<Fresh>(s + i + 32 * u);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) st_na(d + i + 32 * u, v[u]);
  }
  for (; i < n; i += 32) st_na(d + i, ld_vec<Fresh>(s + i));
}

#endif  // __CUDACC__

}  // namespace comm
