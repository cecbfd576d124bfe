// CPU kernel of tr_engine::tree_attention, the attention of a verify step: each of the T tree tokens attends to every
// cached prefix key and to its own ancestors in the tree. The two parts are computed differently:
//  - the prefix part is dense and needs no mask, so it runs as register-tiled micro-GEMMs over 6 query rows at a
//    time; the G query heads that share a KV head are those rows, so each key is read once for the whole group;
//  - the tree part is sparse (a token sees depth + 1 of the T tree keys), so it is a few dot products per row.
// Nothing of size [T, P + T] is built: no boolean mask, no additive float mask. Softmax runs in float (double for
// float64 inputs) over the scores of both parts together.
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
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // below this exp underflows float; the result is then ~1e-38, as good as 0
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
  return p * scale;
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

// o[r, c] += sum_{j < n} p[r, j] * v[j, c] for r < R, c < Dp (a multiple of kCols). v [n, Dp] row-major.
template <typename Acc, int64_t R>
void values_tile(const Acc* p, int64_t ldp, const Acc* v, int64_t Dp, int64_t n, Acc* o) {
  for (int64_t c0 = 0; c0 < Dp; c0 += kCols) {
    Acc acc[R][kCols] = {};
    for (int64_t j = 0; j < n; ++j) {
      const Acc* vj = v + j * Dp + c0;
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
// to kKeyPad; the padding keys' scores are computed and never read), tree keys as rows ([T, D]), all values as rows
// ([P + T, Dp], Dp = D rounded up to kCols; the padding columns are zero).
template <typename Acc>
struct HeadBuffers {
  int64_t D, Dp, P, Pp, T;
  std::unique_ptr<Acc[]> data;  // uninitialised: fill_keys writes every element that is read
  Acc* kt() { return data.get(); }
  Acc* ktree() { return kt() + D * Pp; }
  Acc* values() { return ktree() + T * D; }
  HeadBuffers(int64_t D, int64_t P, int64_t T)
      : D(D), Dp(round_up(D, kCols)), P(P), Pp(round_up(P, kKeyPad)), T(T),
        data(new Acc[D * Pp + T * D + (P + T) * Dp]) {}
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
  for (int64_t j = j0; j < j1; ++j) {
    Acc* row = b.values() + j * b.Dp;
    for (int64_t d = 0; d < D; ++d) row[d] = to_float(v[j * slot_stride + d]);
    std::fill(row + D, row + b.Dp, Acc(0));
  }
}

// The rows of one task: R <= kRows query rows of KV head h. Row r is query head h*G + g of token t.
template <typename scalar_t, typename Acc, int64_t R>
void attend_rows(const scalar_t* q, const int64_t* q_strides, Acc scale, HeadBuffers<Acc>& b, const int64_t* tok,
                 const int64_t* qhead, const std::vector<std::vector<int64_t>>& ancestors, Acc* scratch, scalar_t* out,
                 int64_t Hq) {
  const int64_t D = b.D, Dp = b.Dp, P = b.P, Pp = b.Pp;
  Acc* qs = scratch;              // [R, D] scaled queries
  Acc* s = qs + R * D;            // [R, Pp] prefix scores, then probabilities
  Acc* o = s + R * Pp;            // [R, Dp] output accumulators
  Acc* ts = o + R * Dp;           // [R, T] tree scores, then probabilities (first |ancestors| used)
  for (int64_t r = 0; r < R; ++r) {
    const scalar_t* qr = q + tok[r] * q_strides[0] + qhead[r] * q_strides[1];
    for (int64_t d = 0; d < D; ++d) qs[r * D + d] = to_float(qr[d]) * scale;
  }
  if (Pp > 0) scores_tile<Acc, R>(qs, D, b.kt(), Pp, Pp, s, Pp);
  std::fill(o, o + R * Dp, Acc(0));
  Acc total[R];
  for (int64_t r = 0; r < R; ++r) {
    const auto& anc = ancestors[tok[r]];
    Acc* sr = s + r * Pp;
    Acc* tr = ts + r * b.T;
    for (size_t a = 0; a < anc.size(); ++a) {
      const Acc* kk = b.ktree() + anc[a] * D;
      Acc dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qs[r * D + d] * kk[d];
      tr[a] = dot;
    }
    Acc m = -std::numeric_limits<Acc>::infinity();
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < P; ++j) m = sr[j] > m ? sr[j] : m;
    for (size_t a = 0; a < anc.size(); ++a) m = std::max(m, tr[a]);
    Acc l = 0;
#pragma omp simd reduction(+ : l)
    for (int64_t j = 0; j < P; ++j) {
      sr[j] = exp_nonpositive(sr[j] - m);
      l += sr[j];
    }
    for (size_t a = 0; a < anc.size(); ++a) {
      tr[a] = exp_nonpositive(tr[a] - m);
      l += tr[a];
      const Acc* vv = b.values() + (P + anc[a]) * Dp;
      for (int64_t d = 0; d < D; ++d) o[r * Dp + d] += tr[a] * vv[d];
    }
    total[r] = l;
  }
  if (P > 0) values_tile<Acc, R>(s, Pp, b.values(), Dp, P, o);
  for (int64_t r = 0; r < R; ++r) {
    scalar_t* dst = out + (tok[r] * Hq + qhead[r]) * D;
    const Acc inv = Acc(1) / total[r];
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(o[r * Dp + d] * inv);
  }
}

template <typename scalar_t, typename Acc>
void tree_attention_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t P,
                           const std::vector<std::vector<int64_t>>& ancestors, double scale, at::Tensor& out) {
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(0), G = Hq / Hkv;
  // Convert each KV head once; every task of that head reads it.
  std::vector<HeadBuffers<Acc>> heads;
  heads.reserve(Hkv);
  for (int64_t h = 0; h < Hkv; ++h) heads.emplace_back(D, P, T);
  const auto* kp = k.data_ptr<scalar_t>();
  const auto* vp = v.data_ptr<scalar_t>();
  constexpr int64_t kFillBlock = 128;  // slots per conversion task
  const int64_t fill_blocks = (P + T + kFillBlock - 1) / kFillBlock;
  at::parallel_for(0, Hkv * fill_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / fill_blocks, j0 = i % fill_blocks * kFillBlock;
      fill_keys(heads[h], kp + h * k.stride(0), vp + h * v.stride(0), k.stride(1), j0,
                std::min(j0 + kFillBlock, P + T));
    }
  });
  // Tasks: each KV head's G*T query rows (token-major: the G heads of token t are adjacent) in blocks of kRows.
  const int64_t rows = G * T, blocks = (rows + kRows - 1) / kRows;
  const int64_t q_strides[2] = {q.stride(0), q.stride(1)};
  const auto* qp = q.data_ptr<scalar_t>();
  auto* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, Hkv * blocks, 1, [&](int64_t begin, int64_t end) {
    const auto& b0 = heads[0];
    std::vector<Acc> scratch(kRows * (D + b0.Pp + b0.Dp + T));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / blocks, r0 = task % blocks * kRows, R = std::min(kRows, rows - r0);
      int64_t tok[kRows], qhead[kRows];
      for (int64_t r = 0; r < R; ++r) {
        tok[r] = (r0 + r) / G;
        qhead[r] = h * G + (r0 + r) % G;
      }
      auto run = [&](auto rows_const) {
        attend_rows<scalar_t, Acc, decltype(rows_const)::value>(qp, q_strides, static_cast<Acc>(scale), heads[h], tok,
                                                                qhead, ancestors, scratch.data(), op, Hq);
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
  // The visible tree keys of each token, from the mask (T^2 bools, read once per call rather than once per head).
  const auto mask = tree_mask.contiguous();
  const bool* m = mask.data_ptr<bool>();
  std::vector<std::vector<int64_t>> ancestors(T);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < T; ++i)
      if (m[t * T + i]) ancestors[t].push_back(i);
    TORCH_CHECK(prefix_len > 0 || !ancestors[t].empty(), "tree_attention: token ", t,
                " sees no key (prefix_len is 0 and its tree_mask row is all False)");
  }
  auto out = at::empty({T, Hq, D}, q.options());
  if (T == 0) return out;
  switch (q.scalar_type()) {
    case at::kFloat: tree_attention_kernel<float, float>(q, k, v, prefix_len, ancestors, scale, out); break;
    case at::kDouble: tree_attention_kernel<double, double>(q, k, v, prefix_len, ancestors, scale, out); break;
    case at::kBFloat16:
      tree_attention_kernel<c10::BFloat16, float>(q, k, v, prefix_len, ancestors, scale, out);
      break;
    case at::kHalf: tree_attention_kernel<c10::Half, float>(q, k, v, prefix_len, ancestors, scale, out); break;
    default:
      TORCH_CHECK(false, "tree_attention: dtype ", q.scalar_type(),
                  " is not supported (float32, bfloat16, float16, float64)");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tr_engine, CPU, m) { m.impl("tree_attention", &tree_attention_cpu); }
