// Row reduction of a bf16 matrix with float32 accumulation: the arithmetic core
// of combine (several copies of a token summed in fp32, stored as bf16).
#include <cuda_bf16.h>

#include <cstdint>

namespace moelink {

// out[c] = bf16( sum_r float(in[r * cols + c]) ). Each thread owns 8 columns
// (one 16-byte vector) when cols is a multiple of 8 and both pointers are 16-byte
// aligned, else single columns.
// The kernel's argument block, mirrored in Rust (ep_kernels::launch::ReduceRowsParams).
struct ReduceRowsParams {
  const __nv_bfloat16* in;
  __nv_bfloat16* out;
  int64_t rows;
  int64_t cols;
};
static_assert(sizeof(ReduceRowsParams) == 32, "mirrored in Rust");

__global__ void reduce_rows_bf16(const __grid_constant__ ReduceRowsParams a) {
  const __nv_bfloat16* __restrict__ in = a.in;
  __nv_bfloat16* __restrict__ out = a.out;
  const int64_t rows = a.rows, cols = a.cols;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nthreads = int64_t(gridDim.x) * blockDim.x;
  const bool vec = cols % 8 == 0 && ((reinterpret_cast<uintptr_t>(in) | reinterpret_cast<uintptr_t>(out)) % 16) == 0;
  if (vec) {
    const int64_t vecs = cols / 8;
    for (int64_t v = tid; v < vecs; v += nthreads) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int64_t r = 0; r < rows; ++r) {
        const int4 raw = reinterpret_cast<const int4*>(in + r * cols)[v];
        const auto* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float2 f = __bfloat1622float2(h[k]);
          acc[2 * k] += f.x;
          acc[2 * k + 1] += f.y;
        }
      }
      int4 packed;
      auto* o = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
      for (int k = 0; k < 4; ++k) o[k] = __floats2bfloat162_rn(acc[2 * k], acc[2 * k + 1]);
      reinterpret_cast<int4*>(out)[v] = packed;
    }
  } else {
    for (int64_t c = tid; c < cols; c += nthreads) {
      float acc = 0.f;
      for (int64_t r = 0; r < rows; ++r) acc += __bfloat162float(in[r * cols + c]);
      out[c] = __float2bfloat16_rn(acc);
    }
  }
}

}  // namespace moelink
