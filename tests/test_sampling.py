"""Sampling (tr_engine/core/sampling.py, accept_sampled): the processed distribution is the usual one, sampling over a
draft tree gives exactly the model's distribution (a chi-square test against the exact distribution of the first three
tokens, with a biased sampler that must fail it), a seed gives the same tokens with or without drafting, and
temperature 0 is greedy."""

import contextlib
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from curves import CPU_LIKE, FREE
from tr_engine.core import speculative
from tr_engine.core.adaptive import AdaptiveTrees
from tr_engine.core.batch import speculative_generate
from tr_engine.core.decode import plain_generate, prefill
from tr_engine.core.drafters import Draft, PromptLookup, TokenRecycling
from tr_engine.core.hybrid import Hybrid
from tr_engine.core.matrix import RecyclingMatrix
from tr_engine.core.sampling import Sampler, Sampling, greedy, gumbel_noise, probabilities, sample
from tr_engine.core.tree import load_tree
from tr_engine.errors import UserError
from tr_engine.model.kv_cache import KVCache
from tr_engine.model.ops import load_ops
from tr_engine.model.weights import load_model

SMALL_VOCAB = 16


@pytest.fixture(scope="module")
def tiny(tiny_factory):
    folder = tiny_factory("spec", dtype=torch.float64, vocab_size=300, std=0.5)
    return load_model(folder, torch.float64)


@pytest.fixture(scope="module")
def small(tiny_factory):
    """A float64 tiny Llama with a 16-token vocabulary: the tokenizer's folder, its embeddings and LM head cut to
    the first 16 ids (the tests feed ids, so the tokenizer is not used)."""
    folder = tiny_factory("small-vocab", dtype=torch.float64, std=0.5, seed=7)
    config = json.loads((folder / "config.json").read_text())
    if config["vocab_size"] != SMALL_VOCAB:
        config["vocab_size"] = SMALL_VOCAB
        (folder / "config.json").write_text(json.dumps(config))
        weights = load_file(folder / "model.safetensors")
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            weights[name] = weights[name][:SMALL_VOCAB].contiguous()
        save_file(weights, folder / "model.safetensors")
    return load_model(folder, torch.float64)


# --- the processed distribution -------------------------------------------------------------------------------------


def test_probabilities_follow_temperature_top_k_and_top_p():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1000, generator=g, dtype=torch.float64) * 3
    assert torch.allclose(probabilities(logits, Sampling(0.7)), torch.softmax(logits / 0.7, 0))
    p = probabilities(logits, Sampling(1.0, top_k=10))
    top = torch.topk(logits, 10).indices
    assert set(p.nonzero().flatten().tolist()) == set(top.tolist())
    assert torch.allclose(p[top] / p.sum(), torch.softmax(logits[top], 0))
    # top-p: the smallest most-likely set holding >= top_p, by the definition written out.
    for top_p in (0.05, 0.5, 0.9, 0.999):
        full = torch.softmax(logits, 0)
        order = full.argsort(descending=True).tolist()
        kept, mass = set(), 0.0
        for i in order:
            if mass >= top_p:
                break
            kept.add(i)
            mass += float(full[i])
        got = probabilities(logits, Sampling(1.0, top_p=top_p))
        assert set(got.nonzero().flatten().tolist()) == kept, top_p
        assert torch.allclose(got[list(kept)], full[list(kept)])
    flat = torch.zeros(5000, dtype=torch.float64)  # the nucleus needs more than the first 1024 candidates
    assert int((probabilities(flat, Sampling(1.0, top_p=0.4999)) > 0).sum()) == 2500


def test_top_k_and_top_p_match_transformers_warpers():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        logits = torch.randn(1, 300, generator=g) * 2
        for s in (Sampling(0.8, top_k=7), Sampling(1.0, top_p=0.9), Sampling(0.5, top_k=50, top_p=0.8)):
            z = logits / s.temperature
            if s.top_k:
                z = TopKLogitsWarper(s.top_k)(None, z)
            if s.top_p < 1:
                z = TopPLogitsWarper(s.top_p)(None, z)
            hf = torch.softmax(z, -1)[0]
            ours = probabilities(logits[0], s)
            assert torch.allclose(ours / ours.sum(), hf, atol=1e-6), s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_every_temperature_gives_its_limits_distribution(dtype):
    """Any finite temperature in the allowed range, subnormals included (float32 rounds 1e-46 and 5e-324 to 0): the
    probabilities are finite and sum to 1, a tiny temperature puts them all on the best token (shared by exact ties),
    a huge one spreads them evenly, and a draw below float32's normal range is the argmax."""
    from hypothesis import given, settings, strategies as st

    logits = torch.tensor([0.5, 3.0, -1.0, 2.0, 3.0 - 2**-6], dtype=dtype)
    tied = torch.tensor([1.0, 3.0, 3.0, -2.0], dtype=dtype)
    tiny = st.one_of(st.sampled_from([5e-324, 1e-320, 1e-46, 1e-45, 1e-40, 1.1754943508222875e-38, 1e-30]),
                     st.floats(5e-324, 1e-30))

    @settings(max_examples=60, deadline=None)
    @given(t=tiny, seed=st.integers(0, 2**32))
    def greedy_limit(t, seed):
        p = probabilities(logits, Sampling(t))
        assert p.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0] or dtype == torch.bfloat16 and p[1] == p[4] == 0.5, (t, p)
        assert torch.isfinite(p).all() and float(p.sum()) == pytest.approx(1.0)
        q = probabilities(tied, Sampling(t))
        assert q.tolist() == [0.0, 0.5, 0.5, 0.0], (t, q)
        assert Sampler(Sampling(t), seed).draw(logits, 0) in ((1, 4) if dtype == torch.bfloat16 else (1,))

    @settings(max_examples=60, deadline=None)
    @given(t=st.floats(1e-30, 1e300))
    def any_temperature(t):
        p = probabilities(logits, Sampling(t))
        assert torch.isfinite(p).all() and float(p.sum()) == pytest.approx(1.0, rel=1e-6)

    greedy_limit()
    any_temperature()
    assert torch.allclose(probabilities(logits, Sampling(1e300)).double(), torch.full((5,), 0.2, dtype=torch.float64))


def test_gumbel_max_draws():
    p = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3], dtype=torch.float64)
    assert sample(p, torch.tensor([9.0, 0.0, 9.0, 0.1, 0.0], dtype=torch.float64)) == 3  # log p + noise, argmax
    assert sample(p * 4, torch.tensor([9.0, 2.0, 9.0, 0.1, 0.0], dtype=torch.float64)) == 1  # unnormalised is fine
    assert sample(torch.tensor([0.0, 0.0, 1.0]), torch.tensor([50.0, 50.0, -5.0])) == 2  # zero probability: never
    # The frequencies of many draws are the distribution (a loose check; the exact ones are the tests below).
    draws = torch.tensor([sample(p, gumbel_noise(1, j, 5)) for j in range(4000)])
    assert torch.allclose(torch.bincount(draws, minlength=5).double() / 4000, p, atol=0.03)


@pytest.mark.parametrize("ops", ["kernels", "reference"])
def test_greedy_is_argmax_bit_for_bit(ops, cpu_tier):
    """greedy() (the decode loops' argmax: ops.argmax_rows on a CPU, the kernel on every CPU tier, or its reference)
    returns torch.argmax's index on every row: random rows, ties (the lowest id; -0 and +0 tie), NaNs (the first one),
    infinities, all -inf, float64, 1-D, 3-D and empty, one logit, and a vocabulary not in whole chunks."""
    ops = load_ops(ops)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(49152, generator=g), torch.randn(8, 49152, generator=g), torch.randn(0, 1024),
            torch.randn(3, 1000, generator=g), torch.randn(5, 2048, generator=g, dtype=torch.float64),
            torch.randn(2, 3, 130, generator=g), torch.randn(4, 1, generator=g)]
    special = torch.zeros(8, 1024)
    special[0, [5, 700]] = 3.0  # a tie across chunks
    special[1, [900, 3]] = float("nan")
    special[2] = float("-inf")
    special[3, [1023, 130]] = float("inf")
    special[4, [129, 130]] = 2.0  # a tie inside a chunk
    special[5, 1023] = float("nan")
    special[5, 0] = float("inf")
    special[6] = -1.0
    special[6, [70, 9]] = torch.tensor([0.0, -0.0])  # -0 == +0: the first of them
    special[7, 1000] = 1e-30
    for x in rows + [special, special.double()]:
        got, want = greedy(x, ops), x.argmax(dim=-1)
        assert got.shape == want.shape and torch.equal(got, want), x.shape
    assert greedy(special, ops).tolist() == [5, 3, 0, 130, 129, 1023, 9, 1000]


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(temperature=1, top_k=-1), dict(temperature=1, top_p=0),
                                    dict(temperature=1, top_p=1.5), dict(temperature=float("nan"))])
def test_bad_sampling_settings_are_user_errors(kwargs):
    with pytest.raises(UserError, match="--t"):
        Sampling(**kwargs)


def test_the_noise_of_a_position_depends_only_on_the_seed_and_the_position():
    a, b = Sampler(Sampling(1.0), 3), Sampler(Sampling(1.0), 3)
    late = a.noise(300, 100)
    assert all(torch.equal(a.noise(j, 100), b.noise(j, 100)) for j in range(5)) and torch.equal(b.noise(300, 100), late)
    assert not torch.equal(a.noise(1, 100), a.noise(2, 100))
    assert not torch.equal(a.noise(1, 100), Sampler(Sampling(1.0), 4).noise(1, 100))


# --- over draft trees -----------------------------------------------------------------------------------------------


def run(model, drafter, prompt, n, sampling, seed, eos=()):
    cache = KVCache(model.config, 512, torch.float64, "cpu")
    model.set_max_positions(512)
    sampler = Sampler(sampling, seed) if not sampling.greedy else None
    if drafter is None:
        return plain_generate(model, cache, prompt, n, eos, sampler)
    return speculative_generate(model, cache, prompt, drafter, n, eos, model.ops, None, sampler)


def make_drafter(kind: str, vocab: int):
    matrix = RecyclingMatrix(vocab, 8)
    if kind == "pld":
        return PromptLookup("cpu", length=6)
    adaptive = {"tr": None, "tr-adaptive": AdaptiveTrees(CPU_LIKE), "hybrid": AdaptiveTrees(FREE)}[kind]
    tr = TokenRecycling(matrix, load_tree("2.2.2"), adaptive)
    return Hybrid(tr, PromptLookup("cpu", length=6)) if kind == "hybrid" else tr


@pytest.mark.parametrize("kind", ["tr", "tr-adaptive", "pld", "hybrid"])
@pytest.mark.parametrize("sampling", [Sampling(0.5), Sampling(1.0, top_p=0.9), Sampling(1.0, top_k=20)],
                         ids=["t0.5", "t1-p0.9", "t1-k20"])
def test_a_seed_gives_plain_samplings_tokens_with_any_drafter(tiny, kind, sampling):
    """Each committed token is the draw of its position, with or without drafts: same seed, same tokens."""
    g = torch.Generator().manual_seed(11)
    d = make_drafter(kind, tiny.config.vocab_size)  # hot across prompts
    longer = 0
    for i in range(20):
        # Repeated prompts make drafts come true often (prompt lookup copies them; the matrix learns them).
        prompt = torch.randint(0, 300, (int(torch.randint(3, 10, (1,), generator=g)),), generator=g).tolist() * 4
        n = int(torch.randint(1, 40, (1,), generator=g))
        plain = run(tiny, None, prompt, n, sampling, seed=i)
        eos = (plain.token_ids[len(plain.token_ids) // 2],) if i % 3 == 0 else ()
        plain = run(tiny, None, prompt, n, sampling, seed=i, eos=eos)
        drafted = run(tiny, d, prompt, n, sampling, seed=i, eos=eos)
        assert drafted.token_ids == plain.token_ids, (kind, i)
        assert drafted.finish_reason == plain.finish_reason
        longer += sum(a > 1 for a in drafted.accept_lengths)
    # Steps accepted drafts, so the walk descended: dozens for tr and hybrid; prompt lookup and the CPU-sized
    # adaptive tree draft little on a random model's sampled text, but at least once.
    assert longer >= (20 if kind in ("tr", "hybrid") else 1)


def exact_first_tokens(model, prompt, sampling, depth=3) -> dict[tuple, float]:
    """The exact probability of every sequence of the first `depth` new tokens, by enumeration."""
    model.set_max_positions(64)

    def next_probs(prefix):
        cache = KVCache(model.config, 64, torch.float64, "cpu")
        p = probabilities(prefill(model, cache, prompt + list(prefix)), sampling)
        return p / p.sum()

    frontier = [((), 1.0)]
    for _ in range(depth):
        nxt = []
        for prefix, mass in frontier:
            p = next_probs(prefix)
            nxt += [(prefix + (t,), mass * float(p[t])) for t in p.nonzero().flatten().tolist()]
        frontier = nxt
    return dict(frontier)


def distribution_p_value(counts: dict[tuple, int], exact: dict[tuple, float], n: int) -> float:
    """How likely samples this far from the exact distribution are, two ways, Bonferroni-corrected: Pearson's
    chi-square over whole sequences (cells expected below 5 pooled into one), and a z-test of every token's
    frequency at every position (which a shift in one token's probability cannot hide in)."""
    assert sum(counts.values()) == n and set(counts) <= set(exact)  # nothing outside the support
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for seq, p in exact.items():
        e, o = n * p, counts.get(seq, 0)
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
        else:
            stat, cells = stat + (o - e) ** 2 / e, cells + 1
    if pooled_exp > 0:
        stat, cells = stat + (pooled_obs - pooled_exp) ** 2 / pooled_exp, cells + 1
    f64 = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    p_values = [float(torch.special.gammaincc(f64((cells - 1) / 2), f64(stat / 2)))]
    depth = len(next(iter(exact)))
    for pos in range(depth):
        marginal, observed = {}, {}
        for seq, p in exact.items():
            marginal[seq[pos]] = marginal.get(seq[pos], 0.0) + p
        for seq, c in counts.items():
            observed[seq[pos]] = observed.get(seq[pos], 0) + c
        for token, p in marginal.items():
            if n * p * (1 - p) >= 10:  # where the normal approximation holds; rarer tokens are in the chi-square
                z = abs(observed.get(token, 0) / n - p) / math.sqrt(p * (1 - p) / n)
                p_values.append(math.erfc(z / math.sqrt(2)))
    return min(1.0, min(p_values) * len(p_values))


# Runs of 3 tokens per setting: a shift of 0.05 in one token's probability at one position is >= 6.3 standard errors
# (at p = 0.5, the worst case), well beyond the ~4.4 that the Bonferroni-corrected 1e-3 level needs.
SAMPLES = 4000


@contextlib.contextmanager
def one_thread():
    """Thousands of tiny float64 forwards: a second thread costs more in handing out the work than it takes off."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@one_thread()
def tree_samples(model, sampling, prompt, n=SAMPLES) -> tuple[dict[tuple, int], float]:
    """Counts of the first three tokens over n seeded runs of Token Recycling with the paper's tree, hot matrix.
    The runs share one cache, as a chat's turns do: each prefills the prompt's last token only."""
    d = make_drafter("tr", model.config.vocab_size)
    model.set_max_positions(512)
    cache = KVCache(model.config, 512, torch.float64, "cpu")
    counts, steps, tokens = {}, 0, 0
    for seed in range(n):
        cache.length = min(cache.length, len(prompt) - 1)  # the prompt but its last token, cached
        gen = speculative_generate(model, cache, prompt, d, 3, (), model.ops, None, Sampler(sampling, 10_000 + seed))
        key = tuple(gen.token_ids)
        counts[key] = counts.get(key, 0) + 1
        steps, tokens = steps + gen.steps, tokens + len(gen.token_ids) - 1
    return counts, tokens / max(steps, 1)


PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


# Temperature 1, the biased sampler's setting below, and a processed distribution (top-p; temperature goes through the
# same probabilities(), held to its formula above): 4000 runs each, ~12 s here.
@pytest.mark.parametrize("sampling", [Sampling(1.0), Sampling(1.0, top_p=0.9)], ids=["t1", "t1-p0.9"])
def test_tree_sampling_has_the_models_distribution(small, sampling):
    exact = exact_first_tokens(small, PROMPT, sampling)
    counts, mat = tree_samples(small, sampling, PROMPT)
    assert mat > 1.3  # most steps accept a draft: the distribution comes through the tree walk
    p = distribution_p_value(counts, exact, SAMPLES)
    assert p > 1e-3, f"p = {p:.2e}"


def naive_accept(draft, logits, sampler, j):
    """A classic mistake: accept each drafted child with its own probability, else sample afresh at the node."""
    tokens = draft.tokens.tolist()
    rng = torch.Generator().manual_seed(sampler.seed * 7919 + j)
    path, node = [], 0
    while True:
        p = probabilities(logits[node], sampler.sampling)
        p = p / p.sum()
        child = next((c for c in draft.tree.children[node]
                      if float(torch.rand(1, generator=rng)) < float(p[tokens[c]])), None)
        if child is None:
            return path, [tokens[i] for i in path] + [sampler.draw(logits[node], j + len(path))]
        path.append(child)
        node = child


def test_a_biased_tree_sampler_fails_the_same_test(small, monkeypatch):
    sampling = Sampling(1.0)
    monkeypatch.setattr(speculative, "accept_sampled", naive_accept)
    exact = exact_first_tokens(small, PROMPT, sampling)
    counts, _ = tree_samples(small, sampling, PROMPT)
    assert distribution_p_value(counts, exact, SAMPLES) < 1e-6


def test_the_test_sees_a_five_point_shift_in_one_tokens_probability(small):
    """Power without the model: draw SAMPLES sequences from the exact distribution with one first token's
    probability raised by 0.05 (the rest scaled down), for every first token in turn; every one is rejected."""
    sampling = Sampling(1.0)
    exact = exact_first_tokens(small, PROMPT, sampling)
    seqs = list(exact)
    probs = torch.tensor([exact[s] for s in seqs], dtype=torch.float64)
    first = {}
    for i, s in enumerate(seqs):
        first.setdefault(s[0], []).append(i)
    g = torch.Generator().manual_seed(0)
    tested = 0
    for token, idx in first.items():
        mass = float(probs[idx].sum())
        if mass > 0.95:
            continue
        shifted = probs * (1 - 0.05) / (1 - mass)
        shifted[idx] = probs[idx] * (mass + 0.05) / mass
        draws = torch.multinomial(shifted, SAMPLES, replacement=True, generator=g).tolist()
        counts = {}
        for i in draws:
            counts[seqs[i]] = counts.get(seqs[i], 0) + 1
        assert distribution_p_value(counts, exact, SAMPLES) < 1e-3, token
        tested += 1
    assert tested >= 10
    fair = torch.multinomial(probs, SAMPLES, replacement=True, generator=g).tolist()  # and a fair draw passes
    counts = {}
    for i in fair:
        counts[seqs[i]] = counts.get(seqs[i], 0) + 1
    assert distribution_p_value(counts, exact, SAMPLES) > 1e-3


def score_z(p: torch.Tensor, x: torch.Tensor) -> tuple[float, float]:
    """Two statistics of draws x [n], each x[i] drawn from its own exact distribution p[i] ([n, V]) given everything
    before it, both standard normal if every draw has its p (a sum of martingale differences over its standard
    deviation):
    - the most likely token: sum of [x = argmax p] - max p, over sqrt(sum max p (1 - max p)). It is the score test
      for a bias on the most likely token (p_top scaled by a factor), the most powerful test against it for small
      factors;
    - the log-likelihood: sum of log p(x) - E_p log p, over its standard deviation: draws from any other distribution
      (logits computed on a wrong cache, say) move it."""
    q, top = p.max(dim=1)
    logp = torch.where(p > 0, p.log(), torch.zeros_like(p))
    mean = (p * logp).sum(dim=1)
    ll_var = (p * logp * logp).sum(dim=1) - mean**2
    z_top = ((x == top).double() - q).sum() / (q * (1 - q)).sum().sqrt()
    z_ll = (logp.gather(1, x[:, None])[:, 0] - mean).sum() / ll_var.sum().sqrt()
    return float(z_top), float(z_ll)


# Draws of the synthetic walk below (about 6 s). The test's power against a bias f on the most likely token (p_top is
# 1/2 at every step, so the bias shifts it by d = p f / (1 + p (f - 1)) - p, and z's mean is sqrt(WALK_DRAWS) d / 0.5)
# at |z| < 4: f = 1.05: mean 10.9, power > 99.9%; f = 1.03: mean 6.6, power 99.5%; f = 1.02: mean 4.4, power 67%.
WALK_DRAWS = 200_000


def test_the_tree_walk_has_power_against_a_small_bias_on_the_most_likely_token():
    """Where the chi-square test above has power from a shift of about 10% in one token, this one sees 3-5%: many
    draws, made cheap by a synthetic model. The model: a Markov chain over 16 tokens whose most likely next token
    always has probability 1/2 (where such a bias shows most); the drafts: the paper's tree from a matrix holding
    each token's 8 most likely successors. accept_sampled walks each step's tree with the engine's Sampler, so every
    committed token is one of the engine's draws, and the statistics (score_z) hold them to the chain's
    probabilities."""
    V = 16
    g = torch.Generator().manual_seed(0)
    probs = torch.empty(V, V, dtype=torch.float64)
    for c in range(V):
        rest = torch.rand(V - 1, generator=g, dtype=torch.float64) + 0.2
        probs[c, torch.randperm(V, generator=g)] = torch.cat([torch.tensor([0.5], dtype=torch.float64),
                                                              0.5 * rest / rest.sum()])
    logits = probs.log()
    tree = load_tree("2.2.2")
    ranked = probs.argsort(dim=1, descending=True)
    drafts = {}  # root -> the step's draft (the matrix never changes) and its nodes' logits
    for root in range(V):
        tokens = [root]
        for parent, rank in zip(tree.parent.tolist()[1:], tree.rank.tolist()[1:]):
            tokens.append(int(ranked[tokens[parent], rank]))
        tokens = torch.tensor(tokens)
        drafts[root] = (Draft(tree, tokens), logits[tokens])
    sampler, walk, steps = Sampler(Sampling(1.0), 0), [0], 0
    with one_thread():
        while len(walk) <= WALK_DRAWS:
            draft, node_logits = drafts[walk[-1]]
            walk += speculative.accept_sampled(draft, node_logits, sampler, len(walk) - 1)[1]
            steps += 1
    assert (len(walk) - 1) / steps > 1.5  # the walk descends: most draws are taken below the root
    walk = torch.tensor(walk)
    top, ll = score_z(probs[walk[:-1]], walk[1:])
    assert abs(top) < 4 and abs(ll) < 4, (top, ll)


def test_long_sampled_generations_keep_the_models_conditionals(small, monkeypatch):
    """Sampled Token Recycling over 24 tokens a run, so that later steps read K/V that compaction moved: every token
    is held to the model's exact distribution given what came before it, from a fresh prefill of the prompt and the
    run (score_z). Runs share a hot matrix; the test records that accepted nodes moved (paths past rejected
    siblings)."""
    sampling, n, runs = Sampling(1.0), 24, 100
    moved = []
    compact = speculative.compact
    monkeypatch.setattr(speculative, "compact", lambda cache, path, ops:
                        moved.append(path != list(range(1, len(path) + 1))) or compact(cache, path, ops))
    small.set_max_positions(512)
    drafter = make_drafter("tr", small.config.vocab_size)
    cache, fresh = KVCache(small.config, 512, torch.float64, "cpu"), KVCache(small.config, 512, torch.float64, "cpu")
    p, x = [], []
    with one_thread():
        for seed in range(runs):
            cache.length = min(cache.length, len(PROMPT) - 1)  # the prompt but its last token, cached
            out = speculative_generate(small, cache, PROMPT, drafter, n, (), small.ops, None, Sampler(sampling, seed))
            assert len(out.token_ids) == n
            fresh.reset()
            logits = prefill(small, fresh, PROMPT + out.token_ids[:-1], all_logits=True)[len(PROMPT) - 1:]
            p += [probabilities(row, sampling) for row in logits]
            x += out.token_ids
    assert sum(moved) > runs  # more than one step a run read K/V that compaction had moved
    p = torch.stack(p)
    top, ll = score_z(p / p.sum(dim=1, keepdim=True), torch.tensor(x))
    assert abs(top) < 4 and abs(ll) < 4, (top, ll)


@pytest.fixture(scope="module")
def engine(tiny_factory):
    from tr_engine.engine import Engine

    return Engine.from_pretrained(str(tiny_factory("float32", dtype=torch.float64)), dtype="float64", seed=5)


@pytest.mark.parametrize("method", ["ar", "tr", "pld", "hybrid"])
def test_temperature_zero_is_greedy(engine, method):
    greedy = engine.generate("hello there", 24, method="ar").token_ids
    assert engine.generate("hello there", 24, method=method, temperature=0.0, top_k=3, top_p=0.5).token_ids == greedy


def test_engine_sampling_is_seeded_and_method_independent(engine):
    kw = dict(temperature=1.0, top_p=0.95)
    by_method = {m: engine.generate("tell me a story", 32, method=m, seed=7, **kw).token_ids
                 for m in ("ar", "tr", "pld", "hybrid")}
    assert len(set(map(tuple, by_method.values()))) == 1, by_method
    assert engine.generate("tell me a story", 32, method="tr", seed=8, **kw).token_ids != by_method["ar"]
    # Without a per-call seed, calls draw their seeds from the engine's stream: a same-seeded engine repeats them.
    from tr_engine.engine import Engine

    twin = Engine(engine.model, engine.tokenizer, engine.folder, 512, seed=5)
    again = Engine(engine.model, engine.tokenizer, engine.folder, 512, seed=5)
    first = [twin.generate("hi", 16, method=m, **kw).token_ids for m in ("ar", "tr", "ar")]
    second = [again.generate("hi", 16, method=m, **kw).token_ids for m in ("tr", "ar", "hybrid")]
    assert first == second


def test_one_sampling_is_passed_through_untouched_or_built_from_the_keywords(tiny_factory):
    from tr_engine.engine import Engine
    from tr_engine.errors import InvalidType, InvalidValue
    from tr_engine.core.sampling import Sampling, sampling_of

    s = Sampling(0.7, 5, 0.9)
    assert sampling_of(s) is s and sampling_of(None, 0.7, 5, 0.9) == s
    with pytest.raises(InvalidValue, match="not both"):
        sampling_of(s, temperature=0.5)
    with pytest.raises(InvalidType, match="must be a Sampling"):
        sampling_of({"temperature": 0.7})
    engine = Engine.from_pretrained(str(tiny_factory("float32", dtype=torch.float64)), dtype="float64")
    by_keywords = engine.generate("hello", 12, method="hybrid", temperature=0.7, top_k=5, top_p=0.9, seed=3)
    assert engine.generate("hello", 12, method="hybrid", sampling=s, seed=3).token_ids == by_keywords.token_ids
