// Peer-write diagnostics: every rank stores a rank-specific pattern straight into
// every peer's buffer over NVLink (the peers' buffers are mapped into this
// process). Proves allocation, export, mapping, kernel launch and NVLink stores.
#include <comm/copy_device.cuh>

#include "pattern.cuh"

namespace moelink::diagnostics {

// peers[p] is rank p's buffer as mapped here (peers[rank] is our own buffer).
// Each buffer holds nranks slots of `words` 64-bit words; rank r writes slot r.
// Grid: blockIdx.y selects the peer, blockIdx.x/threadIdx.x stride over words.
// The kernel's argument block, mirrored in Rust (ep_kernels::launch::DiagnosticsParams).
struct DiagnosticsParams {
  const uint64_t* const* peers;
  uint64_t words;
  uint64_t seed;
  int nranks;
  int rank;
};
static_assert(sizeof(DiagnosticsParams) == 32, "mirrored in Rust");

__global__ void write_peers(const __grid_constant__ DiagnosticsParams a) {
  const uint64_t* const* peers = a.peers;
  const int nranks = a.nranks, rank = a.rank;
  const uint64_t words = a.words, seed = a.seed;
  const int dst = blockIdx.y;
  if (dst >= nranks) return;
  uint64_t* slot = const_cast<uint64_t*>(peers[dst]) + uint64_t(rank) * words;
  const size_t tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t nthreads = size_t(gridDim.x) * blockDim.x;
  comm::store_words(slot, words, tid, nthreads, [=](size_t i) {
    return moelink::pattern_word(seed, uint32_t(rank), uint32_t(dst), i);
  });
}

}  // namespace moelink::diagnostics
