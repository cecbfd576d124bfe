// The CPU matmuls y = x @ w.T of the decode steps, draft-tree verifies and prefills, written once over simd.h's Vec.
//
// packed_rows: w stored, once at load time, in pack_linear's blocked layout (csrc/registration.cpp): blocks of 32
// output rows; inside a block, for each group of P input columns, the 32 rows' P values side by side (P = 2 for bf16,
// 1 for float32 and float16). In a decode step or a verify (1..~100 rows of x) each weight must be read from memory
// once and applied to every row of x while it sits in registers. With this layout one vector load holds kLanes output
// rows' next P weights; the kernel broadcasts x[r]'s next value and multiply-adds it into one accumulator per output,
// so nothing needs a horizontal sum: the accumulators are the outputs. A register tile is R rows of x by V vectors of
// outputs (R x V accumulators, V weight vectors, one broadcast); a block is covered in 32 / (V kLanes) passes, each
// reading its own cache lines of the block's groups. Prefetches keep the memory streaming the whole time: a block's
// first pass asks for its own lines ahead of the stream, and where a block takes several passes every pass also asks
// for its share of the next block's, so that it is on its way while the later passes run from the caches.
//
// skinny_linear: a plain row-major w [N, K] (weights nobody packed), for 1-16 rows: tiles of rows of x by 4 weight
// rows, each weight row streamed once and reduced against every row of x while it sits in L1.
//
// Each output is one sum over K in a fixed order (the dims in order into one accumulator lane), whatever the other
// rows of the call: the kernels are row-independent, so a token's projections are bit for bit the same in a decode
// step, a verify and a prefill, on each tier.
#pragma once

#include "api.h"
#include "parallel.h"
#include "simd.h"
#include "tiles.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace tr_engine_cpu {

// A register tile is R rows of x by V vectors of outputs: R x V accumulators, the V weight vectors of one group and a
// broadcast of x must fit the registers. Each accumulator is a chain of dependent multiply-adds (4 cycles each, two
// issued per cycle), so a tile needs about 8 accumulators to keep the units busy: a decode step's single row takes
// a whole block per pass where the registers allow (AVX2: 4 vectors of 8; NEON: 8 of 4), more rows take narrower
// passes (16 outputs) and up to kPackRows rows. With AVX-512 a block is always one pass (2 vectors of 16), up to 8 rows
// (it could hold 14; a tile of 12 ran slower than two of 8 at a 7B model's shapes).
constexpr int kWideVecs = static_cast<int>(kPackBlock) / kLanes;  // a whole block
constexpr int kNarrowVecs = kLanes >= 16 ? kWideVecs : 16 / kLanes;  // 16 outputs
constexpr int kPackRows = std::min(8, (kRegisters - kNarrowVecs - 1) / kNarrowVecs);
constexpr int64_t kRowChunk = 192;  // rows of x per pass over w, so x's chunk stays in L2 for a long prefill
static_assert(kPackBlock % (kNarrowVecs * kLanes) == 0, "a pass covers a whole number of a block's outputs");

// Whether a pass over a tile of R rows by V vectors of outputs takes a group's V weight vectors first, then each
// row's broadcast in turn (R x V accumulators, V weights and one broadcast live), or the R broadcasts first, then
// each weight vector in turn (R x V accumulators, R broadcasts and one weight): the first where it fits the
// registers, the second where only it does (with AVX2, 3 rows by a whole block: 12 + 3 + 1 of 16 registers). Every
// accumulator takes the same multiply-adds in the same order either way. (The loops are written out in each pass:
// through one helper taking lambdas, GCC allocated the 6-row tiles' registers worse, 1.08-1.11x slower.)
template <int R, int V>
constexpr bool weights_first() { return R * V + V + 1 <= kRegisters; }

// The vectors per pass for a tile of R rows: a whole block if its accumulators and the fewer of its weight vectors
// and its rows' broadcasts, plus one, fit the registers (weights_first), else 16 outputs. Each tile of a block takes
// its own: with AVX2 a last tile of 1-3 rows covers the whole block in one pass. (3 rows in one pass of 12
// accumulators against two passes of 6, AMD EPYC Zen 3, all of SmolLM2's projections alternated in one process: bf16
// 0.85-0.93x the time, float16 0.94x, float32 0.96x, float32 at 9 rows (6 + 3) 0.95x; the same outputs bit for bit.)
constexpr int tile_vecs(int R) {
  return R * kWideVecs + std::min(kWideVecs, R) + 1 <= kRegisters ? kWideVecs : kNarrowVecs;
}

// How a verify's rows are cut into tiles, where the block is covered a K-chunk at a time (block_in_chunks: float32,
// widened bf16). With AVX2's 16 registers, full tiles of kPackRows (6) rows and the rest in the last: a tile of 6 rows
// by 16 outputs has 12 accumulators, one of 4 rows (near-equal tiles of 8 rows) 8, too few chains to keep both
// multiply-add units busy through the loads. All of SmolLM2's float32 projections and head, AMD EPYC (Zen 3) with 2
// threads, against near-equal tiles, alternated in one process: 7 rows 0.92x the time, 8 rows 0.81x, 9 0.93x, 13-14
// 0.87x; 10, 16 and 24 rows as fast. f16 and bf16 pairs (a whole block per pass, no K-chunks) keep near-equal tiles:
// full ones measured mixed there (f16 0.9x at 7-8 rows, 1.04x at 9 and 13; bf16 pairs 0.92-0.94x at 7-8, 1.03-1.05x
// at 9-10, 0.93-0.97x at 13-14, as fast at 16). Elsewhere (32 registers: 8-row tiles of 16 accumulators) near-equal
// tiles, not measured against.
constexpr bool kFullTiles = kRegisters < 32;

// The rows of tile g of `tiles` over `rows` rows of x, from row t on: `full` tiles of kPackRows rows, the rest in the
// last, or near-equal tiles.
inline int tile_rows(int64_t rows, int64_t tiles, int64_t t, int64_t g, bool full) {
  return static_cast<int>(full ? std::min<int64_t>(kPackRows, rows - t) : (rows - t) / (tiles - g));
}

// The passes over a block of `valid` outputs for `rows` rows of x in `tiles` tiles.
inline int64_t block_passes(int64_t rows, int64_t tiles, int valid, bool full) {
  int64_t passes = 0;
  for (int64_t g = 0, t = 0; g < tiles; ++g) {
    const int r = tile_rows(rows, tiles, t, g, full), per_pass = tile_vecs(r) * kLanes;
    passes += (valid + per_pass - 1) / per_pass;
    t += r;
  }
  return passes;
}

// The prefetch distance: the hardware prefetchers alone left this stream short of the memory's bandwidth (each
// matmul of a step is short: 0.7-3.5 MB for SmolLM2, split between the threads, and at 8 rows the multiply-adds keep
// the core busy while the next lines are on their way). Measured with AVX-512 on whole SmolLM2 steps against no
// prefetch: bf16 4-7% faster at 1 row and 12-15% at 8, fp32 3% and 8%; 2 KB ahead helped less, 6 KB no more.
constexpr int64_t kPrefetch = 4096;
// How far ahead a pass of 3 rows or more asks for its lines: each group takes longer there (a multiply-add per row),
// and 4 KB ahead left the memory idle. SmolLM2's projections, AMD EPYC (Zen 4), 2 threads, while one row streamed at
// ~55 GB/s, alternated against 4 KB (bf16 with the dot product; float32): 3 rows 0.92x and 0.87x the time, 4 rows
// 0.87x and 0.91x, 5 rows 0.75x and 0.75x, 6 rows 0.80x and 0.76x, 8 rows 0.92x and 0.93x; 16 KB (and for 2 rows
// too) was no better at 3-8 rows and worse at 2 (1.13x). 1-2 rows keep 4 KB: 8 KB made one row 1.37x slower. Whole
// decoding on that host, bench.ab against 4 KB: hybrid 1.089x in bf16, 1.066x in fp32; on an Intel Xeon (avx512bf16,
// its memory at ~25-30 GB/s) unchanged: 0.994x and 1.003x, plain 1.012x and 1.007x (ab_prefetch_avx512bf16*.md).
constexpr int64_t kPrefetchManyRows = 8192;
constexpr int kManyRows = 3;

// Whether a pass leads with prefetchnta rather than prefetcht1: on the avx512bf16 tier, bf16 and float32 weights, 2-4
// rows. Measured on an AMD EPYC (Zen 4), 2 threads, all of SmolLM2's projections from one process (no Python between
// them), while one row streamed at ~52 GB/s: bf16 2 rows 6.02 -> 5.10 ms (one row's 4.86-5.08), 3 rows 5.77 -> 5.30,
// 4 rows 5.60 -> 5.45; float32 2 rows 12.8-13.5 -> 11.0-11.1 ms (one row's 10.1-10.8), 3 rows 1.00-1.05x the time,
// 4 rows 12.0-12.6 -> 11.2-11.8. 1 row took 1.04-1.08x with it, 5-8 rows 1.05-1.12x; while the memory ran at ~37
// GB/s (the host's slow spells) it changed nothing. Whole bf16 forwards at a 256-token prefix, the hints alternated
// in rotation: 2 / 3 / 4 tokens 6.72 -> 6.18 / 8.40 -> 7.20 / 8.35 -> 7.84 ms (a plain step 5.6), the same bits. Not
// measured on other hosts or tiers (the amx tier's bf16 runs on its tiles), which keep prefetcht1.
template <typename T, int R>
constexpr bool lead_once() {
  return (std::is_same_v<T, bf16> || std::is_same_v<T, float>) && kBf16Dot && !kAmx && R >= 2 && R <= 4;
}

template <typename T>
constexpr int64_t pack_width() { return std::is_same_v<T, bf16> ? 2 : 1; }

// y[r, c0 + i] for the tile's R rows and V vectors of outputs, columns from `valid` on left alone.
template <int R, int V, typename T>
void store_tile(const Vec (&acc)[R][V], T* y, int64_t ldy, int c0, int valid) {
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) {
      const int col = c0 + v * kLanes;
      if (valid - col >= kLanes)
        store(y + r * ldy + col, acc[r][v]);
      else if (valid > col)
        store_first(y + r * ldy + col, acc[r][v], valid - col);
    }
}

// What one pass asks the memory for. `lead`: the group's own lines kPrefetch bytes ahead (a block's first pass, when
// no earlier pass asked for them). `ahead`, `bytes`: this pass's share of the next K-chunk (a multiple of 64 bytes;
// packed_rows), spread evenly over the pass's groups. Without the shares a block of several passes was streamed by
// its first pass alone, the memory idle while the others ran. SmolLM2's projections, float32, against one row's time
// (medians of 4 alternated runs, when the shares were of the next whole block): AVX2 at 8 rows (4 passes of 4 rows
// by 16 outputs) 1.73x -> 1.45x with the shares and over_groups' pairs; AVX-512 at 16 rows (2 passes) 1.79x -> 1.44x.
struct Prefetch {
  bool lead = false;
  const char* ahead = nullptr;
  int64_t bytes = 0;
};

class Prefetcher {
 public:
  // `rows`: the pass's rows of x (how far ahead it leads: kPrefetch, or kPrefetchManyRows from kManyRows rows on).
  // `once`: the lead's lines with prefetch_once (lead_once).
  Prefetcher(const Prefetch& plan, int64_t groups, int rows, bool once = false)
      : lead_(plan.lead), once_(once), next_(plan.ahead), share_(plan.bytes), per_line_(64 * groups),
        distance_(rows >= kManyRows ? kPrefetchManyRows : kPrefetch) {}

  // Before n groups from `group` on, `bytes` of lines each.
  void at(const void* group, int64_t bytes, int n) {
    if (lead_)
      for (int64_t line = 0; line < n * bytes; line += 64) {
        const char* p = static_cast<const char*>(group) + distance_ + line;
        if (once_)
          prefetch_once(p);
        else
          prefetch(p);
      }
    if (next_ != nullptr)
      for (owed_ += n * share_; owed_ >= per_line_; owed_ -= per_line_, next_ += 64) prefetch(next_);
  }

 private:
  bool lead_, once_;
  const char* next_;
  int64_t share_, owed_ = 0, per_line_;  // owed_ in 1/groups bytes: after k groups, k * share / groups are due
  int64_t distance_;
};

// for k in 0..groups-1: prefetcher.at before each pair of groups, then step(k) for each. (The pairs halve the
// loop's bookkeeping: with AVX2 the tile's 8 multiply-adds issue in 4 cycles, and the loop's other instructions
// competed with them.)
template <typename F>
inline void over_groups(int64_t groups, int64_t group_bytes, const char* wb, Prefetcher& prefetcher, F&& step) {
  int64_t k = 0;
  for (; k + 2 <= groups; k += 2) {
    prefetcher.at(wb + k * group_bytes, group_bytes, 2);
    step(k);
    step(k + 1);
  }
  if (k < groups) {
    prefetcher.at(wb + k * group_bytes, group_bytes, 1);
    step(k);
  }
}

// A pass is a function of its own, never inlined into its caller: its loop then gets the registers to itself, with
// the prefetcher and the per-group step inlined into it. Inlined into block_in_chunks, beside the pass choice for
// every tile's rows and vectors, GCC left Prefetcher::at a call inside the loop, each call sending the tile's
// accumulators to the stack and back: bf16 verifies past 12 rows ran 2-2.5x slower.
#define TR_ENGINE_PASS __attribute__((noinline))

// A pass's sums when a block is covered a K-chunk at a time (block_in_chunks): with `carried`, the pass starts from
// `sums` ([rows, kPackBlock] floats from the tile's first row: zeros before the first chunk) and leaves its sums there
// (the block's outputs are written from them after the last chunk); without, from zeros, into y. A sum stored as a
// float and loaded again is the same float, so each output is still one chain of multiply-adds in the order of K, as
// in a single pass. (A template flag: chosen at run time in the pass, it made f16's passes at 16-24 rows, which fill
// AVX2's registers, 1.2-1.4x slower.)
template <bool carried, int R, int V>
void start_tile(Vec (&acc)[R][V], const float* sums, int c0) {
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = carried ? load(sums + r * kPackBlock + c0 + v * kLanes) : zero();
}

template <bool carried, int R, int V, typename Y>
void end_tile(const Vec (&acc)[R][V], float* sums, Y* y, int64_t ldy, int c0, int valid) {
  if constexpr (carried) {
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < V; ++v) store(sums + r * kPackBlock + c0 + v * kLanes, acc[r][v]);
  } else {
    store_tile<R, V>(acc, y, ldy, c0, valid);
  }
}

// One pass over a block of float32 or float16 weights (P = 1: a group is the 32 outputs' weights of one input
// column): outputs c0.. for R rows of x as floats. f16 weights are widened in registers (exact), then the same
// multiply-adds as float32.
template <int R, int V, bool carried = false, typename W, typename Y>
TR_ENGINE_PASS void pass_p1(const float* x, int64_t ldx, const W* wb, int64_t groups, Y* y, int64_t ldy, int c0,
                            int valid, const Prefetch& plan, float* sums = nullptr) {
  Prefetcher prefetcher(plan, groups, R, lead_once<W, R>());
  Vec acc[R][V];
  start_tile<carried>(acc, sums, c0);
  over_groups(groups, kPackBlock * sizeof(W), reinterpret_cast<const char*>(wb), prefetcher, [&](int64_t k) {
    const W* group = wb + k * kPackBlock + c0;
    if constexpr (weights_first<R, V>()) {
      Vec w[V];
      for (int v = 0; v < V; ++v) w[v] = load(group + v * kLanes);
      for (int r = 0; r < R; ++r) {
        const Vec xb = broadcast(x[r * ldx + k]);
        for (int v = 0; v < V; ++v) acc[r][v] = mul_add(xb, w[v], acc[r][v]);
      }
    } else {
      Vec xb[R];
      for (int r = 0; r < R; ++r) xb[r] = broadcast(x[r * ldx + k]);
      for (int v = 0; v < V; ++v) {
        const Vec w = load(group + v * kLanes);
        for (int r = 0; r < R; ++r) acc[r][v] = mul_add(xb[r], w, acc[r][v]);
      }
    }
  });
  end_tile<carried>(acc, sums, y, ldy, c0, valid);
}

// One pass over a block of bf16 weights (P = 2: a group is the 32 outputs' pairs of weights of input columns 2k and
// 2k + 1, as 32-bit words). With the AVX512-BF16 dot product: x's pair broadcast, both products into each lane in
// one instruction (xb: x's rows as bf16). Elsewhere: the group's words widened to their even weights (exact) and
// multiplied into every row's accumulators, then widened again from L1 to their odd weights, and the same: each
// output takes the even column first, then the odd one, into its one accumulator; x as floats, the tile's rows side
// by side for each column (xt: tiles_as_float). (Two accumulators per output, even and odd, would shorten the chains
// of a one-row tile, but then the sum's order would depend on the tile: not row-independent.)
// Widening both halves at once held twice the weight vectors and two broadcasts: with AVX2's 16 registers a tile of
// 4 rows by 16 outputs (8 accumulators, each a chain of two dependent multiply-adds per group) was the most that fit,
// too few chains for the multiply-add units; a half at a time, tiles of 5-6 rows fit (10-12 accumulators). And with
// x's rows apart by ldx, each row's broadcast needed an address register of its own, and the tile's rows did not fit
// the general registers either; side by side, one pointer and constant offsets. SmolLM2's projections, AMD EPYC (Zen
// 3), 2 threads, alternated in one process against both halves at once from x's rows: 2 rows 0.90x the time, 4 rows
// 0.90x, 6 0.87x, 8 0.85x, 10 0.68x, 12 0.74x, 16-32 0.74-0.79x (then against widening once per chunk: kWidenRows);
// one row as fast. (The halves' weights in arrays of their own: one array reused for both, GCC kept the
// accumulators in memory, a store after every multiply-add, 1.2-1.7x slower.)
template <int R, int V, bool carried = false, typename Y>
TR_ENGINE_PASS void pass_bf16(const float* xt, const bf16* xb, int64_t ldx, const bf16* wb, int64_t groups, Y* y,
                              int64_t ldy, int c0, int valid, const Prefetch& plan, float* sums = nullptr) {
  Prefetcher prefetcher(plan, groups, R, lead_once<bf16, R>());
  Vec acc[R][V];
  start_tile<carried>(acc, sums, c0);
  over_groups(groups, 2 * kPackBlock * sizeof(bf16), reinterpret_cast<const char*>(wb), prefetcher, [&](int64_t k) {
    const bf16* group = wb + k * 2 * kPackBlock + 2 * c0;
    if constexpr (kBf16Dot) {
      static_assert(weights_first<R, V>(), "AVX-512 (the dot product's tier, 32 registers) fits any tile");
      Vec w[V];
      for (int v = 0; v < V; ++v) w[v] = load_words(group + 2 * v * kLanes);
      for (int r = 0; r < R; ++r) {
        const Vec pair = broadcast_word(xb + r * ldx + 2 * k);
        for (int v = 0; v < V; ++v) acc[r][v] = dot_pairs(acc[r][v], pair, w[v]);
      }
    } else {
      const float* x_even = xt + 2 * k * R;  // column 2k's R rows, then column 2k + 1's
      const float* x_odd = x_even + R;
      if constexpr (weights_first<R, V>()) {
        Vec w_even[V], w_odd[V];
        for (int v = 0; v < V; ++v) w_even[v] = even(load_words(group + 2 * v * kLanes));
        for (int r = 0; r < R; ++r) {
          const Vec xr = broadcast(x_even[r]);
          for (int v = 0; v < V; ++v) acc[r][v] = mul_add(xr, w_even[v], acc[r][v]);
        }
        for (int v = 0; v < V; ++v) w_odd[v] = odd(load_words(group + 2 * v * kLanes));
        for (int r = 0; r < R; ++r) {
          const Vec xr = broadcast(x_odd[r]);
          for (int v = 0; v < V; ++v) acc[r][v] = mul_add(xr, w_odd[v], acc[r][v]);
        }
      } else {
        Vec xe[R], xo[R];
        for (int r = 0; r < R; ++r) xe[r] = broadcast(x_even[r]);
        for (int v = 0; v < V; ++v) {
          const Vec w = even(load_words(group + 2 * v * kLanes));
          for (int r = 0; r < R; ++r) acc[r][v] = mul_add(xe[r], w, acc[r][v]);
        }
        for (int r = 0; r < R; ++r) xo[r] = broadcast(x_odd[r]);
        for (int v = 0; v < V; ++v) {
          const Vec w = odd(load_words(group + 2 * v * kLanes));
          for (int r = 0; r < R; ++r) acc[r][v] = mul_add(xo[r], w, acc[r][v]);
        }
      }
    }
  });
  end_tile<carried>(acc, sums, y, ldy, c0, valid);
}

// x's rows t0..t0+rows-1 as floats ([rows, ldx]), in a buffer the calling thread keeps: the passes that broadcast
// floats read them from there (f16; bf16 without the dot product). float x is read where it is.
template <typename T>
const float* rows_as_float(const T* x, int64_t ldx, int64_t rows) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    thread_local std::vector<float> buffer;
    if (static_cast<int64_t>(buffer.size()) < rows * ldx) buffer.resize(rows * ldx);
    for (int64_t i = 0; i < rows * ldx; ++i) buffer[i] = to_float(x[i]);
    return buffer.data();
  }
}

// x's rows t0..t0+rows-1 as floats for pass_bf16's widened pairs: tile by tile (`tiles` near-equal tiles:
// tile_rows, the cut block_in_chunks makes of them, whose pairs are not chunked), each of the tile's K columns its r
// rows side by side, so the tile from row t starts at t * K. In a buffer the calling thread keeps.
inline const float* tiles_as_float(const bf16* x, int64_t ldx, int64_t rows, int64_t tiles, int64_t K) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < rows * K) buffer.resize(rows * K);
  for (int64_t g = 0, t = 0; g < tiles; ++g) {
    const int r = tile_rows(rows, tiles, t, g, false);
    float* tile = buffer.data() + t * K;
    for (int64_t c = 0; c < K; ++c)
      for (int i = 0; i < r; ++i) tile[c * r + i] = to_float(x[(t + i) * ldx + c]);
    t += r;
  }
  return buffer.data();
}

// A block of float32 weights that takes several passes (more rows than one tile, or outputs than one pass) is
// covered a K-chunk at a time: every pass over one chunk of the block's groups, then the next chunk, each pass's sums
// carried from chunk to chunk as floats (start_tile). The chunk, read from memory by its first pass, is still in L1 for
// the others; a whole block (SmolLM2: 73-196 KB of float32) was not, and every later pass read it again from L2.
// bf16 weights without the dot product are widened into floats once per chunk (exact), into a buffer of the
// thread's, instead of once per pass, past kWidenRows rows, and the passes run float32's: the same multiply-adds in
// the same order (a pair's even column, then its odd one). Half-type weights otherwise go a whole block at a time,
// widened in registers by each pass as before: half the bytes, and measured slower in chunks (f16 1.14x at 8-12 rows;
// widened once per chunk 1.5x at 16; bf16 pairs 1.1x at 8), so f16, and bf16 with the dot product (not measured
// here: no AVX512-BF16 on this host), keep their pass. All of SmolLM2's projections on an AVX2 host (AMD EPYC, 2
// threads), against whole blocks per pass, alternated in one process: float32 at 6 rows 26 -> 23 ms, 8 rows 30 ->
// 23-24 ms (1.39x -> 1.06x one row's time), 12 rows 29 -> 27 ms, 16 rows and more as fast; bf16 at 16 rows 40 -> 35
// ms, 32 rows 77 -> 63 ms.
constexpr int64_t kChunkFloats = 4096;  // 16 KB: a chunk's weights as the passes read them (L1: 32-48 KB)
// Rows of x past which bf16 pairs (without the dot product) are widened once per chunk; below, they are
// widened in registers by every pass, a whole block at a time (in chunks they ran slower). Measured on AVX2,
// SmolLM2's projections, alternated in one process, pass_bf16's pairs against widening once per chunk: 0.85x the time
// at 13-18 rows, 0.89x at 24-48, 0.95x at 64, as fast at 96 (the chunks' floats stay in L1; a block's passes
// read its pairs from L2 again).
constexpr int kWidenRows = 64;

// Whether many rows' passes read a chunk widened into floats (bf16 without the dot product).
template <typename T>
constexpr bool widens() { return std::is_same_v<T, bf16> && !kBf16Dot; }

// The groups [0, groups) of a block of bf16 pairs as floats in float32's layout (a group per input column: a pair's
// even column, then its odd one).
inline void widen(const bf16* w, int64_t groups, float* out) {
  for (int64_t k = 0; k < groups; ++k)
    for (int v = 0; v < kWideVecs; ++v) {
      const Vec words = load_words(w + 2 * (k * kPackBlock + v * kLanes));
      store(out + 2 * k * kPackBlock + v * kLanes, even(words));
      store(out + (2 * k + 1) * kPackBlock + v * kLanes, odd(words));
    }
}

// n floats of `buffer` (grown as needed) from a cache line's start: a vector load from L1 that straddles two lines
// costs two.
inline float* cache_lines(std::vector<float>& buffer, int64_t n) {
  constexpr int64_t line = 64 / sizeof(float);
  if (static_cast<int64_t>(buffer.size()) < n + line) buffer.resize(n + line);
  const auto address = reinterpret_cast<uintptr_t>(buffer.data());
  return buffer.data() + ((64 - address % 64) % 64) / sizeof(float);
}

// One block's outputs for a chunk of `rows` rows of x in `tiles` tiles (tile_rows; each tile's passes as wide as
// tile_vecs says), a K-chunk at a time (above; half types but widened bf16: the whole block as one chunk); with
// `as_floats`, from the chunk widened into floats. `first`: the thread's first block, whose first pass asks for its
// own lines (nothing asked for them before); `next_block`: the thread's next block (nullptr at its
// last), whose first chunk this block's last chunk asks for, shared between its passes, as every chunk asks for the
// next.
template <bool as_floats, typename T>
void block_in_chunks(const float* xf, const T* x, int64_t ldx, const T* wb, int64_t groups, T* y, int64_t N,
                     int64_t rows, int64_t tiles, int valid, bool first, const T* next_block) {
  constexpr int64_t P = pack_width<T>();
  constexpr bool chunked = as_floats || std::is_same_v<T, float>;  // (others: the whole block is one chunk)
  constexpr bool full = chunked && kFullTiles;
  constexpr int64_t group_bytes = kPackBlock * P * static_cast<int64_t>(sizeof(T));
  const int64_t most = chunked ? std::max<int64_t>(1, kChunkFloats / (kPackBlock * P)) : groups;
  const int64_t chunks = (groups + most - 1) / most, per_chunk = (groups + chunks - 1) / chunks;  // near-equal
  const int64_t passes = block_passes(rows, tiles, valid, full);
  thread_local std::vector<float> sums_buffer, wide_buffer;
  float* const sums = chunks > 1 ? cache_lines(sums_buffer, rows * kPackBlock) : nullptr;
  float* const wide = as_floats ? cache_lines(wide_buffer, per_chunk * kPackBlock * P) : nullptr;
  if (sums != nullptr) std::fill(sums, sums + rows * kPackBlock, 0.f);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t g0 = c * per_chunk, g1 = std::min(groups, g0 + per_chunk);
    const T* wc = wb + g0 * kPackBlock * P;
    const char* next = nullptr;  // the next chunk, this block's or the next block's first
    int64_t next_bytes = 0;
    if (g1 < groups) {
      next = reinterpret_cast<const char*>(wb + g1 * kPackBlock * P);
      next_bytes = (std::min(groups, g1 + per_chunk) - g1) * group_bytes;
    } else if (next_block != nullptr) {
      next = reinterpret_cast<const char*>(next_block);
      next_bytes = std::min(groups, per_chunk) * group_bytes;
    }
    const int64_t share = (next_bytes / passes + 63) / 64 * 64;
    if constexpr (as_floats) widen(wc, g1 - g0, wide);
    int64_t pass = 0;
    for (int c0 = 0; c0 < valid; c0 += kNarrowVecs * kLanes)
      for (int64_t g = 0, t = 0; g < tiles; ++g) {
        const int r = tile_rows(rows, tiles, t, g, full);
        float* tile_sums = sums != nullptr ? sums + t * kPackBlock : nullptr;
        T* yt = y + t * N;
        with_rows<kPackRows>(r, [&](auto rows_constant) {
          constexpr int R = decltype(rows_constant)::value, V = tile_vecs(R);
          if (c0 % (V * kLanes) != 0) return;  // (a tile of whole-block passes covered the block at c0 = 0)
          Prefetch plan;
          plan.lead = first && c == 0 && pass == 0 && !as_floats;
          if (next != nullptr && pass * share < next_bytes) {
            plan.ahead = next + pass * share;
            plan.bytes = std::min(share, next_bytes - pass * share);
          }
          ++pass;
          const auto pass_on = [&](auto carried_constant) {
            constexpr bool C = decltype(carried_constant)::value;
            if constexpr (as_floats)
              pass_p1<R, V, C>(xf + t * ldx + g0 * P, ldx, wide, (g1 - g0) * P, yt, N, c0, valid, plan,
                               tile_sums);
            else if constexpr (std::is_same_v<T, bf16>)
              pass_bf16<R, V, C>(xf ? xf + t * groups * P + g0 * P * R : nullptr, x + t * ldx + g0 * P, ldx, wc,
                                 g1 - g0, yt, N, c0, valid, plan, tile_sums);
            else
              pass_p1<R, V, C>(xf + t * ldx + g0, ldx, wc, g1 - g0, yt, N, c0, valid, plan, tile_sums);
          };
          if (sums != nullptr)
            pass_on(std::true_type{});
          else
            pass_on(std::false_type{});
        });
        t += r;
      }
  }
  if (sums != nullptr)  // the block's outputs, from the sums of its last chunk
    for (int64_t r = 0; r < rows; ++r)
      for (int col = 0; col < valid; col += kLanes) {
        const Vec sum = load(sums + r * kPackBlock + col);
        if (valid - col >= kLanes)
          store(y + r * N + col, sum);
        else
          store_first(y + r * N + col, sum, valid - col);
      }
}

#if defined(TR_ENGINE_AMX)
// ---- bf16 on AMX's tiles (the amx tier) ------------------------------------------------------------------------
//
// tiles.h says what the tiles are: one tdpbf16ps adds a tile of x (M rows x 16 pairs of bf16) times a tile of
// weights (16 pairs x 16 outputs) into a tile of float sums (M rows x 16 outputs), 8192 multiply-adds at once. The
// packed layout is already what it reads: in a block, 16 groups of 32 outputs' pairs are two weight tiles (outputs
// 0-15 and 16-31, rows 128 bytes apart), so the weights stream from memory as they do for the vector passes. A pass
// covers a block for up to 32 rows of x: 4 tiles of sums (rows 0-15 and 16-31 by outputs 0-15 and 16-31), 2 of x, 2
// of weights, all 8 registers; more rows take more passes over the block, the later ones from L2. Each output is the
// same function of its own row of x and the weights in every pass (checked bit for bit by the row-independence
// tests), so the amx tier is row-independent as every tier is; it rounds differently from avx512bf16's vdpbf16ps, as
// tiers do. A decode step's single row goes through the tiles too (its bits must be a verify's), where the memory,
// not the tiles, bounds it.
namespace amx {

constexpr int64_t kStep = 16;  // groups (pairs of input columns) per tdpbf16ps: a weight tile's 16 rows
constexpr int kPassRows = 32;  // rows of x per pass: two tiles of x, four of sums
constexpr int64_t kTileStride = kPackBlock * 2 * sizeof(bf16);  // bytes from one group's pairs to the next's: 128

// The tiles' shapes for a pass of `rows` rows of x: sums 0-3, x 4-5, weights 6-7.
inline void configure(int rows) {
  const int top = std::min(rows, 16), bottom = rows - top;
  tiles::Config c;
  for (int tile : {0, 1, 4}) c.shape(tile, top);
  if (bottom > 0)
    for (int tile : {2, 3, 5}) c.shape(tile, bottom);
  c.shape(6, kStep);
  c.shape(7, kStep);
  c.load();
}

// One pass: sums ([32 rows][32 outputs] floats) of x's tiles (rows lda bf16 apart, 32 values per step) against a
// block's `steps` steps of weights, the last one from `tail` where the block's groups are not a whole number of steps
// (tail: that step's groups, zeros after; x is zero past K there too). Each step asks for `ahead_per_step` bytes of
// lines from `ahead` on (none where it is null): a block's first pass its own weights kDistance bytes ahead of the
// stream, running on into the next block. Where a block takes more passes (more than 32 rows), which read it from L2,
// each later one asks for a share of the next block's lines, so that the memory streams the whole time (as the vector
// passes' shares), but only from three passes on (65 rows and more: a prefill's chunks). A block's second pass asked
// for the whole next block: all a layer's projections at 33-64 rows cost 1.7-2.0 single rows' time at a 7B model's
// shapes against 1.35-1.6 without (its misses to memory held the fill buffers its own loads from L2 wait for), 1.75-1.9
// against 1.55-1.75 at SmolLM2's; at 96 and 192 rows the shares pay at SmolLM2's shapes (weights from L3 here) and
// cost at 7B's 96 rows (2.0 single rows without, 2.4 with), as fast at 192.
template <bool kBottom>
TR_ENGINE_PASS void pass(const bf16* x, int64_t lda, const bf16* wb, int64_t steps, const bf16* tail, float* sums,
                         const char* ahead, int64_t ahead_per_step) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kBottom) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t x_stride = lda * static_cast<int64_t>(sizeof(bf16));
  const char* w = reinterpret_cast<const char*>(wb);
  for (int64_t s = 0; s < steps; ++s, w += kStep * kTileStride) {
    const char* ws = tail != nullptr && s + 1 == steps ? reinterpret_cast<const char*>(tail) : w;
    if (ahead != nullptr)
      for (int64_t line = 0; line < ahead_per_step; line += 64, ahead += 64) prefetch(ahead);
    _tile_loadd(6, ws, kTileStride);
    _tile_loadd(7, ws + 64, kTileStride);
    _tile_loadd(4, x + s * 2 * kStep, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (kBottom) {
      _tile_loadd(5, x + 16 * lda + s * 2 * kStep, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t ld = kPackBlock * sizeof(float);
  _tile_stored(0, sums, ld);
  _tile_stored(1, sums + 16, ld);
  if constexpr (kBottom) {
    _tile_stored(2, sums + 16 * kPackBlock, ld);
    _tile_stored(3, sums + 16 * kPackBlock + 16, ld);
  }
}

// How far ahead a block's first pass asks for its weights (the lead of the vector passes, kPrefetch).
constexpr int64_t kDistance = 4096;

// One chunk of rows of x (xa, lda: as the tiles read it) through every block.
inline void chunk_rows(const bf16* xa, int64_t lda, const bf16* wp, bf16* y, int64_t rows, int64_t groups, int64_t N,
                       int64_t whole, int64_t steps) {
  const int64_t blocks = (N + kPackBlock - 1) / kPackBlock, block_size = groups * kPackBlock * 2;
  const int64_t block_bytes = block_size * static_cast<int64_t>(sizeof(bf16));
  const int64_t passes = (rows + kPassRows - 1) / kPassRows;
  parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) float sums[kPassRows * kPackBlock];
    alignas(64) bf16 tail[kStep * 2 * kPackBlock];
    int configured = 0;
    for (int64_t b = b0; b < b1; ++b) {
      const bf16* wb = wp + b * block_size;
      const int valid = static_cast<int>(std::min(kPackBlock, N - b * kPackBlock));
      if (whole != steps) {
        std::memset(tail, 0, sizeof(tail));
        std::memcpy(tail, wb + whole * kStep * 2 * kPackBlock, (groups - whole * kStep) * kTileStride);
      }
      for (int64_t t = 0; t < rows; t += kPassRows) {
        const int r = static_cast<int>(std::min<int64_t>(kPassRows, rows - t));
        if (r != configured) {
          configure(r);
          configured = r;
        }
        const bf16* xt = xa + t * lda;
        const bf16* tail_step = whole != steps ? tail : nullptr;
        const char* ahead = nullptr;
        int64_t per_step = 0;
        if (t == 0) {
          ahead = reinterpret_cast<const char*>(wb) + kDistance;
          per_step = kStep * kTileStride;
        } else if (b + 1 < b1 && passes > 2) {  // the next block's share after the first pass's lead
          const int64_t later = passes - 1, pass_index = t / kPassRows - 1;
          const int64_t share = (std::max<int64_t>(0, block_bytes - kDistance) / later + 63) / 64 * 64;
          ahead = reinterpret_cast<const char*>(wb) + block_bytes + kDistance + pass_index * share;
          per_step = (share / steps + 63) / 64 * 64;
        }
        if (r > 16)
          pass<true>(xt, lda, wb, steps, tail_step, sums, ahead, per_step);
        else
          pass<false>(xt, lda, wb, steps, tail_step, sums, ahead, per_step);
        for (int i = 0; i < r; ++i)
          for (int col = 0; col < valid; col += kLanes) {
            const Vec sum = load(sums + i * kPackBlock + col);
            bf16* out = y + (t + i) * N + b * kPackBlock + col;
            if (valid - col >= kLanes)
              store(out, sum);
            else
              store_first(out, sum, valid - col);
          }
      }
    }
    if (configured != 0) _tile_release();
  });
}

// packed_rows for bf16 on the tiles: threads split the blocks; each block's rows of x in passes of up to 32.
inline void rows(const bf16* x, int64_t ldx, const bf16* wp, bf16* y, int64_t rows, int64_t groups, int64_t N) {
  const int64_t whole = groups / kStep, steps = (groups + kStep - 1) / kStep;
  // x as the tiles read it: as it is where K fills whole steps, else its rows copied with zeros to the last step's end.
  const bf16* xa = x;
  int64_t lda = ldx;
  if (whole != steps) {
    thread_local std::vector<bf16> padded;
    lda = steps * 2 * kStep;
    padded.assign(rows * lda, bf16{});
    for (int64_t r = 0; r < rows; ++r) std::memcpy(padded.data() + r * lda, x + r * ldx, 2 * groups * sizeof(bf16));
    xa = padded.data();
  }
  // A long prefill's rows a chunk at a time, as the vector passes take them (kRowChunk: x's chunk stays in L2).
  for (int64_t t0 = 0; t0 < rows; t0 += kRowChunk) {
    const int64_t chunk = std::min(kRowChunk, rows - t0);
    chunk_rows(xa + t0 * lda, lda, wp, y + t0 * N, chunk, groups, N, whole, steps);
  }
}

}  // namespace amx
#endif

// Threads claim the blocks of w (claimed_for: each block is 32 x K contiguous values, read once per chunk of rows from
// memory); inside a block, the chunk's rows go in tiles of at most kPackRows (cut as kFullTiles says). A block that
// one pass covers (a decode step's row, a few rows of float32) streams straight from memory, its lines asked for ahead;
// any other goes through block_in_chunks (float32, and bf16 widened into floats, a K-chunk at a time; other half types
// a block).
template <typename T>
void packed_rows(const T* x, int64_t ldx, const T* wp, T* y, int64_t rows, int64_t groups, int64_t N) {
#if defined(TR_ENGINE_AMX)
  if constexpr (std::is_same_v<T, bf16>) return amx::rows(x, ldx, wp, y, rows, groups, N);
#endif
  const int64_t blocks = (N + kPackBlock - 1) / kPackBlock, block_size = groups * kPackBlock * pack_width<T>();
  constexpr bool bf16_pairs = std::is_same_v<T, bf16>;
  constexpr bool floats = !(bf16_pairs && kBf16Dot);  // whether the passes read x as floats
  for (int64_t t0 = 0; t0 < rows; t0 += kRowChunk) {
    const int64_t chunk = std::min(kRowChunk, rows - t0);
    // bf16 pairs without the dot product are widened in registers (pass_bf16) up to kWidenRows rows; more rows of
    // them read a chunk widened into floats once.
    const bool as_floats = widens<T>() && chunk > kWidenRows;
    const int64_t tiles = (chunk + kPackRows - 1) / kPackRows;
    // x as the passes read it: its rows as floats, or tile by tile for pairs widened in registers (nothing for the
    // dot product's pairs: x as it is).
    const float* xf = nullptr;
    if constexpr (widens<T>())
      xf = as_floats ? rows_as_float(x + t0 * ldx, ldx, chunk)
                     : tiles_as_float(x + t0 * ldx, ldx, chunk, tiles, 2 * groups);
    else if constexpr (floats)
      xf = rows_as_float(x + t0 * ldx, ldx, chunk);
    claimed_for(blocks, [&](int64_t b, bool first, int64_t next) {
      const int valid = static_cast<int>(std::min(kPackBlock, N - b * kPackBlock));
      const T* wb = wp + b * block_size;
      T* yb = y + t0 * N + b * kPackBlock;
      const T* next_block = next >= 0 ? wp + next * block_size : nullptr;
      if (as_floats) {
        block_in_chunks<widens<T>()>(xf, x + t0 * ldx, ldx, wb, groups, yb, N, chunk, tiles, valid, first,
                                     next_block);
        return;
      }
      if (block_passes(chunk, tiles, valid, kFullTiles && std::is_same_v<T, float>) > 1) {
        block_in_chunks<false>(xf, x + t0 * ldx, ldx, wb, groups, yb, N, chunk, tiles, valid, first, next_block);
        return;
      }
      Prefetch plan;
      plan.lead = true;  // (its stream runs on into the next block)
      with_rows<kPackRows>(static_cast<int>(chunk), [&](auto rows_constant) {
        constexpr int R = decltype(rows_constant)::value, V = tile_vecs(R);
        if constexpr (bf16_pairs)
          pass_bf16<R, V>(xf, x + t0 * ldx, ldx, wb, groups, yb, N, 0, valid, plan);
        else
          pass_p1<R, V>(xf, ldx, wb, groups, yb, N, 0, valid, plan);
      });
    });
  }
}

// ---- skinny_linear ---------------------------------------------------------------------------------------------

constexpr int kSkinnyRows = kRegisters >= 32 ? 4 : 2;  // rows of x per tile (x 4 weight rows of accumulators)
constexpr int kSkinnyCols = 4;                         // weight rows per tile

// n (< one vector's worth) elements at p, zeros after: K's tail.
template <typename T>
Vec load_tail(const T* p, int n) {
  T lanes[kLanes] = {};
  std::memcpy(lanes, p, sizeof(T) * n);
  return load(lanes);
}

// n (< two vectors' worth) bf16 values at p as words, zeros after.
inline Vec load_tail_words(const bf16* p, int n) {
  bf16 lanes[2 * kLanes] = {};
  std::memcpy(lanes, p, sizeof(bf16) * n);
  return load_words(lanes);
}

// y[i, j] for TR rows of x (floats, [TR, K]) by NR weight rows (w [NR, K] of type W), K in vector steps: lane l of
// an accumulator sums dims l, l + kLanes, ... in order, then reduce_add sums the lanes in its fixed order.
template <int TR, int NR, typename W, typename Y>
void skinny_tile(const float* x, const W* w, Y* y, int64_t K, int64_t N) {
  Vec acc[TR][NR];
  for (int i = 0; i < TR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = zero();
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    Vec wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load(w + j * K + k);
    for (int i = 0; i < TR; ++i) {
      const Vec xv = load(x + i * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = mul_add(xv, wv[j], acc[i][j]);
    }
  }
  if (k < K) {
    const int n = static_cast<int>(K - k);
    Vec wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load_tail(w + j * K + k, n);
    for (int i = 0; i < TR; ++i) {
      const Vec xv = load_first(x + i * K + k, n);
      for (int j = 0; j < NR; ++j) acc[i][j] = mul_add(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < TR; ++i)
    for (int j = 0; j < NR; ++j) y[i * N + j] = from_float<Y>(reduce_add(acc[i][j]));
}

// The bf16 tile with the dot product: lane l sums the pairs (2l, 2l + 1), (2l + 2 kLanes, ...) of x and w as bf16.
template <int TR, int NR>
void skinny_tile_pairs(const bf16* x, const bf16* w, bf16* y, int64_t K, int64_t N) {
  Vec acc[TR][NR];
  for (int i = 0; i < TR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = zero();
  for (int64_t k = 0; k < K; k += 2 * kLanes) {
    const int n = static_cast<int>(std::min<int64_t>(2 * kLanes, K - k));  // bf16 values in this step
    Vec wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = n == 2 * kLanes ? load_words(w + j * K + k) : load_tail_words(w + j * K + k, n);
    for (int i = 0; i < TR; ++i) {
      const Vec xv = n == 2 * kLanes ? load_words(x + i * K + k) : load_tail_words(x + i * K + k, n);
      for (int j = 0; j < NR; ++j) acc[i][j] = dot_pairs(acc[i][j], xv, wv[j]);
    }
  }
  for (int i = 0; i < TR; ++i)
    for (int j = 0; j < NR; ++j) y[i * N + j] = from_float<bf16>(reduce_add(acc[i][j]));
}

template <typename T>
void skinny(const T* x, const T* w, T* y, int64_t rows, int64_t K, int64_t N) {
  constexpr bool pairs = std::is_same_v<T, bf16> && kBf16Dot;
  const float* xf = pairs ? nullptr : rows_as_float(x, K, rows);
  const int64_t tiles = (N + kSkinnyCols - 1) / kSkinnyCols;
  parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = b * kSkinnyCols;
      const int nr = static_cast<int>(std::min<int64_t>(kSkinnyCols, N - n));
      for (int64_t t = 0; t < rows; t += kSkinnyRows) {
        const int tr = static_cast<int>(std::min<int64_t>(kSkinnyRows, rows - t));
        with_rows<kSkinnyRows>(tr, [&](auto rows_constant) {
          constexpr int TR = decltype(rows_constant)::value;
          for (int j = 0; j < nr;) {  // a whole tile of weight rows, or the last ones one at a time
            const bool whole = nr == kSkinnyCols;
            if constexpr (pairs) {
              if (whole) skinny_tile_pairs<TR, kSkinnyCols>(x + t * K, w + n * K, y + t * N + n, K, N);
              else skinny_tile_pairs<TR, 1>(x + t * K, w + (n + j) * K, y + t * N + n + j, K, N);
            } else {
              if (whole) skinny_tile<TR, kSkinnyCols>(xf + t * K, w + n * K, y + t * N + n, K, N);
              else skinny_tile<TR, 1>(xf + t * K, w + (n + j) * K, y + t * N + n + j, K, N);
            }
            j += whole ? kSkinnyCols : 1;
          }
        });
      }
    }
  });
}

}  // namespace tr_engine_cpu
