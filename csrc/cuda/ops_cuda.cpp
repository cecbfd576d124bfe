// Torch-facing launchers for the CUDA kernels in csrc/cuda/*.cu (declared in launchers.h): each op's shared argument
// checks (csrc/op_checks.h, the same as its CPU kernel's), what the CUDA kernel adds, device guard, current stream.
// Built only where torch has CUDA (setup.py); the kernels themselves compile without torch.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../op_checks.h"
#include "launchers.h"

namespace {

// The kernels' dtype code: 0 float32, 1 float16, 2 bfloat16.
int dtype_code(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat: return 0;
    case at::kHalf: return 1;
    case at::kBFloat16: return 2;
    default: TORCH_CHECK(false, op, ": dtype ", t.scalar_type(), " is not supported on CUDA (float32, float16, bfloat16)");
  }
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA launch failed: ", cudaGetErrorString(err));
}

void compact_kv_cuda_(at::Tensor& cache, const at::Tensor& src_slots, int64_t dst_start) {
  tr_engine::check_compact_kv_args(cache, src_slots, dst_start);
  const int64_t S = cache.size(3), n = src_slots.numel();
  const int64_t slot_bytes = cache.size(4) * cache.element_size();
  TORCH_CHECK(slot_bytes % 4 == 0, "compact_kv_: head_dim * element size must be a multiple of 4 bytes");
  // A source slot out of range is skipped by the kernel: checking it here would need a host sync.
  const c10::cuda::CUDAGuard guard(cache.device());
  const int64_t rows = cache.numel() / (S * cache.size(4));
  auto scratch = at::empty({rows * n * slot_bytes}, cache.options().dtype(at::kByte));
  const auto src = src_slots.contiguous();
  const cudaError_t err =
      tr_engine::launch_compact_kv(cache.data_ptr(), src.data_ptr<int64_t>(), scratch.data_ptr(), rows, n, S,
                                   slot_bytes, dst_start, c10::cuda::getCurrentCUDAStream());
  check_launch(err, "compact_kv_");
}

// The launch shared by tree_attention (prefix_dev null: prefix_len is the int), tree_attention_dynamic and
// tree_attention_rows (k, v [N, Hkv, S, D] and each row's place in `rows`), after their checks.
at::Tensor tree_attention_launch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t prefix_len,
                                 const int64_t* prefix_dev, const at::Tensor& tree_mask, double scale, const char* op,
                                 const int64_t* rows = nullptr) {
  const bool batched = rows != nullptr;
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(batched), S = k.size(batched + 1);
  TORCH_CHECK(D <= tr_engine::tree_attention_max_head_dim(), op, ": head dim ", D, " exceeds the CUDA kernel's ",
              tr_engine::tree_attention_max_head_dim());
  // A row that sees no key (prefix_len 0 and an all-False mask row) is not detected on the device (that would need a
  // host sync); the decode loop's masks always include the token itself.
  const int code = dtype_code(q, op);
  const c10::cuda::CUDAGuard guard(q.device());
  auto out = at::empty({T, Hq, D}, q.options());
  const auto mask = tree_mask.contiguous();
  check_launch(tr_engine::launch_tree_attention(code, q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(),
                                                v.data_ptr(), k.stride(batched), k.stride(batched + 1),
                                                mask.data_ptr<bool>(), T, Hq, Hkv, D, prefix_len, prefix_dev, rows,
                                                batched ? k.stride(0) : 0, batched ? k.size(0) : 1, S,
                                                static_cast<float>(scale), out.data_ptr(),
                                                c10::cuda::getCurrentCUDAStream()),
               op);
  return out;
}

at::Tensor tree_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t prefix_len,
                               const at::Tensor& tree_mask, double scale) {
  tr_engine::check_tree_attention_args(q, k, v, prefix_len, tree_mask);
  return tree_attention_launch(q, k, v, prefix_len, nullptr, tree_mask, scale, "tree_attention");
}

at::Tensor tree_attention_dynamic_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& prefix_len, const at::Tensor& tree_mask, double scale) {
  tr_engine::check_tree_attention_dynamic_args(q, k, v, prefix_len, tree_mask);
  const auto prefix = prefix_len.contiguous();
  // The shapes are checked as for a prefix of 0 (T <= S); the length itself is read, and clamped, by the kernel.
  return tree_attention_launch(q, k, v, 0, prefix.data_ptr<int64_t>(), tree_mask, scale, "tree_attention_dynamic");
}

// One launch per sequence on its rows, slot and mask block (a ragged kernel in one launch is the GPU issue's to
// measure first).
at::Tensor tree_attention_batch_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     at::IntArrayRef slots, at::IntArrayRef prefix_lens, at::IntArrayRef offsets,
                                     const at::Tensor& tree_masks, double scale) {
  tr_engine::check_tree_attention_batch_args(q, k, v, slots, prefix_lens, offsets, tree_masks);
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  int64_t at = 0;
  for (size_t b = 0; b < slots.size(); ++b) {
    const int64_t lo = offsets[b], n = offsets[b + 1] - offsets[b];
    if (n == 0) continue;
    const auto rows = q.narrow(0, lo, n), mask = tree_masks.narrow(0, at, n * n).view({n, n});
    const auto kb = k.select(0, slots[b]), vb = v.select(0, slots[b]);
    out.narrow(0, lo, n).copy_(
        tree_attention_launch(rows, kb, vb, prefix_lens[b], nullptr, mask, scale, "tree_attention_batch"));
    at += n * n;
  }
  return out;
}

// Every row's slot, prefix and sequence read on the device: one launch a CUDA graph replays with any batch.
at::Tensor tree_attention_rows_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& rows, const at::Tensor& tree_mask, double scale) {
  tr_engine::check_tree_attention_rows_args(q, k, v, rows, tree_mask);
  const auto r = rows.contiguous();
  return tree_attention_launch(q, k, v, 0, nullptr, tree_mask, scale, "tree_attention_rows", r.data_ptr<int64_t>());
}

void recycle_update_cuda_(at::Tensor& table, const at::Tensor& tokens, const at::Tensor& logits) {
  tr_engine::check_recycle_update_args(table, tokens, logits);
  TORCH_CHECK(table.size(1) <= tr_engine::recycle_update_max_k(), "recycle_update_: k = ", table.size(1),
              " exceeds the CUDA kernel's ", tr_engine::recycle_update_max_k());
  // A token id out of range is skipped by the kernel: checking it here would need a host sync.
  const int code = dtype_code(logits, "recycle_update_");
  const c10::cuda::CUDAGuard guard(table.device());
  const auto toks = tokens.contiguous();
  const auto x = logits.contiguous();
  check_launch(tr_engine::launch_recycle_update(code, table.data_ptr<int64_t>(), toks.data_ptr<int64_t>(),
                                                x.data_ptr(), static_cast<int>(toks.numel()), x.size(1),
                                                static_cast<int>(table.size(1)), c10::cuda::getCurrentCUDAStream()),
               "recycle_update_");
}

at::Tensor skinny_linear_cuda(const at::Tensor& x, const at::Tensor& w) {
  tr_engine::check_skinny_linear_args(x, w, tr_engine::skinny_linear_max_rows());
  const int code = dtype_code(x, "skinny_linear");
  const c10::cuda::CUDAGuard guard(x.device());
  const auto xc = x.contiguous();
  auto y = at::empty({x.size(0), w.size(0)}, x.options());
  check_launch(tr_engine::launch_skinny_linear(code, xc.data_ptr(), w.data_ptr(), y.data_ptr(),
                                               static_cast<int>(x.size(0)), x.size(1), w.size(0),
                                               c10::cuda::getCurrentCUDAStream()),
               "skinny_linear");
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(tr_engine, CUDA, m) {
  m.impl("compact_kv_", &compact_kv_cuda_);
  m.impl("tree_attention", &tree_attention_cuda);
  m.impl("tree_attention_dynamic", &tree_attention_dynamic_cuda);
  m.impl("tree_attention_batch", &tree_attention_batch_cuda);
  m.impl("tree_attention_rows", &tree_attention_rows_cuda);
  m.impl("recycle_update_", &recycle_update_cuda_);
  m.impl("skinny_linear", &skinny_linear_cuda);
}
