// CUDA kernel of tr_engine::compact_kv_ (contract in csrc/registration.cpp). Plain CUDA C++, no torch headers, so
// `nvcc` can compile-check it on a machine without a CUDA build of torch; cuda/ops_cuda.cpp is its torch launcher.
#include "launchers.h"

namespace {

// One block per (row, slot) pair to write, where a row is one (layer, k|v, head). All blocks read their source
// before any writes... which a single launch cannot promise, so the copy goes through `scratch` [rows, n, words]:
// pass 1 gathers, pass 2 writes. Words are 4-byte units (slot_bytes is a multiple of 4 for D >= 2 in 16-bit types).
__global__ void gather_slots(const uint32_t* cache, const int64_t* src, uint32_t* scratch, int64_t n, int64_t S,
                             int64_t words) {
  const int64_t row = blockIdx.y, i = blockIdx.x;
  if (src[i] < 0 || src[i] >= S) return;  // out of range: skipped (checking on the host would need a sync)
  const uint32_t* from = cache + (row * S + src[i]) * words;
  uint32_t* to = scratch + (row * n + i) * words;
  for (int64_t w = threadIdx.x; w < words; w += blockDim.x) to[w] = from[w];
}

__global__ void scatter_slots(uint32_t* cache, const int64_t* src, const uint32_t* scratch, int64_t n, int64_t S,
                              int64_t words, int64_t dst_start) {
  const int64_t row = blockIdx.y, i = blockIdx.x;
  if (src[i] < 0 || src[i] >= S) return;  // nothing was gathered for it
  const uint32_t* from = scratch + (row * n + i) * words;
  uint32_t* to = cache + (row * S + dst_start + i) * words;
  for (int64_t w = threadIdx.x; w < words; w += blockDim.x) to[w] = from[w];
}

}  // namespace

cudaError_t tr_engine::launch_compact_kv(void* cache, const int64_t* src_slots, void* scratch, int64_t rows, int64_t n, int64_t S,
                              int64_t slot_bytes, int64_t dst_start, cudaStream_t stream) {
  if (n == 0 || rows == 0) return cudaSuccess;
  const int64_t words = slot_bytes / 4;
  const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>(rows));
  const int threads = words >= 128 ? 128 : 32;
  gather_slots<<<grid, threads, 0, stream>>>(static_cast<const uint32_t*>(cache), src_slots,
                                             static_cast<uint32_t*>(scratch), n, S, words);
  scatter_slots<<<grid, threads, 0, stream>>>(static_cast<uint32_t*>(cache), src_slots,
                                              static_cast<const uint32_t*>(scratch), n, S, words, dst_start);
  return cudaGetLastError();
}
