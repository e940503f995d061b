// LL ("low latency") packets: data and a flag written by one store, so a reader
// that sees the flag also sees the data; no separate signal is needed. The flag
// changes every round (callers pass a counter), so buffers need no reset.
//   LL8:  { uint32 data, uint32 flag }             8-byte store, 4 data bytes
//   LL16: { uint32 d0, uint32 f0, uint32 d1, uint32 f1 }  16-byte store, 8 data bytes
#pragma once

#include "common_device.cuh"

namespace comm {

struct alignas(8) LL8Packet {
  uint32_t data;
  uint32_t flag;
#if defined(__CUDACC__)
  static constexpr int kDataBytes = 4;
  __device__ __forceinline__ void write(const void* src, uint32_t f) {
    const uint32_t d = *reinterpret_cast<const uint32_t*>(src);
    const uint64_t v = uint64_t(d) | (uint64_t(f) << 32);
    asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(this), "l"(v) : "memory");
  }
  // True if the packet holds flag `f`; then its data is copied to `dst`.
  __device__ __forceinline__ bool try_read(void* dst, uint32_t f) const {
    uint64_t v;
    asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(this) : "memory");
    if (uint32_t(v >> 32) != f) return false;
    *reinterpret_cast<uint32_t*>(dst) = uint32_t(v);
    return true;
  }
#endif
};
static_assert(sizeof(LL8Packet) == 8, "LL8 packet is one 8-byte store");

struct alignas(16) LL16Packet {
  uint32_t d0, f0, d1, f1;
#if defined(__CUDACC__)
  static constexpr int kDataBytes = 8;
  __device__ __forceinline__ void write(const void* src, uint32_t f) {
    const uint2 d = *reinterpret_cast<const uint2*>(src);
    asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(this), "r"(d.x), "r"(f),
                 "r"(d.y), "r"(f)
                 : "memory");
  }
  // The 8 data bytes and flag `f` in one 16-byte store.
  __device__ __forceinline__ void write64(uint64_t v, uint32_t f) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(this), "r"(uint32_t(v)),
                 "r"(f), "r"(uint32_t(v >> 32)), "r"(f)
                 : "memory");
  }
  // One 16-byte load of the packet as it is now: data, and both flags.
  __device__ __forceinline__ uint64_t load(uint32_t& flag0, uint32_t& flag1) const {
    uint32_t a, c;
    asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(a), "=r"(flag0), "=r"(c), "=r"(flag1)
                 : "l"(this)
                 : "memory");
    return uint64_t(a) | (uint64_t(c) << 32);
  }
  __device__ __forceinline__ bool try_read(void* dst, uint32_t f) const {
    uint32_t f0, f1;
    const uint64_t v = load(f0, f1);
    if (f0 != f || f1 != f) return false;
    *reinterpret_cast<uint2*>(dst) = make_uint2(uint32_t(v), uint32_t(v >> 32));
    return true;
  }
#endif
};
static_assert(sizeof(LL16Packet) == 16, "LL16 packet is one 16-byte store");

#if defined(__CUDACC__)
// Packs `bytes` (a multiple of Packet::kDataBytes) from `src` into packets at
// `dst` (bytes / kDataBytes packets), flag `flag`.
template <typename Packet>
__device__ __forceinline__ void put_packets(Packet* dst, const void* src, size_t bytes,
                                            uint32_t flag, size_t tid, size_t nthreads) {
  const char* s = static_cast<const char*>(src);
  const size_t n = bytes / Packet::kDataBytes;
  for (size_t i = tid; i < n; i += nthreads) dst[i].write(s + i * Packet::kDataBytes, flag);
}

// Waits for every packet of `src` to carry `flag` and copies their data to
// `dst`. Each packet's wait is bounded by `timeout_ns` of GPU time; a timeout
// is reported to `err` (kWaitPacket, id = packet index) and the function
// returns false.
template <typename Packet>
__device__ __forceinline__ bool read_packets(void* dst, const Packet* src, size_t bytes,
                                             uint32_t flag, size_t tid, size_t nthreads,
                                             DeviceError* err, int32_t rank, int32_t peer,
                                             int64_t timeout_ns = kDefaultTimeoutNs) {
  char* d = static_cast<char*>(dst);
  const size_t n = bytes / Packet::kDataBytes;
  for (size_t i = tid; i < n; i += nthreads) {
    bool ok;
    spin_until([&] { return uint64_t(src[i].try_read(d + i * Packet::kDataBytes, flag)); },
               [](uint64_t got) { return got != 0; }, timeout_ns, ok);
    if (!ok) {
      report_error(err, kErrorTimeout, kWaitPacket, rank, peer, i, flag, 0);
      return false;
    }
  }
  return true;
}
#endif

}  // namespace comm
