// Torch-facing launchers for the CUDA kernels in csrc/cuda/*.cu: argument checks, device guard, current stream.
// Built only where torch has CUDA (setup.py); the kernels themselves compile without torch.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../tree_attention_checks.h"

namespace tr_engine {
cudaError_t launch_compact_kv(void* cache, const int64_t* src_slots, void* scratch, int64_t rows, int64_t n, int64_t S,
                              int64_t slot_bytes, int64_t dst_start, cudaStream_t stream);
cudaError_t launch_tree_attention(int dtype, const void* q, int64_t q_stride_t, int64_t q_stride_h, const void* k,
                                  const void* v, int64_t kv_stride_h, int64_t kv_stride_s, const bool* mask, int T,
                                  int Hq, int Hkv, int D, int P, const int64_t* prefix_dev, int S, float scale,
                                  void* out, cudaStream_t stream);
int tree_attention_max_head_dim();
cudaError_t launch_recycle_update(int dtype, int64_t* table, const int64_t* tokens, const void* logits, int n_rows,
                                  int64_t V, int k, cudaStream_t stream);
int recycle_update_max_k();
cudaError_t launch_skinny_linear(int dtype, const void* x, const void* w, void* y, int rows, int64_t K, int64_t N,
                                 cudaStream_t stream);
}  // namespace tr_engine

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
  TORCH_CHECK(cache.dim() == 5, "compact_kv_: cache must be [L, 2, Hkv, S, D], got ", cache.dim(), " dims");
  TORCH_CHECK(cache.is_contiguous(), "compact_kv_: cache must be contiguous");
  TORCH_CHECK(src_slots.dim() == 1 && src_slots.scalar_type() == at::kLong,
              "compact_kv_: src_slots must be a 1-D int64 tensor");
  TORCH_CHECK(src_slots.device() == cache.device(), "compact_kv_: src_slots must be on ", cache.device());
  const int64_t S = cache.size(3), n = src_slots.numel();
  TORCH_CHECK(dst_start >= 0 && dst_start + n <= S, "compact_kv_: dst_start ", dst_start, " + ", n,
              " slots exceeds the cache capacity ", S);
  const int64_t slot_bytes = cache.size(4) * cache.element_size();
  TORCH_CHECK(slot_bytes % 4 == 0, "compact_kv_: head_dim * element size must be a multiple of 4 bytes");
  // Slot indices are not range-checked on the device (that would need a host sync); the engine produces them.
  const c10::cuda::CUDAGuard guard(cache.device());
  const int64_t rows = cache.numel() / (S * cache.size(4));
  auto scratch = at::empty({rows * n * slot_bytes}, cache.options().dtype(at::kByte));
  const auto src = src_slots.contiguous();
  const cudaError_t err =
      tr_engine::launch_compact_kv(cache.data_ptr(), src.data_ptr<int64_t>(), scratch.data_ptr(), rows, n, S,
                                   slot_bytes, dst_start, c10::cuda::getCurrentCUDAStream());
  check_launch(err, "compact_kv_");
}

// The launch shared by tree_attention (prefix_dev null: prefix_len is the int) and tree_attention_dynamic.
at::Tensor tree_attention_launch(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t prefix_len,
                                 const int64_t* prefix_dev, const at::Tensor& tree_mask, double scale, const char* op) {
  tr_engine::check_tree_attention_args(q, k, v, prefix_len, tree_mask);
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(0), S = k.size(1);
  TORCH_CHECK(D <= tr_engine::tree_attention_max_head_dim(), op, ": head dim ", D, " exceeds the CUDA kernel's ",
              tr_engine::tree_attention_max_head_dim());
  // A row that sees no key (prefix_len 0 and an all-False mask row) is not detected on the device (that would need a
  // host sync); the decode loop's masks always include the token itself.
  const int code = dtype_code(q, op);
  const c10::cuda::CUDAGuard guard(q.device());
  auto out = at::empty({T, Hq, D}, q.options());
  const auto mask = tree_mask.contiguous();
  check_launch(tr_engine::launch_tree_attention(code, q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(),
                                                v.data_ptr(), k.stride(0), k.stride(1), mask.data_ptr<bool>(), T, Hq,
                                                Hkv, D, prefix_len, prefix_dev, S, static_cast<float>(scale),
                                                out.data_ptr(), c10::cuda::getCurrentCUDAStream()),
               op);
  return out;
}

at::Tensor tree_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t prefix_len,
                               const at::Tensor& tree_mask, double scale) {
  return tree_attention_launch(q, k, v, prefix_len, nullptr, tree_mask, scale, "tree_attention");
}

at::Tensor tree_attention_dynamic_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& prefix_len, const at::Tensor& tree_mask, double scale) {
  tr_engine::check_dynamic_prefix(prefix_len, q);
  const auto prefix = prefix_len.contiguous();
  // The shapes are checked as for a prefix of 0 (T <= S); the length itself is read, and clamped, by the kernel.
  return tree_attention_launch(q, k, v, 0, prefix.data_ptr<int64_t>(), tree_mask, scale, "tree_attention_dynamic");
}

void recycle_update_cuda_(at::Tensor& table, const at::Tensor& tokens, const at::Tensor& logits) {
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kLong && table.is_contiguous(),
              "recycle_update_: table must be a contiguous int64 [V, k] tensor");
  TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong, "recycle_update_: tokens must be int64 [T]");
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) == tokens.size(0), "recycle_update_: logits must be [T, V] with T = ",
              tokens.size(0), ", got ", logits.sizes());
  TORCH_CHECK(logits.size(1) >= table.size(1), "recycle_update_: logits have ", logits.size(1),
              " columns, fewer than k = ", table.size(1));
  TORCH_CHECK(table.size(1) <= tr_engine::recycle_update_max_k(), "recycle_update_: k = ", table.size(1),
              " exceeds the CUDA kernel's ", tr_engine::recycle_update_max_k());
  TORCH_CHECK(table.device() == tokens.device() && tokens.device() == logits.device(),
              "recycle_update_: table, tokens and logits must be on one device");
  // Token ids are not range-checked on the device (that would need a host sync); the engine produces them.
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
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "skinny_linear: x must be [T, K] and w [N, K], got ", x.dim(), " and ",
              w.dim(), " dims");
  TORCH_CHECK(x.size(1) == w.size(1), "skinny_linear: x is [", x.size(0), ", ", x.size(1), "] but w is [", w.size(0),
              ", ", w.size(1), "]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 16, "skinny_linear: x has ", x.size(0),
              " rows; 1..16 are supported (use a regular matmul for more)");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "skinny_linear: x is ", x.scalar_type(), " but w is ",
              w.scalar_type());
  TORCH_CHECK(w.is_contiguous(), "skinny_linear: w must be contiguous [N, K]");
  TORCH_CHECK(x.device() == w.device(), "skinny_linear: x and w must be on one device");
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
  m.impl("recycle_update_", &recycle_update_cuda_);
  m.impl("skinny_linear", &skinny_linear_cuda);
}
