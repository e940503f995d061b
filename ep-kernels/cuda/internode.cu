// Internode dispatch / combine (docs/design-internode.md): R ranks in N nodes of
// L consecutive ranks. Peers of this rank's node are reached by memory channels
// (loads and stores), every other rank only by port channels (the CPU proxy).
//
// One region per rank (the same layout on every rank; offsets in XCtx, set per
// call by the host from the record sizes):
//
//   [0, 64K)         control: two halves (notify parity) of [R_src][R + N + E_local]
//                    int32 count rows (as intranode, plus tokens per node)
//   [64K, 128K)      notify staging: two halves of [R_dst][row] (rows put to other nodes)
//   dispatch half:   slots [R_src][T] NVL records (the intranode receive side, unchanged)
//                    xsend [N][T] cross-node records (this rank's, per destination node)
//                    xrecv [N][T] cross-node records (as forwarder, per source node)
//   combine half:    slots [R][T] combine records (from this node's ranks)
//                    fwd   [L][N][T] combine records (as forwarder: rows of this node's
//                          ranks for tokens of other nodes, by source token)
//                    psend [N][T] partial sums (as forwarder, per source node)
//                    precv [N][T] partial sums (per forwarding node)
//
// Dispatch of token t of source s (node m, local index l):
//   - to each rank of node m: the NVL record, stored straight into its slot (as intranode);
//   - to each other node n holding any of t's experts: ONE cross-node record (row, scales,
//     global top-k, weights, t, and the L slots of n's ranks) into xsend[n][node_head[t][n]];
//     the coordinator warp for n puts it, in chunks of C records in order, into the
//     forwarder f = n*L + l's xrecv[m], a port-channel signal after every chunk;
//   - the forwarder's waiter for source node m counts the signals (chunks landed);
//     its forward warps then store each record into the slot of every rank of node n
//     that receives it (local ids for that rank, flag after): the same record, in the
//     same slot, as a same-node sender would have written.
//   - every rank's receivers are intranode's (the fused dispatch's receive half, run_dispatch
//     of intranode.cuh): a receive-only launch of this file's dispatch kernel.
// Combine of token t of source s:
//   - a rank of s's node stores its row into s's combine slots (as intranode);
//   - a rank d of another node n stores its row into the forwarder f = n*L + l's
//     fwd[local(d)][m][t]; f sums the copies of t in ascending local rank (f32 from
//     +0.0), rounds to bf16 (weights: f32 sums), stages it in psend[m][idx] and its
//     coordinator puts the chunks into s's precv[n], a signal per chunk;
//   - s: out = bf16((bias0 + bias1) + partial(node 0) + partial(node 1) + ...), its own
//     node's partial computed from its slots and rounded alike
//     (ep_reference::normal::combine_internode, bit for bit).
// Flags and call counters are intranode's (records never reset, CUDA graphs
// replay). Chunks are ordered by the port channel: signal j means chunks
// 0..j-1 landed. Every wait is bounded and names the peer.
//
// Kernels (namespace moelink::internode, the names a profiler shows): notify
// (normal dispatch), cached_notify (the barrier of a cached dispatch and of a
// combine after a combine), dispatch (two concurrent launches per call: the
// send side, and the receive half on a side stream; XDispatchLaunch says
// which), combine.
#include <comm/port_channel_device.cuh>

#include "intranode.cuh"

namespace moelink::internode {

using intranode::CombineRecvParams;
using intranode::Ctx;
using intranode::RecordLayout;
using intranode::kThreads;
using intranode::kWarps;

constexpr int kMaxNodes = 16;

// Everything the internode kernels need beyond the intranode context;
// mirrored in Rust (ep_kernels::internode::XCtx).
struct XCtx {
  Ctx c;                                   // memory channels: this node's ranks only
  comm::PortChannelDeviceHandle* ports;    // [R]: the other nodes' ranks (zeroed for this node's)
  unsigned long long* landed;              // [2][kMaxNodes]: (call << 32 | chunks landed) per
                                           // peer node, dispatch (forwarder) and combine (source)
  uint64_t stage_offset;                   // notify staging (two halves of [R][row])
  uint64_t xsend_offset;                   // dispatch: [N][T] cross-node records
  uint64_t xrecv_offset;                   // dispatch: [N][T] cross-node records
  uint64_t fwd_offset;                     // combine: [L][N][T] combine records
  uint64_t psend_offset;                   // combine: [N][T] partial records
  uint64_t precv_offset;                   // combine: [N][T] partial records
  int64_t xslots;                          // T of the x regions (tokens per rank)
  int64_t meta_slots;                      // second dimension of fwd_meta (the dispatch's T)
  int32_t ranks_per_node;                  // L
  int32_t num_nodes;                       // N
  int32_t chunk;                           // C: records per put (1..32)
  int32_t pad;
};
static_assert(sizeof(XCtx) == 176, "mirrored in Rust");
static_assert(offsetof(XCtx, xslots) == 144, "mirrored in Rust");

struct XNotifyParams {
  XCtx x;
  const bool* is_token_in_rank;          // [N_tok, R]
  const int* num_tokens_per_expert;      // [E]
  int* rank_prefix_matrix;               // [R, R] out
  int* send_head;                        // [N_tok, R] out
  int* node_head;                        // [N_tok, nodes] out
  int* xcounts;                          // [2 * nodes] out: tokens to each node, records from each
  int* recv_rdma_rank_prefix_sum;        // [nodes] out, or null: inclusive prefix sum over source
                                         // nodes m of the tokens rank (m, this local rank) sends
                                         // to this node (m = this node: this rank's own tokens)
  int* host_counts;                      // host-mapped counts out
  unsigned long long* host_epoch;        // host-mapped, written last
  unsigned long long epoch_value;
  const int64_t* topk_idx;               // [N_tok, K] or null
  comm::DeviceError* error;
  int num_tokens;
  int experts_per_rank;
  int expert_alignment;
  int num_topk;
};
static_assert(sizeof(XNotifyParams) == 288, "mirrored in Rust");
static_assert(offsetof(XNotifyParams, recv_rdma_rank_prefix_sum) == 224, "mirrored in Rust");
static_assert(offsetof(XNotifyParams, num_tokens) == 272, "mirrored in Rust");

struct XDispatchParams {
  XCtx x;
  intranode::DispatchSendParams send;    // its Ctx is x.c
  RecordLayout xrec;                     // cross-node record: global ids; L slots; flag
  const int* node_head;                  // [N_tok, nodes]
  const int* xcounts;                    // [2 * nodes]
  int* fwd_meta;                         // [nodes][T][1 + L] out: source token and slots
  unsigned long long* calls;             // the dispatch send counter
  comm::DeviceError* error;
  int xslots_offset;                     // byte offset of the L slots in a cross-node record
  int num_send_blocks;                   // [0, n) send, block n coordinates, the rest forward
};
static_assert(sizeof(XDispatchParams) == 432, "mirrored in Rust");
static_assert(offsetof(XDispatchParams, send) == 176, "mirrored in Rust");
static_assert(offsetof(XDispatchParams, num_send_blocks) == 428, "mirrored in Rust");

// The one parameter of the dispatch kernel: its two launches per call run one
// role each, with that role's argument block.
constexpr int32_t kDispatchSendSide = 0;  // XDispatchParams: senders, coordinator, forwarders
constexpr int32_t kDispatchRecvHalf = 1;  // DispatchFusedParams: the fused receive half alone
union XDispatchRoleArgs {
  XDispatchParams send;
  intranode::DispatchFusedParams recv;
};
struct XDispatchLaunch {
  int32_t role;
  int32_t pad;
  XDispatchRoleArgs args;
};
static_assert(sizeof(XDispatchLaunch) == 440, "mirrored in Rust");
static_assert(offsetof(XDispatchLaunch, args) == 8, "mirrored in Rust");

struct XCombineParams {
  XCtx x;
  intranode::CombineSendParams send;     // its Ctx is x.c
  intranode::CombineRecvParams recv;
  const int* recv_src_idx;               // [rows]: source token of every received row
  const int* node_head;                  // [N_tok, nodes]
  const int* xcounts;                    // [2 * nodes]
  const int* fwd_meta;                   // [nodes][T][1 + L]
  unsigned long long* calls;             // the combine counter
  comm::DeviceError* error;
  int num_send_blocks;                   // [0, s) send rows
  int num_fwd_blocks;                    // [s, s + f) reduce for forwarding, then one
                                         // coordinating block, the rest receive
};
static_assert(sizeof(XCombineParams) == 504, "mirrored in Rust");
static_assert(offsetof(XCombineParams, recv) == 304, "mirrored in Rust");
static_assert(offsetof(XCombineParams, num_send_blocks) == 496, "mirrored in Rust");

using intranode::fence_acq_rel_sys;
using intranode::flag_value;
using intranode::peer_base;
using intranode::record_flag;
using intranode::timed_out_peers;

__device__ __forceinline__ int node_of(const XCtx& x, int r) { return r / x.ranks_per_node; }

__device__ __forceinline__ unsigned node_mask(const XCtx& x, int node) {
  const int L = x.ranks_per_node;
  const unsigned m = L == 32 ? 0xffffffffu : (1u << L) - 1;
  return m << (node * L);
}

__device__ __forceinline__ void mark_peer(const Ctx& c, int p) { atomicOr(c.ticket + 1, 1u << p); }

// Loads an int / int64 / float the proxy's copy engine wrote during this kernel.
__device__ __forceinline__ int ld_cg_i32(const void* p) { return __ldcg(reinterpret_cast<const int*>(p)); }
__device__ __forceinline__ int64_t ld_cg_i64(const void* p) {
  return __ldcg(reinterpret_cast<const long long*>(p));
}
__device__ __forceinline__ float ld_cg_f32(const void* p) { return __ldcg(reinterpret_cast<const float*>(p)); }

// A combine partial's flag with this bit set: its forwarder timed out waiting
// for a copy (a rank of its node) and sent NaN; the source names the forwarder.
// (flag_value's high word is kFlagMagic, below 2^31: the bit is free.)
constexpr uint64_t kPoisonedBit = 1ull << 63;

// What both internode data kernels derive from their context first: the
// thread's lane and warp in its block, the group's sizes (R ranks, L per node,
// N nodes, C records per chunk), this rank's node and place in it, and the
// call (the phase's device counter of completed calls) with its flag value.
struct XFrame {
  int lane, wib, R, L, N, C, my_node, my_local;
  uint64_t calls, flag;
};

__device__ __forceinline__ XFrame x_frame(const XCtx& x, const unsigned long long* calls) {
  const int L = x.ranks_per_node;
  const uint64_t n = *reinterpret_cast<const volatile unsigned long long*>(calls);
  return XFrame{int(threadIdx.x % 32), int(threadIdx.x / 32), x.c.num_ranks, L, x.num_nodes,
                x.chunk, x.c.rank / L, x.c.rank % L, n, intranode::flag_value(n)};
}

// The value `landed` holds once `chunks` chunks of call `calls` landed.
__device__ __forceinline__ bool has_landed(uint64_t v, uint64_t calls, int64_t chunks) {
  return (v >> 32) == (calls & 0xffffffffull) && int64_t(v & 0xffffffffull) >= chunks;
}

// Lane 0: waits until `chunks` chunks of call `calls` from peer `p` landed
// (published by the node's waiter warp). False if p timed out (or this wait did).
__device__ bool wait_landed(const Ctx& c, const unsigned long long* landed, uint64_t calls,
                            int64_t chunks, int p, comm::DeviceError* error, uint32_t kind,
                            uint64_t id) {
  comm::WaitClock clock(c.timeout_ns);
  uint64_t v = comm::load_acquire_sys(reinterpret_cast<const uint64_t*>(landed));
  while (!has_landed(v, calls, chunks)) {
    if (timed_out_peers(c) & (1u << p)) return false;
    if (clock.expired()) {
      mark_peer(c, p);
      comm::report_error(error, comm::kErrorTimeout, kind, c.rank, p, id, uint64_t(chunks),
                         v & 0xffffffffull);
      return false;
    }
    v = comm::load_acquire_sys(reinterpret_cast<const uint64_t*>(landed));
  }
  return true;
}

// The waiter of peer `p`'s stream (one thread): counts `chunks` signals of its
// port channel, publishing (calls << 32 | j) after the j-th.
__device__ void count_chunks(const XCtx& x, int p, int64_t chunks, uint64_t calls,
                             unsigned long long* landed) {
  const Ctx& c = x.c;
  for (int64_t j = 1; j <= chunks; ++j) {
    if (!x.ports[p].wait(c.timeout_ns)) {
      mark_peer(c, p);
      return;
    }
    comm::store_release_sys(reinterpret_cast<uint64_t*>(landed), (calls << 32) | uint64_t(j));
  }
}

// The coordinator of one stream (a whole warp): for each chunk of `count`
// records at `src_offset` (stride `bytes`) in order, waits until this rank's
// warps flagged every record of it (flag `flag`), then puts it to `dst_offset`
// of peer `p` with a signal. Returns false on a timeout (recorded).
__device__ bool put_chunks(const XCtx& x, int p, int64_t count, uint64_t src_offset,
                           uint64_t dst_offset, int64_t bytes, uint64_t flag,
                           comm::DeviceError* error, int lane, int node) {
  const Ctx& c = x.c;
  const int C = x.chunk;
  for (int64_t first = 0; first < count; first += C) {
    const int n = int(min(int64_t(C), count - first));
    bool ok = true;
    if (lane < n) {
      const uint64_t* f = record_flag(c.local + src_offset + (first + lane) * bytes, bytes);
      // This rank's own warps write these records; they stall only behind a
      // peer (combine: the forwarders wait for the node-mates' copies, then
      // flag even a NaN partial). Both waits bounded alike, this one fired
      // first in the killed-rank 2 x 2 run (4 x H200: node-mate rank 3 dead,
      // the report named rank 0, the stream's peer). So it yields to any
      // peer's timeout and is bounded by twice a peer wait.
      comm::WaitClock clock(c.timeout_ns > INT64_MAX / 2 ? INT64_MAX : 2 * c.timeout_ns);
      uint64_t v;
      while (((v = comm::load_acquire_sys(f)) & ~kPoisonedBit) != flag) {
        if ((clock.polls & 1023u) == 0 && timed_out_peers(c) != 0) {
          ok = false;
          break;
        }
        if (clock.expired()) {
          comm::report_error(error, comm::kErrorTimeout, comm::kWaitInternodeLocal, c.rank, p,
                             (uint64_t(node) << 32) | uint64_t(first / C), flag, v);
          ok = false;
          break;
        }
      }
    }
    if (__ballot_sync(0xffffffffu, !ok) != 0) return false;
    if (lane == 0) {
      __threadfence_system();
      x.ports[p].put_with_signal(dst_offset + first * bytes, src_offset + first * bytes,
                                 uint64_t(n) * bytes);
    }
    __syncwarp();
  }
  return true;
}

__device__ __forceinline__ int64_t chunks_of(int64_t count, int C) { return (count + C - 1) / C; }

// The coordinating block of a dispatch (`a`: XDispatchParams) or, with the
// streams `Reversed`, of a combine (XCombineParams). One stream per peer
// node, between this rank and the rank of the same local index there: warp n
// puts the one to node n, its a.xcounts[n] (reversed: [N + n]) records of
// `bytes` from slot n of `send_offset` (here) into slot [this node] of
// `recv_offset` (there); warp N + m counts the chunks of the one from node m,
// a.xcounts[N + m] (reversed: [m]) records, into landed[m]. (`bytes` by
// reference: loaded in the put branch only.)
template <bool Reversed, typename Params>
__device__ __forceinline__ void coordinate(const Params& a, uint64_t send_offset, uint64_t recv_offset,
                                           const int64_t& bytes, uint64_t calls, uint64_t flag,
                                           unsigned long long* landed, int C, int my_node, int my_local,
                                           int wib, int lane) {
  const XCtx& x = a.x;
  const int L = x.ranks_per_node, N = x.num_nodes;
  if (wib < N && wib != my_node) {
    const int n = wib;
    put_chunks(x, n * L + my_local, a.xcounts[Reversed ? N + n : n],
               send_offset + uint64_t(n) * x.xslots * bytes,
               recv_offset + uint64_t(my_node) * x.xslots * bytes, bytes, flag, a.error, lane, n);
  } else if (wib >= N && wib < 2 * N && wib - N != my_node && lane == 0) {
    const int m = wib - N;
    count_chunks(x, m * L + my_local, chunks_of(a.xcounts[Reversed ? m : N + m], C), calls, landed + m);
  }
}

// The records this rank forwards (dispatch) or reduces for forwarding
// (combine), as units for the warps: unit u is record u / (N - 1) of the
// (u % (N - 1))-th other node, so the source nodes advance together.
struct ForwardUnits {
  const XCtx& x;
  const int* xcounts;  // [2 * N]: [N + m] records from source node m
  int my_node;
  int64_t count;       // units (some past a node's records)

  __device__ __forceinline__ ForwardUnits(const XCtx& x_, const int* xcounts_, int my_node_)
      : x(x_), xcounts(xcounts_), my_node(my_node_) {
    int most = 0;
    for (int m = 0; m < x.num_nodes; ++m)
      if (m != my_node) most = max(most, xcounts[x.num_nodes + m]);
    count = int64_t(x.num_nodes - 1) * most;
  }

  // Unit u: source node m and record idx; false past m's records (or the
  // region's slots).
  __device__ __forceinline__ bool unit(int64_t u, int& m, int64_t& idx) const {
    const int others = x.num_nodes - 1;
    const int k = int(u % others);
    m = k < my_node ? k : k + 1;
    idx = u / others;
    return idx < xcounts[x.num_nodes + m] && idx < x.xslots && idx < x.meta_slots;
  }
};

// notify: one block. As intranode's notify (intranode.cu), plus:
// node_head[t][n] (the token's index in this rank's cross-node stream to node
// n, -1 for this node and for nodes it does not go to), the count rows
// carrying the tokens per node, rows to other nodes staged and put through
// the port channels (a signal each: the barrier), and xcounts: [n] tokens to
// node n, [N + m] records this rank forwards from source node m; and, if
// asked for, recv_rdma_rank_prefix_sum.
__global__ void __launch_bounds__(intranode::kNotifyThreads) notify(const __grid_constant__ XNotifyParams a) {
  using namespace intranode;
  const XCtx& x = a.x;
  const Ctx& c = x.c;
  const int num_tokens = a.num_tokens, epr = a.experts_per_rank, K = a.num_topk;
  __shared__ int warp_sums[32];
  __shared__ int scan_sums[kNotifyThreads / 32][kSlotRanks];
  __shared__ int sent[kMaxRanks];
  __shared__ int sent_node[kMaxNodes];
  __shared__ int sent_own;  // tokens to this rank's own node (recv_rdma_rank_prefix_sum)
  __shared__ uint64_t parity_s;
  __shared__ unsigned long long first_bad;
  const int R = c.num_ranks, rank = c.rank, N = x.num_nodes, L = x.ranks_per_node;
  const int my_node = rank / L, my_local = rank % L;
  const int row_len = R + N + epr;
  if (threadIdx.x == 0) {
    parity_s = *c.epoch & 1;
    first_bad = ~0ull;
  }
  __syncthreads();
  const int per_thread = (num_tokens + kNotifyThreads - 1) / kNotifyThreads;
  const int t0 = min(num_tokens, int(threadIdx.x) * per_thread);
  const int t1 = min(num_tokens, t0 + per_thread);
  const int64_t num_experts = int64_t(epr) * R;
  find_bad_expert_id(a.topk_idx, int64_t(num_tokens) * K, num_experts, &first_bad);
  const bool* in_rank = a.is_token_in_rank;
  send_slots(in_rank, a.send_head, num_tokens, R, scan_sums, sent);
  for (int n = 0; n < N; ++n) {
    auto goes = [&](int t) {
      if (n == my_node) return false;
      for (int l = 0; l < L; ++l)
        if (in_rank[int64_t(t) * R + n * L + l]) return true;
      return false;
    };
    int count = 0;
    for (int t = t0; t < t1; ++t) count += goes(t) ? 1 : 0;
    int total;
    int idx = block_exclusive_scan(count, warp_sums, total);
    for (int t = t0; t < t1; ++t) a.node_head[int64_t(t) * N + n] = goes(t) ? idx++ : -1;
    if (threadIdx.x == 0) sent_node[n] = total;
  }
  if (a.recv_rdma_rank_prefix_sum != nullptr) {  // the same on every thread
    int count = 0;
    for (int t = t0; t < t1; ++t) {
      bool any = false;
      for (int l = 0; l < L; ++l) any = any || in_rank[int64_t(t) * R + my_node * L + l];
      count += any ? 1 : 0;
    }
    int total;
    block_exclusive_scan(count, warp_sums, total);
    if (threadIdx.x == 0) sent_own = total;
  }
  __syncthreads();
  report_bad_expert_id(a.topk_idx, K, num_experts, first_bad, rank, a.error);
  const uint64_t half = parity_s * kCtrlHalfBytes;
  // Count rows: same-node ranks (and this one) by stores, other nodes' ranks
  // into the staging rows (put below).
  for (int i = threadIdx.x; i < R * row_len; i += blockDim.x) {
    const int d = i / row_len, j = i % row_len;
    const int v = j < R ? sent[j]
                        : j < R + N ? sent_node[j - R] : a.num_tokens_per_expert[d * epr + (j - R - N)];
    int* row = d / L == my_node
                   ? reinterpret_cast<int*>(peer_base(c, d) + half) + rank * row_len
                   : reinterpret_cast<int*>(c.local + x.stage_offset + half) + d * row_len;
    row[j] = v;
  }
  __threadfence_system();
  __syncthreads();
  // The barrier with every peer: a signal (after the row, over a port
  // channel: with it) and a wait each.
  {
    const int p = threadIdx.x;
    if (p < R && p != rank) {
      if (p / L == my_node) {
        c.channels[p].signal();
        if (!c.channels[p].wait(c.timeout_ns)) mark_peer(c, p);
      } else {
        const uint64_t bytes = uint64_t(row_len) * 4;
        x.ports[p].put_with_signal(half + uint64_t(rank) * bytes,
                                   x.stage_offset + half + uint64_t(p) * bytes, bytes);
        if (!x.ports[p].wait(c.timeout_ns)) mark_peer(c, p);
      }
    }
  }
  __syncthreads();
  const int* ctrl = reinterpret_cast<const int*>(c.local + half);
  for (int j = threadIdx.x; j < R; j += blockDim.x) {
    int acc = 0;
    for (int s = 0; s < R; ++s) {
      acc += __ldcg(ctrl + s * row_len + j);
      a.rank_prefix_matrix[s * R + j] = acc;
    }
    if (j == rank) a.host_counts[0] = acc;
  }
  for (int e = threadIdx.x; e < epr; e += blockDim.x) {
    int acc = 0;
    for (int s = 0; s < R; ++s) acc += __ldcg(ctrl + s * row_len + R + N + e);
    a.host_counts[1 + e] = (acc + a.expert_alignment - 1) / a.expert_alignment * a.expert_alignment;
  }
  for (int n = threadIdx.x; n < N; n += blockDim.x) {
    a.xcounts[n] = sent_node[n];
    a.xcounts[N + n] = n == my_node ? 0 : __ldcg(ctrl + (n * L + my_local) * row_len + R + my_node);
  }
  if (a.recv_rdma_rank_prefix_sum != nullptr && threadIdx.x == 0) {
    // Inclusive, over source nodes m: xcounts[N + m]'s value, this rank's own
    // tokens to its node for m = my_node.
    int acc = 0;
    for (int m = 0; m < N; ++m) {
      acc += m == my_node ? sent_own : __ldcg(ctrl + (m * L + my_local) * row_len + R + my_node);
      a.recv_rdma_rank_prefix_sum[m] = acc;
    }
  }
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    *c.epoch += 1;
    __threadfence_system();
    *reinterpret_cast<volatile unsigned long long*>(a.host_epoch) = a.epoch_value;
  }
}

// cached_notify: one signal to and one wait for every peer (memory channels
// inside the node, port channels across): the barrier before a cached
// dispatch and before a combine that follows a combine (DeepEP's kernel in
// that place is its cached_notify, so profiles of both read alike).
__global__ void cached_notify(const __grid_constant__ XCtx x) {
  const Ctx& c = x.c;
  const int p = threadIdx.x, L = x.ranks_per_node;
  if (p >= c.num_ranks || p == c.rank) return;
  if (p / L == c.rank / L) {
    c.channels[p].signal();
    if (!c.channels[p].wait(c.timeout_ns)) mark_peer(c, p);
  } else {
    x.ports[p].signal();
    if (!x.ports[p].wait(c.timeout_ns)) mark_peer(c, p);
  }
}

// The send side of a dispatch (the receive side is intranode's fused receive
// half, run_dispatch). Blocks [0, num_send_blocks): a warp
// per token: the NVL records to this node's ranks, one cross-node record per
// other node (flag after, in this rank's xsend). Block num_send_blocks: warp n
// puts node n's stream in chunks (put_chunks); warp N + m counts source node
// m's chunks (count_chunks). The other blocks forward: each landed cross-node
// record into the slots of this node's ranks that receive it, and its source
// token and slots into fwd_meta (for combine). `a` is a field of the
// launch's __grid_constant__ parameter.
__device__ __forceinline__ void send_side(const XDispatchParams& a) {
  using namespace intranode;
  const XCtx& x = a.x;
  const Ctx& c = x.c;
  const auto [lane, wib, R, L, N, C, my_node, my_local, calls, flag] = x_frame(x, a.calls);
  const RecordLayout& rec = a.send.rec;
  const RecordLayout& xrec = a.xrec;
  const int K = rec.num_topk;
  const int nsend = a.num_send_blocks;
  if (int(blockIdx.x) < nsend) {
    const DispatchSendParams& s = a.send;
    const unsigned mine = node_mask(x, my_node);
    const int64_t warp = int64_t(blockIdx.x) * kWarps + wib;
    for (int64_t t = warp; t < s.num_tokens; t += int64_t(nsend) * kWarps) {
      send_token(s, t, lane, flag, mine);
      const char* row = s.x + t * rec.hidden_bytes;
      for (int n = 0; n < N; ++n) {
        const int idx = a.node_head[t * N + n];
        if (idx < 0) continue;
        char* r = c.local + x.xsend_offset + (int64_t(n) * x.xslots + idx) * xrec.bytes;
        warp_copy16(r, row, rec.hidden_bytes, lane);
        float* sc = reinterpret_cast<float*>(r + rec.hidden_bytes);
        for (int j = lane; j < rec.num_scales; j += 32)
          sc[j] = s.scales[t * s.scale_stride0 + j * s.scale_stride1];
        if (lane < K) {
          reinterpret_cast<int64_t*>(r + xrec.idx_offset)[lane] = s.topk_idx[t * K + lane];
          // Always written (0 without weights): the forwarder masks and copies them.
          reinterpret_cast<float*>(r + xrec.w_offset)[lane] =
              s.topk_weights != nullptr ? s.topk_weights[t * K + lane] : 0.f;
        }
        if (lane == 0) *reinterpret_cast<int*>(r + xrec.src_offset) = int(t);
        if (lane < L)
          reinterpret_cast<int*>(r + a.xslots_offset)[lane] = s.send_head[t * R + n * L + lane];
        __syncwarp();
        if (lane == 0) {
          fence_acq_rel_sys();
          comm::store_relaxed_sys(record_flag(r, xrec.bytes), flag);
        }
      }
    }
  } else if (int(blockIdx.x) == nsend) {
    // Streams of cross-node records: to node n, a.xcounts[n]; from node m, a.xcounts[N + m].
    coordinate<false>(a, x.xsend_offset, x.xrecv_offset, xrec.bytes, calls, flag,
                      x.landed /* dispatch: [0, kMaxNodes) */, C, my_node, my_local, wib, lane);
  } else {
    // Forwarders: unit u is record u / (N - 1) of the u % (N - 1)-th other node.
    const ForwardUnits units(x, a.xcounts, my_node);
    const int nfwd = int(gridDim.x) - nsend - 1;
    const int64_t warp = int64_t(blockIdx.x - nsend - 1) * kWarps + wib;
    for (int64_t u = warp; u < units.count; u += int64_t(nfwd) * kWarps) {
      int m;
      int64_t idx;
      if (!units.unit(u, m, idx)) continue;
      const int src = m * L + my_local;
      bool ok = true;
      if (lane == 0)
        ok = wait_landed(c, x.landed + m, calls, idx / C + 1, src, a.error,
                         comm::kWaitInternodeChunk, uint64_t(idx / C));
      if (!__shfl_sync(0xffffffffu, ok, 0)) continue;
      const char* r = c.local + x.xrecv_offset + (int64_t(m) * x.xslots + idx) * xrec.bytes;
      const int t = ld_cg_i32(r + xrec.src_offset);
      const int my_slot = lane < L ? ld_cg_i32(r + a.xslots_offset + 4 * lane) : -1;
      int* fwd_meta_row = a.fwd_meta + (int64_t(m) * x.meta_slots + idx) * (1 + L);
      if (lane == 0) fwd_meta_row[0] = t;
      if (lane < L) fwd_meta_row[1 + lane] = my_slot;
      int64_t my_id = -1;
      float my_w = 0.f;
      if (lane < K) {
        my_id = ld_cg_i64(r + xrec.idx_offset + 8 * lane);
        my_w = ld_cg_f32(r + xrec.w_offset + 4 * lane);
      }
      unsigned dests = __ballot_sync(0xffffffffu, my_slot >= 0);
      while (dests) {
        const int l = __ffs(dests) - 1;
        dests &= dests - 1;
        const int d = my_node * L + l;
        const int64_t slot = __shfl_sync(0xffffffffu, my_slot, l);
        char* dst = peer_base(c, d) + c.dispatch_offset + (int64_t(src) * c.dispatch_slots + slot) * rec.bytes;
        warp_copy16<true>(dst, r, rec.hidden_bytes, lane);
        const float* sc = reinterpret_cast<const float*>(r + rec.hidden_bytes);
        float* dsc = reinterpret_cast<float*>(dst + rec.hidden_bytes);
        for (int j = lane; j < rec.num_scales; j += 32) dsc[j] = __ldcg(sc + j);
        if (lane < K) {
          const int64_t first = int64_t(d) * a.send.experts_per_rank;
          const bool in = my_id >= first && my_id < first + a.send.experts_per_rank;
          reinterpret_cast<int64_t*>(dst + rec.idx_offset)[lane] = in ? my_id - first : -1;
          reinterpret_cast<float*>(dst + rec.w_offset)[lane] = in ? my_w : 0.f;
        }
        if (lane == 0) *reinterpret_cast<int*>(dst + rec.src_offset) = t;
      }
      __syncwarp();
      if (my_slot >= 0) {
        fence_acq_rel_sys();
        char* dst = peer_base(c, my_node * L + lane) + c.dispatch_offset +
                    (int64_t(src) * c.dispatch_slots + my_slot) * rec.bytes;
        comm::store_relaxed_sys(record_flag(dst, rec.bytes), flag);
      }
    }
  }
  fused_done(c.ticket, a.calls, nullptr);
}

// dispatch: one kernel for both launches of a dispatch, the send side on the
// caller's stream and the receive half on a side stream, at once (so a
// profiler shows one name, moelink::internode::dispatch, twice per call).
__global__ void __launch_bounds__(intranode::kThreads) dispatch(const __grid_constant__ XDispatchLaunch a) {
  if (a.role == kDispatchSendSide)
    send_side(a.args.send);
  else if (a.role == kDispatchRecvHalf)
    intranode::run_dispatch(a.args.recv);
}

// Adds the bf16 row at `p` (vector v of 8) to acc.
template <bool Fresh>
__device__ __forceinline__ void add_row8(float* acc, const __nv_bfloat16* row, int v) {
  const int4 w = comm::ld_vec<Fresh>(reinterpret_cast<const int4*>(row) + v);
  const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&w);
#pragma unroll
  for (int k = 0; k < 8; ++k) acc[k] += __bfloat162float(e[k]);
}

// Vector v (8 bf16) of the rows of the sources in `srcs`, summed in f32 in
// ascending order from +0.0 into p; row_of(d): source d's row.
template <typename RowOf>
__device__ __forceinline__ void sum_rows8(float* p, unsigned srcs, int v, RowOf row_of) {
#pragma unroll
  for (int k = 0; k < 8; ++k) p[k] = 0.f;
  while (srcs) {
    const int d = __ffs(srcs) - 1;
    srcs &= srcs - 1;
    add_row8<true>(p, reinterpret_cast<const __nv_bfloat16*>(row_of(d)), v);
  }
}

// The f32 at byte `offset` of the records of the sources in `srcs`, summed in
// ascending order from +0.0; rec_of(d): source d's record.
template <typename RecOf>
__device__ __forceinline__ float sum_f32(unsigned srcs, int64_t offset, RecOf rec_of) {
  float p = 0.f;
  while (srcs) {
    const int d = __ffs(srcs) - 1;
    srcs &= srcs - 1;
    p += ld_cg_f32(rec_of(d) + offset);
  }
  return p;
}

// The combine of token t at its source (one warp; the copies from this
// node's ranks and the partials of the other nodes have arrived):
// out[t] = bf16((bias0 + bias1) + sum over nodes n ascending of p_n), where
// this node's p is bf16(sum of its copies, ascending rank, from +0.0) and
// another node's is its forwarder's partial; weights likewise in f32.
__device__ void reduce_token_x(const XCombineParams& a, int64_t t, unsigned own_srcs,
                               const int* my_slots, int lane) {
  const XCtx& x = a.x;
  const Ctx& c = x.c;
  const CombineRecvParams& r = a.recv;
  const int N = x.num_nodes, L = x.ranks_per_node, my_node = c.rank / L;
  const int hidden = r.hidden, K = r.num_topk;
  const int64_t rb = r.record_bytes, row_bytes = int64_t(hidden) * 2;
  const int nvec = hidden / 8;
  // The record of this node's rank d.
  const auto own_rec = [&](int d) {
    return c.local + c.combine_offset + (int64_t(d) * c.combine_slots + my_slots[d]) * rb;
  };
  for (int v = lane; v < nvec; v += 32) {
    float acc[8];
    {
      int4 b0 = make_int4(0, 0, 0, 0), b1 = make_int4(0, 0, 0, 0);
      if (r.bias0 != nullptr) b0 = comm::ld_nc(reinterpret_cast<const int4*>(r.bias0 + t * hidden) + v);
      if (r.bias1 != nullptr) b1 = comm::ld_nc(reinterpret_cast<const int4*>(r.bias1 + t * hidden) + v);
      const __nv_bfloat16* p0 = reinterpret_cast<const __nv_bfloat16*>(&b0);
      const __nv_bfloat16* p1 = reinterpret_cast<const __nv_bfloat16*>(&b1);
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[k] = __bfloat162float(p0[k]) + __bfloat162float(p1[k]);
    }
    for (int n = 0; n < N; ++n) {
      if (n == my_node) {
        if (own_srcs == 0) continue;
        float p[8];
        sum_rows8(p, own_srcs, v, own_rec);
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[k] += __bfloat162float(__float2bfloat16_rn(p[k]));
      } else {
        const int idx = a.node_head[t * N + n];
        if (idx < 0) continue;
        const char* rec = c.local + x.precv_offset + (int64_t(n) * x.xslots + idx) * rb;
        add_row8<true>(acc, reinterpret_cast<const __nv_bfloat16*>(rec), v);
      }
    }
    int4 o;
    __nv_bfloat16* po = reinterpret_cast<__nv_bfloat16*>(&o);
#pragma unroll
    for (int k = 0; k < 8; ++k) po[k] = __float2bfloat16_rn(acc[k]);
    reinterpret_cast<int4*>(r.out + t * hidden)[v] = o;
  }
  if (r.out_weights != nullptr && lane < K) {
    float acc = 0.f;
    for (int n = 0; n < N; ++n) {
      if (n == my_node) {
        if (own_srcs == 0) continue;
        acc += sum_f32(own_srcs, row_bytes + 4 * lane, own_rec);
      } else {
        const int idx = a.node_head[t * N + n];
        if (idx < 0) continue;
        const char* rec = c.local + x.precv_offset + (int64_t(n) * x.xslots + idx) * rb;
        acc += ld_cg_f32(rec + row_bytes + 4 * lane);
      }
    }
    r.out_weights[t * K + lane] = acc;
  }
}

// combine: one launch. Blocks [0, num_send_blocks) send every
// received row: to its source's combine slots if the source is on this node,
// else to the forwarder's fwd region (by source node and token). Blocks
// [num_send_blocks, + num_fwd_blocks) reduce, per record this rank forwarded
// in the dispatch (fwd_meta), the copies of this node's ranks into one bf16
// partial (psend). The next block: warp m puts source node m's partials in
// chunks; warp N + n counts node n's partial chunks. The rest: a warp per
// token of this rank (reduce_token_x) once its copies and partials are in.
__global__ void __launch_bounds__(intranode::kThreads) combine(const __grid_constant__ XCombineParams a) {
  using namespace intranode;
  const XCtx& x = a.x;
  const Ctx& c = x.c;
  const auto [lane, wib, R, L, N, C, my_node, my_local, calls, flag] = x_frame(x, a.calls);
  const int64_t rb = a.send.record_bytes;
  const int K = a.send.num_topk;
  const int nsend = a.num_send_blocks, nfwd = a.num_fwd_blocks;
  const int b = int(blockIdx.x);
  __shared__ int slots[kWarps][kMaxRanks];
  if (b < nsend) {
    const CombineSendParams& s = a.send;
    const int64_t warp = int64_t(b) * kWarps + wib;
    const InterleavedRows rows(s.rank_prefix_matrix, c.rank, R, c.rank, lane);
    for (int64_t k = warp; k < rows.units; k += int64_t(nsend) * kWarps) {
      int src;
      int64_t slot, i;
      if (!rows.row(k, src, slot, i) || slot >= c.combine_slots) continue;
      if (src / L == my_node) {
        send_combine_row(s, i, src, slot, lane, flag);
        continue;
      }
      const int t = a.recv_src_idx[i];
      if (t < 0 || t >= x.xslots) continue;
      const int f = my_node * L + src % L;
      char* dst = peer_base(c, f) + x.fwd_offset +
                  ((int64_t(my_local) * N + src / L) * x.xslots + t) * rb;
      warp_copy16(dst, s.y + i * s.row_bytes, s.row_bytes, lane);
      if (s.topk_weights != nullptr && lane < K)
        reinterpret_cast<float*>(dst + s.row_bytes)[lane] = s.topk_weights[i * K + lane];
      __syncwarp();
      if (lane == 0) {
        fence_acq_rel_sys();
        comm::store_relaxed_sys(record_flag(dst, rb), flag);
      }
    }
  } else if (b < nsend + nfwd) {
    const ForwardUnits units(x, a.xcounts, my_node);
    const int64_t warp = int64_t(b - nsend) * kWarps + wib;
    const int64_t row_bytes = a.send.row_bytes;
    const int nvec = int(row_bytes / 16);
    for (int64_t u = warp; u < units.count; u += int64_t(nfwd) * kWarps) {
      int m;
      int64_t idx;
      if (!units.unit(u, m, idx)) continue;
      const int* meta = a.fwd_meta + (int64_t(m) * x.meta_slots + idx) * (1 + L);
      const int t = meta[0];
      const int my_slot = lane < L ? meta[1 + lane] : -1;
      const unsigned srcs = __ballot_sync(0xffffffffu, my_slot >= 0);
      // The copy of rank (this node, l).
      const auto copy_of = [&](int l) {
        return c.local + x.fwd_offset + ((int64_t(l) * N + m) * x.xslots + t) * rb;
      };
      // Lane l waits for the row of rank (this node, l).
      bool ok = true;
      if (my_slot >= 0) {
        ok = wait_record(c, record_flag(copy_of(lane), rb), flag, my_node * L + lane,
                         comm::kWaitInternodeForward, uint64_t(t), a.error);
      }
      const bool all_ok = __ballot_sync(0xffffffffu, !ok) == 0;
      char* out = c.local + x.psend_offset + (int64_t(m) * x.xslots + idx) * rb;
      for (int v = lane; v < nvec; v += 32) {
        int4 o;
        if (all_ok) {
          float p[8];
          sum_rows8(p, srcs, v, copy_of);
          __nv_bfloat16* po = reinterpret_cast<__nv_bfloat16*>(&o);
#pragma unroll
          for (int q = 0; q < 8; ++q) po[q] = __float2bfloat16_rn(p[q]);
        } else {
          o = make_int4(-1, -1, -1, -1);  // NaN: a copy never came
        }
        reinterpret_cast<int4*>(out)[v] = o;
      }
      if (lane < K) {
        const float p = sum_f32(srcs, row_bytes + 4 * lane, copy_of);
        reinterpret_cast<float*>(out + row_bytes)[lane] = all_ok ? p : __int_as_float(0x7fffffff);
      }
      __syncwarp();
      if (lane == 0) {
        fence_acq_rel_sys();
        comm::store_relaxed_sys(record_flag(out, rb), all_ok ? flag : flag | kPoisonedBit);
      }
    }
  } else if (b == nsend + nfwd) {
    // Streams of partials, the dispatch's reversed: to source node m the
    // a.xcounts[N + m] it forwarded, from node n the a.xcounts[n] sent there.
    coordinate<true>(a, x.psend_offset, x.precv_offset, rb, calls, flag, x.landed + kMaxNodes /* combine */,
                     C, my_node, my_local, wib, lane);
  } else {
    const CombineRecvParams& r = a.recv;
    const int nrecv = int(gridDim.x) - nsend - nfwd - 1;
    const int64_t warp = int64_t(b - nsend - nfwd - 1) * kWarps + wib;
    int* my_slots = slots[wib];
    const unsigned own = node_mask(x, my_node);
    for (int64_t t = warp; t < r.num_tokens; t += int64_t(nrecv) * kWarps) {
      const int my_slot = lane < R ? r.send_head[t * R + lane] : -1;
      const unsigned own_srcs = __ballot_sync(0xffffffffu, my_slot >= 0 && ((own >> lane) & 1u));
      bool ok = true;
      if (my_slot >= 0 && ((own >> lane) & 1u)) {
        const char* rec = c.local + c.combine_offset + (int64_t(lane) * c.combine_slots + my_slot) * rb;
        ok = wait_record(c, record_flag(const_cast<char*>(rec), rb), flag, lane,
                         comm::kWaitIntranodeCombine, uint64_t(my_slot), a.error);
      }
      // Lane n waits for node n's partial of t.
      if (lane < N && lane != my_node) {
        const int idx = a.node_head[t * N + lane];
        const int f = lane * L + my_local;
        if (idx >= 0)
          ok = ok && wait_landed(c, x.landed + kMaxNodes + lane, calls, int64_t(idx) / C + 1, f,
                                 a.error, comm::kWaitInternodeChunk, uint64_t(idx / C));
        if (idx >= 0 && ok) {
          // Landed, but poisoned by its forwarder: NaN here too, and the error
          // names the forwarder (which names the rank it waited for).
          char* rec = c.local + x.precv_offset + (int64_t(lane) * x.xslots + idx) * rb;
          const uint64_t v = uint64_t(ld_cg_i64(record_flag(rec, rb)));
          if (v != flag) {
            comm::report_error(a.error, comm::kErrorTimeout, comm::kWaitInternodePoisoned, c.rank,
                               f, (uint64_t(lane) << 32) | uint64_t(idx), flag, v);
            ok = false;
          }
        }
      }
      if (__ballot_sync(0xffffffffu, !ok) != 0) {
        poison_token(r, t, lane);
        continue;
      }
      share_slots(my_slots, my_slot, lane, R);
      reduce_token_x(a, t, own_srcs, my_slots, lane);
    }
  }
  fused_done(c.ticket, a.calls, nullptr);
}

}  // namespace moelink::internode
