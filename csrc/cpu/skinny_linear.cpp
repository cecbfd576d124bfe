// CPU kernel of tr_engine::skinny_linear: y = x @ w.T for the 1-16 rows of a decode step or a small draft tree with a
// weight that is not packed, where reading w from memory is the whole cost of one row and must stay most of it for 16
// (stock sgemv and oneDNN's few-row GEMM fall well short of the memory bandwidth on these shapes:
// bench/results/kernels_cpu.md). This file checks the arguments; the tiles are the active CPU tier's
// (csrc/cpu/kernels/linear.h).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../op_checks.h"
#include "tiers.h"

#include <cstdint>

namespace {

constexpr int64_t kMaxRows = 16;  // the schema's limit on T (rows of x)

at::Tensor skinny_linear_cpu(const at::Tensor& x, const at::Tensor& w) {
  tr_engine::check_skinny_linear_args(x, w, kMaxRows);
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "skinny_linear: dtype ", x.scalar_type(), " is not supported (float32, bfloat16, float16)");
  const auto xc = x.contiguous();
  auto y = at::empty({x.size(0), w.size(0)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "skinny_linear", [&] {
    using S = typename tr_engine_cpu::Storage<scalar_t>::type;
    using tr_engine_cpu::data;
    if constexpr (!std::is_same_v<S, double>)
      tr_engine_cpu::kernels_for<S>().skinny(data<S>(xc), data<S>(w), data<S>(y), x.size(0), x.size(1), w.size(0));
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(tr_engine, CPU, m) { m.impl("skinny_linear", &skinny_linear_cpu); }
