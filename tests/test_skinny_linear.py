"""skinny_linear (the decode step's matmul) against its reference and against float64 ground truth."""

import pytest
import torch
import torch.nn.functional as F

from tr_engine.model import reference
from tr_engine.model.ops import load_ops

kernels = load_ops("kernels")
# Every test here runs once per CPU kernel tier this machine can run (conftest.cpu_tier).
pytestmark = pytest.mark.usefixtures("cpu_tier")
EVERY_TIER = True  # avx512 too where avx512bf16 runs: its bf16 matmuls are its own (conftest)


def operands(T, K, N, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, K, generator=g).to(dtype), torch.randn(N, K, generator=g).to(dtype)


@pytest.mark.parametrize("T", [1, 2, 7, 16])
@pytest.mark.parametrize("K, N", [(576, 960), (64, 1), (33, 129), (1536, 576), (7, 5)])
def test_float32_matches_float64_truth(T, K, N):
    x, w = operands(T, K, N, torch.float32)
    truth = F.linear(x.double(), w.double())
    got = kernels.skinny_linear(x, w)
    assert got.dtype == torch.float32 and got.shape == (T, N)
    torch.testing.assert_close(got.double(), truth, atol=1e-4 * K**0.5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [1, 5, 16])
def test_half_types_within_twice_the_references_error(dtype, T):
    """flash-attention's rule: kernel error vs the float64 truth at most 2x the reference's own error."""
    x, w = operands(T, 576, 1536, dtype, seed=T)
    truth = F.linear(x.double(), w.double())
    kernel_err = (kernels.skinny_linear(x, w).double() - truth).abs().max().item()
    ref_err = (reference.skinny_linear(x, w).double() - truth).abs().max().item()
    assert kernel_err <= 2 * ref_err + 1e-6, (kernel_err, ref_err)


def test_non_contiguous_x_is_accepted():
    x, w = operands(8, 64, 32, torch.float32)
    x_nc = torch.randn(64, 8).t()  # [8, 64], not contiguous
    torch.testing.assert_close(kernels.skinny_linear(x_nc, w), F.linear(x_nc, w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "x_shape, w_shape, dtype_w, message",
    [
        ((17, 8), (4, 8), torch.float32, "1..16"),
        ((2, 8), (4, 9), torch.float32, "but w is"),
        ((2, 8), (4, 8), torch.bfloat16, "but w is"),
        ((2, 8, 1), (4, 8), torch.float32, "must be"),
    ],
)
def test_bad_arguments_are_refused(x_shape, w_shape, dtype_w, message):
    with pytest.raises(RuntimeError, match=message):
        kernels.skinny_linear(torch.randn(x_shape), torch.randn(w_shape).to(dtype_w))


def test_non_contiguous_w_is_refused():
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.skinny_linear(torch.randn(2, 8), torch.randn(8, 4).t())


def test_engine_linear_routes_by_rows():
    x, w = operands(17, 64, 32, torch.float32)  # more than one row: F.linear, bit for bit
    torch.testing.assert_close(kernels.linear(x, w), F.linear(x, w), atol=0, rtol=0)
    torch.testing.assert_close(kernels.linear(x[:1], w), kernels.skinny_linear(x[:1], w), atol=0, rtol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 16])
def test_cuda_kernel_matches_reference(dtype, rows):
    x, w = operands(rows, 576, 1536, dtype)
    truth = F.linear(x.double(), w.double())
    got = kernels.skinny_linear(x.cuda(), w.cuda()).cpu()
    ref_err = (reference.skinny_linear(x, w).double() - truth).abs().max().item()
    assert (got.double() - truth).abs().max().item() <= 2 * ref_err + 1e-6
