// CUDA kernel of tr_engine::skinny_linear (contract in csrc/registration.cpp). Plain CUDA C++, no torch headers, so
// `nvcc` can compile-check it on a machine without a CUDA build of torch; cuda/ops_cuda.cpp is its torch launcher.
//
// One warp per output feature n: the lanes stream weight row n once (coalesced) and keep one partial sum per row of
// x, then reduce them across the warp. The decode step's matmul is a weight stream, so this is a memory-bound GEMV.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "launchers.h"

namespace {

constexpr int kMaxRows = 16;  // the schema's limit on T
constexpr int kWarpsPerBlock = 8;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half(v); }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }

template <typename T>
__global__ void skinny_linear_kernel(const T* x, const T* w, T* y, int rows, int64_t K, int64_t N) {
  const int lane = threadIdx.x % 32;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (n >= N) return;
  float acc[kMaxRows] = {};
  const T* wn = w + n * K;
  for (int64_t i = lane; i < K; i += 32) {
    const float wv = to_float(wn[i]);
    for (int t = 0; t < rows; ++t) acc[t] += to_float(x[t * K + i]) * wv;
  }
  for (int t = 0; t < rows; ++t) {
    float s = acc[t];
    for (int offset = 16; offset > 0; offset /= 2) s += __shfl_xor_sync(0xffffffffu, s, offset);
    if (lane == 0) store(y + t * N + n, s);
  }
}

template <typename T>
cudaError_t launch(const void* x, const void* w, void* y, int rows, int64_t K, int64_t N, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((N + kWarpsPerBlock - 1) / kWarpsPerBlock);
  skinny_linear_kernel<T><<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(static_cast<const T*>(x),
                                                                       static_cast<const T*>(w), static_cast<T*>(y),
                                                                       rows, K, N);
  return cudaGetLastError();
}

}  // namespace

int tr_engine::skinny_linear_max_rows() { return kMaxRows; }

cudaError_t tr_engine::launch_skinny_linear(int dtype, const void* x, const void* w, void* y, int rows, int64_t K, int64_t N,
                                 cudaStream_t stream) {
  if (rows == 0 || N == 0) return cudaSuccess;
  switch (dtype) {
    case 0: return launch<float>(x, w, y, rows, K, N, stream);
    case 1: return launch<__half>(x, w, y, rows, K, N, stream);
    case 2: return launch<__nv_bfloat16>(x, w, y, rows, K, N, stream);
    default: return cudaErrorInvalidValue;
  }
}
