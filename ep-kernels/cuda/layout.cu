// get_dispatch_layout: from top-k expert ids, the tokens each rank and each
// expert receives, and which ranks each token goes to. Semantics:
// ep_core::reference::layout (a token counts once per rank hosting any of its
// experts, once per expert even if the id repeats in its top-k; -1 = none).
//
// Two kinds of blocks, no atomics across blocks and every output element
// written (outputs come from torch.empty):
// - expert blocks (the first ceil(E / kExpertsPerBlock)): each scans every id
//   and counts the tokens of its experts in shared memory;
// - rank blocks (the rest, kRanksPerBlock ranks each): a thread per token
//   writes is_token_in_rank for the block's ranks and counts per rank.
#include <cstdint>

namespace moelink::layout {

constexpr int kThreads = 256;
constexpr int kExpertsPerBlock = 32;
constexpr int kRanksPerBlock = 8;

// True if id `e` already appeared in positions [0, k) of the token's top-k.
__device__ __forceinline__ bool seen_before(const int64_t* ids, int k, int64_t e) {
  for (int j = 0; j < k; ++j)
    if (ids[j] == e) return true;
  return false;
}

}  // namespace moelink::layout

extern "C" __global__ void __launch_bounds__(moelink::layout::kThreads)
    layout_dispatch(const int64_t* __restrict__ topk_idx, int num_tokens, int num_topk,
                    int num_experts, int num_ranks, int* __restrict__ num_tokens_per_rank,
                    int* __restrict__ num_tokens_per_expert, bool* __restrict__ is_token_in_rank) {
  using namespace moelink::layout;
  __shared__ int counts[kExpertsPerBlock > kRanksPerBlock ? kExpertsPerBlock : kRanksPerBlock];
  const int expert_blocks = (num_experts + kExpertsPerBlock - 1) / kExpertsPerBlock;
  const int experts_per_rank = num_experts / num_ranks;
  for (int i = threadIdx.x; i < kExpertsPerBlock; i += blockDim.x) counts[i] = 0;
  __syncthreads();

  if (int(blockIdx.x) < expert_blocks) {
    const int64_t e0 = int64_t(blockIdx.x) * kExpertsPerBlock;
    for (int t = threadIdx.x; t < num_tokens; t += blockDim.x) {
      const int64_t* ids = topk_idx + int64_t(t) * num_topk;
      for (int k = 0; k < num_topk; ++k) {
        const int64_t e = ids[k];
        if (e >= e0 && e < e0 + kExpertsPerBlock && !seen_before(ids, k, e))
          atomicAdd(&counts[e - e0], 1);
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < kExpertsPerBlock; i += blockDim.x)
      if (e0 + i < num_experts) num_tokens_per_expert[e0 + i] = counts[i];
    return;
  }

  const int r0 = (int(blockIdx.x) - expert_blocks) * kRanksPerBlock;
  const int nr = min(kRanksPerBlock, num_ranks - r0);
  for (int t = threadIdx.x; t < num_tokens; t += blockDim.x) {
    const int64_t* ids = topk_idx + int64_t(t) * num_topk;
    uint32_t hit = 0;
    for (int k = 0; k < num_topk; ++k) {
      const int64_t e = ids[k];
      if (e < 0) continue;
      const int r = int(e / experts_per_rank) - r0;
      if (r >= 0 && r < nr) hit |= 1u << r;
    }
    bool* row = is_token_in_rank + int64_t(t) * num_ranks + r0;
    for (int r = 0; r < nr; ++r) {
      const bool in = (hit >> r) & 1u;
      row[r] = in;
      if (in) atomicAdd(&counts[r], 1);
    }
  }
  __syncthreads();
  for (int r = threadIdx.x; r < nr; r += blockDim.x) num_tokens_per_rank[r0 + r] = counts[r];
}
