// The CUDA launchers: what each csrc/cuda/*.cu defines and csrc/cuda/ops_cuda.cpp calls, declared once. Both sides
// include this header, and each .cu defines its launcher by its qualified name (`tr_engine::launch_...`), which C++
// accepts only for a function declared here with the same parameters: a launcher that drifts from its declaration is a
// compile error, not a crash at load time (tests/test_cuda_sources.py checks that it stays one). Plain C++ with the
// CUDA runtime's types, no torch, so nvcc compiles the kernels alone.
//
// dtype codes: 0 float32, 1 float16, 2 bfloat16. Every launcher returns the launch error (cudaSuccess when accepted).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace tr_engine {

// cache [rows, S, slot_bytes] (rows = L * 2 * Hkv): slots dst_start.. <- src_slots[0..n), through scratch
// [rows, n, slot_bytes]; a source slot outside [0, S) is skipped (its destination is left as it was).
cudaError_t launch_compact_kv(void* cache, const int64_t* src_slots, void* scratch, int64_t rows, int64_t n, int64_t S,
                              int64_t slot_bytes, int64_t dst_start, cudaStream_t stream);

// The prefix length is P, or *prefix_dev (read on the device, clamped to 0..S-T) when prefix_dev is not null. With
// `rows` (int64 [T, 3] on the device: slot, prefix length, first row of its sequence), k and v are N slots kv_stride_n
// elements apart and each row reads its own (tree_attention_rows); else k and v are one slot.
cudaError_t launch_tree_attention(int dtype, const void* q, int64_t q_stride_t, int64_t q_stride_h, const void* k,
                                  const void* v, int64_t kv_stride_h, int64_t kv_stride_s, const bool* mask, int T,
                                  int Hq, int Hkv, int D, int P, const int64_t* prefix_dev, const int64_t* rows,
                                  int64_t kv_stride_n, int N, int S, float scale, void* out, cudaStream_t stream);
int tree_attention_max_head_dim();

// table [V, k] <- the top-k ids of each logits row [n_rows, V] at its token's row; a token outside [0, V) is skipped.
cudaError_t launch_recycle_update(int dtype, int64_t* table, const int64_t* tokens, const void* logits, int n_rows,
                                  int64_t V, int k, cudaStream_t stream);
int recycle_update_max_k();

// y [rows, N] = x [rows, K] @ w [N, K].T, contiguous.
cudaError_t launch_skinny_linear(int dtype, const void* x, const void* w, void* y, int rows, int64_t K, int64_t N,
                                 cudaStream_t stream);
int skinny_linear_max_rows();

}  // namespace tr_engine
