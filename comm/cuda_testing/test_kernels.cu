// Kernels behind comm's GPU tests and benchmarks. Each drives the device API
// the way a real kernel would and reports failures through the handles' error
// records (so a hang becomes a reported timeout). `timeout_ns` bounds each
// device wait (GPU time, comm::spin_until). Every kernel takes one argument
// block (`const __grid_constant__`), mirrored in Rust (comm::kernels::testing).
#include <cstddef>

#include <comm/memory_channel_device.cuh>
#include <comm/port_channel_device.cuh>

using namespace comm;

template <typename H>
struct PingpongParams {
  H h;
  int64_t timeout_ns;
  uint64_t* out_ns;  // [0] = elapsed ns
  int iters;
  int initiator;
};

struct MemchanCopyParams {
  MemoryChannelDeviceHandle h;
  uint64_t dst_off;
  uint64_t src_off;
  uint64_t bytes;
  int get;
  int iters;
  int signal;
};

struct MemchanWaitParams {
  MemoryChannelDeviceHandle h;
  int64_t timeout_ns;
};

struct PacketsParams {
  MemoryChannelDeviceHandle h;
  uint64_t dst_off;
  uint64_t src_off;
  uint64_t bytes;
  int64_t timeout_ns;
  uint32_t flag;
  int ll16;
  int read;
};

struct PortchanOpParams {
  PortChannelDeviceHandle h;
  uint64_t dst_off;
  uint64_t src_off;
  uint64_t size;
  int64_t timeout_ns;
  int op;
  int iters;
};

struct PortchanAtomicsParams {
  PortChannelDeviceHandle h;
  uint64_t dst_off64;
  uint64_t dst_off32;
  int64_t v64;
  int per_thread;
  int32_t v32;
};

struct FifoParams {
  PortChannelDeviceHandle h;
  int64_t timeout_ns;
  uint64_t* out_ns;  // [0] = elapsed ns
  int iters;
  // comm_test_fifo_push_many only: lanes pushing per warp (the block's
  // warps: blockDim.x / 32) and triggers per push_batch (1: push()).
  int lanes;
  int batch;
};

// Offsets after the handle, the same numbers as Rust's const asserts.
constexpr size_t kMh = sizeof(MemoryChannelDeviceHandle), kPh = sizeof(PortChannelDeviceHandle);
static_assert(offsetof(PingpongParams<MemoryChannelDeviceHandle>, iters) == kMh + 16, "Rust");
static_assert(offsetof(PingpongParams<PortChannelDeviceHandle>, iters) == kPh + 16, "Rust");
static_assert(offsetof(MemchanCopyParams, signal) == kMh + 32, "Rust");
static_assert(offsetof(MemchanWaitParams, timeout_ns) == kMh, "Rust");
static_assert(offsetof(PacketsParams, read) == kMh + 40, "Rust");
static_assert(offsetof(PortchanOpParams, iters) == kPh + 36, "Rust");
static_assert(offsetof(PortchanAtomicsParams, v32) == kPh + 28, "Rust");
static_assert(offsetof(FifoParams, iters) == kPh + 16, "Rust");
static_assert(offsetof(FifoParams, batch) == kPh + 24, "Rust");

// Signal/wait ping-pong on one channel (one thread). The initiator signals
// then waits; the other side waits then signals.
template <typename H>
__device__ __forceinline__ void pingpong(const PingpongParams<H>& a) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  H h = a.h;
  const uint64_t t0 = now_ns();
  for (int i = 0; i < a.iters; ++i) {
    if (a.initiator) {
      h.signal();
      if (!h.wait(a.timeout_ns)) break;
    } else {
      if (!h.wait(a.timeout_ns)) break;
      h.signal();
    }
  }
  a.out_ns[0] = now_ns() - t0;
}

extern "C" __global__ void comm_test_memchan_pingpong(
    const __grid_constant__ PingpongParams<MemoryChannelDeviceHandle> a) {
  pingpong(a);
}

// The floor of comm_test_memchan_pingpong (its round trip's breakdown): the same
// ping-pong on the same counters with a relaxed reduction and relaxed polling,
// no release or acquire: what two NVLink one-way trips and the polling cost by
// themselves. Synchronises nothing; for timing only.
extern "C" __global__ void comm_test_memchan_pingpong_floor(
    const __grid_constant__ PingpongParams<MemoryChannelDeviceHandle> a) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  SemaphoreDeviceHandle s = a.h.semaphore;
  uint64_t want = *s.expected_inbound;
  // Every wait bounded: a lost peer leaves the loop after timeout_ns.
  auto wait = [&]() {
    ++want;
    WaitClock clock(a.timeout_ns);
    while (load_relaxed_sys(s.inbound) < want)
      if (clock.expired()) return false;
    return true;
  };
  const uint64_t t0 = now_ns();
  for (int i = 0; i < a.iters; ++i) {
    if (a.initiator) {
      s.relaxed_signal();
      if (!wait()) break;
    } else {
      if (!wait()) break;
      s.relaxed_signal();
    }
  }
  a.out_ns[0] = now_ns() - t0;
  *s.expected_inbound = want;
}

// The same over a port channel (signals through the proxy).
extern "C" __global__ void comm_test_portchan_pingpong(
    const __grid_constant__ PingpongParams<PortChannelDeviceHandle> a) {
  pingpong(a);
}

// Grid-wide put of `bytes` from src + src_off to the peer's dst + dst_off
// (get when `get` != 0: from the peer's dst + dst_off into src + src_off),
// `iters` times; then (signal != 0) one thread signals after a grid-wide fence.
// The signal is only correct with one block (no grid barrier here).
extern "C" __global__ void comm_test_memchan_copy(const __grid_constant__ MemchanCopyParams a) {
  MemoryChannelDeviceHandle h = a.h;
  const size_t tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t nthreads = size_t(gridDim.x) * blockDim.x;
  for (int i = 0; i < a.iters; ++i) {
    if (a.get)
      h.get(a.dst_off, a.src_off, a.bytes, tid, nthreads);
    else
      h.put(a.dst_off, a.src_off, a.bytes, tid, nthreads);
  }
  if (a.signal) {
    __syncthreads();
    if (threadIdx.x == 0) h.signal();
  }
}

// One thread waits for the peer's next signal on a memory channel.
extern "C" __global__ void comm_test_memchan_wait(const __grid_constant__ MemchanWaitParams a) {
  MemoryChannelDeviceHandle h = a.h;
  if (threadIdx.x == 0 && blockIdx.x == 0) h.wait(a.timeout_ns);
}

// LL packets: write (`read` == 0) `bytes` of src + src_off as packets (flag) at
// the peer's dst + dst_off, or read (`read` != 0) packets at our packets +
// dst_off into src + src_off. ll16 selects LL16 over LL8.
extern "C" __global__ void comm_test_packets(const __grid_constant__ PacketsParams a) {
  MemoryChannelDeviceHandle h = a.h;
  const size_t tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t nthreads = size_t(gridDim.x) * blockDim.x;
  if (a.read) {
    if (a.ll16)
      h.read_packets<LL16Packet>(a.dst_off, a.src_off, a.bytes, a.flag, tid, nthreads,
                                 a.timeout_ns);
    else
      h.read_packets<LL8Packet>(a.dst_off, a.src_off, a.bytes, a.flag, tid, nthreads,
                                a.timeout_ns);
  } else {
    if (a.ll16)
      h.put_packets<LL16Packet>(a.dst_off, a.src_off, a.bytes, a.flag, tid, nthreads);
    else
      h.put_packets<LL8Packet>(a.dst_off, a.src_off, a.bytes, a.flag, tid, nthreads);
  }
}

// Port channel operations from one thread. op: 0 put, 1 put_with_signal,
// 2 put_with_signal_and_flush, 3 signal, 4 wait, 5 flush, 6 put + flush.
// Repeats `iters` times (size split in `iters` consecutive pieces for puts;
// 0: an empty kernel); a wait that times out ends the kernel.
extern "C" __global__ void comm_test_portchan_op(const __grid_constant__ PortchanOpParams a) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  PortChannelDeviceHandle h = a.h;
  const int64_t timeout_ns = a.timeout_ns;
  const uint64_t piece = a.iters > 0 ? a.size / a.iters : a.size;
  for (int i = 0; i < a.iters; ++i) {
    const uint64_t d = a.dst_off + i * piece, s = a.src_off + i * piece;
    switch (a.op) {
      case 0: h.put(d, s, piece); break;
      case 1: h.put_with_signal(d, s, piece); break;
      case 2: h.put_with_signal_and_flush(d, s, piece, timeout_ns); break;
      case 3: h.signal(); break;
      case 4:
        if (!h.wait(timeout_ns)) return;  // timed out (recorded): not once per iteration
        break;
      case 5: h.flush(timeout_ns); break;
      case 6: h.put(d, s, piece); h.flush(timeout_ns); break;
      case 7: h.put_with_signal(d, s, piece); break;  // then the waits below
    }
  }
  // 7: the pushing kernel stays, waiting for the partner's `iters` signals.
  for (int i = 0; a.op == 7 && i < a.iters; ++i)
    if (!h.wait(timeout_ns)) return;
}

// Every thread of the grid pushes `per_thread` 64-bit adds of `v64` at dst_off64
// and as many 32-bit adds of `v32` at dst_off32 (both in the peer's dst_mem).
extern "C" __global__ void comm_test_portchan_atomics(
    const __grid_constant__ PortchanAtomicsParams a) {
  PortChannelDeviceHandle h = a.h;
  for (int i = 0; i < a.per_thread; ++i) {
    h.atomic_add(a.dst_off64, a.v64);
    h.atomic_add32(a.dst_off32, a.v32);
  }
}

// FIFO round trip: push a no-op trigger (a 0-byte put) and wait until the
// proxy popped it, `iters` times. out_ns[0] = elapsed.
extern "C" __global__ void comm_test_fifo_roundtrip(const __grid_constant__ FifoParams a) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  PortChannelDeviceHandle h = a.h;
  const uint64_t t0 = now_ns();
  for (int i = 0; i < a.iters; ++i) {
    const uint64_t pos = h.put(0, 0, 0);
    if (!h.fifo.sync(pos, a.timeout_ns)) break;
  }
  a.out_ns[0] = now_ns() - t0;
}

// Latency breakdown, part 1: push `iters` no-op triggers back to back without
// waiting for each, then wait for the last. Per push: the proxy's service time
// per trigger (or the push cost, whichever is larger).
extern "C" __global__ void comm_test_fifo_push_only(const __grid_constant__ FifoParams a) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  PortChannelDeviceHandle h = a.h;
  const uint64_t t0 = now_ns();
  uint64_t pos = 0;
  for (int i = 0; i < a.iters; ++i) pos = h.put(0, 0, 0);
  h.fifo.sync(pos, a.timeout_ns);
  a.out_ns[0] = now_ns() - t0;
}

// FIFO throughput from several producers: `lanes` lanes of each warp of the
// block push no-op triggers (0-byte puts) back to back, `iters` in all, in
// batches of `batch` (1: push(), else push_batch() of up to 32), then each
// waits for its last. out_ns[0] = elapsed, first push to the last producer
// done: per trigger, the slower of the pushes and the proxy's service.
extern "C" __global__ void comm_test_fifo_push_many(const __grid_constant__ FifoParams a) {
  PortChannelDeviceHandle h = a.h;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int lanes = max(1, min(a.lanes, 32)), batch = max(1, min(a.batch, 32));
  const int producers = (blockDim.x / 32) * lanes, me = warp * lanes + lane;
  __shared__ uint64_t t0;
  if (threadIdx.x == 0) t0 = now_ns();
  __syncthreads();
  if (lane < lanes) {
    // This producer's share of the iters, whole batches first.
    const int share = a.iters / producers + (me < a.iters % producers ? 1 : 0);
    const ProxyTrigger t = make_data_trigger(kTriggerData, h.channel, h.dst_mem, 0, h.src_mem, 0, 0);
    ProxyTrigger ts[32];
    for (int j = 0; j < batch; ++j) ts[j] = t;
    uint64_t pos = 0;
    for (int i = 0; i < share; i += batch) {
      const int n = min(batch, share - i);
      pos = batch == 1 ? h.fifo.push(t, a.timeout_ns) : h.fifo.push_batch(ts, n, a.timeout_ns);
    }
    if (share > 0) h.fifo.sync(pos, a.timeout_ns);
  }
  __syncthreads();
  if (threadIdx.x == 0) a.out_ns[0] = now_ns() - t0;
}
