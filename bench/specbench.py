"""Spec-Bench-style evaluation: every method on the same questions, model, dtype and threads, side by side.

For each question's first turn (chat template) it runs the chosen methods one after another, records tokens, steps,
mean accepted tokens per step (MAT, bonus token included), prefill and decode seconds, and whether the tokens equal
the `ar` run's. Token Recycling keeps its matrix across questions (hot start) after --warmup questions.
Writes results.jsonl and summary.md (the paper's table shape: per category group) under --out.

    python -m bench.specbench [--methods ar tr pld] [--dtype float32] [--max-new-tokens 256] [--limit N]
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.machine import machine_info, machine_line
from tr_engine.engine import Engine

DEFAULT_QUESTIONS = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench_dev.jsonl"
GROUPS = {"translation": "translation", "summarization": "summarization", "qa": "qa", "math_reasoning": "math",
          "rag": "rag"}  # every other category is MT-bench: "conversation"
GROUP_ORDER = ["conversation", "translation", "summarization", "qa", "math", "rag"]


def group_of(category: str) -> str:
    return GROUPS.get(category, "conversation")


def load_questions(path: Path, limit: int | None, categories: list[str] | None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if categories:
        rows = [r for r in rows if group_of(r["category"]) in categories or r["category"] in categories]
    return rows[:limit] if limit else rows


def summarize(records: list[dict], methods: list[str]) -> dict:
    """Per method and group: MAT (mean over steps), tokens/s (total tokens / total seconds), speedup over ar."""
    table = {}
    for m in methods:
        for g in GROUP_ORDER + ["all"]:
            rows = [r for r in records if r["method"] == m and (g == "all" or r["group"] == g)]
            if not rows:
                continue
            steps = sum(r["steps"] for r in rows)
            tokens = sum(r["new_tokens"] for r in rows)
            seconds = sum(r["prefill_s"] + r["decode_s"] for r in rows)
            committed = sum(sum(r["accept_lengths"]) for r in rows)
            table[(m, g)] = {"mat": committed / steps if steps else 0.0, "tok_s": tokens / seconds,
                             "identical": sum(r["identical"] for r in rows), "n": len(rows)}
    for (m, g), v in table.items():
        base = table.get(("ar", g))
        v["speedup"] = v["tok_s"] / base["tok_s"] if base else float("nan")
    return table


def write_summary(out: Path, table: dict, records: list[dict], methods: list[str], args, info: dict) -> str:
    groups = [g for g in GROUP_ORDER + ["all"] if any((m, g) in table for m in methods)]
    lines = [
        f"# Spec-Bench dev split: {', '.join(methods)} on {args.model} ({args.dtype})",
        "",
        f"First turns of {args.questions.name}, chat template, greedy, up to {args.max_new_tokens} new tokens; "
        f"Token Recycling hot (matrix kept across questions) after {args.warmup} warm-up questions, tree "
        f"{args.tree}, k = {args.topk}. MAT = tokens committed per decode step, bonus token included.",
        f"Machine: {machine_line(info)}.",
        "",
        "Speedup over our own plain greedy decoding (wall clock, prefill included):",
        "",
        "| method | " + " | ".join(groups) + " |",
        "|---|" + "---|" * len(groups),
    ]
    for m in methods:
        cells = [f"{table[(m, g)]['speedup']:.2f}x" if (m, g) in table else "" for g in groups]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", "MAT:", "", "| method | " + " | ".join(groups) + " |", "|---|" + "---|" * len(groups)]
    for m in methods:
        lines.append(f"| {m} | " + " | ".join(f"{table[(m, g)]['mat']:.2f}" if (m, g) in table else ""
                                             for g in groups) + " |")
    lines += ["", "| method | tokens/s | speedup | MAT | identical to ar |", "|---|---|---|---|---|"]
    for m in methods:
        v = table[(m, "all")]
        flag = "" if v["identical"] == v["n"] else " **DIFFERS**"
        lines.append(f"| {m} | {v['tok_s']:.1f} | {v['speedup']:.2f}x | {v['mat']:.2f} | "
                     f"{v['identical']}/{v['n']}{flag} |")
    phases = ("retrieve", "verify", "accept", "compact", "recycle")
    lines += ["", "Where decode time goes (share of decode seconds, all questions):", "",
              "| method | " + " | ".join(phases) + " |", "|---|" + "---|" * len(phases)]
    for m in methods:
        if m == "ar":
            continue
        totals = [sum(r.get("phase_s", {}).get(p, 0.0) for r in records if r["method"] == m) for p in phases]
        decode = sum(r["decode_s"] for r in records if r["method"] == m) or 1.0
        lines.append(f"| {m} | " + " | ".join(f"{100 * t / decode:.0f}%" for t in totals) + " |")
    if args.dtype in ("bfloat16", "bf16", "float16", "fp16") and any(
            table[(m, "all")]["identical"] < table[(m, "all")]["n"] for m in methods):
        lines += ["", f"In {args.dtype} a 1-token forward and a many-token verify forward round differently, so "
                  "near-tied argmaxes flip and answers drift apart from AR's (shared/FACTS.md); where an answer "
                  "differs, its speed is not a like-for-like comparison. Losslessness is checked in float32."]
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.specbench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS)
    ap.add_argument("--methods", nargs="+", default=["ar", "tr", "pld"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--limit", type=int, default=None, help="first N questions only")
    ap.add_argument("--categories", nargs="+", default=None, help="category groups or categories to run")
    ap.add_argument("--warmup", type=int, default=3, help="questions run by tr before measuring (hot start)")
    ap.add_argument("--tree", default="2.2.2")
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("bench/out/specbench"))
    ap.add_argument("--from-results", action="store_true",
                    help="only rebuild summary.md from --out's results.jsonl and machine.json (no model run)")
    args = ap.parse_args(argv)
    if args.from_results:
        records = [json.loads(line) for line in (args.out / "results.jsonl").read_text().splitlines()]
        methods = list(dict.fromkeys(r["method"] for r in records))
        info = json.loads((args.out / "machine.json").read_text())
        print(write_summary(args.out, summarize(records, methods), records, methods, args, info))
        return 0
    if "ar" not in args.methods:
        args.methods = ["ar"] + args.methods  # the baseline and the losslessness reference
    torch.set_num_threads(args.threads)
    info = machine_info()  # before the run: the commit that produced the numbers
    engine = Engine.from_pretrained(args.model, dtype=args.dtype, max_context=4096, tree=args.tree, topk=args.topk)
    questions = load_questions(args.questions, args.limit, args.categories)
    warm = load_questions(args.questions, None, None)[-args.warmup:] if args.warmup else []
    for q in warm:  # warm the matrix on questions from the end of the file
        engine.generate(q["turns"][0], args.max_new_tokens, method="tr")
    args.out.mkdir(parents=True, exist_ok=True)
    records = []
    with open(args.out / "results.jsonl", "w") as f:
        for i, q in enumerate(questions, 1):
            reference = None
            for m in args.methods:
                r = engine.generate(q["turns"][0], args.max_new_tokens, method=m)
                g = r.generation
                reference = r.token_ids if m == "ar" else reference
                rec = {"question_id": q["question_id"], "category": q["category"], "group": group_of(q["category"]),
                       "method": m, "new_tokens": len(g.token_ids), "steps": g.steps,
                       "accept_lengths": g.accept_lengths, "mat": r.mean_accepted, "prefill_s": g.prefill_s,
                       "decode_s": g.decode_s, "phase_s": g.phase_s, "identical": r.token_ids == reference}
                records.append(rec)
                f.write(json.dumps(rec) + "\n")
                f.flush()
            done = [r for r in records if r["question_id"] == q["question_id"]]
            print(f"[{i}/{len(questions)}] {q['category']:>14} " + "  ".join(
                f"{r['method']} {r['new_tokens'] / (r['prefill_s'] + r['decode_s']):5.1f} tok/s MAT {r['mat']:.2f}"
                f"{'' if r['identical'] else ' DIFF'}" for r in done), flush=True)
    text = write_summary(args.out, summarize(records, args.methods), records, args.methods, args, info)
    (args.out / "machine.json").write_text(json.dumps(info, indent=2) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
