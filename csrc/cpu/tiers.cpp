// Loading a CPU kernel tier. The kernels are compiled once per instruction-set tier into libraries of their own
// (tr_engine/_cpu_<tier>.so, csrc/cpu/kernels/tier.cpp); this file tells what the CPU supports (cpu_features) and
// makes one tier's library the active one (use_cpu_tier), after checking that the CPU has every feature the tier
// needs: a library built for AVX-512 is never even opened on a CPU without it. tr_engine/model/cpu.py holds the list of
// tiers and chooses; every CPU op then calls the active tier through kernels(). Libraries stay loaded once opened,
// so a kernel that is running while another thread switches tiers finishes in its own.
#include "tiers.h"

#include <ATen/Parallel.h>

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>

namespace tr_engine_cpu {
namespace {

// The tiers' thread pool: ATen's, so a kernel's threads are the ones torch.set_num_threads sets.
void host_parallel_for(int64_t begin, int64_t end, int64_t grain, ParallelBody body, void* ctx) {
  at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) { body(ctx, b, e); });
}
const Host kHost{&host_parallel_for};

std::atomic<const Kernels*> active{nullptr};

}  // namespace

const Kernels& kernels() {
  const Kernels* k = active.load(std::memory_order_acquire);
  TORCH_CHECK(k != nullptr, "tr_engine: no CPU kernel tier is loaded; import tr_engine.model.ops (it loads the best one "
              "for this CPU, or the one TR_ENGINE_CPU names)");
  return *k;
}

// The instruction-set features the tiers may need that this CPU and its operating system support (the compiler's
// runtime reads CPUID, and XGETBV for the OS's vector state), by the names tr_engine/model/cpu.py uses.
std::vector<std::string> cpu_features() {
  std::vector<std::string> found;
#if defined(__x86_64__)
  __builtin_cpu_init();
#define TR_ENGINE_FEATURE(name) \
  if (__builtin_cpu_supports(name)) found.emplace_back(name);
  TR_ENGINE_FEATURE("avx2")
  TR_ENGINE_FEATURE("fma")
  TR_ENGINE_FEATURE("f16c")
  TR_ENGINE_FEATURE("avx512f")
  TR_ENGINE_FEATURE("avx512bw")
  TR_ENGINE_FEATURE("avx512vl")
  TR_ENGINE_FEATURE("avx512dq")
  TR_ENGINE_FEATURE("avx512bf16")
#undef TR_ENGINE_FEATURE
#elif defined(__aarch64__)
  found.emplace_back("neon");  // Advanced SIMD is part of every aarch64 CPU
#endif
  return found;
}

void use_cpu_tier(const std::string& name, const std::string& path, const std::vector<std::string>& needs) {
  const auto have = cpu_features();
  for (const auto& need : needs)
    TORCH_CHECK(std::find(have.begin(), have.end(), need) != have.end(), "tr_engine: the CPU kernel tier ", name,
                " needs ", need, ", which this CPU does not have");
  static std::mutex mutex;
  static std::map<std::string, const Kernels*> opened;  // by path
  const std::lock_guard<std::mutex> lock(mutex);
  const Kernels*& table = opened[path];
  if (table == nullptr) {
    void* library = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    TORCH_CHECK(library != nullptr, "tr_engine: cannot load the CPU kernel tier ", name, ": ", dlerror());
    auto entry = reinterpret_cast<KernelsEntry>(dlsym(library, kKernelsEntry));
    TORCH_CHECK(entry != nullptr, "tr_engine: ", path, " is not a CPU kernel tier (no ", kKernelsEntry, ")");
    const Kernels* k = entry(&kHost);
    TORCH_CHECK(k->abi == kAbiVersion, "tr_engine: ", path, " was built for kernel table version ", k->abi, ", not ",
                kAbiVersion, "; rebuild with `make install`");
    table = k;
  }
  TORCH_CHECK(name == table->tier, "tr_engine: ", path, " holds the tier ", table->tier, ", not ", name);
  active.store(table, std::memory_order_release);
}

// The active tier's multiply-add rate in GFLOPS: `units` units of its peak loop (kernels/peak.h) over the thread pool,
// timed.
double multiply_add_peak(int64_t units) {
  TORCH_CHECK(units > 0, "multiply_add_peak: units must be positive, got ", units);
  const Kernels& k = kernels();
  const auto start = std::chrono::steady_clock::now();
  const double flops = k.multiply_adds(units);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return flops / seconds / 1e9;
}

std::string cpu_tier() {
  const Kernels* k = active.load(std::memory_order_acquire);
  return k == nullptr ? "" : k->tier;
}

}  // namespace tr_engine_cpu
