// What a tier library (tr_engine/_cpu_<tier>.so) and the op library (tr_engine._C) share: the table of kernels one
// tier exports, and the operands of each kernel as plain pointers and sizes. No torch types cross it, so the tier
// libraries build without torch (and cross-compile for aarch64). The op library checks arguments, allocates outputs,
// and calls the active tier's table (csrc/cpu/tiers.cpp); the tier computes. Shapes as in csrc/registration.cpp.
#pragma once

#include "types.h"

#include <cstdint>
#include <type_traits>

namespace tr_engine_cpu {

// Raised whenever this file changes what a table holds: the op library refuses a tier library of another version
// (a stale build) instead of calling through a table it would misread.
constexpr int kAbiVersion = 4;

// Output rows per block of a packed weight (pack_linear's layout, the same on every tier).
constexpr int64_t kPackBlock = 32;

// A cache's keys and values: slot s, KV head h, position j at k + s * seq + h * head + j * pos (v the same), the head
// dim contiguous.
template <typename T>
struct CacheView {
  const T* k;
  const T* v;
  int64_t Hkv, seq, head, pos;
};

// tree_attention_batch's operands, checked already: sequence b's rows offsets[b]..offsets[b+1] of q [T, Hq, D] (rows
// q_row and heads q_head apart) attend to slot slots[b] of the cache after prefix_lens[b] cached keys, through its
// flattened T_b x T_b block of masks (every row sees at least one key); out [T, Hq, D] contiguous.
template <typename T>
struct Attention {
  const T* q;
  int64_t q_row, q_head, Hq, D;
  CacheView<T> cache;
  const int64_t* slots;
  const int64_t* prefix_lens;
  const int64_t* offsets;  // B + 1 entries
  int64_t B;
  const bool* masks;
  double scale;
  T* out;
};

// One decoder layer's weights: the norms' [E] and the projections packed ([blocks, groups, 32, P], groups given).
template <typename T>
struct LayerWeights {
  const T *input_norm, *qkv, *o, *post_norm, *gate_up, *down;
  int64_t qkv_groups, o_groups, gate_up_groups, down_groups;
};

// decoder_layers' operands, checked already: the residual stream h [T, E] (updated in place, through every layer and
// the final norm when final_norm is not null), the rows' cos/sin [T, D], the cache kv [L, N, 2, Hkv, S, D] with
// strides kv_strides (layer, slot, k|v, head, position), the rows as a ragged batch as in Attention, and two buffers
// the layers share: qkv [T, Hq + 2 Hkv, D] and attended [T, Hq, D].
template <typename T>
struct Layers {
  T* h;
  const LayerWeights<T>* layers;
  int64_t L;
  const T* final_norm;
  const T* cos;
  const T* sin;
  T* kv;
  int64_t kv_strides[5];
  const int64_t* slots;
  const int64_t* prefix_lens;
  const int64_t* offsets;
  int64_t B;
  const bool* masks;
  int64_t rows, E, Hq, Hkv, D, F;  // rows of h: T
  float eps;
  T* qkv;
  T* attended;
};

// One element type's kernels (nullptr where the op does not take the type).
template <typename T>
struct TypedKernels {
  // y [rows, N] (contiguous) = x [rows, ldx] @ w.T, wp = pack_linear(w) of w [N, groups * P]; x padded with zeros to
  // groups * P columns. Each output one sum over K in a fixed order: row-independent.
  void (*packed_rows)(const T* x, int64_t ldx, const T* wp, T* y, int64_t rows, int64_t groups, int64_t N);
  // y [rows, N] = x [rows, K] @ w [N, K].T for 1..16 rows, both contiguous.
  void (*skinny)(const T* x, const T* w, T* y, int64_t rows, int64_t K, int64_t N);
  void (*attention)(const Attention<T>& a);
  void (*layers)(const Layers<T>& a);
  // table[tokens[r]] <- the k ids of the largest logits[r] (best first, ties to the lower id) for each r with keep[r].
  void (*top_k_rows)(int64_t* table, int64_t k, const int64_t* tokens, const bool* keep, const T* logits,
                     int64_t rows, int64_t V);
  // out[r] = the first index of row r's maximum (a NaN counts as the largest) of x [rows, V].
  void (*argmax_rows)(const T* x, int64_t rows, int64_t V, int64_t* out);
};

// What the op library lends a tier: its thread pool. parallel_for(begin, end, grain, body, ctx) calls
// body(ctx, b, e) on disjoint chunks covering [begin, end), as at::parallel_for does (whose pool it is); threads() is
// how many threads a parallel_for called there would run on (1 inside another's region), which a kernel may split its
// work by (never its sums).
using ParallelBody = void (*)(void* ctx, int64_t begin, int64_t end);
struct Host {
  void (*parallel_for)(int64_t begin, int64_t end, int64_t grain, ParallelBody body, void* ctx);
  int (*threads)();
};

struct Kernels {
  int abi;           // kAbiVersion of the library's build
  const char* tier;  // its tier's name (tr_engine/model/cpu.py)
  TypedKernels<float> float32;
  TypedKernels<double> float64;
  TypedKernels<bf16> bfloat16;
  TypedKernels<f16> float16;
  // `units` fixed units of independent multiply-adds over the thread pool (peak.h); returns the FLOPs done, for the
  // caller to time: the tier's arithmetic peak, for float32 and float16 (multiply_adds) and for bf16
  // (bf16_multiply_adds: the pair dot product's where the tier has it).
  double (*multiply_adds)(int64_t units);
  double (*bf16_multiply_adds)(int64_t units);
};

// The table's entries for element type T.
template <typename T>
const TypedKernels<T>& typed(const Kernels& k) {
  if constexpr (std::is_same_v<T, float>) return k.float32;
  else if constexpr (std::is_same_v<T, double>) return k.float64;
  else if constexpr (std::is_same_v<T, bf16>) return k.bfloat16;
  else return k.float16;
}

// Each tier library's one exported symbol: its table, bound to the host's thread pool.
using KernelsEntry = const Kernels* (*)(const Host* host);
constexpr const char* kKernelsEntry = "tr_engine_cpu_kernels";

}  // namespace tr_engine_cpu
