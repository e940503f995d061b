// Low-latency dispatch / combine (the decode path), docs/design-low-latency.md.
//
// Every rank's low-latency buffer has the same layout (offsets in LlCtx):
//
//   flags     [2 parities][R sources] u64: call counters, one per (parity, peer);
//             at 1024 the release counts [R peers][2 parities] u64 (below); at
//             2048 / 3072 the outgoing values of both that the proxy copies
//             (same shapes)
//   zero-copy [E_local][R*T][H] bf16: get_next_low_latency_combine_buffer
//   recv[p]   dispatch: [R sources] inboxes of `inbox_bytes`:
//               header: E_local int32 counts and the number of messages
//               (padded to 16 bytes), then one message per token of the source
//               that has an expert on this rank, in token order: the token,
//               its (local expert, occurrence) pairs and the payload once
//             combine:  [R expert ranks] inboxes of `inbox_bytes`: bf16 rows,
//               one per (token, k) at its place (below)
//   stage[p]  (proxy transport only) the same shape as recv[p]: what this rank
//             sends to peer d is assembled in inbox d, then put in one piece
//
// Call n uses parity p = n & 1. The send half numbers its call from the send
// counter, the receive half from the receive counter, each advanced by its own
// half on the device (graph replays advance them too; the host never resets
// them but in clean), so a call's send may run while the previous call's
// receive is pending (a receive hook not yet called: SGLang's two-batch
// overlap): at most two calls in flight, one per parity. The send of call n
// writes the half of call n - 2 again, in the peer's buffer (and, proxy, our
// staging), so it first waits until the peer has finished receiving call
// n - 2: every LL kernel, at its start, publishes into each peer's release
// counts how many calls of each parity this rank has received (its receive
// counter: the kernels before it on the stream are done); the send half waits,
// per destination, for the count of its parity to reach (its calls on that
// parity) - 1, bounded like every wait (wait_release). Its own rank: the
// receive counter itself.
// Places are computed, not allocated. The dispatch message of token t to rank
// d is the (number of earlier tokens with an expert on d)-th of the inbox; its
// pair for slot k names the received row: row occurrence(t, k) = number of
// (t', k') before (t, k), token-major, with the same id, of block (expert,
// source). Combine returns that row to slot
//   prefix(e) = sum of s's counts for the experts of e's rank below e
//   + occurrence(t, k)
// of s's combine inbox on e's rank, and the source recomputes the same slot
// from topk_idx, so no slot map has to survive between the calls. Flags count calls: a sender adds one
// (proxy) or stores the count (NVLink) after its data; the receiver waits for
// flag >= the number of calls on this parity so far, so nothing is ever reset.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include <comm/copy_device.cuh>
#include <comm/port_channel_device.cuh>

namespace moelink::ll {

constexpr int kMaxRanks = 32;
constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxTopk = 32;
// Largest hidden size (LL_MAX_HIDDEN in Rust): at most 64 fp8 scales per
// token, two per lane of the copying warp (dispatch_recv).
constexpr int kMaxHidden = 8192;
static_assert(kMaxHidden / 128 <= 64, "dispatch_recv moves at most 64 scales per message");
// A dispatch message (one per token and destination rank): int4 {token, n, 0,
// 0}, then n <= K pairs {local expert, occurrence} (int2, in k order), padded
// to 16 bytes; then the payload (fp8 + scales, or bf16).
__host__ __device__ constexpr int msg_header_bytes(int num_topk) {
  return (16 + 8 * num_topk + 15) / 16 * 16;
}
// An inbox header: E_local int32 counts, then the number of messages, padded.
__host__ __device__ constexpr int64_t inbox_header_bytes(int experts_per_rank) {
  return (int64_t(experts_per_rank + 1) * 4 + 15) / 16 * 16;
}
// Flags region (FLAGS_BYTES = 4096 in Rust): incoming data flags [2 parities]
// [kMaxRanks] u64 at 0; incoming release counts [kMaxRanks peers][2 parities]
// u64 at kReleaseOffset (peer d's entry p: calls of parity p that d has
// finished receiving); the outgoing values of both (proxy transport: copied to
// the peer) at kOutFlagsOffset / kOutReleaseOffset.
constexpr uint64_t kReleaseOffset = 1024;
constexpr uint64_t kOutFlagsOffset = 2048;
constexpr uint64_t kOutReleaseOffset = 3072;
static_assert(kOutReleaseOffset + kMaxRanks * 16 <= 4096, "FLAGS_BYTES in Rust");
// `id` of the errors of the send half (kWaitLlDispatch / kWaitLlCombine): a
// wait for a peer's release of parity p is id kReleaseId + p (2, 3; a data
// flag's wait has id p); a whole call (send and receive in one launch) whose
// counters disagree (a call issued while a receive was pending: a graph
// replayed over a pending hook) is id kOrderId (kErrorInvalid; expected: the
// receive's call number, observed: the send's).
constexpr uint64_t kReleaseId = 2;
constexpr uint64_t kOrderId = 4;

// Mirrored in Rust (ep_kernels::low_latency::LlCtx).
struct LlCtx {
  char** peers;                            // [R] each rank's buffer as mapped here (own = local)
  comm::PortChannelDeviceHandle* ports;    // [R] (proxy transport) or null
  char* local;                             // this rank's buffer
  uint32_t* state;                         // local counters, see kState*
  int32_t* mask;                           // [R] 1 = masked rank
  comm::DeviceError* error;                // host-mapped record
  uint64_t zc_offset;                      // zero-copy region
  uint64_t recv_offset[2];                 // recv region per parity
  uint64_t stage_offset[2];                // staging region per parity (proxy)
  uint64_t timeout_ns;                     // bound of every receive wait
  int32_t rank;
  int32_t num_ranks;
  int32_t use_proxy;                       // bit d set: peer d through its port channel
                                           // (the proxy), else direct stores (NVLink)
  int32_t shrink;                          // 1: a silent peer is masked, not an error
  uint64_t* prof;                          // MOELINK_LL_PROFILE stamps (see stamp) or null
};
static_assert(sizeof(LlCtx) == 120, "mirrored in Rust");

// Whether peer d is reached through the proxy (never this rank): all peers
// (forced proxy, unmapped peers), none (NVLink), or across nodes only (mixed).
__device__ __forceinline__ bool proxied(const LlCtx& c, int d) {
  return d != c.rank && ((uint32_t(c.use_proxy) >> d) & 1u);
}

// `state` words (kStateWords, mirrored in Rust as STATE_WORDS): [0, 2) u64
// receive counter (receive halves done); [2] ticket of the receive half; [3]
// unused; [kStateDone, +32) per-destination arrivals of the send half;
// [kStateSend, +2) u64 send counter: send halves done << kSendShift (each
// block of a send half adds its share, send_share, the shares of a grid sum
// to 1 << kSendShift); [kStateReleased, +2) u64 the receive counter last
// published through the proxy (publish_release). All zero between kernels,
// except the counters (reset only by clean, with the flags).
constexpr int kStateTicket = 2;
constexpr int kStateDone = 4;
constexpr int kStateSend = kStateDone + kMaxRanks;
constexpr int kStateReleased = kStateSend + 2;
constexpr int kStateWords = kStateReleased + 2;
static_assert(kStateSend % 2 == 0 && kStateWords == 8 + kMaxRanks, "STATE_WORDS in Rust");
constexpr int kSendShift = 20;

struct DispatchArgs {
  const __nv_bfloat16* x;  // [N, H]
  const int64_t* topk;     // [N, K]
  void* recv_x;            // [E_local, R*T, H] fp8 or bf16
  void* recv_scales;       // f32 [E_local, G, R*T] or int32 [E_local, W, R*T] (ue8m0)
  int32_t* recv_count;     // [E_local]
  int32_t* src_info;       // [E_local, R*T]
  int64_t* layout_range;   // [E_local, R]
  int32_t* stats_count;    // [E_local] or null
  int64_t* stats_wait;     // [R] or null
  int64_t msg_bytes;
  int64_t inbox_bytes;
  int32_t num_tokens;
  int32_t max_tokens;
  int32_t hidden;
  int32_t num_topk;
  int32_t num_experts;
  int32_t use_fp8;
  int32_t round_scale;
  int32_t use_ue8m0;
  int32_t phases;  // 1 send, 2 receive, 3 both
  int32_t pad_;
};
static_assert(sizeof(DispatchArgs) == 128, "mirrored in Rust");

struct CombineArgs {
  const __nv_bfloat16* x;      // [E_local, R*T, H] expert outputs
  const int64_t* layout_range; // [E_local, R] of the dispatch
  const int64_t* topk;         // [N, K]
  const float* weights;        // [N, K]
  __nv_bfloat16* out;          // [N, H]
  int64_t* stats_wait;         // [R] or null
  int64_t inbox_bytes;
  int32_t num_tokens;
  int32_t max_tokens;
  int32_t hidden;
  int32_t num_topk;
  int32_t num_experts;
  int32_t phases;
};
static_assert(sizeof(CombineArgs) == 80, "mirrored in Rust");

// The kernels' argument blocks (const __grid_constant__), mirrored in Rust.
struct LlDispatchParams {
  LlCtx c;
  DispatchArgs a;
};
static_assert(sizeof(LlDispatchParams) == 248, "mirrored in Rust");
struct LlCombineParams {
  LlCtx c;
  CombineArgs a;
};
static_assert(sizeof(LlCombineParams) == 200, "mirrored in Rust");

// Optional phase stamps (MOELINK_LL_PROFILE=1, read by Buffer._ll_native().profile()):
// prof[kernel][block][slot], kernel 0 dispatch / 1 combine, written by thread 0
// of each block (or lane 0 of warp 0 for the per-warp slots): slots 0 and
// kProfSlots-1 the globaltimer (ns) at the start and the end, the others
// clock64 (1 at the start, kProfSlots-2 at the end; the rest at the phase
// boundaries marked by the stamp calls below; benches/ll_bench.py (run with
// MOELINK_LL_PROFILE=1) names them).
constexpr int kProfBlocks = 256;
constexpr int kProfSlots = 16;
__device__ __forceinline__ void stamp(const LlCtx& c, int kernel, int slot) {
  if (c.prof != nullptr && threadIdx.x == 0 && blockIdx.x < kProfBlocks) {
    const uint64_t v = (slot == 0 || slot == kProfSlots - 1) ? comm::now_ns() : uint64_t(clock64());
    c.prof[(int64_t(kernel) * kProfBlocks + blockIdx.x) * kProfSlots + slot] = v;
  }
}

using comm::ld_cg;
using comm::ld_nc;
using comm::st_na;
using comm::warp_copy16;

__device__ __forceinline__ int ld_cg_i32(const int* p) {
  int v;
  asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ uint64_t* flag_ptr(char* base, int parity, int src) {
  return reinterpret_cast<uint64_t*>(base) + parity * kMaxRanks + src;
}

// Calls on this parity so far, this one included (the value flags reach).
__device__ __forceinline__ uint64_t calls_on_parity(uint64_t seq) { return (seq + 1) >> 1; }

// Receive halves done on this rank (the receive counter).
__device__ __forceinline__ uint64_t recv_done(const LlCtx& c) {
  return *reinterpret_cast<volatile uint64_t*>(c.state);
}

// The number of the call whose send half this launch runs (from 1).
__device__ __forceinline__ uint64_t send_seq(const LlCtx& c) {
  return (*reinterpret_cast<volatile uint64_t*>(c.state + kStateSend) >> kSendShift) + 1;
}

// Calls of parity p among calls 1 .. done (what a rank that has received
// `done` calls releases on parity p).
__device__ __forceinline__ uint64_t released_calls(uint64_t done, int parity) {
  return parity ? (done + 1) >> 1 : done >> 1;
}

// Peer `peer`'s release count of `parity` in the buffer at `base`.
__device__ __forceinline__ uint64_t* release_ptr(char* base, int peer, int parity) {
  return reinterpret_cast<uint64_t*>(base + kReleaseOffset) + 2 * peer + parity;
}

// This block's share of a send half's advance of the send counter: the shares
// of the grid's blocks sum to 1 << kSendShift, and every partial sum is less,
// so the counter's call number (>> kSendShift) changes only with the last
// block's add, which follows its own reads: no block of the call reads the
// advanced number, whatever the order of the adds, and no block waits for an
// add (fire-and-forget).
__device__ __forceinline__ uint64_t send_share() {
  constexpr uint64_t whole = uint64_t(1) << kSendShift;
  return whole / gridDim.x + (blockIdx.x < whole % gridDim.x ? 1 : 0);
}

// One thread per block, after a barrier that follows every thread's read of
// the send counter (send_seq at kernel start): fence (orders those reads, by
// cumulativity through the barrier), then the block's add.
__device__ __forceinline__ void advance_send(const LlCtx& c) {
  __threadfence();
  atomicAdd(reinterpret_cast<unsigned long long*>(c.state + kStateSend),
            static_cast<unsigned long long>(send_share()));
}

__device__ __forceinline__ bool is_masked(const LlCtx& c, int r) {
  return *reinterpret_cast<volatile int32_t*>(c.mask + r) != 0;
}

// Whether the send half writes to peer d: not masked, and its release did not
// time out (bit d of `blocked`, shared memory, written before a barrier).
__device__ __forceinline__ bool can_send(const LlCtx& c, int d, const uint32_t* blocked) {
  return !is_masked(c, d) && ((*blocked >> d) & 1u) == 0;
}

// Every LL kernel's first act (one warp, lane s for peer s): publishes into
// every unmasked peer's release counts (this rank's entry, both parities) the
// calls this rank has finished receiving, `done` = the receive counter at
// kernel start (the receive halves before this kernel on the stream are done,
// so they no longer read their inboxes). NVLink: two relaxed stores per peer
// (nothing of ours to order: the reads they release are complete); the values
// only grow, so rewriting the same ones every kernel is harmless. Proxy: the
// values into the outgoing slot, then a put, only when `done` changed since the
// last publication (kStateReleased); a put that copies a newer value than the
// one it was pushed for is still a valid (larger) count.
__device__ void publish_release(const LlCtx& c, uint64_t done) {
  const int lane = threadIdx.x % 32;
  const uint64_t v0 = released_calls(done, 0), v1 = released_calls(done, 1);
  for (int s = lane; s < c.num_ranks; s += 32) {
    if (s == c.rank || is_masked(c, s) || proxied(c, s)) continue;
    uint64_t* p = release_ptr(c.peers[s], c.rank, 0);
    comm::store_relaxed_sys(p, v0);
    comm::store_relaxed_sys(p + 1, v1);
  }
  if (c.use_proxy == 0) return;
  volatile uint64_t* last = reinterpret_cast<volatile uint64_t*>(c.state + kStateReleased);
  if (*last == done) return;
  for (int s = lane; s < c.num_ranks; s += 32) {
    if (s == c.rank || is_masked(c, s) || !proxied(c, s)) continue;
    volatile uint64_t* out = reinterpret_cast<volatile uint64_t*>(c.local + kOutReleaseOffset) + 2 * s;
    out[0] = v0;
    out[1] = v1;
    __threadfence_system();
    c.ports[s].put(kReleaseOffset + uint64_t(c.rank) * 16, kOutReleaseOffset + uint64_t(s) * 16, 16);
  }
  __syncwarp();
  if (lane == 0) *last = done;
}

// The send half's first look at the release counts, issued at kernel start
// with the counters' loads: thread p * 32 + d (p = 0, 1; d < R) loads peer d's
// count of parity p (acquire: our writes to its half follow its reads), its
// own rank's from the receive counter (`done`).
__device__ __forceinline__ uint64_t release_poll(const LlCtx& c, uint64_t done) {
  const int d = threadIdx.x % 32, p = threadIdx.x / 32;
  if (p >= 2 || d >= c.num_ranks) return 0;
  if (d == c.rank) return released_calls(done, p);
  return comm::load_acquire_sys(release_ptr(c.local, d, p));
}

// Waits (thread parity * 32 + d, which loaded `polled` in release_poll) until
// peer d has received call seq - 2 (the last call on this parity), at most
// `timeout_ns` of GPU time: on timeout the peer is masked (shrink) or an error
// recorded (rank, peer, id kReleaseId + parity, wanted and seen counts) and
// bit d of `blocked` set, so this block writes nothing to d. A masked peer is
// not waited for (nothing is sent to it). Every block waits for itself before
// its first write (a barrier after this). Other threads return at once.
__device__ void wait_release(const LlCtx& c, uint64_t seq, uint64_t polled, uint32_t* blocked,
                             uint32_t kind) {
  const int parity = int(seq & 1);
  const int d = threadIdx.x % 32;
  if (int(threadIdx.x) / 32 != parity || d >= c.num_ranks) return;
  const uint64_t want = calls_on_parity(seq) - 1;
  uint64_t v = polled;
  if (v >= want) return;
  comm::WaitClock clock(c.timeout_ns > uint64_t(INT64_MAX) ? INT64_MAX : int64_t(c.timeout_ns));
  while (v < want) {
    if (is_masked(c, d)) return;
    if (clock.expired()) {
      if (c.shrink) {
        atomicExch(c.mask + d, 1);
      } else {
        comm::report_error(c.error, comm::kErrorTimeout, kind, c.rank, d,
                           kReleaseId + uint64_t(parity), want, v);
        atomicOr(blocked, 1u << d);
      }
      return;
    }
    v = d == c.rank ? released_calls(recv_done(c), parity)
                    : comm::load_acquire_sys(release_ptr(c.local, d, parity));
  }
}

// What every LL kernel reads at its start (every thread): the call numbers of
// its halves and the first release poll. Block 0's last warp then publishes
// the release counts (block 0: the first to be resident, so a kernel whose
// other blocks wait for peers' releases never keeps its own from being
// published; its stall, one load of the receive counter, overlaps the loads
// the block waits for anyway). A launch of both halves whose counters
// disagree (a whole call issued while another call's receive was pending; the
// host refuses that, a CUDA graph replayed over a pending hook cannot be
// refused) is reported by block 0 (kErrorInvalid, id kOrderId).
struct Start {
  uint64_t send_seq;  // phases & 1
  uint64_t recv_seq;  // the receive counter + 1
  uint64_t release;   // release_poll (phases & 1)
};
__device__ __forceinline__ Start kernel_start(const LlCtx& c, int phases, uint32_t kind,
                                              uint32_t* blocked) {
  Start s;
  const uint64_t done = recv_done(c);
  s.recv_seq = done + 1;
  s.send_seq = (phases & 1) ? send_seq(c) : 0;
  s.release = (phases & 1) ? release_poll(c, done) : 0;
  if (threadIdx.x == 0) *blocked = 0;
  if (blockIdx.x == 0 && int(threadIdx.x) / 32 == kWarps - 1) publish_release(c, done);
  if (phases == 3 && s.send_seq != s.recv_seq && blockIdx.x == 0 && threadIdx.x == 0)
    comm::report_error(c.error, comm::kErrorInvalid, kind, c.rank, -1, kOrderId, s.recv_seq,
                       s.send_seq);
  return s;
}

// Where the inbox of peer `d` that this rank writes lies: the peer's recv
// region (direct stores) or our staging (proxy; put in one piece later).
__device__ __forceinline__ char* send_inbox(const LlCtx& c, int parity, int d, int64_t inbox_bytes) {
  const bool direct = !proxied(c, d);
  if (direct) return c.peers[d] + c.recv_offset[parity] + int64_t(c.rank) * inbox_bytes;
  return c.local + c.stage_offset[parity] + int64_t(d) * inbox_bytes;
}

// The send half's last arrival for peer d publishes the inbox: a flag store
// (direct) or a put of the assembled inbox and a remote add (proxy).
__device__ void publish(const LlCtx& c, int parity, int d, int64_t inbox_bytes, int64_t used_bytes,
                        uint64_t seq) {
  __threadfence_system();
  if (!proxied(c, d)) {
    comm::store_release_sys(flag_ptr(c.peers[d], parity, c.rank), calls_on_parity(seq));
    return;
  }
  // Proxy: the inbox, then the flag value, both copied by the proxy's stream in
  // order (copy engines only: a remote-atomic kernel could not be scheduled while
  // this kernel's receive half holds every SM).
  comm::PortChannelDeviceHandle& port = c.ports[d];
  const uint64_t src = c.stage_offset[parity] + uint64_t(d) * inbox_bytes;
  const uint64_t dst = c.recv_offset[parity] + uint64_t(c.rank) * inbox_bytes;
  const uint64_t out_off = kOutFlagsOffset + uint64_t(parity * kMaxRanks + d) * 8;
  *reinterpret_cast<volatile uint64_t*>(c.local + out_off) = calls_on_parity(seq);
  __threadfence_system();
  if (used_bytes > 0) port.put(dst, src, uint64_t(used_bytes));
  port.put(uint64_t(parity * kMaxRanks + c.rank) * 8, out_off, 8);
}

// One arrival for peer d (after this warp's writes for d): adds `add` to d's
// arrival counter; the arrival that brings it to `target` is the last and
// publishes (and resets the counter for the next call). Lane 0 only.
// `used_bytes` < 0: the proxy put's size is read from the staged inbox header
// (dispatch: the header arrival carried the message count; see
// dispatch_send), only by the last arrival and only for a proxied peer.
__device__ __forceinline__ void arrive(const LlCtx& c, int parity, int d, uint32_t add,
                                       uint32_t target, int64_t inbox_bytes, int64_t used_bytes,
                                       uint64_t seq, int experts_per_rank = 0,
                                       int64_t msg_bytes = 0) {
  __threadfence_system();
  uint32_t* done = c.state + kStateDone + d;
  const uint32_t prev = atomicAdd(done, add);
  if (prev + add == target) {
    *done = 0;
    if (used_bytes < 0) {
      used_bytes = 0;
      if (proxied(c, d)) {
        // Acquire side of the header block's fence + add (which this add
        // follows in the counter's RMW chain): its header stores are visible.
        __threadfence();
        const int* h = reinterpret_cast<const int*>(send_inbox(c, parity, d, inbox_bytes));
        const int n = ld_cg_i32(h + experts_per_rank);
        used_bytes = inbox_header_bytes(experts_per_rank) + int64_t(n) * msg_bytes;
      }
    }
    publish(c, parity, d, inbox_bytes, used_bytes, seq);
  }
}
// Dispatch arrivals: every message adds 1, the header block adds
// kArrivalsDone - (messages to d), so the counter reaches kArrivalsDone exactly
// at the last of the messages + 1 arrivals whatever their order (before the
// header's add it is at most the message count < kArrivalsDone); the message
// warps need not know how many messages their destination gets.
constexpr uint32_t kArrivalsDone = 1u << 30;

// The receive halves' first look at the flags, issued at the start of the
// half together with the call counter's load instead of after it (the parity
// picks the flag): thread p * 32 + s (p = 0, 1; s < R) loads source s's flag
// of parity p with acquire semantics, and the mask entry of s. The thread of
// this call's parity then waits from that value on (wait_flag), so when the
// data is already there the chain is one round trip (counter, flag and mask
// in flight together), not counter -> mask -> flag.
struct FirstPoll {
  uint64_t flag;
  int32_t masked;
};
__device__ __forceinline__ FirstPoll first_poll(const LlCtx& c) {
  FirstPoll f{0, 0};
  const int s = threadIdx.x % 32, p = threadIdx.x / 32;
  if (p < 2 && s < c.num_ranks) {
    f.masked = *reinterpret_cast<volatile int32_t*>(c.mask + s);
    f.flag = comm::load_acquire_sys(flag_ptr(c.local, p, s));
  }
  return f;
}

// Waits (thread parity * 32 + src, which loaded `f`) for the flag of `src` on
// `parity` to reach the call count, at most `timeout_ns` of GPU time
// (comm::WaitClock). Returns false on timeout: the peer is masked (shrink) or
// an error recorded (rank, peer, parity, wanted and seen flag values).
__device__ bool wait_flag(const LlCtx& c, int parity, int src, uint64_t seq, uint32_t kind,
                          int64_t* cycles, const FirstPoll& f) {
  const uint64_t want = calls_on_parity(seq);
  const uint64_t* flag = flag_ptr(c.local, parity, src);
  const long long t0 = clock64();
  uint64_t v = f.flag;
  comm::WaitClock clock(c.timeout_ns > uint64_t(INT64_MAX) ? INT64_MAX : int64_t(c.timeout_ns));
  while (v < want) {
    if (is_masked(c, src)) return false;
    if (clock.expired()) {
      if (c.shrink) {
        atomicExch(c.mask + src, 1);
      } else {
        comm::report_error(c.error, comm::kErrorTimeout, kind, c.rank, src, uint64_t(parity), want,
                           v);
      }
      return false;
    }
    v = comm::load_acquire_sys(flag);
  }
  if (cycles) *cycles = clock64() - t0;
  return true;
}

// The receive half's share of advancing the call counter: one thread per
// block, after a barrier that follows every thread's read of the counter
// (recv_done at kernel start). The last block's ticket advances it. Taken
// before the copy-out / sums (not after them, at the end of the kernel, where
// its fence and atomic round trip were the block's last ~1 us), so the round
// trip overlaps them; the counter is read by no one else before the next
// kernel. Ordering: each
// block's fence + ticket add happen after its counter reads (the barrier);
// the last block's add follows them in the ticket's RMW chain, then its fence,
// then the store: no block can read the advanced value.
__device__ __forceinline__ void take_ticket(const LlCtx& c) {
  __threadfence();
  if (comm::last_block_ticket(c.state + kStateTicket)) {
    __threadfence();
    uint64_t* seq = reinterpret_cast<uint64_t*>(c.state);
    *seq = *seq + 1;
    __threadfence();
  }
}
// Which thread takes the ticket: lane 0 of the last warp (it never waits for a
// flag, and is the last to get a message / channels to work on).
__device__ __forceinline__ bool ticket_thread() { return threadIdx.x == kThreads - 32; }

// Exclusive prefix sums of the n ints in[i * stride] into out[i * stride] (may
// alias in), by one warp (every lane calls it); returns the total.
__device__ __forceinline__ int warp_exclusive_scan(const int* in, int* out, int n, int stride,
                                                   int lane) {
  int carry = 0;
  for (int base = 0; base < n; base += 32) {
    const int i = base + lane;
    const int v = i < n ? in[i * stride] : 0;
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    if (i < n) out[i * stride] = carry + x - v;
    carry += __shfl_sync(0xffffffffu, x, 31);
  }
  return carry;
}

// ---- routing: counts, prefixes and occurrences (shared by dispatch and combine)

struct Routing {
  int* cnt;     // [E] messages per expert (this rank's tokens)
  int* prefix;  // [E] sum of cnt over the experts of the same rank below e
  int* total;   // [R] messages per destination rank
  int* ek;      // [K] the current token's ids (-1: none)
  int* occ;     // [K] occurrence of (t, k) among its expert's messages
};

__device__ __forceinline__ int64_t valid_id(int64_t e, int num_experts) {
  return (e >= 0 && e < num_experts) ? e : -1;
}

// The ids of a token's k slots as int (-1: none), from the int64 entry.
__device__ __forceinline__ int valid_id32(int64_t e, int num_experts) {
  return (e >= 0 && e < num_experts) ? int(e) : -1;
}

// Combine's routing: per-expert counts of this rank's (token, k) entries, the
// prefixes per destination rank, and (t0 >= 0) ek / occ of token t0, fused
// into the same pass over the ids (token_routing for the others). Whole block;
// ends with a barrier.
__device__ void count_routing(const Routing& r, const int64_t* topk, int n_entries, int num_experts,
                              int experts_per_rank, int num_ranks, int t0, int num_topk) {
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) r.cnt[e] = 0;
  if (t0 >= 0 && threadIdx.x < num_topk) {
    r.ek[threadIdx.x] = valid_id32(topk[int64_t(t0) * num_topk + threadIdx.x], num_experts);
    r.occ[threadIdx.x] = 0;
  }
  __syncthreads();
  const int64_t base = int64_t(t0) * num_topk;
  for (int i = threadIdx.x; i < n_entries; i += blockDim.x) {
    const int e = valid_id32(topk[i], num_experts);
    if (e < 0) continue;
    atomicAdd(r.cnt + e, 1);
    // Occurrence of (t0, k): the entries before it with the same id.
    if (t0 >= 0 && i < base + num_topk)
      for (int k = 0; k < num_topk; ++k)
        if (r.ek[k] == e && i < base + k) atomicAdd(r.occ + k, 1);
  }
  __syncthreads();
  // One warp per destination rank: prefixes over its experts, and its total.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int d = warp; d < num_ranks; d += blockDim.x / 32) {
    const int off = d * experts_per_rank;
    const int tot = warp_exclusive_scan(r.cnt + off, r.prefix + off, experts_per_rank, 1, lane);
    if (lane == 0) r.total[d] = tot;
  }
  __syncthreads();
}

// ek / occ of token t (whole block; ends with a barrier).
__device__ void token_routing(const Routing& r, const int64_t* topk, int t, int num_topk,
                              int num_experts) {
  if (threadIdx.x < num_topk) {
    r.ek[threadIdx.x] = int(valid_id(topk[int64_t(t) * num_topk + threadIdx.x], num_experts));
    r.occ[threadIdx.x] = 0;
  }
  __syncthreads();
  const int base = t * num_topk;
  const int lim = base + num_topk;
  for (int i = threadIdx.x; i < lim; i += blockDim.x) {
    const int64_t e = valid_id(topk[i], num_experts);
    if (e < 0) continue;
    for (int k = 0; k < num_topk; ++k)
      if (r.ek[k] == e && i < base + k) atomicAdd(r.occ + k, 1);
  }
  __syncthreads();
}

__device__ __forceinline__ void warp_copy(char* dst, const char* src, int64_t bytes, int lane) {
  const int4* s = reinterpret_cast<const int4*>(src);
  int4* d = reinterpret_cast<int4*>(dst);
  const int64_t n = bytes / 16;
  for (int64_t i = lane; i < n; i += 32) st_na(d + i, s[i]);
}

// ---- dispatch ---------------------------------------------------------------------

// The send half's routing state (shared memory, dispatch_smem in Rust:
// E + 4 kMaxTopk + kMaxRanks + 4 ints, then kThreads bytes, then the message).
// Block b keeps running counts over the tokens it has routed so far, [0, done):
// advancing them to its next token t costs one pass over the ids of
// [done, t), so its occurrences and message slots follow from counters instead
// of a per-token rescan of every earlier token.
struct SendRouting {
  int* hist;   // [E] entries of tokens [0, done) per expert
  int* tpos;   // [kMaxRanks] tokens of [0, done) with an expert on rank d
  int* ek;     // [kMaxTopk] the current token's ids (-1: none)
  int* occ;    // [kMaxTopk] occurrence of (t, k)
  int* dl;     // [kMaxTopk] the current token's distinct destinations (first-k order)
  int* dpos;   // [kMaxTopk] its message slot on dl[i]
  int* nd;     // the number of distinct destinations
  int8_t* sd;  // [kThreads] destination rank of each entry of a chunk (-1: none)
};

// Adds the tokens [from, to) to hist / tpos, in chunks of whole tokens (one
// entry per thread; K <= 32 so a chunk holds at least 32 tokens). An entry
// counts for tpos when no earlier slot of its token has the same destination
// (warp-aggregated with match.any). `report` (the header block, which passes
// every token exactly once): ids outside [-1, E) are recorded (token, column
// of the [N, num_topk] ids, value), raised by the host later. Whole block;
// ends with a barrier when there was work.
__device__ void route_tokens(const SendRouting& r, const int64_t* topk, int from, int to, int K,
                             int E, int EL, const LlCtx* report) {
  const int tpc = blockDim.x / K;
  const int lane = threadIdx.x % 32;
  const int i = threadIdx.x;
  for (int c0 = from; c0 < to; c0 += tpc) {
    const int n = (to - c0 < tpc ? to - c0 : tpc) * K;
    int d = -1;
    if (i < n) {
      const int64_t g = int64_t(c0) * K + i;
      const int64_t raw = topk[g];
      const int e = valid_id32(raw, E);
      if (e >= 0) {
        d = e / EL;
        atomicAdd(r.hist + e, 1);
      } else if (report != nullptr && raw != -1) {
        comm::report_error(report->error, comm::kErrorInvalid, comm::kInvalidExpertId,
                           report->rank, -1, (uint64_t(g / K) << 8) | uint64_t(g % K),
                           uint64_t(E), uint64_t(raw));
      }
      r.sd[i] = int8_t(d);
    }
    __syncthreads();
    bool lead = d >= 0;
    if (lead) {
      const int k = i % K;
      const int8_t* row = r.sd + (i - k);
      for (int k2 = 0; k2 < k; ++k2)
        if (row[k2] == d) {
          lead = false;
          break;
        }
    }
    const unsigned peers = __match_any_sync(0xffffffffu, lead ? d : -1);
    if (lead && lane == __ffs(peers) - 1) atomicAdd(r.tpos + d, __popc(peers));
    __syncthreads();
  }
}

// Token t's row (H/8 threads, 8 channels each), loaded before the routing so
// its latency overlaps it.
__device__ __forceinline__ int4 load_row(const DispatchArgs& a, int t) {
  if (int(threadIdx.x) < a.hidden / 8)
    return ld_nc(reinterpret_cast<const int4*>(a.x + int64_t(t) * a.hidden) + threadIdx.x);
  return make_int4(0, 0, 0, 0);
}

// The cast of one token (its row in `raw`, from load_row) into the payload at
// `msg` (shared memory; the per-destination header is written by the sending
// warp), H/8 threads each owning 8 channels; exactly the reference's
// arithmetic.
__device__ void build_message(const DispatchArgs& a, int4 raw, char* msg) {
  const int H = a.hidden;
  const int i = threadIdx.x;  // owns channels 8i .. 8i + 7
  const bool active = i < H / 8;
  if (!a.use_fp8) {
    if (active) reinterpret_cast<int4*>(msg)[i] = raw;
    return;
  }
  const __nv_bfloat16* v = reinterpret_cast<const __nv_bfloat16*>(&raw);
  float f[8];
  float amax = 0.0f;
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    f[u] = __bfloat162float(v[u]);
    amax = fmaxf(amax, fabsf(f[u]));
  }
  // 16 threads per 128-channel group, aligned: reduce within half-warps.
#pragma unroll
  for (int o = 8; o >= 1; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (!active) return;
  amax = fmaxf(amax, 1e-4f);
  float scale, scale_inv;
  const float vv = amax * (1.0f / 448.0f);
  if (a.round_scale) {
    const uint32_t bits = __float_as_uint(vv);
    const int p = int((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0 ? 1 : 0);
    scale = __uint_as_float(uint32_t(-p + 127) << 23);
    scale_inv = __uint_as_float(uint32_t(p + 127) << 23);
  } else {
    scale = __fdiv_rn(448.0f, amax);
    scale_inv = vv;
  }
  uint32_t lo = 0, hi = 0;
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    const uint32_t q =
        uint32_t(__nv_cvt_float_to_fp8(__fmul_rn(f[u], scale), __NV_SATFINITE, __NV_E4M3));
    if (u < 4)
      lo |= q << (8 * u);
    else
      hi |= q << (8 * (u - 4));
  }
  reinterpret_cast<uint2*>(msg)[i] = make_uint2(lo, hi);
  const int g = i / 16;
  if (i % 16 == 0) {
    char* sc = msg + H;
    if (a.use_ue8m0) {
      reinterpret_cast<uint8_t*>(sc)[g] = uint8_t(__float_as_uint(scale_inv) >> 23);
    } else {
      reinterpret_cast<float*>(sc)[g] = scale_inv;
    }
  }
  if (a.use_ue8m0 && i == 0) {
    // Unused high bytes of the last packed word (G % 4 != 0) are zero.
    const int G = H / 128;
    for (int g2 = G; g2 < (G + 3) / 4 * 4; ++g2)
      reinterpret_cast<uint8_t*>(msg + H)[g2] = 0;
  }
}

// Send half. No block waits for another: block b routes its tokens b, b + grid,
// ... from running counts (route_tokens), casts each once, and one warp per
// distinct destination rank of the token stores its message. The header block
// hb (N % grid: one of the blocks with the fewest tokens; with more blocks
// than tokens, one without a token) also routes the rest of the tokens and
// writes every inbox header (this rank's counts for the peer's experts and its
// number of messages), then adds kArrivalsDone - messages to each counter.
__device__ void dispatch_send(const LlCtx& c, const DispatchArgs& a, uint64_t seq, char* smem,
                              uint64_t release, uint32_t* blocked) {
  const int parity = int(seq & 1);
  const int R = c.num_ranks;
  const int E = a.num_experts;
  const int EL = E / R;
  const int K = a.num_topk;
  const int N = a.num_tokens;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t hdr = inbox_header_bytes(EL);
  const int mh = msg_header_bytes(K);
  SendRouting r;
  r.hist = reinterpret_cast<int*>(smem);
  r.tpos = r.hist + E;
  r.ek = r.tpos + kMaxRanks;
  r.occ = r.ek + kMaxTopk;
  r.dl = r.occ + kMaxTopk;
  r.dpos = r.dl + kMaxTopk;
  r.nd = r.dpos + kMaxTopk;
  r.sd = reinterpret_cast<int8_t*>(smem + (int64_t(E + 4 * kMaxTopk + kMaxRanks + 4) * 4 + 15) /
                                              16 * 16);
  char* msg = reinterpret_cast<char*>(r.sd) + kThreads;
  const int hb = N % int(gridDim.x);
  const LlCtx* report = int(blockIdx.x) == hb ? &c : nullptr;
  for (int e = threadIdx.x; e < E; e += blockDim.x) r.hist[e] = 0;
  if (threadIdx.x < kMaxRanks) r.tpos[threadIdx.x] = 0;
  __syncthreads();
  // Every thread has read the send counter (kernel start).
  if (threadIdx.x == 0) advance_send(c);
  int done = 0;  // tokens [0, done) are in hist / tpos
  for (int t = blockIdx.x; t < N; t += gridDim.x) {
    const bool first = t == int(blockIdx.x);
    // Loads that do not wait for the routing: the token's ids (warp 0, lane
    // k) and its row.
    const int64_t raw_id = warp == 0 && lane < K ? a.topk[int64_t(t) * K + lane] : -1;
    const int4 row = load_row(a, t);
    route_tokens(r, a.topk, done, t, K, E, EL, report);
    done = t;
    if (first) stamp(c, 0, 2);
    if (warp == 0) {
      // Lane k: occurrence of (t, k) = earlier tokens' entries with its id +
      // earlier slots of t with it; whether it is the first slot of t for its
      // destination; the distinct destinations in first-k order and their
      // message slots (tokens before t with an expert there).
      const int e = lane < K ? valid_id32(raw_id, E) : -1;
      const int d = e >= 0 ? e / EL : -1;
      int occ = e >= 0 ? r.hist[e] : 0;
      bool lead = d >= 0;
      for (int k2 = 0; k2 < K; ++k2) {
        const int e2 = __shfl_sync(0xffffffffu, e, k2);
        const int d2 = __shfl_sync(0xffffffffu, d, k2);
        if (k2 < lane && e >= 0 && e2 == e) ++occ;
        if (k2 < lane && d2 == d) lead = false;
      }
      const unsigned lm = __ballot_sync(0xffffffffu, lead);
      if (lead) {
        const int slot = __popc(lm & ((1u << lane) - 1u));
        r.dl[slot] = d;
        r.dpos[slot] = r.tpos[d];
      }
      if (lane < K) {
        r.ek[lane] = e;
        r.occ[lane] = occ;
      }
      if (lane == 0) *r.nd = __popc(lm);
    }
    if (first) stamp(c, 0, 3);
    build_message(a, row, msg);
    // Before the block's first write: the destinations have released this half.
    if (first) wait_release(c, seq, release, blocked, comm::kWaitLlDispatch);
    __syncthreads();
    if (first) stamp(c, 0, 4);
    if (warp < *r.nd) {
      const int d = r.dl[warp];
      if (can_send(c, d, blocked)) {
        char* dst =
            send_inbox(c, parity, d, a.inbox_bytes) + hdr + int64_t(r.dpos[warp]) * a.msg_bytes;
        if (first) stamp(c, 0, 11);
        // Header: the token and, in k order, (local expert, occurrence) of every
        // k whose expert lives on d.
        const bool mine = lane < K && r.ek[lane] >= 0 && r.ek[lane] / EL == d;
        const unsigned m = __ballot_sync(0xffffffffu, mine);
        if (lane == 0) *reinterpret_cast<int4*>(dst) = make_int4(t, __popc(m), 0, 0);
        if (mine)
          reinterpret_cast<int2*>(dst + 16)[__popc(m & ((1u << lane) - 1u))] =
              make_int2(r.ek[lane] - d * EL, r.occ[lane]);
        warp_copy(dst + mh, msg, a.msg_bytes - mh, lane);
        __syncwarp();
        if (first) stamp(c, 0, 12);
        if (lane == 0)
          arrive(c, parity, d, 1u, kArrivalsDone, a.inbox_bytes, -1, seq, EL, a.msg_bytes);
        if (first) stamp(c, 0, 13);
      }
    }
    // Before the next token's routing rewrites the counters, ek .. nd and msg.
    __syncthreads();
    if (first) stamp(c, 0, 5);
  }
  if (int(blockIdx.x) == hb) {
    if (int(blockIdx.x) >= N) {
      // No token of its own (the loop above never ran): its release wait.
      wait_release(c, seq, release, blocked, comm::kWaitLlDispatch);
      __syncthreads();
    }
    route_tokens(r, a.topk, done, N, K, E, EL, report);
    // hist / tpos now cover every token: the inbox headers, one arrival per
    // peer (so a peer with no message still publishes).
    for (int d = warp; d < R; d += kWarps) {
      if (!can_send(c, d, blocked)) continue;
      int* h = reinterpret_cast<int*>(send_inbox(c, parity, d, a.inbox_bytes));
      const int nmsg = r.tpos[d];
      for (int j = lane; j < EL; j += 32) h[j] = r.hist[d * EL + j];
      if (lane == 0) h[EL] = nmsg;
      __syncwarp();
      if (lane == 0)
        arrive(c, parity, d, kArrivalsDone - uint32_t(nmsg), kArrivalsDone, a.inbox_bytes,
               hdr + int64_t(nmsg) * a.msg_bytes, seq);
    }
  }
  stamp(c, 0, 6);
}

// Receive half. Every block waits for every source's flag and reads every inbox
// header, so each block knows the whole layout: source blocks are placed in
// source-rank order (begin = counts of the lower sources), and the messages are
// spread one per warp over the grid. Block 0 writes layout_range, recv_count and
// the statistics.
__device__ void dispatch_recv(const LlCtx& c, const DispatchArgs& a, uint64_t seq, char* smem,
                              const FirstPoll& poll) {
  const int parity = int(seq & 1);
  const int R = c.num_ranks;
  const int EL = a.num_experts / R;
  const int H = a.hidden;
  const int G = H / 128;
  const int W = (G + 3) / 4;
  const int64_t RT = int64_t(R) * a.max_tokens;
  const int64_t hdr = inbox_header_bytes(EL);
  const int mh = msg_header_bytes(a.num_topk);
  const int64_t max_msgs = (a.inbox_bytes - hdr) / a.msg_bytes;
  const int lane = threadIdx.x % 32;
  // cnt/begin [R][EL]; nmsg, live [R]; before [R] and the total messages after it.
  int* cnt = reinterpret_cast<int*>(smem);
  int* begin = cnt + R * EL;
  int* nmsg = begin + R * EL;  // messages (tokens) from source s
  int* live = nmsg + kMaxRanks;
  int* before = live + kMaxRanks;  // [R] messages of the sources below s
  // before[kMaxRanks]: the total messages; before[kMaxRanks + 1]: 1 when a
  // source that is not masked timed out (an error is recorded): the counts this
  // call returns are then -1, never a partial result that looks whole.
  int* timed_out = before + kMaxRanks + 1;
  if (threadIdx.x == 0) *timed_out = 0;
  __syncthreads();
  // Thread parity * 32 + s waits for source s, from its first poll.
  if (int(threadIdx.x) / 32 == parity && lane < R) {
    const int s = lane;
    int64_t cycles = 0;
    const bool ok =
        !poll.masked && wait_flag(c, parity, s, seq, comm::kWaitLlDispatch, &cycles, poll);
    live[s] = ok ? 1 : 0;
    if (!ok && !is_masked(c, s)) atomicExch(timed_out, 1);
    if (ok && blockIdx.x == 0 && a.stats_wait)
      atomicAdd(reinterpret_cast<unsigned long long*>(a.stats_wait + s),
                static_cast<unsigned long long>(cycles));
  }
  __syncthreads();
  // The header words and the mask (re-read: another block may have masked s)
  // are loaded together, not one after the other.
  for (int u = threadIdx.x; u < R * EL; u += blockDim.x) {
    const int s = u / EL, j = u % EL;
    const int* h = reinterpret_cast<const int*>(c.local + c.recv_offset[parity] +
                                                int64_t(s) * a.inbox_bytes);
    const int v = ld_cg_i32(h + j);
    const int vn = j == 0 ? ld_cg_i32(h + EL) : 0;
    const bool use = live[s] && !is_masked(c, s);
    cnt[u] = use ? v : 0;
    if (j == 0) nmsg[s] = use ? vn : 0;
  }
  __syncthreads();
  stamp(c, 0, 7);
  // Per source (one warp each): counts >= 0 and its messages must fit its inbox.
  const int warp = threadIdx.x / 32;
  for (int s = warp; s < R; s += kWarps) {
    int* cs = cnt + s * EL;
    int bad_j = -1;
    for (int j0 = 0; j0 < EL && bad_j < 0; j0 += 32) {
      const int j = j0 + lane;
      const unsigned m = __ballot_sync(0xffffffffu, j < EL && cs[j] < 0);
      if (m != 0) bad_j = j0 + __ffs(m) - 1;
    }
    const int nm = nmsg[s];
    const bool bad = bad_j >= 0 || nm < 0 || nm > max_msgs;
    if (bad) {
      if (blockIdx.x == 0 && lane == 0)
        comm::report_error(c.error, comm::kErrorInvalid, comm::kLlOverflow, c.rank, s,
                           uint64_t(bad_j >= 0 ? bad_j : EL), uint64_t(max_msgs),
                           uint64_t(bad_j >= 0 ? cs[bad_j] : nm));
      __syncwarp();
      for (int j = lane; j < EL; j += 32) cs[j] = 0;
    }
    if (lane == 0) before[s] = bad ? 0 : nm;  // turned into a prefix below
  }
  __syncthreads();
  if (warp == 0) {
    const int tot = warp_exclusive_scan(before, before, R, 1, lane);
    if (lane == 0) reinterpret_cast<int*>(before + kMaxRanks)[0] = tot;
  }
  // begin[s][j]: rows of expert j from the sources below s (one warp per expert).
  for (int j = warp; j < EL; j += kWarps) {
    const int p = warp_exclusive_scan(cnt + j, begin + j, R, EL, lane);
    __syncwarp();
    if (blockIdx.x == 0) {
      if (lane == 0) {
        const int n = p > RT ? int(RT) : p;
        if (p > RT)
          comm::report_error(c.error, comm::kErrorInvalid, comm::kLlOverflow, c.rank, -1,
                             uint64_t(j), uint64_t(RT), uint64_t(p));
        a.recv_count[j] = *timed_out ? -1 : n;
        if (a.stats_count) atomicAdd(a.stats_count + j, n);
      }
      for (int s = lane; s < R; s += 32)
        a.layout_range[int64_t(j) * R + s] =
            (int64_t(begin[s * EL + j]) << 32) | int64_t(cnt[s * EL + j]);
    }
  }
  __syncthreads();
  stamp(c, 0, 8);
  // Warp 31 has no message in the standard shape (about 350 messages on 132 x
  // 32 warps): its ticket's round trip overlaps the copy-out.
  if (ticket_thread()) take_ticket(c);
  const int total = reinterpret_cast<int*>(before + kMaxRanks)[0];
  // Message m goes to warp m / gridDim of block m % gridDim: every SM copies.
  const int gwarp = warp * gridDim.x + blockIdx.x;
  const int nwarps = gridDim.x * kWarps;
  const int K = a.num_topk;
  const int row_bytes = a.use_fp8 ? H : 2 * H;
  const int n16 = row_bytes / 16;
  const int nsc = a.use_fp8 ? (a.use_ue8m0 ? W : G) : 0;  // <= 64: two per lane
  char* recv_x = static_cast<char*>(a.recv_x);
  int* recv_sc = static_cast<int*>(a.recv_scales);
  for (int m = gwarp; m < total; m += nwarps) {
    // Source: the last s with before[s] <= m.
    int s = 0;
    while (s + 1 < R && before[s + 1] <= m) ++s;
    const char* msg = c.local + c.recv_offset[parity] + int64_t(s) * a.inbox_bytes + hdr +
                      int64_t(m - before[s]) * a.msg_bytes;
    // Every load of the message is issued before the first use: header, pair
    // of lane k, scales, and the first batch of the payload (none depends on
    // another), then the rest of the payload batch by batch (one round trip
    // per 8 KiB of the message instead of one per load).
    const int4 head = ld_cg(reinterpret_cast<const int4*>(msg));
    int pj = -1, pocc = -1;
    if (lane < K) {
      const int* pr = reinterpret_cast<const int*>(msg + 16) + 2 * lane;
      pj = ld_cg_i32(pr);
      pocc = ld_cg_i32(pr + 1);
    }
    const int* sc = reinterpret_cast<const int*>(msg + mh + H);
    const int sc0 = lane < nsc ? ld_cg_i32(sc + lane) : 0;
    const int sc1 = lane + 32 < nsc ? ld_cg_i32(sc + lane + 32) : 0;
    const int4* payload = reinterpret_cast<const int4*>(msg + mh);
    constexpr int kUnroll = 8;
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int q = lane + 32 * u;
      v[u] = q < n16 ? ld_cg(payload + q) : make_int4(0, 0, 0, 0);
    }
    // Lane i < n holds the i-th (expert, occurrence) pair: its destination
    // (local expert dj, row di; dj = -1: out of range, the sender and this
    // rank disagree; skipped).
    const int n = head.y < 0 ? 0 : (head.y > K ? K : head.y);
    int dj = -1, di = 0;
    if (lane < n && pj >= 0 && pj < EL && pocc >= 0 && pocc < cnt[s * EL + pj]) {
      const int64_t rowi = int64_t(begin[s * EL + pj]) + pocc;
      if (rowi < RT) {
        dj = pj;
        di = int(rowi);
        a.src_info[int64_t(dj) * RT + di] = head.x;
      }
    }
    // Loops are uniform over the warp (the shuffles need every lane): q0 is
    // the batch's base index, lane q0 + lane + 32 u copies.
    for (int q0 = 0;;) {
      for (int p = 0; p < n; ++p) {
        const int j = __shfl_sync(0xffffffffu, dj, p);
        const int ri = __shfl_sync(0xffffffffu, di, p);
        if (j < 0) continue;
        int4* dst = reinterpret_cast<int4*>(recv_x + (int64_t(j) * RT + ri) * row_bytes);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int q = q0 + lane + 32 * u;
          if (q < n16) dst[q] = v[u];
        }
      }
      q0 += 32 * kUnroll;
      if (q0 >= n16) break;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int q = q0 + lane + 32 * u;
        v[u] = q < n16 ? ld_cg(payload + q) : make_int4(0, 0, 0, 0);
      }
    }
    if (nsc > 0) {
      for (int p = 0; p < n; ++p) {
        const int j = __shfl_sync(0xffffffffu, dj, p);
        const int ri = __shfl_sync(0xffffffffu, di, p);
        if (j < 0) continue;
        // Column-major: element (j, row, g) at j*RT*nsc + g*RT + row.
        int* base = recv_sc + int64_t(j) * RT * nsc + ri;
        if (lane < nsc) base[int64_t(lane) * RT] = sc0;
        if (lane + 32 < nsc) base[int64_t(lane + 32) * RT] = sc1;
      }
    }
  }
  stamp(c, 0, 9);
}

// The body of both kernels (K: the kernel's profile row, 0 dispatch, 1
// combine): the send phase, the receive phase, or both (a.phases), `kind` the
// wait kind kernel_start reports under. The receive phase runs between two
// barriers; kRecvBegin (0: none) and kRecvEnd are the slots stamped after
// each. The kernels keep their shared memory (`smem`, `blocked`) declared in
// themselves and pass it in.
template <int K, int kRecvBegin, int kRecvEnd, auto Send, auto Recv, typename Args>
__device__ __forceinline__ void run_phases(const LlCtx& c, const Args& a, uint32_t kind,
                                           char* smem, uint32_t* blocked) {
  stamp(c, K, 0);
  stamp(c, K, 1);
  const Start st = kernel_start(c, a.phases, kind, blocked);
  if (a.phases & 1) Send(c, a, st.send_seq, smem, st.release, blocked);
  if (a.phases & 2) {
    // Issued before the barrier: in a receive-only launch these loads are in
    // flight together with the call counter's.
    const FirstPoll poll = first_poll(c);
    __syncthreads();
    if constexpr (kRecvBegin != 0) stamp(c, K, kRecvBegin);
    Recv(c, a, st.recv_seq, smem, poll);
    __syncthreads();
    stamp(c, K, kRecvEnd);
  }
  stamp(c, K, kProfSlots - 2);
  stamp(c, K, kProfSlots - 1);
}

// dispatch (moelink::ll::dispatch): the send phase, the receive phase, or
// both (a.phases).
__global__ void __launch_bounds__(kThreads, 1) dispatch(const __grid_constant__ LlDispatchParams p) {
  extern __shared__ __align__(16) char smem[];
  __shared__ uint32_t blocked;  // destinations whose release timed out (wait_release)
  run_phases<0, 0, 10, dispatch_send, dispatch_recv>(p.c, p.a, comm::kWaitLlDispatch, smem,
                                                     &blocked);
}

// ---- combine ----------------------------------------------------------------------

__device__ void combine_send(const LlCtx& c, const CombineArgs& a, uint64_t seq, char* smem,
                             uint64_t release, uint32_t* blocked) {
  const int parity = int(seq & 1);
  const int R = c.num_ranks;
  const int EL = a.num_experts / R;
  const int64_t RT = int64_t(R) * a.max_tokens;
  const int64_t row_bytes = int64_t(a.hidden) * 2;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // cnt/begin/prefix [EL][R], total [R], rows per expert (cumulative) [EL + 1].
  int* cnt = reinterpret_cast<int*>(smem);
  int* beg = cnt + EL * R;
  int* pre = beg + EL * R;
  int* total = pre + EL * R;
  int* cum = total + kMaxRanks;
  for (int i = threadIdx.x; i < EL * R; i += blockDim.x) {
    const int64_t v = a.layout_range[i];
    cnt[i] = int(v & 0xFFFFFFFF);
    beg[i] = int(v >> 32);
  }
  __syncthreads();
  // Every thread has read the send counter (kernel start).
  if (threadIdx.x == 0) advance_send(c);
  // pre[j][s]: rows of source s in the experts below j (one warp per source);
  // cum[j]: rows of the experts below j (all sources).
  for (int s = warp; s < R; s += kWarps) {
    const int tot = warp_exclusive_scan(cnt + s, pre + s, EL, R, lane);
    if (lane == 0) total[s] = tot;
  }
  for (int j0 = threadIdx.x; j0 < EL; j0 += blockDim.x) {
    int p = 0;
    for (int s = 0; s < R; ++s) p += cnt[j0 * R + s];
    cum[j0] = p;
  }
  __syncthreads();
  if (warp == 0) {
    const int tot = warp_exclusive_scan(cum, cum, EL, 1, lane);
    if (lane == 0) cum[EL] = tot;
  }
  // Before the block's first write: the destinations have released this half.
  wait_release(c, seq, release, blocked, comm::kWaitLlCombine);
  __syncthreads();
  stamp(c, 1, 2);
  if (blockIdx.x == 0) {
    for (int s = warp; s < R; s += kWarps)
      if (lane == 0 && can_send(c, s, blocked))
        arrive(c, parity, s, 1u, uint32_t(total[s] + 1), a.inbox_bytes, total[s] * row_bytes, seq);
  }
  // Row `item` goes to warp item / gridDim of block item % gridDim: every SM copies.
  const int gwarp = warp * gridDim.x + blockIdx.x;
  const int nwarps = gridDim.x * kWarps;
  for (int item = gwarp; item < cum[EL]; item += nwarps) {
    // The expert: the last j with cum[j] <= item.
    int j = 0, hi = EL - 1;
    while (j < hi) {
      const int mid = (j + hi + 1) / 2;
      if (cum[mid] <= item) j = mid; else hi = mid - 1;
    }
    const int row = item - cum[j];
    int s = 0;
    while (s < R && !(beg[j * R + s] <= row && row < beg[j * R + s] + cnt[j * R + s])) ++s;
    if (s == R || !can_send(c, s, blocked)) continue;
    const int64_t pos = pre[j * R + s] + (row - beg[j * R + s]);
    char* dst = send_inbox(c, parity, s, a.inbox_bytes) + pos * row_bytes;
    const char* src = reinterpret_cast<const char*>(a.x) + (int64_t(j) * RT + row) * row_bytes;
    const bool first = item == gwarp;
    if (first) stamp(c, 1, 11);
    warp_copy16(dst, src, row_bytes, lane);
    __syncwarp();
    if (first) stamp(c, 1, 12);
    if (lane == 0) arrive(c, parity, s, 1u, uint32_t(total[s] + 1), a.inbox_bytes, total[s] * row_bytes, seq);
    if (first) stamp(c, 1, 13);
  }
  stamp(c, 1, 3);
}

__device__ void combine_recv(const LlCtx& c, const CombineArgs& a, uint64_t seq, char* smem,
                             const FirstPoll& poll) {
  const int parity = int(seq & 1);
  const int R = c.num_ranks;
  const int E = a.num_experts;
  const int EL = E / R;
  const int K = a.num_topk;
  const int H = a.hidden;
  const int lane = threadIdx.x % 32;
  Routing r;
  r.cnt = reinterpret_cast<int*>(smem);
  r.prefix = r.cnt + E;
  r.total = r.prefix + E;
  r.ek = r.total + kMaxRanks;
  r.occ = r.ek + kMaxTopk;
  int* live = r.occ + kMaxTopk;  // [R] 1: data of rank d arrived
  // Thread parity * 32 + d waits for expert rank d, from its first poll (the
  // other warps start the routing; its barriers wait for them).
  if (int(threadIdx.x) / 32 == parity && lane < R) {
    const int d = lane;
    int64_t cycles = 0;
    const bool ok =
        !poll.masked && wait_flag(c, parity, d, seq, comm::kWaitLlCombine, &cycles, poll);
    live[d] = ok ? 1 : 0;
    if (ok && blockIdx.x == 0 && a.stats_wait)
      atomicAdd(reinterpret_cast<unsigned long long*>(a.stats_wait + d),
                static_cast<unsigned long long>(cycles));
  }
  const int t0 = int(blockIdx.x) < a.num_tokens ? int(blockIdx.x) : -1;
  count_routing(r, a.topk, a.num_tokens * K, E, EL, R, t0, K);
  stamp(c, 1, 5);
  // Warp 31 sums nothing up to hidden 7936 (H / 8 threads sum): its ticket's
  // round trip overlaps the sums.
  if (ticket_thread()) take_ticket(c);
  const int i = threadIdx.x;  // channels 8i .. 8i + 7
  const int64_t row_bytes = int64_t(H) * 2;
  const char* inbox = c.local + c.recv_offset[parity];
  for (int t = blockIdx.x; t < a.num_tokens; t += gridDim.x) {
    if (t != t0) token_routing(r, a.topk, t, K, E);
    if (i < H / 8) {
      float acc[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) acc[u] = 0.0f;
      bool poisoned = false;
      // kBatch slots' rows (and weights) are loaded before the first is
      // summed: one round trip per kBatch slots, not one per slot. The sums
      // stay in ascending k from +0, as in the reference.
      constexpr int kBatch = 8;
      for (int k0 = 0; k0 < K; k0 += kBatch) {
        int4 v[kBatch];
        float w[kBatch];
        bool use[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int k = k0 + u;
          const int e = k < K ? r.ek[k] : -1;
          const int d = e >= 0 ? e / EL : 0;
          use[u] = e >= 0 && live[d];
          // A rank that timed out (not one masked on purpose): this token's
          // sum would be partial, so it becomes NaN.
          if (e >= 0 && !live[d] && !is_masked(c, d)) poisoned = true;
          w[u] = 0.0f;
          v[u] = make_int4(0, 0, 0, 0);
          if (use[u]) {
            w[u] = a.weights[int64_t(t) * K + k];
            const char* row = inbox + int64_t(d) * a.inbox_bytes +
                              (int64_t(r.prefix[e]) + r.occ[k]) * row_bytes;
            v[u] = ld_cg(reinterpret_cast<const int4*>(row) + i);
          }
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          if (!use[u]) continue;
          const __nv_bfloat16* b = reinterpret_cast<const __nv_bfloat16*>(&v[u]);
#pragma unroll
          for (int q = 0; q < 8; ++q) acc[q] = __fmaf_rn(__bfloat162float(b[q]), w[u], acc[q]);
        }
      }
      __align__(16) __nv_bfloat16 o[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) o[u] = __float2bfloat16_rn(poisoned ? __int_as_float(0x7fc00000) : acc[u]);
      reinterpret_cast<int4*>(a.out + int64_t(t) * H)[i] = *reinterpret_cast<const int4*>(o);
    }
    __syncthreads();
  }
  stamp(c, 1, 6);
}

// combine (moelink::ll::combine): likewise.
__global__ void __launch_bounds__(kThreads, 1) combine(const __grid_constant__ LlCombineParams p) {
  extern __shared__ __align__(16) char smem[];
  __shared__ uint32_t blocked;  // destinations whose release timed out (wait_release)
  run_phases<1, 4, 7, combine_send, combine_recv>(p.c, p.a, comm::kWaitLlCombine, smem, &blocked);
}

}  // namespace moelink::ll
