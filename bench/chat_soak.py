"""Chat soak run: many piped turns through one chat process, its resident memory sampled as it goes.

A long-lived chat (or a server) must not grow: every turn leaves statistics, drafter state and a conversation behind,
and the recycling matrix is updated all along. This feeds the real `python -m tr_engine.chat` the dev split's
questions (both turns of each, then /reset, round and round) with its matrix persisting in a file (loaded at start,
saved at exit), reads the process's resident set size (VmRSS) every `--every` turns, and checks that after the last
turn it is within 10% of what it was after turn 50 (the first turns grow caches and allocator pools that then
stay). A benchmark, not a test: minutes of decoding.

    python -m bench.chat_soak [--turns 300] [--every 25] [--max-new-tokens 48] [--out bench/results]
"""

import json
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.machine import machine_info, machine_line, rss_kb, save_results
from bench.specbench import DEFAULT_QUESTIONS
from tr_engine.cli.args import integer
from tr_engine.cli.common import ArgumentParser, run

STATUS = re.compile(r"^\[(\d+) tokens, ")  # the status line the chat prints to stderr after each answer
BASELINE_TURN = 50
TOLERANCE = 0.10


def turns_of(path: Path):
    """Every question's turns, one line each (a newline inside a turn would split it), with /reset between
    questions; round and round."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    while True:
        for row in rows:
            for text in row["turns"]:
                yield " ".join(text.split())
            yield "/reset"


def soak(args) -> dict:
    matrix = Path(args.matrix or Path(tempfile.mkdtemp(prefix="tr_soak_")) / "matrix.pt")
    cmd = [sys.executable, "-m", "tr_engine.chat", "--model", args.model, "--max-new-tokens", str(args.max_new_tokens),
           "--matrix", str(matrix)]
    chat = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            bufsize=1)
    answered = queue.Queue()  # one item per finished turn: its token count, or an error line
    stderr_tail = []

    def read_stderr():
        for line in chat.stderr:
            stderr_tail[:] = (stderr_tail + [line.rstrip()])[-20:]
            m = STATUS.match(line)
            if m:
                answered.put(int(m.group(1)))
            elif line.startswith("error: "):
                answered.put(line.strip())

    threading.Thread(target=read_stderr, daemon=True).start()
    threading.Thread(target=lambda: [None for _ in chat.stdout], daemon=True).start()  # drain the answers

    samples, tokens, errors, t0 = [], 0, [], time.perf_counter()
    lines = turns_of(args.questions)
    turn = 0
    while turn < args.turns:
        line = next(lines)
        chat.stdin.write(line + "\n")
        chat.stdin.flush()
        if line == "/reset":
            continue
        result = answered.get(timeout=600)
        turn += 1
        if isinstance(result, str):
            errors.append(result)
        else:
            tokens += result
        if turn % args.every == 0:
            samples.append({"turn": turn, "rss_mb": round(rss_kb(chat.pid) / 1024, 1),
                            "seconds": round(time.perf_counter() - t0, 1)})
            print(f"turn {turn}: {samples[-1]['rss_mb']} MB resident, {tokens} tokens so far", file=sys.stderr)
    chat.stdin.close()
    status = chat.wait(timeout=300)
    if status != 0:
        raise RuntimeError(f"the chat exited with status {status}: {' | '.join(stderr_tail)}")
    by_turn = {s["turn"]: s["rss_mb"] for s in samples}
    base = by_turn.get(BASELINE_TURN, samples[0]["rss_mb"])
    last = samples[-1]["rss_mb"]
    return {"turns": args.turns, "max_new_tokens": args.max_new_tokens, "model": args.model, "tokens": tokens,
            "errors": errors, "seconds": round(time.perf_counter() - t0, 1), "samples": samples,
            "baseline_turn": BASELINE_TURN if BASELINE_TURN in by_turn else samples[0]["turn"],
            "growth": round(last / base - 1, 4), "within_10_percent": abs(last / base - 1) <= TOLERANCE,
            "matrix_bytes": matrix.stat().st_size, "exit_status": status}


def report(result: dict, info: dict) -> str:
    rows = "\n".join(f"| {s['turn']} | {s['rss_mb']} | {s['seconds']} |" for s in result["samples"])
    verdict = "within" if result["within_10_percent"] else "NOT within"
    return f"""# Chat soak: {result['turns']} piped turns, one process

{result['model']}, `--max-new-tokens {result['max_new_tokens']}`, the matrix persisting in a file
({result['matrix_bytes']} bytes at exit, exit status {result['exit_status']}); {result['tokens']} tokens in
{result['seconds']} s, {len(result['errors'])} refused turns.

| after turn | resident MB | seconds |
|---|---|---|
{rows}

After turn {result['turns']} the resident memory is {result['growth']:+.1%} against turn {result['baseline_turn']}:
{verdict} the 10% bound.

Machine: {machine_line(info)}
"""


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m bench.chat_soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS)
    ap.add_argument("--turns", type=integer(1), default=300)
    ap.add_argument("--every", type=integer(1), default=25, help="sample the resident memory every N turns")
    ap.add_argument("--max-new-tokens", type=integer(1), default=48)
    ap.add_argument("--matrix", default=None, help="matrix file (default: a new one in a temporary folder)")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args(argv)
    result = soak(args)
    info = machine_info()
    text = save_results(args.out / "chat_soak", report(result, info), result, info)
    print(text)
    return 0 if result["within_10_percent"] else 1


if __name__ == "__main__":
    raise SystemExit(run(main))
