"""What a long prompt joining a running batch costs the requests already decoding, with its prompt prefilled whole
and in chunks (--prefill-chunk), side by side in one run.

    python -m bench.prefill_stall [--dtype bfloat16] [--prompt-tokens 1800] [--chunks 0 512 256 128] [--rounds 3]

Three dev-split questions decode together (hybrid, the server's default; `--method` for another); after a few of
their steps a fourth request joins with a long prompt (dev-split questions end to end, cut to --prompt-tokens), as a
client sending a document to summarise would. Reported per setting, the median of --rounds runs (the settings in turn
in each round, each first in one): the longest wait the decoding requests saw between two of their steps while the
long prompt was being prefilled (its whole prefill without chunks; one chunk's forward and a step with them), their
p99 gap over the whole run, how long the long request waited for its first token, and everyone's wall time; every
answer is held to its plain decoding alone. Writes bench/results/prefill_stall.{md,json}.
"""

import json
import statistics
import sys
import time
from argparse import ArgumentParser
from pathlib import Path

from bench.batch import percentile
from bench.machine import machine_info, machine_line, save_results

RESULTS = Path(__file__).resolve().parent / "results"


class Joining:
    """A request source (batch_steps' take/leaving): the short requests at once, the long one once `after` steps
    have run, then the end."""

    def __init__(self, short, long, after: int, steps: list):
        self.short, self.long, self.after, self.steps = list(short), long, after, steps

    def take(self, block: bool):
        from tr_engine.core.batch import END

        if self.short:
            return self.short.pop(0)
        if self.long is not None:
            if len(self.steps) < self.after:
                return None
            long, self.long = self.long, None
            long.asked = time.perf_counter()
            return long
        return END

    @staticmethod
    def leaving(active):
        return []


def run(engine, short_ids, long_ids, method: str, chunk: int, max_new_tokens: int, after: int) -> dict:
    """One run: the short requests decode, the long one joins after `after` steps; gaps between the short
    requests' steps, the long one's time to its first token, the tokens by request."""
    from tr_engine.core.batch import Request

    engine.prefill_chunk = chunk or None
    steps: list[float] = []  # when each of the short requests' steps ended (the first short request's)
    short = [Request(i, ids, max_new_tokens, ignore_eos=True) for i, ids in enumerate(short_ids)]
    long = Request(len(short), long_ids, max_new_tokens // 4)
    source = Joining(short, long, after, steps)
    tokens = {r.id: [] for r in short + [long]}
    first_token = None
    t0 = time.perf_counter()
    for event in engine.batch_loop(source, method):
        if event.error is not None:
            raise SystemExit(f"error: {event.error}")
        tokens[event.request] += event.tokens
        now = time.perf_counter()
        if event.request == 0:
            steps.append(now)
        elif event.request == long.id and first_token is None:
            first_token = now - long.asked
    wall = time.perf_counter() - t0
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    while_joining = [b - a for a, b in zip(steps, steps[1:]) if b > long.asked and a < long.asked + first_token]
    return {"max_gap_joining_ms": 1e3 * max(while_joining), "p99_gap_ms": 1e3 * percentile(gaps, 0.99),
            "median_gap_ms": 1e3 * statistics.median(gaps), "first_token_s": first_token, "wall_s": wall,
            "long_prefill_s": long.prefill_s, "tokens": tokens}


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m bench.prefill_stall", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--method", default="hybrid")
    ap.add_argument("--prompt-tokens", type=int, default=1800, help="the long prompt's tokens")
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 512, 256, 128],
                    help="--prefill-chunk settings to compare (0: whole prompts)")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="each short request's tokens (the long one's: /4)")
    ap.add_argument("--after", type=int, default=8, help="the short requests' steps before the long prompt arrives")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    import torch

    from bench.specbench import DEFAULT_QUESTIONS
    from tr_engine.core.generation import run_to_end
    from tr_engine.engine import Engine

    torch.set_num_threads(args.threads)
    info = machine_info()
    engine = Engine.from_pretrained(args.model, dtype=args.dtype, threads=args.threads, max_batch=4)
    rows = [json.loads(line) for line in DEFAULT_QUESTIONS.read_text().splitlines() if line.strip()]
    short_ids = [engine.prompt_ids(q["turns"][0]) for q in rows[:3]]
    text = "\n\n".join(q["turns"][0] for q in rows[3:])
    body = engine.tokenizer.encode(text)[: args.prompt_tokens]
    long_ids = engine.prompt_ids("Summarise these questions in one paragraph.\n\n" + engine.tokenizer.decode(body))
    if len(long_ids) + args.max_new_tokens > engine.batch_context:
        raise SystemExit(f"error: --prompt-tokens {args.prompt_tokens} does not fit the batch's "
                         f"{engine.batch_context}-token slots")
    def alone(ids, n, ignore_eos):
        return run_to_end(engine.decode_steps(ids, n, "ar", ignore_eos=ignore_eos)).token_ids

    want = {i: alone(ids, args.max_new_tokens, True) for i, ids in enumerate(short_ids)}
    want[3] = alone(long_ids, args.max_new_tokens // 4, False)
    run(engine, short_ids, long_ids, args.method, 0, args.max_new_tokens, args.after)  # (warm: the cost curve too)
    runs = {c: [] for c in args.chunks}
    for i in range(args.rounds):
        order = args.chunks[i % len(args.chunks):] + args.chunks[: i % len(args.chunks)]
        for c in order:
            r = run(engine, short_ids, long_ids, args.method, c, args.max_new_tokens, args.after)
            tokens = r.pop("tokens")
            r["identical"] = sum(tokens[k] == w for k, w in want.items())
            runs[c].append(r)
            print(f"chunk {c}: longest wait {r['max_gap_joining_ms']:.0f} ms, first token "
                  f"{r['first_token_s']:.2f} s, wall {r['wall_s']:.2f} s, identical {r['identical']}/4",
                  file=sys.stderr)
    median = {c: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "identical"} |
              {"identical": min(r["identical"] for r in rs)} for c, rs in runs.items()}
    base = median[args.chunks[0]]
    lines = [
        "# A long prompt joining a running batch: prefilled whole or in chunks",
        "",
        f"{machine_line(info)}. {args.model} ({args.dtype}), {args.threads} threads, method {args.method}. Three "
        f"dev-split questions decode together ({args.max_new_tokens} tokens each); after {args.after} of their steps a "
        f"fourth request joins with a {len(long_ids)}-token prompt (dev-split questions end to end). Each row: the "
        f"median of {args.rounds} runs, the settings in turn (each first in one round). Longest wait: the longest "
        "time between two steps of the decoding requests while the long prompt was being prefilled; gaps: between "
        "two of their steps over the whole run; first token: the long request's wait from arrival; identical: "
        "requests whose tokens equal their plain decoding alone (of 4).",
        "",
        "| --prefill-chunk | longest wait ms | vs whole | p99 gap ms | median gap ms | long prompt's first token s | "
        "its prefill s | wall s | identical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c, m in median.items():
        lines.append(f"| {c or 'whole'} | {m['max_gap_joining_ms']:.0f} | "
                     f"{m['max_gap_joining_ms'] / base['max_gap_joining_ms']:.2f}x | {m['p99_gap_ms']:.0f} | "
                     f"{m['median_gap_ms']:.1f} | {m['first_token_s']:.2f} | {m['long_prefill_s']:.2f} | "
                     f"{m['wall_s']:.2f} | {m['identical']}/4 |")
    text = "\n".join(lines) + "\n"
    print(save_results(args.out / "prefill_stall", text, {"args": {k: str(v) for k, v in vars(args).items()},
                                                          "prompt_tokens": len(long_ids), "median": median,
                                                          "runs": runs}, info))
    return 0 if all(m["identical"] == 4 for m in median.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
