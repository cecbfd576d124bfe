"""Which dtype a CPU tier should default to: each half type's answers against float32's, and its speed, in one run.

    python -m bench.dtypes [--questions 24] [--max-new-tokens 64] [--tier amx] [--threads 2]

Every dtype answers the same questions (first turns of the dev split, spread over its categories, the chat template,
greedy, EOS as a user gets it) by plain decoding and by hybrid drafting, the dtypes in turn question by question (each
first in its share of them), so a noisy spell hits them alike. float32's plain answers are the reference: for each
other dtype, how many answers are identical to float32's and how many tokens agree before the first difference. Every
method in a dtype commits that dtype's plain answer (tested elsewhere: tests/test_cpu_tiers.py), so the quality of a
dtype is that of its plain decoding, and its speed is its hybrid's. Each dtype's engine keeps its own recycling
matrix and suffix index, warmed first on other questions. Writes dtypes_<tier>.{md,json} under --out.
"""

import sys
import time
from pathlib import Path

DTYPES = ("float32", "float16", "bfloat16")


def agreeing(a: list[int], b: list[int]) -> int:
    """Tokens `a` and `b` share before their first difference (the shorter's length if one is the other's start)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run(args) -> dict:
    from bench.specbench import load_questions
    from tr_engine.engine import Engine

    rows = load_questions(args.questions_file, None, None)
    step = max(len(rows) // (args.questions + args.warmup), 1)
    spread = rows[::step]
    chosen, warm = spread[: args.questions], spread[args.questions : args.questions + args.warmup]
    engines = {}
    for dtype in args.dtypes:
        engine = Engine.from_pretrained(args.model, dtype=dtype, threads=args.threads)
        engine.cost_model()
        for q in warm:
            engine.generate(q["turns"][0], args.max_new_tokens, method="hybrid")
        engines[dtype] = engine
    got = {d: {"ar": [], "hybrid": []} for d in args.dtypes}  # per method: (tokens, seconds) per question
    for i, q in enumerate(chosen):
        order = args.dtypes[i % len(args.dtypes) :] + args.dtypes[: i % len(args.dtypes)]
        for dtype in order:
            for method in ("ar", "hybrid") if i % 2 == 0 else ("hybrid", "ar"):
                t0 = time.perf_counter()
                r = engines[dtype].generate(q["turns"][0], args.max_new_tokens, method=method)
                got[dtype][method].append((r.token_ids, time.perf_counter() - t0))
        print(f"question {i + 1}/{len(chosen)}", file=sys.stderr, flush=True)
    reference = [tokens for tokens, _ in got["float32"]["ar"]] if "float32" in got else None
    out = {}
    for dtype, runs in got.items():
        row = {}
        for method, done in runs.items():
            row[f"{method}_tokens_per_s"] = sum(len(t) for t, _ in done) / sum(s for _, s in done)
        row["lossless"] = sum(h == a for (h, _), (a, _) in zip(runs["hybrid"], runs["ar"]))
        if reference is not None:
            answers = [t for t, _ in runs["ar"]]
            row["identical_to_float32"] = sum(a == b for a, b in zip(answers, reference))
            row["agreeing_tokens"] = sum(agreeing(a, b) for a, b in zip(answers, reference)) / len(answers)
            row["float32_tokens"] = sum(len(b) for b in reference) / len(reference)
        out[dtype] = row
    return {"questions": len(chosen), "warmup": len(warm), "rows": out}


def write(folder: Path, data: dict, info: dict, args) -> str:
    from bench.machine import machine_line, save_results

    base = data["rows"].get("float16")
    lines = [f"# Half types against float32 on the {info['cpu_tier']} tier: answers and speed", "",
             f"{machine_line(info)}. {args.model}, {data['questions']} questions of {args.questions_file.name} (first "
             f"turns, spread over its categories), greedy, up to {args.max_new_tokens} new tokens, EOS honoured; each "
             f"dtype's engine warmed on {data['warmup']} other questions. Identical: answers equal to float32's plain "
             "answer; agreeing: tokens before the first difference from it (mean, of float32's mean answer length). "
             "Tokens/s: all answers' tokens over their wall time, prefills included; the dtypes alternated question "
             "by question. Lossless: hybrid answers equal to the same dtype's plain ones.", "",
             "| dtype | identical to float32 | agreeing tokens | plain tok/s | hybrid tok/s | plain vs float16 | "
             "hybrid vs float16 | lossless |", "|---|---|---|---|---|---|---|---|"]
    for dtype, r in data["rows"].items():
        same = (f"{r['identical_to_float32']}/{data['questions']}" if "identical_to_float32" in r else "-")
        agree = (f"{r['agreeing_tokens']:.1f} of {r['float32_tokens']:.1f}" if "agreeing_tokens" in r else "-")
        rel = lambda key: f"{r[key] / base[key]:.2f}x" if base else "-"  # noqa: E731
        lines.append(f"| {dtype} | {same} | {agree} | {r['ar_tokens_per_s']:.1f} | {r['hybrid_tokens_per_s']:.1f} | "
                     f"{rel('ar_tokens_per_s')} | {rel('hybrid_tokens_per_s')} | {r['lossless']}/{data['questions']} |")
    text = "\n".join(lines) + "\n"
    return save_results(folder / f"dtypes_{info['cpu_tier']}", text, data, info)


def main(argv=None) -> int:
    from bench.specbench import DEFAULT_QUESTIONS
    from tr_engine.cli.args import integer
    from tr_engine.cli.common import ArgumentParser
    from tr_engine.model import cpu

    ap = ArgumentParser(prog="python -m bench.dtypes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    ap.add_argument("--questions", type=integer(1), default=24, help="questions, spread over the file")
    ap.add_argument("--warmup", type=integer(0), default=3, help="other questions that warm each engine first")
    ap.add_argument("--questions-file", type=Path, default=DEFAULT_QUESTIONS)
    ap.add_argument("--max-new-tokens", type=integer(1), default=64)
    ap.add_argument("--threads", type=integer(1), default=2)
    ap.add_argument("--tier", choices=cpu.NAMES, default=None,
                    help="the CPU kernel tier to run (default: TR_ENGINE_CPU's, else the best this CPU runs)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)

    from bench.machine import machine_info

    cpu.use(args.tier)
    info = machine_info()
    data = run(args)
    print(write(args.out, data, info, args))
    return 0


if __name__ == "__main__":
    from tr_engine.cli.common import run as run_cli

    raise SystemExit(run_cli(main))
