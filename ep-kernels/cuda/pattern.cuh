// The word pattern of the peer diagnostics. Mirrored exactly by
// ep_core::diagnostics::pattern_word on the CPU.
#pragma once
#include <cstdint>

namespace moelink {

__host__ __device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Word `i` that rank `src` writes into rank `dst`'s buffer in the run with `seed`.
__host__ __device__ __forceinline__ uint64_t pattern_word(uint64_t seed, uint32_t src, uint32_t dst,
                                                          uint64_t i) {
  return splitmix64(seed ^ (uint64_t(src) << 48) ^ (uint64_t(dst) << 32) ^ splitmix64(i));
}

}  // namespace moelink
