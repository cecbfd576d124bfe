// CUDA kernel of tr_engine::tree_attention (contract in csrc/registration.cpp). Plain CUDA C++, no torch headers, so
// `nvcc` can compile-check it on a machine without a CUDA build of torch; cuda/ops_cuda.cpp is its torch launcher.
//
// One block per (token, query head), flash-decoding style: the keys the token sees (all P prefix slots, then its
// tree ancestors) are walked in chunks of blockDim; each thread scores one key of the chunk, the block keeps a running
// max and sum (online softmax), and each thread accumulates its own output dimensions. Correct and simple; the
// tensor-core version belongs with the GPU issue, measured on a GPU. The launch depends on T, the heads and D only,
// never on the prefix length, which tree_attention_dynamic passes by pointer: a CUDA graph replays it at any prefix.
// tree_attention_rows passes each row's slot, prefix and first row by pointer too (`rows`), so a graph of a batched
// step replays with any sequences in it.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "launchers.h"

namespace {

constexpr int kThreads = 128;
constexpr int kMaxDimsPerThread = 2;  // head dim up to 256

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16(v); }

// The block-wide max or sum of one value per thread; every thread gets the result.
template <bool kMax>
__device__ float block_reduce(float v, float* scratch) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(0xffffffffu, v, offset);
    v = kMax ? fmaxf(v, other) : v + other;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = scratch[0];
  for (int w = 1; w < warps; ++w) v = kMax ? fmaxf(v, scratch[w]) : v + scratch[w];
  __syncthreads();  // scratch is reused by the next reduction
  return v;
}

template <typename T>
__global__ void tree_attention_kernel(const T* q, int64_t q_stride_t, int64_t q_stride_h, const T* k, const T* v,
                                      int64_t kv_stride_h, int64_t kv_stride_s, const bool* mask, int T_, int Hq,
                                      int Hkv, int D, int P, const int64_t* prefix_dev, const int64_t* rows,
                                      int64_t kv_stride_n, int N, int S, float scale, T* out) {
  const int t = blockIdx.x, hq = blockIdx.y, h = hq / (Hq / Hkv), tid = threadIdx.x;
  // tree_attention_dynamic: the prefix length is read here (a captured graph replays at any prefix), clamped so that
  // no read leaves the cache.
  if (prefix_dev != nullptr) {
    const int64_t p = *prefix_dev, top = S - T_;
    P = static_cast<int>(p < 0 ? 0 : (p > top ? top : p));
  }
  // tree_attention_rows: this row's slot, prefix length and first row of its sequence, read here; tree slot i of the
  // batch is cache position P + i - first. Clamped into the cache (the CPU kernel checks them; here that would sync).
  int first = 0;
  if (rows != nullptr) {
    const int64_t slot = rows[3 * t], p = rows[3 * t + 1];
    const int64_t s = slot < 0 ? 0 : (slot >= N ? N - 1 : slot);
    k += s * kv_stride_n;
    v += s * kv_stride_n;
    P = static_cast<int>(p < 0 ? 0 : (p >= S ? S - 1 : p));
    first = static_cast<int>(rows[3 * t + 2]);
  }
  extern __shared__ float smem[];
  float* qs = smem;                                         // [D] scaled query
  float* probs = qs + D;                                    // [kThreads] this chunk's probabilities
  int* slots = reinterpret_cast<int*>(probs + kThreads);    // [kThreads] this chunk's cache slots
  int* ancestors = slots + kThreads;                        // [T_] tree slots token t sees
  __shared__ float reduce_scratch[kThreads / 32];
  __shared__ int n_ancestors;

  for (int d = tid; d < D; d += kThreads) qs[d] = to_float(q[t * q_stride_t + hq * q_stride_h + d]) * scale;
  if (tid == 0) {
    int n = 0;
    for (int i = 0; i < T_; ++i)
      if (mask[t * T_ + i]) {
        const int pos = P + i - first;
        ancestors[n++] = pos < 0 ? 0 : (pos >= S ? S - 1 : pos);
      }
    n_ancestors = n;
  }
  __syncthreads();
  const int n_keys = P + n_ancestors;
  const T* kh = k + h * kv_stride_h;
  const T* vh = v + h * kv_stride_h;

  float running_max = -INFINITY, running_sum = 0.f, acc[kMaxDimsPerThread] = {0.f, 0.f};
  for (int chunk = 0; chunk < n_keys; chunk += kThreads) {
    const int j = chunk + tid;
    float score = -INFINITY;
    int slot = 0;
    if (j < n_keys) {
      slot = j < P ? j : ancestors[j - P];
      const T* key = kh + slot * kv_stride_s;
      score = 0.f;
      for (int d = 0; d < D; ++d) score += qs[d] * to_float(key[d]);
    }
    const float new_max = fmaxf(running_max, block_reduce<true>(score, reduce_scratch));
    const float p = j < n_keys ? __expf(score - new_max) : 0.f;
    const float correction = __expf(running_max - new_max);  // 0 on the first chunk (running_max = -inf)
    running_sum = running_sum * correction + block_reduce<false>(p, reduce_scratch);
    probs[tid] = p;
    slots[tid] = slot;
    __syncthreads();
    const int in_chunk = min(kThreads, n_keys - chunk);
    for (int c = 0; c < kMaxDimsPerThread; ++c) {
      const int d = tid + c * kThreads;
      if (d >= D) break;
      float a = acc[c] * correction;
      for (int jj = 0; jj < in_chunk; ++jj) a += probs[jj] * to_float(vh[slots[jj] * kv_stride_s + d]);
      acc[c] = a;
    }
    running_max = new_max;
    __syncthreads();  // probs/slots are rewritten by the next chunk
  }
  for (int c = 0; c < kMaxDimsPerThread; ++c) {
    const int d = tid + c * kThreads;
    if (d < D) out[(static_cast<int64_t>(t) * Hq + hq) * D + d] = from_float<T>(acc[c] / running_sum);
  }
}

template <typename T>
cudaError_t launch(const void* q, int64_t q_stride_t, int64_t q_stride_h, const void* k, const void* v,
                   int64_t kv_stride_h, int64_t kv_stride_s, const bool* mask, int T_, int Hq, int Hkv, int D, int P,
                   const int64_t* prefix_dev, const int64_t* rows, int64_t kv_stride_n, int N, int S, float scale,
                   void* out, cudaStream_t stream) {
  const dim3 grid(T_, Hq);
  const size_t shared = (D + kThreads) * sizeof(float) + (kThreads + T_) * sizeof(int);
  tree_attention_kernel<T><<<grid, kThreads, shared, stream>>>(
      static_cast<const T*>(q), q_stride_t, q_stride_h, static_cast<const T*>(k), static_cast<const T*>(v),
      kv_stride_h, kv_stride_s, mask, T_, Hq, Hkv, D, P, prefix_dev, rows, kv_stride_n, N, S, scale,
      static_cast<T*>(out));
  return cudaGetLastError();
}

}  // namespace

int tr_engine::tree_attention_max_head_dim() { return kThreads * kMaxDimsPerThread; }

cudaError_t tr_engine::launch_tree_attention(int dtype, const void* q, int64_t q_stride_t, int64_t q_stride_h, const void* k,
                                  const void* v, int64_t kv_stride_h, int64_t kv_stride_s, const bool* mask, int T,
                                  int Hq, int Hkv, int D, int P, const int64_t* prefix_dev, const int64_t* rows,
                                  int64_t kv_stride_n, int N, int S, float scale, void* out, cudaStream_t stream) {
  if (T == 0) return cudaSuccess;
  auto run = [&](auto type_tag) {
    using T_ = decltype(type_tag);
    return launch<T_>(q, q_stride_t, q_stride_h, k, v, kv_stride_h, kv_stride_s, mask, T, Hq, Hkv, D, P, prefix_dev,
                      rows, kv_stride_n, N, S, scale, out, stream);
  };
  switch (dtype) {
    case 0: return run(float{});
    case 1: return run(__half{});
    case 2: return run(__nv_bfloat16{});
    default: return cudaErrorInvalidValue;
  }
}
