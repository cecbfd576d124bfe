// The attention's arithmetic (attention.h drives it): its shapes (a task's rows, the softmax's blocks of keys), the
// softmax's halves (split_point, merge_halves) and a row's output, and the micro-tiles that compute a block's scores
// and its values' weighted sum: in vectors on every tier, on AMX's tiles for the amx tier's bf16 heads. Each sum is a
// function of its own row and key (or value column) in a fixed order, wherever it is computed: what keeps the
// attention row-independent.
#pragma once

#include "simd.h"
#include "tiles.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace tr_engine_cpu {

// A micro-tile is kRows query rows x kCols keys (scores) or head-dim columns (output), kRows x kCols / kLanes
// accumulators: with AVX-512, 6 x 64 floats are 24 of the 32 registers, which measured ~105 GFLOPS on one core, against
// ~55 for 4 x 64 tiles; 6 x 16 on 16 registers of 8 lanes (AVX2) or 32 of 4 (NEON) fill them alike.
constexpr int64_t kRows = 6;
constexpr int64_t kCols = kLanes == 16 ? 64 : 16;
constexpr int64_t kKeyPad = 16;  // prefix keys are padded to a multiple of this (one vector), not of kCols
constexpr int64_t kKeyBlock = 256;  // keys per softmax block: 6 rows of scores stay in L1 (6 KB)
// The most query rows a task takes: one AMX tile's on the amx tier (its bf16 heads: amx_attention), kRows elsewhere.
constexpr int64_t kTaskRows = kAmx ? 16 : kRows;
// A causal chunk (a prompt's) is attended as a prefix that each row sees up to itself (attend_rows): the rows of one
// task end at most kTaskRows keys apart, so the keys past their last shared block are fewer than this.
constexpr int64_t kTailWidth = kKeyBlock + kKeyPad * ((kTaskRows + kKeyPad - 1) / kKeyPad);
// From this many tokens on, a causal mask (a lower triangle of ones) is attended that way rather than as a tree.
constexpr int64_t kCausalMin = 16;

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// 2^x for x <= 0 (numbers.h's exp2_clamped: its bits for x >= -126, 0 below). Scores are kept in log2 units (the
// queries are pre-multiplied by log2(e)), so softmax needs 2^x; masked scores are -inf and give 0. Computed, then
// selected: written as a choice before the call, the compiler keeps a branch (and a scalar loop) on AVX2.
inline float exp2_nonpositive(float x) {
  const float p = exp2_clamped(x);
  return x < -126.0f ? 0.f : p;
}
inline double exp2_nonpositive(double x) { return std::exp2(x); }

// A row that sees more than two blocks of keys (kKeyBlock) takes its softmax in two halves: the keys before
// split_point(n) of its n, and the rest, each folded block by block from a fresh start, then merged (merge_halves). The
// split is a function of the row's own key count, wherever the row is computed, so a task may fold both halves (a
// verify's rows, a prompt's) or give them to two tasks on two threads (a decode step's head, whose single task would
// otherwise be the unit the threads share: SmolLM2's 3 KV heads on 2 threads left one idle a third of the time), with
// the same bits. 0: two blocks or fewer, no halves (a second half of a few keys would balance nothing, and each merge
// costs: a 32-token verify's attention at prefix 300 took 5% longer with halves from 257 keys on).
inline int64_t split_point(int64_t n) {
  const int64_t blocks = (n + kKeyBlock - 1) / kKeyBlock;
  return blocks >= 3 ? blocks / 2 * kKeyBlock : 0;
}

// How many of a tree's T tokens token t sees (its row of the [T, T] mask: its ancestors and itself); with the prefix,
// the keys a row of that token sees, which its split_point follows.
inline int64_t tree_keys_seen(const bool* mask, int64_t T, int64_t t) {
  int64_t n = 0;
  for (int64_t i = 0; i < T; ++i) n += mask[t * T + i];
  return n;
}

// Which of a row's halves a task folds: both (merged at its end), or one of them (merged after the tasks).
enum class Half { kBoth, kFirst, kSecond };

// The softmax state of the first half (m1, l1, o1) merged into the second's (m2, l2, o2): each half's sums rescaled to
// the larger maximum. One compiled body for every caller (noinline): a merge inside a task and one after two tasks
// must give the same bits.
template <typename Acc>
__attribute__((noinline)) void merge_halves(Acc m1, Acc l1, const Acc* o1, Acc& m2, Acc& l2, Acc* o2, int64_t D) {
  const Acc m = std::max(m1, m2), c1 = exp2_nonpositive(m1 - m), c2 = exp2_nonpositive(m2 - m);
  l2 = l1 * c1 + l2 * c2;
  for (int64_t d = 0; d < D; ++d) o2[d] = o1[d] * c1 + o2[d] * c2;
  m2 = m;
}

// A row's output: its weighted values o over the softmax's sum l, in the row's dtype.
template <typename scalar_t, typename Acc>
void finish_row(const Acc* o, Acc l, scalar_t* dst, int64_t D) {
  const Acc inv = Acc(1) / l;
  for (int64_t d = 0; d < D; ++d) {
    if constexpr (std::is_same_v<Acc, double>)
      dst[d] = o[d] * inv;
    else
      dst[d] = from_float<scalar_t>(o[d] * inv);
  }
}

// Keys transposed, so that a score tile's innermost loop runs along keys (one broadcast of q[r, d] times a vector of
// keys), in groups of kKeyPad keys: dim d of key j at kt[(j / kKeyPad) * group + d * dim + j % kKeyPad]. A prefix's
// keys are stored group by group (group = D * kKeyPad, dim = kKeyPad), so a tile reads each group's D x kKeyPad block
// in one sequential run; a tree's few keys as plain [D, ld] rows (group = kKeyPad, dim = ld).
struct KeyLayout {
  int64_t group, dim;
};

// s[r, j] = sum_d q[r, d] * k[d, j] for r < R and the W keys j0..j0+W-1 (j0 and W multiples of kKeyPad). q [R, D].
// (Prefix keys as [D, ld] rows, a tile read D lines ~1 KB apart per group of keys, each asked for one multiply-add
// before it was used: on the AVX2 tier the score tiles of an 8-token fp32 verify ran at a fifth of the FMA peak.)
template <typename Acc, int64_t R, int64_t W>
void scores_chunk(const Acc* q, int64_t D, const Acc* kt, KeyLayout layout, int64_t j0, Acc* s, int64_t lds) {
  constexpr int64_t G = W / kKeyPad;  // groups of keys
  static_assert(W % kKeyPad == 0, "a chunk covers whole groups of keys");
  Acc acc[R][W] = {};
  for (int64_t d = 0; d < D; ++d)
    for (int64_t g = 0; g < G; ++g) {
      const Acc* k = kt + (j0 / kKeyPad + g) * layout.group + d * layout.dim;
      for (int64_t r = 0; r < R; ++r) {
        const Acc qv = q[r * D + d];
#pragma omp simd
        for (int64_t j = 0; j < kKeyPad; ++j) acc[r][g * kKeyPad + j] = fmadd(qv, k[j], acc[r][g * kKeyPad + j]);
      }
    }
  for (int64_t r = 0; r < R; ++r) std::copy(acc[r], acc[r] + W, s + r * lds + j0);
}

// All n keys (a multiple of kKeyPad): wide chunks, then narrow ones for the rest.
template <typename Acc, int64_t R>
void scores_tile(const Acc* q, int64_t D, const Acc* kt, KeyLayout layout, int64_t n, Acc* s, int64_t lds) {
  int64_t j0 = 0;
  for (; j0 + kCols <= n; j0 += kCols) scores_chunk<Acc, R, kCols>(q, D, kt, layout, j0, s, lds);
  for (; j0 < n; j0 += kKeyPad) scores_chunk<Acc, R, kKeyPad>(q, D, kt, layout, j0, s, lds);
}


// o[r, c0 + c] += sum_{j < n} p[r, j] * rows[j][c0 + c] for r < R and the W columns from c0: one block's value rows
// (cache rows or tree rows, wherever they are) in their storage type, converted in the loop (bf16 -> float is a
// shift); o [R, D]. The sum runs over j in order whatever the rows' source, so a row's output bits depend only on
// which value rows it sees, in which order.
template <typename Acc, int64_t R, int64_t W, typename V>
void values_chunk(const Acc* p, int64_t ldp, const V* const* rows, int64_t c0, int64_t n, Acc* o, int64_t D) {
  // The same multiply-adds as the loop below, written out in vectors: the compiler leaves the loop scalar for a
  // single row (a decode step), where it was half of the attention's time.
  if constexpr (std::is_same_v<Acc, float> && W % kLanes == 0) {
    constexpr int64_t NV = W / kLanes;
    Vec acc[R][NV];
    for (int64_t r = 0; r < R; ++r)
      for (int64_t i = 0; i < NV; ++i) acc[r][i] = zero();
    for (int64_t j = 0; j < n; ++j) {
      const V* vj = rows[j] + c0;
      Vec vv[NV];
      for (int64_t i = 0; i < NV; ++i) vv[i] = load(vj + kLanes * i);
      for (int64_t r = 0; r < R; ++r) {
        const Vec pv = broadcast(p[r * ldp + j]);
        for (int64_t i = 0; i < NV; ++i) acc[r][i] = mul_add(pv, vv[i], acc[r][i]);
      }
    }
    for (int64_t r = 0; r < R; ++r)
      for (int64_t i = 0; i < NV; ++i) {
        float* dst = o + r * D + c0 + kLanes * i;
        store(dst, add(load(dst), acc[r][i]));
      }
    return;
  }
  Acc acc[R][W] = {};
  for (int64_t j = 0; j < n; ++j) {
    const V* vj = rows[j] + c0;
    for (int64_t r = 0; r < R; ++r) {
      const Acc pv = p[r * ldp + j];
#pragma omp simd
      for (int64_t c = 0; c < W; ++c) acc[r][c] = fmadd(pv, Acc(to_float(vj[c])), acc[r][c]);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < W; ++c) o[r * D + c0 + c] += acc[r][c];
}

// All D columns: wide chunks, then one vector, then single columns (head dims that are not a multiple of 16).
template <typename Acc, int64_t R, typename V>
void values_tile(const Acc* p, int64_t ldp, const V* const* rows, int64_t n, Acc* o, int64_t D) {
  int64_t c0 = 0;
  for (; c0 + kCols <= D; c0 += kCols) values_chunk<Acc, R, kCols>(p, ldp, rows, c0, n, o, D);
  for (; c0 + kKeyPad <= D; c0 += kKeyPad) values_chunk<Acc, R, kKeyPad>(p, ldp, rows, c0, n, o, D);
  for (; c0 < D; ++c0) values_chunk<Acc, R, 1>(p, ldp, rows, c0, n, o, D);
}

// values_tile for a runtime number of rows (1..kRows), each count compiled on its own.
template <typename Acc, typename V>
void values_rows(int64_t rows_n, const Acc* p, int64_t ldp, const V* const* rows, int64_t n, Acc* o, int64_t D) {
  switch (rows_n) {
    case 1: values_tile<Acc, 1>(p, ldp, rows, n, o, D); break;
    case 2: values_tile<Acc, 2>(p, ldp, rows, n, o, D); break;
    case 3: values_tile<Acc, 3>(p, ldp, rows, n, o, D); break;
    case 4: values_tile<Acc, 4>(p, ldp, rows, n, o, D); break;
    case 5: values_tile<Acc, 5>(p, ldp, rows, n, o, D); break;
    default: values_tile<Acc, kRows>(p, ldp, rows, n, o, D); break;
  }
}

// ---- bf16 attention on AMX's tiles (the amx tier) -------------------------------------------------------------
//
// With bf16 keys and values, D a multiple of 64, the amx tier runs a task's scores and its values' products on the
// tiles (tiles.h): a task is then up to 16 query rows (one tile's), not kRows, and one tdpbf16ps takes 16 rows times
// 32 dims of 16 keys, where the vector tiles above take one multiply-add per row, key and dim. Everything else (the
// blocks, the softmax, which keys a row sees, in which order) is attend_rows' as on every tier.
//  - Scores: q's rows as bf16 (as they are in the cache's dtype) times the keys' bf16 pairs, which HeadKeys already
//    lays out as the tiles' B operand (16 pairs of a group of 16 keys, 64 bytes a pair); the sums are then scaled to
//    log2 units (the vector tiles scale q first: the tiers round apart here, as they do elsewhere).
//  - Values: each probability as two bf16 halves, hi = bf16(p) and lo = bf16(p - hi) (together p to ~2^-16), times the
//    value rows interleaved in key pairs (word (i, d): dims d of keys 2i and 2i + 1), into float sums.
// Each sum is a function of its own row, its key (or value column) and a fixed sequence of instructions, so a row's
// bits are the same wherever it is computed (in a tile of 1 row or 16, with the prefix's keys or a tree's): the tier
// stays row-independent, and speculative decoding exact on it.
#if defined(TR_ENGINE_AMX)
namespace amx_attention {

constexpr int64_t kTileRows = 16;  // a task's query rows at most: one tile's
constexpr int64_t kPairKeys = 32;  // keys per tdpbf16ps in the values' products (16 pairs)

// Whether a head of dim D runs on the tiles (bf16 keys and values, float scores).
template <typename scalar_t, typename Acc>
bool applies(int64_t D) {
  return std::is_same_v<scalar_t, bf16> && std::is_same_v<Acc, float> && D % 64 == 0;
}

// A task's tiles: sums 0-3 (`rows` rows of 16 floats), its rows' operands 4-5 (`rows` rows of 32 bf16), the keys' or
// values' operands 6-7 (16 rows of 16 words).
inline void configure(int rows) {
  tiles::Config c;
  for (int t = 0; t < 6; ++t) c.shape(t, rows);
  c.shape(6, 16);
  c.shape(7, 16);
  c.load();
}

// s[r, j] = scale * sum_d q[r, d] k_j[d] for the task's rows (q: [rows, D] bf16, D apart) and the n keys (a multiple
// of 16) of kp, in HeadKeys' pair layout (a group of 16 keys is D / 2 rows of 16 words; word (c, i): dims 2c, 2c + 1
// of key i). Rows of s: lds floats apart.
inline void scores(const bf16* q, int64_t D, const uint32_t* kp, int64_t n, float scale, int rows, float* s,
                   int64_t lds) {
  const int64_t group = D / 2 * kKeyPad, ldq = D * static_cast<int64_t>(sizeof(bf16));
  const int64_t ld = lds * static_cast<int64_t>(sizeof(float));
  for (int64_t j = 0; j < n; j += 2 * kKeyPad) {
    const uint32_t* k0 = kp + j / kKeyPad * group;
    _tile_zero(0);
    if (j + kKeyPad < n) {  // two groups of keys: both against each step of q
      _tile_zero(1);
      for (int64_t c = 0; c < D / 32; ++c) {
        _tile_loadd(4, q + 32 * c, ldq);
        _tile_loadd(6, k0 + 16 * kKeyPad * c, 64);
        _tile_loadd(7, k0 + group + 16 * kKeyPad * c, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
      }
      _tile_stored(1, s + j + kKeyPad, ld);
    } else {
      for (int64_t c = 0; c < D / 32; ++c) {
        _tile_loadd(4, q + 32 * c, ldq);
        _tile_loadd(6, k0 + 16 * kKeyPad * c, 64);
        _tile_dpbf16ps(0, 4, 6);
      }
    }
    _tile_stored(0, s + j, ld);
  }
  const Vec f = broadcast(scale);
  for (int r = 0; r < rows; ++r)
    for (int64_t j = 0; j < n; j += kLanes) store(s + r * lds + j, mul(load(s + r * lds + j), f));
}

// The probabilities of rows r0..r1-1 at block positions k0..k0+np-1 (np a multiple of kPairKeys) as their high and
// low bf16 halves, row r zero from its own n[r] on (hi, lo: rows ldh apart, from column 0).
inline void halves(const float* p, int64_t ldp, const int64_t* n, int64_t r0, int64_t r1, int64_t k0, int64_t np,
                   bf16* hi, bf16* lo, int64_t ldh) {
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t j = 0; j < np; j += kLanes) {
      const int64_t valid = n[r] - (k0 + j);
      const Vec x = valid >= kLanes ? load(p + r * ldp + k0 + j)
                                    : valid > 0 ? load_first(p + r * ldp + k0 + j, static_cast<int>(valid)) : zero();
      store(hi + r * ldh + j, x);
      store(lo + r * ldh + j, add(x, mul(load(hi + r * ldh + j), broadcast(-1.0f))));  // exact: x - hi
    }
}

// Dims d0..d0+63 of n value rows in key pairs, np / 2 rows of 64 words (np a multiple of kPairKeys): word (i, d) holds
// dim d0 + d of row 2i (low half) and of row 2i + 1; zeros from row n on.
inline void pairs(const bf16* const* rows, int64_t n, int64_t np, int64_t d0, uint32_t* vp) {
  alignas(64) static constexpr int16_t kLow[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                   8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr int16_t kHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                    24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i low = _mm512_load_si512(kLow), high = _mm512_load_si512(kHigh);
  for (int64_t i = 0; i < np / 2; ++i) {
    uint32_t* dst = vp + i * 64;
    for (int64_t d = 0; d < 64; d += 32) {
      const __m512i a = 2 * i < n ? _mm512_loadu_si512(rows[2 * i] + d0 + d) : _mm512_setzero_si512();
      const __m512i b = 2 * i + 1 < n ? _mm512_loadu_si512(rows[2 * i + 1] + d0 + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi16(a, low, b));
      _mm512_storeu_si512(dst + d + 16, _mm512_permutex2var_epi16(a, high, b));
    }
  }
}

// Sums tiles 0-3 += the probabilities' halves (rows ldh bf16 apart) times the value pairs of `np` keys (64 dims).
inline void products(const bf16* hi, const bf16* lo, int64_t ldh, const uint32_t* vp, int64_t np) {
  const int64_t ld = ldh * static_cast<int64_t>(sizeof(bf16));
  for (int64_t k = 0; k < np; k += kPairKeys) {
    _tile_loadd(4, hi + k, ld);
    _tile_loadd(5, lo + k, ld);
    const uint32_t* v = vp + k / 2 * 64;
    _tile_loadd(6, v, 256);
    _tile_loadd(7, v + 16, 256);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(0, 5, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(1, 5, 7);
    _tile_loadd(6, v + 32, 256);
    _tile_loadd(7, v + 48, 256);
    _tile_dpbf16ps(2, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 4, 7);
    _tile_dpbf16ps(3, 5, 7);
  }
}

// A head's value rows laid out in key pairs once for all its tasks (tree_attention_kernel), where it has several: a
// verify of many rows, a prompt chunk. Each task would otherwise lay out the same rows for each of its blocks: a
// 1200-token prompt's attention (SmolLM2, 2 threads) took 24% less time without that, 1.3x faster. `data` points at the
// pair of a block's first key (an even slot) in the first 64 dims; the next 64 dims' are `chunk` words on. The keys
// past a block's last hold the next slots' values or zeros, never garbage: their probabilities are zero, and so are
// their products, as pairs' zeros.
struct HeadValues {
  const uint32_t* data = nullptr;  // null: the rows are laid out by the task (pairs)
  int64_t chunk = 0;
  HeadValues from(int64_t j) const { return {data == nullptr ? nullptr : data + j / 2 * 64, chunk}; }
};

// Slots j0..j1-1 (j0 a multiple of kPairKeys) of one head's values (v: slot 0; ldv elements between slots) into its
// layout (vp: slot 0's pair, the first 64 dims; chunk words between 64-dim chunks), zeros for the slots from n on, up
// to j1 rounded up to kPairKeys.
inline void lay_values(const bf16* v, int64_t ldv, int64_t n, int64_t j0, int64_t j1, int64_t D, uint32_t* vp,
                       int64_t chunk) {
  constexpr int64_t kSpan = 128;  // rows a pass
  const bf16* rows[kSpan];
  for (int64_t a = j0; a < j1; a += kSpan) {
    const int64_t b = std::min(a + kSpan, j1), count = std::clamp<int64_t>(n - a, 0, b - a);
    for (int64_t i = 0; i < count; ++i) rows[i] = v + (a + i) * ldv;
    for (int64_t d0 = 0; d0 < D; d0 += 64)
      pairs(rows, count, round_up(b - a, kPairKeys), d0, vp + d0 / 64 * chunk + a / 2 * 64);
  }
}

// One softmax block's values for a task's R rows: row r has n[r] keys in this block (0: none, its output untouched),
// p its probabilities (rows ldp apart). Keys 0..shared-1 have the same value rows for every row (`rows`: a block of
// prefix slots); after them each token's group of rows g (rows groups[g].r0..r1-1) has its own (groups[g].rows, for
// keys shared..n-1 of its rows). o[r, :] += sum_j p[r, j] v_j, on the tiles, a group's keys with every other row's
// probabilities zero there: a row's sums take the same products in the same order of key pairs as the block's
// computed for that row alone (its own keys, then zeros, which add nothing), so its bits are the same. With `laid`
// (HeadValues), the shared keys' pairs are read from the head's layout, not laid out from `rows` here.
struct Group {
  int64_t r0, r1;
  const bf16* const* rows;  // value rows from key `shared` on
};
struct ValueScratch {
  bf16* hi;      // [kTileRows, kKeyBlock] the shared keys' probabilities, high halves
  bf16* lo;      // and low halves
  bf16* ghi;     // [kTileRows, kKeyBlock] a group's (zeros but for the group being done)
  bf16* glo;
  uint32_t* vp;  // [kKeyBlock / 2, 64] value pairs
  float* sums;   // [kTileRows, 64] one pass's sums
};
inline void block_values(const float* p, int64_t ldp, int64_t R, const int64_t* n, const bf16* const* rows,
                         int64_t shared, const Group* groups, int64_t n_groups, float* o, int64_t D, ValueScratch w,
                         HeadValues laid = {}) {
  const int64_t shared_np = round_up(shared, kPairKeys);
  halves(p, ldp, n, 0, R, 0, shared_np, w.hi, w.lo, kKeyBlock);
  for (int64_t d0 = 0; d0 < D; d0 += 64) {  // 64 dims a pass: 4 tiles of sums
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    if (shared_np > 0) {
      const uint32_t* vp = w.vp;
      if (laid.data != nullptr)
        vp = laid.data + d0 / 64 * laid.chunk;
      else
        pairs(rows, shared, shared_np, d0, w.vp);
      products(w.hi, w.lo, kKeyBlock, vp, shared_np);
    }
    for (int64_t g = 0; g < n_groups; ++g) {
      const Group& G = groups[g];
      const int64_t count = n[G.r0] - shared, np = round_up(count, kPairKeys);  // (a group's rows share their n)
      if (count <= 0) continue;
      halves(p, ldp, n, G.r0, G.r1, shared, np, w.ghi, w.glo, kKeyBlock);
      pairs(G.rows, count, np, d0, w.vp);
      products(w.ghi, w.glo, kKeyBlock, w.vp, np);
      for (int64_t r = G.r0; r < G.r1; ++r) {  // zeros again for the next group
        std::memset(w.ghi + r * kKeyBlock, 0, np * sizeof(bf16));
        std::memset(w.glo + r * kKeyBlock, 0, np * sizeof(bf16));
      }
    }
    _tile_stored(0, w.sums, 256);
    _tile_stored(1, w.sums + 16, 256);
    _tile_stored(2, w.sums + 32, 256);
    _tile_stored(3, w.sums + 48, 256);
    for (int64_t r = 0; r < R; ++r)
      if (n[r] > 0)
        for (int64_t c = 0; c < 64; c += kLanes) {
          float* dst = o + r * D + d0 + c;
          store(dst, add(load(dst), load(w.sums + r * 64 + c)));
        }
  }
}

}  // namespace amx_attention
#endif

}  // namespace tr_engine_cpu
