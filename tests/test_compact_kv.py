"""KV-cache compaction: the C++ kernel equals its PyTorch reference exactly, overlapping ranges included."""

import pytest
import torch

from tr_engine.model import reference
from tr_engine.model.ops import load_ops

kernels = load_ops("kernels")


def naive(cache, src, dst):
    """The contract spelled out one slot at a time, from a snapshot of the old cache."""
    old = cache.clone()
    out = cache.clone()
    for i, s in enumerate(src.tolist()):
        out[:, :, :, dst + i] = old[:, :, :, s]
    return out


def make_cache(dtype, L=3, H=2, S=40, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2, H, S, D, generator=g).to(dtype)


CASES = {
    "accepted_path": ([20, 23, 31], 20),  # tree slots after the prefix -> right after the prefix
    "overlap_forward": ([5, 6, 7, 8, 9], 3),  # destination overlaps the sources
    "overlap_backward": ([3, 4, 5], 5),
    "identity": ([10, 11, 12], 10),
    "duplicates": ([7, 7, 2], 0),
    "single": ([39], 0),
    "empty": ([], 4),
    "long": (list(range(8, 8 + 30)), 0),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference_and_contract(case, dtype):
    src_list, dst = CASES[case]
    src = torch.tensor(src_list, dtype=torch.long)
    want = naive(make_cache(dtype), src, dst)
    for impl in (reference.compact_kv_, kernels.compact_kv_):
        cache = make_cache(dtype)
        impl(cache, src, dst)
        assert torch.equal(cache, want), impl


@pytest.mark.parametrize("D", [1, 7, 128])
def test_awkward_head_dims(D):
    src = torch.tensor([9, 3, 4], dtype=torch.long)
    want, got = make_cache(torch.float32, D=D), make_cache(torch.float32, D=D)
    reference.compact_kv_(want, src, 2)
    kernels.compact_kv_(got, src, 2)
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "src, dst, message",
    [
        ([1, 2], 39, "exceeds the cache capacity"),
        ([40], 0, "outside"),
        ([-1], 0, "outside"),
    ],
)
def test_bad_arguments_are_refused(src, dst, message):
    cache = make_cache(torch.float32)
    with pytest.raises(RuntimeError, match=message):
        kernels.compact_kv_(cache, torch.tensor(src, dtype=torch.long), dst)


def test_wrong_index_dtype_and_layout_are_refused():
    cache = make_cache(torch.float32)
    with pytest.raises(RuntimeError, match="int64"):
        kernels.compact_kv_(cache, torch.tensor([1], dtype=torch.int32), 0)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.compact_kv_(cache.transpose(3, 4), torch.tensor([1]), 0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_cuda_kernel_matches_reference(case, dtype):
    src_list, dst = CASES[case]
    src = torch.tensor(src_list, dtype=torch.long, device="cuda")
    want = make_cache(dtype).cuda()
    reference.compact_kv_(want, src, dst)
    got = make_cache(dtype).cuda()
    kernels.compact_kv_(got, src, dst)
    assert torch.equal(got, want)
