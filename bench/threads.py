"""Decoding speed by thread policy, on an idle machine and beside a busy process, side by side in one run.

One engine (the default model, no --threads: it follows the load, tr_engine/model/threads.py) answers the same
questions under each policy in turn, question by question, so a noisy spell hits all alike:
  - all: the process's thread count (torch's), fixed (what an engine did before it followed the load);
  - follow: the engine's default, looking at the CPUs between steps;
  - one: 1 thread, fixed.
First on the idle machine, then beside `--busy` processes that each keep a CPU busy (a Python loop, started by the
bench), after a few seconds of looks that let the follower settle. Tokens are checked identical across policies (no
thread count changes what is computed). Writes bench/results/threads.{md,json}.

    python -m bench.threads [--dtype bfloat16] [--methods ar hybrid] [--questions 6] [--max-new-tokens 96] [--busy 1]
"""

import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.machine import machine_info, machine_line, save_results
from bench.specbench import DEFAULT_QUESTIONS, load_questions
from tr_engine.cli.args import integer
from tr_engine.cli.common import ArgumentParser, run

POLICIES = ("all", "follow", "one")
SETTLE_S = 3.0  # looks before the timed runs beside the busy processes: the follower moves after two


def busy_processes(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def use(engine, policy: str) -> None:
    """The engine under `policy` for its next runs."""
    follower = engine.threads
    engine.pace = follower.tick if policy == "follow" else None
    torch.set_num_threads({"all": follower.most, "one": 1, "follow": follower.threads}[policy])


def measure(engine, prompts: list[str], methods: list[str], max_new_tokens: int, warm) -> dict:
    """{method: {policy: [decode tok/s per prompt]}} and each policy's tokens, the policies in turn, each first for a
    third of the prompts, each run from the `warm` matrix (a policy run later must not draft from what an earlier one
    learned of the same answer), the follower's own count in the follow runs recorded."""
    speed = {m: {p: [] for p in POLICIES} for m in methods}
    tokens = {m: {p: [] for p in POLICIES} for m in methods}
    counts = []
    for i, prompt in enumerate(prompts):
        for method in methods:
            # (each first in turn: what a drafter's statistics learn from one run, the next has; the matrix is restored)
            for policy in POLICIES[i % 3 :] + POLICIES[: i % 3]:
                use(engine, policy)
                warm.restore()
                r = engine.generate(prompt, max_new_tokens, method=method)
                g = r.generation
                speed[method][policy].append(len(r.token_ids) / g.decode_s)
                tokens[method][policy].append(r.token_ids)
                if policy == "follow":
                    counts.append(engine.threads.threads)
    return {"speed": speed, "tokens": tokens, "follow_threads": counts}


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m bench.threads", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--methods", nargs="+", default=["ar", "hybrid"], choices=["ar", "tr", "hybrid", "pld"])
    ap.add_argument("--questions", type=integer(1), default=6, help="dev-split questions, spread over the file")
    ap.add_argument("--max-new-tokens", type=integer(1), default=96)
    ap.add_argument("--busy", type=integer(1), default=1, help="processes that each keep a CPU busy")
    ap.add_argument("--questions-file", type=Path, default=DEFAULT_QUESTIONS)
    ap.add_argument("--name", default="threads", help="the results' file name under --out")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)

    from bench.batch import WarmState
    from tr_engine.engine import Engine

    info = machine_info()
    rows = load_questions(args.questions_file, None, None)
    step = max(len(rows) // args.questions, 1)
    prompts = [q["turns"][0] for q in rows[::step][: args.questions]]
    engine = Engine.from_pretrained(args.model, dtype=args.dtype)
    engine.cost_model()
    for method in args.methods:  # warm-up: the kernels' first calls, the matrix's first rows
        engine.generate(prompts[0], 16, method=method)
    warm = WarmState(engine)
    results = {"idle": measure(engine, prompts, args.methods, args.max_new_tokens, warm)}
    hogs = busy_processes(args.busy)
    try:
        use(engine, "follow")
        end = time.monotonic() + SETTLE_S
        while time.monotonic() < end:
            engine.threads.tick()
            time.sleep(0.05)
        results["busy"] = measure(engine, prompts, args.methods, args.max_new_tokens, warm)
    finally:
        for h in hogs:
            h.kill()
    table = write(args, info, results, engine.threads.most)
    print(table)
    return 0


def write(args, info: dict, results: dict, most: int) -> str:
    lines = ["# Decoding speed by thread policy: idle, and beside a busy process", "",
             f"{machine_line(info)}. {args.model} in {args.dtype}, {args.questions} dev-split questions (first turns), "
             f"{args.max_new_tokens} new tokens, greedy; decode tok/s (after the prompt), the median over the "
             f"questions. Policies, alternating question by question on one engine: all = {most} threads fixed "
             "(torch's count; an engine before it followed the load), follow = the engine's default "
             "(tr_engine/model/threads.py), one = 1 thread fixed. Busy: beside "
             f"{args.busy} process(es) each keeping a CPU busy, after {SETTLE_S:.0f} s of the follower's looks.", "",
             "| load | method | all tok/s | follow tok/s | one tok/s | follow / all | follow / one | "
             "follow's threads | identical |", "|---|---|---|---|---|---|---|---|---|"]
    record = {}
    for load, r in results.items():
        counts = sorted(set(r["follow_threads"]))
        for method, by in r["speed"].items():
            med = {p: statistics.median(v) for p, v in by.items()}
            toks = r["tokens"][method]
            same = sum(toks["all"][i] == toks["follow"][i] == toks["one"][i] for i in range(len(toks["all"])))
            lines.append(f"| {load} | {method} | {med['all']:.1f} | {med['follow']:.1f} | {med['one']:.1f} | "
                         f"{med['follow'] / med['all']:.2f}x | {med['follow'] / med['one']:.2f}x | "
                         f"{', '.join(map(str, counts))} | {same}/{len(toks['all'])} |")
            record[f"{load}/{method}"] = {"median_tok_s": med, "per_question": by, "identical": same,
                                          "follow_threads": r["follow_threads"]}
    text = "\n".join(lines) + "\n"
    save_results(args.out / args.name, text, {"args": {k: str(v) for k, v in vars(args).items()},
                                              "results": record}, info)
    return text


if __name__ == "__main__":
    raise SystemExit(run(main))
