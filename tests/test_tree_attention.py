"""tree_attention (the attention of decode and verify steps): the C++ kernel against its textbook reference and
against float64 ground truth, over tree masks, causal masks, GQA, head dims, awkward sizes and strided inputs."""

import pytest
import torch

from tr_engine.core.tree import ancestor_mask, build_tree, load_tree
from tr_engine.model import reference
from tr_engine.model.ops import load_ops

kernels = load_ops("kernels")
# Every test here runs once per CPU kernel tier this machine can run (conftest.cpu_tier), avx512bf16 too where amx
# runs: amx's bf16 attention is on the tiles, avx512bf16's in vectors.
pytestmark = pytest.mark.usefixtures("cpu_tier")
EVERY_TIER = True


def random_tree_mask(T: int, g: torch.Generator) -> torch.Tensor:
    """A random tree over T tokens in breadth-first-like order: token i's parent is some j < i."""
    return ancestor_mask([0] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, T)])


def operands(T, P, Hq, Hkv, D, dtype, seed=0, S=None):
    """q as the model makes it (a strided slice of the fused qkv rows) and k/v as views of one layer's cache."""
    g = torch.Generator().manual_seed(seed)
    S = S or P + T + 5
    qkv = torch.randn(T, Hq + 2 * Hkv, D, generator=g).to(dtype)
    kv = torch.randn(2, Hkv, S, D, generator=g).to(dtype)
    return qkv[:, :Hq], kv[0], kv[1], g


def truth(q, k, v, P, mask, scale):
    return reference.tree_attention(q.double(), k.double(), v.double(), P, mask, scale)


@pytest.mark.parametrize("T", [1, 7, 33, 81, 129])
@pytest.mark.parametrize("P", [0, 1, 100, 512])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)], ids=["gqa9x3", "mha4", "mqa8"])
def test_float32_matches_reference(T, P, heads):
    Hq, Hkv = heads
    q, k, v, g = operands(T, P, Hq, Hkv, 64, torch.float32, seed=T * 1000 + P)
    mask = random_tree_mask(T, g)
    got = kernels.tree_attention(q, k, v, P, mask, 0.125)
    torch.testing.assert_close(got, reference.tree_attention(q, k, v, P, mask, 0.125), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("D", [16, 48, 64, 128])
def test_head_dims(D):
    q, k, v, g = operands(33, 70, 6, 2, D, torch.float32, seed=D)
    mask = random_tree_mask(33, g)
    got = kernels.tree_attention(q, k, v, 70, mask, D**-0.5)
    torch.testing.assert_close(got, reference.tree_attention(q, k, v, 70, mask, D**-0.5), atol=2e-6, rtol=2e-5)


def test_the_papers_tree_and_a_causal_mask():
    tree = load_tree("2.2.2")
    q, k, v, _ = operands(tree.size, 300, 9, 3, 64, torch.float32, S=2048)
    for mask in (tree.mask, torch.ones(tree.size, tree.size, dtype=torch.bool).tril()):
        got = kernels.tree_attention(q, k, v, 300, mask, 0.125)
        torch.testing.assert_close(got, reference.tree_attention(q, k, v, 300, mask, 0.125), atol=2e-6, rtol=2e-5)


def test_float64_is_float64_accurate():
    q, k, v, g = operands(20, 37, 4, 2, 32, torch.float64)
    mask = random_tree_mask(20, g)
    torch.testing.assert_close(kernels.tree_attention(q, k, v, 37, mask, 0.3), truth(q, k, v, 37, mask, 0.3),
                               atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,P", [(1, 512), (81, 512), (129, 33)])
def test_half_types_by_the_flash_attention_rule(dtype, T, P):
    """Kernel error vs float64 truth <= 2x the reference's own error when it runs in the same dtype."""
    q, k, v, g = operands(T, P, 9, 3, 64, dtype, seed=T + P)
    mask = random_tree_mask(T, g)
    want = truth(q, k, v, P, mask, 0.125)
    kernel_err = (kernels.tree_attention(q, k, v, P, mask, 0.125).double() - want).abs().max().item()
    ref_err = (reference.tree_attention(q, k, v, P, mask, 0.125).double() - want).abs().max().item()
    assert kernel_err <= 2 * ref_err + 1e-6, (kernel_err, ref_err)


def test_large_scores_do_not_overflow():
    """Softmax subtracts the row maximum: scores of several hundred stay finite, and as accurate as float32 allows
    (the rounding of a score of ~500 is what limits both the kernel and the reference). Over ten draws: one draw's
    error depends on how its few roundings happen to fall, several times the reference's or a fraction of it."""
    err = ref_err = 0.0
    for seed in range(10):
        q, k, v, g = operands(9, 40, 2, 1, 16, torch.float32, seed=seed)
        q = q * 60
        mask = random_tree_mask(9, g)
        want = truth(q, k, v, 40, mask, 1.0)
        got = kernels.tree_attention(q, k, v, 40, mask, 1.0)
        assert torch.isfinite(got).all()
        err += (got.double() - want).abs().max().item()
        ref_err += (reference.tree_attention(q, k, v, 40, mask, 1.0).double() - want).abs().max().item()
    assert err <= 2 * ref_err + 1e-6, (err, ref_err)


def test_only_the_visible_keys_matter():
    """Changing a key that no token sees (a non-ancestor tree slot, or a slot past the tree) changes nothing."""
    tree = build_tree([[0], [1], [0, 0]])  # root 0; 1 = [0], 2 = [1], 3 = [0, 0] (child of 1)
    q, k, v, _ = operands(tree.size, 10, 2, 1, 16, torch.float32)
    before = kernels.tree_attention(q, k, v, 10, tree.mask, 0.25)
    k[:, 10 + 2] += 100  # token 2 is no ancestor of 0, 1 or 3: only its own row may change
    v[:, 10 + tree.size :] = float("nan")  # slots past the tree
    after = kernels.tree_attention(q, k, v, 10, tree.mask, 0.25)
    keep = torch.tensor([0, 1, 3])
    assert torch.equal(after[keep], before[keep])
    assert not torch.equal(after[2], before[2])


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: {**a, "prefix_len": 0, "tree_mask": torch.zeros(3, 3, dtype=torch.bool)}, "sees no key"),
        (lambda a: {**a, "tree_mask": torch.ones(2, 2, dtype=torch.bool)}, "tree_mask must be bool"),
        (lambda a: {**a, "tree_mask": torch.ones(3, 3)}, "tree_mask must be bool"),
        (lambda a: {**a, "prefix_len": 8}, "exceeds the cache"),
        (lambda a: {**a, "q": a["q"].double()}, "share a dtype"),
        (lambda a: {**a, "q": torch.randn(3, 5, 8)}, "not a multiple"),
        (lambda a: {**a, "k": a["k"][:, :, :4], "v": a["v"][:, :, :4]}, "head dim"),
    ],
)
def test_argument_errors_name_the_argument(change, message):
    args = {"q": torch.randn(3, 4, 8), "k": torch.randn(2, 10, 8), "v": torch.randn(2, 10, 8), "prefix_len": 5,
            "tree_mask": torch.ones(3, 3, dtype=torch.bool).tril(), "scale": 0.5}
    args = change(args)
    with pytest.raises(RuntimeError, match=message):
        kernels.tree_attention(**args)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,P,heads,D", [(1, 512, (32, 32), 128), (81, 512, (32, 32), 128), (81, 2048, (9, 3), 64),
                                          (7, 0, (8, 1), 64), (129, 33, (9, 3), 64)])
def test_cuda_kernel(dtype, T, P, heads, D):
    q, k, v, g = operands(T, P, *heads, D, dtype, seed=T + P)
    mask = random_tree_mask(T, g)
    want = truth(q, k, v, P, mask, D**-0.5)
    got = kernels.tree_attention(q.cuda(), k.cuda(), v.cuda(), P, mask.cuda(), D**-0.5).cpu()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want.float(), atol=2e-6, rtol=2e-5)
    else:
        ref_err = (reference.tree_attention(q, k, v, P, mask, D**-0.5).double() - want).abs().max().item()
        assert (got.double() - want).abs().max().item() <= 2 * ref_err + 1e-6


def as_decode_step(q, k, v, P, mask, t):
    """Token t's row the way a plain decode step computes it: its ancestors (in index order) and itself moved into
    the cache right after the P prefix slots, attending as a one-node tree."""
    seen = mask[t].nonzero().flatten()  # its visible tree keys, in index order
    n = len(seen)
    k2, v2 = k.clone(), v.clone()
    k2[:, P : P + n], v2[:, P : P + n] = k[:, P + seen], v[:, P + seen]
    one = torch.ones(1, 1, dtype=torch.bool)
    return kernels.tree_attention(q[t : t + 1], k2, v2, P + n - 1, one, 0.125)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("P", [0, 1, 200, 250, 255, 256, 700])
@pytest.mark.parametrize("heads,D", [((9, 3), 64), ((8, 1), 48), ((4, 4), 64), ((4, 2), 128)],
                         ids=["gqa9x3", "mqa8-d48", "mha4", "gqa4x2-d128"])
def test_a_tree_row_is_bitwise_its_decode_step(dtype, P, heads, D):
    """Row independence: each verify row gives exactly the bits of the plain decode step that sees the same keys, so
    greedy speculative decoding commits the tokens of plain decoding in every dtype (not just to rounding)."""
    T = 40
    q, k, v, g = operands(T, P, *heads, D, dtype, seed=P + D, S=P + T + 5)
    chain = torch.ones(T, T, dtype=torch.bool).tril()  # deep enough to cross a 256-key block from P = 250
    for mask in (random_tree_mask(T, g), chain):
        got = kernels.tree_attention(q, k, v, P, mask, 0.125)
        for t in range(T):
            assert torch.equal(got[t], as_decode_step(q, k, v, P, mask, t)), f"token {t}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,heads", [(2, (9, 3)), (10, (9, 3)), (16, (9, 3)), (3, (4, 1))])
def test_a_block_cut_between_the_threads_is_bitwise_its_decode_steps(dtype, T, heads):
    """The threads take equal shares of the heads' blocks of rows, in half blocks (attention.h): with 3 KV heads on 2
    threads a decode step's middle head, a 10-token verify's middle block (15 blocks of 6 rows) or a 16-token one's on
    the tiles (9 blocks of 16) goes as two tasks, one half of its rows' keys each, merged after them; with one KV head,
    its only block. Each row still has its decode step's bits (whose heads are cut elsewhere, or not at all)."""
    P = 700  # (past two blocks of 256 keys: the rows' keys in halves)
    q, k, v, g = operands(T, P, *heads, 64, dtype, seed=T, S=P + T + 5)
    mask = random_tree_mask(T, g)
    got = kernels.tree_attention(q, k, v, P, mask, 0.125)
    for t in range(T):
        assert torch.equal(got[t], as_decode_step(q, k, v, P, mask, t)), f"token {t}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("P,heads,D", [(P, heads, 64) for heads in ((9, 3), (4, 4)) for P in (0, 250, 511)]
                         + [(250, (4, 2), 128)],  # (128 dims: two 64-dim chunks of the tiles' value pairs)
                         ids=[f"{name}-{P}" for name in ("gqa9x3", "mha4") for P in (0, 250, 511)]
                         + ["gqa4x2-d128-250"])
def test_a_causal_chunk_row_is_bitwise_its_decode_step(dtype, P, heads, D):
    """A prompt's chunk (a causal mask, attended as a prefix each row sees up to itself): each row is the decode step
    at its position, across 256-key blocks and with the rows of one task on both sides of a block's end, so a prompt
    prefilled whole, in chunks or token by token caches the same bits (what prefix reuse relies on). The cache's slots
    past the chunk hold NaN: no key or value past it may reach a sum (AMX's tiles read the values in key pairs laid
    out for a whole head, padded with zeros to 32 keys)."""
    T = 300
    q, k, v, g = operands(T, P, *heads, D, dtype, seed=P + 7, S=P + T + 5)
    k[:, P + T :] = v[:, P + T :] = float("nan")
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    got = kernels.tree_attention(q, k, v, P, causal, 0.125)
    one = torch.ones(1, 1, dtype=torch.bool)
    for t in range(T):
        assert torch.equal(got[t], kernels.tree_attention(q[t : t + 1], k, v, P + t, one, 0.125)[0]), f"token {t}"
    torch.testing.assert_close(got.double(), truth(q, k, v, P, causal, 0.125), atol=2e-2 if dtype == torch.bfloat16
                               else 2e-5, rtol=2e-2 if dtype == torch.bfloat16 else 2e-5)


# tree_attention_dynamic: the prefix length as a device tensor, so that one captured CUDA graph serves every prefix.


@pytest.mark.parametrize("ops", [kernels, reference], ids=["kernels", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("P", [0, 3, 300])
def test_dynamic_prefix_is_bitwise_the_int_prefix(ops, dtype, P):
    q, k, v, g = operands(9, P, 9, 3, 64, dtype, seed=P)
    mask = random_tree_mask(9, g)
    want = ops.tree_attention(q, k, v, P, mask, 0.125)
    assert torch.equal(ops.tree_attention_dynamic(q, k, v, torch.tensor([P]), mask, 0.125), want)
    assert torch.equal(ops.tree_attention_dynamic(q, k, v, torch.tensor(P), mask, 0.125), want)


@pytest.mark.parametrize(
    "prefix,message",
    [(torch.tensor([5.0]), "one-element int64"), (torch.tensor([5, 6]), "one-element int64"),
     (torch.tensor([11]), "exceeds the cache"), (torch.tensor([-1]), "exceeds the cache")],
)
def test_dynamic_prefix_errors(prefix, message):
    q, k, v, _ = operands(3, 5, 4, 2, 8, torch.float32)
    with pytest.raises(RuntimeError, match=message):
        kernels.tree_attention_dynamic(q, k, v, prefix, torch.ones(3, 3, dtype=torch.bool).tril(), 0.5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_dynamic_prefix_replays_in_a_graph(dtype):
    """One graph captured at one prefix gives, replayed at others, what the int-prefix op gives there; a prefix past
    the cache's end is clamped on the device (no read leaves the cache)."""
    T, S = 9, 600
    q, k, v, g = operands(T, 0, 9, 3, 64, dtype, seed=1, S=S)
    q, k, v, mask = q.cuda(), k.cuda(), v.cuda(), random_tree_mask(T, g).cuda()
    prefix = torch.tensor([10], device="cuda")
    out = kernels.tree_attention_dynamic(q, k, v, prefix, mask, 0.125)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.tree_attention_dynamic(q, k, v, prefix, mask, 0.125)
    for P in (0, 10, 333, S - T):
        prefix.fill_(P)
        graph.replay()
        assert torch.equal(out, kernels.tree_attention(q, k, v, P, mask, 0.125)), P
    prefix.fill_(S + 50)
    graph.replay()
    assert torch.equal(out, kernels.tree_attention(q, k, v, S - T, mask, 0.125))


# tree_attention_rows: a batch's places in tensors, so that one captured CUDA graph serves any mix of sequences.


def rows_operands(dtype, seed=0):
    """Three sequences in a 4-slot cache (slots 2, 0, 3 after 40, 0 and 7 cached tokens, trees of 5, 1 and 4 rows),
    then 3 padding rows at the start of slot 0 (read by a sequence too: two sequences may read one slot); as
    tree_attention_batch's arguments and as tree_attention_rows' (rows [T, 3], one [T, T] mask)."""
    g = torch.Generator().manual_seed(seed)
    T, S = 13, 64
    q = torch.randn(T, 9 + 6, 64, generator=g).to(dtype)[:, :9]  # (strided, as the model's)
    kv = torch.randn(2, 4, 3, S, 64, generator=g).to(dtype)
    slots, prefixes, offsets = [2, 0, 3, 0], [40, 0, 7, 20], [0, 5, 6, 10, 13]
    blocks = [random_tree_mask(5, g), torch.ones(1, 1, dtype=torch.bool), random_tree_mask(4, g),
              torch.eye(3, dtype=torch.bool)]
    mask = torch.zeros(T, T, dtype=torch.bool)
    rows = torch.empty(T, 3, dtype=torch.long)
    for slot, prefix, lo, hi, block in zip(slots, prefixes, offsets, offsets[1:], blocks):
        mask[lo:hi, lo:hi] = block
        rows[lo:hi] = torch.tensor([slot, prefix, lo])
    flat = torch.cat([b.reshape(-1) for b in blocks])
    return q, kv[0], kv[1], (slots, prefixes, offsets, flat), rows, mask


@pytest.mark.parametrize("ops", [kernels, reference], ids=["kernels", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_form_is_bitwise_the_batch_form(ops, dtype):
    """Each sequence's rows are bit for bit tree_attention's on its own slot (tree_attention_batch's contract; that op
    refuses two sequences in one slot, so each is compared with its own call)."""
    q, k, v, ragged, rows, mask = rows_operands(dtype)
    slots, prefixes, offsets, _ = ragged
    got = ops.tree_attention_rows(q, k, v, rows, mask, 0.125)
    for slot, prefix, lo, hi in zip(slots, prefixes, offsets, offsets[1:]):
        one = ops.tree_attention(q[lo:hi], k[slot], v[slot], prefix, mask[lo:hi, lo:hi], 0.125)
        assert torch.equal(got[lo:hi], one), (slot, prefix)


@pytest.mark.parametrize(
    "change,message",
    [(lambda r, m: r.index_put_((torch.tensor([1]), torch.tensor([2])), torch.tensor(2)), "names row 2 as its first"),
     (lambda r, m: r.__setitem__((slice(0, 5), 0), 4), "outside the cache's 4 slots"),
     (lambda r, m: r.__setitem__((4, 1), 41), "names another slot or prefix"),
     (lambda r, m: r.__setitem__((slice(0, 5), 1), 60), r"needs 60 \+ 5 positions but the cache holds 64"),
     (lambda r, m: m.__setitem__((7, 2), True), "row 7 sees row 2 of another sequence")],
    ids=["first", "slot", "shared", "room", "crossing"])
def test_rows_form_errors(change, message):
    q, k, v, _, rows, mask = rows_operands(torch.float32)
    change(rows, mask)
    with pytest.raises(RuntimeError, match=message):
        kernels.tree_attention_rows(q, k, v, rows, mask, 0.125)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_rows_form_replays_in_a_graph(dtype):
    """One graph captured with one batch's places gives, replayed with another's (other prefixes, slots and trees),
    what the one-sequence op gives for each sequence there."""
    q, k, v, ragged, rows, mask = (x.cuda() if isinstance(x, torch.Tensor) else x for x in rows_operands(dtype))
    out = kernels.tree_attention_rows(q, k, v, rows, mask, 0.125)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.tree_attention_rows(q, k, v, rows, mask, 0.125)
    _, _, _, (slots, prefixes, offsets, _), other_rows, other_mask = rows_operands(dtype, seed=1)
    other_rows[:5, :2] = torch.tensor([1, 51])  # the first sequence moves to slot 1, after 51 tokens
    rows.copy_(other_rows)
    mask.copy_(other_mask)
    graph.replay()
    slots[0], prefixes[0] = 1, 51
    for slot, prefix, lo, hi in zip(slots, prefixes, offsets, offsets[1:]):
        one = kernels.tree_attention(q[lo:hi], k[slot], v[slot], prefix, mask[lo:hi, lo:hi], 0.125)
        assert torch.equal(out[lo:hi], one), (slot, prefix)


def test_one_op_swapped_for_its_reference_by_spec():
    """--ops kernels,tree_attention=reference: that op is the reference's, every other one the kernel's."""
    from tr_engine.errors import UserError
    from tr_engine.model.ops import parse_ops

    ops = load_ops("kernels,tree_attention=reference")
    assert ops.tree_attention is reference.tree_attention
    assert ops.compact_kv_ is kernels.compact_kv_ and ops.pack is not None
    assert parse_ops("reference,recycle_update_=kernels") == ("reference", {"recycle_update_": "kernels"})
    for bad in ("kernel", "kernels,tree_attention", "kernels,nope=reference", "kernels,tree_attention=fast"):
        with pytest.raises(UserError, match="ops"):
            load_ops(bad)
