// The tier's multiply-add peak: what its Vec multiply-adds reach on every thread of the pool at once, with nothing to
// wait for (no memory, no dependences but each chain's own). bench/ sets the kernels' arithmetic against it: a verify
// of T tokens does 2 T multiply-adds per weight, and past a few rows (one AVX2 core: ~96 GFLOPS against ~15 GB/s of
// float32 weights) that, not the memory, sets its time. The compute floor of a step is its FLOPs over this rate, as
// the memory floor is its bytes over the read bandwidth.
#pragma once

#include "parallel.h"
#include "simd.h"

#include <cstdint>

namespace tr_engine_cpu {

// Independent accumulators per thread: enough to cover a multiply-add's latency on both units (4 cycles x 2 on the
// x86 cores measured: avx2 ~96-100 GFLOPS a Zen 3 core, as raw intrinsics; a NEON core with four units would want
// 16, not measured), few enough for AVX2's 16 registers with the two operands.
constexpr int kPeakChains = 12;
constexpr int64_t kPeakSteps = 1 << 16;  // multiply-adds per chain in one unit of work

// `units` units of work split over the pool's threads; returns the floating-point operations done. With `kPairs`
// the chains are the bf16 pair dot product's (dot_pairs: two products and two sums per lane, 4 FLOPs) where the tier
// has the instruction (kBf16Dot), which does twice the float multiply-add's work in one instruction: that is the
// peak its bf16 matmuls run against (a Zen 4 core: ~230 GFLOPS against ~115). Elsewhere bf16 is widened to floats,
// so its peak is the multiply-add's, and the chains are those (2 FLOPs per lane). The sums go to a sink the compiler
// cannot drop.
template <bool kPairs>
double multiply_adds(int64_t units) {
  static volatile float sink = 0.f;
  constexpr bool dot = kPairs && kBf16Dot;
  parallel_for(0, units, 1, [](int64_t begin, int64_t end) {
    // (For the pairs, each word two bf16 values: 1 and 1 times ~1e-7 and ~1e-7, no NaN or denormal among them.)
    const Vec a = broadcast(dot ? bits_to_float(0x3F803F80u) : 0.999999f),
              b = broadcast(dot ? bits_to_float(0x33D633D6u) : 1e-7f);
    Vec acc[kPeakChains];
    for (int c = 0; c < kPeakChains; ++c) acc[c] = broadcast(static_cast<float>(c));
    for (int64_t u = begin; u < end; ++u)
      for (int64_t s = 0; s < kPeakSteps; ++s)
        for (int c = 0; c < kPeakChains; ++c) acc[c] = dot ? dot_pairs(acc[c], a, b) : mul_add(acc[c], a, b);
    float total = 0.f;
    for (int c = 0; c < kPeakChains; ++c) total += reduce_add(acc[c]);
    sink = sink + total;
  });
  return (dot ? 4.0 : 2.0) * kLanes * kPeakChains * static_cast<double>(kPeakSteps) * static_cast<double>(units);
}

}  // namespace tr_engine_cpu
