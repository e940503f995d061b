// Kernels behind comm's GPU tests and benchmarks. Each drives the device API
// the way a real kernel would and reports failures through the handles' error
// records (so a hang becomes a reported timeout). `timeout_ns` bounds each
// device wait (GPU time, comm::spin_until).
#include <comm/memory_channel_device.cuh>
#include <comm/port_channel_device.cuh>

using namespace comm;

// Signal/wait ping-pong on one memory channel (one thread). The initiator
// signals then waits; the other side waits then signals. out_ns[0] = elapsed.
extern "C" __global__ void comm_test_memchan_pingpong(MemoryChannelDeviceHandle h, int iters,
                                                      int initiator, int64_t timeout_ns,
                                                      uint64_t* out_ns) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const uint64_t t0 = now_ns();
  for (int i = 0; i < iters; ++i) {
    if (initiator) {
      h.signal();
      if (!h.wait(timeout_ns)) break;
    } else {
      if (!h.wait(timeout_ns)) break;
      h.signal();
    }
  }
  out_ns[0] = now_ns() - t0;
}

// The same over a port channel (signals through the proxy).
extern "C" __global__ void comm_test_portchan_pingpong(PortChannelDeviceHandle h, int iters,
                                                       int initiator, int64_t timeout_ns,
                                                       uint64_t* out_ns) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const uint64_t t0 = now_ns();
  for (int i = 0; i < iters; ++i) {
    if (initiator) {
      h.signal();
      if (!h.wait(timeout_ns)) break;
    } else {
      if (!h.wait(timeout_ns)) break;
      h.signal();
    }
  }
  out_ns[0] = now_ns() - t0;
}

// Grid-wide put of `bytes` from src + src_off to the peer's dst + dst_off
// (get when `get` != 0: from the peer's dst + dst_off into src + src_off),
// `iters` times; then (signal != 0) one thread signals after a grid-wide fence.
// The signal is only correct with one block (no grid barrier here).
extern "C" __global__ void comm_test_memchan_copy(MemoryChannelDeviceHandle h, uint64_t dst_off,
                                                  uint64_t src_off, uint64_t bytes, int get,
                                                  int iters, int signal) {
  const size_t tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t nthreads = size_t(gridDim.x) * blockDim.x;
  for (int i = 0; i < iters; ++i) {
    if (get)
      h.get(dst_off, src_off, bytes, tid, nthreads);
    else
      h.put(dst_off, src_off, bytes, tid, nthreads);
  }
  if (signal) {
    __syncthreads();
    if (threadIdx.x == 0) h.signal();
  }
}

// One thread waits for the peer's next signal on a memory channel.
extern "C" __global__ void comm_test_memchan_wait(MemoryChannelDeviceHandle h,
                                                  int64_t timeout_ns) {
  if (threadIdx.x == 0 && blockIdx.x == 0) h.wait(timeout_ns);
}

// LL packets: write (`read` == 0) `bytes` of src + src_off as packets (flag) at
// the peer's dst + dst_off, or read (`read` != 0) packets at our packets +
// dst_off into src + src_off. ll16 selects LL16 over LL8.
extern "C" __global__ void comm_test_packets(MemoryChannelDeviceHandle h, int ll16, int read,
                                             uint64_t dst_off, uint64_t src_off, uint64_t bytes,
                                             uint32_t flag, int64_t timeout_ns) {
  const size_t tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t nthreads = size_t(gridDim.x) * blockDim.x;
  if (read) {
    if (ll16)
      h.read_packets<LL16Packet>(dst_off, src_off, bytes, flag, tid, nthreads, timeout_ns);
    else
      h.read_packets<LL8Packet>(dst_off, src_off, bytes, flag, tid, nthreads, timeout_ns);
  } else {
    if (ll16)
      h.put_packets<LL16Packet>(dst_off, src_off, bytes, flag, tid, nthreads);
    else
      h.put_packets<LL8Packet>(dst_off, src_off, bytes, flag, tid, nthreads);
  }
}

// Port channel operations from one thread. op: 0 put, 1 put_with_signal,
// 2 put_with_signal_and_flush, 3 signal, 4 wait, 5 flush, 6 put + flush.
// Repeats `iters` times (size split in `iters` consecutive pieces for puts).
extern "C" __global__ void comm_test_portchan_op(PortChannelDeviceHandle h, int op,
                                                 uint64_t dst_off, uint64_t src_off,
                                                 uint64_t size, int iters, int64_t timeout_ns) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const uint64_t piece = iters > 0 ? size / iters : size;
  for (int i = 0; i < iters; ++i) {
    const uint64_t d = dst_off + i * piece, s = src_off + i * piece;
    switch (op) {
      case 0: h.put(d, s, piece); break;
      case 1: h.put_with_signal(d, s, piece); break;
      case 2: h.put_with_signal_and_flush(d, s, piece, timeout_ns); break;
      case 3: h.signal(); break;
      case 4: h.wait(timeout_ns); break;
      case 5: h.flush(timeout_ns); break;
      case 6: h.put(d, s, piece); h.flush(timeout_ns); break;
    }
  }
}

// Every thread of the grid pushes `per_thread` 64-bit adds of `v64` at dst_off64
// and as many 32-bit adds of `v32` at dst_off32 (both in the peer's dst_mem).
extern "C" __global__ void comm_test_portchan_atomics(PortChannelDeviceHandle h, uint64_t dst_off64,
                                                      uint64_t dst_off32, int per_thread,
                                                      int64_t v64, int32_t v32) {
  for (int i = 0; i < per_thread; ++i) {
    h.atomic_add(dst_off64, v64);
    h.atomic_add32(dst_off32, v32);
  }
}

// FIFO round trip: push a no-op trigger (a 0-byte put) and wait until the
// proxy popped it, `iters` times. out_ns[0] = elapsed.
extern "C" __global__ void comm_test_fifo_roundtrip(PortChannelDeviceHandle h, int iters,
                                                    int64_t timeout_ns, uint64_t* out_ns) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const uint64_t t0 = now_ns();
  for (int i = 0; i < iters; ++i) {
    const uint64_t pos = h.put(0, 0, 0);
    if (!h.fifo.sync(pos, timeout_ns)) break;
  }
  out_ns[0] = now_ns() - t0;
}

// Latency breakdown, part 1: push `iters` no-op triggers back to back without
// waiting for each, then wait for the last. Per push: the proxy's service time
// per trigger (or the push cost, whichever is larger).
extern "C" __global__ void comm_test_fifo_push_only(PortChannelDeviceHandle h, int iters,
                                                    int64_t timeout_ns, uint64_t* out_ns) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const uint64_t t0 = now_ns();
  uint64_t pos = 0;
  for (int i = 0; i < iters; ++i) pos = h.put(0, 0, 0);
  h.fifo.sync(pos, timeout_ns);
  out_ns[0] = now_ns() - t0;
}
