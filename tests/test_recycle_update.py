"""The recycle update (top-k of each tree row's logits into the matrix rows of the tree tokens): the C++ kernel
equals its reference exactly, ties and duplicate tokens included."""

import pytest
import torch

from tr_engine.model import reference
from tr_engine.model.ops import load_ops

kernels = load_ops("kernels")
# Every test here runs once per CPU kernel tier this machine can run (conftest.cpu_tier).
pytestmark = pytest.mark.usefixtures("cpu_tier")


def run_both(tokens, logits, V, k=8):
    want = torch.full((V, k), -1, dtype=torch.long)
    got = want.clone()
    reference.recycle_update_(want, tokens, logits)
    kernels.recycle_update_(got, tokens, logits)
    return want, got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("T", [1, 7, 81, 129])
def test_matches_reference_exactly(dtype, T):
    V = 1000
    g = torch.Generator().manual_seed(T)
    tokens = torch.randint(0, 50, (T,), generator=g)  # duplicates likely
    logits = torch.randn(T, V, generator=g).to(dtype)
    want, got = run_both(tokens, logits, V)
    assert torch.equal(got, want)


def test_ties_go_to_the_lower_token_id():
    V = 300
    logits = torch.zeros(2, V)
    logits[0, [250, 5, 90, 17]] = 3.0  # four-way tie at the top, ids out of order
    logits[0, [299, 1]] = 2.0
    logits[1] = torch.randn(V).round()  # integers in a narrow range: ties everywhere
    tokens = torch.tensor([4, 9])
    want, got = run_both(tokens, logits, V)
    assert torch.equal(got, want)
    assert got[4, :6].tolist() == [5, 17, 90, 250, 1, 299]
    assert got[4, 6:].tolist() == [0, 2]  # then the zeros, lowest ids first


def test_duplicate_tokens_last_row_wins():
    V = 100
    logits = torch.randn(3, V)
    tokens = torch.tensor([7, 3, 7])
    want, got = run_both(tokens, logits, V, k=4)
    assert torch.equal(got, want)
    assert got[7].tolist() == logits[2].topk(4).indices.tolist()


def test_smollm2_shape_and_untouched_rows():
    V, T = 49152, 81
    logits = torch.randn(T, V)
    tokens = torch.randint(0, V, (T,))
    want, got = run_both(tokens, logits, V)
    assert torch.equal(got, want)
    untouched = torch.ones(V, dtype=torch.bool)
    untouched[tokens] = False
    assert (got[untouched] == -1).all()


@pytest.mark.parametrize(
    "table, tokens, logits, message",
    [
        (torch.zeros(10, 2, dtype=torch.long), torch.tensor([10]), torch.randn(1, 10), "outside"),
        (torch.zeros(10, 2, dtype=torch.long), torch.tensor([1]), torch.randn(1, 11), "vocabulary sizes differ"),
        (torch.zeros(10, 2, dtype=torch.int32), torch.tensor([1]), torch.randn(1, 10), "int64"),
        (torch.zeros(10, 2, dtype=torch.long), torch.tensor([1, 2]), torch.randn(1, 10), "logits must be"),
    ],
)
def test_bad_arguments_are_refused(table, tokens, logits, message):
    with pytest.raises(RuntimeError, match=message):
        kernels.recycle_update_(table, tokens, logits)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [1, 81, 129])
def test_cuda_kernel_matches_reference(dtype, T):
    V = 49152
    g = torch.Generator().manual_seed(T)
    tokens = torch.randint(0, 40, (T,), generator=g)
    logits = torch.randn(T, V, generator=g).round().to(dtype)  # rounded: ties everywhere
    want = torch.full((V, 8), -1, dtype=torch.long)
    reference.recycle_update_(want, tokens, logits)
    got = torch.full((V, 8), -1, dtype=torch.long, device="cuda")
    kernels.recycle_update_(got, tokens.cuda(), logits.cuda())
    assert torch.equal(got.cpu(), want)
