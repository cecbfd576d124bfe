// A test of one CPU kernel tier library without torch: `kernel_harness LIBRARY` opens a tr_engine/_cpu_<tier>.so (or
// one cross-compiled for another architecture and run under qemu-user) and holds its kernels to the contracts the
// Python tests hold the ops to: results within rounding of a float64 truth, and row independence bit for bit (a row
// computed alone equals the same row in a call of many, and a tree row equals its decode step). Prints one line per
// check and exits non-zero if any fails. tests/test_cpu_tiers.py builds and runs it.
#include "../csrc/cpu/kernels/api.h"
#include "../csrc/cpu/kernels/numbers.h"
#include "../csrc/cpu/kernels/packing.h"
#include "../csrc/cpu/kernels/parallel.h"

#include <dlfcn.h>
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

using namespace tr_engine_cpu;

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", what.c_str());
  failures += !ok;
}

// The host's thread pool, as the op library lends it: two threads over halves of the range (when it is worth it).
void two_threads(int64_t begin, int64_t end, int64_t grain, ParallelBody body, void* ctx) {
  if (end - begin < 2 * std::max<int64_t>(grain, 1)) return body(ctx, begin, end);
  const int64_t mid = begin + (end - begin) / 2;
  std::thread other([&] { body(ctx, mid, end); });
  body(ctx, begin, mid);
  other.join();
}
const Host kHost{&two_threads, [] { return 2; }};

std::mt19937 rng(1234);
float uniform() { return std::uniform_real_distribution<float>(-1.f, 1.f)(rng); }

template <typename T>
std::vector<T> random(int64_t n, float scale = 1.f) {
  std::vector<T> v(n);
  for (auto& e : v) e = from_float<T>(uniform() * scale);
  return v;
}

template <typename T>
bool same_bits(const T* a, const T* b, int64_t n) { return std::memcmp(a, b, n * sizeof(T)) == 0; }

template <typename T>
double as_double(T v) { return static_cast<double>(to_float(v)); }

// ---- conversions ------------------------------------------------------------------------------------------------

void conversions() {
  bool round_trip = true, ties_to_even = true;
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const f16 v{static_cast<uint16_t>(h)};
    const float f = to_float(v);
    if (f != f) continue;  // NaN
    round_trip &= from_float<f16>(f).bits == h;
    // Halfway to the next half up (towards larger magnitude): rounds to whichever of the two is even.
    const uint16_t next = static_cast<uint16_t>(h + 1);
    if ((h & 0x7C00u) == 0x7C00u || (next & 0x7C00u) == 0x7C00u) continue;  // infinities
    const double mid = (as_double(v) + as_double(f16{next})) / 2;
    const uint16_t even = (h & 1u) ? next : static_cast<uint16_t>(h);
    ties_to_even &= from_float<f16>(static_cast<float>(mid)).bits == even;
  }
  check(round_trip, "f16 -> float -> f16 is the identity on all 63,488 non-NaN halves");
  check(ties_to_even, "float -> f16 rounds halfway cases to even");
  check(from_float<f16>(1e6f).bits == 0x7C00u && from_float<f16>(-1e6f).bits == 0xFC00u, "f16 overflow is infinity");
  check(to_float(from_float<bf16>(1.00390625f)) == 1.0f && to_float(from_float<bf16>(1.01171875f)) == 1.015625f,
        "float -> bf16 rounds halfway cases to even");
  float worst = 0;
  for (float x = -126.f; x <= 0.f; x += 0.001f)
    worst = std::max(worst, static_cast<float>(std::fabs(exp2_clamped(x) / std::exp2(double(x)) - 1)));
  check(worst < 5e-7f, "exp2 within 4 ulp on [-126, 0]");
}

// ---- matmuls ----------------------------------------------------------------------------------------------------

template <typename T>
void matmuls(const Kernels& table, const char* name) {
  const TypedKernels<T>& ops = typed<T>(table);
  const int64_t P = std::is_same_v<T, bf16> ? 2 : 1;
  const double tol = std::is_same_v<T, float> ? 1e-5 : 2e-2;
  for (auto [N, K] : {std::pair<int64_t, int64_t>{96, 576}, {33, 130}, {7, 6}}) {
    const int64_t rows = 20, groups = (K + P - 1) / P;
    const auto w = random<T>(N * K), x = random<T>(rows * K);
    const auto wp = pack_weights(w, N, K, P);
    std::vector<T> y(rows * N), one(N);
    ops.packed_rows(x.data(), K, wp.data(), y.data(), rows, groups, N);
    double err = 0;
    bool independent = true;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t n = 0; n < N; ++n) {
        double truth = 0;
        for (int64_t k = 0; k < K; ++k) truth += as_double(x[r * K + k]) * as_double(w[n * K + k]);
        err = std::max(err, std::fabs(as_double(y[r * N + n]) - truth) / (1 + std::fabs(truth)));
      }
      ops.packed_rows(x.data() + r * K, K, wp.data(), one.data(), 1, groups, N);
      independent &= same_bits(one.data(), y.data() + r * N, N);
    }
    const std::string shape = std::string(name) + " " + std::to_string(N) + "x" + std::to_string(K);
    check(err < tol, "packed_rows " + shape + " within rounding of float64 (" + std::to_string(err) + ")");
    check(independent, "packed_rows " + shape + ": a row alone is bit for bit the row among 20");
    std::vector<T> ys(16 * N), ys1(N);
    ops.skinny(x.data(), w.data(), ys.data(), 16, K, N);
    bool skinny_ok = true;
    for (int64_t r = 0; r < 16; ++r) {
      ops.skinny(x.data() + r * K, w.data(), ys1.data(), 1, K, N);
      skinny_ok &= same_bits(ys1.data(), ys.data() + r * N, N);
      for (int64_t n = 0; n < N; ++n) skinny_ok &= std::fabs(as_double(ys[r * N + n]) - as_double(y[r * N + n])) <
                                                    4 * tol * (1 + std::fabs(as_double(y[r * N + n])));
    }
    check(skinny_ok, "skinny " + shape + " agrees with packed_rows; a row alone is the row among 16");
  }
}

// ---- attention --------------------------------------------------------------------------------------------------

// Hq query heads over Hkv KV heads: a decode step's rows are a task of G = Hq / Hkv rows, a verify's tasks hold 6.
template <typename T>
void attention(const Kernels& table, const char* name, int64_t Hq, int64_t Hkv) {
  // A chain from 760 cached keys across the 768th key, where a row's keys go from 3 softmax blocks of 256 to 4 and
  // their halves from 256 + the rest to 512 + the rest (attention.h, split_point), and a head dim of 40 (vector columns
  // and single ones). With 3 KV heads on the harness's 2 threads, a decode step's heads go as two tasks each.
  const int64_t D = 40, S = 800, P = 760, Tn = 24, G = Hq / Hkv;
  const auto kv = random<T>(2 * Hkv * S * D), q = random<T>(Tn * Hq * D);
  const T* k = kv.data();
  const T* v = kv.data() + Hkv * S * D;
  // A chain: token t sees the prefix and tokens 0..t, the keys a decode step at position P + t sees.
  std::vector<char> chain(Tn * Tn);
  for (int64_t t = 0; t < Tn; ++t)
    for (int64_t i = 0; i < Tn; ++i) chain[t * Tn + i] = i <= t;
  std::vector<T> out(Tn * Hq * D), step(Hq * D);
  auto attend = [&](const T* qs, int64_t rows, int64_t prefix, const char* mask, T* o) {
    const int64_t slot = 0, offsets[2] = {0, rows};
    const Attention<T> a{qs, Hq * D, D, Hq, D, CacheView<T>{k, v, Hkv, 0, S * D, D}, &slot, &prefix, offsets, 1,
                         reinterpret_cast<const bool*>(mask), 0.3, o};
    typed<T>(table).attention(a);
  };
  attend(q.data(), Tn, P, chain.data(), out.data());
  double err = 0;
  bool independent = true;
  const char one = 1;
  for (int64_t t = 0; t < Tn; ++t) {
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t n = P + t + 1;  // keys seen
      std::vector<double> s(n);
      double m = -1e300, l = 0;
      for (int64_t j = 0; j < n; ++j) {
        double dot = 0;
        for (int64_t d = 0; d < D; ++d)
          dot += as_double(q[(t * Hq + h) * D + d]) * as_double(k[(h / G * S + j) * D + d]);
        m = std::max(m, s[j] = 0.3 * dot);
      }
      for (auto& e : s) l += (e = std::exp(e - m));
      for (int64_t d = 0; d < D; ++d) {
        double o = 0;
        for (int64_t j = 0; j < n; ++j) o += s[j] / l * as_double(v[(h / G * S + j) * D + d]);
        err = std::max(err, std::fabs(o - as_double(out[(t * Hq + h) * D + d])));
      }
    }
    attend(q.data() + t * Hq * D, 1, P + t, &one, step.data());
    independent &= same_bits(step.data(), out.data() + t * Hq * D, Hq * D);
  }
  const std::string what = std::string("attention ") + name + " " + std::to_string(Hq) + "/" + std::to_string(Hkv) +
                           " heads";
  check(err < (std::is_same_v<T, float> ? 1e-5 : 2e-2), what + " within rounding of float64 (" + std::to_string(err) +
                                                            ")");
  check(independent, what + ": a tree row is bit for bit its decode step");
}

// The keys and values the tiles read past the last real one (a key group's padding slots, a task's tree keys past its
// union, a key pair's missing half on AMX) are zeros, not whatever the thread's scratch held. They never change a
// result when they are ordinary numbers (their scores are dropped, their probabilities are zeros), but a NaN there
// would (0 * NaN is NaN), and on x86 a subnormal float costs a microcode assist on every multiply-add that reads it (an
// 8-token verify's attention ran 2.6x slower on stale scratch). So: a call with normal inputs, right after one that
// left NaN keys and values, then subnormal keys, in every buffer it used (12 tree keys visible to all, 40 cached keys,
// where the normal call sees 20 cached keys, padded to 32, and 6 tree keys in its first task), must give the bits it
// gave before them; and on x86 it must not raise the denormal-operand flag (MXCSR bit 1, set by any arithmetic with a
// subnormal input) on the calling thread, which runs the first task and converts the keys. (AMX's tiles read
// subnormal bf16 as zeros, raising no flag: the amx tier's bf16 attention says so and skips that half.)
template <typename T>
void attention_padding(const Kernels& table, const char* name) {
  const int64_t D = 64, S = 64, Tn = 12;
  auto q = random<T>(Tn * D), v = random<T>(S * D), k = random<T>(S * D);
  std::vector<T> tiny(S * D, from_float<T>(1e-39f)), nan(S * D, from_float<T>(NAN)), out(Tn * D);  // (subnormal)
  std::vector<char> all(Tn * Tn, 1), own(Tn * Tn, 0);
  for (int64_t t = 0; t < Tn; ++t) own[t * Tn + t] = 1;
  auto attend = [&](const T* keys, const T* values, int64_t prefix, const std::vector<char>& mask) {
    const int64_t slot = 0, offsets[2] = {0, Tn};
    const Attention<T> a{q.data(), D, D, 1, D, CacheView<T>{keys, values, 1, 0, S * D, D}, &slot, &prefix, offsets,
                         1, reinterpret_cast<const bool*>(mask.data()), 0.125, out.data()};
#if defined(__x86_64__)
    constexpr unsigned kDenormalFlag = 0x2, kFlags = 0x3f;
    _mm_setcsr(_mm_getcsr() & ~kFlags);
    typed<T>(table).attention(a);
    return (_mm_getcsr() & kDenormalFlag) != 0;
#else
    typed<T>(table).attention(a);
    return false;
#endif
  };
  const std::string what = std::string("attention ") + name + ": ";
  const bool first = attend(k.data(), v.data(), 20, own);  // normal inputs, on the scratch the tests above left
  const std::vector<T> before = out;
  attend(nan.data(), nan.data(), 40, all);                  // NaN keys and values in every buffer
  const bool seen = attend(tiny.data(), v.data(), 40, all);  // subnormal keys: the flag shows them
  const bool again = attend(k.data(), v.data(), 20, own);    // normal inputs, on the scratch those calls left
  check(std::memcmp(before.data(), out.data(), out.size() * sizeof(T)) == 0,
        what + "the same bits after calls that left NaN and subnormal keys and values in the scratch");
#if defined(__x86_64__)
  if (!seen) {
    std::printf("skip %ssubnormal keys do not raise the denormal flag on this tier\n", what.c_str());
    return;
  }
  check(!first && !again, what + "the padding the score tiles read is zeros, not stale scratch (no subnormal operand" +
                              (first || again ? std::string(first ? " first" : "") + (again ? " again" : "") : "") +
                              ")");
#else
  (void)first, (void)seen, (void)again;
#endif
}

// ---- rows of logits ---------------------------------------------------------------------------------------------

void rows_of_logits(const Kernels& table) {
  const int64_t V = 1000, rows = 5, k = 8;
  auto x = random<float>(rows * V);
  x[2 * V + 700] = x[2 * V + 300] = 5.f;  // a tie: the first wins
  x[3 * V + 10] = NAN;                    // a NaN counts as the largest
  std::vector<int64_t> got(rows);
  table.float32.argmax_rows(x.data(), rows, V, got.data());
  bool argmax_ok = true;
  for (int64_t r = 0; r < rows; ++r) {
    int64_t best = 0;
    for (int64_t i = 0; i < V; ++i) {
      const float a = x[r * V + i], b = x[r * V + best];
      if (a != a ? b == b : a > b) best = i;
    }
    argmax_ok &= got[r] == best;
  }
  check(argmax_ok, "argmax: the first maximum, a NaN first");
  x[3 * V + 10] = 0.f;
  std::vector<int64_t> table_rows(V * k, -1), tokens{4, 9, 4, 1, 2};
  const bool keep[5] = {false, true, true, true, true};
  table.float32.top_k_rows(table_rows.data(), k, tokens.data(), keep, x.data(), rows, V);
  bool top_ok = true;
  for (int64_t r = 1; r < rows; ++r) {
    std::vector<int64_t> ids(V);
    for (int64_t i = 0; i < V; ++i) ids[i] = i;
    std::stable_sort(ids.begin(), ids.end(), [&](int64_t a, int64_t b) { return x[r * V + a] > x[r * V + b]; });
    top_ok &= std::equal(ids.begin(), ids.begin() + k, table_rows.begin() + tokens[r] * k);
  }
  check(top_ok, "top-k: the k largest, best first, ties to the lower id");
}

// ---- decoder layers ---------------------------------------------------------------------------------------------

// Two layers of a tiny Llama: 4 rows verified as a chain equal, bit for bit, 4 decode steps one after another.
template <typename T>
void layers(const Kernels& table, const char* name) {
  const int64_t L = 2, E = 32, Hq = 4, Hkv = 2, D = 8, F = 40, S = 24, Pn = 5, Tn = 4, P = std::is_same_v<T, bf16> ? 2 : 1;
  std::vector<std::vector<T>> store;
  std::vector<LayerWeights<T>> ws;
  auto packed = [&](int64_t N, int64_t K) {
    store.push_back(pack_weights(random<T>(N * K, 1.f / std::sqrt(float(K))), N, K, P));
    return store.back().data();
  };
  for (int64_t l = 0; l < L; ++l) {
    store.push_back(random<T>(E));
    const T* n1 = store.back().data();
    store.push_back(random<T>(E));
    const T* n2 = store.back().data();
    const T* qkv = packed((Hq + 2 * Hkv) * D, E);
    const T* o = packed(E, Hq * D);
    const T* gu = packed(2 * F, E);
    const T* down = packed(E, F);
    ws.push_back({n1, qkv, o, n2, gu, down, (E + P - 1) / P, (Hq * D + P - 1) / P, (E + P - 1) / P, (F + P - 1) / P});
  }
  const auto x = random<T>(Tn * E), cos = random<T>((Pn + Tn) * D), sin = random<T>((Pn + Tn) * D);
  const auto cache0 = random<T>(L * 2 * Hkv * S * D);
  std::vector<char> chain(Tn * Tn);
  for (int64_t t = 0; t < Tn; ++t)
    for (int64_t i = 0; i < Tn; ++i) chain[t * Tn + i] = i <= t;
  auto run = [&](std::vector<T>& cache, const T* rows_in, int64_t rows, int64_t prefix, const char* mask,
                 const T* c, const T* s) {
    std::vector<T> h(rows_in, rows_in + rows * E), qkv(rows * (Hq + 2 * Hkv) * D), att(rows * Hq * D);
    const int64_t slot = 0, offsets[2] = {0, rows};
    const Layers<T> a{h.data(), ws.data(), L, nullptr, c, s, cache.data(),
                      {2 * Hkv * S * D, 0, Hkv * S * D, S * D, D}, &slot, &prefix, offsets, 1,
                      reinterpret_cast<const bool*>(mask), rows, E, Hq, Hkv, D, F, 1e-5f, qkv.data(), att.data()};
    typed<T>(table).layers(a);
    return h;
  };
  std::vector<T> verify_cache = cache0, step_cache = cache0;
  const auto verified = run(verify_cache, x.data(), Tn, Pn, chain.data(), cos.data() + Pn * D, sin.data() + Pn * D);
  bool same = true;
  const char one = 1;
  for (int64_t t = 0; t < Tn; ++t) {
    const auto stepped = run(step_cache, x.data() + t * E, 1, Pn + t, &one, cos.data() + (Pn + t) * D,
                             sin.data() + (Pn + t) * D);
    same &= same_bits(stepped.data(), verified.data() + t * E, E);
  }
  same &= same_bits(step_cache.data(), verify_cache.data(), static_cast<int64_t>(step_cache.size()));
  check(same, std::string("decoder layers ") + name + ": a 4-token chain verify is bit for bit 4 decode steps");
}

}  // namespace

// claimed_for (parallel.h, compiled here) on a pool of `threads` threads, one per share, the thread of share `late`
// starting `delay_ms` late: every unit runs exactly once, a thread's own run comes in order (first marked, next
// foreseen), and where one thread starts late the others take its units.
struct Pool {
  int64_t threads = 1, late = -1, delay_ms = 0;
};
Pool pool;
thread_local int64_t pool_worker = -1;

void pool_for(int64_t begin, int64_t end, int64_t grain, ParallelBody body, void* ctx) {
  std::vector<std::thread> workers;
  for (int64_t i = begin; i < end; ++i)
    workers.emplace_back([=] {
      pool_worker = i;
      if (i == pool.late) std::this_thread::sleep_for(std::chrono::milliseconds(pool.delay_ms));
      body(ctx, i, i + 1);
    });
  for (auto& w : workers) w.join();
}
const Host kPool{&pool_for, [] { return static_cast<int>(pool.threads); }};

void claims(int64_t n, int64_t threads, int64_t late, int64_t delay_ms) {
  pool = {threads, late, delay_ms};
  const Host* before = bound_host();
  bound_host() = &kPool;
  std::vector<std::atomic<int>> runs(n);
  std::vector<int64_t> by(n, -1);
  std::atomic<int> bad_next{0}, firsts{0};
  claimed_for(n, [&](int64_t b, bool first, int64_t next) {
    runs[b].fetch_add(1);
    by[b] = pool_worker;
    firsts += first;
    if (next != -1 && next != b + 1) ++bad_next;
  });
  bound_host() = before;
  const std::string what = std::to_string(n) + " units on " + std::to_string(threads) + " threads" +
                           (late >= 0 ? ", share " + std::to_string(late) + " late" : "");
  check(std::all_of(runs.begin(), runs.end(), [](const std::atomic<int>& r) { return r.load() == 1; }),
        "claimed_for: every unit runs once, " + what);
  check(bad_next == 0 && firsts >= 1, "claimed_for: a thread's own run in order, " + what);
  if (late >= 0) {
    const int64_t p = std::min(threads, n), own = n * (late + 1) / p - n * late / p;
    const int64_t by_late = std::count(by.begin(), by.end(), late);
    check(by_late < own, "claimed_for: the others take the late share's units (" + std::to_string(by_late) + " of " +
                             std::to_string(own) + " left to it), " + what);
  }
}

// The peak loops' counts (what bench.kernels sets the matmuls against): bf16's does twice the float loop's work where
// the tier has the pair dot product (two products and two sums a lane, not one of each), the same elsewhere, where
// bf16 is widened to floats.
void peaks(const Kernels& table) {
  const double fma = table.multiply_adds(1), pairs = table.bf16_multiply_adds(1);
  const std::string tier = table.tier;
  const double expected = tier == "avx512bf16" || tier == "amx" ? 2.0 : 1.0;
  std::printf("peak loops: %.0f float FLOPs, %.0f bf16 FLOPs a unit\n", fma, pairs);
  check(fma > 0 && pairs == expected * fma, "the bf16 peak loop counts the pair dot product's work");
}

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s TIER_LIBRARY\n", argv[0]);
    return 2;
  }
  void* library = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    std::fprintf(stderr, "cannot open %s: %s\n", argv[1], dlerror());
    return 2;
  }
  auto entry = reinterpret_cast<KernelsEntry>(dlsym(library, kKernelsEntry));
  if (entry == nullptr) {
    std::fprintf(stderr, "%s has no %s\n", argv[1], kKernelsEntry);
    return 2;
  }
  const Kernels* found = entry(&kHost);
  if (found == nullptr) {  // (the amx tier, where Linux refuses the process its tiles)
    std::fprintf(stderr, "%s cannot run in this process\n", argv[1]);
    return 2;
  }
  const Kernels& table = *found;
  std::printf("tier %s (table version %d)\n", table.tier, table.abi);
  check(table.abi == kAbiVersion, "the library's table version is this harness's");
  conversions();
  peaks(table);
  claims(10, 2, 1, 100);
  claims(10, 2, 0, 100);
  claims(7, 5, -1, 0);
  claims(3, 5, 2, 50);
  claims(1000, 3, -1, 0);
  matmuls<float>(table, "float32");
  matmuls<bf16>(table, "bfloat16");
  matmuls<f16>(table, "float16");
  for (auto [Hq, Hkv] : {std::pair<int64_t, int64_t>{6, 3}, {4, 4}}) {  // grouped-query, and multi-head (G = 1)
    attention<float>(table, "float32", Hq, Hkv);
    attention<bf16>(table, "bfloat16", Hq, Hkv);
    attention<f16>(table, "float16", Hq, Hkv);
  }
  attention_padding<float>(table, "float32");
  attention_padding<bf16>(table, "bfloat16");
  rows_of_logits(table);
  layers<float>(table, "float32");
  layers<bf16>(table, "bfloat16");
  layers<f16>(table, "float16");
  std::printf("%s: %d failed\n", table.tier, failures);
  return failures == 0 ? 0 : 1;
}
