// The attention of a verify step (tree_attention and its batch form), written once over simd.h's Vec: each of the T
// tree tokens attends to every cached prefix key and to its own ancestors in the tree. A task is 6 query rows of one
// KV head (the G query heads that share it, for one or more tokens; 16 on the amx tier's bf16 heads, amx_attention),
// and all scores and outputs run through the same register-tiled micro-GEMMs (or AMX's tiles; bf16 scores by the
// AVX512-BF16 dot product where the tier has it, scores_chunk_dot):
//  - whole blocks of prefix keys need no mask: scores against all their keys, read once for the task's rows;
//  - the tree part is sparse (a token sees depth + 1 of the T tree keys): the task gathers just the union of its
//    tokens' ancestors (a dozen keys, not T), and each token's rows pick theirs out of those scores.
// No [T, P + T] mask is ever built. Softmax runs in float (double for float64 inputs), over a row's keys in two halves
// merged at its end where they are more than two blocks (split_point), so that a decode step's head can be two tasks.
// The kernel is row-independent: a row's bits depend only on its query and the keys it sees (attend_rows says how), so
// a verify step reproduces plain decoding exactly, in bfloat16 too. Its shapes and micro-tiles: attention_tiles.h.
#pragma once

#include "api.h"
#include "attention_tiles.h"
#include "parallel.h"
#include "simd.h"
#include "tiles.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <type_traits>
#include <vector>

namespace tr_engine_cpu {

// A buffer aligned to 64 bytes (one vector). Every row of scores starts on a vector boundary, so a vectorised sum
// over a row splits into lanes the same way wherever the row lives: part of what makes the results row-independent.
template <typename T>
struct Aligned {
  struct Free {
    void operator()(T* p) const { ::operator delete[](p, std::align_val_t(64)); }
  };
  std::unique_ptr<T[], Free> ptr;
  explicit Aligned(int64_t n) : ptr(static_cast<T*>(::operator new[](sizeof(T) * std::max<int64_t>(n, 1),
                                                                      std::align_val_t(64)))) {}
  T* get() const { return ptr.get(); }
};

// A buffer of at least n elements, kept by the calling thread from one call to the next (grown, never shrunk): a
// fresh allocation of megabytes each call would page-fault every page of it in again, which costs more than the
// conversion that fills it. `slot` tells apart the buffers one call needs at once.
template <typename T>
T* reused(int64_t n, int slot) {
  thread_local std::vector<Aligned<T>> buffers;
  thread_local std::vector<int64_t> capacity;
  while (static_cast<int64_t>(buffers.size()) <= slot) {
    buffers.emplace_back(0);
    capacity.push_back(0);
  }
  if (capacity[slot] < n) {
    buffers[slot] = Aligned<T>(n);
    capacity[slot] = n;
  }
  return buffers[slot].get();
}

// One KV head's keys in Acc, laid out for the score tiles: prefix keys transposed in groups of kKeyPad (KeyLayout; ld
// slots, the padding keys' scores computed and dropped) and tree keys as rows ([T, D]). Values need no layout change
// for the vector tiles, which read them from the cache where they are (AMX's tiles read them in key pairs, laid out
// once a head: amx_attention::HeadValues). Either the whole prefix (ld = P rounded up to kKeyPad), converted once for
// all the tasks of a head into a reused buffer, or a window of one block of it (ld = kKeyBlock, from slot `base`),
// converted by a head's only task just before it scores the block: a decode step's keys are then read once from the
// cache and used while in cache, where a whole head's copy (P x D floats, 16 MB a layer for a 7B model at P = 1024)
// would go out to memory and back. The values are the same either way (bf16 -> float is exact), so are the scores.
// bf16 keys (with AVX-512) are transposed without converting them: `pairs` holds the prefix keys as D/2 32-bit words
// per key (in the same groups), word (i, j) the bf16 values of dims 2i and 2i + 1 of key j side by side, and the
// score tiles widen them to floats in registers (scores_chunk_pairs). A 16 x 16 transpose then moves 32 dims, not 16,
// and writes half the bytes; the floats the tiles multiply, and so the scores, are the same bits. Measured alone on
// SmolLM2's shape (9 query and 3 KV heads of 64), alternating in one process: a decode step's attention 19-27% faster
// (2 threads, prefix 256 and 1024), an 8-token verify's 15-19%.
template <typename Acc>
struct HeadKeys {
  int64_t D, P, ld, T;
  bool pairs;  // the prefix keys as bf16 pairs (see above), not as Acc
  int64_t base = 0;  // the first prefix slot held
  Acc* data;  // D * ld + T * D elements, uninitialised: fill_keys writes every element that is read (padding: zeros)
  Acc* kt() { return data; }
  Acc* ktree() { return kt() + D * ld; }
  // The prefix keys' layout (KeyLayout: groups of kKeyPad keys, each group's dims in turn), pairs or not.
  KeyLayout layout() const { return {(pairs ? D / 2 : D) * kKeyPad, kKeyPad}; }
  // Where dim (or pair) c of prefix slot j is (j from base on, base a multiple of kKeyPad).
  Acc* at(int64_t c, int64_t j) {
    const int64_t i = j - base;
    return kt() + i / kKeyPad * layout().group + c * kKeyPad + i % kKeyPad;
  }
  // The keys from prefix slot j on (j - base a multiple of kKeyPad), as scores_chunk reads them.
  const Acc* prefix(int64_t j) { return kt() + (j - base) / kKeyPad * layout().group; }
  HeadKeys(int64_t D, int64_t P, int64_t T, int64_t ld, Acc* data, bool pairs)
      : D(D), P(P), ld(ld), T(T), pairs(pairs), data(data) {}
  static int64_t size(int64_t D, int64_t T, int64_t ld) { return D * ld + T * D; }
};

// s[r, j0 + j] for the W keys from j0, keys as bf16 pairs (words, in KeyLayout's groups: pair c of key j is dims 2c
// and 2c + 1): the multiply-adds of scores_chunk in the same order (dim 0, 1, 2, ... into one accumulator per score),
// each pair widened to two float vectors (a shift for the even dim, a mask for the odd one: exact). q [R, D] floats,
// D even.
template <int64_t R, int64_t W>
void scores_chunk_pairs(const float* q, int64_t D, const float* kp, KeyLayout layout, int64_t j0, float* s,
                        int64_t lds) {
  constexpr int64_t NV = W / kLanes;
  static_assert(W % kKeyPad == 0 && kKeyPad % kLanes == 0, "a chunk covers whole groups of keys, in vectors");
  // Vector i of the chunk: keys j0 + i kLanes.., in group (j0 + i kLanes) / kKeyPad.
  const auto words = [&](int64_t c, int64_t i) {
    const int64_t j = j0 + kLanes * i;
    return load_words(kp + j / kKeyPad * layout.group + c * layout.dim + j % kKeyPad);
  };
  Vec acc[R][NV];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < NV; ++i) acc[r][i] = zero();
  for (int64_t c = 0; c < D / 2; ++c) {
    Vec kv[NV];
    for (int64_t i = 0; i < NV; ++i) kv[i] = even(words(c, i));  // dim 2c: the low halves
    for (int64_t r = 0; r < R; ++r) {
      const Vec qv = broadcast(q[r * D + 2 * c]);
      for (int64_t i = 0; i < NV; ++i) acc[r][i] = mul_add(qv, kv[i], acc[r][i]);
    }
    for (int64_t i = 0; i < NV; ++i) kv[i] = odd(words(c, i));  // dim 2c + 1: the high halves
    for (int64_t r = 0; r < R; ++r) {
      const Vec qv = broadcast(q[r * D + 2 * c + 1]);
      for (int64_t i = 0; i < NV; ++i) acc[r][i] = mul_add(qv, kv[i], acc[r][i]);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < NV; ++i) store(s + r * lds + j0 + kLanes * i, acc[r][i]);
}

// Whether a head's prefix keys are kept as bf16 pairs (HeadKeys): bf16 keys, float scores, D even.
template <typename scalar_t, typename Acc>
bool keys_as_pairs(int64_t D) {
  return std::is_same_v<scalar_t, bf16> && std::is_same_v<Acc, float> && D % 2 == 0;
}

// s[r, j0 + j] for the W keys from j0 with the AVX512-BF16 dot product (the avx512bf16 tier, and the amx tier's heads
// off the tiles): keys as bf16 pairs in KeyLayout's groups (as scores_chunk_pairs reads them), q [R, D] the rows as
// they are (bf16, pairs of dims as words), one vdpbf16ps per pair of dims, key vector and row (both products into the
// score's lane), then the sum times `scale` (log2 units), as the tiles do on the amx tier. Half the multiply-adds of
// scores_chunk_pairs, and no widening. All 30 layers' attention at SmolLM2's shape, bf16, prefix 1024, 2 threads,
// AMD EPYC (Zen 4), against scores_chunk_pairs: a decode step 1.56 -> 1.42 ms, verifies of 4, 8 and 16 tokens 2.82 ->
// 2.43, 4.45 -> 3.75 and 7.70 -> 6.33 ms. The products of bf16 are exact in float, so the scores are as close to
// float64's as before (the outputs rounded to bf16 match the rounded float64 reference as often or more), but they
// round apart from the widened path's: answers in bf16 part from an earlier build's, as any change of a sum's order
// does. Each score is one chain over its pairs in order, whatever the tile's rows or the key's place (a prefix's
// groups or a task's gathered tree keys, in the same layout): row-independent.
template <int64_t R, int64_t W>
void scores_chunk_dot(const bf16* q, int64_t D, const float* kp, KeyLayout layout, int64_t j0, float scale, float* s,
                      int64_t lds) {
  constexpr int64_t NV = W / kLanes;
  static_assert(W % kKeyPad == 0 && kKeyPad % kLanes == 0, "a chunk covers whole groups of keys, in vectors");
  Vec acc[R][NV];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < NV; ++i) acc[r][i] = zero();
  for (int64_t c = 0; c < D / 2; ++c) {
    Vec kv[NV];
    for (int64_t i = 0; i < NV; ++i) {
      const int64_t j = j0 + kLanes * i;
      kv[i] = load_words(kp + j / kKeyPad * layout.group + c * layout.dim + j % kKeyPad);
    }
    for (int64_t r = 0; r < R; ++r) {
      const Vec pair = broadcast_word(q + r * D + 2 * c);
      for (int64_t i = 0; i < NV; ++i) acc[r][i] = dot_pairs(acc[r][i], pair, kv[i]);
    }
  }
  const Vec sc = broadcast(scale);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < NV; ++i) store(s + r * lds + j0 + kLanes * i, mul(acc[r][i], sc));
}

// The dot product's scores of q's R rows (bf16) against n keys (a multiple of kKeyPad) in pair layout from kp: wide
// chunks, then narrow ones.
template <int64_t R>
void scores_dot(const bf16* q, int64_t D, const float* kp, KeyLayout layout, int64_t n, float scale, float* s,
                int64_t lds) {
  int64_t j0 = 0;
  for (; j0 + kCols <= n; j0 += kCols) scores_chunk_dot<R, kCols>(q, D, kp, layout, j0, scale, s, lds);
  for (; j0 < n; j0 += kKeyPad) scores_chunk_dot<R, kKeyPad>(q, D, kp, layout, j0, scale, s, lds);
}

// The scores of q's R rows against the n prefix keys from slot j (n a multiple of kKeyPad), in either layout.
template <typename Acc, int64_t R>
void prefix_scores(const Acc* q, HeadKeys<Acc>& b, int64_t j, int64_t n, Acc* s, int64_t lds) {
  if constexpr (std::is_same_v<Acc, float>)
    if (b.pairs) {
      const float* kp = b.prefix(j);
      int64_t j0 = 0;
      for (; j0 + kCols <= n; j0 += kCols) scores_chunk_pairs<R, kCols>(q, b.D, kp, b.layout(), j0, s, lds);
      for (; j0 < n; j0 += kKeyPad) scores_chunk_pairs<R, kKeyPad>(q, b.D, kp, b.layout(), j0, s, lds);
      return;
    }
  scores_tile<Acc, R>(q, b.D, b.prefix(j), b.layout(), n, s, lds);
}

// Convert the keys of cache slots j0..j1-1 of one head (k points at slot 0; slot_stride elements between slots); the
// prefix slots among them must lie in b's window. Prefix keys are transposed a kLanes x kLanes tile at a time through
// registers (simd.h's transpose: kLanes row loads, shuffles, kLanes column stores), where a strided read of each
// column would be single-element gathers; bf16 pairs move as 32-bit words, unconverted.
template <typename scalar_t, typename Acc>
void fill_keys(HeadKeys<Acc>& b, const scalar_t* k, int64_t slot_stride, int64_t j0, int64_t j1) {
  const int64_t D = b.D, P = b.P;
  const int64_t prefix_end = std::min(j1, P);
  int64_t jb = j0;
  if constexpr (std::is_same_v<scalar_t, bf16> && std::is_same_v<Acc, float>)
    if (b.pairs) {  // words, copied bit for bit (memcpy: the buffer holds floats at other times)
      const int64_t half = D / 2;
      for (; jb + kLanes <= prefix_end; jb += kLanes) {
        int64_t c = 0;
        for (; c + kLanes <= half; c += kLanes) {
          Vec rows[kLanes];
          for (int i = 0; i < kLanes; ++i) rows[i] = load_words(k + (jb + i) * slot_stride + 2 * c);
          transpose(rows, b.at(c, jb), kKeyPad);
        }
        for (; c < half; ++c)
          for (int64_t j = 0; j < kLanes; ++j)
            std::memcpy(b.at(c, jb + j), k + (jb + j) * slot_stride + 2 * c, 4);
      }
      for (; jb < prefix_end; ++jb)
        for (int64_t c = 0; c < half; ++c) std::memcpy(b.at(c, jb), k + jb * slot_stride + 2 * c, 4);
      jb = prefix_end;
    }
  for (; jb + kLanes <= prefix_end; jb += kLanes) {
    int64_t d = 0;
    if constexpr (std::is_same_v<Acc, float>)
      for (; d + kLanes <= D; d += kLanes) {
        Vec rows[kLanes];
        for (int i = 0; i < kLanes; ++i) rows[i] = load(k + (jb + i) * slot_stride + d);
        transpose(rows, b.at(d, jb), kKeyPad);
      }
    for (; d < D; ++d) {
      Acc* dst = b.at(d, jb);  // kLanes keys of one group
      const scalar_t* src = k + jb * slot_stride + d;
      for (int64_t j = 0; j < kLanes; ++j) dst[j] = to_float(src[j * slot_stride]);
    }
  }
  for (; jb < prefix_end; ++jb)
    for (int64_t d = 0; d < D; ++d) *b.at(d, jb) = to_float(k[jb * slot_stride + d]);
  // The padding slots after the last prefix key (up to a whole group), zeros: their scores are computed and dropped,
  // and whatever the buffer held before could be subnormal floats, whose multiply-adds take a microcode assist each on
  // x86 (an 8-token verify's attention ran 2-3x slower on stale denormal padding than on zeros). The call that
  // converts slot P - 1 writes them.
  if (j0 < P && j1 >= P)
    for (int64_t j = P; j < round_up(P, kKeyPad); ++j)
      for (int64_t c = 0; c < (b.pairs ? D / 2 : D); ++c) *b.at(c, j) = Acc(0);
  for (int64_t j = std::max(j0, P); j < j1; ++j)
    for (int64_t d = 0; d < D; ++d) b.ktree()[(j - P) * D + d] = to_float(k[j * slot_stride + d]);
}

// Where one task works. Its R <= kRows query rows are query head qhead[r] of token tok[r].
template <typename scalar_t, typename Acc>
struct TaskScratch {
  int64_t Tp;                           // T rounded up to kKeyPad
  Aligned<Acc> qs, s, s_tail, s_tree, ku, o, o_first;
  // [R, D] scaled queries; [R, kKeyBlock] one block's scores; [R, kTailWidth] scores of the prefix keys past the
  // last full block; [R, Tp] scores of the tree keys the task sees; [D, Tp] those keys, transposed; [R, D] outputs;
  // [R, D] the outputs of the rows' first halves (split_point)
  std::vector<const scalar_t*> value_rows;  // [kKeyBlock] the value rows of one block
  std::vector<int64_t> tree_keys;           // the union of the task's tokens' visible tree keys (indices into the tree)
  std::vector<int64_t> own;                 // one token's visible keys, as positions in tree_keys
  std::unique_ptr<bool[]> seen;             // [T] membership in that union
#if defined(TR_ENGINE_AMX)
  // amx_attention's operands: [16, D] the queries as bf16; the tree keys the task sees in HeadKeys' pair layout
  // ([Tp / 16] groups of D / 2 x 16 words); the values' staging (ValueScratch), zeroed once (a tile's rows past a
  // call's own read what earlier calls left, never uninitialised memory; a group's halves are zeros but its own);
  // and a block's groups of rows (one a token), their keys' counts and value rows.
  Aligned<bf16> qb, hi, lo, ghi, glo;
  Aligned<uint32_t> kup, vp;
  Aligned<float> sums;
  std::vector<amx_attention::Group> groups;
  std::vector<const bf16*> group_rows;
  int64_t n[16];
#endif
  TaskScratch(int64_t D, int64_t T)
      : Tp(round_up(T, kKeyPad)), qs(kTaskRows * D), s(kTaskRows * kKeyBlock), s_tail(kTaskRows * kTailWidth),
        s_tree(kTaskRows * Tp), ku(D * Tp), o(kTaskRows * D), o_first(kTaskRows * D), value_rows(kKeyBlock),
        seen(new bool[T])
#if defined(TR_ENGINE_AMX)
        , qb(16 * D), hi(16 * kKeyBlock), lo(16 * kKeyBlock), ghi(16 * kKeyBlock), glo(16 * kKeyBlock),
        kup(Tp * D / 2), vp(kKeyBlock / 2 * 64), sums(16 * 64), group_rows(16 * kKeyBlock)
#endif
  {
    tree_keys.reserve(T);
    own.reserve(T);
#if defined(TR_ENGINE_AMX)
    std::memset(qb.get(), 0, sizeof(bf16) * 16 * D);
    std::memset(hi.get(), 0, sizeof(bf16) * 16 * kKeyBlock);
    std::memset(lo.get(), 0, sizeof(bf16) * 16 * kKeyBlock);
    std::memset(ghi.get(), 0, sizeof(bf16) * 16 * kKeyBlock);
    std::memset(glo.get(), 0, sizeof(bf16) * 16 * kKeyBlock);
    groups.reserve(16);
#endif
  }
#if defined(TR_ENGINE_AMX)
  amx_attention::ValueScratch values() { return {hi.get(), lo.get(), ghi.get(), glo.get(), vp.get(), sums.get()}; }
#endif
};

// The calling thread's scratch for tasks of head dim D over T tree tokens, kept from one call to the next while D and T
// stay the same (a decode step's 1, a fixed tree's size): its dozen small buffers are not allocated again for every
// layer of every step. Each task resets the state it uses before it reads it.
template <typename scalar_t, typename Acc>
TaskScratch<scalar_t, Acc>& task_scratch(int64_t D, int64_t T) {
  thread_local std::unique_ptr<TaskScratch<scalar_t, Acc>> scratch;
  thread_local int64_t shape[2] = {-1, -1};
  if (!scratch || shape[0] != D || shape[1] != T) {
    scratch = std::make_unique<TaskScratch<scalar_t, Acc>>(D, T);
    shape[0] = D;
    shape[1] = T;
  }
  return *scratch;
}

// The rows of one task. A row's keys form one sequence: cache slots 0..P-1, then its visible tree keys in index
// order (for a tree in breadth-first order: its ancestors by depth, then itself). The sequence is cut into blocks of
// kKeyBlock by position, and each block is folded into the row's running softmax (flash-attention style, so the
// scores of a block stay in L1 however long the prefix is). A plain decode step is the one-node case: its sequence
// is the same cache slots with the ancestors already among them. Every score is one dot product computed the same
// way wherever its key sits, and every block runs the same loops over the same values, so a tree row gives exactly
// the bits of the decode step that sees the same keys: greedy speculative decoding commits plain decoding's tokens
// in any dtype, not just up to rounding.
//  - Blocks wholly inside the prefix are shared by all the task's rows: scores against all their keys in one tile.
//  - The rest (the prefix tail past the last full block, then tree keys) differs by token: the tail's and the
//    task's tree keys' scores are computed once for all rows, then each token's rows copy theirs into its blocks.
//  - A causal chunk (`causal`: a prompt's tokens, token t seeing the chunk's tokens 0..t) has no tree part: b holds
//    the chunk's keys as prefix keys (b.P = the cached prefix + the chunk), and token t's row sees the prefix keys up
//    to its own, b.P - T + t + 1 of them. Its sequence is then the decode step's at that prefix, key for key, cut into
//    the same blocks: a prompt prefilled in one chunk, in several, or a token at a time gives the same bits.
//  - A row of more than two blocks folds the halves of its sequence apart (split_point) and merges them at the end;
//    with `half` the task folds one half of rows that share their split (among the full blocks) and leaves its state
//    in `partial` ([R, 2 + D]: max, sum, outputs) for tree_attention_kernel to merge.
template <typename scalar_t, typename Acc, int64_t R>
void attend_rows(const scalar_t* q, const int64_t* q_strides, Acc log2_scale, HeadKeys<Acc>& b, bool windowed,
                 const scalar_t* k, const scalar_t* v, int64_t ldv, const bool* mask, const int64_t* tok,
                 const int64_t* qhead, TaskScratch<scalar_t, Acc>& w, scalar_t* out, int64_t Hq, bool causal,
                 const uint32_t* laid_values = nullptr, int64_t laid_chunk = 0, Half half = Half::kBoth,
                 Acc* partial = nullptr) {
  const int64_t D = b.D, P = b.P, T = causal ? 0 : b.T;
  // On the tiles (the amx tier's bf16 heads: amx_attention), or in the vector tiles (every task on every other tier,
  // which never has more than kRows rows).
#if defined(TR_ENGINE_AMX)
  constexpr bool kTileTypes = std::is_same_v<scalar_t, bf16> && std::is_same_v<Acc, float>;
  const bool on_tiles = kTileTypes && amx_attention::applies<scalar_t, Acc>(D);
  if constexpr (kTileTypes)
    if (on_tiles) amx_attention::configure(static_cast<int>(R));
#else
  constexpr bool on_tiles = false;
#endif
  // Scores by the AVX512-BF16 dot product (scores_chunk_dot: bf16 heads with keys as pairs, off the tiles), from q's
  // rows as they are and the tree keys gathered as pairs from the cache, like the tiles'.
  constexpr bool kDotTypes = kBf16Dot && std::is_same_v<scalar_t, bf16> && std::is_same_v<Acc, float>;
  const bool dot = kDotTypes && !on_tiles && b.pairs;
  // The tree keys as floats (a window's prefix slots come block by block); the tiles and the dot product read them
  // from the cache.
  if (windowed && !on_tiles && !dot) fill_keys(b, k, ldv, P, P + T);
  // The prefix keys each token's rows see: all P, or in a causal chunk of n tokens (b.T), those up to its own.
  const auto seen_prefix = [&](int64_t t) { return causal ? P - b.T + t + 1 : P; };
  const int64_t shared = seen_prefix(tok[0]), last = seen_prefix(tok[R - 1]);  // (rows are token-major)
  constexpr int64_t lds = kKeyBlock, ldtail = kTailWidth;
  Acc* qs = w.qs.get();
  for (int64_t r = 0; r < R; ++r) {
    const scalar_t* qr = q + tok[r] * q_strides[0] + qhead[r] * q_strides[1];
#if defined(TR_ENGINE_AMX)
    if constexpr (kTileTypes)
      if (on_tiles) {  // as they are (the scale comes after the sums)
        std::memcpy(w.qb.get() + r * D, qr, D * sizeof(bf16));
        continue;
      }
#endif
    if (dot) {  // as they are (the scale comes after the sums): bf16 in qs' floats' place
      std::memcpy(reinterpret_cast<char*>(qs) + r * D * sizeof(bf16), qr, D * sizeof(bf16));
      continue;
    }
    for (int64_t d = 0; d < D; ++d) qs[r * D + d] = to_float(qr[d]) * log2_scale;
  }
  // The tree keys any row of the task sees, gathered and transposed: ku [D, nup]. The rows are token-major, so each
  // distinct token's mask row is OR-ed in once.
  bool* seen = w.seen.get();
  std::fill(seen, seen + T, false);
  for (int64_t r = 0; r < R && T > 0; ++r)
    if (r == 0 || tok[r] != tok[r - 1])
      for (int64_t i = 0; i < T; ++i) seen[i] |= mask[tok[r] * T + i];
  auto& keys = w.tree_keys;
  keys.clear();
  for (int64_t i = 0; i < T; ++i)
    if (seen[i]) keys.push_back(i);
  const int64_t nu = static_cast<int64_t>(keys.size()), nup = round_up(nu, kKeyPad), ldt = w.Tp;
  Acc* ku = w.ku.get();
  if (dot) {  // in HeadKeys' pair layout (groups of kKeyPad keys, D / 2 words each), from the cache (padding: zeros)
    const int64_t half = D / 2;
    for (int64_t u = 0; u < nup; ++u) {
      Acc* dst = ku + u / kKeyPad * half * kKeyPad + u % kKeyPad;
      const char* src = u < nu ? reinterpret_cast<const char*>(k + (P + keys[u]) * ldv) : nullptr;
      for (int64_t c = 0; c < half; ++c) {
        if (src != nullptr)
          std::memcpy(dst + c * kKeyPad, src + 4 * c, 4);
        else
          dst[c * kKeyPad] = Acc(0);
      }
    }
  } else if (!on_tiles)
    for (int64_t d = 0; d < D; ++d) {
      for (int64_t u = 0; u < nu; ++u) ku[d * nup + u] = b.ktree()[keys[u] * D + d];
      std::fill(ku + d * nup + nu, ku + (d + 1) * nup, Acc(0));  // padding: zeros, not stale floats (fill_keys)
    }
#if defined(TR_ENGINE_AMX)
  if constexpr (kTileTypes)
    if (on_tiles) {  // in HeadKeys' pair layout, from the cache's bf16 (padding: zeros)
      uint32_t* kup = w.kup.get();
      const int64_t half = D / 2;
      for (int64_t u = 0; u < nup; ++u) {
        uint32_t* dst = kup + u / kKeyPad * half * kKeyPad + u % kKeyPad;
        const uint32_t* src = u < nu ? reinterpret_cast<const uint32_t*>(k + (P + keys[u]) * ldv) : nullptr;
        for (int64_t c = 0; c < half; ++c) dst[c * kKeyPad] = src != nullptr ? src[c] : 0u;
      }
    }
#endif
  // The scores of q's rows against n prefix keys from slot j, and against the gathered tree keys.
  auto score_prefix = [&](int64_t j, int64_t n, Acc* dst, int64_t ld) {
#if defined(TR_ENGINE_AMX)
    if constexpr (kTileTypes)
      if (on_tiles) {
        amx_attention::scores(w.qb.get(), D, reinterpret_cast<const uint32_t*>(b.prefix(j)), n, log2_scale,
                              static_cast<int>(R), dst, ld);
        return;
      }
#endif
    if constexpr (kDotTypes && R <= kRows)
      if (dot) {
        scores_dot<R>(reinterpret_cast<const bf16*>(qs), D, b.prefix(j), b.layout(), n, log2_scale, dst, ld);
        return;
      }
    if constexpr (R <= kRows) prefix_scores<Acc, R>(qs, b, j, n, dst, ld);
  };
  auto score_tree = [&](Acc* dst, int64_t ld) {
#if defined(TR_ENGINE_AMX)
    if constexpr (kTileTypes)
      if (on_tiles) {
        amx_attention::scores(w.qb.get(), D, w.kup.get(), nup, log2_scale, static_cast<int>(R), dst, ld);
        return;
      }
#endif
    if constexpr (kDotTypes && R <= kRows)
      if (dot) {
        scores_dot<R>(reinterpret_cast<const bf16*>(qs), D, ku, KeyLayout{D / 2 * kKeyPad, kKeyPad}, nup, log2_scale,
                      dst, ld);
        return;
      }
    if constexpr (R <= kRows) scores_tile<Acc, R>(qs, D, ku, KeyLayout{kKeyPad, nup}, nup, dst, ld);
  };

  Acc m[R], l[R];  // per row: running max and sum of the softmax
  std::fill(m, m + R, -std::numeric_limits<Acc>::infinity());
  std::fill(l, l + R, Acc(0));
  Acc* o = w.o.get();
  std::fill(o, o + R * D, Acc(0));
  // Each row's split_point, from the keys it sees: its prefix keys and its visible tree keys (rows are token-major).
  int64_t split[R];
  for (int64_t r = 0; r < R; ++r) {
    if (r > 0 && tok[r] == tok[r - 1]) {
      split[r] = split[r - 1];
      continue;
    }
    split[r] = split_point(seen_prefix(tok[r]) + tree_keys_seen(mask, T, tok[r]));
  }
  // Rows r0..r1-1 whose second half starts at key `at` of their sequence (folding both): the first half's state set
  // aside, the second folded from a fresh start.
  Acc m_first[R] = {}, l_first[R] = {};
  bool halved[R];
  std::fill(halved, halved + R, false);
  Acc* o_first = w.o_first.get();
  const auto begin_second = [&](int64_t r0, int64_t r1, int64_t at) {
    if (half != Half::kBoth) return;
    for (int64_t r = r0; r < r1; ++r)
      if (split[r] == at && at > 0) {
        m_first[r] = m[r];
        l_first[r] = l[r];
        std::copy(o + r * D, o + (r + 1) * D, o_first + r * D);
        m[r] = -std::numeric_limits<Acc>::infinity();
        l[r] = Acc(0);
        std::fill(o + r * D, o + (r + 1) * D, Acc(0));
        halved[r] = true;
      }
  };
  Acc* s = w.s.get();
  const scalar_t** value_rows = w.value_rows.data();
  // Fold rows r0..r1-1 of s (one block: n keys, padded with -inf to width) into (m, l), rescale their outputs, and
  // leave the block's probabilities in s.
  auto soften = [&](int64_t r0, int64_t r1, int64_t n, int64_t width) {
    for (int64_t r = r0; r < r1; ++r) {
      Acc* sr = s + r * lds;
      std::fill(sr + n, sr + width, -std::numeric_limits<Acc>::infinity());
      Acc block_max = -std::numeric_limits<Acc>::infinity();
#pragma omp simd reduction(max : block_max)
      for (int64_t j = 0; j < width; ++j) block_max = sr[j] > block_max ? sr[j] : block_max;
      const Acc new_max = std::max(m[r], block_max);
      const Acc correction = exp2_nonpositive(m[r] - new_max);  // 0 for the first block (m = -inf)
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) sr[j] = exp2_nonpositive(sr[j] - new_max);
      // The block's sum in kKeyPad lanes (key j into lane j % kKeyPad), then the lanes in order: one order for a row
      // wherever it is computed (an `omp simd` reduction's order is the vectorizer's, which may differ between the
      // kernel's instantiations for different tile heights).
      Acc lane[kKeyPad] = {};
      for (int64_t j = 0; j < width; j += kKeyPad)
        for (int64_t i = 0; i < kKeyPad; ++i) lane[i] += sr[j + i];
      Acc block_sum = 0;
      for (int64_t i = 0; i < kKeyPad; ++i) block_sum += lane[i];
      l[r] = l[r] * correction + block_sum;
      m[r] = new_max;
      for (int64_t d = 0; d < D; ++d) o[r * D + d] *= correction;
    }
  };
#if defined(TR_ENGINE_AMX)
  // The head's values as the tiles read them, if its tasks share one layout (from slot j on); then the prefix's value
  // rows are not listed for block_values (value_rows), which would not read them.
  const auto laid = [&](int64_t j) { return amx_attention::HeadValues{laid_values, laid_chunk}.from(j); };
  const bool prefix_laid = on_tiles && laid_values != nullptr;
#else
  constexpr bool prefix_laid = false;
#endif
  // soften, then the block's n value rows (value_rows, from prefix slot `slot`) into those rows' o.
  auto absorb = [&](int64_t r0, int64_t r1, int64_t n, int64_t width, int64_t slot) {
    soften(r0, r1, n, width);
#if defined(TR_ENGINE_AMX)
    if constexpr (kTileTypes)
      if (on_tiles) {
        for (int64_t r = 0; r < R; ++r) w.n[r] = r >= r0 && r < r1 ? n : 0;
        amx_attention::block_values(s, lds, R, w.n, value_rows, n, nullptr, 0, o, D, w.values(), laid(slot));
        return;
      }
#endif
    if constexpr (R <= kRows) values_rows(r1 - r0, s + r0 * lds, lds, value_rows, n, o + r0 * D, D);
  };
  // Full blocks of prefix keys: the same keys for every row (one half's: those before the rows' split, or from it on).
  const int64_t full = shared / kKeyBlock * kKeyBlock;
  const int64_t from = half == Half::kSecond ? split[0] : 0, to = half == Half::kFirst ? split[0] : full;
  for (int64_t j0 = from; j0 < to; j0 += kKeyBlock) {
    begin_second(0, R, j0);
    if (windowed) {
      b.base = j0;
      fill_keys(b, k, ldv, j0, j0 + kKeyBlock);
    }
    score_prefix(j0, kKeyBlock, s, lds);
    if (!prefix_laid)
      for (int64_t j = 0; j < kKeyBlock; ++j) value_rows[j] = v + (j0 + j) * ldv;
    absorb(0, R, kKeyBlock, kKeyBlock, j0);
  }
  // The rest: the prefix tail's and the tree keys' scores for all rows, then each token's blocks (a first half has
  // none of them).
  const bool rest = half != Half::kFirst;
  const int64_t tail = last - full;  // (the longest; in a tree every row's)
  Acc* s_tail = w.s_tail.get();
  Acc* s_tree = w.s_tree.get();
  if (tail > 0 && rest) {
    if (windowed) {
      b.base = full;
      fill_keys(b, k, ldv, full, P);
    }
    score_prefix(full, round_up(tail, kKeyPad), s_tail, ldtail);
  }
  if (nu > 0 && rest) score_tree(s_tree, ldt);
  auto& own = w.own;
  // The end of the rows from r0 that are one token's (rows are token-major).
  const auto token_end = [&](int64_t r0) {
    int64_t r1 = r0 + 1;
    while (r1 < R && tok[r1] == tok[r0]) ++r1;
    return r1;
  };
  // A token's keys past the full blocks, in order: `mine` prefix keys, then its own tree keys (own: their places in
  // `keys`); the value row and the scores of row r for the i-th of them.
  const auto own_keys = [&](int64_t t) {
    own.clear();
    for (int64_t u = 0; u < nu; ++u)
      if (mask[t * T + keys[u]]) own.push_back(u);
  };
  const auto value_row = [&](int64_t i, int64_t mine) {
    return i < mine ? v + (full + i) * ldv : v + (P + keys[own[i - mine]]) * ldv;
  };
  // Rows r0..r1-1's scores for keys j0..j0+n-1 of their token's into s: the prefix keys' a row's run at a time, the
  // tree keys' one by one.
  const auto copy_scores = [&](int64_t r0, int64_t r1, int64_t j0, int64_t n, int64_t mine) {
    const int64_t split = std::clamp<int64_t>(mine, j0, j0 + n);
    for (int64_t r = r0; r < r1; ++r) {
      std::copy(s_tail + r * ldtail + j0, s_tail + r * ldtail + split, s + r * lds);
      for (int64_t i = split; i < j0 + n; ++i) s[r * lds + i - j0] = s_tree[r * ldt + own[i - mine]];
    }
  };
#if defined(TR_ENGINE_AMX)
  if constexpr (kTileTypes)
    if (on_tiles && rest) {
      // On the tiles every token's blocks go together: the softmax of each token's rows over its keys, then one
      // block_values, whose keys up to the last whole pair group inside the prefix tail are every token's (value rows
      // laid out once for all the task's rows) and the rest each token's own. In a causal chunk every key is a prefix
      // key, the same for all rows (a row sees fewer of them). Each row gets the bits of its own blocks alone.
      int64_t longest = 0, common = 0;
      for (int64_t r0 = 0; r0 < R; r0 = token_end(r0)) {
        own_keys(tok[r0]);
        const int64_t mine = seen_prefix(tok[r0]) - full;
        longest = std::max(longest, mine + static_cast<int64_t>(own.size()));
        common = std::max(common, mine);  // (in a tree every token's)
      }
      for (int64_t j0 = 0; j0 < longest; j0 += kKeyBlock) {
        int64_t shared = std::clamp<int64_t>(common - j0, 0, kKeyBlock);
        if (!causal) shared = shared / amx_attention::kPairKeys * amx_attention::kPairKeys;
        if (!prefix_laid)
          for (int64_t j = 0; j < shared; ++j) value_rows[j] = v + (full + j0 + j) * ldv;
        auto& groups = w.groups;
        groups.clear();
        for (int64_t r0 = 0, r1; r0 < R; r0 = r1) {
          r1 = token_end(r0);
          own_keys(tok[r0]);
          const int64_t mine = seen_prefix(tok[r0]) - full;
          const int64_t n = std::clamp<int64_t>(mine + static_cast<int64_t>(own.size()) - j0, 0, kKeyBlock);
          for (int64_t r = r0; r < r1; ++r) w.n[r] = n;
          if (n == 0) continue;
          begin_second(r0, r1, full + j0);
          copy_scores(r0, r1, j0, n, mine);
          soften(r0, r1, n, round_up(n, kKeyPad));
          const bf16** rows = w.group_rows.data() + groups.size() * kKeyBlock;
          for (int64_t j = shared; j < n; ++j) rows[j - shared] = value_row(j0 + j, mine);
          groups.push_back({r0, r1, rows});
        }
        amx_attention::block_values(s, lds, R, w.n, value_rows, shared, groups.data(),
                                    static_cast<int64_t>(groups.size()), o, D, w.values(), laid(full + j0));
      }
    }
#endif
  for (int64_t r0 = 0, r1; r0 < R && !on_tiles && rest; r0 = r1) {
    r1 = token_end(r0);  // rows r0..r1-1 are this token's
    own_keys(tok[r0]);
    const int64_t mine = seen_prefix(tok[r0]) - full;  // this token's prefix keys past the full blocks
    const int64_t length = mine + static_cast<int64_t>(own.size());  // and its tree keys
    for (int64_t j0 = 0; j0 < length; j0 += kKeyBlock) {
      const int64_t n = std::min(kKeyBlock, length - j0);
      for (int64_t j = 0; j < n; ++j) value_rows[j] = value_row(j0 + j, mine);
      begin_second(r0, r1, full + j0);
      copy_scores(r0, r1, j0, n, mine);
      absorb(r0, r1, n, round_up(n, kKeyPad), -1);  // (not on the tiles)
    }
  }
#if defined(TR_ENGINE_AMX)
  if constexpr (kTileTypes)
    if (on_tiles) _tile_release();
#endif
  if (half != Half::kBoth) {  // one half's state, merged after the tasks
    for (int64_t r = 0; r < R; ++r) {
      Acc* p = partial + r * (2 + D);
      p[0] = m[r];
      p[1] = l[r];
      std::copy(o + r * D, o + (r + 1) * D, p + 2);
    }
    return;
  }
  for (int64_t r = 0; r < R; ++r) {
    if (halved[r]) merge_halves(m_first[r], l_first[r], o_first + r * D, m[r], l[r], o + r * D, D);
    finish_row(o + r * D, l[r], out + (tok[r] * Hq + qhead[r]) * D, D);
  }
}

// One sequence's operands as pointers and strides, so that a call inside another kernel (decoder_layers, a batch)
// builds no tensor views: q [T, Hq, D] (rows q_row apart, heads q_head apart), k and v [Hkv, S, D] (the same strides:
// heads `head` apart, slots `pos` apart), the last dim contiguous everywhere; mask [T, T]; out [T, Hq, D] contiguous.
template <typename scalar_t>
struct SeqOperands {
  const scalar_t* q;
  int64_t q_row, q_head, T, Hq, D;
  const scalar_t* k;
  const scalar_t* v;
  int64_t Hkv, head, pos;
  const bool* mask;
  scalar_t* out;
};

// Whether a [T, T] mask is a causal chunk's: ones on and below the diagonal, nothing above. Row by row with memchr
// (a bool is one byte, 0 or 1): every layer of a prompt chunk asks, and a loop over 1200 x 1200 elements took 5% of
// that chunk's attention.
inline bool is_causal(const bool* mask, int64_t T) {
  static_assert(sizeof(bool) == 1, "a mask element is one byte");
  for (int64_t i = 0; i < T; ++i) {
    const bool* row = mask + i * T;
    if (std::memchr(row, 0, i + 1) != nullptr || std::memchr(row + i + 1, 1, T - i - 1) != nullptr) return false;
  }
  return true;
}

template <typename scalar_t, typename Acc>
void tree_attention_kernel(const SeqOperands<scalar_t>& s, int64_t P, double scale) {
  const int64_t T = s.T, Hq = s.Hq, D = s.D, Hkv = s.Hkv, G = Hq / Hkv;
  const scalar_t* kp = s.k;
  const scalar_t* vp = s.v;
  const bool* mask = s.mask;
  const int64_t slot_stride = s.pos;
  // Tasks: each KV head's G*T query rows (token-major: the G heads of token t are adjacent) in blocks of kRows.
#if defined(TR_ENGINE_AMX)
  const int64_t task_rows = amx_attention::applies<scalar_t, Acc>(D) ? amx_attention::kTileRows : kRows;
#else
  const int64_t task_rows = kRows;
#endif
  const int64_t rows = G * T, blocks = (rows + task_rows - 1) / task_rows;
  // A causal chunk of a prompt: its keys as more prefix keys, each row seeing them up to its own (attend_rows); the
  // same bits as a tree, without gathering a task's ancestors (all the earlier tokens) for every task.
  const bool causal = T >= kCausalMin && is_causal(mask, T);
  // A head with several tasks converts its keys once for all of them; a head's only task (a decode step) converts
  // them a block at a time, as it goes (HeadKeys).
  const bool windowed = blocks == 1;
  std::vector<HeadKeys<Acc>> heads;
  uint32_t* laid = nullptr;  // the amx tier's bf16 values in key pairs (amx_attention::HeadValues), head by head
  int64_t laid_chunk = 0;
#if defined(TR_ENGINE_AMX)
  int64_t laid_keys = 0, laid_np = 0;
  if (!windowed && amx_attention::applies<scalar_t, Acc>(D)) {
    laid_keys = causal ? P + T : P;
    laid_np = round_up(laid_keys, amx_attention::kPairKeys);
    laid_chunk = laid_np / 2 * 64;
    laid = reused<uint32_t>(Hkv * D / 64 * laid_chunk, 0);
  }
#endif
  const auto laid_head = [&](int64_t h) { return laid != nullptr ? laid + h * D / 64 * laid_chunk : nullptr; };
  if (!windowed) {
    heads.reserve(Hkv);
    const int64_t keys = causal ? P + T : P, tree = causal ? 0 : T;
    const int64_t ld = round_up(keys, kKeyPad), each = HeadKeys<Acc>::size(D, tree, ld);
    Acc* storage = reused<Acc>(Hkv * each, 0);
    const bool pairs = keys_as_pairs<scalar_t, Acc>(D);
    for (int64_t h = 0; h < Hkv; ++h) heads.emplace_back(D, keys, causal ? T : tree, ld, storage + h * each, pairs);
    // The tree keys as floats only where the tasks score them from those (attend_rows): the tiles and the dot product
    // gather theirs from the cache.
#if defined(TR_ENGINE_AMX)
    const bool tiles = amx_attention::applies<scalar_t, Acc>(D);
#else
    constexpr bool tiles = false;
#endif
    const int64_t filled = keys + (tiles || (kBf16Dot && pairs) ? 0 : tree);
    constexpr int64_t kFillBlock = 128;  // slots per conversion task
    const int64_t fill_blocks = (filled + kFillBlock - 1) / kFillBlock;
    parallel_for(0, Hkv * fill_blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t h = i / fill_blocks, j0 = i % fill_blocks * kFillBlock;
        fill_keys(heads[h], kp + h * s.head, slot_stride, j0, std::min(j0 + kFillBlock, filled));
#if defined(TR_ENGINE_AMX)
        if constexpr (std::is_same_v<scalar_t, bf16>)
          if (laid != nullptr && j0 < laid_np)
            amx_attention::lay_values(vp + h * s.head, slot_stride, laid_keys, j0, std::min(j0 + kFillBlock, laid_np),
                                      D, laid_head(h), laid_chunk);
#endif
      }
    });
  }
  const int64_t q_strides[2] = {s.q_row, s.q_head};
  const Acc log2_scale = static_cast<Acc>(scale * 1.4426950408889634);  // scores in log2 units: softmax by 2^x
  const scalar_t* qp = s.q;
  scalar_t* op = s.out;
  // The threads take runs of consecutive tasks. A causal chunk's later rows see more keys (the last ones all P + T,
  // the first P + 1), so a head's blocks in row order would give one thread the cheap half and another the dear half
  // (with 2 threads and 3 KV heads, 1.25 against 1.75 heads' work): a head's blocks are taken from both ends in turn
  // (0, n - 1, 1, n - 2, ...), and any run of them costs about its share (a 1200-token prompt's attention 8% faster).
  // Which thread attends a row changes no bit.
  const auto block_of = [&](int64_t i) { return !causal ? i : i % 2 == 0 ? i / 2 : blocks - 1 - i / 2; };
  // The threads take equal shares of the heads' work, counted in half blocks of rows. Where a share ends in the middle
  // of a block whose rows share their split_point among the full blocks of prefix keys, that block goes as two tasks,
  // one half each (attend_rows), their states merged after (merge_halves): SmolLM2's 3 heads of a decode step on 2
  // threads are 1.5 heads each, not 2 and 1; a 16-token verify's 9 blocks on the tiles 4.5 and 4.5, not 5 and 4. At
  // most one block a share is cut (cutting every block of a wide verify, each task's setup twice, took longer). Which
  // task folds a half changes no bit.
  const int64_t units = Hkv * blocks, threads = std::min(pool_threads(), 2 * units);  // (a share is a half at least)
  std::vector<int64_t> halves_at(blocks, 0);  // a block's rows' common split where it may be cut, else 0
  if (!causal && threads > 1 && units % threads != 0) {
    std::vector<int64_t> split(T);  // per token: the split of the keys it sees (the prefix and its visible tree keys)
    for (int64_t t = 0; t < T; ++t) split[t] = split_point(P + tree_keys_seen(mask, T, t));
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t first = blk * task_rows / G, last = (std::min(rows, (blk + 1) * task_rows) - 1) / G;
      bool same = split[first] > 0 && split[first] <= P / kKeyBlock * kKeyBlock;
      for (int64_t t = first; t <= last && same; ++t) same = split[t] == split[first];
      halves_at[blk] = same ? split[first] : 0;
    }
  }
  struct Task {
    int64_t unit;  // h * blocks + the head's block of rows
    Half half;
  };
  std::vector<Task> tasks;  // share by share: share i is tasks[starts[i]] .. tasks[starts[i + 1] - 1]
  std::vector<int64_t> starts{0}, cut;  // cut: the blocks that go as two tasks
  tasks.reserve(units + threads);
  bool second = false;  // whether the share before ended in a block's first half
  for (int64_t share = 0, next = 0, done = 0; share < threads; ++share) {  // done: half blocks taken
    if (second) {
      tasks.push_back({cut.back(), Half::kSecond});
      ++done;
      second = false;
    }
    const int64_t target = 2 * units * (share + 1) / threads;
    for (; done < target && next < units; ++next) {
      const int64_t unit = next / blocks * blocks + block_of(next % blocks);
      if (target - done == 1 && halves_at[unit % blocks] > 0) {
        tasks.push_back({unit, Half::kFirst});
        cut.push_back(unit);
        ++done;
        second = true;
      } else {
        tasks.push_back({unit, Half::kBoth});
        done += 2;
      }
    }
    starts.push_back(static_cast<int64_t>(tasks.size()));
  }
  // A cut block's halves' states: [cut][first, second][row][2 + D] (attend_rows' `partial`).
  const int64_t state = 2 + D;
  Acc* partial = cut.empty() ? nullptr : reused<Acc>(static_cast<int64_t>(cut.size()) * 2 * task_rows * state, 2);
  const auto partial_of = [&](int64_t unit, Half half) {
    const int64_t c = std::find(cut.begin(), cut.end(), unit) - cut.begin();
    return partial + ((c * 2 + (half == Half::kSecond)) * task_rows) * state;
  };
  // The block of rows of a unit: its rows' count, and each row's token and query head.
  const auto rows_of = [&](int64_t unit, int64_t* tok, int64_t* qhead) {
    const int64_t h = unit / blocks, r0 = unit % blocks * task_rows, R = std::min(task_rows, rows - r0);
    for (int64_t r = 0; r < R; ++r) {
      tok[r] = (r0 + r) / G;
      qhead[r] = h * G + (r0 + r) % G;
    }
    return R;
  };
  parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    TaskScratch<scalar_t, Acc>& scratch = task_scratch<scalar_t, Acc>(D, T);
    std::optional<HeadKeys<Acc>> window;
    if (windowed)
      window.emplace(D, P, T, kKeyBlock, reused<Acc>(HeadKeys<Acc>::size(D, T, kKeyBlock), 1),
                     keys_as_pairs<scalar_t, Acc>(D));
    for (int64_t i = starts[begin]; i < starts[end]; ++i) {
      const Task task = tasks[i];
      const int64_t h = task.unit / blocks;
      int64_t tok[kTaskRows], qhead[kTaskRows];
      const int64_t R = rows_of(task.unit, tok, qhead);
      Acc* state_out = task.half == Half::kBoth ? nullptr : partial_of(task.unit, task.half);
      // Each row count a kernel of its own (up to 16 rows where amx_attention applies, kRows elsewhere).
      with_rows<kTaskRows>(static_cast<int>(R), [&](auto rows_const) {
        attend_rows<scalar_t, Acc, decltype(rows_const)::value>(
            qp, q_strides, log2_scale, windowed ? *window : heads[h], windowed, kp + h * s.head, vp + h * s.head,
            slot_stride, mask, tok, qhead, scratch, op, Hq, causal,
            laid_head(h), laid_chunk, task.half, state_out);
      });
    }
  });
  // The cut blocks' halves merged, as attend_rows merges a row's halves when it folds both (the same merge_halves).
  for (const int64_t unit : cut) {
    int64_t tok[kTaskRows], qhead[kTaskRows];
    const int64_t R = rows_of(unit, tok, qhead);
    for (int64_t r = 0; r < R; ++r) {
      const Acc* first = partial_of(unit, Half::kFirst) + r * state;
      Acc* second = partial_of(unit, Half::kSecond) + r * state;
      merge_halves(first[0], first[1], first + 2, second[0], second[1], second + 2, D);
      finish_row(second + 2, second[1], op + (tok[r] * Hq + qhead[r]) * D, D);
    }
  }
}


// The attention of one sequence's rows, its arguments checked already (every row sees a key): the kernel in the
// operands' dtype (float accumulation, double for double).
template <typename scalar_t>
void attend_seq(const SeqOperands<scalar_t>& s, int64_t prefix_len, double scale) {
  if (s.T == 0) return;
  using Acc = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
  tree_attention_kernel<scalar_t, Acc>(s, prefix_len, scale);
}

// Each sequence through the same kernel, on its own rows, slot and mask block: its rows' bits are the ones a call for
// that sequence alone gives. With several sequences the threads split the sequences between them (each sequence's
// call then runs on one thread; a plain step's single row per sequence would leave threads idle otherwise).
template <typename T>
void attention(const Attention<T>& a) {
  std::vector<int64_t> mask_at(a.B + 1, 0);
  for (int64_t b = 0; b < a.B; ++b) {
    const int64_t n = a.offsets[b + 1] - a.offsets[b];
    mask_at[b + 1] = mask_at[b] + n * n;
  }
  auto attend = [&](int64_t b) {
    const int64_t lo = a.offsets[b], n = a.offsets[b + 1] - lo;
    const SeqOperands<T> s{a.q + lo * a.q_row, a.q_row, a.q_head, n, a.Hq, a.D,
                           a.cache.k + a.slots[b] * a.cache.seq, a.cache.v + a.slots[b] * a.cache.seq, a.cache.Hkv,
                           a.cache.head, a.cache.pos, a.masks + mask_at[b], a.out + lo * a.Hq * a.D};
    attend_seq(s, a.prefix_lens[b], a.scale);
  };
  if (a.B == 1) {
    attend(0);
  } else {
    parallel_for(0, a.B, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) attend(b);
    });
  }
}

}  // namespace tr_engine_cpu
