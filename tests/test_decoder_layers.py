"""decoder_layers (every decoder layer of a packed CPU model's decode or verify step in one op,
csrc/cpu/decoder_layers.cpp): its reference is the model's module path; a verify row is bit for bit the decode step of
that token; a sequence's rows are the same bits in a batch as alone; and a packed model runs its decode and verify
steps through it."""

import pytest
import torch

from tr_engine.core.tree import ancestor_mask
from tr_engine.model import reference
from tr_engine.model.llama import rms_norm
from tr_engine.model.ops import load_ops

kernels = load_ops("kernels")
# Every test here runs once per CPU kernel tier this machine can run (conftest.cpu_tier).
pytestmark = pytest.mark.usefixtures("cpu_tier")
EVERY_TIER = True  # avx512 too where avx512bf16 runs: its bf16 matmuls are its own (conftest)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=5e-2, rtol=2e-2),
             torch.float16: dict(atol=5e-3, rtol=5e-3)}


def layers(dtype, L=2, E=64, Hq=4, Hkv=2, D=16, F=48, seed=0):
    """L random layers' packed weights and norms (six a layer, the op's order), their dims, and a rotary table for
    64 positions."""
    g = torch.Generator().manual_seed(seed)

    def w(n, k):
        return reference.pack_linear((torch.randn(n, k, generator=g) / k**0.5).to(dtype))

    def norm():
        return (1 + 0.1 * torch.randn(E, generator=g)).to(dtype)

    weights = []
    for _ in range(L):
        weights += [norm(), w((Hq + 2 * Hkv) * D, E), w(E, Hq * D), norm(), w(2 * F, E), w(E, F)]
    angles = torch.arange(64.0)[:, None] * 10000.0 ** (-torch.arange(0, D, 2) / D)[None]
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(dtype)
    return weights, dict(n_heads=Hq, ffn=F, eps=1e-5), (Hkv, D), cos, sin


def run(op, x, weights, dims, cos, sin, positions, kv, slots, prefix_lens, offsets, masks):
    flat = torch.cat([m.reshape(-1) for m in masks])
    return op(x, weights, cos[positions], sin[positions], kv, slots, prefix_lens, offsets, flat, dims["n_heads"],
              dims["ffn"], dims["eps"])


def batch(dtype, seed=1, sizes=(5, 1), slots=(1, 0), prefixes=(7, 3), N=3, S=20, E=64, L=2):
    """x for two sequences (a 5-token tree and a decode step), their positions, masks and a random cache."""
    weights, dims, (Hkv, D), cos, sin = layers(dtype, L=L, E=E)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes), E, generator=g).to(dtype)
    kv = torch.randn(L, N, 2, Hkv, S, D, generator=g).to(dtype)
    masks = [ancestor_mask([0, 0, 0, 1, 1][:n]) for n in sizes]
    depth = [m.sum(1) - 1 for m in masks]
    positions = torch.cat([d + p for d, p in zip(depth, prefixes)])
    offsets = [0, sizes[0], sum(sizes)]
    return x, weights, dims, cos, sin, positions, kv, list(slots), list(prefixes), offsets, masks


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_kernel_computes_the_module_paths_layers(dtype):
    x, weights, dims, cos, sin, positions, kv, slots, prefixes, offsets, masks = batch(dtype)
    theirs = kv.clone()
    got = run(kernels.decoder_layers, x, weights, dims, cos, sin, positions, kv, slots, prefixes, offsets, masks)
    want = run(reference.decoder_layers, x, weights, dims, cos, sin, positions, theirs, slots, prefixes, offsets,
               masks)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    torch.testing.assert_close(kv, theirs, **TOLERANCE[dtype])  # every layer's rotated K and V, in their slots
    assert not torch.equal(got, x)
    one = run(kernels.decoder_layers, x, weights[:6], dims, cos, sin, positions, kv[:1].clone(), slots, prefixes,
              offsets, masks)
    assert not torch.equal(one, got)  # the second layer ran


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_verify_row_is_its_decode_step_bit_for_bit(dtype):
    """Each tree row equals a one-token call with its ancestors' K/V after the prefix in every layer (what plain
    decoding would have cached), at the position its depth gives."""
    x, weights, dims, cos, sin, positions, kv, slots, prefixes, offsets, masks = batch(dtype)
    tree_kv = kv.clone()
    got = run(kernels.decoder_layers, x[:5], weights, dims, cos, sin, positions[:5], tree_kv, [slots[0]],
              [prefixes[0]], [0, 5], [masks[0]])
    P, slot = prefixes[0], slots[0]
    for t in range(5):
        seen = masks[0][t].nonzero().flatten().tolist()  # its ancestors and itself, in index order
        alone = kv.clone()
        for i, j in enumerate(seen[:-1]):  # the ancestors' K/V as the tree call wrote them, after the prefix
            alone[:, slot, :, :, P + i] = tree_kv[:, slot, :, :, P + j]
        one = run(kernels.decoder_layers, x[t : t + 1], weights, dims, cos, sin, positions[t : t + 1], alone, [slot],
                  [P + len(seen) - 1], [0, 1], [torch.ones(1, 1, dtype=torch.bool)])
        assert torch.equal(one, got[t : t + 1]), t
        assert torch.equal(alone[:, slot, :, :, P + len(seen) - 1], tree_kv[:, slot, :, :, P + t]), t


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_sequences_rows_are_the_same_bits_in_a_batch_as_alone(dtype):
    x, weights, dims, cos, sin, positions, kv, slots, prefixes, offsets, masks = batch(dtype)
    together = kv.clone()
    got = run(kernels.decoder_layers, x, weights, dims, cos, sin, positions, together, slots, prefixes, offsets,
              masks)
    for b, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
        alone = kv.clone()
        one = run(kernels.decoder_layers, x[lo:hi], weights, dims, cos, sin, positions[lo:hi], alone, [slots[b]],
                  [prefixes[b]], [0, hi - lo], [masks[b]])
        assert torch.equal(one, got[lo:hi]), b
        assert torch.equal(alone[:, slots[b]], together[:, slots[b]]), b


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_final_norm_weight_after_the_layers_norms_the_output(dtype):
    """weights' 6 L + 1-th tensor is the model's final norm: the output is the layers' through it (the module path's
    rms_norm, to a rounding), each row still alone (the same bits in a batch as alone)."""
    x, weights, dims, cos, sin, positions, kv, slots, prefixes, offsets, masks = batch(dtype)
    final = (1 + 0.1 * torch.randn(64, generator=torch.Generator().manual_seed(9))).to(dtype)
    args = (x, weights + [final], dims, cos, sin, positions)
    got = run(kernels.decoder_layers, *args, kv.clone(), slots, prefixes, offsets, masks)
    want = run(reference.decoder_layers, *args, kv.clone(), slots, prefixes, offsets, masks)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])
    layers_only = run(kernels.decoder_layers, x, weights, dims, cos, sin, positions, kv.clone(), slots, prefixes,
                      offsets, masks)
    torch.testing.assert_close(got, rms_norm(layers_only, final, dims["eps"]), **TOLERANCE[dtype])
    assert not torch.equal(got, layers_only)
    for b, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
        one = run(kernels.decoder_layers, x[lo:hi], weights + [final], dims, cos, sin, positions[lo:hi], kv.clone(),
                  [slots[b]], [prefixes[b]], [0, hi - lo], [masks[b]])
        assert torch.equal(one, got[lo:hi]), b


def test_odd_sizes_pad_the_matmuls_inputs():
    """A hidden size and an FFN size that are odd: bf16 matmuls read column pairs, so the rows are zero-padded."""
    weights, dims, (Hkv, D), cos, sin = layers(torch.bfloat16, E=37, F=23)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 37, generator=g).to(torch.bfloat16)
    kv = torch.randn(2, 1, 2, Hkv, 12, D, generator=g).to(torch.bfloat16)
    args = (x, weights, dims, cos, sin, torch.tensor([4, 5, 6]))
    mask = [torch.ones(3, 3, dtype=torch.bool).tril()]
    got = run(kernels.decoder_layers, *args, kv.clone(), [0], [4], [0, 3], mask)
    want = run(reference.decoder_layers, *args, kv.clone(), [0], [4], [0, 3], mask)
    torch.testing.assert_close(got, want, **TOLERANCE[torch.bfloat16])


def test_silu_and_norm_handle_extreme_values():
    """Gates far outside exp's range give silu = g or 0 (no inf or NaN); a zero row normalises to zero."""
    weights, dims, (Hkv, D), cos, sin = layers(torch.float32, L=1)
    x = torch.zeros(2, 64)
    x[1] = 1e4 * torch.linspace(-1, 1, 64)
    kv = torch.zeros(1, 1, 2, Hkv, 8, D)
    args = (x, weights, dims, cos, sin, torch.tensor([0, 1]), kv, [0], [0], [0, 2], [torch.ones(2, 2).tril().bool()])
    got = run(kernels.decoder_layers, *args)
    want = run(reference.decoder_layers, *[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-4)


@pytest.fixture(scope="module")
def tiny_bf16(tiny_factory):
    return str(tiny_factory("fused-bf16", dtype=torch.bfloat16, vocab_size=300, std=0.5))


def test_a_packed_model_runs_decode_and_verify_steps_as_one_op(tiny_bf16):
    from tr_engine.engine import Engine

    engine = Engine.from_pretrained(tiny_bf16, dtype="bfloat16")
    model = engine.model
    assert model.fused_layers
    calls = []
    ops = model.ops
    real = ops.decoder_layers

    def counted(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    ops.decoder_layers = counted
    try:
        want = engine.generate("a b c a b c", max_new_tokens=12, method="ar").token_ids
        steps = len(calls)
        got = engine.generate("a b c a b c", max_new_tokens=12, method="hybrid").token_ids
    finally:
        ops.decoder_layers = real
    # one call for the prompt (a causal chunk through the same op: row-independent), then one a decode step
    assert steps == 12 and calls[0] == len(engine.prompt_ids("a b c a b c")) and set(calls[1:steps]) == {1}
    assert got == want and len(calls) > steps
    logits = {}
    for fused in (False, True):  # the module path computes the same model, within a rounding
        model.fused_layers = fused
        with torch.inference_mode():
            logits[fused] = model(torch.tensor([5, 6]), torch.tensor([0, 1]), engine.cache.data, 0,
                                  tree_mask=torch.ones(2, 2, dtype=torch.bool).tril())
    torch.testing.assert_close(logits[True], logits[False], atol=0.1, rtol=0.05)
