// The receive pass of an intranode dispatch, alone on one GPU: how fast can
// rows that arrived in this rank's buffer ([R_src][T] records of `pitch` bytes,
// the row first) be moved into a packed `recv_x` ([rows][row] bytes), and with
// how many SMs?
//
//   ce2d        copy engines: one cudaMemcpy2DAsync per source (0 SMs)
//   ce1d        copy engines: one contiguous cudaMemcpyAsync of the same bytes
//               (the ceiling of ce2d)
//   ce1d_busy   ce1d while a kernel on another stream holds every SM (spinning
//               for 5 ms): about ce1d's time if the copy needs no SM
//   cebatch     the same bytes as one cudaMemcpyBatchAsync entry with
//               cudaMemcpyFlagPreferOverlapWithCompute (the copy engines)
//   cebatch_busy    cebatch beside the spinning kernel
//   cebatch_graph   cebatch captured into a CUDA graph and replayed
//   sm  B W     B blocks of W warps; a warp per row, 16-byte loads then stores
//               (4 vectors in flight per lane)
//   tma B W S   B blocks of W warps; a warp per row, S stages per warp in shared
//               memory: cp.async.bulk global -> shared (mbarrier), then
//               cp.async.bulk shared -> global
//
// Every variant's output is checked byte for byte (poisoned first). Prints one
// JSON object per line: {"mode", "blocks", "warps", "stages", "us", "GBps"} with
// GBps = bytes of rows moved / median time (20 runs after 3 warm-ups).
//
//   nvcc -O3 -arch=sm_90a -o local_copy_probe benches/probe/local_copy_probe.cu
//   ./local_copy_probe [ranks=4] [rows_per_source=3690] [row_bytes=14336] [pitch=14592] [ce]
// (`ce`: the copy-engine modes only)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "probe_common.cuh"


struct Shape {
  int ranks;
  int rows_per_source;
  int slots_per_source;  // T: rows a source block holds
  int64_t row_bytes;
  int64_t pitch;
};

// Output row i comes from source i / rows_per_source, slot i % rows_per_source.
__device__ __forceinline__ const char* source_row(const char* buf, const Shape& s, int64_t i) {
  const int64_t src = i / s.rows_per_source, slot = i % s.rows_per_source;
  return buf + (src * s.slots_per_source + slot) * s.pitch;
}

__global__ void sm_copy(const char* __restrict__ buf, char* __restrict__ out, Shape s) {
  const int warps = blockDim.x / 32, lane = threadIdx.x % 32;
  const int64_t rows = int64_t(s.ranks) * s.rows_per_source;
  const int64_t vecs = s.row_bytes / 16;
  for (int64_t i = int64_t(blockIdx.x) * warps + threadIdx.x / 32; i < rows;
       i += int64_t(gridDim.x) * warps) {
    const int4* src = reinterpret_cast<const int4*>(source_row(buf, s, i));
    int4* dst = reinterpret_cast<int4*>(out + i * s.row_bytes);
    for (int64_t v = lane; v < vecs; v += 32 * 4) {
      int4 r[4];
#pragma unroll
      for (int u = 0; u < 4; u++)
        if (v + u * 32 < vecs) asm volatile("ld.global.cg.v4.s32 {%0,%1,%2,%3}, [%4];"
                                            : "=r"(r[u].x), "=r"(r[u].y), "=r"(r[u].z), "=r"(r[u].w)
                                            : "l"(src + v + u * 32));
#pragma unroll
      for (int u = 0; u < 4; u++)
        if (v + u * 32 < vecs) dst[v + u * 32] = r[u];
    }
  }
}

// Dynamic shared memory: [warps][stages] rows of row_bytes, then
// [warps][stages] mbarriers.
__global__ void tma_copy(const char* __restrict__ buf, char* __restrict__ out, Shape s,
                         int stages) {
  extern __shared__ __align__(128) char smem[];
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t rows = int64_t(s.ranks) * s.rows_per_source;
  char* stage0 = smem + int64_t(warp) * stages * s.row_bytes;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + int64_t(warps) * stages * s.row_bytes) +
                   warp * stages;
  if (lane != 0) return;  // one issuing thread per warp
  for (int k = 0; k < stages; k++)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&bars[k])));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  const int64_t first = int64_t(blockIdx.x) * warps + warp, step = int64_t(gridDim.x) * warps;
  const int64_t mine = first < rows ? (rows - first + step - 1) / step : 0;
  uint32_t phase_bits = 0;
  auto load = [&](int64_t j) {
    const int k = int(j % stages);
    const int64_t i = first + j * step;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(
                     smem_u32(&bars[k])),
                 "r"(uint32_t(s.row_bytes))
                 : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
            "r"(smem_u32(stage0 + k * s.row_bytes)),
        "l"(source_row(buf, s, i)), "r"(uint32_t(s.row_bytes)), "r"(smem_u32(&bars[k]))
        : "memory");
  };
  for (int64_t j = 0; j < stages && j < mine; j++) load(j);
  for (int64_t j = 0; j < mine; j++) {
    const int k = int(j % stages);
    const uint32_t parity = (phase_bits >> k) & 1;
    mbarrier_wait(&bars[k], parity);
    phase_bits ^= 1u << k;
    const int64_t i = first + j * step;
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(
                     out + i * s.row_bytes),
                 "r"(smem_u32(stage0 + k * s.row_bytes)), "r"(uint32_t(s.row_bytes))
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (j + stages < mine) {
      // The stage is reloaded only once its store has read it out.
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      load(j + stages);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

int main(int argc, char** argv) {
  Shape s;
  s.ranks = argc > 1 ? atoi(argv[1]) : 4;
  s.rows_per_source = argc > 2 ? atoi(argv[2]) : 3690;
  s.row_bytes = argc > 3 ? atoll(argv[3]) : 14336;
  s.pitch = argc > 4 ? atoll(argv[4]) : 14592;
  s.slots_per_source = 4096;
  if (s.rows_per_source > s.slots_per_source || s.row_bytes % 16 || s.pitch < s.row_bytes ||
      s.pitch % 16) {
    fprintf(stderr, "bad shape\n");
    return 2;
  }
  const int64_t rows = int64_t(s.ranks) * s.rows_per_source;
  const int64_t out_bytes = rows * s.row_bytes;
  const int64_t buf_bytes = int64_t(s.ranks) * s.slots_per_source * s.pitch;
  char *buf, *out, *ref;
  CK(cudaMalloc(&buf, buf_bytes));
  CK(cudaMalloc(&out, out_bytes));
  CK(cudaMalloc(&ref, out_bytes));
  // Fresh random bytes in the buffer; the reference output from ce2d, checked
  // against a host gather first.
  {
    std::vector<uint32_t> h(buf_bytes / 4);
    uint64_t x = 0x9E3779B97F4A7C15ull;
    for (auto& w : h) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      w = uint32_t(x);
    }
    CK(cudaMemcpy(buf, h.data(), buf_bytes, cudaMemcpyHostToDevice));
  }
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto ce2d = [&](char* dst) {
    for (int r = 0; r < s.ranks; r++)
      CK(cudaMemcpy2DAsync(dst + int64_t(r) * s.rows_per_source * s.row_bytes, s.row_bytes,
                           buf + int64_t(r) * s.slots_per_source * s.pitch, s.pitch,
                           s.row_bytes, s.rows_per_source, cudaMemcpyDeviceToDevice, st));
  };
  ce2d(ref);
  CK(cudaStreamSynchronize(st));
  {
    // Host check of a sample of rows of the reference.
    std::vector<char> a(s.row_bytes), b(s.row_bytes);
    for (int64_t i = 0; i < rows; i += 997) {
      const int64_t src = i / s.rows_per_source, slot = i % s.rows_per_source;
      CK(cudaMemcpy(a.data(), ref + i * s.row_bytes, s.row_bytes, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(b.data(), buf + (src * s.slots_per_source + slot) * s.pitch, s.row_bytes,
                    cudaMemcpyDeviceToHost));
      if (memcmp(a.data(), b.data(), s.row_bytes)) {
        fprintf(stderr, "ce2d reference wrong at row %lld\n", (long long)i);
        return 1;
      }
    }
  }
  int failures = 0;
  auto run = [&](const char* mode, int blocks, int warps, int stages, auto&& launch) {
    CK(cudaMemsetAsync(out, 0xA5, out_bytes, st));
    launch();
    CK(cudaGetLastError());
    CK(cudaStreamSynchronize(st));
    std::vector<char> a(out_bytes), b(out_bytes);
    CK(cudaMemcpy(a.data(), out, out_bytes, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(b.data(), ref, out_bytes, cudaMemcpyDeviceToHost));
    const bool ok = memcmp(a.data(), b.data(), out_bytes) == 0;
    if (!ok) failures++;
    const float us = median_us(st, launch);
    printf("{\"mode\": \"%s\", \"blocks\": %d, \"warps\": %d, \"stages\": %d, \"us\": %.1f, "
           "\"GBps\": %.1f, \"checked\": %s}\n",
           mode, blocks, warps, stages, us, out_bytes / (us * 1e3), ok ? "true" : "false");
    fflush(stdout);
  };
  printf("{\"shape\": {\"ranks\": %d, \"rows_per_source\": %d, \"row_bytes\": %lld, \"pitch\": "
         "%lld, \"bytes\": %lld}}\n",
         s.ranks, s.rows_per_source, (long long)s.row_bytes, (long long)s.pitch,
         (long long)out_bytes);
  run("ce2d", 0, 0, 0, [&] { ce2d(out); });
  run("ce1d", 0, 0, 0, [&] { CK(cudaMemcpyAsync(out, ref, out_bytes, cudaMemcpyDeviceToDevice, st)); });
  {
    cudaStream_t busy;
    CK(cudaStreamCreateWithFlags(&busy, cudaStreamNonBlocking));
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    run("ce1d_busy", 0, 0, 0, [&] {
      spin<<<sms * 2, 1024, 0, busy>>>(5000000);
      // Enqueued after the spinner started (both on the device now).
      CK(cudaMemcpyAsync(out, ref, out_bytes, cudaMemcpyDeviceToDevice, st));
    });
    CK(cudaStreamSynchronize(busy));
    // One cudaMemcpyBatchAsync entry asking for the copy engines; the error
    // is returned (a capture may refuse it).
    auto batch = [&](cudaStream_t on) {
      void* dsts[1] = {out};
      const void* srcs[1] = {ref};
      size_t sizes[1] = {size_t(out_bytes)};
      cudaMemcpyAttributes attr = {};
      attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
      size_t idx = 0;
      return cudaMemcpyBatchAsync(dsts, srcs, sizes, 1, &attr, &idx, 1, on);
    };
    run("ce2d_busy", 0, 0, 0, [&] {
      spin<<<sms * 2, 1024, 0, busy>>>(5000000);
      ce2d(out);
    });
    CK(cudaStreamSynchronize(busy));
    {
      // Control: a copy to pinned host memory beside the spinner.
      char* host;
      CK(cudaMallocHost(&host, 64 << 20));
      std::vector<float> t;
      for (int it = 0; it < 3; it++) {
        spin<<<sms * 2, 1024, 0, busy>>>(5000000);
        CK(cudaEventRecord(e0, st));
        CK(cudaMemcpyAsync(host, ref, 64 << 20, cudaMemcpyDeviceToHost, st));
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        t.push_back(ms);
        CK(cudaStreamSynchronize(busy));
      }
      printf("{\"mode\": \"d2h_64MiB_busy\", \"us\": %.1f}\n", median(t) * 1000.f);
      CK(cudaFreeHost(host));
    }
    run("cebatch", 0, 0, 0, [&] { CK(batch(st)); });
    run("cebatch_busy", 0, 0, 0, [&] {
      spin<<<sms * 2, 1024, 0, busy>>>(5000000);
      CK(batch(st));
    });
    CK(cudaStreamSynchronize(busy));
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    // Not every driver lets a capture take a batched copy: reported, not fatal.
    cudaError_t cap = batch(st);
    const cudaError_t end = cudaStreamEndCapture(st, &g);
    if (cap == cudaSuccess) cap = end;
    if (cap == cudaSuccess && cudaGraphInstantiate(&ge, g, 0) == cudaSuccess) {
      run("cebatch_graph", 0, 0, 0, [&] { CK(cudaGraphLaunch(ge, st)); });
      run("cebatch_graph_busy", 0, 0, 0, [&] {
        spin<<<sms * 2, 1024, 0, busy>>>(5000000);
        CK(cudaGraphLaunch(ge, st));
      });
      CK(cudaStreamSynchronize(busy));
    } else {
      printf("{\"mode\": \"cebatch_graph\", \"error\": \"%s\"}\n", cudaGetErrorString(cap));
      cudaGetLastError();
    }
    CK(cudaStreamDestroy(busy));
  }
  const bool ce_only = argc > 5 && strcmp(argv[5], "ce") == 0;
  for (int blocks : {1, 2, 4, 8, 16, 32})
    for (int warps : {8, 16, 32})
      if (!ce_only) run("sm", blocks, warps, 0, [&] { sm_copy<<<blocks, warps * 32, 0, st>>>(buf, out, s); });
  for (int blocks : {1, 2, 4, 8, 16, 32})
    for (int warps : {1, 2, 4, 8})
      for (int stages : {1, 2, 3}) {
        if (ce_only) continue;
        const size_t smem = size_t(warps) * stages * (s.row_bytes + 8) + 64;
        if (smem > 227 * 1024) continue;
        CK(cudaFuncSetAttribute(tma_copy, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
        run("tma", blocks, warps, stages,
            [&] { tma_copy<<<blocks, warps * 32, smem, st>>>(buf, out, s, stages); });
      }
  CK(cudaFree(buf));
  CK(cudaFree(out));
  CK(cudaFree(ref));
  if (failures) fprintf(stderr, "%d variants wrote a wrong output\n", failures);
  return failures ? 1 : 0;
}
