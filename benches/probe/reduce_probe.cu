// The receive pass of an intranode combine, alone on one GPU: each token's
// output row is the f32 sum, in ascending source order, of its copies from up
// to R source blocks ([R][T] records of `record` bytes, the bf16 row first),
// stored as bf16. How many bytes per second can one SM read this way, and does
// loading more copies or more vectors before adding raise it?
//
// With `pull` (every GPU of the host, R = the GPU count, peers mapped): the
// same reduction where source d's block lies in GPU d's memory, as a combine
// that reads the expert outputs where they are (one pass per byte instead of a
// push over NVLink and a local reduction). Every GPU reduces its own tokens at
// once, reading (R-1)/R of the bytes over NVLink; the time is the slowest GPU's
// (median over runs), the GB/s are each GPU's bytes read.
//
//   plain S U T   T threads per block; each lane loads U 16-byte vectors of S
//                 copies before it adds them (S = 2, U = 2 is the combine
//                 kernel's reduce_token today)
//   cpasync V D T T threads per block; a warp per token, each lane streams V
//                 16-byte vectors of every copy per stage into a ring of D
//                 stages of shared memory (cp.async), D - 1 stages ahead of
//                 the one it adds ("srcs" and "unroll" in the output are V, D);
//                 REDUCE_PROBE_ONLY=cpasync runs only these
//   tma K         a block per token at a time: one thread bulk-loads (TMA) all
//                 copies of the block's token K tokens ahead into K stages of
//                 shared memory, and the whole block sums each stage
//
// Every variant's output is checked against a host reference (bit for bit,
// poisoned first). One JSON object per line: {"mode", "srcs", "unroll",
// "threads", "blocks", "us", "read_GBps", "read_GBps_per_sm"}, with read bytes =
// the copies' row bytes (median of 20 runs after 3 warm-ups).
//
//   nvcc -O3 -arch=sm_90a -std=c++17 -o reduce_probe benches/probe/reduce_probe.cu
//   ./reduce_probe [ranks=4] [tokens=4096] [hidden=7168] [pull]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "probe_common.cuh"


constexpr int kMaxRanks = 8;

// acc += the 8 bf16 of w, in float.
__device__ __forceinline__ void add8(float (&acc)[8], int4 w) {
  const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(&w);
#pragma unroll
  for (int k = 0; k < 8; ++k) acc[k] += __bfloat162float(x[k]);
}

// The 8 sums as bf16 (round to nearest), one 16-byte vector.
__device__ __forceinline__ int4 pack8(const float (&acc)[8]) {
  int4 o;
  __nv_bfloat16* po = reinterpret_cast<__nv_bfloat16*>(&o);
#pragma unroll
  for (int k = 0; k < 8; ++k) po[k] = __float2bfloat16_rn(acc[k]);
  return o;
}

struct Args {
  const char* src[kMaxRanks];  // source d's block: [T] records (here or on GPU d)
  const int* slots;     // [N][R]: slot of token t's copy in source block d, or -1
  __nv_bfloat16* out;   // [N][hidden]
  int64_t record;       // bytes per record
  int tokens, hidden, ranks, slots_per_source;
};

// One warp per token; lanes own 16-byte vectors (8 bf16). S copies x U vectors
// are loaded before they are added; the sum runs in ascending source order.
template <int S, int U, int kThreads>
__global__ void __launch_bounds__(kThreads) reduce_plain(const Args a) {
  const int lane = threadIdx.x % 32;
  const int warps = blockDim.x / 32;
  const int nvec = a.hidden / 8;
  for (int64_t t = int64_t(blockIdx.x) * warps + threadIdx.x / 32; t < a.tokens;
       t += int64_t(gridDim.x) * warps) {
    const int my_slot = lane < a.ranks ? a.slots[t * a.ranks + lane] : -1;
    const unsigned srcs = __ballot_sync(0xffffffffu, my_slot >= 0);
    int slot_of[kMaxRanks];
#pragma unroll
    for (int d = 0; d < kMaxRanks; ++d) slot_of[d] = __shfl_sync(0xffffffffu, my_slot, d);
    for (int v0 = lane; v0 < nvec; v0 += 32 * U) {
      float acc[U][8];
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[u][k] = 0.f;
      unsigned m = srcs;
      while (m) {
        int d[S];
#pragma unroll
        for (int s = 0; s < S; ++s) {
          d[s] = m ? __ffs(m) - 1 : -1;
          if (m) m &= m - 1;
        }
        int4 w[S][U];
#pragma unroll
        for (int s = 0; s < S; ++s)
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const int v = v0 + 32 * u;
            if (d[s] >= 0 && v < nvec) {
              const int4* r = reinterpret_cast<const int4*>(
                  a.src[d[s]] + int64_t(slot_of[d[s]]) * a.record);
              w[s][u] = __ldcg(r + v);
            }
          }
#pragma unroll
        for (int s = 0; s < S; ++s)
#pragma unroll
          for (int u = 0; u < U; ++u) {
            if (d[s] < 0) continue;
            add8(acc[u], w[s][u]);
          }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int v = v0 + 32 * u;
        if (v >= nvec) continue;
        reinterpret_cast<int4*>(a.out + t * a.hidden)[v] = pack8(acc[u]);
      }
    }
  }
}

__device__ __forceinline__ void cp_async16(void* smem, const void* global) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(smem)), "l"(global)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// cp.async: a warp per token; each lane streams its own 16-byte vectors of
// every copy into a ring of D stages in shared memory (V vectors per copy and
// stage, [D][R][V][32] int4 per warp) with cp.async, D - 1 stages ahead of the
// one it adds. The bytes in flight wait in shared memory, not in registers,
// so a block can have more of them than its registers hold.
template <int V, int D>
__global__ void __launch_bounds__(1024) reduce_cpasync(const Args a) {
  extern __shared__ __align__(16) int4 ring[];
  const int lane = threadIdx.x % 32;
  const int warps = blockDim.x / 32;
  const int R = a.ranks;
  int4* mine = ring + int64_t(threadIdx.x / 32) * D * R * V * 32;
  const int nvec = a.hidden / 8;
  const int nchunk = (nvec + 32 * V - 1) / (32 * V);
  for (int64_t t = int64_t(blockIdx.x) * warps + threadIdx.x / 32; t < a.tokens;
       t += int64_t(gridDim.x) * warps) {
    const int my_slot = lane < R ? a.slots[t * R + lane] : -1;
    const unsigned srcs = __ballot_sync(0xffffffffu, my_slot >= 0);
    const int4* row[kMaxRanks];
#pragma unroll
    for (int d = 0; d < kMaxRanks; ++d) {
      const int s = __shfl_sync(0xffffffffu, my_slot, d);
      row[d] = (srcs >> d) & 1u ? reinterpret_cast<const int4*>(a.src[d] + int64_t(s) * a.record)
                                : nullptr;
    }
    auto issue = [&](int c) {
      if (c < nchunk) {
        int4* stage = mine + (c % D) * R * V * 32;
#pragma unroll
        for (int d = 0; d < kMaxRanks; ++d) {
          if (!((srcs >> d) & 1u)) continue;
#pragma unroll
          for (int u = 0; u < V; ++u) {
            const int v = (c * V + u) * 32 + lane;
            if (v < nvec) cp_async16(stage + (d * V + u) * 32 + lane, row[d] + v);
          }
        }
      }
      cp_async_commit();  // empty past the end: the group count stays uniform
    };
    for (int c = 0; c < D - 1; ++c) issue(c);
    for (int c = 0; c < nchunk; ++c) {
      issue(c + D - 1);
      cp_async_wait<D - 1>();  // chunk c's group (this lane's copies) landed
      const int4* stage = mine + (c % D) * R * V * 32;
#pragma unroll
      for (int u = 0; u < V; ++u) {
        const int v = (c * V + u) * 32 + lane;
        if (v >= nvec) continue;
        float acc[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[k] = 0.f;
#pragma unroll
        for (int d = 0; d < kMaxRanks; ++d) {
          if (!((srcs >> d) & 1u)) continue;
          add8(acc, stage[(d * V + u) * 32 + lane]);
        }
        reinterpret_cast<int4*>(a.out + t * a.hidden)[v] = pack8(acc);
      }
    }
  }
}

// Dynamic shared memory: K stages of [R][hidden] bf16, then K mbarriers.
template <int K>
__global__ void __launch_bounds__(1024) reduce_tma(const Args a) {
  extern __shared__ __align__(128) char smem[];
  const int64_t row_bytes = int64_t(a.hidden) * 2;
  const int64_t stage_bytes = int64_t(a.ranks) * row_bytes;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + K * stage_bytes);
  __shared__ unsigned present[K];
  const int nvec = a.hidden / 8;
  const int64_t first = blockIdx.x, step = gridDim.x;
  const int64_t mine = first < a.tokens ? (a.tokens - first + step - 1) / step : 0;
  if (threadIdx.x == 0) {
    for (int k = 0; k < K; ++k)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&bars[k])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();
  // Thread 0: the copies of the block's j-th token into stage j % K.
  auto load = [&](int64_t j) {
    const int k = int(j % K);
    const int64_t t = first + j * step;
    unsigned m = 0;
    uint32_t bytes = 0;
    for (int d = 0; d < a.ranks; ++d)
      if (a.slots[t * a.ranks + d] >= 0) m |= 1u << d, bytes += uint32_t(row_bytes);
    present[k] = m;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(&bars[k])),
                 "r"(bytes)
                 : "memory");
    for (int d = 0; d < a.ranks; ++d) {
      const int s = a.slots[t * a.ranks + d];
      if (s < 0) continue;
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
              "r"(smem_u32(smem + k * stage_bytes + d * row_bytes)),
          "l"(a.src[d] + int64_t(s) * a.record), "r"(uint32_t(row_bytes)),
          "r"(smem_u32(&bars[k]))
          : "memory");
    }
  };
  if (threadIdx.x == 0)
    for (int64_t j = 0; j < K && j < mine; ++j) load(j);
  for (int64_t j = 0; j < mine; ++j) {
    const int k = int(j % K);
    const uint32_t parity = uint32_t((j / K) & 1);
    mbarrier_wait(&bars[k], parity);
    const unsigned m0 = present[k];
    const int64_t t = first + j * step;
    const char* stage = smem + k * stage_bytes;
    for (int v = threadIdx.x; v < nvec; v += blockDim.x) {
      float acc[8];
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[q] = 0.f;
      for (unsigned m = m0; m; m &= m - 1) {
        const int d = __ffs(m) - 1;
        add8(acc, reinterpret_cast<const int4*>(stage + d * row_bytes)[v]);
      }
      reinterpret_cast<int4*>(a.out + t * a.hidden)[v] = pack8(acc);
    }
    __syncthreads();  // the stage is read out; present[k] may change
    if (threadIdx.x == 0 && j + K < mine) load(j + K);
  }
}

static float bf2f(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static uint16_t f2bf(float f) {  // round to nearest even, finite inputs
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return uint16_t(u >> 16);
}

int main(int argc, char** argv) {
  const bool pull = argc > 4 && strcmp(argv[4], "pull") == 0;
  int G = 1;
  if (pull) CK(cudaGetDeviceCount(&G));
  // Pull: one source block per GPU.
  const int R = pull ? G : argc > 1 ? atoi(argv[1]) : 4;
  const int N = argc > 2 ? atoi(argv[2]) : 4096;
  const int H = argc > 3 ? atoi(argv[3]) : 7168;
  if (R < 1 || R > kMaxRanks || H % 8 || N < 1 || (pull && G < 2)) {
    fprintf(stderr, "bad shape (pull needs 2 to %d GPUs)\n", kMaxRanks);
    return 2;
  }
  const int64_t record = (int64_t(H) * 2 + 32 + 8 + 15) / 16 * 16;  // row, 8 weights, flag
  // Routing: each token reaches each rank with probability 0.9 (top-8 of 256
  // over 4 ranks reaches about 3.6 of them), at least one.
  std::vector<int> slots(int64_t(N) * R, -1), count(R, 0);
  uint64_t x = 0x2545F4914F6CDD1Dull;
  auto rnd = [&] {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    return x;
  };
  int64_t copies = 0;
  for (int t = 0; t < N; ++t) {
    bool any = false;
    for (int d = 0; d < R; ++d)
      if (rnd() % 10 != 0) slots[int64_t(t) * R + d] = count[d]++, any = true, copies++;
    if (!any) slots[int64_t(t) * R] = count[0]++, copies++;
  }
  const int T = N;
  const int64_t block_bytes = int64_t(T) * record;
  const int64_t buf_bytes = int64_t(R) * block_bytes;
  std::vector<uint16_t> hbuf(buf_bytes / 2);
  for (auto& v : hbuf) v = f2bf(float(int64_t(rnd() % 2001) - 1000) / 256.f);
  std::vector<uint16_t> want(int64_t(N) * H);
  for (int t = 0; t < N; ++t)
    for (int h = 0; h < H; ++h) {
      float acc = 0.f;
      for (int d = 0; d < R; ++d) {
        const int s = slots[int64_t(t) * R + d];
        if (s >= 0) acc += bf2f(hbuf[((int64_t(d) * T + s) * record) / 2 + h]);
      }
      want[int64_t(t) * H + h] = f2bf(acc);
    }
  // Per GPU (one here without pull): its buffer, routing, output, stream and
  // arguments. Without pull the one buffer holds every source block; with
  // pull, GPU g's buffer holds source g's block once per destination (each
  // destination reads its own copy, as a combine's sources hold one block per
  // destination), and GPU g reads block g of every GPU's buffer.
  std::vector<char*> buf(G);
  std::vector<int*> dslots(G);
  std::vector<__nv_bfloat16*> out(G);
  std::vector<cudaStream_t> st(G);
  std::vector<cudaEvent_t> e0(G), e1(G);
  std::vector<Args> a(G);
  for (int g = 0; g < G; ++g) {
    CK(cudaSetDevice(g));
    for (int h = 0; pull && h < G; ++h)
      if (h != g) CK(cudaDeviceEnablePeerAccess(h, 0));
    CK(cudaMalloc(&buf[g], buf_bytes));
    CK(cudaMalloc(&dslots[g], slots.size() * 4));
    CK(cudaMalloc(&out[g], int64_t(N) * H * 2));
    CK(cudaStreamCreateWithFlags(&st[g], cudaStreamNonBlocking));
    CK(cudaEventCreate(&e0[g]));
    CK(cudaEventCreate(&e1[g]));
    for (int d = 0; d < R; ++d) {
      const char* from = reinterpret_cast<const char*>(hbuf.data()) + (pull ? g : d) * block_bytes;
      CK(cudaMemcpy(buf[g] + d * block_bytes, from, block_bytes, cudaMemcpyHostToDevice));
    }
    CK(cudaMemcpy(dslots[g], slots.data(), slots.size() * 4, cudaMemcpyHostToDevice));
  }
  for (int g = 0; g < G; ++g) {
    for (int d = 0; d < R; ++d) a[g].src[d] = pull ? buf[d] + g * block_bytes : buf[g] + d * block_bytes;
    a[g].slots = dslots[g], a[g].out = out[g], a[g].record = record;
    a[g].tokens = N, a[g].hidden = H, a[g].ranks = R, a[g].slots_per_source = T;
  }
  const double read_bytes = double(copies) * H * 2;
  printf("{\"shape\": {\"ranks\": %d, \"tokens\": %d, \"hidden\": %d, \"copies\": %lld, "
         "\"read_bytes\": %.0f, \"pull\": %s, \"gpus\": %d}}\n",
         R, N, H, (long long)copies, read_bytes, pull ? "true" : "false", G);
  int failures = 0;
  std::vector<uint16_t> got(int64_t(N) * H);
  auto run = [&](const char* mode, int s, int u, int threads, int blocks, size_t smem,
                 auto kernel) {
    bool ok = true;
    for (int g = 0; g < G; ++g) {
      CK(cudaSetDevice(g));
      if (smem > 0)
        CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      CK(cudaMemset(out[g], 0xff, int64_t(N) * H * 2));
      kernel<<<blocks, threads, smem, st[g]>>>(a[g]);
      CK(cudaGetLastError());
    }
    for (int g = 0; g < G; ++g) {
      CK(cudaSetDevice(g));
      CK(cudaDeviceSynchronize());
      CK(cudaMemcpy(got.data(), out[g], got.size() * 2, cudaMemcpyDeviceToHost));
      ok = ok && got == want;
    }
    if (!ok) failures++;
    // Every GPU at once; per run the slowest GPU's time, then the median.
    std::vector<float> times;
    for (int it = 0; it < 23; ++it) {
      for (int g = 0; g < G; ++g) {
        CK(cudaSetDevice(g));
        CK(cudaDeviceSynchronize());
      }
      for (int g = 0; g < G; ++g) {
        CK(cudaSetDevice(g));
        CK(cudaEventRecord(e0[g], st[g]));
        kernel<<<blocks, threads, smem, st[g]>>>(a[g]);
        CK(cudaEventRecord(e1[g], st[g]));
      }
      float worst = 0.f;
      for (int g = 0; g < G; ++g) {
        CK(cudaSetDevice(g));
        CK(cudaEventSynchronize(e1[g]));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0[g], e1[g]));
        worst = std::max(worst, ms);
      }
      if (it >= 3) times.push_back(worst);
    }
    const float us = median(times) * 1000.f;
    printf("{\"mode\": \"%s\", \"pull\": %s, \"srcs\": %d, \"unroll\": %d, \"threads\": %d, "
           "\"blocks\": %d, \"us\": %.1f, \"read_GBps\": %.1f, \"read_GBps_per_sm\": %.1f, "
           "\"checked\": %s}\n",
           mode, pull ? "true" : "false", s, u, threads, blocks, us, read_bytes / (us * 1e3),
           read_bytes / (us * 1e3) / blocks, ok ? "true" : "false");
    fflush(stdout);
  };
  const std::vector<int> block_counts =
      pull ? std::vector<int>{2, 4, 8, 16, 32} : std::vector<int>{1, 2, 4, 8};
  // cp.async rings: (vectors per stage, stages, threads), within 227 KB.
  const char* only = getenv("REDUCE_PROBE_ONLY");  // "cpasync": skip the others
  auto cpasync = [&](int blocks, int v, int d, int threads, auto kernel) {
    const size_t smem = size_t(threads / 32) * d * R * v * 32 * 16;
    if (smem <= 227 * 1024) run("cpasync", v, d, threads, blocks, smem, kernel);
  };
  for (int blocks : block_counts) {
    cpasync(blocks, 1, 2, 1024, reduce_cpasync<1, 2>);
    cpasync(blocks, 1, 3, 1024, reduce_cpasync<1, 3>);
    cpasync(blocks, 1, 4, 512, reduce_cpasync<1, 4>);
    cpasync(blocks, 2, 2, 512, reduce_cpasync<2, 2>);
    cpasync(blocks, 2, 3, 512, reduce_cpasync<2, 3>);
    cpasync(blocks, 2, 4, 256, reduce_cpasync<2, 4>);
    cpasync(blocks, 4, 2, 256, reduce_cpasync<4, 2>);
    cpasync(blocks, 4, 3, 256, reduce_cpasync<4, 3>);
    if (only && strcmp(only, "cpasync") == 0) continue;
    run("plain", 2, 2, 1024, blocks, 0, reduce_plain<2, 2, 1024>);
    run("plain", 4, 2, 1024, blocks, 0, reduce_plain<4, 2, 1024>);
    run("plain", 4, 4, 512, blocks, 0, reduce_plain<4, 4, 512>);
    const size_t stage = size_t(R) * H * 2;
    for (int k : {1, 2, 3}) {
      const size_t smem = k * stage + 64;
      if (smem > 227 * 1024) continue;
      auto kern = k == 1 ? reduce_tma<1> : k == 2 ? reduce_tma<2> : reduce_tma<3>;
      for (int threads : {256, 1024}) run("tma", R, k, threads, blocks, smem, kern);
    }
  }
  if (failures) fprintf(stderr, "%d variants wrote a wrong output\n", failures);
  return failures ? 1 : 0;
}
