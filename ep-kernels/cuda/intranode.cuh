// Device-side pieces of the intranode kernels (structs mirrored in Rust,
// record flags, send / receive / reduce helpers), shared by intranode.cu and
// internode.cu (which forwards into the same fixed slots). The design is
// described at the top of intranode.cu and in docs/design-intranode.md.
#pragma once

#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>

#include <comm/copy_device.cuh>
#include <comm/memory_channel_device.cuh>

namespace moelink::intranode {

constexpr int kMaxRanks = 32;
constexpr int kNotifyThreads = 1024;
constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kWideThreads = 512;  // combine_direct_wide
constexpr uint64_t kCtrlHalfBytes = 32 * 1024;
// High half of every record flag (the low half is the call number): bytes a
// user wrote into the buffer (get_local_buffer_tensor) never pass as a flag.
constexpr uint64_t kFlagMagic = 0x4d4c4e4bull;  // "MLNK"
// Rows per chunk of the interleaved row orders of the fused kernels (each
// source's or destination's rows visited chunk by chunk, round robin).
constexpr int kChunkRows = 16;

// Everything a kernel needs to reach the peers; mirrored in Rust
// (ep_kernels::intranode::IntranodeCtx).
struct Ctx {
  comm::MemoryChannelDeviceHandle* channels;  // [R] device array; entry `rank` unused
  char* local;                                // this rank's NVL buffer
  uint32_t* ticket;                           // [0]: last-block counter (0 between kernels);
                                              // [1]: bit p set once a wait for peer p timed out;
                                              // [kSendWorkWord]: the fused senders' next unit
  uint64_t* epoch;                            // device counter of notify calls (control-half parity)
  uint64_t dispatch_offset;                   // byte offset of the dispatch region
  uint64_t combine_offset;                    // byte offset of the combine region
  int64_t dispatch_slots;                     // T_d: slots per source block of the dispatch region
  int64_t combine_slots;                      // T_c: slots per block of the combine region
  int64_t timeout_ns;                         // bound of every wait, ns of GPU time
  int32_t rank;
  int32_t num_ranks;
};
static_assert(sizeof(Ctx) == 80, "mirrored in Rust");

// Where fields sit inside a dispatch record (bytes from its start).
struct RecordLayout {
  int64_t bytes;         // whole record, a multiple of 16
  int32_t hidden_bytes;  // row bytes (multiple of 16)
  int32_t num_scales;    // f32 scales after the row (0: none)
  int32_t idx_offset;    // K int64 local expert ids (if num_topk > 0)
  int32_t w_offset;      // K f32 weights (if weights)
  int32_t src_offset;    // int32 source token index
  int32_t num_topk;      // K (0: no top-k in the record)
};
static_assert(sizeof(RecordLayout) == 32, "mirrored in Rust");

// The direct dispatch (MOELINK_INTRANODE_RECV=direct) is the packed one with
// recv_x itself in the receiver's receive pool: a region every peer maps,
// from which the receiver's recv_x is leased. Before the senders write, every
// receiver publishes where the range reserved for its recv_x lies in its pool
// (the pool's first 16 bytes, `RecvPoolHeader`, written before the barrier of
// notify, or of publish_barrier for a cached dispatch); a sender then writes
// each row straight into the destination's recv_x, so every received byte is
// stored once. `rows` -1: no range was reserved (the pool was full, a CUDA
// graph is being captured, or the front end allocates recv_x itself), and the
// rows go to the packed arrays as in the packed dispatch.
struct RecvPoolHeader {
  int64_t offset;  // recv_x's byte offset in the pool
  int64_t rows;    // its rows, or -1
};
static_assert(sizeof(RecvPoolHeader) == 16, "mirrored in Rust");

// Writes a pool header (one thread, before the fence and barrier that publish it).
__device__ __forceinline__ void store_pool_header(RecvPoolHeader* header, const RecvPoolHeader& v) {
  uint64_t* h = reinterpret_cast<uint64_t*>(header);
  comm::store_relaxed_sys(h, uint64_t(v.offset));
  comm::store_relaxed_sys(h + 1, uint64_t(v.rows));
}

// One argument block per data kernel (passed as `__grid_constant__`), mirrored
// in Rust (ep_kernels::intranode::*Params); sizes and offsets asserted on both
// sides with the same numbers.
struct NotifyParams {
  Ctx c;
  const bool* is_token_in_rank;          // [N, R]
  const int* num_tokens_per_expert;      // [E]
  int* rank_prefix_matrix;               // [R, R] out
  int* send_head;                        // [N, R] out
  int* host_counts;                      // host-mapped counts out
  unsigned long long* host_epoch;        // host-mapped, written last
  unsigned long long epoch_value;
  const int64_t* topk_idx;               // [N, K] or null
  comm::DeviceError* error;              // an expert id out of range
  int num_tokens;
  int experts_per_rank;
  int expert_alignment;
  int num_topk;
  RecvPoolHeader* pool_header;           // direct dispatch: this rank's pool, or null
  RecvPoolHeader pool_value;             // written there before the barrier
};
static_assert(sizeof(NotifyParams) == 192, "mirrored in Rust");
static_assert(offsetof(NotifyParams, pool_header) == 168, "mirrored in Rust");
static_assert(offsetof(NotifyParams, epoch_value) == 128, "mirrored in Rust");
static_assert(offsetof(NotifyParams, num_tokens) == 152, "mirrored in Rust");

struct DispatchSendParams {
  Ctx c;
  RecordLayout rec;
  const char* x;                 // [N, hidden_bytes]
  const float* scales;           // [N, num_scales] with element strides, or null
  int64_t scale_stride0;
  int64_t scale_stride1;
  const int64_t* topk_idx;       // [N, K] or null
  const float* topk_weights;     // [N, K] or null
  const int* send_head;          // [N, R]
  int num_tokens;
  int experts_per_rank;
};
static_assert(sizeof(DispatchSendParams) == 176, "mirrored in Rust");
static_assert(offsetof(DispatchSendParams, x) == 112, "mirrored in Rust");
static_assert(offsetof(DispatchSendParams, num_tokens) == 168, "mirrored in Rust");

struct DispatchRecvParams {
  Ctx c;
  RecordLayout rec;
  const int* rank_prefix_matrix;  // [R, R]
  int64_t num_rows;
  char* recv_x;
  float* recv_scales;             // or null
  int64_t scale_stride0;
  int64_t scale_stride1;
  int64_t* recv_topk_idx;         // or null
  float* recv_topk_weights;       // or null
  int* recv_src_idx;              // or null
};
static_assert(sizeof(DispatchRecvParams) == 184, "mirrored in Rust");
static_assert(offsetof(DispatchRecvParams, num_rows) == 120, "mirrored in Rust");
static_assert(offsetof(DispatchRecvParams, recv_src_idx) == 176, "mirrored in Rust");

// The packed dispatch (MOELINK_INTRANODE_RECV=packed, ep-core's RecvPolicy):
// the senders write every copy of a token straight to its received row on the
// destination, into arrays of the destination's dispatch region, so each
// received field is one contiguous range that one device copy (cuMemcpyAsync)
// moves into the output. Byte offsets in every rank's NVL buffer, each array
// `capacity` rows long; mirrored in Rust (ep_kernels::intranode::PackedLayout).
struct PackedLayout {
  int64_t rows;      // [capacity][hidden_bytes]
  int64_t scales;    // [capacity][num_scales] f32
  int64_t idx;       // [capacity][K] int64 local expert ids (-1 elsewhere)
  int64_t w;         // [capacity][K] f32 weights (0 elsewhere)
  int64_t src;       // [capacity] int32 source token index
  int64_t capacity;  // rows of each array
};
static_assert(sizeof(PackedLayout) == 48, "mirrored in Rust");

struct DispatchPackedParams {
  DispatchSendParams send;
  PackedLayout packed;
  const int* rank_prefix_matrix;  // [R, R]: a token's row on d is prefix + its slot
  const uint64_t* pools;          // [R] every rank's receive pool here, or null (packed)
};
static_assert(sizeof(DispatchPackedParams) == 240, "mirrored in Rust");
static_assert(offsetof(DispatchPackedParams, rank_prefix_matrix) == 224, "mirrored in Rust");
static_assert(offsetof(DispatchPackedParams, pools) == 232, "mirrored in Rust");

// publish_barrier (direct dispatch and combine): this rank's receive pool
// header, then one signal to and one wait for every peer. `calls` (the direct
// combine's two headers): null, or the device count of completed combines,
// whose parity picks header[0] or header[1]; it is the count combine_direct
// reads, so a CUDA graph's replays alternate the two as eager calls do.
struct PublishBarrierParams {
  Ctx c;
  RecvPoolHeader* header;  // this rank's pool
  RecvPoolHeader value;
  const unsigned long long* calls;
};
static_assert(sizeof(PublishBarrierParams) == 112, "mirrored in Rust");

// What the device copies leave to a kernel after a packed dispatch: padding
// rows (num_worst_tokens), poisoned rows (a peer timed out) and scales into a
// strided recv_scales (`copy_scales`).
struct FinishRowsParams {
  DispatchRecvParams recv;
  PackedLayout packed;
  int copy_scales;
  int pad;
};
static_assert(sizeof(FinishRowsParams) == 240, "mirrored in Rust");
static_assert(offsetof(FinishRowsParams, copy_scales) == 232, "mirrored in Rust");

struct CombineSendParams {
  Ctx c;
  const char* y;                   // [rows, hidden] bf16
  int64_t row_bytes;
  const float* topk_weights;       // [rows, K] or null
  int64_t record_bytes;
  const int* rank_prefix_matrix;   // [R, R]
  int num_topk;
};
static_assert(sizeof(CombineSendParams) == 128, "mirrored in Rust");
static_assert(offsetof(CombineSendParams, num_topk) == 120, "mirrored in Rust");

struct CombineRecvParams {
  Ctx c;
  const int* send_head;            // [N, R]
  int64_t record_bytes;
  const __nv_bfloat16* bias0;      // [N, hidden] or null
  const __nv_bfloat16* bias1;      // [N, hidden] or null
  __nv_bfloat16* out;              // [N, hidden]
  float* out_weights;              // [N, K] or null
  int num_tokens;
  int hidden;
  int num_topk;
};
static_assert(sizeof(CombineRecvParams) == 144, "mirrored in Rust");
static_assert(offsetof(CombineRecvParams, num_tokens) == 128, "mirrored in Rust");

// The fused kernels' blocks: [0, num_send_blocks) run the send half, the rest
// the receive half (dispatch: num_send_blocks == gridDim.x is a send-only
// launch, 0 a receive-only one; the two then run on two streams at once).
// Device counters of calls, from which the flags are derived: dispatch keeps one
// per half (`send_calls`, `recv_calls`: a send-only launch may start after the
// receive-only one of the same call finished), combine one for both halves.
// Every launch advances the counters of the halves it ran, from its last
// block, with `ticket` (the Ctx's, or `recv_ticket` for a receive-only launch,
// which may run at the same time as the send-only one). `error`: the Buffer's
// device error record (a record wait that ran out).
// `prof`: MOELINK_INTRANODE_PROFILE phase stamps (see stamp below) or null.
// `barrier` 1: the senders first pass a barrier with every peer
// (sender_barrier below), so no barrier kernel is launched before.
struct DispatchFusedParams {
  DispatchSendParams send;
  DispatchRecvParams recv;
  unsigned long long* send_calls;
  unsigned long long* recv_calls;
  unsigned int* recv_ticket;
  comm::DeviceError* error;
  uint64_t* prof;
  int num_send_blocks;
  int barrier;
};
static_assert(sizeof(DispatchFusedParams) == 408, "mirrored in Rust");
static_assert(offsetof(DispatchFusedParams, recv) == 176, "mirrored in Rust");
static_assert(offsetof(DispatchFusedParams, num_send_blocks) == 400, "mirrored in Rust");

struct CombineFusedParams {
  CombineSendParams send;
  CombineRecvParams recv;
  unsigned long long* calls;
  comm::DeviceError* error;
  uint64_t* prof;
  int num_send_blocks;
  int barrier;  // as DispatchFusedParams::barrier (0 for combine_direct)
};
static_assert(sizeof(CombineFusedParams) == 304, "mirrored in Rust");
static_assert(offsetof(CombineFusedParams, recv) == 128, "mirrored in Rust");
static_assert(offsetof(CombineFusedParams, num_send_blocks) == 296, "mirrored in Rust");

// The direct combine (MOELINK_INTRANODE_RECV=direct; kernel combine_direct):
// before it, publish_barrier writes where this rank's combine input x lies in
// its receive pool (a RecvPoolHeader, rows -1: x lies elsewhere) at
// `header_offset` of the pool: kCombineHeaderOffset, plus 16 after an odd
// number of completed combines (CombineFusedParams::calls, on the device, so
// that CUDA graph replays alternate too). Two headers, so a call's header is
// never rewritten while a slow peer may still read the one before. A source
// whose x lies in its pool is read where it is.
constexpr int kCombineHeaderOffset = 16;

// Which of the two combine headers this combine uses: the parity of the
// device count of completed combines (read volatile, as call_flag does).
__device__ __forceinline__ int combine_header_slot(const unsigned long long* calls) {
  return int(*reinterpret_cast<const volatile unsigned long long*>(calls) & 1ull);
}

struct CombineDirectParams {
  CombineFusedParams f;
  const uint64_t* pools;  // [R] every rank's receive pool here
  int header_offset;      // the first combine header, bytes into every pool
  int finish;             // this launch ends the call (1), or is a send-only one (0)
};
static_assert(sizeof(CombineDirectParams) == 320, "mirrored in Rust");
static_assert(offsetof(CombineDirectParams, pools) == 304, "mirrored in Rust");
static_assert(offsetof(CombineDirectParams, header_offset) == 312, "mirrored in Rust");

// The word of Ctx::ticket that the fused kernels' senders take their units
// (tokens, rows) from, one at a time per warp, so that every sender warp works
// until the call's units run out (measured on 4 x H200 with a fixed stride of
// units per warp: at 48 SMs the median sender block ended its loop 75 us
// before the last one, 15 % of the send half). Scratch byte 44
// (ep-core's SEND_WORK_OFFSET); 0 between kernels.
constexpr int kSendWorkWord = 11;

// The word of Ctx::ticket that opens the fused kernels' sends after their
// barrier (sender_barrier): 1 once block 0 passed it, 0 between kernels.
// Scratch byte 48 (ep-core's BARRIER_GATE_OFFSET).
constexpr int kBarrierGateWord = 12;

// The next unit of the calling warp (every lane gets it).
__device__ __forceinline__ int64_t next_unit(unsigned int* work, int lane) {
  unsigned int u = 0;
  if (lane == 0) u = atomicAdd(work, 1u);
  return int64_t(__shfl_sync(0xffffffffu, u, 0));
}

__device__ __forceinline__ char* peer_base(const Ctx& c, int p) {
  return p == c.rank ? c.local : c.channels[p].dst;
}

using comm::ld_nc;
using comm::st_na;
using comm::warp_copy16;

// The last block of a grid to get here (after all its threads' writes are
// fenced) signals every peer; the counter is reset for the next kernel.
__device__ __forceinline__ void last_block_signals(const Ctx& c) {
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0 && comm::last_block_ticket(c.ticket)) {
    __threadfence_system();
    for (int p = 0; p < c.num_ranks; ++p)
      if (p != c.rank) c.channels[p].signal();
  }
}

// A wait for peer p that ran out of time (the error is recorded by the
// semaphore) marks p in ticket[1]. The mark stays for the Buffer's life: the
// ranks are out of step from then on, so the receive kernels poison every row
// that came from (or depends on) a marked peer instead of passing stale slots
// as results.
__device__ __forceinline__ void wait_peer(const Ctx& c, int p) {
  if (!c.channels[p].wait(c.timeout_ns)) atomicOr(c.ticket + 1, 1u << p);
}

__device__ __forceinline__ unsigned timed_out_peers(const Ctx& c) {
  return *reinterpret_cast<volatile uint32_t*>(c.ticket + 1);
}

// One signal to and one wait for every peer (one thread per peer).
__device__ __forceinline__ void signal_and_wait_all(const Ctx& c) {
  const int p = threadIdx.x;
  if (p < c.num_ranks && p != c.rank) {
    c.channels[p].signal();
    wait_peer(c, p);
  }
}

// The barrier of a fused kernel whose senders must not write into a peer's
// region before that peer's earlier calls ended (a cached dispatch, a combine
// after a combine), in place of a barrier kernel launched before it: block 0
// (a sender) signals and waits for every peer as the barrier kernel does, then
// opens the gate word; the other sender blocks wait for the gate. Block 0 is
// the first block the GPU places, so no block waits for one that cannot run.
// A gate still shut after twice the wait bound (block 0 was never placed)
// records the error and marks every peer late, so the call's rows are
// poisoned and the host raises. The last block shuts the gate (fused_done).
__device__ __forceinline__ void sender_barrier(const Ctx& c, comm::DeviceError* error) {
  unsigned int* gate = c.ticket + kBarrierGateWord;
  if (blockIdx.x == 0) {
    signal_and_wait_all(c);
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(gate), "r"(1u) : "memory");
    }
    return;
  }
  if (threadIdx.x == 0) {
    comm::WaitClock clock(2 * c.timeout_ns);
    unsigned int open = 0;
    for (;;) {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(open) : "l"(gate) : "memory");
      if (open != 0) break;
      if (clock.expired()) {
        atomicOr(c.ticket + 1, ((1u << c.num_ranks) - 1u) & ~(1u << c.rank));
        comm::report_error(error, comm::kErrorTimeout, comm::kWaitIntranodeGate, c.rank, -1,
                           0, 1, open);
        break;
      }
    }
  }
  __syncthreads();
}

// `bits` (the low `n` bits used) rotated right by `k` (0 <= k < n): bit (j + k) % n
// moves to bit j.
__device__ __forceinline__ unsigned rotate_right(unsigned bits, int k, int n) {
  if (k == 0) return bits;
  const unsigned mask = n == 32 ? 0xffffffffu : (1u << n) - 1;
  return ((bits >> k) | (bits << (n - k))) & mask;
}

// The warps of blocks [first, gridDim.x), which a grid-stride loop of a
// warp per unit spreads over: this warp's index among them and their count.
struct GridWarps {
  int64_t warp;
  int64_t nwarps;
};
template <int Warps = kWarps>
__device__ __forceinline__ GridWarps grid_warps(int first = 0) {
  return {int64_t(blockIdx.x - first) * Warps + threadIdx.x / 32, int64_t(gridDim.x - first) * Warps};
}

// Column `rank` of rank_prefix_matrix [R, R] (one warp): lane s's
// `my_prefix` holds prefix[s], the rows received from sources 0..s (0 for
// lanes past R), and `num_recv` all of them.
struct RecvPrefix {
  int my_prefix;
  int64_t num_recv;
};
__device__ __forceinline__ RecvPrefix recv_prefix(const Ctx& c, const int* rank_prefix_matrix, int lane) {
  const int R = c.num_ranks;
  const int my_prefix = lane < R ? rank_prefix_matrix[lane * R + c.rank] : 0;
  return {my_prefix, __shfl_sync(0xffffffffu, my_prefix, R - 1)};
}

// Source rank of received row i: the first s with prefix[s] > i, where prefix
// is column `rank` of rank_prefix_matrix (lane s holds prefix[s]).
__device__ __forceinline__ void locate(int64_t i, int my_prefix, int lane, int num_ranks,
                                       int& src, int64_t& slot) {
  const unsigned above = __ballot_sync(0xffffffffu, lane < num_ranks && i < my_prefix);
  src = __ffs(above) - 1;
  const int before = __shfl_sync(0xffffffffu, my_prefix, src > 0 ? src - 1 : 0);
  slot = i - (src > 0 ? before : 0);
}

// Destinations notify's slot pass handles at once (block_exclusive_scan_n).
constexpr int kSlotRanks = 8;

// Block-wide exclusive scans of kSlotRanks ints per thread at once
// (kNotifyThreads threads; two __syncthreads for all of them, then one before
// `sums` is reused): v[j] becomes the sum of v[j] over the threads before this
// one, and totals[j] (shared) the block's sum, for j < n.
__device__ __forceinline__ void block_exclusive_scan_n(int (&v)[kSlotRanks],
                                                       int (*sums)[kSlotRanks], int* totals,
                                                       int n) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int x[kSlotRanks];
#pragma unroll
  for (int j = 0; j < kSlotRanks; ++j) {
    x[j] = v[j];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, x[j], o);
      if (lane >= o) x[j] += y;
    }
    if (lane == 31) sums[warp][j] = x[j];
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int j = 0; j < kSlotRanks; ++j) {
      const int own = sums[lane][j];
      int w = own;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, w, o);
        if (lane >= o) w += y;
      }
      sums[lane][j] = w - own;  // exclusive
      if (lane == 31 && j < n) totals[j] = w;
    }
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kSlotRanks; ++j) v[j] = sums[warp][j] + x[j] - v[j];
  __syncthreads();
}

// notify's expert id check (every thread of the block): the lowest index i
// < n of `topk_idx` (null: none) outside [-1, num_experts) into *first_bad
// (shared, ~0 before). The ids are read coalesced, each load independent of
// the others (one thread's ids one after another, each load waiting on the
// one before, used to be most of notify's time).
__device__ __forceinline__ void find_bad_expert_id(const int64_t* topk_idx, int64_t n,
                                                   int64_t num_experts,
                                                   unsigned long long* first_bad) {
  if (topk_idx == nullptr) return;
  unsigned long long mine = ~0ull;
#pragma unroll 8
  for (int64_t i = threadIdx.x; i < n; i += kNotifyThreads) {
    const int64_t e = topk_idx[i];
    if (e < -1 || e >= num_experts) mine = min(mine, (unsigned long long)i);
  }
  if (mine != ~0ull) atomicMin(first_bad, mine);
}

// Thread 0 records the id find_bad_expert_id found (after a __syncthreads),
// naming its token and column.
__device__ __forceinline__ void report_bad_expert_id(const int64_t* topk_idx, int num_topk,
                                                     int64_t num_experts,
                                                     unsigned long long first_bad, int rank,
                                                     comm::DeviceError* error) {
  if (threadIdx.x != 0 || first_bad == ~0ull) return;
  const int64_t i = int64_t(first_bad), t = i / num_topk, k = i % num_topk;
  comm::report_error(error, comm::kErrorInvalid, comm::kInvalidExpertId, rank, -1,
                     (uint64_t(t) << 8) | uint64_t(k), uint64_t(num_experts),
                     uint64_t(topk_idx[i]));
}

// notify's slots (every thread of the block): send_head[t][d] = the slot of
// token t on rank d (its rank among this rank's tokens for d) or -1, and
// sent[d] (shared) the tokens for d. kSlotRanks destinations at a time: each
// thread owns a contiguous range of tokens, counts them per destination, one
// block scan gives it its first slot per destination, a second pass writes
// them.
__device__ __forceinline__ void send_slots(const bool* is_token_in_rank, int* send_head,
                                           int num_tokens, int R,
                                           int (*scan_sums)[kSlotRanks], int* sent) {
  const int per_thread = (num_tokens + kNotifyThreads - 1) / kNotifyThreads;
  const int t0 = min(num_tokens, int(threadIdx.x) * per_thread);
  const int t1 = min(num_tokens, t0 + per_thread);
  for (int d0 = 0; d0 < R; d0 += kSlotRanks) {
    int slot[kSlotRanks];
#pragma unroll
    for (int j = 0; j < kSlotRanks; ++j) slot[j] = 0;
    for (int t = t0; t < t1; ++t) {
      const bool* in = is_token_in_rank + int64_t(t) * R + d0;
#pragma unroll
      for (int j = 0; j < kSlotRanks; ++j)
        if (d0 + j < R) slot[j] += in[j] ? 1 : 0;
    }
    block_exclusive_scan_n(slot, scan_sums, sent + d0, R - d0);
    for (int t = t0; t < t1; ++t) {
      const bool* in = is_token_in_rank + int64_t(t) * R + d0;
      int* head = send_head + int64_t(t) * R + d0;
#pragma unroll
      for (int j = 0; j < kSlotRanks; ++j)
        if (d0 + j < R) head[j] = in[j] ? slot[j]++ : -1;
    }
  }
}

// Block-wide exclusive scan of one int per thread (kNotifyThreads threads).
__device__ __forceinline__ int block_exclusive_scan(int v, int* warp_sums, int& total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int w = lane < kNotifyThreads / 32 ? warp_sums[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += y;
    }
    warp_sums[lane] = w;  // inclusive
  }
  __syncthreads();
  total = warp_sums[kNotifyThreads / 32 - 1];
  const int r = (warp > 0 ? warp_sums[warp - 1] : 0) + x - v;
  __syncthreads();
  return r;
}

}  // namespace moelink::intranode

using moelink::intranode::Ctx;
using moelink::intranode::RecordLayout;

namespace moelink::intranode {

// The flag word of a record of `bytes` bytes (its last 8).
__device__ __forceinline__ uint64_t* record_flag(char* record, int64_t bytes) {
  return reinterpret_cast<uint64_t*>(record + bytes - 8);
}

// The flag value of the call after `calls` completed calls of a phase.
__device__ __forceinline__ uint64_t flag_value(uint64_t calls) {
  return (kFlagMagic << 32) | ((calls + 1) & 0xffffffffull);
}

// The flag value of this call of a phase whose device counter of completed
// calls is `*calls` (read volatile: the previous launch's last block advanced it).
__device__ __forceinline__ uint64_t call_flag(const unsigned long long* calls) {
  return flag_value(*reinterpret_cast<const volatile unsigned long long*>(calls));
}

__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// Waits (the calling thread) until the flag of a record from peer `src`
// holds `want`, bounded by the context's timeout. A peer already marked as
// timed out is not waited for again. On timeout: marks `src` in ticket[1],
// records the failure (kind, rank, src, `id`, want, seen) and returns false.
__device__ bool wait_record(const Ctx& c, const uint64_t* flag, uint64_t want, int src,
                            uint32_t kind, uint64_t id, comm::DeviceError* error) {
  if (timed_out_peers(c) & (1u << src)) return false;
  comm::WaitClock clock(c.timeout_ns);
  uint64_t seen = comm::load_acquire_sys(flag);
  while (seen != want) {
    if (clock.expired()) {
      atomicOr(c.ticket + 1, 1u << src);
      comm::report_error(error, comm::kErrorTimeout, kind, c.rank, src, id, want, seen);
      return false;
    }
    // Another warp found this peer late: stop waiting for it.
    if ((clock.polls & 1023u) == 0 && (timed_out_peers(c) & (1u << src))) return false;
    seen = comm::load_acquire_sys(flag);
  }
  return true;
}

// Where one destination's copy of a token goes: its row, scales, local top-k
// ids, weights and source index.
struct TokenDst {
  char* row;
  float* scales;
  int64_t* idx;
  float* w;
  int* src;
};

// Token t's copy for rank d in slot `slot` of block [rank] of d's dispatch
// region (one record: the fixed-slot layout).
struct RecordDst {
  const Ctx& c;
  const RecordLayout& rec;
  __device__ __forceinline__ TokenDst operator()(int d, int64_t slot, int /*lane*/) const {
    char* r = peer_base(c, d) + c.dispatch_offset + (int64_t(c.rank) * c.dispatch_slots + slot) * rec.bytes;
    return {r, reinterpret_cast<float*>(r + rec.hidden_bytes),
            reinterpret_cast<int64_t*>(r + rec.idx_offset), reinterpret_cast<float*>(r + rec.w_offset),
            reinterpret_cast<int*>(r + rec.src_offset)};
  }
};

// Copies one row (`bytes`, a multiple of 16) to several destinations: the
// j-th for every bit j of `to`, at the address lane j holds in `my_dst`. Each
// 16-byte vector is loaded once (four per lane in flight) and stored to every
// destination before the next ones are loaded, so a token's row costs one
// round of load latencies however many ranks receive it. The loop bounds are
// the same on every lane (the shuffles need the whole warp).
__device__ __forceinline__ void warp_copy16_to(unsigned to, char* my_dst, const char* src,
                                               int64_t bytes, int lane) {
  if (to == 0) return;  // every destination skipped: don't load the row
  const int4* s = reinterpret_cast<const int4*>(src);
  const int64_t n = bytes / 16;
  constexpr int kUnroll = 4;
  for (int64_t base = 0; base < n; base += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + 32 * u + lane;
      if (i < n) v[u] = comm::ld_vec<false>(s + i);
    }
    for (unsigned m = to; m; m &= m - 1) {
      const int j = __ffs(m) - 1;
      int4* d = reinterpret_cast<int4*>(__shfl_sync(0xffffffffu, reinterpret_cast<uint64_t>(my_dst), j));
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + 32 * u + lane;
        if (i < n) comm::st_na(d + i, v[u]);
      }
    }
  }
}

// Writes token t's copies (row, scales, local top-k ids, weights, source
// index) for its destinations where `dst` puts them, no flags. Returns, on
// lane d, the slot of t on rank d (a destination that `allowed` keeps), else -1.
template <class Dst>
__device__ __forceinline__ int write_token(const DispatchSendParams& a, int64_t t, int lane,
                                           unsigned allowed, const Dst& dst_of) {
  const Ctx& c = a.c;
  const RecordLayout& rec = a.rec;
  const int R = c.num_ranks, K = rec.num_topk;
  const int my_slot = lane < R ? a.send_head[t * R + lane] : -1;
  const bool mine_to_send = my_slot >= 0 && ((allowed >> lane) & 1u);
  unsigned dests = __ballot_sync(0xffffffffu, mine_to_send);
  const char* row = a.x + t * rec.hidden_bytes;
  int64_t my_id = -1;
  float my_w = 0.f;
  if (lane < K) {
    my_id = a.topk_idx[t * K + lane];
    if (a.topk_weights != nullptr) my_w = a.topk_weights[t * K + lane];
  }
  // Destinations in the order rank, rank + 1, ... (mod R): at any moment the
  // ranks write to different peers instead of all to the lowest one first
  // (measured: ascending order left peers waiting 60-300 us for the last sender).
  dests = rotate_right(dests, c.rank, R);
  // The token's first 32 * kScaleRegs scales, loaded once into lanes (fp8:
  // 56 for hidden 7168) instead of once per destination; any beyond are read
  // per destination.
  constexpr int kScaleRegs = 2;
  float sc[kScaleRegs];
#pragma unroll
  for (int u = 0; u < kScaleRegs; ++u) {
    const int s = lane + 32 * u;
    sc[u] = s < rec.num_scales ? a.scales[t * a.scale_stride0 + s * a.scale_stride1] : 0.f;
  }
  // Every destination's small fields first; lane j keeps the row address of
  // the j-th destination in that order, and the row goes out to all at once.
  char* my_dst_row = nullptr;
  unsigned rows_to = 0;
  while (dests) {
    const int j = __ffs(dests) - 1;
    dests &= dests - 1;
    const int d = j + c.rank < R ? j + c.rank : j + c.rank - R;
    const int64_t slot = __shfl_sync(0xffffffffu, my_slot, d);
    const TokenDst dst = dst_of(d, slot, lane);
    if (dst.row == nullptr) continue;
    rows_to |= 1u << j;
    if (lane == j) my_dst_row = dst.row;
#pragma unroll
    for (int u = 0; u < kScaleRegs; ++u)
      if (lane + 32 * u < rec.num_scales) dst.scales[lane + 32 * u] = sc[u];
    for (int s = lane + 32 * kScaleRegs; s < rec.num_scales; s += 32)
      dst.scales[s] = a.scales[t * a.scale_stride0 + s * a.scale_stride1];
    if (lane < K) {
      const int64_t first = int64_t(d) * a.experts_per_rank;
      const bool mine = my_id >= first && my_id < first + a.experts_per_rank;
      dst.idx[lane] = mine ? my_id - first : -1;
      if (a.topk_weights != nullptr) dst.w[lane] = mine ? my_w : 0.f;
    }
    if (lane == 0) *dst.src = int(t);
  }
  warp_copy16_to(rows_to, my_dst_row, row, rec.hidden_bytes, lane);
  return mine_to_send ? my_slot : -1;
}

// Token t's copy for rank d in a packed dispatch: row `prefix + slot` of d's
// packed arrays, where lane d's `my_prefix` is the tokens d receives from the
// ranks before this one. A row past the arrays (stale counts after a timeout)
// is skipped (row null).
// In a direct dispatch, lane d's `my_rows` / `my_recv_rows` are d's recv_x
// (here) and its rows (-1: none; the rows go to the packed arrays).
struct PackedDst {
  const Ctx& c;
  const RecordLayout& rec;
  const PackedLayout& L;
  int my_prefix;
  char* my_rows;
  int64_t my_recv_rows;
  __device__ __forceinline__ TokenDst operator()(int d, int64_t slot, int /*lane*/) const {
    const int64_t i = int64_t(__shfl_sync(0xffffffffu, my_prefix, d)) + slot;
    char* const direct = reinterpret_cast<char*>(__shfl_sync(0xffffffffu, reinterpret_cast<uint64_t>(my_rows), d));
    const int64_t recv_rows = __shfl_sync(0xffffffffu, my_recv_rows, d);
    if (i >= L.capacity || (direct != nullptr && i >= recv_rows))
      return {nullptr, nullptr, nullptr, nullptr, nullptr};
    char* b = peer_base(c, d);
    const int K = rec.num_topk;
    return {direct != nullptr ? direct + i * rec.hidden_bytes : b + L.rows + i * rec.hidden_bytes,
            reinterpret_cast<float*>(b + L.scales) + i * rec.num_scales,
            reinterpret_cast<int64_t*>(b + L.idx) + i * K, reinterpret_cast<float*>(b + L.w) + i * K,
            reinterpret_cast<int*>(b + L.src) + i};
  }
};

// The fixed-slot records of token t (write_token into RecordDst).
__device__ __forceinline__ int write_token_records(const DispatchSendParams& a, int64_t t,
                                                   int lane, unsigned allowed) {
  return write_token(a, t, lane, allowed, RecordDst{a.c, a.rec});
}

// The flag of the record in `slot` of rank `lane` (this rank's block there),
// after a fence that ordered the record's stores before it.
__device__ __forceinline__ void store_record_flag(const DispatchSendParams& a, int lane,
                                                  int slot, uint64_t flag) {
  const Ctx& c = a.c;
  char* dst = peer_base(c, lane) + c.dispatch_offset +
              (int64_t(c.rank) * c.dispatch_slots + slot) * a.rec.bytes;
  comm::store_relaxed_sys(record_flag(dst, a.rec.bytes), flag);
}

// Writes the dispatch record of token t into slot send_head[t][d] of block
// [rank] of every destination d's dispatch region (the whole warp). With
// `flag` != 0, the record's flag is then set to `flag` on every destination
// (after a fence: the record's bytes are visible first). Only destinations
// whose bit is set in `allowed` are written (internode: this node's ranks).
__device__ __forceinline__ void send_token(const DispatchSendParams& a, int64_t t, int lane,
                                           uint64_t flag, unsigned allowed = 0xffffffffu) {
  const int slot = write_token_records(a, t, lane, allowed);
  if (flag != 0) {
    __syncwarp();
    if (slot >= 0) {
      fence_acq_rel_sys();
      store_record_flag(a, lane, slot, flag);
    }
  }
}

// Poisons received row i (a peer timed out): bytes 0xff (NaN in bf16 and
// e4m3), NaN scales and weights, top-k id -1 and source index -1.
__device__ __forceinline__ void poison_row(const DispatchRecvParams& a, int64_t i, int lane) {
  const RecordLayout& rec = a.rec;
  const int K = rec.num_topk;
  int4* row = reinterpret_cast<int4*>(a.recv_x + i * rec.hidden_bytes);
  for (int j = lane; j < rec.hidden_bytes / 16; j += 32) row[j] = make_int4(-1, -1, -1, -1);
  for (int j = lane; j < rec.num_scales; j += 32)
    a.recv_scales[i * a.scale_stride0 + j * a.scale_stride1] = __int_as_float(0x7fffffff);
  if (a.recv_topk_idx != nullptr && lane < K) a.recv_topk_idx[i * K + lane] = -1;
  if (a.recv_topk_weights != nullptr && lane < K)
    a.recv_topk_weights[i * K + lane] = __int_as_float(0x7fffffff);
  if (a.recv_src_idx != nullptr && lane == 0) a.recv_src_idx[i] = -1;
}

// Padding row i (num_worst_tokens beyond the received count): id -1, weight 0,
// source -1; recv_x and scales are left as they are.
__device__ __forceinline__ void pad_row(const DispatchRecvParams& a, int64_t i, int lane) {
  const int K = a.rec.num_topk;
  if (a.recv_topk_idx != nullptr && lane < K) a.recv_topk_idx[i * K + lane] = -1;
  if (a.recv_topk_weights != nullptr && lane < K) a.recv_topk_weights[i * K + lane] = 0.f;
  if (a.recv_src_idx != nullptr && lane == 0) a.recv_src_idx[i] = -1;
}

// Copies record `r` into received row i. `Fresh`: the record arrived during
// this kernel (read through L2), else it was complete before the kernel.
template <bool Fresh>
__device__ __forceinline__ void copy_out_row(const DispatchRecvParams& a, int64_t i, const char* r,
                                             int lane) {
  const RecordLayout& rec = a.rec;
  const int K = rec.num_topk;
  warp_copy16<Fresh>(a.recv_x + i * rec.hidden_bytes, r, rec.hidden_bytes, lane);
  const float* sc = reinterpret_cast<const float*>(r + rec.hidden_bytes);
  for (int j = lane; j < rec.num_scales; j += 32)
    a.recv_scales[i * a.scale_stride0 + j * a.scale_stride1] = sc[j];
  if (lane < K) {
    if (a.recv_topk_idx != nullptr)
      a.recv_topk_idx[i * K + lane] = reinterpret_cast<const int64_t*>(r + rec.idx_offset)[lane];
    if (a.recv_topk_weights != nullptr)
      a.recv_topk_weights[i * K + lane] = reinterpret_cast<const float*>(r + rec.w_offset)[lane];
  }
  if (a.recv_src_idx != nullptr && lane == 0)
    a.recv_src_idx[i] = *reinterpret_cast<const int*>(r + rec.src_offset);
}

// This rank's received rows in the interleaved order of the fused kernels:
// unit k (of R * chunks * kChunkRows) is row j of source block b, where the
// blocks take turns chunk by chunk (b = (first + k / kChunkRows) % R), so every
// block's rows advance together, as the senders' do. Built by the whole warp
// from column `rank` of rank_prefix_matrix; row() is called by the whole warp.
struct InterleavedRows {
  int R, first;
  int my_prefix;  // lane s: rows of sources 0..s
  int my_count;   // lane s: rows of source s
  int64_t units;  // enough chunks for the largest source block

  __device__ __forceinline__ InterleavedRows(const int* rank_prefix_matrix, int rank, int R_,
                                             int first_, int lane)
      : R(R_), first(first_) {
    my_prefix = lane < R ? rank_prefix_matrix[lane * R + rank] : 0;
    const int before = __shfl_up_sync(0xffffffffu, my_prefix, 1);
    my_count = lane < R ? my_prefix - (lane > 0 ? before : 0) : 0;
    int max_count = my_count;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) max_count = max(max_count, __shfl_xor_sync(0xffffffffu, max_count, o));
    units = int64_t(R) * ((int64_t(max_count) + kChunkRows - 1) / kChunkRows) * kChunkRows;
  }

  // Rows received in all.
  __device__ __forceinline__ int64_t total() const { return __shfl_sync(0xffffffffu, my_prefix, R - 1); }

  // Unit k: block b, its row j and the received row index i; false past b's rows.
  __device__ __forceinline__ bool row(int64_t k, int& b, int64_t& j, int64_t& i) const {
    const int turn = int((k / kChunkRows) % R);
    b = first + turn < R ? first + turn : first + turn - R;
    j = k / (int64_t(R) * kChunkRows) * kChunkRows + k % kChunkRows;
    const int count_b = __shfl_sync(0xffffffffu, my_count, b);
    const int start_b = __shfl_sync(0xffffffffu, my_prefix, b > 0 ? b - 1 : 0);
    i = (b > 0 ? start_b : 0) + j;
    return j < count_b;
  }
};

// The combine record of token slot `slot` written by rank `from` in `s`'s
// combine region (as seen through base `base`).
__device__ __forceinline__ const char* combine_record(const Ctx& c, const char* base, int from,
                                                      int64_t slot, int64_t record_bytes) {
  return base + c.combine_offset + (int64_t(from) * c.combine_slots + slot) * record_bytes;
}

// Lane d's `my_slot` (token's slot in source d's block, lanes d < R) into the
// warp's row `my_slots` of shared memory, where every lane of the reduction
// reads it (the lanes of its row loop may be inactive, so slots are not
// shuffled).
__device__ __forceinline__ void share_slots(int* my_slots, int my_slot, int lane, int R) {
  __syncwarp();
  if (lane < R) my_slots[lane] = my_slot;
  __syncwarp();
}

// The combine of token t (one warp): out[t] = bf16((bias0 + bias1) + copy_d0 +
// copy_d1 + ...) in f32 over the ranks d0 < d1 < ... that received t (the CPU
// reference's order, so results match it bit for bit); weights likewise from 0.
// `Fresh`: the copies arrived during this kernel (read through L2).
// `row_of(d)`: where the row of source d lies (a record here, or, in the
// direct combine, the source's x itself through the peer mapping); the weights
// always come from the records. `kSources` sources of `kUnroll` vectors per
// lane are loaded before they are added (memory-level parallelism: 2 x 2 fits
// a 1024-thread block's registers, 4 x 4 a 512-thread one's); the order of the
// additions stays bias, then sources in ascending rank order.
template <bool Fresh, int kSources = 2, int kUnroll = 2, typename RowOf>
__device__ __forceinline__ void reduce_rows(const CombineRecvParams& a, int64_t t, unsigned srcs,
                                            RowOf row_of, int my_slot, int lane) {
  const Ctx& c = a.c;
  const int hidden = a.hidden, num_topk = a.num_topk;
  const int64_t record_bytes = a.record_bytes;
  const int64_t row_bytes = int64_t(hidden) * 2;
  const int nvec = hidden / 8;
  for (int v0 = lane; v0 < nvec; v0 += 32 * kUnroll) {
    float acc[kUnroll][8];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int v = v0 + 32 * u;
      int4 b0 = make_int4(0, 0, 0, 0), b1 = make_int4(0, 0, 0, 0);
      if (v < nvec && a.bias0 != nullptr) b0 = ld_nc(reinterpret_cast<const int4*>(a.bias0 + t * hidden) + v);
      if (v < nvec && a.bias1 != nullptr) b1 = ld_nc(reinterpret_cast<const int4*>(a.bias1 + t * hidden) + v);
      const __nv_bfloat16* p0 = reinterpret_cast<const __nv_bfloat16*>(&b0);
      const __nv_bfloat16* p1 = reinterpret_cast<const __nv_bfloat16*>(&b1);
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[u][k] = __bfloat162float(p0[k]) + __bfloat162float(p1[k]);
    }
    unsigned m = srcs;
    if constexpr (kSources == 2) {
      // Two at a time, written out (what the 1024-thread kernels compile
      // without spilling).
      while (m) {
        const int d0 = __ffs(m) - 1;
        m &= m - 1;
        const int d1 = m ? __ffs(m) - 1 : -1;
        if (m) m &= m - 1;
        const int4* r0 = row_of(d0);
        const int4* r1 = d1 < 0 ? nullptr : row_of(d1);
        int4 w0[kUnroll], w1[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int v = v0 + 32 * u;
          if (v < nvec) {
            w0[u] = comm::ld_vec<Fresh>(r0 + v);
            if (r1 != nullptr) w1[u] = comm::ld_vec<Fresh>(r1 + v);
          }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(&w0[u]);
          const __nv_bfloat16* y = reinterpret_cast<const __nv_bfloat16*>(&w1[u]);
#pragma unroll
          for (int k = 0; k < 8; ++k) {
            acc[u][k] += __bfloat162float(x[k]);
            if (r1 != nullptr) acc[u][k] += __bfloat162float(y[k]);
          }
        }
      }
    }
    while (kSources != 2 && m) {
      // The next kSources sources (the first always present).
      const int4* r[kSources];
#pragma unroll
      for (int s = 0; s < kSources; ++s) {
        const int d = m ? __ffs(m) - 1 : -1;
        if (m) m &= m - 1;
        r[s] = d < 0 ? nullptr : row_of(d);
      }
      int4 w[kSources][kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int v = v0 + 32 * u;
        if (v < nvec) {
#pragma unroll
          for (int s = 0; s < kSources; ++s)
            if (s == 0 || r[s] != nullptr) w[s][u] = comm::ld_vec<Fresh>(r[s] + v);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
#pragma unroll
          for (int s = 0; s < kSources; ++s) {
            const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(&w[s][u]);
            if (s == 0 || r[s] != nullptr) acc[u][k] += __bfloat162float(x[k]);
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int v = v0 + 32 * u;
      if (v >= nvec) continue;
      int4 o;
      __nv_bfloat16* po = reinterpret_cast<__nv_bfloat16*>(&o);
#pragma unroll
      for (int k = 0; k < 8; ++k) po[k] = __float2bfloat16_rn(acc[u][k]);
      reinterpret_cast<int4*>(a.out + t * hidden)[v] = o;
    }
  }
  if (a.out_weights != nullptr) {
    float acc = 0.f;
    unsigned m = srcs;
    while (m) {
      const int d = __ffs(m) - 1;
      m &= m - 1;
      const int64_t slot = __shfl_sync(0xffffffffu, my_slot, d);
      const char* r = combine_record(c, c.local, d, slot, record_bytes);
      if (lane < num_topk) {
        const float* w = reinterpret_cast<const float*>(r + row_bytes) + lane;
        acc += Fresh ? __ldcg(w) : *w;
      }
    }
    if (lane < num_topk) a.out_weights[t * num_topk + lane] = acc;
  }
}

// The combine of token t from the records in this rank's combine region.
template <bool Fresh>
__device__ __forceinline__ void reduce_token(const CombineRecvParams& a, int64_t t, unsigned srcs,
                                             const int* my_slots, int my_slot, int lane) {
  const Ctx& c = a.c;
  const auto row_of = [&](int d) {
    return reinterpret_cast<const int4*>(combine_record(c, c.local, d, my_slots[d], a.record_bytes));
  };
  reduce_rows<Fresh>(a, t, srcs, row_of, my_slot, lane);
}

// Poisons combined token t (it depends on a peer whose wait timed out).
__device__ __forceinline__ void poison_token(const CombineRecvParams& a, int64_t t, int lane) {
  int4* row = reinterpret_cast<int4*>(a.out + t * a.hidden);
  for (int v = lane; v < a.hidden / 8; v += 32) row[v] = make_int4(-1, -1, -1, -1);
  if (a.out_weights != nullptr && lane < a.num_topk)
    a.out_weights[t * a.num_topk + lane] = __int_as_float(0x7fffffff);
}

// Token t of a combine's receiver (one warp): lane d's slot of it in source
// d's block (-1: d did not receive it) and the sources that did. A token that
// a peer of `late` received is poisoned here (true: the warp skips it).
__device__ __forceinline__ bool late_token(const CombineRecvParams& a, int64_t t, int lane, int R,
                                           unsigned late, int& my_slot, unsigned& srcs) {
  my_slot = lane < R ? a.send_head[t * R + lane] : -1;
  srcs = __ballot_sync(0xffffffffu, my_slot >= 0);
  if ((srcs & late) == 0) return false;
  poison_token(a, t, lane);
  return true;
}

// Writes received row i (its expert output row and K weights) into slot `slot`
// of block [rank] of source rank `src`'s combine region (the whole warp); with
// `flag` != 0 then sets the record's flag (after a fence). `with_row` false:
// the weights alone (the direct combine, whose receivers read the row itself).
__device__ __forceinline__ void send_combine_row(const CombineSendParams& a, int64_t i, int src,
                                                 int64_t slot, int lane, uint64_t flag,
                                                 bool with_row = true) {
  const Ctx& c = a.c;
  char* dst = peer_base(c, src) + c.combine_offset +
              (int64_t(c.rank) * c.combine_slots + slot) * a.record_bytes;
  if (with_row) warp_copy16(dst, a.y + i * a.row_bytes, a.row_bytes, lane);
  if (a.topk_weights != nullptr && lane < a.num_topk)
    reinterpret_cast<float*>(dst + a.row_bytes)[lane] = a.topk_weights[i * a.num_topk + lane];
  if (flag != 0) {
    __syncwarp();
    if (lane == 0) {
      fence_acq_rel_sys();
      comm::store_relaxed_sys(record_flag(dst, a.record_bytes), flag);
    }
  }
}

// The end of a fused kernel: the last block (by `ticket`) advances the call
// counters given (null: not this launch's).
// Optional phase stamps of the fused kernels (MOELINK_INTRANODE_PROFILE=1, read
// by the Buffer's intranode_profile(); benches/intranode_profile.py names them):
// prof[kind][block][slot], globaltimer ns written by thread 0 of each block.
// kind: 0 a dispatch sender block, 1 a dispatch receiver block (of a
// receive-only launch or of one that runs both halves), 2 a combine sender
// block, 3 a combine receiver block.
// Slots: 0 the block starts; 1 its
// warp 0 is past its first row (a sender: its sends; a receiver: its first
// record arrived); 2 its warp 0 left its row loop; 3 the block ends (every warp).
// Stamps of the latest launch of each kind; blocks past kProfBlocks are not kept.
constexpr int kProfBlocks = 256;
constexpr int kProfSlots = 4;
__device__ __forceinline__ void stamp(uint64_t* prof, int kind, int slot) {
  if (prof != nullptr && threadIdx.x == 0 && blockIdx.x < kProfBlocks)
    prof[(int64_t(kind) * kProfBlocks + blockIdx.x) * kProfSlots + slot] = comm::now_ns();
}

// `work` (the senders' unit counter, or null) and `gate` (sender_barrier's
// gate, or null): reset to 0 by the last block, after every sender has taken
// its last unit and passed the gate.
__device__ __forceinline__ void fused_done(unsigned int* ticket, unsigned long long* calls,
                                           unsigned long long* more_calls,
                                           unsigned int* work = nullptr,
                                           unsigned int* gate = nullptr) {
  __syncthreads();
  if (threadIdx.x == 0 && comm::last_block_ticket(ticket)) {
    if (calls != nullptr) *calls += 1;
    if (more_calls != nullptr) *more_calls += 1;
    if (work != nullptr) *work = 0;
    if (gate != nullptr) *gate = 0;
  }
}

// The fused dispatch (kernel moelink::intranode::dispatch, and the
// receive-only launches of moelink::internode::dispatch): blocks
// [0, num_send_blocks) send as dispatch_send (a warp per token at a time)
// and set each record's flag (all blocks: a send-only launch); the other
// blocks (all: a receive-only launch) receive: received row (source s, slot
// j) is copied out once its record's flag shows this call, the rows
// visited source by source in chunks (interleaved), so they are copied while
// the later rows are still crossing NVLink. No end-of-send signal, no wait
// kernel. A wait that runs out marks the peer (its rows are poisoned, not
// waited for again) and records the error. `a` is the launch's
// __grid_constant__ parameter; the kernels' __launch_bounds__ is kThreads.
__device__ __forceinline__ void run_dispatch(const DispatchFusedParams& a) {
  const Ctx& c = a.send.c;
  const int lane = threadIdx.x % 32;
  const int R = c.num_ranks;
  const int nsend = a.num_send_blocks;
  const int kind = int(blockIdx.x) < nsend ? 0 : 1;  // sender or receiver
  stamp(a.prof, kind, 0);
  unsigned int* work = c.ticket + kSendWorkWord;
  if (int(blockIdx.x) < nsend) {
    if (a.barrier) sender_barrier(c, a.error);
    const uint64_t flag = call_flag(a.send_calls);
    // Tokens taken one at a time per warp (kSendWorkWord), one release each.
    // (Units of 2 and 4 tokens sharing one release were measured slower on
    // 4 x H200; docs/design-intranode.md, "Send unit".)
    bool first = true;
    for (int64_t t = next_unit(work, lane); t < a.send.num_tokens; t = next_unit(work, lane)) {
      send_token(a.send, t, lane, flag);
      if (first) stamp(a.prof, kind, 1);
      first = false;
    }
    stamp(a.prof, kind, 2);
  } else {
    const uint64_t flag = call_flag(a.recv_calls);
    const DispatchRecvParams& r = a.recv;
    const auto [warp, nwarps] = grid_warps(nsend);
    const InterleavedRows rows(r.rank_prefix_matrix, c.rank, R, 0, lane);
    const int64_t num_recv = rows.total();
    // Once any wait of this Buffer timed out, the counts themselves may be a
    // peer's stale row: every row is poisoned, none copied (as dispatch_recv).
    const bool poisoned = timed_out_peers(c) != 0;
    for (int64_t i = warp; poisoned && i < r.num_rows; i += nwarps) poison_row(r, i, lane);
    for (int64_t k = warp; !poisoned && k < rows.units; k += nwarps) {
      int s;
      int64_t j, i;
      if (!rows.row(k, s, j, i) || i >= r.num_rows) continue;
      const char* rec = c.local + c.dispatch_offset + (int64_t(s) * c.dispatch_slots + j) * r.rec.bytes;
      bool ok = true;
      if (lane == 0)
        ok = wait_record(c, record_flag(const_cast<char*>(rec), r.rec.bytes), flag, s,
                         comm::kWaitIntranodeDispatch, uint64_t(j), a.error);
      if (k == warp) stamp(a.prof, kind, 1);
      if (__shfl_sync(0xffffffffu, ok, 0))
        copy_out_row<true>(r, i, rec, lane);
      else
        poison_row(r, i, lane);
    }
    stamp(a.prof, kind, 2);
    // num_worst_tokens padding.
    for (int64_t i = num_recv + warp; !poisoned && i < r.num_rows; i += nwarps) pad_row(r, i, lane);
  }
  const bool sends = nsend > 0, receives = nsend < int(gridDim.x);
  fused_done(sends ? c.ticket : a.recv_ticket, sends ? a.send_calls : nullptr,
             receives ? a.recv_calls : nullptr, sends ? work : nullptr,
             a.barrier ? c.ticket + kBarrierGateWord : nullptr);
  stamp(a.prof, kind, 3);
}

}  // namespace moelink::intranode
