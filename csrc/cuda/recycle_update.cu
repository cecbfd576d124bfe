// CUDA kernel of tr_engine::recycle_update_ (contract in csrc/registration.cpp). Plain CUDA C++, no torch headers, so
// `nvcc` can compile-check it on a machine without a CUDA build of torch; cuda/ops_cuda.cpp is its torch launcher.
//
// One block per tree row. Each thread keeps the best k of its strided share of the row in a sorted register list;
// then k rounds of a block-wide argmax pick the winners in order, by (value descending, id ascending), so ties go to
// the lower id exactly as on the CPU. The block writes its row only when its token does not occur at a later row
// (the decode loop's duplicate rule), so no two blocks write the same matrix row.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "launchers.h"

namespace {

constexpr int kThreads = 256;
constexpr int kMaxK = 16;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// (value, id) a ranks before (value, id) b.
__device__ __forceinline__ bool better(float va, int64_t ia, float vb, int64_t ib) {
  return va > vb || (va == vb && ia < ib);
}

template <typename T>
__global__ void recycle_update_kernel(int64_t* table, const int64_t* tokens, const T* logits, int n_rows, int64_t V,
                                      int k) {
  const int row = blockIdx.x, tid = threadIdx.x;
  const int64_t token = tokens[row];
  if (token < 0 || token >= V) return;  // out of range: skipped (checking on the host would need a sync)
  for (int later = row + 1; later < n_rows; ++later)
    if (tokens[later] == token) return;  // a later node of the same token writes this matrix row

  float best[kMaxK];
  int64_t ids[kMaxK];
  int filled = 0;
  const T* x = logits + row * V;
  for (int64_t i = tid; i < V; i += kThreads) {  // ids arrive in increasing order per thread
    const float v = to_float(x[i]);
    if (filled == k && !better(v, i, best[k - 1], ids[k - 1])) continue;
    int pos = filled < k ? filled++ : k - 1;
    while (pos > 0 && better(v, i, best[pos - 1], ids[pos - 1])) {
      best[pos] = best[pos - 1];
      ids[pos] = ids[pos - 1];
      --pos;
    }
    best[pos] = v;
    ids[pos] = i;
  }

  __shared__ float win_value[kThreads];
  __shared__ int64_t win_id[kThreads];
  int head = 0;  // next unused entry of this thread's list
  for (int round = 0; round < k; ++round) {
    win_value[tid] = head < filled ? best[head] : -INFINITY;
    win_id[tid] = head < filled ? ids[head] : INT64_MAX;
    __syncthreads();
    for (int stride = kThreads / 2; stride > 0; stride /= 2) {
      if (tid < stride && better(win_value[tid + stride], win_id[tid + stride], win_value[tid], win_id[tid])) {
        win_value[tid] = win_value[tid + stride];
        win_id[tid] = win_id[tid + stride];
      }
      __syncthreads();
    }
    const int64_t winner = win_id[0];
    if (head < filled && ids[head] == winner) ++head;  // ids are unique, so exactly one thread owns the winner
    if (tid == 0) table[token * k + round] = winner;
    __syncthreads();  // win_* are rewritten by the next round
  }
}

}  // namespace

int tr_engine::recycle_update_max_k() { return kMaxK; }

cudaError_t tr_engine::launch_recycle_update(int dtype, int64_t* table, const int64_t* tokens, const void* logits, int n_rows,
                                  int64_t V, int k, cudaStream_t stream) {
  if (n_rows == 0) return cudaSuccess;
  switch (dtype) {
    case 0:
      recycle_update_kernel<<<n_rows, kThreads, 0, stream>>>(table, tokens, static_cast<const float*>(logits), n_rows,
                                                             V, k);
      break;
    case 1:
      recycle_update_kernel<<<n_rows, kThreads, 0, stream>>>(table, tokens, static_cast<const __half*>(logits), n_rows,
                                                             V, k);
      break;
    case 2:
      recycle_update_kernel<<<n_rows, kThreads, 0, stream>>>(
          table, tokens, static_cast<const __nv_bfloat16*>(logits), n_rows, V, k);
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}
