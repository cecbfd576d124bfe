// CPU kernel of tr_engine::tree_attention, the attention of a verify step: each of the T tree tokens attends to every
// cached prefix key and to its own ancestors in the tree. A task is 6 query rows of one KV head (the G query heads
// that share it, for one or more tokens), and both parts run through the same register-tiled micro-GEMMs:
//  - the prefix part is dense and needs no mask: scores against all P keys, read once for the task's rows;
//  - the tree part is sparse (a token sees depth + 1 of the T tree keys): the task gathers just the union of its
//    tokens' ancestors (a dozen keys, not T) as extra columns, and masks the few that a row does not see.
// No [T, P + T] mask is ever built. Softmax runs in float (double for float64 inputs) over both parts together.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../tree_attention_checks.h"
#include "convert.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

using tr_engine_cpu::to_float;

// A micro-tile is kRows query rows x kCols keys (scores) or head-dim columns (output): 6 x 64 floats are 24 of the 32
// AVX-512 registers, which measured ~105 GFLOPS on one core here, against ~55 for 4 x 64 tiles.
constexpr int64_t kRows = 6;
constexpr int64_t kCols = 64;
constexpr int64_t kKeyPad = 16;  // prefix keys are padded to a multiple of this (one vector), not of kCols
constexpr int64_t kKeyBlock = 256;  // prefix keys per softmax block: 6 rows of scores stay in L1 (6 KB)

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// 2^x for x <= 0, within 2 ulp, as branch-free arithmetic the compiler vectorises (std::exp2 is a scalar call).
// Scores are kept in log2 units (the queries are pre-multiplied by log2(e)), so softmax needs 2^x, whose range
// reduction is exact: x = n + r with n = round(x), |r| <= 1/2; 2^r = e^(r ln2) by its degree-6 Taylor polynomial
// (relative error < 2e-7); 2^n is written into the exponent bits. Inputs below -126 (masked scores are -inf) give 0.
inline float exp2_nonpositive(float x) {
  const float x_in = x;
  x = std::max(x, -126.0f);  // keeps the exponent arithmetic below in range
  const float n = std::nearbyint(x);
  const float r = x - n;
  float p = 1.5403530e-4f;  // (ln 2)^6 / 6!
  p = std::fma(p, r, 1.3333558e-3f);
  p = std::fma(p, r, 9.6181291e-3f);
  p = std::fma(p, r, 5.5504109e-2f);
  p = std::fma(p, r, 2.4022651e-1f);
  p = std::fma(p, r, 6.9314718e-1f);  // ln 2
  p = std::fma(p, r, 1.0f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x_in < -126.0f ? 0.f : p * scale;
}
inline double exp2_nonpositive(double x) { return std::exp2(x); }

// s[r, j] = sum_d q[r, d] * kt[d, j] for r < R and the W keys j0..j0+W-1. q [R, D]; kt [D, ldk] holds the keys
// transposed, so the innermost loop runs along keys: one broadcast of q[r, d] times a vector of keys.
template <typename Acc, int64_t R, int64_t W>
void scores_chunk(const Acc* q, int64_t D, const Acc* kt, int64_t ldk, int64_t j0, Acc* s, int64_t lds) {
  Acc acc[R][W] = {};
  for (int64_t d = 0; d < D; ++d) {
    const Acc* k = kt + d * ldk + j0;
    for (int64_t r = 0; r < R; ++r) {
      const Acc qv = q[r * D + d];
#pragma omp simd
      for (int64_t j = 0; j < W; ++j) acc[r][j] += qv * k[j];
    }
  }
  for (int64_t r = 0; r < R; ++r) std::copy(acc[r], acc[r] + W, s + r * lds + j0);
}

// All n keys (a multiple of kKeyPad): wide chunks, then narrow ones for the rest.
template <typename Acc, int64_t R>
void scores_tile(const Acc* q, int64_t D, const Acc* kt, int64_t ldk, int64_t n, Acc* s, int64_t lds) {
  int64_t j0 = 0;
  for (; j0 + kCols <= n; j0 += kCols) scores_chunk<Acc, R, kCols>(q, D, kt, ldk, j0, s, lds);
  for (; j0 < n; j0 += kKeyPad) scores_chunk<Acc, R, kKeyPad>(q, D, kt, ldk, j0, s, lds);
}

// o[r, c0 + c] += sum_{j < n} p[r, j] * v[j, c0 + c] for r < R and the W columns from c0. v [n, >= c0 + W] in its
// storage type (converted in the loop: bf16 -> float is a shift), rows ldv apart; o [R, D].
template <typename Acc, int64_t R, int64_t W, typename V>
void values_chunk(const Acc* p, int64_t ldp, const V* v, int64_t ldv, int64_t c0, int64_t n, Acc* o, int64_t D) {
  Acc acc[R][W] = {};
  for (int64_t j = 0; j < n; ++j) {
    const V* vj = v + j * ldv + c0;
    for (int64_t r = 0; r < R; ++r) {
      const Acc pv = p[r * ldp + j];
#pragma omp simd
      for (int64_t c = 0; c < W; ++c) acc[r][c] += pv * to_float(vj[c]);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < W; ++c) o[r * D + c0 + c] += acc[r][c];
}

// All D columns: wide chunks, then one vector, then single columns (head dims that are not a multiple of 16).
template <typename Acc, int64_t R, typename V>
void values_tile(const Acc* p, int64_t ldp, const V* v, int64_t ldv, int64_t n, Acc* o, int64_t D) {
  int64_t c0 = 0;
  for (; c0 + kCols <= D; c0 += kCols) values_chunk<Acc, R, kCols>(p, ldp, v, ldv, c0, n, o, D);
  for (; c0 + kKeyPad <= D; c0 += kKeyPad) values_chunk<Acc, R, kKeyPad>(p, ldp, v, ldv, c0, n, o, D);
  for (; c0 < D; ++c0) values_chunk<Acc, R, 1>(p, ldp, v, ldv, c0, n, o, D);
}

// One KV head's keys in Acc, laid out for the score tiles: prefix keys transposed ([D, Pp], Pp = P rounded up to
// kKeyPad; the padding keys' scores are computed and masked) and tree keys as rows ([T, D]). Values need no layout
// change: the tiles read them from the cache where they are.
template <typename Acc>
struct HeadKeys {
  int64_t D, P, Pp, T;
  std::unique_ptr<Acc[]> data;  // uninitialised: fill_keys writes every element that is read
  Acc* kt() { return data.get(); }
  Acc* ktree() { return kt() + D * Pp; }
  HeadKeys(int64_t D, int64_t P, int64_t T)
      : D(D), P(P), Pp(round_up(P, kKeyPad)), T(T), data(new Acc[D * Pp + T * D]) {}
};

// Convert the keys of cache slots j0..j1-1 of one head (k points at slot 0; slot_stride elements between slots).
template <typename scalar_t, typename Acc>
void fill_keys(HeadKeys<Acc>& b, const scalar_t* k, int64_t slot_stride, int64_t j0, int64_t j1) {
  const int64_t D = b.D, P = b.P;
  // Transpose in blocks of 16 keys, so both the reads (16 key rows) and the writes (16 adjacent floats) stay in L1;
  // a full block has a fixed width, which the compiler turns into vector gathers.
  const int64_t prefix_end = std::min(j1, P);
  int64_t jb = j0;
  for (; jb + 16 <= prefix_end; jb += 16)
    for (int64_t d = 0; d < D; ++d) {
      Acc* dst = b.kt() + d * b.Pp + jb;
      const scalar_t* src = k + jb * slot_stride + d;
#pragma omp simd
      for (int64_t j = 0; j < 16; ++j) dst[j] = to_float(src[j * slot_stride]);
    }
  for (; jb < prefix_end; ++jb)
    for (int64_t d = 0; d < D; ++d) b.kt()[d * b.Pp + jb] = to_float(k[jb * slot_stride + d]);
  for (int64_t j = std::max(j0, P); j < j1; ++j)
    for (int64_t d = 0; d < D; ++d) b.ktree()[(j - P) * D + d] = to_float(k[j * slot_stride + d]);
}

// Where one task works. Its R <= kRows query rows are query head qhead[r] of token tok[r].
template <typename scalar_t, typename Acc>
struct TaskScratch {
  std::vector<Acc> qs, s, ku, o;   // [R, D] scaled queries, [R, lds] one key block's scores, [D, Tp] tree keys, [R, D]
  int64_t lds;                     // room for a block of prefix keys or all tree keys
  std::vector<scalar_t> vu;        // [Tp, D] tree value rows, as stored
  std::vector<int64_t> tree_keys;  // the union of the task's tokens' visible tree keys (indices into the tree)
  std::unique_ptr<bool[]> seen;    // [T] membership in that union
  TaskScratch(int64_t D, int64_t T)
      : qs(kRows * D), ku(D * round_up(T, kKeyPad)), o(kRows * D), lds(std::max(kKeyBlock, round_up(T, kKeyPad))),
        vu(round_up(T, kKeyPad) * D), seen(new bool[T]) {
    s.resize(kRows * lds);
    tree_keys.reserve(T);
  }
};

template <typename scalar_t, typename Acc, int64_t R>
void attend_rows(const scalar_t* q, const int64_t* q_strides, Acc log2_scale, HeadKeys<Acc>& b, const scalar_t* v,
                 int64_t ldv, const bool* mask, const int64_t* tok, const int64_t* qhead,
                 TaskScratch<scalar_t, Acc>& w, scalar_t* out, int64_t Hq) {
  const int64_t D = b.D, P = b.P, Pp = b.Pp, T = b.T;
  Acc* qs = w.qs.data();
  for (int64_t r = 0; r < R; ++r) {
    const scalar_t* qr = q + tok[r] * q_strides[0] + qhead[r] * q_strides[1];
    for (int64_t d = 0; d < D; ++d) qs[r * D + d] = to_float(qr[d]) * log2_scale;
  }
  // The tree keys any row of the task sees, gathered: transposed keys ku [D, nup] and value rows vu [nu, D].
  // The rows are token-major, so each distinct token's mask row is OR-ed in once.
  bool* seen = w.seen.get();
  std::fill(seen, seen + T, false);
  for (int64_t r = 0; r < R; ++r)
    if (r == 0 || tok[r] != tok[r - 1])
      for (int64_t i = 0; i < T; ++i) seen[i] |= mask[tok[r] * T + i];
  auto& keys = w.tree_keys;
  keys.clear();
  for (int64_t i = 0; i < T; ++i)
    if (seen[i]) keys.push_back(i);
  const int64_t nu = static_cast<int64_t>(keys.size()), nup = round_up(nu, kKeyPad);
  for (int64_t u = 0; u < nu; ++u) {
    const Acc* key = b.ktree() + keys[u] * D;
    for (int64_t d = 0; d < D; ++d) w.ku[d * nup + u] = key[d];
    std::copy(v + (P + keys[u]) * ldv, v + (P + keys[u]) * ldv + D, w.vu.begin() + u * D);
  }
  // Flash-attention style: key blocks of kKeyBlock prefix keys, then the gathered tree keys, each folded into a
  // running max m, sum l and output o per row, so the scores of a block stay in L1 however long the prefix is.
  Acc m[R], l[R];
  std::fill(m, m + R, -std::numeric_limits<Acc>::infinity());
  std::fill(l, l + R, Acc(0));
  Acc* o = w.o.data();
  std::fill(o, o + R * D, Acc(0));
  Acc* s = w.s.data();
  const int64_t lds = w.lds;
  // Fold scores s[:, 0:width) (masked entries already -inf) and their value rows into (m, l, o).
  auto absorb = [&](int64_t width, const scalar_t* values, int64_t ld_values, int64_t n_values) {
    for (int64_t r = 0; r < R; ++r) {
      Acc* sr = s + r * lds;
      Acc block_max = -std::numeric_limits<Acc>::infinity();
#pragma omp simd reduction(max : block_max)
      for (int64_t j = 0; j < width; ++j) block_max = sr[j] > block_max ? sr[j] : block_max;
      const Acc new_max = std::max(m[r], block_max);
      const Acc correction = exp2_nonpositive(m[r] - new_max);  // 0 for the first block (m = -inf)
      Acc block_sum = 0;
#pragma omp simd reduction(+ : block_sum)
      for (int64_t j = 0; j < width; ++j) {
        sr[j] = exp2_nonpositive(sr[j] - new_max);
        block_sum += sr[j];
      }
      l[r] = l[r] * correction + block_sum;
      m[r] = new_max;
      for (int64_t d = 0; d < D; ++d) o[r * D + d] *= correction;
    }
    values_tile<Acc, R>(s, lds, values, ld_values, n_values, o, D);
  };
  constexpr Acc kMasked = -std::numeric_limits<Acc>::infinity();
  for (int64_t j0 = 0; j0 < P; j0 += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, P - j0), width = round_up(n, kKeyPad);
    scores_tile<Acc, R>(qs, D, b.kt() + j0, Pp, width, s, lds);
    for (int64_t r = 0; r < R; ++r) std::fill(s + r * lds + n, s + r * lds + width, kMasked);  // padding keys
    absorb(width, v + j0 * ldv, ldv, n);
  }
  scores_tile<Acc, R>(qs, D, w.ku.data(), nup, nup, s, lds);
  for (int64_t r = 0; r < R; ++r)  // tree padding, and tree keys that are another token's ancestors
    for (int64_t u = 0; u < nup; ++u)
      if (u >= nu || !mask[tok[r] * T + keys[u]]) s[r * lds + u] = kMasked;
  absorb(nup, w.vu.data(), D, nu);
  Acc* total = l;
  for (int64_t r = 0; r < R; ++r) {
    scalar_t* dst = out + (tok[r] * Hq + qhead[r]) * D;
    const Acc inv = Acc(1) / total[r];
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(o[r * D + d] * inv);
  }
}

template <typename scalar_t, typename Acc>
void tree_attention_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t P,
                           const bool* mask, double scale, at::Tensor& out) {
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(0), G = Hq / Hkv;
  const auto* kp = k.data_ptr<scalar_t>();
  const auto* vp = v.data_ptr<scalar_t>();
  const int64_t slot_stride = k.stride(1);
  // Convert each KV head's keys once; every task of that head reads them.
  std::vector<HeadKeys<Acc>> heads;
  heads.reserve(Hkv);
  for (int64_t h = 0; h < Hkv; ++h) heads.emplace_back(D, P, T);
  constexpr int64_t kFillBlock = 128;  // slots per conversion task
  const int64_t fill_blocks = (P + T + kFillBlock - 1) / kFillBlock;
  at::parallel_for(0, Hkv * fill_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / fill_blocks, j0 = i % fill_blocks * kFillBlock;
      fill_keys(heads[h], kp + h * k.stride(0), slot_stride, j0, std::min(j0 + kFillBlock, P + T));
    }
  });
  // Tasks: each KV head's G*T query rows (token-major: the G heads of token t are adjacent) in blocks of kRows.
  const int64_t rows = G * T, blocks = (rows + kRows - 1) / kRows;
  const int64_t q_strides[2] = {q.stride(0), q.stride(1)};
  const Acc log2_scale = static_cast<Acc>(scale * 1.4426950408889634);  // scores in log2 units: softmax by 2^x
  const auto* qp = q.data_ptr<scalar_t>();
  auto* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, Hkv * blocks, 1, [&](int64_t begin, int64_t end) {
    TaskScratch<scalar_t, Acc> scratch(D, T);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / blocks, r0 = task % blocks * kRows, R = std::min(kRows, rows - r0);
      int64_t tok[kRows], qhead[kRows];
      for (int64_t r = 0; r < R; ++r) {
        tok[r] = (r0 + r) / G;
        qhead[r] = h * G + (r0 + r) % G;
      }
      auto run = [&](auto rows_const) {
        attend_rows<scalar_t, Acc, decltype(rows_const)::value>(qp, q_strides, log2_scale, heads[h],
                                                                vp + h * v.stride(0), slot_stride, mask, tok, qhead,
                                                                scratch, op, Hq);
      };
      switch (R) {
        case 1: run(std::integral_constant<int64_t, 1>{}); break;
        case 2: run(std::integral_constant<int64_t, 2>{}); break;
        case 3: run(std::integral_constant<int64_t, 3>{}); break;
        case 4: run(std::integral_constant<int64_t, 4>{}); break;
        case 5: run(std::integral_constant<int64_t, 5>{}); break;
        default: run(std::integral_constant<int64_t, kRows>{}); break;
      }
    }
  });
}


at::Tensor tree_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t prefix_len,
                              const at::Tensor& tree_mask, double scale) {
  tr_engine::check_tree_attention_args(q, k, v, prefix_len, tree_mask);
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  const auto mask_c = tree_mask.contiguous();
  const bool* mask = mask_c.data_ptr<bool>();
  for (int64_t t = 0; t < T && prefix_len == 0; ++t)
    TORCH_CHECK(std::any_of(mask + t * T, mask + (t + 1) * T, [](bool b) { return b; }), "tree_attention: token ", t,
                " sees no key (prefix_len is 0 and its tree_mask row is all False)");
  auto out = at::empty({T, Hq, D}, q.options());
  if (T == 0) return out;
  switch (q.scalar_type()) {
    case at::kFloat: tree_attention_kernel<float, float>(q, k, v, prefix_len, mask, scale, out); break;
    case at::kDouble: tree_attention_kernel<double, double>(q, k, v, prefix_len, mask, scale, out); break;
    case at::kBFloat16:
      tree_attention_kernel<c10::BFloat16, float>(q, k, v, prefix_len, mask, scale, out);
      break;
    case at::kHalf: tree_attention_kernel<c10::Half, float>(q, k, v, prefix_len, mask, scale, out); break;
    default:
      TORCH_CHECK(false, "tree_attention: dtype ", q.scalar_type(),
                  " is not supported (float32, bfloat16, float16, float64)");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tr_engine, CPU, m) { m.impl("tree_attention", &tree_attention_cpu); }
