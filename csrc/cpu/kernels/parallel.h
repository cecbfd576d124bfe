// The op library's thread pool as the kernels call it: parallel_for(begin, end, grain, f) runs f(b, e) on disjoint
// chunks of [begin, end), through the Host a tier library is bound to when the op library loads it (api.h). On a
// chunk smaller than grain, or inside another parallel region, it runs f(begin, end) on the calling thread, as
// at::parallel_for does. claimed_for(n, f) shares n units the same way, the threads claiming them as they go.
#pragma once

#include "api.h"

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace tr_engine_cpu {

// The host bound by tr_engine_cpu_kernels (tier.cpp); serial until then.
inline const Host*& bound_host() {
  static const Host* host = nullptr;
  return host;
}

// The threads a parallel_for called here would run on (1 until a host is bound, or inside another's region).
inline int64_t pool_threads() {
  const Host* host = bound_host();
  return host == nullptr ? 1 : host->threads();
}

template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  const Host* host = bound_host();
  if (host == nullptr) {
    f(begin, end);
    return;
  }
  ParallelBody body = [](void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); };
  host->parallel_for(begin, end, grain, body, const_cast<void*>(static_cast<const void*>(&f)));
}

// f(b, first, next) for each b in [0, n) once, over the pool's threads, which claim the b's as they go: each thread
// takes its own share (the run of a static split) from the front, and once that is done, what is left of the fullest
// other share from its back. `first`: whether b is the first the thread takes of a run (its lines were asked for by
// nothing before); `next`: the b the thread likely takes after this one (-1: none), whose lines it may ask for ahead.
// Under a static split a thread that runs slower (its memory's share of the moment, a late start, the other running
// its caller's own work) holds the other at the region's end; claiming, the faster one takes the slower one's last
// b's. packed_rows' blocks, SmolLM2 on a 2-core Zen 4 (avx512bf16): with the static split the calling thread spent 8%
// of a bf16 hybrid generation waiting in the pool's barriers, 4% once they claim (perf); bench.ab against the split:
// hybrid 1.034x in bf16 (fp32 1.001x), batch 4 1.029x, plain decoding 1.001x (a row streams the weights at the
// memory's pace on either thread). Where b runs changes no bit of it. (The amx tier's tiles keep the static split.)
template <typename F>
void claimed_for(int64_t n, const F& f) {
  constexpr int64_t kMaxShares = 64;
  const int64_t p = std::min<int64_t>(pool_threads(), n);
  // (Serial; or a static split for a pool wider than the shares kept here, or more units than 32 bits count.)
  if (p <= 1 || p > kMaxShares || n > int64_t{0xffffffff}) {
    parallel_for(0, n, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) f(b, b == b0, b + 1 < b1 ? b + 1 : -1);
    });
    return;
  }
  // A share's run left to take, [front, back): front in the low 32 bits, back in the high, changed together.
  struct alignas(64) Share {
    std::atomic<uint64_t> left;
  };
  const auto front_of = [](uint64_t v) { return static_cast<int64_t>(v & 0xffffffffu); };
  const auto back_of = [](uint64_t v) { return static_cast<int64_t>(v >> 32); };
  Share shares[kMaxShares];
  for (int64_t i = 0; i < p; ++i)
    shares[i].left.store(static_cast<uint64_t>(n * i / p) | static_cast<uint64_t>(n * (i + 1) / p) << 32,
                         std::memory_order_relaxed);
  // (Relaxed: a claim only has to be taken once; the pool's join orders every b's writes before the caller reads.)
  parallel_for(0, p, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {  // its own share(s), from the front
      std::atomic<uint64_t>& own = shares[i].left;
      bool first = true;
      for (uint64_t v = own.load(std::memory_order_relaxed); front_of(v) < back_of(v);) {
        if (!own.compare_exchange_weak(v, v + 1, std::memory_order_relaxed)) continue;  // (v reloaded)
        const int64_t b = front_of(v);
        f(b, first, b + 1 < back_of(v) ? b + 1 : -1);
        first = false;
        v = own.load(std::memory_order_relaxed);
      }
    }
    while (true) {  // then the fullest share's last b, until none is left
      int64_t fullest = -1, most = 0;
      for (int64_t j = 0; j < p; ++j) {
        const uint64_t v = shares[j].left.load(std::memory_order_relaxed);
        if (back_of(v) - front_of(v) > most) most = back_of(v) - front_of(v), fullest = j;
      }
      if (fullest < 0) return;
      std::atomic<uint64_t>& other = shares[fullest].left;
      uint64_t v = other.load(std::memory_order_relaxed);
      const uint64_t taken = v - (uint64_t{1} << 32);
      if (front_of(v) < back_of(v) && other.compare_exchange_strong(v, taken, std::memory_order_relaxed))
        f(back_of(v) - 1, true, -1);
    }
  });
}

}  // namespace tr_engine_cpu
