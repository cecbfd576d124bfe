"""pack_linear / packed_linear (the CPU engine's projections) against their references and float64 ground truth."""

import pytest
import torch
import torch.nn.functional as F

from tr_engine.model import reference
from tr_engine.model.ops import PackedWeight, load_ops

kernels = load_ops("kernels")
# Every test here runs once per CPU kernel tier this machine can run (conftest.cpu_tier).
pytestmark = pytest.mark.usefixtures("cpu_tier")
EVERY_TIER = True  # avx512 too where avx512bf16 runs: its bf16 matmuls are its own (conftest)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def operands(T, K, N, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, K, generator=g).to(dtype), torch.randn(N, K, generator=g).to(dtype)


# Awkward shapes: N off the 32-row block, K odd (bf16 packs pairs), one output, and SmolLM2's projections.
SHAPES = [(576, 960), (1536, 576), (64, 1), (33, 129), (7, 5), (2, 33)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K, N", SHAPES)
def test_pack_is_the_references_layout_exactly(dtype, K, N):
    _, w = operands(1, K, N, dtype)
    wp = kernels.pack_linear(w)
    assert torch.equal(wp, reference.pack_linear(w))
    P = 2 if dtype == torch.bfloat16 else 1
    assert wp.shape == ((N + 31) // 32, (K + P - 1) // P, 32, P)
    assert wp[0, 0, 0, 0] == w[0, 0] and wp[-1, -1, (N - 1) % 32, (K - 1) % P] == w[-1, -1]


# Row counts: 1 (a decode step), up to and past an 8-row register tile, a tree, past a 192-row chunk (a prefill).
@pytest.mark.parametrize("T", [1, 5, 8, 9, 12, 13, 33, 81, 200])
@pytest.mark.parametrize("K, N", SHAPES)
def test_float32_matches_float64_truth(T, K, N):
    x, w = operands(T, K, N, torch.float32, seed=T)
    got = kernels.packed_linear(x, kernels.pack_linear(w), N)
    assert got.dtype == torch.float32 and got.shape == (T, N)
    torch.testing.assert_close(got.double(), F.linear(x.double(), w.double()), atol=1e-5 * K**0.5, rtol=1e-5)


@pytest.mark.parametrize("T", [1, 7, 16, 81])
@pytest.mark.parametrize("K, N", [(576, 960), (1536, 576), (33, 129)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_types_within_twice_the_references_error(T, K, N, dtype):
    """flash-attention's rule: kernel error vs the float64 truth at most 2x the reference's own error."""
    x, w = operands(T, K, N, dtype, seed=T)
    wp = kernels.pack_linear(w)
    truth = F.linear(x.double(), w.double())
    kernel_err = (kernels.packed_linear(x, wp, N).double() - truth).abs().max().item()
    ref_err = (reference.packed_linear(x, wp, N).double() - truth).abs().max().item()
    assert kernel_err <= 2 * ref_err + 1e-6, (kernel_err, ref_err)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K, N", [(576, 960), (1000, 100)])
def test_a_rows_output_does_not_depend_on_the_other_rows(dtype, K, N):
    """Each output is one float32 sum over K in a fixed order, whatever the number of rows in the call: a token's
    projections are bit for bit the same in a 1-token decode step and an 81-token verify (and a prefill)."""
    x, w = operands(200, K, N, dtype)
    wp = kernels.pack_linear(w)
    whole = kernels.packed_linear(x, wp, N)
    # (float32 with AVX2: tiles of 6 rows and a last one of 1-3 rows over the whole block at 7-9 and 13-15; f16:
    # widened in registers up to 12 rows, past that once per chunk; bf16: near-equal tiles of 4-6 rows, x's rows side
    # by side in each, widened in registers up to 64 rows, past that once per chunk; bf16 on AMX: passes of 32 rows,
    # tiles of 16, and K = 1000 ends in a part step of 4 pairs)
    for T in (1, 2, 3, 5, 7, 8, 9, 10, 11, 12, 13, 14, 16, 17, 31, 32, 33, 48, 64, 65, 81, 193):
        assert torch.equal(kernels.packed_linear(x[:T], wp, N), whole[:T])
    assert torch.equal(kernels.packed_linear(x[150:151], wp, N), whole[150:151])


def test_weights_are_packed_one_after_another_in_huge_page_chunks():
    """Weights of up to 8 MB are carved, in packing order, out of shared 64 MB chunks aligned to 2 MB pages (a step
    streams them as one run, through few TLB entries): each starts on the 4 KB page after the one before, unless it
    opens a new chunk. Bigger weights start on a 2 MB page of their own. A chunk outlives the packing call that
    opened it as long as a weight in it lives."""
    huge, page = 2 << 20, 4096
    ws = [kernels.pack_linear(torch.ones(n, 576, dtype=torch.bfloat16)) for n in (960, 576, 3072, 576)]
    for a, b in zip(ws, ws[1:]):
        after = a.data_ptr() + (a.numel() * 2 + page - 1) // page * page
        assert b.data_ptr() == after or b.data_ptr() % huge == 0
        assert torch.equal(b, reference.pack_linear(torch.ones(b.shape[0] * 32, 576, dtype=torch.bfloat16)))
    big = kernels.pack_linear(torch.ones(8192, 576, dtype=torch.float32))  # 18.9 MB
    assert big.data_ptr() % huge == 0
    assert big.unique().tolist() == [1.0]


def test_non_contiguous_x_is_accepted():
    _, w = operands(1, 64, 40, torch.float32)
    x = torch.randn(64, 9).t()  # [9, 64], not contiguous
    torch.testing.assert_close(kernels.packed_linear(x, kernels.pack_linear(w), 40), F.linear(x, w),
                               atol=1e-5, rtol=1e-5)


def test_engine_linear_takes_packed_weights_in_both_op_kinds():
    x, w = operands(9, 64, 40, torch.bfloat16)
    packed = kernels.pack(w)
    assert isinstance(packed, PackedWeight) and packed.n == 40
    assert torch.equal(kernels.linear(x, packed), kernels.packed_linear(x, packed.data, 40))
    assert torch.equal(load_ops("reference").linear(x, packed), reference.packed_linear(x, packed.data, 40))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: kernels.pack_linear(torch.randn(4, 8, dtype=torch.float64)), "float32, bfloat16 and float16"),
        (lambda: kernels.pack_linear(torch.randn(8)), "must be"),
        (lambda: kernels.packed_linear(torch.randn(2, 9), kernels.pack_linear(torch.randn(4, 8)), 4), "K = 9"),
        (lambda: kernels.packed_linear(torch.randn(2, 8), kernels.pack_linear(torch.randn(4, 8)), 40), "n = 40"),
        (lambda: kernels.packed_linear(torch.randn(2, 8).bfloat16(), kernels.pack_linear(torch.randn(4, 8)), 4),
         "but wp is"),
        (lambda: kernels.packed_linear(torch.randn(2, 8), torch.randn(1, 8, 16, 1), 4), "from pack_linear"),
    ],
)
def test_bad_arguments_are_refused(make, message):
    with pytest.raises(RuntimeError, match=message):
        make()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])  # (float32: tests/test_op_contract.py)
def test_opcheck(dtype):
    x, w = operands(3, 64, 40, dtype)
    torch.library.opcheck(torch.ops.tr_engine.pack_linear, (w,))
    torch.library.opcheck(torch.ops.tr_engine.packed_linear, (x, kernels.pack_linear(w), 40))
