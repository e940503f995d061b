// Intranode dispatch / combine over NVLink memory channels, fixed-slot design
// (docs/design-intranode.md). Every rank's NVL buffer has the same layout:
//
//   [0, kCtrlBytes)            control: two halves (alternating calls), each
//                              [R_src][R + E_local] int32 rows of counts
//   [dispatch_offset, ...)     dispatch slots [R_src][T_d] records
//   [combine_offset, ...)      combine slots  [R_dst][T_c] records
//
// A token t of source rank s that goes to rank d is written into slot
// send_head[t][d] (its rank among s's tokens for d) of block [s] of d's
// dispatch region; combine writes expert outputs back into slot
// send_head[t][d] of block [d] of s's combine region. So no flow control and
// one signal per peer and phase:
//
//   dispatch:  notify (barrier + counts) -> dispatch_send -> wait_peers -> dispatch_recv
//   cached:    barrier -> dispatch_send -> wait_peers -> dispatch_recv
//   combine:   [barrier] -> combine_send -> wait_peers -> combine_recv
//
// (Kernel names are those of namespace moelink::intranode, which is what a
// profiler shows: moelink::intranode::notify, ...; docs/api-notes.md, "Profiler
// names".)
//
// Every phase does exactly one signal and one wait per peer pair, in the same
// order on every rank, on the one device-to-device semaphore per pair.
//
// Fused (the default): one kernel does the send and the receive of a phase at
// once, on disjoint blocks, so the local pass runs while the bytes are still
// crossing NVLink instead of after them:
//
//   dispatch:  notify -> dispatch
//   cached:    dispatch (its senders pass a barrier first)
//   combine:   combine (after a combine, its senders pass a barrier first)
//
// The barrier of a fused kernel (sender_barrier in intranode.cuh) is the
// barrier kernel's, run by its block 0 while the receiver blocks start: one
// launch per call. It needs a sender and a receiver block at once, so a call
// on one SM runs the separate kernels above.
//
// Every record ends in an 8-byte flag: the sender stores (kFlagMagic << 32 |
// call number) into it after the record's bytes (one fence.acq_rel.sys per
// token or row, then relaxed flag stores); the receiving warp polls it with
// acquire loads and then reads the record through L2 (ld.global.cg: the bytes
// arrive during the kernel). Call numbers are device counters (one for each
// phase, advanced by the last block of the fused kernel), so CUDA-graph replays
// count like eager calls and flags are never reset. The fused kernels send no
// end-of-phase signal and run no wait kernel: the semaphores stay aligned
// because both are left out together.
#include "intranode.cuh"

namespace moelink::intranode {

// notify: one block. (0) every expert id of topk_idx (if given) must
// lie in [-1, E): the first one outside is recorded in `error` (naming token
// and column) before the host epoch is written, so the host, which waits on
// that epoch, raises it at the end of the call without another sync.
// (1) send_head[t][d] = slot of token t on rank d
// (exclusive count over earlier tokens going to d) or -1; (2) into every rank
// d's control half: row [rank] = {tokens to each rank, this rank's per-expert
// counts for d's experts}; (3) signal + wait every peer (a barrier: a peer
// signals only after its stream finished its earlier calls, so the data
// regions are free); (4) rank_prefix_matrix, the received token count and the
// per-expert counts (rounded up to `expert_alignment`) to device and
// host-mapped memory, the host epoch last.
__global__ void __launch_bounds__(kNotifyThreads) notify(const __grid_constant__ NotifyParams a) {
  const Ctx& c = a.c;
  const bool* __restrict__ is_token_in_rank = a.is_token_in_rank;
  const int* __restrict__ num_tokens_per_expert = a.num_tokens_per_expert;
  const int num_tokens = a.num_tokens, experts_per_rank = a.experts_per_rank;
  const int expert_alignment = a.expert_alignment, num_topk = a.num_topk;
  int* __restrict__ rank_prefix_matrix = a.rank_prefix_matrix;
  int* __restrict__ send_head = a.send_head;
  int* __restrict__ host_counts = a.host_counts;
  unsigned long long* __restrict__ host_epoch = a.host_epoch;
  const unsigned long long epoch_value = a.epoch_value;
  const int64_t* __restrict__ topk_idx = a.topk_idx;
  comm::DeviceError* error = a.error;
  __shared__ int scan_sums[kNotifyThreads / 32][kSlotRanks];
  __shared__ int sent[kMaxRanks];
  __shared__ uint64_t parity_s;
  __shared__ unsigned long long first_bad;
  const int R = c.num_ranks, rank = c.rank;
  const int row_len = R + experts_per_rank;
  if (threadIdx.x == 0) {
    parity_s = *c.epoch & 1;
    first_bad = ~0ull;
  }
  __syncthreads();
  const int64_t num_experts = int64_t(experts_per_rank) * R;
  find_bad_expert_id(topk_idx, int64_t(num_tokens) * num_topk, num_experts, &first_bad);
  send_slots(is_token_in_rank, send_head, num_tokens, R, scan_sums, sent);
  __syncthreads();
  report_bad_expert_id(topk_idx, num_topk, num_experts, first_bad, rank, error);
  const uint64_t half = parity_s * kCtrlHalfBytes;
  // (2) Counts into every rank's control half, row `rank`; a direct
  // dispatch's pool header into this rank's pool (the barrier publishes both).
  for (int i = threadIdx.x; i < R * row_len; i += blockDim.x) {
    const int d = i / row_len, j = i % row_len;
    const int v = j < R ? sent[j] : num_tokens_per_expert[d * experts_per_rank + (j - R)];
    int* row = reinterpret_cast<int*>(peer_base(c, d) + half) + rank * row_len;
    row[j] = v;
  }
  if (threadIdx.x == 0 && a.pool_header != nullptr) store_pool_header(a.pool_header, a.pool_value);
  __threadfence_system();
  __syncthreads();
  // (3) Barrier with every peer.
  signal_and_wait_all(c);
  __syncthreads();
  // (4) Read every source's row from our control half.
  const int* ctrl = reinterpret_cast<const int*>(c.local + half);
  for (int j = threadIdx.x; j < R; j += blockDim.x) {
    int acc = 0;
    for (int s = 0; s < R; ++s) {
      acc += ctrl[s * row_len + j];
      rank_prefix_matrix[s * R + j] = acc;
    }
    if (j == rank) host_counts[0] = acc;
  }
  for (int e = threadIdx.x; e < experts_per_rank; e += blockDim.x) {
    int acc = 0;
    for (int s = 0; s < R; ++s) acc += ctrl[s * row_len + R + e];
    host_counts[1 + e] = (acc + expert_alignment - 1) / expert_alignment * expert_alignment;
  }
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    *c.epoch += 1;
    __threadfence_system();
    *reinterpret_cast<volatile unsigned long long*>(host_epoch) = epoch_value;
  }
}

// barrier (before a cached dispatch or a combine on the separate kernels, and
// before the packed one): one signal and one wait
// per peer, so no rank writes into a region a peer may still be reading.
__global__ void barrier(Ctx c) { signal_and_wait_all(c); }

// publish_barrier (cached direct dispatch, before dispatch_send_packed; the
// direct combine, before combine_direct): where this rank's recv_x, or its
// combine's x, lies in its receive pool (RecvPoolHeader), then a barrier as
// above, whose signals carry the header to every peer.
__global__ void publish_barrier(const __grid_constant__ PublishBarrierParams a) {
  if (threadIdx.x == 0) {
    const int slot = a.calls == nullptr ? 0 : combine_header_slot(a.calls);
    store_pool_header(a.header + slot, a.value);
    __threadfence_system();
  }
  __syncwarp();
  signal_and_wait_all(a.c);
}

// wait_peers (separate kernels only, after dispatch_send or combine_send): one
// wait per peer for its end-of-send signal.
__global__ void wait_peers(Ctx c) {
  const int p = threadIdx.x;
  if (p < c.num_ranks && p != c.rank) wait_peer(c, p);
}


// dispatch_send: a warp per token; for each destination d of the token, the
// record (row, scales, local top-k ids, weights, source index) goes into slot
// send_head[t][d] of block [rank] of d's dispatch region. The last block
// signals every peer.
__global__ void __launch_bounds__(kThreads) dispatch_send(const __grid_constant__ DispatchSendParams a) {
  const int lane = threadIdx.x % 32;
  const auto [warp, nwarps] = grid_warps();
  for (int64_t t = warp; t < a.num_tokens; t += nwarps) send_token(a, t, lane, 0);
  last_block_signals(a.c);
}

// dispatch_recv: a warp per output row. Row i < num_recv comes from the
// record of (source, slot) located through column `rank` of
// rank_prefix_matrix; rows beyond (num_worst_tokens padding) get top-k id -1,
// weight 0 and source index -1. Once any wait of this Buffer timed out, the
// counts (rank_prefix_matrix) themselves may be a peer's stale row, so every
// row is poisoned, not copied (poison_row).
__global__ void __launch_bounds__(kThreads) dispatch_recv(const __grid_constant__ DispatchRecvParams a) {
  const Ctx& c = a.c;
  const int lane = threadIdx.x % 32;
  const auto [warp, nwarps] = grid_warps();
  const int R = c.num_ranks;
  const auto [my_prefix, num_recv] = recv_prefix(c, a.rank_prefix_matrix, lane);
  const bool poisoned = timed_out_peers(c) != 0;
  for (int64_t i = warp; i < a.num_rows; i += nwarps) {
    if (poisoned) {
      poison_row(a, i, lane);
      continue;
    }
    if (i >= num_recv) {
      pad_row(a, i, lane);
      continue;
    }
    int src;
    int64_t slot;
    locate(i, my_prefix, lane, R, src, slot);
    const char* r = c.local + c.dispatch_offset + (int64_t(src) * c.dispatch_slots + slot) * a.rec.bytes;
    copy_out_row<false>(a, i, r, lane);
  }
}

// dispatch_send_packed (packed dispatch): dispatch_send with every copy of a
// token written to its received row on the destination (PackedDst): rows
// [prefix, prefix + count) of each destination's packed arrays come from
// this rank. The last block signals every peer; wait_peers, the device copies
// and finish_rows follow on the receiving side.
__global__ void __launch_bounds__(kThreads) dispatch_send_packed(const __grid_constant__ DispatchPackedParams a) {
  const Ctx& c = a.send.c;
  const int lane = threadIdx.x % 32;
  const int R = c.num_ranks;
  const int my_prefix = lane < R && c.rank > 0 ? a.rank_prefix_matrix[(c.rank - 1) * R + lane] : 0;
  // Direct: lane d reads d's pool header (published by the barrier of notify
  // or publish_barrier before this kernel, so a relaxed load sees this call's).
  char* my_rows = nullptr;
  int64_t my_recv_rows = -1;
  if (a.pools != nullptr && lane < R) {
    char* pool = reinterpret_cast<char*>(a.pools[lane]);
    const uint64_t* h = reinterpret_cast<const uint64_t*>(pool);
    const int64_t rows = int64_t(comm::load_relaxed_sys(h + 1));
    if (pool != nullptr && rows >= 0) {
      my_rows = pool + comm::load_relaxed_sys(h);
      my_recv_rows = rows;
    }
  }
  const PackedDst dst{c, a.send.rec, a.packed, my_prefix, my_rows, my_recv_rows};
  const auto [warp, nwarps] = grid_warps();
  for (int64_t t = warp; t < a.send.num_tokens; t += nwarps) write_token(a.send, t, lane, 0xffffffffu, dst);
  last_block_signals(c);
}

// finish_rows (packed dispatch, after the device copies moved the packed
// arrays into the outputs): a warp per output row, and only where there is
// something left to do: every row is poisoned once any wait of this Buffer
// timed out (as dispatch_recv), rows past the received count (num_worst_tokens)
// are padded, and a strided recv_scales gets its scales here. Otherwise every
// block returns at once.
__global__ void __launch_bounds__(kThreads) finish_rows(const __grid_constant__ FinishRowsParams a) {
  const DispatchRecvParams& r = a.recv;
  const Ctx& c = r.c;
  const int lane = threadIdx.x % 32;
  const int64_t num_recv = recv_prefix(c, r.rank_prefix_matrix, lane).num_recv;
  const bool poisoned = timed_out_peers(c) != 0;
  if (!poisoned && !a.copy_scales && r.num_rows <= num_recv) return;
  const auto [warp, nwarps] = grid_warps();
  const int S = r.rec.num_scales;
  const float* scales = reinterpret_cast<const float*>(c.local + a.packed.scales);
  if (!poisoned && a.copy_scales && r.scale_stride0 == 1) {
    // Column-major recv_scales (DeepEP's fp8 layout): a warp takes 32 rows at
    // a time, a lane per row, so each scale column goes out as one coalesced
    // store, and a row's packed scales are read once into L1. (A warp per row
    // wrote every scale to its own cache line, one after another.)
    const int64_t rows = num_recv < r.num_rows ? num_recv : r.num_rows;
    const bool vec4 = S % 4 == 0 && reinterpret_cast<uintptr_t>(scales) % 16 == 0;
    for (int64_t i0 = int64_t(warp) * 32; i0 < rows; i0 += int64_t(nwarps) * 32) {
      const int64_t i = i0 + lane;
      if (i >= rows) continue;
      const float* __restrict__ src = scales + i * S;
      float* __restrict__ dst = r.recv_scales + i;
      const int64_t st = r.scale_stride1;
      int j = 0;
      // 16-byte loads where every packed row starts 16-aligned.
      for (; vec4 && j + 4 <= S; j += 4, dst += 4 * st) {
        const float4 v = *reinterpret_cast<const float4*>(src + j);
        dst[0] = v.x;
        dst[st] = v.y;
        dst[2 * st] = v.z;
        dst[3 * st] = v.w;
      }
      for (; j < S; ++j, dst += st) *dst = src[j];
    }
    for (int64_t i = num_recv + warp; i < r.num_rows; i += nwarps) pad_row(r, i, lane);
    return;
  }
  for (int64_t i = warp; i < r.num_rows; i += nwarps) {
    if (poisoned) {
      poison_row(r, i, lane);
    } else if (i >= num_recv) {
      pad_row(r, i, lane);
    } else if (a.copy_scales) {
      for (int j = lane; j < S; j += 32)
        r.recv_scales[i * r.scale_stride0 + j * r.scale_stride1] = scales[i * S + j];
    }
  }
}

// dispatch (fused): run_dispatch of intranode.cuh, whose comment has what the
// blocks do (internode's dispatch kernel runs its receive-only launches too).
__global__ void __launch_bounds__(kThreads) dispatch(const __grid_constant__ DispatchFusedParams a) {
  run_dispatch(a);
}

// combine_send: a warp per received row i < num_recv: the expert output row
// (and K weights) goes into slot `slot` of block [rank] of source rank `src`'s
// combine region. Slots beyond the region (the source rank refused the call)
// are skipped. The last block signals every peer.
__global__ void __launch_bounds__(kThreads) combine_send(const __grid_constant__ CombineSendParams a) {
  const Ctx& c = a.c;
  const int lane = threadIdx.x % 32;
  const auto [warp, nwarps] = grid_warps();
  const int R = c.num_ranks;
  const auto [my_prefix, num_recv] = recv_prefix(c, a.rank_prefix_matrix, lane);
  // Rows in the order of their source rank starting at this rank (rank,
  // rank + 1, ... mod R), so the ranks write to different peers at any moment.
  const int64_t start = c.rank > 0 ? __shfl_sync(0xffffffffu, my_prefix, c.rank - 1) : 0;
  for (int64_t w = warp; w < num_recv; w += nwarps) {
    const int64_t i = w + start < num_recv ? w + start : w + start - num_recv;
    int src;
    int64_t slot;
    locate(i, my_prefix, lane, R, src, slot);
    if (slot >= c.combine_slots) continue;
    send_combine_row(a, i, src, slot, lane, 0);
  }
  last_block_signals(c);
}

// combine_recv: a warp per token t (reduce_token). A token that one of the
// ranks whose wait timed out received is NaN (row and weights), not a partial
// sum.
__global__ void __launch_bounds__(kThreads) combine_recv(const __grid_constant__ CombineRecvParams a) {
  const Ctx& c = a.c;
  const int lane = threadIdx.x % 32;
  const auto [warp, nwarps] = grid_warps();
  const int R = c.num_ranks;
  // Slots of the warp's token per source rank (share_slots).
  __shared__ int slots[kWarps][kMaxRanks];
  int* my_slots = slots[threadIdx.x / 32];
  const unsigned late = timed_out_peers(c);
  for (int64_t t = warp; t < a.num_tokens; t += nwarps) {
    int my_slot;
    unsigned srcs;
    if (late_token(a, t, lane, R, late, my_slot, srcs)) continue;
    share_slots(my_slots, my_slot, lane, R);
    reduce_token<false>(a, t, srcs, my_slots, my_slot, lane);
  }
}

// combine (fused): blocks [0, num_send_blocks) send as combine_send and set each
// record's flag, the rows visited source block by source block in chunks
// (interleaved, starting at this rank's own block) so that every source's
// slots fill at the same pace; the other blocks reduce token after token as
// soon as every copy of the token shows this call's flag. No end-of-send
// signal, no wait kernel.
__global__ void __launch_bounds__(kThreads) combine(const __grid_constant__ CombineFusedParams a) {
  const Ctx& c = a.send.c;
  const int lane = threadIdx.x % 32;
  const int R = c.num_ranks;
  const uint64_t flag = call_flag(a.calls);
  const int nsend = a.num_send_blocks;
  __shared__ int slots[kWarps][kMaxRanks];
  const int kind = int(blockIdx.x) < nsend ? 2 : 3;  // sender or receiver
  stamp(a.prof, kind, 0);
  unsigned int* work = c.ticket + kSendWorkWord;
  if (int(blockIdx.x) < nsend) {
    if (a.barrier) sender_barrier(c, a.error);
    const CombineSendParams& s = a.send;
    const InterleavedRows rows(s.rank_prefix_matrix, c.rank, R, c.rank, lane);
    // Units taken one at a time per warp (kSendWorkWord), in the interleaved order.
    bool first = true;
    for (int64_t k = next_unit(work, lane); k < rows.units; k = next_unit(work, lane)) {
      int src;
      int64_t slot, i;
      if (!rows.row(k, src, slot, i) || slot >= c.combine_slots) continue;
      send_combine_row(s, i, src, slot, lane, flag);
      if (first) stamp(a.prof, kind, 1);
      first = false;
    }
    stamp(a.prof, kind, 2);
  } else {
    const CombineRecvParams& r = a.recv;
    const auto [warp, nwarps] = grid_warps(nsend);
    int* my_slots = slots[threadIdx.x / 32];
    const unsigned late_at_start = timed_out_peers(c);
    for (int64_t t = warp; t < r.num_tokens; t += nwarps) {
      int my_slot;
      unsigned srcs;
      if (late_token(r, t, lane, R, late_at_start, my_slot, srcs)) continue;
      // Lane d waits for the copy from rank d.
      bool ok = true;
      if (my_slot >= 0) {
        const char* rec = combine_record(c, c.local, lane, my_slot, r.record_bytes);
        ok = wait_record(c, record_flag(const_cast<char*>(rec), r.record_bytes), flag, lane,
                         comm::kWaitIntranodeCombine, uint64_t(my_slot), a.error);
      }
      if (__ballot_sync(0xffffffffu, !ok) != 0) {
        poison_token(r, t, lane);
        continue;
      }
      if (t == warp) stamp(a.prof, kind, 1);
      share_slots(my_slots, my_slot, lane, R);
      reduce_token<true>(r, t, srcs, my_slots, my_slot, lane);
    }
    stamp(a.prof, kind, 2);
  }
  fused_done(c.ticket, a.calls, nullptr, nsend > 0 ? work : nullptr,
             a.barrier ? c.ticket + kBarrierGateWord : nullptr);
  stamp(a.prof, kind, 3);
}

// combine_direct (MOELINK_INTRANODE_RECV=direct; after publish_barrier wrote
// this call's combine header, CombineDirectParams): the fused combine, except
// that a source whose x lies in its receive pool sends no rows. The receivers
// read that source's rows where they are, through the peer mapping: row
// prefix + slot of its x, prefix being the rows it received from ranks below
// this one. So such bytes cross NVLink once and are stored once, into the
// output. The other sources send records as the fused combine does, and
// weights always come as records (a source whose x is read sends its weights
// alone, with the flag). When any rank's x is read, the last block ends with a
// barrier: no rank's combine ends, and so no x is released, while a peer may
// still read it. Every rank reads the same headers, so all take that barrier
// or none. `finish` 0: a send-only launch (one SM), the receive-only launch
// (num_send_blocks 0) follows and ends the call.
// `Threads` per block; the receivers load `Sources` sources of `Unroll`
// vectors per lane at a time (reduce_rows).
template <int Threads, int Sources, int Unroll>
__device__ __forceinline__ void combine_direct_body(const CombineDirectParams& a) {
  const CombineFusedParams& f = a.f;
  const Ctx& c = f.send.c;
  const int lane = threadIdx.x % 32;
  const int R = c.num_ranks;
  const uint64_t flag = call_flag(f.calls);
  const int nsend = f.num_send_blocks;
  __shared__ const char* xs[kMaxRanks];  // source d's x here, or null: records
  __shared__ const char* rows[Threads / 32][kMaxRanks];
  __shared__ unsigned read_mask;
  __shared__ int last;
  if (threadIdx.x < 32) {
    const char* x = nullptr;
    if (lane < R) {
      const char* pool = reinterpret_cast<const char*>(a.pools[lane]);
      const int at = a.header_offset + 16 * combine_header_slot(f.calls);
      const uint64_t* h = reinterpret_cast<const uint64_t*>(pool + at);
      const int64_t rows_d = int64_t(comm::load_relaxed_sys(h + 1));
      if (rows_d >= 0) x = pool + comm::load_relaxed_sys(h);
      xs[lane] = x;
    }
    const unsigned m = __ballot_sync(0xffffffffu, x != nullptr);
    if (lane == 0) read_mask = m;
  }
  __syncthreads();
  const bool my_x_read = (read_mask >> c.rank) & 1u;
  const int kind = int(blockIdx.x) < nsend ? 2 : 3;  // sender or receiver
  stamp(f.prof, kind, 0);
  unsigned int* work = c.ticket + kSendWorkWord;
  if (int(blockIdx.x) < nsend) {
    const CombineSendParams& s = f.send;
    // Nothing to send when the peers read the rows and there are no weights.
    const bool sends = !my_x_read || s.topk_weights != nullptr;
    const InterleavedRows order(s.rank_prefix_matrix, c.rank, R, c.rank, lane);
    for (int64_t k = sends ? next_unit(work, lane) : order.units; k < order.units;
         k = next_unit(work, lane)) {
      int src;
      int64_t slot, i;
      if (!order.row(k, src, slot, i) || slot >= c.combine_slots) continue;
      send_combine_row(s, i, src, slot, lane, flag, !my_x_read);
    }
    stamp(f.prof, kind, 2);
  } else {
    const CombineRecvParams& r = f.recv;
    const auto [warp, nwarps] = grid_warps<Threads / 32>(nsend);
    const char** my_rows = rows[threadIdx.x / 32];
    const int64_t row_bytes = int64_t(r.hidden) * 2;
    // Lane d: rows source d received from ranks below this one.
    const int prefix = lane < R && c.rank > 0 ? f.send.rank_prefix_matrix[(c.rank - 1) * R + lane] : 0;
    const bool read_here = lane < R && xs[lane] != nullptr;
    const unsigned late_at_start = timed_out_peers(c);
    for (int64_t t = warp; t < r.num_tokens; t += nwarps) {
      int my_slot;
      unsigned srcs;
      if (late_token(r, t, lane, R, late_at_start, my_slot, srcs)) continue;
      const char* rec = my_slot >= 0 ? combine_record(c, c.local, lane, my_slot, r.record_bytes) : nullptr;
      // Lane d waits for the record from rank d: its row, or its weights alone.
      bool ok = true;
      if (my_slot >= 0 && (!read_here || r.out_weights != nullptr))
        ok = wait_record(c, record_flag(const_cast<char*>(rec), r.record_bytes), flag, lane,
                         comm::kWaitIntranodeCombine, uint64_t(my_slot), f.error);
      if (__ballot_sync(0xffffffffu, !ok) != 0) {
        poison_token(r, t, lane);
        continue;
      }
      __syncwarp();
      if (my_slot >= 0) my_rows[lane] = read_here ? xs[lane] + (int64_t(prefix) + my_slot) * row_bytes : rec;
      __syncwarp();
      const auto row_of = [&](int d) { return reinterpret_cast<const int4*>(my_rows[d]); };
      reduce_rows<true, Sources, Unroll>(r, t, srcs, row_of, my_slot, lane);
    }
    stamp(f.prof, kind, 2);
  }
  // The end (fused_done, and the barrier when any x was read).
  __syncthreads();
  if (threadIdx.x == 0) last = comm::last_block_ticket(c.ticket);
  __syncthreads();
  if (last) {
    if (threadIdx.x == 0) {
      if (a.finish) *f.calls += 1;
      if (nsend > 0) *work = 0;
    }
    if (a.finish && read_mask != 0) {
      __threadfence_system();
      signal_and_wait_all(c);
    }
  }
  stamp(f.prof, kind, 3);
}


__global__ void __launch_bounds__(kThreads) combine_direct(const __grid_constant__ CombineDirectParams a) {
  combine_direct_body<kThreads, 2, 2>(a);
}

// combine_direct_wide: the same with kWideThreads threads per block, whose
// receivers load four sources of four vectors per lane at a time (more bytes
// in flight per SM than a 1024-thread block's registers hold: the pull probe
// reads 39.4 GB/s per SM at 8 blocks on 4 x H200 this way, 31.7 with two of
// two). For a rank whose own x is read in place (its blocks send no rows) in a
// group of 4 or more ranks, where a token has up to 4 copies.
__global__ void __launch_bounds__(kWideThreads) combine_direct_wide(const __grid_constant__ CombineDirectParams a) {
  combine_direct_body<kWideThreads, 4, 4>(a);
}

}  // namespace moelink::intranode
