// One tier library, tr_engine/_cpu_<tier>.so: every CPU kernel compiled with one tier's flags (tr_engine/model/cpu.py
// lists them; setup.py passes them with -DTR_ENGINE_TIER_<TIER>), exporting one table (api.h). Built with hidden
// visibility, so that each tier's copies of inline and template code stay inside its own library: the op library
// loads the tier it chooses with dlopen, and code compiled for AVX-512 can never be called on a CPU without it.
#include "api.h"
#include "attention.h"
#include "layers.h"
#include "linear.h"
#include "parallel.h"
#include "peak.h"
#include "rows.h"
#include "simd.h"
#include "tiles.h"

namespace tr_engine_cpu {
namespace {

template <typename T>
constexpr TypedKernels<T> typed_kernels() {
  TypedKernels<T> k{};
  if constexpr (!std::is_same_v<T, double>) {
    k.packed_rows = &packed_rows<T>;
    k.skinny = &skinny<T>;
    k.layers = &layers<T>;
  }
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) k.argmax_rows = &argmax_rows<T>;
  k.attention = &attention<T>;
  k.top_k_rows = &top_k_rows<T>;
  return k;
}

const Kernels kTable{kAbiVersion, kTier, typed_kernels<float>(), typed_kernels<double>(), typed_kernels<bf16>(),
                     typed_kernels<f16>(), &multiply_adds<false>, &multiply_adds<true>};

}  // namespace
}  // namespace tr_engine_cpu

extern "C" __attribute__((visibility("default"))) const tr_engine_cpu::Kernels* tr_engine_cpu_kernels(
    const tr_engine_cpu::Host* host) {
  tr_engine_cpu::bound_host() = host;
#if defined(TR_ENGINE_AMX)
  if (!tr_engine_cpu::tiles::request()) return nullptr;  // (the op library checked first: a host that did not)
#endif
  return &tr_engine_cpu::kTable;
}
