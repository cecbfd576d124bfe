// The op library's thread pool as the kernels call it: parallel_for(begin, end, grain, f) runs f(b, e) on disjoint
// chunks of [begin, end), through the Host a tier library is bound to when the op library loads it (api.h). On a
// chunk smaller than grain, or inside another parallel region, it runs f(begin, end) on the calling thread, as
// at::parallel_for does.
#pragma once

#include "api.h"

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

}  // namespace tr_engine_cpu
