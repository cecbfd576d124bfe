// CPU kernel of tr_engine::argmax_rows: x.argmax(dim=-1) for float32 and float64 logits, the same index bit for bit
// (the first maximum; a NaN counts as the largest value, the first NaN wins), for greedy decoding's choice.
//
// Why a kernel: PyTorch's CPU argmax carries an index with every element (~0.9 ns each here, 85 us for a row of
// SmolLM2's 49,152 logits), and the chunked max-then-argmax that sampling.greedy built from PyTorch ops took nine
// small ops, each one a dispatch that, right after a step has streamed the model's weights through the caches, costs
// tens of microseconds (~0.15 ms a plain step). The pass itself is the active CPU tier's (csrc/cpu/kernels/rows.h).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../op_checks.h"
#include "tiers.h"

#include <cstdint>

namespace {

at::Tensor argmax_rows_cpu(const at::Tensor& x) {
  tr_engine::check_argmax_rows_args(x);
  const auto xc = x.contiguous();
  const int64_t V = x.size(-1), rows = x.numel() / V;
  auto out = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  if (x.scalar_type() == at::kDouble)
    tr_engine_cpu::kernels_for<double>().argmax_rows(xc.data_ptr<double>(), rows, V, o);
  else
    tr_engine_cpu::kernels_for<float>().argmax_rows(xc.data_ptr<float>(), rows, V, o);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tr_engine, CPU, m) { m.impl("argmax_rows", &argmax_rows_cpu); }
