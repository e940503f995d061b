// Allgather kernels (docs/design-allreduce.md): out[p * m .. (p + 1) * m) =
// input of rank p (m = CollArgs::nbytes bytes per rank; any dtype, moved as bytes).
//
//   ag_ll    every rank writes its input as LL16 packets into slot [rank] of
//            every peer's LL region and unpacks the R - 1 slots it receives
//            (small sizes; same flag/half protocol as the LL allreduces).
//   ag_mesh  full mesh over mapped buffers: each rank's input is readable by
//            every peer (its registered tensor, zero copy, or a copy in its
//            scratch); after a per-block barrier every rank pulls every peer's
//            chunk into its output; a second barrier keeps the sources alive
//            until every peer has read them.
//
// Also here: coll_layout_probe, which writes what the device compiler made of
// CollArgs (compared with Rust's layout by a GPU test).
#include "coll_common.cuh"

namespace moelink::coll {

__device__ __forceinline__ void ag_ll(const CollArgs& a) {
  const LlCall call = ll_begin(a);
  const int R = a.num_ranks, rank = a.rank;
  const uint64_t m = a.nbytes;
  const uint64_t P = ceil_div(m, 8);
  const uint64_t slot = P * 16;
  const bool aligned = a.flags & kFlagAligned;  // input, output and m all multiples of 8
  const uint64_t tid = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t nth = uint64_t(gridDim.x) * blockDim.x;
  char* own_out = a.output + uint64_t(rank) * m;
  const bool copy_own = own_out != a.input;  // in place: the input is our chunk of the output
  const uint64_t mine = call.region + uint64_t(rank) * slot;

  for (uint64_t i = tid; i < P; i += nth) {
    const uint64_t v = load8(a.input, i * 8, m, aligned);
    for (int k = 1; k < R; ++k)
      ll_write(a.peer_scratch[rotate(rank, k, R)] + mine + i * 16, v, call.flag);
    if (copy_own) store8(own_out, i * 8, m, v, aligned);
  }

  comm::WaitClock clock(a.timeout_ns);
  bool ok = true;
  const char* inbox = a.scratch + call.region;
  const uint64_t work = uint64_t(R - 1) * P;
  for (uint64_t j = tid; j < work; j += nth) {
    const int p = rotate(rank, 1 + int(j / P), R);
    const uint64_t i = j % P;
    const uint64_t v = ll_read(inbox + uint64_t(p) * slot + i * 16, call.flag, a, p, i, clock, ok);
    store8(a.output + uint64_t(p) * m, i * 8, m, v, aligned);
  }
  ll_end(a);
}

// Block b owns bytes [b*C, (b+1)*C) of every chunk in both phases.
__device__ __forceinline__ void ag_mesh(const CollArgs& a) {
  const int R = a.num_ranks, rank = a.rank;
  const uint64_t m = a.nbytes;
  const uint64_t C = round_up(ceil_div(m, gridDim.x), 16);
  const uint64_t lo = uint64_t(blockIdx.x) * C;
  const uint64_t len = lo < m ? (m - lo < C ? m - lo : C) : 0;

  if ((a.flags & kFlagCopyIn) && len > 0)
    block_copy<false>(a.scratch + a.data_offset + lo, a.input + lo, len);
  block_barrier(a);
  if (len > 0) {
    for (int k = 1; k < R; ++k) {
      const int p = rotate(rank, k, R);
      block_copy<true>(a.output + uint64_t(p) * m + lo, a.peer_in[p] + lo, len);
    }
    char* own_out = a.output + uint64_t(rank) * m;
    if (own_out != a.input) block_copy<false>(own_out + lo, a.input + lo, len);
  }
  block_barrier(a);
}

}  // namespace moelink::coll

extern "C" __global__ void __launch_bounds__(1024)
    ag_ll(const __grid_constant__ moelink::coll::CollArgs a) {
  moelink::coll::ag_ll(a);
}

extern "C" __global__ void __launch_bounds__(1024)
    ag_mesh(const __grid_constant__ moelink::coll::CollArgs a) {
  moelink::coll::ag_mesh(a);
}

// Writes sizeof/offsetof of CollArgs in the order of
// collectives::args::layout_probe_expected.
extern "C" __global__ void coll_layout_probe(unsigned long long* out) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  using moelink::coll::CollArgs;
  const unsigned long long v[] = {
      sizeof(CollArgs),
      offsetof(CollArgs, input),
      offsetof(CollArgs, output),
      offsetof(CollArgs, scratch),
      offsetof(CollArgs, peer_scratch),
      offsetof(CollArgs, peer_in),
      offsetof(CollArgs, peer_out),
      offsetof(CollArgs, channels),
      offsetof(CollArgs, error),
      offsetof(CollArgs, counter),
      offsetof(CollArgs, ticket),
      offsetof(CollArgs, nbytes),
      offsetof(CollArgs, ll_offset),
      offsetof(CollArgs, ll_half_bytes),
      offsetof(CollArgs, data_offset),
      offsetof(CollArgs, result_offset),
      offsetof(CollArgs, timeout_ns),
      offsetof(CollArgs, rank),
      offsetof(CollArgs, num_ranks),
      offsetof(CollArgs, flags),
      offsetof(CollArgs, test_delay_us),
      sizeof(comm::MemoryChannelDeviceHandle),
      moelink::coll::kMaxRanks,
      moelink::coll::kMaxBlocks,
  };
  for (unsigned i = 0; i < sizeof(v) / sizeof(v[0]); ++i) out[i] = v[i];
}
