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

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// exp(x) for x <= 0, within 2 ulp, as branch-free arithmetic the compiler vectorises (std::exp is a scalar call).
// x = n ln2 + r with |r| <= ln2/2; exp(r) by its degree-6 Taylor polynomial; 2^n written into the exponent bits.
// Inputs below -87 (masked scores are -inf) give exactly 0.
inline float exp_nonpositive(float x) {
  const float x_in = x;
  x = std::max(x, -87.0f);  // keeps the exponent arithmetic below in range
  const float n = std::nearbyint(x * 1.44269504f);
  const float r = std::fma(n, -0.693145752f, std::fma(n, -1.42860677e-6f, x));  // ln2 in two parts: exact n*ln2_hi
  float p = 1.f / 720;
  p = std::fma(p, r, 1.f / 120);
  p = std::fma(p, r, 1.f / 24);
  p = std::fma(p, r, 1.f / 6);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.f);
  p = std::fma(p, r, 1.f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x_in < -87.0f ? 0.f : p * scale;
}
inline double exp_nonpositive(double x) { return std::exp(x); }

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

// o[r, c] += sum_{j < n} p[r, j] * v[j, c] for r < R, c < Dp (a multiple of kCols). v [n, >= Dp], rows ldv apart.
template <typename Acc, int64_t R>
void values_tile(const Acc* p, int64_t ldp, const Acc* v, int64_t ldv, int64_t Dp, int64_t n, Acc* o) {
  for (int64_t c0 = 0; c0 < Dp; c0 += kCols) {
    Acc acc[R][kCols] = {};
    for (int64_t j = 0; j < n; ++j) {
      const Acc* vj = v + j * ldv + c0;
      for (int64_t r = 0; r < R; ++r) {
        const Acc pv = p[r * ldp + j];
#pragma omp simd
        for (int64_t c = 0; c < kCols; ++c) acc[r][c] += pv * vj[c];
      }
    }
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < kCols; ++c) o[r * Dp + c0 + c] += acc[r][c];
  }
}

// One KV head's keys and values in Acc, laid out for the tiles: prefix keys transposed ([D, Pp], Pp = P rounded up
// to kKeyPad; the padding keys' scores are computed and masked), tree keys as rows ([T, D]), and all P + T values as
// rows of at least Dp = D rounded up to kCols columns (zero-padded), ldv apart. float32 values whose rows already
// have Dp columns are read from the cache where they are, not copied.
template <typename Acc>
struct HeadBuffers {
  int64_t D, Dp, P, Pp, T;
  std::unique_ptr<Acc[]> data;  // uninitialised: fill_keys writes every element that is read
  const Acc* values = nullptr;
  int64_t ldv = 0;
  Acc* kt() { return data.get(); }
  Acc* ktree() { return kt() + D * Pp; }
  Acc* value_copy() { return ktree() + T * D; }
  HeadBuffers(int64_t D, int64_t P, int64_t T, bool copy_values)
      : D(D), Dp(round_up(D, kCols)), P(P), Pp(round_up(P, kKeyPad)), T(T),
        data(new Acc[D * Pp + T * D + (copy_values ? (P + T) * Dp : 0)]) {
    if (copy_values) values = value_copy(), ldv = Dp;
  }
};

// Convert cache slots j0..j1-1 of one head (k, v point at slot 0; slot_stride elements between slots).
template <typename scalar_t, typename Acc>
void fill_keys(HeadBuffers<Acc>& b, const scalar_t* k, const scalar_t* v, int64_t slot_stride, int64_t j0,
               int64_t j1) {
  const int64_t D = b.D, P = b.P;
  // Transpose in blocks of 16 keys, so both the reads (16 key rows) and the writes (16 adjacent floats) stay in L1.
  for (int64_t jb = j0; jb < std::min(j1, P); jb += 16)
    for (int64_t d = 0; d < D; ++d)
      for (int64_t j = jb; j < std::min({jb + 16, j1, P}); ++j) b.kt()[d * b.Pp + j] = to_float(k[j * slot_stride + d]);
  for (int64_t j = std::max(j0, P); j < j1; ++j)
    for (int64_t d = 0; d < D; ++d) b.ktree()[(j - P) * D + d] = to_float(k[j * slot_stride + d]);
  if (b.values != b.value_copy()) return;  // read in place
  for (int64_t j = j0; j < j1; ++j) {
    Acc* row = b.value_copy() + j * b.Dp;
    for (int64_t d = 0; d < D; ++d) row[d] = to_float(v[j * slot_stride + d]);
    std::fill(row + D, row + b.Dp, Acc(0));
  }
}

// Where one task works: R <= kRows query rows, row r being query head qhead[r] of token tok[r].
template <typename Acc>
struct TaskScratch {
  std::vector<Acc> qs, s, ku, vu, o;  // [R, D], [R, Pp + Tp], [D, Tp], [Tp, Dp], [R, Dp]
  std::vector<int64_t> tree_keys;     // the union of the task's tokens' visible tree keys (indices into the tree)
  std::unique_ptr<bool[]> seen_;      // [T] membership in that union
  bool* seen_data() { return seen_.get(); }
  TaskScratch(int64_t D, int64_t Dp, int64_t Pp, int64_t T)
      : qs(kRows * D), s(kRows * (Pp + round_up(T, kKeyPad))), ku(D * round_up(T, kKeyPad)),
        vu(round_up(T, kKeyPad) * Dp), o(kRows * Dp), seen_(new bool[T]) {
    tree_keys.reserve(T);
  }
};

template <typename scalar_t, typename Acc, int64_t R>
void attend_rows(const scalar_t* q, const int64_t* q_strides, Acc scale, const HeadBuffers<Acc>& b0, const bool* mask,
                 const int64_t* tok, const int64_t* qhead, TaskScratch<Acc>& w, scalar_t* out, int64_t Hq) {
  auto& b = const_cast<HeadBuffers<Acc>&>(b0);
  const int64_t D = b.D, Dp = b.Dp, P = b.P, Pp = b.Pp, T = b.T;
  Acc* qs = w.qs.data();
  for (int64_t r = 0; r < R; ++r) {
    const scalar_t* qr = q + tok[r] * q_strides[0] + qhead[r] * q_strides[1];
    for (int64_t d = 0; d < D; ++d) qs[r * D + d] = to_float(qr[d]) * scale;
  }
  // The tree keys any row of the task sees, gathered: transposed keys ku [D, nup] and value rows vu [nu, Dp].
  // The rows are token-major, so each distinct token's mask row is OR-ed in once.
  bool* seen = w.seen_data();
  std::fill(seen, seen + T, false);
  for (int64_t r = 0; r < R; ++r)
    if (r == 0 || tok[r] != tok[r - 1])
      for (int64_t i = 0; i < T; ++i) seen[i] |= mask[tok[r] * T + i];
  auto& keys = w.tree_keys;
  keys.clear();
  for (int64_t i = 0; i < T; ++i)
    if (seen[i]) keys.push_back(i);
  const int64_t nu = static_cast<int64_t>(keys.size()), nup = round_up(nu, kKeyPad), W = Pp + nup;
  for (int64_t u = 0; u < nu; ++u) {
    const Acc* key = b.ktree() + keys[u] * D;
    for (int64_t d = 0; d < D; ++d) w.ku[d * nup + u] = key[d];
  }
  for (int64_t u = 0; u < nu; ++u) std::copy(b.values + (P + keys[u]) * b.ldv, b.values + (P + keys[u]) * b.ldv + Dp,
                                             w.vu.begin() + u * Dp);
  // Scores: columns [0, Pp) the prefix, [Pp, Pp + nup) the gathered tree keys; then mask what a row must not see
  // (prefix padding, tree padding, and tree keys that are another token's ancestors).
  Acc* s = w.s.data();
  if (Pp > 0) scores_tile<Acc, R>(qs, D, b.kt(), Pp, Pp, s, W);
  scores_tile<Acc, R>(qs, D, w.ku.data(), nup, nup, s + Pp, W);
  constexpr Acc kMasked = -std::numeric_limits<Acc>::infinity();
  Acc total[R];
  for (int64_t r = 0; r < R; ++r) {
    Acc* sr = s + r * W;
    std::fill(sr + P, sr + Pp, kMasked);
    for (int64_t u = 0; u < nup; ++u)
      if (u >= nu || !mask[tok[r] * T + keys[u]]) sr[Pp + u] = kMasked;
    Acc m = kMasked;
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < W; ++j) m = sr[j] > m ? sr[j] : m;
    Acc l = 0;
#pragma omp simd reduction(+ : l)
    for (int64_t j = 0; j < W; ++j) {
      sr[j] = exp_nonpositive(sr[j] - m);
      l += sr[j];
    }
    total[r] = l;
  }
  Acc* o = w.o.data();
  std::fill(o, o + R * Dp, Acc(0));
  if (P > 0) values_tile<Acc, R>(s, W, b.values, b.ldv, Dp, P, o);
  values_tile<Acc, R>(s + Pp, W, w.vu.data(), Dp, Dp, nu, o);
  for (int64_t r = 0; r < R; ++r) {
    scalar_t* dst = out + (tok[r] * Hq + qhead[r]) * D;
    const Acc inv = Acc(1) / total[r];
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(o[r * Dp + d] * inv);
  }
}

template <typename scalar_t, typename Acc>
void tree_attention_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t P,
                           const bool* mask, double scale, at::Tensor& out) {
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(0), G = Hq / Hkv;
  const auto* kp = k.data_ptr<scalar_t>();
  const auto* vp = v.data_ptr<scalar_t>();
  const int64_t slot_stride = k.stride(1);
  // Convert each KV head once; every task of that head reads it.
  const bool in_place = std::is_same_v<scalar_t, Acc> && D % kCols == 0;
  std::vector<HeadBuffers<Acc>> heads;
  heads.reserve(Hkv);
  for (int64_t h = 0; h < Hkv; ++h) {
    heads.emplace_back(D, P, T, !in_place);
    if (in_place) heads[h].values = reinterpret_cast<const Acc*>(vp + h * v.stride(0)), heads[h].ldv = slot_stride;
  }
  constexpr int64_t kFillBlock = 128;  // slots per conversion task
  const int64_t fill_blocks = (P + T + kFillBlock - 1) / kFillBlock;
  at::parallel_for(0, Hkv * fill_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / fill_blocks, j0 = i % fill_blocks * kFillBlock;
      fill_keys(heads[h], kp + h * k.stride(0), vp + h * v.stride(0), slot_stride, j0,
                std::min(j0 + kFillBlock, P + T));
    }
  });
  // Tasks: each KV head's G*T query rows (token-major: the G heads of token t are adjacent) in blocks of kRows.
  const int64_t rows = G * T, blocks = (rows + kRows - 1) / kRows;
  const int64_t q_strides[2] = {q.stride(0), q.stride(1)};
  const auto* qp = q.data_ptr<scalar_t>();
  auto* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, Hkv * blocks, 1, [&](int64_t begin, int64_t end) {
    TaskScratch<Acc> scratch(D, heads[0].Dp, heads[0].Pp, T);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / blocks, r0 = task % blocks * kRows, R = std::min(kRows, rows - r0);
      int64_t tok[kRows], qhead[kRows];
      for (int64_t r = 0; r < R; ++r) {
        tok[r] = (r0 + r) / G;
        qhead[r] = h * G + (r0 + r) % G;
      }
      auto run = [&](auto rows_const) {
        attend_rows<scalar_t, Acc, decltype(rows_const)::value>(qp, q_strides, static_cast<Acc>(scale), heads[h], mask,
                                                                tok, qhead, scratch, op, Hq);
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
  TORCH_CHECK(q.dim() == 3, "tree_attention: q must be [T, Hq, D], got ", q.dim(), " dims");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3, "tree_attention: k and v must be [Hkv, S, D]");
  TORCH_CHECK(k.sizes() == v.sizes() && k.strides() == v.strides(), "tree_attention: k and v must have the same shape "
              "and strides, got ", k.sizes(), " and ", v.sizes());
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(0), S = k.size(1);
  TORCH_CHECK(k.size(2) == D, "tree_attention: q has head dim ", D, " but k has ", k.size(2));
  TORCH_CHECK(Hkv >= 1 && Hq % Hkv == 0, "tree_attention: q's ", Hq, " heads are not a multiple of k's ", Hkv);
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
              "tree_attention: q, k and v must share a dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ",
              v.scalar_type());
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "tree_attention: q, k and v need a contiguous last (head) dim");
  TORCH_CHECK(prefix_len >= 0 && prefix_len + T <= S, "tree_attention: prefix_len ", prefix_len, " + T ", T,
              " exceeds the cache's ", S, " slots");
  TORCH_CHECK(tree_mask.dim() == 2 && tree_mask.size(0) == T && tree_mask.size(1) == T &&
                  tree_mask.scalar_type() == at::kBool,
              "tree_attention: tree_mask must be bool [T, T] = [", T, ", ", T, "], got ", tree_mask.scalar_type(), " ",
              tree_mask.sizes());
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
