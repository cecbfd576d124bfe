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

// `units` units of work split over the pool's threads; returns the floating-point operations done (2 per lane of
// each multiply-add). The chains' sums go to a sink the compiler cannot drop.
inline double multiply_adds(int64_t units) {
  static volatile float sink = 0.f;
  parallel_for(0, units, 1, [](int64_t begin, int64_t end) {
    const Vec a = broadcast(0.999999f), b = broadcast(1e-7f);
    Vec acc[kPeakChains];
    for (int c = 0; c < kPeakChains; ++c) acc[c] = broadcast(static_cast<float>(c));
    for (int64_t u = begin; u < end; ++u)
      for (int64_t s = 0; s < kPeakSteps; ++s)
        for (int c = 0; c < kPeakChains; ++c) acc[c] = mul_add(acc[c], a, b);
    float total = 0.f;
    for (int c = 0; c < kPeakChains; ++c) total += reduce_add(acc[c]);
    sink = sink + total;
  });
  return 2.0 * kLanes * kPeakChains * static_cast<double>(kPeakSteps) * static_cast<double>(units);
}

}  // namespace tr_engine_cpu
