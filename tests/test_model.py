"""The hand-written Llama computes what transformers' LlamaForCausalLM computes, and its cached incremental forward
gives the logits of a full forward."""

import pytest
import torch

from hf_reference import hf_logits, load_hf
from tr_engine.core.decode import plain_generate
from tr_engine.model.kv_cache import KVCache
from tr_engine.model.weights import load_model


def our_logits(model, ids, dtype):
    model.set_max_positions(len(ids))
    cache = KVCache(model.config, len(ids), dtype, "cpu")
    with torch.inference_mode():
        return model(torch.tensor(ids), torch.arange(len(ids)), cache.data, 0)


CASES = {
    # name: (tiny_llama kwargs, dtype, tolerance)
    "float64": (dict(num_kv_heads=4), torch.float64, 1e-8),
    "gqa": (dict(num_heads=8, num_kv_heads=2, hidden_size=64), torch.float64, 1e-8),
    "llama3_rope": (dict(rope_scaling="llama3", max_positions=256), torch.float64, 1e-8),
    "linear_rope": (dict(rope_scaling="linear"), torch.float64, 1e-8),
    "tied_sentencepiece": (dict(tokenizer="sentencepiece", tie_word_embeddings=True), torch.float64, 1e-8),
    "head_dim_128_sharded": (dict(hidden_size=128, num_heads=2, num_kv_heads=1, head_dim=128, shards=3),
                             torch.float64, 1e-8),
    "float32": (dict(), torch.float32, 1e-4),
}


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(tiny_factory, case):
    kwargs, dtype, tol = CASES[case]
    folder = tiny_factory(case, dtype=torch.float64, **kwargs)
    g = torch.Generator().manual_seed(1)
    # 200 tokens reach past llama3's original_max_position_embeddings (64), where its scaling matters.
    ids = torch.randint(0, 300, (200,), generator=g).tolist()
    ours = our_logits(load_model(folder, dtype), ids, dtype)
    ref = hf_logits(load_hf(folder, dtype), ids)
    assert ours.dtype == torch.float32 or dtype == torch.float64
    err = (ours.double() - ref.double()).abs().max().item()
    assert err <= tol, f"max |ours - transformers| = {err:.3g} > {tol}"


def test_incremental_decode_matches_full_forward(tiny_factory):
    """Prefill 20 tokens, then feed 1, then 5, then 1: every step's logits equal the full forward's (fp32, 1e-4)."""
    folder = tiny_factory("float32", dtype=torch.float64)
    model = load_model(folder, torch.float32)
    ids = torch.randint(0, 300, (27,), generator=torch.Generator().manual_seed(2))
    full = our_logits(model, ids.tolist(), torch.float32)
    model.set_max_positions(64)
    cache = KVCache(model.config, 64, torch.float32, "cpu")
    pieces = []
    with torch.inference_mode():
        for a, b in [(0, 20), (20, 21), (21, 26), (26, 27)]:
            pieces.append(model(ids[a:b], torch.arange(a, b), cache.data, a))
    torch.testing.assert_close(torch.cat(pieces), full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_models_prompt_caches_the_same_bits_whole_in_chunks_or_token_by_token(tiny_factory, dtype, cpu_tier):
    """Row independence reaches the prompt: a packed CPU model's prompt chunk runs through the decode steps' op, so a
    prompt prefilled whole, in chunks (a conversation's turns, a server slot's reused prefix) or one token at a time
    gives the same logits and caches the same K/V, bit for bit, across a 256-key block of the attention; on every CPU
    kernel tier."""
    folder = tiny_factory("packed-prompt", dtype=torch.bfloat16, vocab_size=300, std=0.5)
    model = load_model(folder, dtype)
    assert model.fused_layers  # (the compiled kernels' packed model: the layers as one op)
    ids = torch.randint(0, 300, (300,), generator=torch.Generator().manual_seed(3))
    model.set_max_positions(320)
    runs = []
    for fused, cuts in [(True, (0, 300)), (True, (0, 100, 101, 257, 300)), (True, (0, 250, *range(251, 301))),
                        (False, (0, 300)), (False, (0, 120, 300))]:  # (False: the module path, as under --tp)
        model.fused_layers = fused
        cache = KVCache(model.config, 320, dtype, "cpu")
        with torch.inference_mode():
            logits = torch.cat([model(ids[a:b], torch.arange(a, b), cache.data, a) for a, b in zip(cuts, cuts[1:])])
        runs.append((logits, cache.data[:, :, :, :300].clone()))
    for logits, kv in runs[1:3]:
        assert torch.equal(logits, runs[0][0]) and torch.equal(kv, runs[0][1])
    assert torch.equal(runs[4][0], runs[3][0]) and torch.equal(runs[4][1], runs[3][1])


def test_tree_mask_equals_separate_causal_branches(tiny_factory):
    """Two branches verified in one forward with a tree mask give each branch's causal logits (the verify contract)."""
    folder = tiny_factory("float32", dtype=torch.float64)
    model = load_model(folder, torch.float64)
    model.set_max_positions(64)
    prefix = [5, 17, 42, 9]
    a, b = [7, 8, 9], [11, 12]  # branch a: depth 1..3; branch b: depth 1..2, both children of the prefix's end
    with torch.inference_mode():
        want_a = our_logits(model, prefix + a, torch.float64)[len(prefix):]
        want_b = our_logits(model, prefix + b, torch.float64)[len(prefix):]
        model.set_max_positions(64)
        cache = KVCache(model.config, 64, torch.float64, "cpu")
        model(torch.tensor(prefix), torch.arange(4), cache.data, 0)
        mask = torch.zeros(5, 5, dtype=torch.bool)
        for i, ancestors in enumerate([[0], [0, 1], [0, 1, 2], [3], [3, 4]]):
            mask[i, ancestors] = True
        positions = torch.tensor([4, 5, 6, 4, 5])
        got = model(torch.tensor(a + b), positions, cache.data, 4, tree_mask=mask)
    torch.testing.assert_close(got[:3], want_a, atol=1e-10, rtol=0)
    torch.testing.assert_close(got[3:], want_b, atol=1e-10, rtol=0)


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2, smollm2_hf):
    """SmolLM2-135M fp32 on a 64-token prompt: logits within 1e-3, and the same 64-token greedy continuation."""
    text = ("Token Recycling is a speculative decoding method. It stores candidate tokens in an adjacency matrix "
            "and retrieves a draft tree from it at every step, then verifies the whole tree in a single forward pass "
            "of the model, so that several tokens can be accepted at once. The matrix is updated after every step with the "
            "top candidates the model predicted, which become the drafts of the steps that follow.")
    ids = smollm2.tokenizer.encode(text)[:64]
    assert len(ids) == 64
    ours = our_logits(smollm2.model, ids, torch.float32)
    smollm2.model.set_max_positions(smollm2.cache.capacity)
    ref = hf_logits(smollm2_hf, ids)
    err = (ours - ref).abs().max().item()
    assert err <= 1e-3, f"max |ours - transformers| = {err:.3g}"

    # No EOS stop on either side, so both produce exactly 64 tokens.
    smollm2.cache.reset()
    ours = plain_generate(smollm2.model, smollm2.cache, ids, 64, eos_ids=()).token_ids
    with torch.no_grad():
        hf_out = smollm2_hf.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                                     pad_token_id=0)[0, 64:].tolist()
    assert len(ours) == 64 and ours == hf_out
