"""Cost-aware adaptive trees and hybrid drafting (tr_engine/core/adaptive.py, tr_engine/core/cost.py): lossless like
every drafter, and the choices follow the statistics and the cost curve they are given."""

import dataclasses
import json

import pytest
import torch

from curves import CPU_LIKE, FREE, LINEAR, curve
from tr_engine.core.adaptive import CONTEXTS, DEPTHS, EDGES, AdaptiveTrees, Candidates, ChainStats, ConfidenceStats, \
    StepTimes, confidence_bin
from tr_engine.core.batch import speculative_generate
from tr_engine.core.cost import BUCKETS, PREFIXES, PRIOR_PER_TOKEN, CostModel, cost_key, cost_path
from tr_engine.core.decode import plain_generate
from tr_engine.core.drafters import PromptLookup, TokenRecycling
from tr_engine.core.hybrid import Hybrid
from tr_engine.core.matrix import RecyclingMatrix
from tr_engine.core.tree import build_tree, graft, load_tree
from tr_engine.model.kv_cache import KVCache
from tr_engine.model.weights import load_model


@pytest.fixture(scope="module")
def tiny(tiny_factory):
    folder = tiny_factory("spec", dtype=torch.float64, vocab_size=300, std=0.5)
    return load_model(folder, torch.float64)


def generate(model, drafter, prompt, n, eos=()):
    cache = KVCache(model.config, 512, torch.float64, "cpu")
    model.set_max_positions(512)
    if drafter is None:
        return plain_generate(model, cache, prompt, n, eos)
    return speculative_generate(model, cache, prompt, drafter, n, eos, model.ops)


def drafter(kind: str, cost: CostModel | None, vocab: int):
    matrix = RecyclingMatrix(vocab, 8)
    adaptive = AdaptiveTrees(cost) if cost is not None else None
    tr = TokenRecycling(matrix, load_tree("2.2.2"), adaptive)
    return Hybrid(tr, PromptLookup("cpu", length=6)) if kind == "hybrid" else tr


@pytest.mark.parametrize("kind,cost", [("tr", FREE), ("tr", CPU_LIKE), ("hybrid", FREE), ("hybrid", CPU_LIKE),
                                       ("hybrid", None)], ids=["tr-free", "tr-cpu", "hybrid-free", "hybrid-cpu",
                                                               "hybrid-static"])
def test_adaptive_and_hybrid_are_lossless_on_30_prompts(tiny, kind, cost):
    g = torch.Generator().manual_seed(5)
    d = drafter(kind, cost, tiny.config.vocab_size)  # kept across prompts: hot matrix, learned statistics
    accepted = 0
    for i in range(30):
        prompt = torch.randint(0, 300, (int(torch.randint(3, 10, (1,), generator=g)),), generator=g).tolist() * 3
        n = int(torch.randint(1, 40, (1,), generator=g))
        ar = generate(tiny, None, prompt, n)
        eos = (ar.token_ids[len(ar.token_ids) // 2],) if i % 3 == 0 else ()
        ar = generate(tiny, None, prompt, n, eos)
        got = generate(tiny, d, prompt, n, eos)
        assert got.token_ids == ar.token_ids, (i, kind)
        assert got.finish_reason == ar.finish_reason
        accepted += sum(a >= 2 for a in got.accept_lengths)
    assert accepted >= 5  # drafts were accepted, so acceptance and compaction were exercised


def test_confidence_stats_learn_how_often_each_confidence_is_right():
    stats = ConfidenceStats()
    sure, unsure = confidence_bin(0.9), confidence_bin(0.03)
    for _ in range(200):  # the candidate of confidence 0.9 is right at every depth, the others never
        stats.observe([[10, 11, 12, 13]] * 3, [[0.03, 0.03, 0.9, 0.04]] * 3, [12, 12, 12])
    rates = stats.rates()
    assert rates[0][sure] > 0.9 and rates[0][unsure] < 0.05
    assert rates[DEPTHS - 1][sure] > 0.9  # the deepest class too (observed here)
    untouched = confidence_bin(0.5)
    assert rates[0][untouched] == pytest.approx(stats.prior[untouched])  # no observation: the prior
    stats.observe([[5, 5, 5, 5]], [[0.25, 0.25, 0.25, 0.25]], [5])  # duplicates in a row: the first rank is right
    quarter = confidence_bin(0.25)
    assert stats.hits[0][quarter] == pytest.approx(1.0, rel=0.01)  # one hit among four tries, decayed a little
    assert stats.tries[0][quarter] == pytest.approx(4.0, rel=0.01)
    assert [confidence_bin(c) for c in (0.0, EDGES[0], 1.0)] == [0, 1, len(EDGES)]


def matrix_with(rows: dict, k: int = 8, vocab: int = 64) -> RecyclingMatrix:
    """A matrix whose row t holds rows[t] = (ids, confidences); the rest never written."""
    m = RecyclingMatrix(vocab, k)
    for t, (ids, conf) in rows.items():
        m.table[t] = torch.tensor(ids)
        m.confidence[t] = torch.tensor(conf, dtype=torch.float16)
    return m


def sure_chain(vocab: int = 64, k: int = 8) -> RecyclingMatrix:
    """Token t's rank-0 candidate is t+1 with confidence 0.97; the other candidates are unlikely."""
    return matrix_with({t: ([(t + 1 + r) % vocab for r in range(k)], [0.97] + [0.004] * (k - 1))
                        for t in range(vocab)}, k, vocab)


def trained(trees: AdaptiveTrees, k: int = 8, contexts=range(len(CONTEXTS))) -> AdaptiveTrees:
    for _ in range(300):  # confident candidates are always right, the others never (in each of these contexts)
        for context in contexts:
            trees.observe([list(range(k))] * 6, [[0.97] + [0.004] * (k - 1)] * 6, [0] * 6, context)
    return trees


def plan(trees, m, root=0, prefix=100, chain=(), values=()):
    """One sequence's plan: (tree, the chain tokens it adds: their node indices, 1 the first)."""
    return trees.plan(m.table, m.confidence, [root], [prefix], [Candidates.chain(root, list(chain), list(values))])[0]


def test_trees_follow_the_confident_candidates_and_are_prefix_closed():
    trees = trained(AdaptiveTrees(FREE, max_tokens=32))
    tree, m = plan(trees, sure_chain())
    assert tree.size == 32 and m == []  # trees are free: the biggest
    assert {(0,) * d for d in range(1, 13)} <= set(tree.paths)  # the whole sure chain, to the depth limit
    assert max(map(len, tree.paths)) == AdaptiveTrees.MAX_DEPTH
    assert set(p[:-1] for p in tree.paths if len(p) > 1) <= set(tree.paths)  # every parent is in the tree
    assert plan(trees, sure_chain())[0] is tree  # a shape is built once


def test_size_follows_the_cost_curve_and_the_confidence():
    trees = trained(AdaptiveTrees(LINEAR))
    assert plan(trees, sure_chain())[0].size == 1  # nothing pays: a plain decode step
    trees.cost = CPU_LIKE
    T = plan(trees, sure_chain())[0].size
    assert 2 < T < 128  # a long sure chain pays, a bushy tree does not
    unsure = matrix_with({0: (list(range(1, 9)), [0.125] * 8)})  # a flat row: nothing worth drafting
    assert plan(trees, unsure)[0].size <= 2
    assert plan(trees, matrix_with({}))[0].size <= 2 and trees.expected < 1.01  # a row never written (confidence 0)
    trees.cost = FREE
    assert plan(trees, sure_chain())[0].size == 128


def test_step_times_correct_the_curve_online():
    trees = trained(AdaptiveTrees(CPU_LIKE))
    m = sure_chain()
    T = plan(trees, m)[0].size
    assert trees.times.curve(100) == dict(zip(BUCKETS, CPU_LIKE.curve(100)))  # nothing observed: the calibration
    predicted = CPU_LIKE.seconds(T, 100)
    for _ in range(100):  # steps of this size take 3x what the calibration said (the machine slowed, say)
        trees.observe_step(T, 100, 3 * predicted)
    assert trees.times.factor[T] == pytest.approx(3.0, rel=0.01)
    now = trees.times.curve(100)
    assert now[T] == pytest.approx(3 * CPU_LIKE.cost(T, 100), rel=0.01)
    assert now[BUCKETS[-1]] == pytest.approx(3 * CPU_LIKE.cost(BUCKETS[-1], 100), rel=0.01)  # borrowed
    for _ in range(200):  # while plain steps cost what was said: every draft is dearer, relative to them
        trees.observe_step(1, 100, CPU_LIKE.seconds(1, 100))
    assert trees.times.factor[1] == pytest.approx(1.0, rel=0.01)
    assert plan(trees, m)[0].size < T
    f = trees.times.factor[1]
    trees.observe_step(1, 100, 1000.0)  # one outlier (a preemption) moves a factor by at most 1/32 of 2x
    assert trees.times.factor[1] == pytest.approx(f * (1 + 1 / 32), rel=1e-9)
    before = trees.times
    trees.cost = CPU_LIKE  # the same curve again (each decode call sets it): the corrections stay
    assert trees.times is before
    trees.cost = ones = curve(lambda T: 1.0)  # a new calibration: learn afresh
    assert trees.times.factor == {} and trees.times.model is ones
    zero = CostModel((1,), (0, 0), [[1.0], [1.0]], [0.0, 0.0], {})  # a cache too small to measure: no timings
    trees.cost = zero
    trees.observe_step(1, 10, 0.01)
    assert trees.times.factor == {}


def test_a_bucket_not_stepped_takes_the_factor_of_the_nearest_one_stepped():
    """Each size's correction is its own bucket's factor once stepped, else the nearest stepped bucket's (the bigger on
    a tie); which bucket that is changes as buckets are stepped first, and the curve follows."""
    times = StepTimes(CPU_LIKE)
    times.observe(16, 100, 2 * CPU_LIKE.seconds(16, 100))  # 16 tokens (bucket 10) took twice the calibration's time
    f16 = times.factor[16]
    assert f16 == pytest.approx(1.25)  # (a first step moves its bucket a quarter of the way: PRIOR)
    assert list(times.curve(100).values()) == pytest.approx([f16 * c for c in CPU_LIKE.curve(100)])
    times.observe(1, 100, CPU_LIKE.seconds(1, 100))  # a plain step (bucket 0) took what it said
    f1 = times.factor[1]
    assert f1 == pytest.approx(f16 + (1 - f16) / 4)  # (from the factor it borrowed, 16's)
    factors = [now / c for now, c in zip(times.curve(100).values(), CPU_LIKE.curve(100))]
    assert factors == pytest.approx([f1] * 5 + [f16] * (len(BUCKETS) - 5))  # 6 tokens (bucket 5): a tie, the bigger
    times.observe(6, 100, 3 * f16 * CPU_LIKE.seconds(6, 100))
    f6 = times.factor[6]
    assert f6 == pytest.approx(f16 * 1.25)  # (3x its borrowed factor, clipped to 2x, a quarter of the way there)
    assert times.curve(100)[5] == pytest.approx(f6 * CPU_LIKE.cost(5, 100))  # 5 tokens: now nearest to 6's bucket


def test_one_slow_first_step_does_not_price_a_size_out():
    """A size priced out is never stepped, so its correction is never corrected: one slow first step must not do it.
    It moves its bucket a quarter of the way from the factor it borrowed, and no size costs more than a bigger one."""
    times = StepTimes(CPU_LIKE)
    for _ in range(50):
        times.observe(4, 100, CPU_LIKE.seconds(4, 100))  # size 4 costs what the calibration said
    times.observe(3, 100, 1.3 * CPU_LIKE.seconds(3, 100))  # size 3's first step: 30% slow (a neighbour's spike)
    assert times.factor[3] == pytest.approx(1 + 0.3 / 4)
    for _ in range(50):
        times.observe(5, 100, 1.5 * CPU_LIKE.seconds(5, 100))  # size 5: steadily dearer than calibrated
    curve = times.curve(100)
    assert list(curve.values()) == sorted(curve.values())  # no size dearer than a bigger one
    assert curve[3] <= curve[4] == pytest.approx(CPU_LIKE.cost(4, 100))


def test_the_decode_loop_times_its_steps_for_the_adaptive_tree(tiny):
    d = drafter("hybrid", CPU_LIKE, tiny.config.vocab_size)
    generate(tiny, d, [5, 6, 7, 8] * 4, 30)
    times = d.adaptive.times
    assert sum(times.count.values()) >= 5 and all(f > 0 for f in times.factor.values())


def test_chain_stats_and_chain_length_choice():
    chain = ChainStats(6)
    for _ in range(100):
        chain.observe([1, 2, 3, 4, 5, 6], [1, 2, 3, 9])  # the first three are right, then a miss
    v = chain.values(6)
    assert v[2] > 0.9 and v[3] < 0.05
    trees = AdaptiveTrees(CPU_LIKE)  # prior rates only, and an empty matrix: no tree worth drafting
    tree, m = plan(trees, matrix_with({}), chain=[40, 41, 42, 43, 44, 45], values=v)
    assert tree.size == 1 and m == [1, 2, 3]  # exactly the chain tokens that pay


def test_chain_tokens_the_tree_already_drafts_are_not_charged_twice():
    trees = trained(AdaptiveTrees(CPU_LIKE))
    m = sure_chain()
    tree, _ = plan(trees, m)
    alone = trees.expected
    # A chain that copies the tree's own sure path (0 -> 1 -> 2 -> 3) is the same nodes: no token, no cost added,
    # and no expected token either (they were counted once, with the tree's odds, which are better here).
    same, _ = plan(trees, m, chain=[1, 2, 3], values=[0.9, 0.8, 0.7])
    assert same.size == tree.size and trees.expected == pytest.approx(alone)
    # Counted twice, as before this rule, those three would have looked worth 2.4 more tokens.
    other, k = plan(trees, m, chain=[40, 41, 42], values=[0.9, 0.8, 0.7])  # a chain off the tree: charged
    assert trees.expected > alone + 1.0 and len(k) >= 1


def test_the_matrix_is_priced_by_what_it_showed_in_the_context_it_drafts_in():
    """Its candidates learned right when the matrix drafts alone and wrong beside another source's: a step with a chain
    drafts the chain and no matrix node; one without drafts the matrix's sure path, as before."""
    trees = trained(AdaptiveTrees(CPU_LIKE), contexts=[0])
    for _ in range(300):
        trees.observe([list(range(8))] * 6, [[0.97] + [0.004] * 7] * 6, [99] * 6, 1)
    m = sure_chain()
    alone, _ = plan(trees, m)
    assert alone.size > 4
    beside, chosen = plan(trees, m, chain=[40, 41, 42], values=[0.9, 0.8, 0.7])
    assert beside.size == 1 and chosen == [1, 2, 3]
    # One batched step, each sequence in its own context.
    (a, _), (b, c) = trees.plan(m.table, m.confidence, [0, 0], [100, 100],
                                [Candidates.chain(0, [], []), Candidates.chain(0, [40, 41, 42], [0.9, 0.8, 0.7])])
    assert a.size > 1 and b.size == 1 and c and c == list(range(1, len(c) + 1))  # (the forward is shared: the chain's
    # first tokens)


def test_hybrid_learns_the_matrix_in_the_context_its_draft_was_priced_in():
    matrix = RecyclingMatrix(20, 2)
    matrix.table[3] = torch.tensor([4, 5])
    adaptive = AdaptiveTrees(CPU_LIKE)
    hybrid = Hybrid(TokenRecycling(matrix, build_tree([[0]]), adaptive), PromptLookup("cpu", length=4))
    seen = []
    adaptive.observe = lambda rows, confidences, targets, context=0: seen.append(context)
    for history, context in (([3, 4, 6, 8, 9, 1, 2, 3], 1), ([7, 8, 9, 3], 0)):  # lookup finds 3 earlier / nothing
        draft = hybrid.propose(history)
        assert draft.context == context and draft.cut(1).context == context
        hybrid.learn(draft, [4])
        assert seen[-1] == context


def test_one_plan_for_one_sequence_or_a_batch():
    trees = trained(AdaptiveTrees(CPU_LIKE))
    m = sure_chain()
    alone = plan(trees, m)
    assert trees.plan(m.table, m.confidence, [0], [100]) == [alone]  # a batch of one is a batch
    # Two sequences share one forward: one whose root drafts the sure chain, one whose root's row was never written
    # (the same candidates, at confidence 0). The sure one drafts less than alone (the other's root takes a token
    # of the forward's bucket), the other nothing.
    m.confidence[63] = 0.0
    sure, blank = trees.plan(m.table, m.confidence, [0, 63], [100, 100])
    assert 1 < sure[0].size < alone[0].size and sure[0].size + blank[0].size in BUCKETS and blank[0].size == 1
    # Where nothing beats plain decoding by the batch's margin, every sequence takes a plain step.
    trees.cost = LINEAR
    assert [t.size for t, _ in trees.plan(m.table, m.confidence, [0, 5], [100, 100])] == [1, 1]
    # A size costs its whole bucket (a step runs padded to it under CUDA graphs; a CPU kernel's cost moves in steps
    # of its row tiles), so a plan fills the bucket it pays for: 12 tokens of the sure chain, not the 13 that reach
    # the depth limit, which would pay for the 16 bucket.
    trees.cost = CPU_LIKE
    assert {plan(trees, sure_chain(), root=r)[0].size for r in range(8)} == {12}
    # A curve measured in a small cache stops at 4 tokens: a batch of more roots than that takes plain steps.
    trees.cost = CostModel((1, 2, 4), PREFIXES, [[1.0, 1.1, 1.3]] * 2, [0.0, 0.0], {})
    assert [t.size for t, _ in trees.plan(m.table, m.confidence, list(range(6)), [100] * 6)] == [1] * 6


def test_a_batch_drafts_only_where_the_gain_pays_for_the_drafters_own_host_work():
    """A drafted batch step costs its verify plus the drafter's host work (retrieve, learn, recycle), which the plain
    step it is compared with does without: observed a sequence at a time, priced in the curve's plain steps."""
    trees = trained(AdaptiveTrees(CPU_LIKE))
    m = sure_chain()
    assert all(t.size > 1 for t, _ in trees.plan(m.table, m.confidence, [0, 5], [100, 100]))
    trees.observe_host(2, 2 * 10.0)  # ten plain steps (CPU_LIKE's plain step is 1 s) of host work a sequence
    assert trees.host_s == pytest.approx(10.0)
    assert [t.size for t, _ in trees.plan(m.table, m.confidence, [0, 5], [100, 100])] == [1, 1]
    assert plan(trees, m)[0].size > 1  # alone, a sequence's step times include its drafting: nothing added
    for _ in range(200):  # a mean of the recent steps: cheap host work since, drafting again
        trees.observe_host(2, 0.0)
    assert trees.host_s < 0.01
    assert all(t.size > 1 for t, _ in trees.plan(m.table, m.confidence, [0, 5], [100, 100]))
    research = AdaptiveTrees(CPU_LIKE, pinned=True)  # a pinned curve prices nothing it did not give
    research.observe_host(2, 100.0)
    assert research.host_s == 0.0


def test_a_plan_keeps_the_tokens_and_rows_it_read_for_the_steps_other_host_work():
    """What the plan read, kept until the step recycles: each tree's tokens as the matrix would gather them for it
    (root first, in the tree's order), and the rows it read by token, as they stand in the matrix."""
    g = torch.Generator().manual_seed(3)
    m = RecyclingMatrix(64, 8)
    m.table.copy_(torch.randint(0, 64, (64, 8), generator=g))
    m.confidence.copy_(torch.rand(64, 8, generator=g).softmax(dim=-1).half())
    m.confidence[:, 0] = 0.97  # (rank 0 as sure as the trained rates say, so the trees go deep)
    trees = trained(AdaptiveTrees(CPU_LIKE))
    for roots in ([5], [1, 2, 3, 9], [7, 7]):
        plans = trees.plan(m.table, m.confidence, roots, [100] * len(roots))
        assert len(trees.tokens) == len(roots) and any(t.size > 2 for t, _ in plans)
        for root, (tree, _), tokens in zip(roots, plans, trees.tokens):
            assert tokens == m.retrieve(torch.tensor(root), tree).tolist()
        assert set(roots) <= set(trees.rows)
        for t, (ids, confidences) in trees.rows.items():
            assert ids == m.table[t].tolist() and confidences == m.confidence[t].tolist()


def test_graft_buffers():
    tree = build_tree([[0], [1], [0, 0]])
    g = graft(tree, [2, 4, 5])  # a chain of three under token index 2 (path [1])
    assert g.size == 7
    assert g.parent.tolist() == [0, 0, 0, 1, 2, 4, 5]
    assert g.depth.tolist() == [0, 1, 1, 2, 2, 3, 4]
    assert g.children[2] == (4,) and g.children[4] == (5,) and g.children[6] == ()
    assert g.mask[6].nonzero().flatten().tolist() == [0, 2, 4, 5, 6]
    assert g.levels == tree.levels  # retrieve still expands only the matrix's nodes
    assert g.paths[3:] == ((1, -1), (1, -1, -1), (1, -1, -1, -1))
    branched = graft(tree, [0, 0, 4, 1])  # two new children of the root, one under the first, one under a tree node
    assert branched.parent.tolist()[4:] == [0, 0, 4, 1] and branched.depth.tolist()[4:] == [1, 1, 2, 2]
    assert branched.paths[3:] == ((-1,), (-2,), (-1, -1), (0, -1)) and branched.children[0] == (1, 2, 4, 5)
    assert branched.mask[6].nonzero().flatten().tolist() == [0, 4, 6]
    with pytest.raises(ValueError):
        graft(tree, [5])


def test_hybrid_prices_a_chain_by_how_long_its_match_was():
    """Prompt lookup's chains are learned apart by the n-gram their match agreed on: where chains found by 1-token
    matches went wrong and chains of 3-token matches came true, a 3-token match's chain is worth more than a 1-token
    match's, token for token."""
    tr = TokenRecycling(RecyclingMatrix(20, 2), build_tree([[0]]))
    hybrid = Hybrid(tr, PromptLookup("cpu", length=4))
    three = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]  # "1 2 3" occurred: 4 5 6 7 follow
    one = [8, 9, 10, 11, 12, 13, 14, 15, 9]  # only "9" occurred: 10 11 12 13 follow
    assert hybrid.lookup.match(three)[1] == 3 and hybrid.lookup.match(one)[1] == 1
    for _ in range(30):
        draft = hybrid.propose(three)
        assert draft.chain_ngram == 3
        hybrid.learn(draft, [4, 5, 6, 7, 0])
        draft = hybrid.propose(one)
        assert draft.chain_ngram == 1
        hybrid.learn(draft, [0])
    found3, n3 = hybrid.lookup.match(three)
    found1, n1 = hybrid.lookup.match(one)
    value3 = hybrid.candidates(three, found3, None, n3).value
    value1 = hybrid.candidates(one, found1, None, n1).value
    assert value3[1] > 0.9 and value1[1] < 0.1 and all(a > b for a, b in zip(value3[1:], value1[1:]))


def test_hybrid_follows_the_tree_then_grafts_the_rest_of_the_chain():
    matrix = RecyclingMatrix(20, 2)
    matrix.table[3] = torch.tensor([4, 5])
    matrix.table[4] = torch.tensor([6, 7])
    tr = TokenRecycling(matrix, build_tree([[0], [1], [0, 0]]))  # tokens: 3 -> 4, 5; 4 -> 6
    hybrid = Hybrid(tr, PromptLookup("cpu", length=4))
    history = [3, 4, 6, 8, 9, 1, 2, 3]  # lookup: the last 3 occurred at the start, followed by 4 6 8 9
    draft = hybrid.propose(history)
    assert draft.tokens.tolist() == [3, 4, 5, 6, 8, 9]  # 4 and 6 are already tree nodes; 8, 9 hang under 6
    assert draft.tree.parent.tolist()[-2:] == [3, 4]


def test_cost_model_interpolates_saves_and_checks_its_key(tmp_path):
    rel = [[float(i + 1) for i in range(len(BUCKETS))], [float(2 * (i + 1)) for i in range(len(BUCKETS))]]
    cm = CostModel(BUCKETS, PREFIXES, rel, [0.01, 0.02], {"model": "m"})
    mid = (PREFIXES[0] + PREFIXES[1]) // 2
    assert cm.cost(BUCKETS[1], PREFIXES[0]) == 2.0 and cm.cost(BUCKETS[1], 0) == 2.0
    assert cm.cost(BUCKETS[1], mid) == pytest.approx(3.0, rel=0.01)
    span = PREFIXES[1] - PREFIXES[0]  # past the longer prefix: extrapolated (attention grows with it), to 8 spans
    assert cm.cost(BUCKETS[1], PREFIXES[1] + span) == pytest.approx(6.0) and cm.cost(BUCKETS[1], 10**9) == 18.0
    # Seconds: the plain step's seconds (interpolated alike) times the relative cost, linear between buckets.
    assert cm.seconds(BUCKETS[1], PREFIXES[0]) == pytest.approx(0.02)
    assert cm.seconds(BUCKETS[-1], PREFIXES[1]) == pytest.approx(0.02 * 2 * len(BUCKETS))
    b = next(i for i in range(1, len(BUCKETS)) if BUCKETS[i] - BUCKETS[i - 1] == 2)  # e.g. 8 -> 10: 9 is halfway
    assert cm.seconds(BUCKETS[b] - 1, PREFIXES[0]) == pytest.approx(0.01 * (b + 0.5))
    path = tmp_path / "c.json"
    cm.save(path)
    assert CostModel.load(path, {"model": "m"}).relative == rel
    assert CostModel.load(path, {"model": "other"}) is None  # another machine, dtype or model: measure again
    path.write_text("{not json")
    assert CostModel.load(path, {"model": "m"}) is None


def test_measured_curve_is_monotone_and_starts_at_one(tiny):
    cache = KVCache(tiny.config, 2048, torch.float64, "cpu")
    tiny.set_max_positions(2048)
    cm = CostModel.measure(tiny, cache, {"model": "tiny"}, reps=1)
    for row in cm.relative:
        assert row[0] == 1.0 and row == sorted(row)
    assert cache.length == 0
    # A small cache measures the buckets that fit twice over, and the trees stay within them.
    small = CostModel.measure(tiny, KVCache(tiny.config, 64, torch.float64, "cpu"), {"model": "tiny"}, reps=1)
    assert small.buckets == tuple(T for T in BUCKETS if T <= 32) and max(small.prefixes) <= 32
    trees = trained(AdaptiveTrees(small))
    assert plan(trees, sure_chain(), prefix=30)[0].size <= 32
    assert CostModel.measure(tiny, KVCache(tiny.config, 3, torch.float64, "cpu"), {}).buckets == (1,)


def test_timing_stops_passes_at_the_budget_but_keeps_the_warm_up_and_one(tiny):
    """`reps` passes after a warm-up (none asked for at a second prefix); past budget_s no further pass (a 7B
    model's take half a minute each)."""
    from tr_engine.core.cost import time_steps

    calls = []

    class Counting:  # the model, counting its forwards
        def __getattr__(self, name):
            return getattr(tiny, name)

        def __call__(self, ids, *args, **kwargs):
            calls.append(len(ids))
            return tiny(ids, *args, **kwargs)

    cache = KVCache(tiny.config, 256, torch.float64, "cpu")
    tiny.set_max_positions(256)
    sizes = (1, 4, 8)
    for budget, warm_up, passes in ((None, True, 1 + 3), (0.0, True, 1 + 1), (1e9, True, 1 + 3), (None, False, 3)):
        calls.clear()
        s = time_steps(Counting(), cache, sizes, 64, reps=3, budget_s=budget, warm_up=warm_up)
        # the prefix's prefill, a first plain step before a warm-up, then the passes
        assert calls == [64] + [1] * warm_up + list(sizes) * passes and set(s) == set(sizes)


class Timed:
    """The tiny model's stand-in whose forwards take `seconds(T, n)` (T tokens, the n-th since a prefill) on a clock
    of its own and compute nothing (zero logits): a machine whose costs the test decides, to check what the
    measurement makes of them. tr_engine.core.cost reads that clock while the test runs, so neither the model's own
    time nor the host's speed enters the timings. (They did when it slept for real: a host busier than its cores
    stretched the model's ~1 ms to 12, and woke 4-10 ms sleeps a scheduler slice late, 30% of a step, which failed the
    inversion test below in CI with "a 10-token verify timed under a 7-token one".)"""

    def __init__(self, model, seconds, monkeypatch):
        from types import SimpleNamespace

        from tr_engine.core import cost

        self.model, self.seconds, self.calls, self.since_prefill, self.now = model, seconds, [], 0, 0.0
        monkeypatch.setattr(cost, "time", SimpleNamespace(perf_counter=lambda: self.now))

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, ids, *args, **kwargs):
        self.calls.append(len(ids))
        self.since_prefill = 0 if kwargs.get("last_logits_only") else self.since_prefill + 1
        self.now += self.seconds(len(ids), self.since_prefill)
        return torch.zeros(1 if kwargs.get("last_logits_only") else len(ids), self.model.config.vocab_size,
                           dtype=torch.float64)


def test_sizes_too_dear_to_pay_are_not_timed_but_extrapolated(tiny, monkeypatch):
    """A machine where a verify costs a plain step per token: past MAX_RELATIVE plain steps the sizes are left out
    of the timed passes (the measurement stays short however slow big verifies are) and priced in proportion."""
    from tr_engine.core.cost import MAX_RELATIVE

    tiny.set_max_positions(200)
    timed = Timed(tiny, lambda T, call: 0.008 * T, monkeypatch)
    fractions = []
    cm = CostModel.measure(timed, KVCache(tiny.config, 200, torch.float64, "cpu"), {}, progress=fractions.append)
    assert cm.doubt is None and cm.buckets[-1] == 96 and cm.prefixes == (104, 104)  # (the cache's room)
    verifies = [n for n in timed.calls if n != 104]  # (the prefills)
    assert max(verifies) <= 4 * MAX_RELATIVE  # (the warm-up judges at twice the limit, then the first timed pass)
    # (A verify of T tokens takes T plain steps: 96 at the top.)
    for row in cm.relative:
        assert row == sorted(row) and row[-1] > 4 * MAX_RELATIVE and row[-1] / row[7] == pytest.approx(96 / 8, rel=0.3)
    assert fractions == sorted(fractions) and fractions[-1] == 1.0 and len(fractions) > 10  # the notice's progress


def test_paired_timing_prices_each_size_against_the_plain_step_just_before_it(tiny, monkeypatch):
    """A host slowing down 5% a forward, where every verify costs a plain step: timed in passes of all sizes after
    one plain step, the last size seems 1.05^7 = 1.4x as dear; each right after a plain step of its own (how the
    calibration times), every size is priced within a forward's drift (the median of the plain steps around it is the
    one after it here)."""
    from tr_engine.core.cost import time_steps

    tiny.set_max_positions(256)
    timed = Timed(tiny, lambda T, call: 0.004 * 1.05**call, monkeypatch)
    cache, sizes = KVCache(tiny.config, 256, torch.float64, "cpu"), (1, 2, 3, 4, 5, 6, 7, 8)
    apart = time_steps(timed, cache, sizes, 64, reps=3, with_argmax=False)
    paired = time_steps(timed, cache, sizes, 64, reps=3, with_argmax=False, paired=True)
    assert apart[8] / apart[1] > 1.3
    assert all(1.0 < paired[T] / paired[1] < 1.06 for T in sizes[1:]), paired  # (1.05: a forward's drift)


def test_the_doubt_names_the_worst_inversion_not_the_first():
    """A spell of noise can put a 2-token verify a little under a 1-token one; a curve that has a 5-token verify at a
    quarter of a 4-token one is named by that, the inversion that matters."""
    from tr_engine.core.cost import distrust

    steady = {"before": [0.010] * 3, "after": [0.010] * 3}
    seconds = {1: 0.010, 2: 0.0070, 3: 0.011, 4: 0.040, 5: 0.010, 6: 0.041}
    assert distrust(seconds, steady) == ["a 5-token verify timed under a 4-token one"]
    assert distrust({1: 0.010, 2: 0.011, 3: 0.012}, steady) == []
    busy = {"before": [0.010] * 3, "after": [0.030] * 3}  # both at once: both named (a busy CI host once hid the
    assert distrust(seconds, busy) == ["a plain step took 3.0x as long after the measurement as before (was another "
                                       "process busy?)", "a 5-token verify timed under a 4-token one"]  # inversion)


@pytest.mark.parametrize("spell", ["busy", "inverted", "both"])
def test_a_noisy_or_inverted_measurement_is_measured_again_and_not_cached(tiny, tiny_factory, spell, tmp_path,
                                                                          monkeypatch):
    """A busy spell (plain steps 4x slower by the end of each measurement) or a curve no machine gives (a 5-token
    verify far cheaper than a 4-token one), or both: measured once more, then used with its doubt, which names the
    reasons found at every prefix (the spell shows at the second only: the first's timed passes all run after it, and
    an inversion there, noise's or the machine's, must not hide it), and never saved."""
    from tr_engine.engine import Engine

    def seconds(T, call):
        busy = 4 if spell != "inverted" and call >= 40 else 1  # each prefix's measurement 4x slower halfway through
        inverted = 6 if spell != "busy" and T == 4 else 1  # (~5 plain steps: timed, under MAX_RELATIVE's 12)
        return 0.002 * busy * inverted

    tiny.set_max_positions(200)
    timed = Timed(tiny, seconds, monkeypatch)
    fractions = []
    cm = CostModel.measure(timed, KVCache(tiny.config, 200, torch.float64, "cpu"), {}, progress=fractions.append)
    assert cm.doubt is not None and ("took" in cm.doubt or spell == "inverted"), cm.doubt
    assert "under a 4-token" in cm.doubt or spell == "busy", cm.doubt
    assert timed.calls.count(104) == 4  # each prefix prefilled twice: a second try
    assert fractions == sorted(fractions) and fractions[-1] == 1.0  # the notice climbs on through the second try
    # Through the engine: the doubtful curve's fallback serves, the notice says why, and nothing is cached.
    monkeypatch.setenv("TR_ENGINE_HOME", str(tmp_path))
    monkeypatch.setattr(CostModel, "measure", classmethod(lambda cls, *a, **k: cm))
    folder = tiny_factory("spec", dtype=torch.float64, vocab_size=300, std=0.5)  # (tiny's)
    engine = Engine.from_pretrained(str(folder), dtype="float64", max_context=256, ops="reference")
    heard = []
    engine.on_calibrate = lambda fraction, doubt: heard.append((fraction, doubt))
    assert engine.cost_model() == cm.fallback() and heard[0] == (0.0, None) and heard[-1] == (1.0, cm.doubt)
    assert not list(tmp_path.glob("costs/*.json"))
    fallback = engine.cost_model()  # (what the run drafts by: a middling CPU's shape, the doubt kept)
    assert fallback.doubt == cm.doubt and fallback.buckets == cm.buckets and fallback.prefixes == cm.prefixes
    assert fallback.cost(8, 0) == fallback.cost(8, 10_000) == pytest.approx(1 + 7 * PRIOR_PER_TOKEN)


def test_an_inversion_timed_alike_twice_is_the_machines_and_cached(tiny, tmp_path, monkeypatch):
    """A machine whose 5-token verify really is cheaper than its 4-token one (AVX2's matmul tiles change with the row
    count), by more than MONOTONE allows noise but within MACHINE_INVERSION: the first try is doubtful, the second
    times it alike, and the curve is trusted and cached, its envelope pricing 5 tokens as 4."""
    from tr_engine.core.cost import MACHINE_INVERSION, calibrated

    tiny.set_max_positions(200)
    timed = Timed(tiny, lambda T, call: 0.0056 if T == 4 else 0.004, monkeypatch)  # (1.4x)
    path = tmp_path / "curve.json"
    cm, _ = calibrated(timed, KVCache(tiny.config, 200, torch.float64, "cpu"), {}, path, tiny.shard, 8, again=True)
    assert cm.doubt is None, cm.doubt
    assert timed.calls.count(104) == 4  # the first try doubtful, the second agreeing with it
    i = cm.buckets.index(4)
    assert cm.relative[0][i + 1] == cm.relative[0][i] > 1.2 and cm.relative[0][i] < MACHINE_INVERSION
    assert path.is_file()  # cached


@pytest.mark.parametrize("second_try", ["crowded", "alone", "check off"])
def test_a_measurement_beside_processes_that_crowd_its_threads_is_doubtful(tiny, tmp_path, monkeypatch, second_try):
    """Other processes kept busy CPUs that its threads need (tr_engine/model/threads.py: CpuLoad.crowds): the try is
    doubtful and measured again. Crowded again, the curve is not cached and its doubt names them, however alike the
    two tries timed (a crowded machine times its curve alike, and wrong); with its CPUs left to it, the second try is
    trusted and cached. With the check off (TR_ENGINE_LOAD_CHECK=0: the test suite's default) nothing is asked."""
    from tr_engine.core import cost
    from tr_engine.core.cost import LOAD_CHECK_ENV, calibrated

    crowding = [1.0, 1.0 if second_try == "crowded" else None]

    class Crowd:
        cpus = {0, 1}

        def crowds(self, threads: int):
            return crowding.pop(0)

    monkeypatch.setattr(cost, "CpuLoad", Crowd)
    monkeypatch.setenv(LOAD_CHECK_ENV, "0" if second_try == "check off" else "1")
    tiny.set_max_positions(200)
    timed = Timed(tiny, lambda T, call: 0.004, monkeypatch)
    path = tmp_path / "curve.json"
    cm, _ = calibrated(timed, KVCache(tiny.config, 200, torch.float64, "cpu"), {}, path, tiny.shard, 8, again=True)
    if second_try == "check off":
        assert cm.doubt is None and path.is_file() and len(crowding) == 2 and timed.calls.count(104) == 2
        return
    assert timed.calls.count(104) == 4 and not crowding  # two tries, each asked
    if second_try == "crowded":
        assert cm.doubt.startswith("other processes kept 1.0 of the 2 CPUs busy") and not path.is_file(), cm.doubt
    else:
        assert cm.doubt is None and path.is_file()


def test_engine_adaptive_tree_calibrates_once_and_stays_lossless(tiny_factory, tmp_path, monkeypatch):
    from tr_engine.engine import Engine

    monkeypatch.setenv("TR_ENGINE_HOME", str(tmp_path))
    # The measured curve trusted however busy this machine is (a doubtful one is never saved: tested above), so that
    # the run always has a curve to save.
    measure = CostModel.measure
    monkeypatch.setattr(CostModel, "measure", classmethod(
        lambda cls, *a, **k: dataclasses.replace(measure(*a, **k), doubt=None)))
    folder = tiny_factory("spec", dtype=torch.float64, vocab_size=300, std=0.5)
    engine = Engine.from_pretrained(str(folder), dtype="float64", max_context=512, tree="adaptive", ops="reference")
    prompt = "the the the cat sat on the mat and the cat sat on the mat"
    ar = engine.generate(prompt, 40, method="ar")
    for method in ("tr", "hybrid"):
        assert engine.generate(prompt, 40, method=method).token_ids == ar.token_ids, method
    saved = list((tmp_path / "costs").glob("*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["key"]["dtype"] == "float64"
    flat = CostModel.flat(40)  # a pinned curve stays: the engine does not swap in its own, the steps do not correct it
    pinned = engine.new_drafter("hybrid", "adaptive", cost=flat, max_tokens=40)
    got = engine.generate(prompt, 40, drafter=pinned)
    assert got.token_ids == ar.token_ids and pinned.adaptive.cost is flat and pinned.adaptive.times.factor == {}
    assert max(got.generation.verify_tokens) == 40

    def no_measuring(*a, **k):
        raise AssertionError("the cached cost curve should have been used")

    monkeypatch.setattr(CostModel, "measure", no_measuring)
    again = Engine.from_pretrained(str(folder), dtype="float64", max_context=512, tree="adaptive", ops="reference")
    assert again.generate(prompt, 40, method="tr").token_ids == ar.token_ids
    assert cost_path(tmp_path, cost_key(folder.name, torch.float64, torch.device("cpu"), "reference")) == saved[0]
    # a --tp run's steps pay collectives too, and CUDA graphs change a step's cost: each keeps a curve of its own
    assert len({cost_path(tmp_path, cost_key(folder.name, torch.float64, torch.device("cpu"), "reference", graphs, tp))
                for graphs in (False, True) for tp in (1, 2)} - {saved[0]}) == 3
    # and so does each CPU kernel tier (tr_engine/model/cpu.py): an AVX2 verify costs more plain steps than an AVX-512
    # one
    assert len({cost_path(tmp_path, cost_key(folder.name, torch.bfloat16, torch.device("cpu"), "kernels", cpu_tier=t))
                for t in ("avx512bf16", "avx2", "scalar")}) == 3
    engine.save_matrix(tmp_path / "m.pt")  # the matrix travels with its confidences (the adaptive tree reads them)
    again.load_matrix(tmp_path / "m.pt")
    assert engine.matrix.confidence.any() and torch.equal(again.matrix.confidence, engine.matrix.confidence)


def test_a_cached_curve_is_keyed_by_the_cpu_kernels_it_was_measured_with(tmp_path, monkeypatch):
    """The CPU kernels live in each tier's library, not in the op library: a rebuilt tier library (its kernels
    changed) keys a curve of its own, so a curve measured with the kernels before a change is not reused."""
    from tr_engine.model import cpu

    tier = cpu.runnable()[0]
    key = lambda: cost_key("m", torch.float32, torch.device("cpu"), "kernels", cpu_tier=tier.name)  # noqa: E731
    before = key()["build"]
    assert before == key()["build"]  # a fingerprint, the same while nothing changes
    rebuilt = tmp_path / cpu.library(tier).name
    rebuilt.write_bytes(cpu.library(tier).read_bytes() + b"a rebuilt kernel")
    monkeypatch.setattr(cpu, "library", lambda t: rebuilt if t == tier else None)
    assert key()["build"] != before


def test_an_engine_given_a_curve_prices_its_trees_by_it_and_measures_nothing(tiny_factory, tmp_path, monkeypatch):
    from tr_engine.engine import Engine
    from tr_engine.errors import InvalidType

    def no_measuring(*a, **k):
        raise AssertionError("a curve was given: nothing to measure")

    monkeypatch.setenv("TR_ENGINE_HOME", str(tmp_path))
    monkeypatch.setattr(CostModel, "measure", no_measuring)
    folder = tiny_factory("spec", dtype=torch.float64, vocab_size=300, std=0.5)
    engine = Engine.from_pretrained(str(folder), dtype="float64", max_context=512)
    engine.use_cost(FREE)  # any tree costs one plain step: the biggest pay
    prompt = "the the the cat sat on the mat and the cat sat on the mat"
    ar = engine.generate(prompt, 40, method="ar")
    got = engine.generate(prompt, 40, method="hybrid")
    assert got.token_ids == ar.token_ids and engine.cost_model() is FREE and not (tmp_path / "costs").exists()
    assert max(got.generation.verify_tokens) > 16  # priced as free: trees a CPU-measured curve would not pay for
    with pytest.raises(InvalidType, match="CostModel"):
        engine.use_cost("flat")


@pytest.mark.parametrize("kind", ["tr", "hybrid"])
def test_a_mirrored_matrix_plans_the_same_trees(tiny, kind):
    """On a GPU the adaptive tree reads its rows from a CPU mirror of the matrix (each read of device memory would be
    a sync, hundreds a step). Forced on here, the mirror must plan the very same trees and stay equal to the matrix,
    also after a cold start and a whole-matrix copy."""
    def make():
        matrix = RecyclingMatrix(tiny.config.vocab_size, 8)
        tr = TokenRecycling(matrix, load_tree("2.2.2"), AdaptiveTrees(FREE, max_tokens=16, pinned=True))
        return Hybrid(tr, PromptLookup("cpu", length=6)) if kind == "hybrid" else tr

    device, mirrored = make(), make()
    mirrored.matrix.mirrored = True
    g = torch.Generator().manual_seed(9)
    for i in range(6):
        prompt = torch.randint(0, 300, (6,), generator=g).tolist() * 3
        a, b = generate(tiny, device, prompt, 20), generate(tiny, mirrored, prompt, 20)
        assert (a.token_ids, a.accept_lengths, a.verify_tokens) == (b.token_ids, b.accept_lengths, b.verify_tokens)
        table, confidence = mirrored.matrix.host()
        assert table is not mirrored.matrix.table
        assert torch.equal(table, mirrored.matrix.table) and torch.equal(confidence, mirrored.matrix.confidence)
    assert max(a.verify_tokens) > 8  # trees of many nodes were planned from the mirror
    m = mirrored.matrix
    saved = m.table.clone(), m.confidence.clone()
    m.clear_()
    assert not m.host()[0].any() and not m.host()[1].any()
    m.copy_(*saved)
    assert torch.equal(m.host()[0], saved[0]) and torch.equal(m.host()[1], saved[1])


def test_the_tree_cache_keeps_the_recently_used_shapes_within_its_size():
    from tr_engine.core.tree import TreeCache, chain_tree

    cache, made = TreeCache(2), []

    def make(n):
        return lambda: made.append(n) or chain_tree(n)

    a = cache.get(1, make(1))
    cache.get(2, make(2))
    assert cache.get(1, make(1)) is a  # a hit: not made again, and now the most recent
    cache.get(3, make(3))  # 2, the least recently used, leaves
    cache.get(1, make(1))
    cache.get(2, make(2))
    assert made == [1, 2, 3, 2] and list(cache.trees) == [1, 2]
