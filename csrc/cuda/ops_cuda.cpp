// Torch-facing launchers for the CUDA kernels in csrc/cuda/*.cu: argument checks, device guard, current stream.
// Built only where torch has CUDA (setup.py); the kernels themselves compile without torch.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace tr_engine {
cudaError_t launch_compact_kv(void* cache, const int64_t* src_slots, void* scratch, int64_t rows, int64_t n, int64_t S,
                              int64_t slot_bytes, int64_t dst_start, cudaStream_t stream);
}

namespace {

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
                                   slot_bytes, dst_start, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "compact_kv_: CUDA launch failed: ", cudaGetErrorString(err));
}

}  // namespace

TORCH_LIBRARY_IMPL(tr_engine, CUDA, m) { m.impl("compact_kv_", &compact_kv_cuda_); }
