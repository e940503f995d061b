// Copy helpers shared by all moelink kernels: vectorised, coalesced loops over
// a range, executed cooperatively by a group of threads (a warp, a block, a grid).
#pragma once

#include <cstddef>
#include <cstdint>

namespace comm {

#if defined(__CUDACC__)

// Stores `n` 64-bit words produced by `gen(i)` into `dst`, thread `tid` of
// `nthreads` cooperating threads (consecutive threads write consecutive words,
// so a warp's stores coalesce into full 256-byte lines, also over NVLink).
template <typename Gen>
__device__ __forceinline__ void store_words(uint64_t* dst, size_t n, size_t tid, size_t nthreads,
                                            Gen gen) {
  for (size_t i = tid; i < n; i += nthreads) dst[i] = gen(i);
}

// 16-byte copy of `bytes` (a multiple of 16, both pointers 16-byte aligned).
__device__ __forceinline__ void copy_16b(void* dst, const void* src, size_t bytes, size_t tid,
                                         size_t nthreads) {
  auto* d = reinterpret_cast<int4*>(dst);
  const auto* s = reinterpret_cast<const int4*>(src);
  const size_t n = bytes / sizeof(int4);
  for (size_t i = tid; i < n; i += nthreads) d[i] = s[i];
}

#endif  // __CUDACC__

}  // namespace comm
