// Every Llama decoder layer of a decode step or a draft-tree verify, in one call (the op decoder_layers). The model's
// module path runs ~35 PyTorch ops per layer (RMSNorm alone is eight), each a dispatch, an allocation and a pass over
// a few KB; on SmolLM2 that glue cost as much as streaming the weights (issue 25, bench/results/step_profile.md).
// Here the elementwise work (RMSNorm, RoPE, the cache write, SiLU * up, the residual adds) runs in plain loops over
// the T rows between the layer's four packed matmuls and its attention, which are linear.h's and attention.h's.
//
// Row independence, kept: every loop computes a row from that row alone, in a fixed order, and the matmuls and the
// attention are row-independent already, so a verify row's bits are its decode step's and bf16 speculative decoding
// stays bit-identical to plain decoding. Rounding follows the module path's (tr_engine.model.reference.decoder_layers):
// each PyTorch op's result is rounded to the model's dtype where that op would round it. Two sums differ in order
// from PyTorch's (RMSNorm's mean of squares, SiLU's exp), so the op agrees with its reference to a rounding, not to the
// bit; every method runs the same op, so they still agree with each other bit for bit.
#pragma once

#include "api.h"
#include "attention.h"
#include "linear.h"
#include "numbers.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace tr_engine_cpu {

// out[t] = w * round(x[t] / rms(x[t])), each row alone: RMSNorm as the module computes it (the half types normalise
// in float and round once before the weight's multiply; float stays float). The sum of squares runs in 16 lanes
// (element i into lane i % 16: a multiply and an add each), then the lanes in order: a fixed order, on every tier the
// same sums. out is [rows, ldo]: columns E..ldo-1 (the matmul's padding to its column pairs) are zeros.
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t ldo, int64_t rows, int64_t E, float eps) {
  for (int64_t t = 0; t < rows; ++t) {
    const T* xr = x + t * E;
    float lane[16] = {};
    int64_t i = 0;
    if constexpr (!std::is_same_v<T, double>) {
      // The 16 lanes as 16 / kLanes vectors side by side (written as the scalar loop below, the compiler kept them
      // scalar for the 16-bit types: 5% of a prompt chunk's bf16 forward); what the vectors leave, that loop.
      constexpr int kParts = 16 / kLanes;
      Vec acc[kParts];
      for (int a = 0; a < kParts; ++a) acc[a] = zero();
      for (; i + 16 <= E; i += 16)
        for (int a = 0; a < kParts; ++a) {
          const Vec v = load(xr + i + a * kLanes);
          acc[a] = add(acc[a], mul(v, v));
        }
      for (int a = 0; a < kParts; ++a) store(lane + a * kLanes, acc[a]);
    }
    for (; i + 16 <= E; i += 16)
      for (int l = 0; l < 16; ++l) {
        const float v = to_float(xr[i + l]);
        lane[l] += v * v;
      }
    for (int l = 0; i + l < E; ++l) {
      const float v = to_float(xr[i + l]);
      lane[l] += v * v;
    }
    float sum = 0.f;
    for (int l = 0; l < 16; ++l) sum += lane[l];
    const float r = 1.f / std::sqrt(sum / static_cast<float>(E) + eps);
    T* o = out + t * ldo;
    for (int64_t j = 0; j < E; ++j) {
      const float normed = to_float(from_float<T>(to_float(xr[j]) * r));
      o[j] = from_float<T>(to_float(w[j]) * normed);
    }
    std::fill(o + E, o + ldo, T{});
  }
}

// RoPE on the q and k heads of qkv [T, Hq + 2 Hkv, D] in place, then the rotated k and the v heads written to the
// cache: row r of sequence b to slot slots[b], position prefix_lens[b] + (r - offsets[b]); rows r0..r1-1. As
// apply_rope in tr_engine/model/llama.py: a = round(x * cos), then round(a + swap(x) * sin), with the tables' (cos,
// cos) and (-sin, sin).
template <typename T>
void rope_and_cache(T* qkv, const Layers<T>& a, T* kv, int64_t r0, int64_t r1) {
  const int64_t D = a.D, half = D / 2, heads = a.Hq + 2 * a.Hkv;
  const int64_t* st = a.kv_strides;
  int64_t b = 0;
  for (int64_t r = r0; r < r1; ++r) {
    while (a.offsets[b + 1] <= r) ++b;  // the sequence row r is in
    const T* c = a.cos + r * D;
    const T* s = a.sin + r * D;
    for (int64_t h = 0; h < a.Hq + a.Hkv; ++h) {
      T* row = qkv + (r * heads + h) * D;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = to_float(row[i]), x2 = to_float(row[i + half]);
        const float a1 = to_float(from_float<T>(x1 * to_float(c[i])));
        const float a2 = to_float(from_float<T>(x2 * to_float(c[i + half])));
        row[i] = from_float<T>(a1 + x2 * to_float(s[i]));
        row[i + half] = from_float<T>(a2 + x1 * to_float(s[i + half]));
      }
    }
    const int64_t pos = a.prefix_lens[b] + (r - a.offsets[b]);
    for (int64_t h = 0; h < a.Hkv; ++h)
      for (int64_t kind = 0; kind < 2; ++kind) {  // 0: k (rotated above), 1: v
        const T* src = qkv + (r * heads + a.Hq + kind * a.Hkv + h) * D;
        T* dst = kv + a.slots[b] * st[1] + kind * st[2] + h * st[3] + pos * st[4];
        std::copy(src, src + D, dst);
      }
  }
}

// act[t] = round(round(silu(gate[t])) * up[t]) from gate_up [T, 2F] (gate, then up): F.silu(gate) * up, into act
// [T, lda], zeros in columns F..lda-1. silu(g) = g / (1 + e^-g), e^-g as 2^(-g log2 e) (exp2_clamped: 0 or a huge
// finite value past its range, so silu is g or -0 there).
template <typename T>
void silu_mul_rows(const T* gate_up, T* act, int64_t lda, int64_t rows, int64_t F) {
  constexpr float kLog2e = 1.4426950408889634f;
  for (int64_t t = 0; t < rows; ++t) {
    const T* gate = gate_up + t * 2 * F;
    T* out = act + t * lda;
    for (int64_t j = 0; j < F; ++j) {
      const float g = to_float(gate[j]);
      const float silu = to_float(from_float<T>(g / (1.f + exp2_clamped(-g * kLog2e))));
      out[j] = from_float<T>(silu * to_float(gate[F + j]));
    }
    std::fill(out + F, out + lda, T{});
  }
}

// x += y, rounded, elementwise.
template <typename T>
void add_into(T* x, const T* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = from_float<T>(to_float(x[i]) + to_float(y[i]));
}

// Scratch that a thread keeps between calls (a step's buffers are the same few sizes every layer).
template <typename T>
T* grown(std::vector<T>& buffer, int64_t n) {
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

// The elementwise work between a layer's matmuls, f(r0, r1) over rows r0..r1-1, split between the threads once a
// step has kGlueRows rows or more (a verify, a batch, a prompt chunk): every loop above computes a row from that row
// alone, so where a row is computed changes no bit. Run on the calling thread alone, it left the others waiting at
// the next matmul: at 16 rows RMSNorm, RoPE and SiLU * up were ~3% of a SmolLM2 forward's samples on one thread of
// two, the other spinning meanwhile. A decode step's single row stays on the calling thread (a fork costs more).
constexpr int64_t kGlueRows = 4;
template <typename F>
void glue(int64_t rows, const F& f) {
  if (rows >= kGlueRows)
    parallel_for(0, rows, 1, f);
  else
    f(0, rows);
}

// One decoder layer on the residual stream a.h [T, E] in place; kv is this layer's cache [N, 2, Hkv, S, D]. `normed`
// holds the input norm's rows already (the layer before normed them with its last residual add).
template <typename T>
void layer(const Layers<T>& a, const LayerWeights<T>& w, T* kv, T* normed, int64_t ld_norm,
           const T* next_norm) {
  T* qkv = a.qkv;
  thread_local std::vector<T> gate_up_buf, act_buf, proj_buf;
  constexpr int64_t P = pack_width<T>();
  const int64_t rows = a.rows, E = a.E, F = a.F, D = a.D, heads = a.Hq + 2 * a.Hkv;
  const int64_t ld_act = w.down_groups * P;  // (the matmuls read their rows in column pairs, padded to them)
  T* proj = grown(proj_buf, rows * E);
  // attention: q/k/v, RoPE and the cache write, attention, o_proj, residual (and the MLP's norm)
  packed_rows(normed, ld_norm, w.qkv, qkv, rows, w.qkv_groups, heads * D);
  glue(rows, [&](int64_t r0, int64_t r1) { rope_and_cache(qkv, a, kv, r0, r1); });
  const Attention<T> attend{qkv, heads * D, D, a.Hq, D,
                            CacheView<T>{kv, kv + a.kv_strides[2], a.Hkv, a.kv_strides[1], a.kv_strides[3],
                                         a.kv_strides[4]},
                            a.slots, a.prefix_lens, a.offsets, a.B, a.masks, std::pow(static_cast<double>(D), -0.5),
                            a.attended};
  attention(attend);
  packed_rows(a.attended, a.Hq * D, w.o, proj, rows, w.o_groups, E);
  glue(rows, [&](int64_t r0, int64_t r1) {
    add_into(a.h + r0 * E, proj + r0 * E, (r1 - r0) * E);
    rms_norm_rows(a.h + r0 * E, w.post_norm, normed + r0 * ld_norm, ld_norm, r1 - r0, E, a.eps);
  });
  // MLP: gate/up, SiLU * up, down_proj, residual (and the next layer's input norm, or the final norm, if any)
  T* gate_up = grown(gate_up_buf, rows * 2 * F);
  packed_rows(normed, ld_norm, w.gate_up, gate_up, rows, w.gate_up_groups, 2 * F);
  T* act = grown(act_buf, rows * ld_act);
  glue(rows, [&](int64_t r0, int64_t r1) {
    silu_mul_rows(gate_up + r0 * 2 * F, act + r0 * ld_act, ld_act, r1 - r0, F);
  });
  packed_rows(act, ld_act, w.down, proj, rows, w.down_groups, E);
  glue(rows, [&](int64_t r0, int64_t r1) {
    add_into(a.h + r0 * E, proj + r0 * E, (r1 - r0) * E);
    if (next_norm != nullptr)
      rms_norm_rows(a.h + r0 * E, next_norm, normed + r0 * ld_norm, ld_norm, r1 - r0, E, a.eps);
  });
}

// Every layer in turn, in one call: a step's 30 layers cost one dispatch, one set of checks and three allocations,
// where one op per layer paid those 30 times (~15 us each, half a millisecond of a 9 ms SmolLM2 step). Then the final
// norm, when there is one: as eight PyTorch ops after the layers it took ~0.3 ms of a SmolLM2 step, fifteen times
// what it takes in a loop of its own, because each op's dispatch ran with the caches full of the weights just
// streamed; here it made a plain bf16 step 2.4% faster (alternating in one process). Each layer's input norm runs with
// the residual add before it (glue): one pass over the rows, split between the threads.
template <typename T>
void layers(const Layers<T>& a) {
  if (a.L > 0) {  // the first layer's input norm here; every later one with the residual add before it (layer)
    thread_local std::vector<T> norm_buf;
    const int64_t ld_norm = a.layers[0].qkv_groups * pack_width<T>();  // (every layer's qkv reads E columns alike)
    T* normed = grown(norm_buf, a.rows * ld_norm);
    glue(a.rows, [&](int64_t r0, int64_t r1) {
      rms_norm_rows(a.h + r0 * a.E, a.layers[0].input_norm, normed + r0 * ld_norm, ld_norm, r1 - r0, a.E, a.eps);
    });
    for (int64_t l = 0; l < a.L; ++l)
      layer(a, a.layers[l], a.kv + l * a.kv_strides[0], normed, ld_norm,
            l + 1 < a.L ? a.layers[l + 1].input_norm : nullptr);
  }
  if (a.final_norm != nullptr)  // in place: a row is read whole before any of it is written
    glue(a.rows, [&](int64_t r0, int64_t r1) {
      rms_norm_rows(a.h + r0 * a.E, a.final_norm, a.h + r0 * a.E, a.E, r1 - r0, a.E, a.eps);
    });
}

}  // namespace tr_engine_cpu
