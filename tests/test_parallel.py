"""Tensor parallelism (tr_engine/model/parallel.py) on this CPU: 2 ranks on gloo, started with `spawn` as torchrun
starts them (fresh interpreters, no forked state), each loading only its shard of the weights."""

import os
import socket
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from curves import pinned
from tr_engine.model.config import LlamaConfig
from tr_engine.model.parallel import Shard, local_config

CONFIGS = {  # name -> write_tiny_llama's arguments: MHA, GQA, KV heads that do not divide by 2, tied, odd vocab
    "mha": dict(num_heads=4, num_kv_heads=4),
    "gqa": dict(num_heads=4, num_kv_heads=2),
    "gqa-uneven-tied": dict(num_heads=6, num_kv_heads=3, tie_word_embeddings=True),
    "odd-vocab-ffn": dict(num_heads=4, num_kv_heads=2, vocab_size=301, intermediate_size=129),
}
PROMPT = [1, 17, 42, 99, 7, 150, 3]
TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)  # root, 2 kids, grandkid


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker, world: int, *args) -> None:
    """Run worker(rank, world, port, *args) in `world` fresh processes, as torchrun would."""
    mp.start_processes(worker, args=(world, free_port(), *args), nprocs=world, start_method="spawn", join=True)


def joined(rank: int, world: int, port: int) -> Shard:
    from tr_engine.model import parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    return parallel.init(world, torch.device("cpu"))


def finish() -> None:
    """A worker's end, as a command's (tr_engine/cli/common.py): every rank done, then out without the backend's
    teardown."""
    from tr_engine.model.parallel import leave

    leave()
    os._exit(0)


def forwards(model) -> dict[str, torch.Tensor]:
    """A prompt (causal attention), a decode step and a tree verify (the tree_attention op) on one cache."""
    from tr_engine.model.kv_cache import KVCache

    model.set_max_positions(64)
    cache = KVCache(model.local_config, 64, model.dtype, model.device)
    out = {"prefill": model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), cache.data, 0)}
    P = len(PROMPT)
    out["decode"] = model(torch.tensor([5]), torch.tensor([P]), cache.data, P)
    depth = torch.tensor([0, 1, 1, 2])
    out["verify"] = model(torch.tensor([5, 8, 9, 11]), P + 1 + depth, cache.data, P + 1, tree_mask=TREE)
    return out


def logits_worker(rank: int, world: int, port: int, folders: dict, out: str) -> None:
    from tr_engine.model.weights import load_model

    shard = joined(rank, world, port)
    results = {}
    for name, folder in folders.items():
        model = load_model(folder, torch.float64, "cpu", "kernels", shard)
        results[name] = {**forwards(model), "heads": model.local_config.num_attention_heads,
                         "vocab rows": model.vocab[1] - model.vocab[0]}
    if rank == 0:
        torch.save(results, out)
    finish()


@pytest.mark.parametrize("n", [1, 2, 3, 7, 301])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_split_gives_each_rank_a_contiguous_share_that_differs_by_at_most_one(n, world):
    shares = [Shard(r, world).split(n) for r in range(world)]
    assert shares[0][0] == 0 and shares[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))
    sizes = [b - a for a, b in shares]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_a_rank_gets_whole_kv_heads_with_their_query_heads():
    config = LlamaConfig(vocab_size=301, hidden_size=48, intermediate_size=129, num_hidden_layers=1,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=16, max_position_embeddings=64)
    parts = [local_config(config, Shard(r, 2)) for r in range(2)]
    assert [(c.num_key_value_heads, c.num_attention_heads, c.intermediate_size) for c in parts] == [(2, 6, 65),
                                                                                                    (1, 3, 64)]
    assert all(c.vocab_size == 301 and c.head_dim == 16 for c in parts)


def test_two_ranks_give_one_rank_logits_within_float64_rounding(tiny_factory):
    from tr_engine.model.weights import load_model

    folders = {name: str(tiny_factory(f"tp-{name}", **kwargs)) for name, kwargs in CONFIGS.items()}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "logits.pt"
        spawn(logits_worker, 2, folders, str(out))
        got = torch.load(out)
    for name, folder in folders.items():
        model = load_model(folder, torch.float64, "cpu", "kernels")
        want = forwards(model)
        c = model.config  # rank 0 held its share of the heads and the vocabulary, and no more
        assert got[name]["heads"] == Shard(0, 2).split(c.num_key_value_heads)[1] * (c.num_attention_heads
                                                                                   // c.num_key_value_heads)
        assert got[name]["vocab rows"] == (c.vocab_size + 1) // 2 < c.vocab_size
        for what in want:
            assert got[name][what].shape == want[what].shape, (name, what)
            torch.testing.assert_close(got[name][what], want[what], rtol=1e-12, atol=1e-12, msg=f"{name} {what}")


def spy_on_gathers() -> list[int]:
    """The number of rows of every logits gather (Shard.gather_last) from now on, in this process."""
    rows, gather_last = [], Shard.gather_last

    def counted(self, x, n):
        rows.append(x.shape[0])
        return gather_last(self, x, n)

    Shard.gather_last = counted
    return rows


PROMPTS = ["hello there", "the cat sat on the mat, the cat sat"]
METHODS = ("tr", "hybrid", "pld")


def methods_worker(rank: int, world: int, port: int, folder: str, out: str) -> None:
    from tr_engine.engine import Engine

    joined(rank, world, port)
    gathered = spy_on_gathers()
    results = {}
    for dtype in ("float32", "bfloat16"):
        # (its adaptive trees priced by a pinned curve, corrected by the ranks' agreed step times as they run: the
        # ranks' joint measurement is the torchrun commands' below, and on two busy workers it is measured again)
        engine = pinned(Engine.from_pretrained(folder, dtype=dtype, tp=world, max_context=256))
        for p in PROMPTS:
            results[dtype, p, "ar"] = engine.generate(p, 40, method="ar").token_ids
            for method in METHODS:
                gathered.clear()
                r = engine.generate(p, 40, method=method)
                results[dtype, p, method] = r.token_ids
                results[dtype, p, method, "steps"] = r.generation.steps
                results[dtype, p, method, "rows gathered"] = max(gathered)
            results[dtype, p, "sampled-ar"] = engine.generate(p, 24, method="ar", temperature=1.0, seed=3).token_ids
            results[dtype, p, "sampled-hybrid"] = engine.generate(p, 24, method="hybrid", temperature=1.0,
                                                                  seed=3).token_ids
    torch.save(results, f"{out}.{rank}")
    finish()


def test_within_a_tp2_run_every_method_emits_plain_decodings_tokens(tiny_factory, tmp_path):
    """The kernels are row-independent and a 2-rank all-reduce adds two partial sums the same way whatever the
    other rows, so a verify row equals the decode step in fp32 and bf16 under tensor parallelism too; and every rank
    decides alike (the same logits everywhere, agreed step times for the adaptive tree, rank 0's sampling seed)."""
    from tr_engine.engine import Engine

    folder = str(tiny_factory("tp-methods", num_heads=6, num_kv_heads=3, vocab_size=301))
    out = tmp_path / "tokens"
    spawn(methods_worker, 2, folder, str(out))
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    assert ranks[0] == ranks[1]  # every rank decoded alike
    got = ranks[0]
    for dtype in ("float32", "bfloat16"):
        for p in PROMPTS:
            for method in METHODS:
                assert got[dtype, p, method] == got[dtype, p, "ar"], (dtype, p, method)
            assert got[dtype, p, "sampled-hybrid"] == got[dtype, p, "sampled-ar"], (dtype, p)
    assert any(got["float32", p, m, "steps"] < len(got["float32", p, "ar"]) for p in PROMPTS for m in METHODS)
    # greedy verify steps merged each node's top-k across the ranks: no whole rows of logits but the prompt's last
    gathers = {key: rows for key, rows in got.items() if key[-1] == "rows gathered"}
    assert set(gathers.values()) == {1}, gathers
    alone = Engine.from_pretrained(folder, dtype="float32", max_context=256)  # and TP=2's tokens are TP=1's
    assert [got["float32", p, "ar"] for p in PROMPTS] == [alone.generate(p, 40, method="ar").token_ids
                                                         for p in PROMPTS]


def calibration_worker(rank: int, world: int, port: int, folder: str, out: str) -> None:
    from tr_engine.core.cost import time_steps
    from tr_engine.engine import Engine

    joined(rank, world, port)
    engine = Engine.from_pretrained(folder, dtype="float32", tp=world, max_context=256)
    # Rank 1's clock runs slow (3 ms more a forward), so on its own clock it would spend its budget passes sooner
    # and drop dear sizes that rank 0 keeps: it would leave rank 0 waiting inside a forward's collective.
    slow = (lambda: time.sleep(0.003)) if rank == 1 else None
    seconds = time_steps(engine.model, engine.cache, (1, 2, 4, 8, 16), 16, reps=1000, budget_s=0.2, max_relative=2.0,
                         on_step=slow, paired=True)
    torch.save(seconds, f"{out}.{rank}")
    finish()


def test_the_ranks_time_the_cost_curve_alike_though_their_clocks_differ(tiny_factory, tmp_path):
    """A cost curve under tensor parallelism is measured by every rank together: each forward a collective, every
    decision (which sizes stay, when a pass ends) taken from the ranks' agreed times, so they run the same forwards."""
    folder = str(tiny_factory("tp-methods", num_heads=6, num_kv_heads=3, vocab_size=301))
    out = tmp_path / "seconds"
    spawn(calibration_worker, 2, folder, str(out))
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    assert ranks[0] == ranks[1] and ranks[0][1] > 0.003  # the same sizes, timed alike: the slower rank's times


def smollm2_worker(rank: int, world: int, port: int, folder: str, asks: list, out: str) -> None:
    from tr_engine.engine import Engine

    from tr_engine.core.cost import CostModel

    joined(rank, world, port)
    engine = Engine.from_pretrained(folder, dtype="float32", tp=world, max_context=1024)
    # (the adaptive tree priced by a pinned curve, up to 16 tokens: calibrating a TP=2 curve would double the time)
    drafter = engine.new_drafter("hybrid", "adaptive", cost=CostModel.flat(16), max_tokens=16)
    answers = [engine.generate(prompt, tokens, drafter=drafter).token_ids for prompt, tokens in asks]
    torch.save(answers, f"{out}.{rank}")
    finish()


@pytest.mark.slow
def test_smollm2_fp32_at_tp2_answers_the_dev_subset_as_one_process_does(smollm2_dir, smollm2_dev_answers, tmp_path):
    """The real model split in two (3 KV heads: 2 on rank 0, 1 on rank 1), hybrid drafting (its merged top-k, its
    adaptive tree on the two ranks' agreed step times): each dev-subset answer equals one process's plain greedy
    decoding, token for token. A float32 sum in another order could flip a near-tie; none does here."""
    out = tmp_path / "answers"
    spawn(smollm2_worker, 2, str(smollm2_dir), [(a.prompt, 16) for a in smollm2_dev_answers], str(out))
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    assert ranks[0] == ranks[1]
    same = [got == a.ids[:16] for got, a in zip(ranks[0], smollm2_dev_answers)]  # (greedy: the first 16 tokens)
    differ = [a.question for a, ok in zip(smollm2_dev_answers, same) if not ok]
    assert not differ, f"{sum(same)}/{len(same)} answers equal TP=1's; these differ: {differ}"


def test_torchrun_runs_the_generate_command_and_rank_0_alone_answers(tiny_factory):
    """Rank 0 alone prints the answer, with the default adaptive tree: its verify cost curve measured by both ranks
    together (the other torchrun tests plan static trees, to spare that measurement)."""
    import json
    import subprocess
    import sys

    from tr_engine.engine import Engine

    folder = str(tiny_factory("tp-methods", num_heads=6, num_kv_heads=3, vocab_size=301))
    command = ["-m", "tr_engine.generate", "--model", folder, "--prompt", "the cat sat on the mat", "--json",
               "--max-new-tokens", "24", "--dtype", "float32", "--max-context", "256"]
    tp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                         str(free_port()), *command, "--tp", "2"], capture_output=True, text=True, timeout=300)
    assert tp.returncode == 0, tp.stderr
    lines = tp.stdout.strip().splitlines()
    assert len(lines) == 1  # one answer: rank 0's
    alone = Engine.from_pretrained(folder, dtype="float32", max_context=256)
    assert json.loads(lines[0])["token_ids"] == alone.generate("the cat sat on the mat", 24).token_ids


def test_torchrun_runs_the_benchmark_and_rank_0_alone_writes_it(tiny_factory, tmp_path):
    """Static trees (tr's 2.2.2, hybrid-81's flat curve): the TP calibration is the generate command's test's."""
    import json
    import subprocess
    import sys

    folder = str(tiny_factory("tp-methods", num_heads=6, num_kv_heads=3, vocab_size=301))
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["the cat sat on the mat, the cat",
                                                                                   "and then?"]}) + "\n")
    out = tmp_path / "out"
    tp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                         str(free_port()), "-m", "bench.specbench", "--tp", "2", "--model", folder, "--dtype",
                         "float32", "--questions", str(questions), "--methods", "tr", "hybrid-81", "--max-new-tokens",
                         "16", "--warmup", "1", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert tp.returncode == 0, tp.stderr
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["turn"], r["method"]) for r in records] == [(t, m) for t in (0, 1) for m in ("ar", "tr", "hybrid-81")]
    assert all(r["identical"] for r in records) and any(r["steps"] < r["new_tokens"] - 1 for r in records)
    summary = (out / "summary.md").read_text()
    assert "split over 2 ranks" in summary and tp.stdout.count(summary.splitlines()[0]) == 1  # printed by rank 0


def test_a_killed_rank_ends_the_run_with_one_line_on_rank_0(tiny_factory):
    """Started as torchrun starts ranks (its environment variables), rank 1 killed mid-answer: rank 0 stops within
    the timeout with one line naming the cause, instead of hanging in its next all-reduce."""
    import subprocess
    import sys

    folder = str(tiny_factory("tp-long", num_heads=6, num_kv_heads=3, vocab_size=301, max_positions=8192))
    port, ranks = free_port(), []
    for rank in range(2):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "TR_ENGINE_TP_TIMEOUT_S": "30"}
        ranks.append(subprocess.Popen([sys.executable, "-m", "tr_engine.generate", "--model", folder, "--tp", "2",
                                       "--prompt", "hello there", "--max-new-tokens", "3000", "--max-context", "4096",
                                       "--method", "ar", "--threads", "1"], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    time.sleep(6)  # loaded and decoding ("hello there" runs to 3000 tokens here, about 20 s at 2 ranks)
    assert ranks[0].poll() is None and ranks[1].poll() is None
    ranks[1].kill()
    started = time.time()
    _, err = ranks[0].communicate(timeout=60)
    assert time.time() - started < 35 and ranks[0].returncode == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: another rank of this --tp run stopped"), err


def test_torchrun_chat_reads_on_rank_0_and_every_rank_follows(tiny_factory):
    import subprocess
    import sys

    folder = str(tiny_factory("tp-methods", num_heads=6, num_kv_heads=3, vocab_size=301))
    # (the paper's static tree: measuring a verify cost curve at TP=2, 4 s of each rank, is the generate test's part)
    command = ["-m", "tr_engine.chat", "--model", folder, "--max-new-tokens", "16", "--quiet", "--no-persist",
               "--max-context", "256", "--tree", "2.2.2"]
    turns = "hello there\n/method tr\nthe cat sat on the mat\n"
    alone = subprocess.run([sys.executable, *command], input=turns, capture_output=True, text=True, timeout=300)
    tp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                         str(free_port()), *command, "--tp", "2"], input=turns, capture_output=True, text=True,
                        timeout=300)
    assert alone.returncode == 0 and tp.returncode == 0, tp.stderr
    assert tp.stdout == alone.stdout and tp.stdout.count("\n") == 2  # two answers, once each


def test_torchrun_chat_outlasts_a_pause_in_its_input_longer_than_the_timeout(tiny_factory):
    """While rank 0 waits for a line (a person thinking), the other ranks wait for it in a collective: rank 0's
    heartbeats keep that wait inside $TR_ENGINE_TP_TIMEOUT_S, so a pause longer than it (7 s against 5) ends nothing."""
    import subprocess
    import sys

    folder = str(tiny_factory("tp-methods", num_heads=6, num_kv_heads=3, vocab_size=301))
    command = ["-m", "tr_engine.chat", "--model", folder, "--max-new-tokens", "8", "--quiet", "--no-persist",
               "--max-context", "256", "--method", "tr", "--tree", "2.2.2"]  # (static: no curve measured)
    alone = subprocess.run([sys.executable, *command], input="hello there\nand again\n", capture_output=True,
                           text=True, timeout=300)
    tp = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), *command, "--tp", "2"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env={**os.environ, "TR_ENGINE_TP_TIMEOUT_S": "5"})
    try:
        tp.stdin.write("hello there\n")
        tp.stdin.flush()
        first = tp.stdout.readline()  # the first answer; then 7 s with no input
        time.sleep(7)
        assert tp.poll() is None, tp.stderr.read()
        rest, err = tp.communicate("and again\n", timeout=120)
    finally:
        tp.kill()
    assert alone.returncode == 0 and tp.returncode == 0, err
    assert first + rest == alone.stdout and alone.stdout.count("\n") == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_stable_topk_is_the_head_of_a_stable_sort_ties_and_all(dtype):
    """torch.topk alone may take any of several values tied at the k-th place; stable_topk takes the lowest ids, as
    the recycling kernel and a stable sort do, and orders ties by id."""
    from tr_engine.model.parallel import stable_topk

    g = torch.Generator().manual_seed(0)
    for distinct in (1, 3, 40, None):  # every value tied, a few values (ties everywhere), some ties, almost none
        x = torch.randn(16, 301, generator=g) if distinct is None else torch.randint(0, distinct, (16, 301),
                                                                                     generator=g) / 4
        x = x.to(dtype)
        values, ids = x.sort(dim=-1, descending=True, stable=True)
        for k in (1, 2, 8, 301):
            got = stable_topk(x, k)
            assert torch.equal(got[0], values[:, :k]) and torch.equal(got[1], ids[:, :k]), (distinct, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ops", ["kernels", "reference"])
def test_a_ranks_top_k_from_the_ops_is_stable_topks(ops, dtype, cpu_tier):
    """A greedy verify under tensor parallelism takes each rank's top-k of its columns (Llama.top_k) from the compiled
    top_k_rows on a CPU (stable_topk with the reference ops): the same values and ids in the same order, ties and
    all, on every CPU tier."""
    from types import SimpleNamespace

    from tr_engine.model.llama import Llama
    from tr_engine.model.ops import load_ops
    from tr_engine.model.parallel import stable_topk

    rank = SimpleNamespace(ops=load_ops(ops))
    g = torch.Generator().manual_seed(1)
    for distinct in (1, 3, 40, None):
        x = torch.randn(16, 301, generator=g) if distinct is None else torch.randint(0, distinct, (16, 301),
                                                                                     generator=g) / 4
        x = x.to(dtype)
        for k in (1, 8, 301):
            got, want = Llama._local_top_k(rank, x, k), stable_topk(x, k)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (distinct, k)


def recycle_logits(V: int = 301, T: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    """A verify step's tokens (a repeated one among them) and logits with many ties (a few distinct values)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 40, (T, V), generator=g).float() / 4  # ~8 ids per value: ties, across the shards
    tokens = torch.tensor([5, 17, 300, 5, 150, 151, 0, 17, 42])
    return tokens, logits


def topk_worker(rank: int, world: int, port: int, out: str) -> None:
    from tr_engine.core.matrix import RecyclingMatrix

    shard = joined(rank, world, port)
    tokens, logits = recycle_logits()
    start, stop = shard.split(logits.shape[1])
    values, ids = shard.topk(logits[:, start:stop], 8, start)  # this rank's shard of the logits only
    matrix = RecyclingMatrix(logits.shape[1], 8)
    matrix.recycle_top_(tokens, values, ids)
    torch.save((matrix.table, matrix.confidence), f"{out}.{rank}")
    finish()


@pytest.mark.parametrize("world", [2, 3])
def test_the_shards_top_k_merged_recycle_the_rows_the_whole_logits_do(world, tmp_path):
    from tr_engine.core.matrix import RecyclingMatrix

    spawn(topk_worker, world, str(tmp_path / "m"))
    tokens, logits = recycle_logits()
    values, ids = logits.sort(dim=-1, descending=True, stable=True)
    first = Shard(0, world).split(logits.shape[1])[1]
    straddles = [(ids[t, :8] < first).any() and (ids[t, :8] >= first).any() and
                 any((values[t, :8] == v).sum() > 1 for v in values[t, :8]) for t in range(len(tokens))]
    assert any(straddles)  # (a row whose top-k mixes the shards and holds a tie: the case the merge must get right)
    for ops in ("reference", "kernels"):
        whole = RecyclingMatrix(logits.shape[1], 8, ops=ops)
        whole.recycle_(tokens, logits)
        for rank in range(world):
            table, confidence = torch.load(tmp_path / f"m.{rank}")
            assert torch.equal(table, whole.table) and torch.equal(confidence, whole.confidence), (ops, rank)
