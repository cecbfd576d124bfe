"""CUDA graphs (tr_engine/model/graphs.py): the decode loop's steps as replayable forwards. On a CPU the same padded,
static-buffer steps run uncaptured (the rehearsal of the graph path) and must give the eager steps' logits bit for
bit; on a GPU (cuda-marked) the captured graphs must give the eager engine's tokens."""

import pytest
import torch

from cli import run_module
from tr_engine.core.cost import BUCKETS, CostModel
from tr_engine.core.tree import sample_tree_mask
from tr_engine.engine import Engine
from tr_engine.errors import UserError
from tr_engine.core.batch import Request, batch_steps
from tr_engine.core.drafters import TokenRecycling
from tr_engine.core.matrix import RecyclingMatrix
from tr_engine.core.tree import load_tree
from tr_engine.model.graphs import BatchGraphs, StepGraphs
from tr_engine.model.kv_cache import BatchKVCache, KVCache
from tr_engine.model.llama import RaggedBatch
from tr_engine.model.weights import load_model

PROMPTS = ["the quick brown fox jumps over the lazy dog " * 3, "def add(a, b):\n    return a + b\n" * 2,
           "Paris is the capital of France; Berlin is the capital of Germany."]
CONFIGS = [("ar", "adaptive"), ("tr", "adaptive"), ("tr", "2.2.2"), ("pld", "adaptive"), ("hybrid", "adaptive"),
           ("hybrid", "2.2.2")]


@pytest.fixture(scope="module")
def folder(tiny_factory):
    return tiny_factory("graphs", vocab_size=320, std=0.5)


def rehearsal(engine: Engine) -> StepGraphs:
    """The engine's steps through uncaptured static buffers: the graph path, minus the capture."""
    engine.runners.use_graphs(BUCKETS, engine.tree.size, capture=False)
    return engine.runners.runner


def answers(engine: Engine, method: str, max_new_tokens: int = 48) -> list[tuple[list[int], list[int]]]:
    """Each prompt's tokens and accept lengths. An adaptive tree is pinned to a flat cost of up to 40 tokens: its
    trees then depend on the matrix alone, not on the clock, so two engines draft alike."""
    drafter = None
    if method in ("tr", "hybrid") and engine.tree_spec == "adaptive":
        drafter = engine.new_drafter(method, cost=CostModel.flat(40), max_tokens=40)
    out = []
    for prompt in PROMPTS:
        g = engine.generate(prompt, max_new_tokens=max_new_tokens, method=method, drafter=drafter).generation
        out.append((g.token_ids, g.accept_lengths))
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("method,tree", CONFIGS)
def test_static_steps_are_bitwise_the_eager_steps(folder, dtype, method, tree):
    """Same tokens and same accept lengths step by step (the drafts and every logit's bits agree), with trees padded
    to their buckets (hybrid's chain on the 81-token tree runs in 96, prompt lookup's 9 in 10)."""
    eager = Engine.from_pretrained(str(folder), dtype=dtype, max_context=512, tree=tree)
    static = Engine.from_pretrained(str(folder), dtype=dtype, max_context=512, tree=tree)
    runner = rehearsal(static)
    assert answers(static, method) == answers(eager, method)
    assert runner.counts["graph"] > 0
    if method != "ar":
        assert answers(static, "ar") == answers(eager, "ar")


def test_padding_rows_leave_the_real_rows_alone(folder):
    model = load_model(folder, torch.bfloat16)
    model.set_max_positions(256)
    cache = KVCache(model.config, 256, torch.bfloat16, "cpu")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (120,), generator=g)
    model(ids[:100], torch.arange(100), cache.data, 0)
    mask = sample_tree_mask(11)
    depth = 100 + mask.sum(dim=1) - 1
    want = model(ids[100:111], depth, cache.data, 100, tree_mask=mask)
    runner = StepGraphs(model, cache, (1, 16), capture=False)
    got = runner(ids[100:111], depth, cache.data, 100, tree_mask=mask)
    assert got.shape == want.shape and torch.equal(got, want)
    assert runner.counts == {"graph": 1, "eager": 0}


def test_steps_past_the_cache_end_and_prefills_run_eagerly(folder):
    engine = Engine.from_pretrained(str(folder), dtype="float32", max_context=120, tree="2.2.2")
    eager = Engine.from_pretrained(str(folder), dtype="float32", max_context=120, tree="2.2.2")
    runner = rehearsal(engine)
    prompt = "the quick brown fox jumps over the lazy dog"
    assert engine.generate(prompt, max_new_tokens=60, method="tr").token_ids == \
        eager.generate(prompt, max_new_tokens=60, method="tr").token_ids
    assert runner.counts["eager"] >= 2  # the prefill, and the steps whose 81-token bucket no longer fits


def test_graphs_are_refused_where_they_cannot_run(folder):
    with pytest.raises(UserError, match="--cuda-graphs on needs --device cuda"):
        Engine.from_pretrained(str(folder), cuda_graphs=True)
    with pytest.raises(UserError, match="cuda_graphs must be"):
        Engine.from_pretrained(str(folder), cuda_graphs="yes")
    assert Engine.from_pretrained(str(folder), cuda_graphs=False).runners.runner.__class__.__name__ == "Llama"
    assert not Engine.from_pretrained(str(folder)).cuda_graphs  # the default on a CPU: off


def test_cuda_graphs_flag_on_a_cpu_is_one_line(folder):
    proc = run_module("tr_engine.cli.generate", "--model", str(folder), "--prompt", "hi", "--cuda-graphs", "on")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert "--cuda-graphs on needs --device cuda" in proc.stderr
    proc = run_module("tr_engine.cli.generate", "--model", str(folder), "--prompt", "hi", "--cuda-graphs", "maybe")
    assert proc.returncode == 2 and "--cuda-graphs" in proc.stderr and proc.stderr.strip().count("\n") == 0


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_give_the_eager_tokens(folder, dtype):
    """Captured graphs against the same engine's eager steps (which run the same kernels, minus the capture): each
    method's tokens and accept lengths agree, every bucket is captured once, and the steps replay graphs."""
    graphed = Engine.from_pretrained(str(folder), device="cuda", dtype=dtype, max_context=512, cuda_graphs=True)
    eager = Engine.from_pretrained(str(folder), device="cuda", dtype=dtype, max_context=512, cuda_graphs=False)
    rehearsal(eager)  # the same static-buffer forwards, uncaptured
    for method in ("ar", "tr", "pld", "hybrid"):
        assert answers(graphed, method) == answers(eager, method), method
    runner = graphed.runners.runner
    assert isinstance(runner, StepGraphs) and not runner.failures
    assert runner.counts["graph"] > runner.counts["eager"]  # the steps replay graphs; prefills run eagerly


@pytest.mark.cuda
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_cuda_fp32_methods_emit_the_plain_tokens(folder, cuda_graphs):
    """Losslessness on the GPU in float32: every method gives plain decoding's tokens."""
    engine = Engine.from_pretrained(str(folder), device="cuda", dtype="float32", max_context=512,
                                    cuda_graphs=cuda_graphs)
    plain = [tokens for tokens, _ in answers(engine, "ar")]
    for method in ("tr", "pld", "hybrid"):
        assert [tokens for tokens, _ in answers(engine, method)] == plain, method


def test_a_plain_step_in_a_bigger_bucket_sees_only_itself(folder):
    """Without a one-token bucket a plain step is padded too: the mask a bigger tree left in the buffer is reset."""
    model = load_model(folder, torch.float32)
    model.set_max_positions(128)
    cache = KVCache(model.config, 128, torch.float32, "cpu")
    ids = torch.arange(40) % model.config.vocab_size
    model(ids[:30], torch.arange(30), cache.data, 0)
    runner = StepGraphs(model, cache, (4,), capture=False)
    everything = torch.ones(4, 4, dtype=torch.bool)  # (not a tree: a mask whose first row sees the others)
    runner(ids[30:34], torch.arange(30, 34), cache.data, 30, tree_mask=everything)
    want = model(ids[30:31], torch.tensor([30]), cache.data, 30)
    got = runner(ids[30:31], torch.tensor([30]), cache.data, 30)
    assert torch.equal(got, want)


# A batch's steps (BatchGraphs): every row's place in static tensors, padding rows in the cache's scratch slot.


def batch_rehearsal(engine: Engine) -> BatchGraphs:
    """The engine's batches through uncaptured static buffers: the batch graph path, minus the capture (the cache
    with its scratch slot, as --cuda-graphs on makes it)."""
    engine.runners.use_graphs(BUCKETS, engine.tree.size, capture=False)
    assert engine.batch_cache().scratch is not None  # (allocated now, with the scratch slot)
    return engine.runners.batch_runner


def batch_answers(engine: Engine, method: str) -> list[tuple[list[int], list[int]]]:
    # Six requests through three slots: they join and leave mid-run, and the batch ends down to one sequence.
    results = engine.generate_batch(PROMPTS * 2, max_new_tokens=40, method=method)
    return [(r.token_ids, r.generation.accept_lengths) for r in results]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("method", ["ar", "tr", "hybrid"])
def test_static_batched_steps_are_bitwise_the_eager_batch(folder, dtype, method):
    """Each request's tokens and accept lengths agree with the eager batch's step by step (every logit's bits), with
    the adaptive trees priced flat (then they depend on the matrix alone, not on the clock)."""
    eager, static = (Engine.from_pretrained(str(folder), dtype=dtype, max_context=256, max_batch=3) for _ in "ab")
    for engine in (eager, static):
        engine.use_cost(CostModel.flat(40))
    runner = batch_rehearsal(static)
    assert batch_answers(static, method) == batch_answers(eager, method)
    assert runner.counts["graph"] > 0 and not runner.failures


def test_batched_module_path_through_the_rows_op(folder):
    """A model the layers' op does not take (float64: the module path) attends through tree_attention_rows: the
    same tokens as the eager batch, sequence by sequence."""
    model = load_model(folder, torch.float64)
    model.set_max_positions(256)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (20, 9, 33, 14)]

    def run(graphs: bool):
        cache = BatchKVCache(model.config, 2, 256, torch.float64, "cpu", scratch=graphs)
        runner = BatchGraphs(model, cache, (1, 96, 192), capture=False) if graphs else model
        drafter = TokenRecycling(RecyclingMatrix(320, 8), load_tree("2.2.2"))
        out = {i: [] for i in range(len(prompts))}
        for event in batch_steps(runner, cache, [Request(i, p, 24) for i, p in enumerate(prompts)], drafter, (),
                                 model.ops):
            out[event.request] += event.tokens
        return out, runner

    got, runner = run(graphs=True)
    assert got == run(graphs=False)[0]
    assert runner.counts["graph"] > 0


def test_batch_padding_rows_write_only_the_scratch_slot(folder):
    """Two sequences' verify in a 16-row bucket: their logits are the eager forward's bit for bit, their slots hold
    the same K/V after it, and the padding rows wrote nowhere but the scratch slot."""
    model = load_model(folder, torch.bfloat16)
    model.set_max_positions(128)
    cache = BatchKVCache(model.config, 3, 128, torch.bfloat16, "cpu", scratch=True)
    assert (cache.slots, cache.scratch, cache.capacity, cache.free()) == (3, 3, 128, 3)  # the scratch is never taken
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (80,), generator=g)
    for slot, n in ((0, 30), (2, 17)):
        model(ids[:n], torch.arange(n), cache.view(slot).data, 0)
    masks = [sample_tree_mask(5), sample_tree_mask(4)]
    batch = RaggedBatch(slots=[2, 0], prefix_lens=[17, 30], offsets=[0, 5, 9],
                        tree_masks=torch.cat([m.reshape(-1) for m in masks]),
                        seq=torch.tensor([2] * 5 + [0] * 4), pos=torch.tensor([17, 18, 19, 20, 21, 30, 31, 32, 33]))
    tokens = ids[40:49]
    positions = torch.cat([17 + masks[0].sum(dim=1) - 1, 30 + masks[1].sum(dim=1) - 1])  # prefix + depth
    before = cache.data.clone()
    want = model(tokens, positions, cache.data, 0, batch=batch)
    eager_cache = cache.data.clone()
    cache.data.copy_(before)
    runner = BatchGraphs(model, cache, (16,), capture=False)
    got = runner(tokens, positions, cache.data, 0, batch=batch)
    assert got.shape == want.shape and torch.equal(got, want)
    assert torch.equal(cache.data[:3], eager_cache[:3])  # the sequences' slots (and the unused one) as eager left them
    assert not torch.equal(cache.data[3], before[3])  # the padding's K/V went to the scratch slot
    assert runner.counts == {"graph": 1, "eager": 0}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_batch_graphs_give_the_eager_batch(folder, dtype):
    """Captured batch graphs against the same static-buffer steps uncaptured (the same kernels): each method's tokens
    and accept lengths agree request by request, every bucket is captured once, and the steps replay graphs."""
    graphed, eager = (Engine.from_pretrained(str(folder), device="cuda", dtype=dtype, max_context=256, max_batch=3,
                                             cuda_graphs=graphs) for graphs in (True, False))
    batch_rehearsal(eager)
    for engine in (graphed, eager):
        engine.use_cost(CostModel.flat(40))
    for method in ("ar", "tr", "hybrid"):
        assert batch_answers(graphed, method) == batch_answers(eager, method), method
    runner = graphed.runners.batch_runner
    assert isinstance(runner, BatchGraphs) and not runner.failures
    assert runner.counts["graph"] > runner.counts["eager"]  # the steps replay graphs; prefills run eagerly
