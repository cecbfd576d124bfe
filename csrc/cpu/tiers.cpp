// Loading a CPU kernel tier. The kernels are compiled once per instruction-set tier into libraries of their own
// (tr_engine/_cpu_<tier>.so, csrc/cpu/kernels/tier.cpp); this file tells what the CPU supports (cpu_features) and
// makes one tier's library the active one (use_cpu_tier), after checking that the CPU has every feature the tier
// needs: a library built for AVX-512 is never even opened on a CPU without it. tr_engine/model/cpu.py holds the list of
// tiers and chooses; every CPU op then calls the active tier through kernels(). Libraries stay loaded once opened,
// so a kernel that is running while another thread switches tiers finishes in its own.
#include "tiers.h"

#include <ATen/Parallel.h>

#include <dlfcn.h>
#if defined(__x86_64__)
#include <cpuid.h>

#include "kernels/tiles.h"
#endif

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
// The threads a parallel_for called here would run on: 1 inside another's region (which runs it serially).
int host_threads() { return at::in_parallel_region() ? 1 : at::get_num_threads(); }
const Host kHost{&host_parallel_for, &host_threads};

std::atomic<const Kernels*> active{nullptr};

#if defined(__x86_64__)
// Whether AMX's tiles with bf16 can run in this process: the CPU has them (CPUID leaf 7: AMX-TILE, AMX-BF16), the OS
// saves their state (XCR0's XTILECFG and XTILEDATA bits), and Linux lets this process use them: it asks once (the
// state is 8 KB a thread, so Linux hands it out only on request, ARCH_REQ_XCOMP_PERM; since Linux 5.16), and keeps
// the answer. Without the permission the first tile instruction would kill the process.
bool amx_usable() {
  static const bool usable = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool tile = (edx >> 24) & 1, bf16 = (edx >> 22) & 1;
    if (!tile || !bf16) return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) return false;  // OSXSAVE: XGETBV is allowed
    uint32_t lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if (((lo >> 17) & 3) != 3) return false;  // XTILECFG and XTILEDATA
    return tiles::request();
  }();
  return usable;
}
#endif

}  // namespace

const Kernels& kernels() {
  const Kernels* k = active.load(std::memory_order_acquire);
  TORCH_CHECK(k != nullptr, "tr_engine: no CPU kernel tier is loaded; import tr_engine.model.ops (it loads the best one "
              "for this CPU, or the one TR_ENGINE_CPU names)");
  return *k;
}

// The instruction-set features the tiers may need that this CPU and its operating system support (the compiler's
// runtime reads CPUID, and XGETBV for the OS's vector state; AMX by amx_usable), by the names tr_engine/model/cpu.py
// uses.
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
  if (amx_usable()) {
    found.emplace_back("amx_tile");
    found.emplace_back("amx_bf16");
  }
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
    TORCH_CHECK(k != nullptr, "tr_engine: the CPU kernel tier ", name, " cannot run in this process (Linux refused it "
                "the AMX tiles); choose another with TR_ENGINE_CPU");
    TORCH_CHECK(k->abi == kAbiVersion, "tr_engine: ", path, " was built for kernel table version ", k->abi, ", not ",
                kAbiVersion, "; rebuild with `make install`");
    table = k;
  }
  TORCH_CHECK(name == table->tier, "tr_engine: ", path, " holds the tier ", table->tier, ", not ", name);
  active.store(table, std::memory_order_release);
}

// The active tier's multiply-add rate in GFLOPS: `units` units of its peak loop (kernels/peak.h) over the thread pool,
// timed; with `bf16`, the loop of its bf16 arithmetic (the pair dot product's where it has the instruction).
double multiply_add_peak(int64_t units, bool bf16) {
  TORCH_CHECK(units > 0, "multiply_add_peak: units must be positive, got ", units);
  const Kernels& k = kernels();
  const auto start = std::chrono::steady_clock::now();
  const double flops = bf16 ? k.bf16_multiply_adds(units) : k.multiply_adds(units);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return flops / seconds / 1e9;
}

std::string cpu_tier() {
  const Kernels* k = active.load(std::memory_order_acquire);
  return k == nullptr ? "" : k->tier;
}

}  // namespace tr_engine_cpu
