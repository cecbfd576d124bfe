"""Batched decoding's throughput and latency, side by side: batch sizes 1, 2, 4, 8, 16 × methods ar, tr, hybrid, pld,
on the same dev-split questions, in one run per dtype.

    python -m bench.batch [--dtypes bfloat16 float32] [--questions 16] [--max-new-tokens 128] [--rounds 3]
    python -m bench.batch --questions-file bench/data/memory.jsonl --questions 52 --suffix-index 64 \
        --methods ar hybrid --dtypes bfloat16 --name batch_memory

Each configuration answers every question with generate_batch at that batch size (prefills included: a request
joins when a slot frees). Reported: total tokens/s (all requests' tokens over the wall clock), each request's own
tokens/s (median), the latency per token (a step's time over the tokens it committed to a request: p50 and p99
over every token), speedup over batch-1 plain decoding and over plain decoding at the same batch size, and whether
every request's tokens equal its batch-1 plain decoding's. The recycling matrix (and with --suffix-index, the suffix
index hybrid also drafts from) is warmed first on other questions (a file's own warm-up rows where it has them) and
shared by tr and hybrid (hot, as in use); every configuration starts from that warm state, so none drafts from the
answers an earlier configuration gave to the same questions. With --rounds R every configuration runs R times, the
methods of a batch size in turn (each first in one round), and each row is its median round's: on a host whose speed
moves 10-15% within minutes, one run of each configuration after another puts that into the ratios. Writes
NAME.{md,json,png} (default batch).
"""

import sys
import time
from pathlib import Path

SIZES = (1, 2, 4, 8, 16)
METHODS = ("ar", "tr", "hybrid", "pld")


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def measure(engine, prompts, size: int, method: str, max_new_tokens: int) -> dict:
    t0 = time.perf_counter()
    results = engine.generate_batch(prompts, max_new_tokens, method=method, batch_size=size)
    wall = time.perf_counter() - t0
    latencies, own = [], []
    for r in results:
        g = r.generation
        if r.error is not None:
            raise SystemExit(f"error: {r.error}")
        own.append(len(g.token_ids) / (g.prefill_s + g.decode_s))
        if size == 1 and method == "ar":  # the batch-1 plain run: generate()'s own loop has no step clock
            continue
        last = 0.0
        for n, end in zip(g.accept_lengths, g.step_end_s):
            latencies += [(end - last) / n] * n
            last = end
    tokens = sum(len(r.token_ids) for r in results)
    prefill = sum(r.generation.prefill_s for r in results)  # between steps, so no decoding happens meanwhile
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall, "prefill_s": prefill,
            "decode_tokens_per_s": tokens / (wall - prefill),
            "request_tokens_per_s": percentile(own, 0.5), "latency_ms_p50": 1e3 * percentile(latencies, 0.5),
            "latency_ms_p99": 1e3 * percentile(latencies, 0.99), "token_ids": [r.token_ids for r in results],
            "verify_tokens_per_step": sum(sum(r.generation.verify_tokens) for r in results)
            / max(1, sum(r.generation.steps for r in results))}


class WarmState:
    """The engine's recycling matrix and suffix index as the warm-up left them, put back before each configuration."""

    def __init__(self, engine):
        from tr_engine.core.suffix import BYTES_PER_TOKEN, SuffixIndex

        self.engine, self.matrix = engine, (engine.matrix.table.clone(), engine.matrix.confidence.clone())
        index = engine.drafting.suffix
        self.suffix = None
        if index is not None:
            self.suffix = SuffixIndex(index.vocab_size, index.capacity * BYTES_PER_TOKEN)
            self.suffix.copy_(index)

    def restore(self) -> None:
        self.engine.matrix.copy_(*self.matrix)
        if self.suffix is not None:
            self.engine.drafting.suffix.copy_(self.suffix)


def baseline(engine, prompts, max_new_tokens: int) -> dict:
    """Batch-1 plain decoding through generate(), today's single-sequence engine: the baseline row."""
    t0 = time.perf_counter()
    results = [engine.generate(p, max_new_tokens, method="ar") for p in prompts]
    wall = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for r in results)
    prefill = sum(r.generation.prefill_s for r in results)
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall, "prefill_s": prefill,
            "decode_tokens_per_s": tokens / (wall - prefill),
            "request_tokens_per_s": percentile([r.tokens_per_s for r in results], 0.5),
            "latency_ms_p50": 1e3 * percentile([r.generation.decode_s / max(1, r.generation.steps)
                                                for r in results], 0.5),
            "latency_ms_p99": None, "token_ids": [r.token_ids for r in results], "verify_tokens_per_step": 1.0}


def run(args) -> dict:
    from bench.specbench import load_questions, warm_up_questions
    from tr_engine.engine import Engine

    questions = load_questions(args.questions_file, None, None)
    own_warm = warm_up_questions(args.questions_file, 0)  # (a file's own warm-up rows, if it has them)
    step = max(len(questions) // (args.questions + (0 if own_warm else args.warmup)), 1)
    spread = questions[::step]
    chosen = spread[: args.questions]
    warm = own_warm or spread[args.questions : args.questions + args.warmup]
    args.questions, args.warmup = len(chosen), len(warm)  # (what the table reports)
    prompts = [[{"role": "user", "content": q["turns"][0]}] for q in chosen]
    out = {}
    for dtype in args.dtypes:
        engine = Engine.from_pretrained(args.model, dtype=dtype, threads=args.threads, max_batch=max(args.sizes),
                                        suffix_bytes=args.suffix_index << 20)
        engine.cost_model()
        for q in warm:  # the shared matrix (and index), hot
            engine.generate(q["turns"][0], args.max_new_tokens, method="hybrid" if args.suffix_index else "tr")
        state = WarmState(engine)
        rows = {}
        for size in args.sizes:
            tries = {method: [] for method in args.methods}
            for r in range(args.rounds):  # the methods in turn, each first in one round: a slow spell hits them alike
                for method in args.methods[r % len(args.methods) :] + args.methods[: r % len(args.methods)]:
                    state.restore()
                    row = (baseline(engine, prompts, args.max_new_tokens) if size == 1 and method == "ar"
                           else measure(engine, prompts, size, method, args.max_new_tokens))
                    tries[method].append(row)
                    print(f"{dtype} batch {size} {method}: {row['tokens_per_s']:.1f} tok/s", file=sys.stderr,
                          flush=True)
            for method, got in tries.items():  # the round of median throughput (the lower middle of an even count)
                row = sorted(got, key=lambda x: x["tokens_per_s"])[(len(got) - 1) // 2]
                row["rounds_tokens_per_s"] = [x["tokens_per_s"] for x in got]
                row["token_ids"] = [x["token_ids"] for x in got]
                rows[f"{method}@{size}"] = row
        base, want = rows["ar@1"], rows["ar@1"]["token_ids"][0]
        for key, row in rows.items():
            same = rows.get(f"ar@{key.split('@')[1]}")  # plain decoding at the same batch size
            row["speedup_same_batch"] = row["tokens_per_s"] / same["tokens_per_s"] if same else None
            row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"]
            row["decode_speedup"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
            row["identical"] = sum(all(run[i] == b for run in row["token_ids"]) for i, b in enumerate(want))
            del row["token_ids"]  # (every round's requests, each as its batch-1 plain decoding)
        out[dtype] = rows
    return out


def write(folder: Path, data: dict, info: dict, args) -> str:
    from bench.machine import machine_line, save_results

    rounds = (f"; each row is the median of {args.rounds} rounds by total tok/s, the methods in turn in each "
              "round (each first in one)") if args.rounds > 1 else ""
    index = (f"; hybrid also drafts from a suffix index of up to {args.suffix_index} MB (--suffix-index), warmed "
             "with the matrix") if args.suffix_index else ""
    lines = ["# Batched decoding: throughput and latency by batch size and method", "",
             f"{machine_line(info)}. {args.model}, {args.questions} questions of {Path(args.questions_file).name} "
             f"(first turns), greedy, {args.max_new_tokens} new tokens at most, {args.threads} threads; the matrix "
             f"warmed on {args.warmup} other questions{index}, and every configuration started from that warm "
             f"state{rounds}. Speedup: total tokens/s over batch-1 plain decoding (`generate`), prefills "
             "included; vs ar: over plain decoding at the same batch size. "
             "Decode: the same without the prefills' time (a request's prompt is prefilled alone, between steps, "
             "so nothing else decodes meanwhile): how the steps themselves scale. Latency: a step's time over the "
             "tokens it committed to a request, over every token (a step that waited for a joining request's "
             "prefill counts it). Identical: requests whose tokens equal their batch-1 plain decoding's.", ""]
    for dtype, rows in data.items():
        lines += [f"## {dtype}", "", "| batch | method | total tok/s | speedup | vs ar | decode tok/s | decode speedup | "
                  "request tok/s (median) | latency/token p50 ms | p99 ms | tokens verified per sequence-step | "
                  "identical |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for key, r in rows.items():
            method, size = key.split("@")
            p99 = f"{r['latency_ms_p99']:.1f}" if r["latency_ms_p99"] is not None else "-"
            same = f"{r['speedup_same_batch']:.2f}x" if r.get("speedup_same_batch") else "-"
            lines.append(f"| {size} | {method} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {same} | "
                         f"{r['decode_tokens_per_s']:.1f} | {r['decode_speedup']:.2f}x | "
                         f"{r['request_tokens_per_s']:.1f} | {r['latency_ms_p50']:.1f} | {p99} | "
                         f"{r['verify_tokens_per_step']:.2f} | {r['identical']}/{args.questions} |")
        lines.append("")
    text = "\n".join(lines)
    save_results(folder / args.name, text, data, info)
    plot(folder / f"{args.name}.png", data, args)
    return text


def plot(path: Path, data: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(data), figsize=(6 * len(data), 4), squeeze=False)
    for ax, (dtype, rows) in zip(axes[0], data.items()):
        for method in args.methods:
            ax.plot(args.sizes, [rows[f"{method}@{s}"]["tokens_per_s"] for s in args.sizes], marker="o",
                    label=method)
        ax.set(xscale="log", xticks=args.sizes, xticklabels=[str(s) for s in args.sizes], xlabel="batch size",
               ylabel="total tokens/s", title=dtype)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    from bench.machine import machine_info
    from bench.specbench import DEFAULT_QUESTIONS
    from tr_engine.cli.common import ArgumentParser
    from tr_engine.cli.args import integer

    ap = ArgumentParser(prog="python -m bench.batch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["float32", "bfloat16"])
    ap.add_argument("--questions", type=integer(1), default=16, help="questions, spread over the file")
    ap.add_argument("--warmup", type=integer(0), default=4, help="other questions that warm the matrix first")
    ap.add_argument("--questions-file", type=Path, default=DEFAULT_QUESTIONS)
    ap.add_argument("--max-new-tokens", type=integer(1), default=128)
    ap.add_argument("--threads", type=integer(1), default=2)
    ap.add_argument("--rounds", type=integer(1), default=1,
                    help="runs of every configuration, the methods in turn; each row is its median round's")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--sizes", nargs="+", type=integer(1), default=list(SIZES), help="batch sizes (1 is needed)")
    ap.add_argument("--suffix-index", type=integer(0), default=0, metavar="MB",
                    help="hybrid also drafts from a suffix index of this bound (0: none)")
    ap.add_argument("--name", default="batch", help="the results' file name under --out")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    if 1 not in args.sizes or "ar" not in args.methods:
        ap.error("the baseline is plain decoding at batch 1: keep 1 in --sizes and ar in --methods")
    args.sizes = sorted(set(args.sizes))
    info = machine_info()
    print(write(args.out, run(args), info, args))
    return 0


if __name__ == "__main__":
    from tr_engine.cli.common import run as run_cli

    raise SystemExit(run_cli(main))
