// get_dispatch_layout: from top-k expert ids, the tokens each rank and each
// expert receives, and which ranks each token goes to. Semantics:
// ep_reference::normal::layout (a token counts once per rank hosting any of its
// experts, once per expert even if the id repeats in its top-k; -1 = none).
//
// Token-parallel: a thread per token writes its is_token_in_rank row and counts
// into the block's shared counters; each block stores its counts into
// `partials[block]`, and the last block to finish (a ticket, reset to 0 for the
// next launch) sums them into the outputs. Every output element is written
// (outputs come from torch.empty). Needs R <= 32 and (E + R) ints of shared memory.
//
// An id outside [-1, E) counts nowhere and is recorded in `error` (the
// communicator's host-mapped record: token, column, value), which the host
// raises as a ValueError at the call's next synchronous point.
#include <cstddef>
#include <cstdint>

#include <comm/common_device.cuh>

namespace moelink::layout {

constexpr int kThreads = 256;

// True if id `e` already appeared in positions [0, k) of the token's top-k.
__device__ __forceinline__ bool seen_before(const int64_t* ids, int k, int64_t e) {
  for (int j = 0; j < k; ++j)
    if (ids[j] == e) return true;
  return false;
}

// The kernel's argument block, mirrored in Rust (ep_kernels::launch::LayoutParams).
struct Params {
  const int64_t* topk_idx;      // [N, K]
  int* num_tokens_per_rank;     // [R] out
  int* num_tokens_per_expert;   // [E] out
  bool* is_token_in_rank;       // [N, R] out
  int* partials;                // scratch: [blocks][E + 2R]
  unsigned* ticket;             // 0 before and after
  comm::DeviceError* error;     // an id out of range (or null)
  int num_tokens;
  int num_topk;
  int num_experts;
  int num_ranks;
  int rank;
  int* num_tokens_per_node;     // [R / ranks_per_node] out (DeepEP's num_tokens_per_rdma_rank), or null
  int ranks_per_node;           // nodes of consecutive ranks (used with num_tokens_per_node)
  int pad;
};
static_assert(sizeof(Params) == 96, "mirrored in Rust");
static_assert(offsetof(Params, num_tokens) == 56, "mirrored in Rust");
static_assert(offsetof(Params, rank) == 72, "mirrored in Rust");

// count_tokens (get_dispatch_layout; no "dispatch" in the name: profiles of
// a dispatch find one kernel with that word, the dispatch's own).
__global__ void __launch_bounds__(kThreads) count_tokens(const __grid_constant__ Params a) {
  const int64_t* __restrict__ topk_idx = a.topk_idx;
  const int num_tokens = a.num_tokens, num_topk = a.num_topk;
  const int num_experts = a.num_experts, num_ranks = a.num_ranks, rank = a.rank;
  int* __restrict__ num_tokens_per_rank = a.num_tokens_per_rank;
  int* __restrict__ num_tokens_per_expert = a.num_tokens_per_expert;
  bool* __restrict__ is_token_in_rank = a.is_token_in_rank;
  int* __restrict__ partials = a.partials;
  unsigned* __restrict__ ticket = a.ticket;
  comm::DeviceError* error = a.error;
  extern __shared__ int counts[];  // [E] per expert, [R] per rank, [nodes] per node
  __shared__ bool last;
  const int L = a.num_tokens_per_node != nullptr ? a.ranks_per_node : 0;
  const int nodes = L > 0 ? num_ranks / L : 0;
  const int slots = num_experts + num_ranks + nodes;
  const int experts_per_rank = num_experts / num_ranks;
  for (int i = threadIdx.x; i < slots; i += blockDim.x) counts[i] = 0;
  __syncthreads();

  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < num_tokens) {
    const int64_t* ids = topk_idx + t * num_topk;
    uint32_t hit = 0;
    for (int k = 0; k < num_topk; ++k) {
      const int64_t e = ids[k];
      if (e < 0 || e >= num_experts) {
        if (e != -1)
          comm::report_error(error, comm::kErrorInvalid, comm::kInvalidExpertId, rank, -1,
                             (uint64_t(t) << 8) | uint64_t(k), uint64_t(num_experts),
                             uint64_t(e));
        continue;
      }
      if (!seen_before(ids, k, e)) atomicAdd(&counts[e], 1);
      hit |= 1u << int(e / experts_per_rank);
    }
    bool* row = is_token_in_rank + t * num_ranks;
    for (int r = 0; r < num_ranks; ++r) row[r] = (hit >> r) & 1u;
    for (uint32_t m = hit; m; m &= m - 1) atomicAdd(&counts[num_experts + __ffs(m) - 1], 1);
    for (int n = 0; n < nodes; ++n) {
      const uint32_t node_bits = (L == 32 ? 0xffffffffu : (1u << L) - 1) << (n * L);
      if (hit & node_bits) atomicAdd(&counts[num_experts + num_ranks + n], 1);
    }
  }
  __syncthreads();
  int* mine = partials + int64_t(blockIdx.x) * slots;
  for (int i = threadIdx.x; i < slots; i += blockDim.x) mine[i] = counts[i];
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = comm::last_block_ticket(ticket);
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int i = threadIdx.x; i < slots; i += blockDim.x) {
    int sum = 0;
    for (unsigned b = 0; b < gridDim.x; ++b) sum += __ldcg(partials + int64_t(b) * slots + i);
    if (i < num_experts)
      num_tokens_per_expert[i] = sum;
    else if (i < num_experts + num_ranks)
      num_tokens_per_rank[i - num_experts] = sum;
    else
      a.num_tokens_per_node[i - num_experts - num_ranks] = sum;
  }
}

}  // namespace moelink::layout
