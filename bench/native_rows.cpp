// One forward's projections through a CPU tier library's packed_rows, straight from C++ (bench/native_rows.py builds
// and runs it): each projection its own packed weight, back to back as a step runs them, with no torch dispatch
// between them, so what a few rows cost against one is the kernel's alone (through torch, ~1 ms of per-call overhead
// in a SmolLM2 step hid it). The library is opened as tests/kernel_harness.cpp opens it, lent a pool of spinning
// threads (a parallel_for splits its range evenly, as at::parallel_for does).
//
//   native_rows LIBRARY DTYPE REPS THREADS ROWS...   (DTYPE: bfloat16, float32 or float16; the shapes "N K" on stdin)
//
// Prints one line per row count: "rows <r> median_ms <m> min_ms <m>", the row counts timed in alternation.
#include "../csrc/cpu/kernels/api.h"
#include "../csrc/cpu/kernels/numbers.h"
#include "../csrc/cpu/kernels/packing.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

using namespace tr_engine_cpu;

namespace {

// The pool: workers spin on a generation counter, take their share of the range, and count themselves done.
struct Pool {
  int threads = 1;
  std::atomic<int> generation{0}, done{0};
  ParallelBody body = nullptr;
  void* ctx = nullptr;
  int64_t begin = 0, end = 0;
};
Pool pool;

void share(int i, int64_t begin, int64_t end, int n) {
  const int64_t size = end - begin;
  const int64_t lo = begin + size * i / n, hi = begin + size * (i + 1) / n;
  if (lo < hi) pool.body(pool.ctx, lo, hi);
}

void worker(int i) {
  int seen = 0;
  for (;;) {
    int now;
    while ((now = pool.generation.load(std::memory_order_acquire)) == seen) {
    }
    seen = now;
    share(i, pool.begin, pool.end, pool.threads);
    pool.done.fetch_add(1, std::memory_order_acq_rel);
  }
}

void parallel_for(int64_t begin, int64_t end, int64_t grain, ParallelBody body, void* ctx) {
  if (pool.threads == 1 || end - begin < 2 * std::max<int64_t>(grain, 1)) return body(ctx, begin, end);
  pool.body = body;
  pool.ctx = ctx;
  pool.begin = begin;
  pool.end = end;
  pool.done.store(0, std::memory_order_relaxed);
  pool.generation.fetch_add(1, std::memory_order_acq_rel);
  share(0, begin, end, pool.threads);
  while (pool.done.load(std::memory_order_acquire) != pool.threads - 1) {
  }
}

int threads() { return pool.threads; }
const Host kHost{&parallel_for, &threads};

template <typename T>
void run(const TypedKernels<T>& ops, int64_t P, int reps, const std::vector<int>& rows,
         const std::vector<std::pair<int64_t, int64_t>>& shapes) {
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> small(-0.05f, 0.05f), unit(-1.f, 1.f);
  std::vector<std::vector<T>> packed;
  int64_t widest = 0, most = 0;
  for (const auto& [N, K] : shapes) {
    std::vector<T> w(N * K);
    for (auto& e : w) e = from_float<T>(small(rng));
    packed.push_back(pack_weights(w, N, K, P));
    widest = std::max(widest, (K + P - 1) / P * P);
    most = std::max(most, N);
  }
  const int top = *std::max_element(rows.begin(), rows.end());
  std::vector<T> x(top * widest), y(top * most);
  for (auto& e : x) e = from_float<T>(unit(rng));
  std::vector<std::vector<double>> ms(rows.size());
  for (int rep = -1; rep < reps; ++rep)  // (a first pass untimed: pages touched, the pool awake)
    for (size_t i = 0; i < rows.size(); ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      for (size_t s = 0; s < shapes.size(); ++s) {
        const int64_t groups = (shapes[s].second + P - 1) / P;
        ops.packed_rows(x.data(), groups * P, packed[s].data(), y.data(), rows[i], groups, shapes[s].first);
      }
      const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (rep >= 0) ms[i].push_back(t);
    }
  for (size_t i = 0; i < rows.size(); ++i) {
    std::sort(ms[i].begin(), ms[i].end());
    std::printf("rows %d median_ms %.4f min_ms %.4f\n", rows[i], ms[i][ms[i].size() / 2], ms[i][0]);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: native_rows LIBRARY DTYPE REPS THREADS ROWS... (shapes \"N K\" on stdin)\n");
    return 2;
  }
  void* library = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    std::fprintf(stderr, "cannot open %s: %s\n", argv[1], dlerror());
    return 1;
  }
  auto entry = reinterpret_cast<KernelsEntry>(dlsym(library, kKernelsEntry));
  const Kernels* table = entry != nullptr ? entry(&kHost) : nullptr;
  if (table == nullptr) {
    std::fprintf(stderr, "%s has no kernel table this build can use\n", argv[1]);
    return 1;
  }
  const std::string dtype = argv[2];
  const int reps = std::max(1, std::atoi(argv[3]));
  pool.threads = std::max(1, std::atoi(argv[4]));
  std::vector<int> rows;
  for (int i = 5; i < argc; ++i) rows.push_back(std::max(1, std::atoi(argv[i])));
  std::vector<std::pair<int64_t, int64_t>> shapes;
  int64_t n, k;
  while (std::cin >> n >> k) shapes.emplace_back(n, k);
  for (int i = 1; i < pool.threads; ++i) std::thread(worker, i).detach();
  if (dtype == "bfloat16")
    run(table->bfloat16, 2, reps, rows, shapes);
  else if (dtype == "float16")
    run(table->float16, 1, reps, rows, shapes);
  else
    run(table->float32, 1, reps, rows, shapes);
  std::fflush(stdout);
  std::_Exit(0);  // (the spinning workers are not joined)
}
