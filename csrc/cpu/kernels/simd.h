// The one vector type the CPU kernels are written in: Vec, kLanes floats, and the handful of operations they use.
// The kernels are one source, compiled once per tier (tr_engine/model/cpu.py lists the tiers and their compiler flags);
// this file gives each tier its Vec: AVX-512 (16 lanes), AVX2 + FMA + F16C (8), aarch64 NEON (4), and `scalar` (4),
// plain arrays and loops that any C++ compiler builds (the readable specification of every operation below, and
// the last resort). The tier is chosen by the -DTR_ENGINE_TIER_* macro that setup.py passes with the tier's flags.
//
// What a kernel may assume of every tier: loads and stores of float, bf16 (widened by a shift, exact) and f16
// (hardware conversion where there is one, exact); stores to 16-bit types round to nearest even; mul_add is fused
// (one rounding) on every tier but `scalar` on x86 (FMA is not in x86-64's baseline); reduce_add sums the lanes in
// one fixed order. Each operation is elementwise or fixed-order, so a kernel that computes an output from its own
// inputs in a fixed sequence of these operations is row-independent on every tier.
#pragma once

#include "numbers.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

// The amx tier is the avx512bf16 tier's code but for its bf16 matmuls and attention, which run on AMX's tiles
// (linear.h, attention.h).
#if defined(TR_ENGINE_TIER_AMX)
#if !defined(__AMX_TILE__) || !defined(__AMX_BF16__)
#error "the amx tier needs -mamx-tile -mamx-bf16"
#endif
#define TR_ENGINE_TIER_AVX512BF16
#define TR_ENGINE_AMX
#endif

#if defined(TR_ENGINE_TIER_AVX512BF16) || defined(TR_ENGINE_TIER_AVX512) || defined(TR_ENGINE_TIER_AVX2)
#include <immintrin.h>  // (first included by numbers.h, with GCC 12's false warnings silenced)
#elif defined(TR_ENGINE_TIER_NEON)
#include <arm_neon.h>
#elif !defined(TR_ENGINE_TIER_SCALAR)
#error "build the CPU kernels with one of -DTR_ENGINE_TIER_{AMX,AVX512BF16,AVX512,AVX2,NEON,SCALAR} (see setup.py)"
#endif

namespace tr_engine_cpu {

#if defined(TR_ENGINE_AMX)
constexpr bool kAmx = true;  // bf16 matmuls and attention on AMX's tiles (linear.h's amx, attention.h's amx_attention)
#else
constexpr bool kAmx = false;
#endif

// f(std::integral_constant<int, rows>) for rows in 1..kMax: each row count a kernel of its own.
template <int kMax, int R = 1, typename F>
void with_rows(int rows, F&& f) {
  if constexpr (R < kMax) {
    if (rows != R) return with_rows<kMax, R + 1>(rows, f);
  }
  f(std::integral_constant<int, R>{});
}

// Ask for the cache line at p into L2 (prefetcht1 on x86, PRFM PLDL2KEEP on ARM): a hint, never a fault.
inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 2); }
// Ask for it as a line read once (prefetchnta on x86, PRFM PLDL1STRM on ARM).
inline void prefetch_once(const void* p) { __builtin_prefetch(p, 0, 0); }

#if defined(TR_ENGINE_TIER_AVX512BF16) || defined(TR_ENGINE_TIER_AVX512)
#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__FMA__)
#error "the avx512 tiers need -mavx512f -mavx512bw -mavx512vl -mfma"
#endif
#if defined(TR_ENGINE_TIER_AVX512BF16)
#if !defined(__AVX512BF16__)
#error "the avx512bf16 tier needs -mavx512bf16"
#endif
#if defined(TR_ENGINE_AMX)
constexpr const char* kTier = "amx";
#else
constexpr const char* kTier = "avx512bf16";
#endif
constexpr bool kBf16Dot = true;  // vdpbf16ps: two bf16 products per float lane, summed into it
#else
constexpr const char* kTier = "avx512";
constexpr bool kBf16Dot = false;
#endif
constexpr int kLanes = 16;
constexpr int kRegisters = 32;  // vector registers: what a register tile may hold

struct Vec {
  __m512 v;
};
inline __mmask16 first(int n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n > 0 ? n : 0)) - 1); }
inline Vec zero() { return {_mm512_setzero_ps()}; }
inline Vec broadcast(float x) { return {_mm512_set1_ps(x)}; }
inline Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Vec load(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))};
}
inline Vec load(const f16* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
inline Vec load_first(const float* p, int n) { return {_mm512_maskz_loadu_ps(first(n), p)}; }
inline void store(float* p, Vec a) { _mm512_storeu_ps(p, a.v); }
inline void store_first(float* p, Vec a, int n) { _mm512_mask_storeu_ps(p, first(n), a.v); }
inline __m256i rounded(Vec a, bf16*) {
#if defined(TR_ENGINE_TIER_AVX512BF16)
  return (__m256i)_mm512_cvtneps_pbh(a.v);
#else  // round to nearest even by integer arithmetic (from_float<bf16>, sixteen at a time)
  const __m512i bits = _mm512_castps_si512(a.v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
#endif
}
inline __m256i rounded(Vec a, f16*) { return _mm512_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
template <typename T>
inline void store(T* p, Vec a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), rounded(a, p)); }
template <typename T>
inline void store_first(T* p, Vec a, int n) { _mm256_mask_storeu_epi16(p, first(n), rounded(a, p)); }
inline Vec mul_add(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec add(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec mul(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline float reduce_add(Vec a) { return _mm512_reduce_add_ps(a.v); }

// bf16 pairs: a Vec of kLanes 32-bit words, word i the bf16 values of two consecutive dims of one row (the even dim
// in the low half). even()/odd() widen them to floats (exact); dot_pairs adds both products to each lane.
inline Vec load_words(const void* p) { return {_mm512_loadu_ps(static_cast<const float*>(p))}; }
inline Vec load_words_first(const void* p, int n) { return {_mm512_maskz_loadu_ps(first(n), p)}; }
inline Vec even(Vec w) { return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(w.v), 16))}; }
inline Vec odd(Vec w) {
  return {_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(w.v), _mm512_set1_epi32(int(0xFFFF0000u))))};
}
#if defined(TR_ENGINE_TIER_AVX512BF16)
// acc + x.even * w.even + x.odd * w.odd in every lane, x the pair (x0, x1) in every lane.
inline Vec dot_pairs(Vec acc, Vec x, Vec w) {
  return {_mm512_dpbf16_ps(acc.v, (__m512bh)_mm512_castps_si512(x.v), (__m512bh)_mm512_castps_si512(w.v))};
}
#endif

// rows[0..15] (16 rows of 16 32-bit words) -> dst: word c of row r to dst[c * ldd + r]. Every step is a shuffle, so
// floats and bf16 pairs move unchanged. 16 row loads, four rounds of shuffles, 16 stores, where a strided read of
// each column would be 256 single-element gathers.
inline void transpose(Vec (&rows)[kLanes], float* dst, int64_t ldd) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = rows[i].v;
  for (int i = 0; i < 16; i += 2) {  // within 128-bit lanes: pairs of rows interleaved
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // quads of rows: r[i + c] holds columns c, c + 4, c + 8, c + 12 of 4 rows
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes across the quads
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 8; ++i) {  // column i and column i + 8
    _mm512_storeu_ps(dst + i * ldd, _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88));
    _mm512_storeu_ps(dst + (i + 8) * ldd, _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD));
  }
}

#elif defined(TR_ENGINE_TIER_AVX2)
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "the avx2 tier needs -mavx2 -mfma -mf16c"
#endif
constexpr const char* kTier = "avx2";
constexpr bool kBf16Dot = false;
constexpr int kLanes = 8;
constexpr int kRegisters = 16;

struct Vec {
  __m256 v;
};
// The mask of the first n of 8 lanes (maskload/maskstore read each lane's top bit).
inline __m256i first(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline Vec zero() { return {_mm256_setzero_ps()}; }
inline Vec broadcast(float x) { return {_mm256_set1_ps(x)}; }
inline Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
inline Vec load(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))};
}
inline Vec load(const f16* p) { return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
inline Vec load_first(const float* p, int n) { return {_mm256_maskload_ps(p, first(n))}; }
inline void store(float* p, Vec a) { _mm256_storeu_ps(p, a.v); }
inline void store_first(float* p, Vec a, int n) { _mm256_maskstore_ps(p, first(n), a.v); }
inline __m128i rounded(Vec a, bf16*) {  // round to nearest even by integer arithmetic (from_float<bf16>, 8 at a time)
  const __m256i bits = _mm256_castps_si256(a.v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), odd), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  // 32-bit lanes (each < 2^16) to 16-bit: pack within each 128-bit half, then the halves' low quads together
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}
inline __m128i rounded(Vec a, f16*) { return _mm256_cvtps_ph(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
template <typename T>
inline void store(T* p, Vec a) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), rounded(a, p)); }
template <typename T>
inline void store_first(T* p, Vec a, int n) {
  uint16_t lanes[8];
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lanes), rounded(a, p));
  std::memcpy(p, lanes, sizeof(uint16_t) * (n < 8 ? (n > 0 ? n : 0) : 8));
}
inline Vec mul_add(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec add(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Vec mul(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline float reduce_add(Vec a) {  // (l0 + l4) + (l2 + l6) + ((l1 + l5) + (l3 + l7)), always in this order
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  const __m128 d = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}

inline Vec load_words(const void* p) { return {_mm256_loadu_ps(static_cast<const float*>(p))}; }
inline Vec load_words_first(const void* p, int n) { return {_mm256_maskload_ps(static_cast<const float*>(p), first(n))}; }
inline Vec even(Vec w) { return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(w.v), 16))}; }
// The high halves by two shifts rather than a mask: the mask's constant took one of the 16 registers for the whole
// loop, and register tiles that fill them (packed_rows' 6-row tiles of bf16 pairs, tree attention's score tiles) then
// spilled. SmolLM2's shapes, AMD EPYC (Zen 3), alternated in one process: bf16 projections at 6 and 12 rows 0.84x and
// 0.79x the time, bf16 tree attention at 8 rows 0.88-0.90x; a decode step's row as fast.
inline Vec odd(Vec w) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(_mm256_castps_si256(w.v), 16), 16))};
}

// rows[0..7] -> dst: word c of row r to dst[c * ldd + r] (an 8 x 8 transpose in three rounds of shuffles).
inline void transpose(Vec (&rows)[kLanes], float* dst, int64_t ldd) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(rows[i].v, rows[i + 1].v);
    t[i + 1] = _mm256_unpackhi_ps(rows[i].v, rows[i + 1].v);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {  // column i from the low 128-bit halves, column i + 4 from the high ones
    _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
  }
}

#elif defined(TR_ENGINE_TIER_NEON)
#if !defined(__aarch64__)
#error "the neon tier is built for aarch64"
#endif
constexpr const char* kTier = "neon";
constexpr bool kBf16Dot = false;
constexpr int kLanes = 4;
constexpr int kRegisters = 32;

struct Vec {
  float32x4_t v;
};
inline Vec zero() { return {vdupq_n_f32(0.f)}; }
inline Vec broadcast(float x) { return {vdupq_n_f32(x)}; }
inline Vec load(const float* p) { return {vld1q_f32(p)}; }
inline Vec load(const bf16* p) {
  return {vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16))};
}
inline Vec load(const f16* p) {
  return {vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p))))};
}
inline Vec load_first(const float* p, int n) {
  float lanes[4] = {};
  std::memcpy(lanes, p, sizeof(float) * (n < 4 ? (n > 0 ? n : 0) : 4));
  return {vld1q_f32(lanes)};
}
inline void store(float* p, Vec a) { vst1q_f32(p, a.v); }
inline void store_first(float* p, Vec a, int n) {
  float lanes[4];
  vst1q_f32(lanes, a.v);
  std::memcpy(p, lanes, sizeof(float) * (n < 4 ? (n > 0 ? n : 0) : 4));
}
inline uint16x4_t rounded(Vec a, bf16*) {  // round to nearest even by integer arithmetic (from_float<bf16>)
  const uint32x4_t bits = vreinterpretq_u32_f32(a.v);
  const uint32x4_t odd = vandq_u32(vshrq_n_u32(bits, 16), vdupq_n_u32(1));
  const uint32x4_t r = vshrq_n_u32(vaddq_u32(vaddq_u32(bits, vdupq_n_u32(0x7FFF)), odd), 16);
  return vmovn_u32(vbslq_u32(vceqq_f32(a.v, a.v), r, vdupq_n_u32(0x7FC0)));
}
inline uint16x4_t rounded(Vec a, f16*) { return vreinterpret_u16_f16(vcvt_f16_f32(a.v)); }
template <typename T>
inline void store(T* p, Vec a) { vst1_u16(reinterpret_cast<uint16_t*>(p), rounded(a, p)); }
template <typename T>
inline void store_first(T* p, Vec a, int n) {
  uint16_t lanes[4];
  vst1_u16(lanes, rounded(a, p));
  std::memcpy(p, lanes, sizeof(uint16_t) * (n < 4 ? (n > 0 ? n : 0) : 4));
}
inline Vec mul_add(Vec a, Vec b, Vec c) { return {vfmaq_f32(c.v, a.v, b.v)}; }
inline Vec add(Vec a, Vec b) { return {vaddq_f32(a.v, b.v)}; }
inline Vec mul(Vec a, Vec b) { return {vmulq_f32(a.v, b.v)}; }
inline float reduce_add(Vec a) {  // (l0 + l2) + (l1 + l3)
  const float32x2_t h = vadd_f32(vget_low_f32(a.v), vget_high_f32(a.v));
  return vget_lane_f32(h, 0) + vget_lane_f32(h, 1);
}

inline Vec load_words(const void* p) { return {vld1q_f32(static_cast<const float*>(p))}; }
inline Vec load_words_first(const void* p, int n) { return load_first(static_cast<const float*>(p), n); }
inline Vec even(Vec w) { return {vreinterpretq_f32_u32(vshlq_n_u32(vreinterpretq_u32_f32(w.v), 16))}; }
inline Vec odd(Vec w) {
  return {vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(w.v), vdupq_n_u32(0xFFFF0000u)))};
}

inline void transpose(Vec (&rows)[kLanes], float* dst, int64_t ldd) {
  const float32x4x2_t a = vtrnq_f32(rows[0].v, rows[1].v), b = vtrnq_f32(rows[2].v, rows[3].v);
  vst1q_f32(dst, vcombine_f32(vget_low_f32(a.val[0]), vget_low_f32(b.val[0])));
  vst1q_f32(dst + ldd, vcombine_f32(vget_low_f32(a.val[1]), vget_low_f32(b.val[1])));
  vst1q_f32(dst + 2 * ldd, vcombine_f32(vget_high_f32(a.val[0]), vget_high_f32(b.val[0])));
  vst1q_f32(dst + 3 * ldd, vcombine_f32(vget_high_f32(a.val[1]), vget_high_f32(b.val[1])));
}

#else  // TR_ENGINE_TIER_SCALAR: every operation as the loop it stands for
constexpr const char* kTier = "scalar";
constexpr bool kBf16Dot = false;
// Four lanes, sixteen registers: what x86-64's baseline SSE2 (and any 128-bit unit) holds, so the compiler keeps a
// Vec in one register (measured on the packed matmul: 4 lanes 2-8x faster than 8 at 4 rows and more).
constexpr int kLanes = 4;
constexpr int kRegisters = 16;

struct Vec {
  float v[kLanes];
};
inline Vec zero() { return Vec{}; }
inline Vec broadcast(float x) {
  Vec a;
  for (int i = 0; i < kLanes; ++i) a.v[i] = x;
  return a;
}
template <typename T>
inline Vec load(const T* p) {
  Vec a;
  for (int i = 0; i < kLanes; ++i) a.v[i] = to_float(p[i]);
  return a;
}
inline Vec load_first(const float* p, int n) {
  Vec a{};
  for (int i = 0; i < kLanes && i < n; ++i) a.v[i] = p[i];
  return a;
}
template <typename T>
inline void store(T* p, Vec a) {
  for (int i = 0; i < kLanes; ++i) p[i] = from_float<T>(a.v[i]);
}
template <typename T>
inline void store_first(T* p, Vec a, int n) {
  for (int i = 0; i < kLanes && i < n; ++i) p[i] = from_float<T>(a.v[i]);
}
inline Vec mul_add(Vec a, Vec b, Vec c) {
  for (int i = 0; i < kLanes; ++i) c.v[i] = fmadd(a.v[i], b.v[i], c.v[i]);
  return c;
}
inline Vec add(Vec a, Vec b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] += b.v[i];
  return a;
}
inline Vec mul(Vec a, Vec b) {
  for (int i = 0; i < kLanes; ++i) a.v[i] *= b.v[i];
  return a;
}
inline float reduce_add(Vec a) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += a.v[i];
  return s;
}

inline Vec load_words(const void* p) {
  Vec a;
  std::memcpy(a.v, p, sizeof a.v);
  return a;
}
inline Vec load_words_first(const void* p, int n) {
  Vec a{};
  std::memcpy(a.v, p, sizeof(float) * (n < kLanes ? (n > 0 ? n : 0) : kLanes));
  return a;
}
inline Vec even(Vec w) {  // the low 16 bits of each word, as the high half of a float
  for (float& x : w.v) x = bits_to_float(float_to_bits(x) << 16);
  return w;
}
inline Vec odd(Vec w) {
  for (float& x : w.v) x = bits_to_float(float_to_bits(x) & 0xFFFF0000u);
  return w;
}

inline void transpose(Vec (&rows)[kLanes], float* dst, int64_t ldd) {
  for (int r = 0; r < kLanes; ++r)
    for (int c = 0; c < kLanes; ++c) std::memcpy(dst + c * ldd + r, &rows[r].v[c], sizeof(float));
}
#endif

// The 32-bit word at p (a pair of bf16) in every lane.
inline Vec broadcast_word(const void* p) {
  uint32_t word;
  std::memcpy(&word, p, sizeof word);
  return broadcast(bits_to_float(word));
}

#if !defined(TR_ENGINE_TIER_AVX512BF16)
// The bf16 pair dot product where the tier has no instruction for it: the even dims' products, then the odd ones',
// each a fused multiply-add (x holds the pair as words, like w). Kernels call it only where kBf16Dot is true; it is
// here so that every tier compiles the same kernels.
inline Vec dot_pairs(Vec acc, Vec x, Vec w) { return mul_add(odd(x), odd(w), mul_add(even(x), even(w), acc)); }
#endif

}  // namespace tr_engine_cpu
