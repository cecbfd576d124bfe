"""The chat command end to end at a real model's size on this machine, without the real weights. A checkpoint of the
shape (Vicuna-7B by default) with random bf16 weights is written to a scratch folder named after the model, so the
chat picks Vicuna's template as it does for a real Vicuna folder that has none, with a sentencepiece tokenizer of
Llama-2's kind (BPE, byte fallback) trained on the Spec-Bench questions: as many pieces as they yield, up to the
shape's vocabulary (bench.load_memory.write_checkpoint zeroes the LM head's rows past them). Then `python -m
tr_engine.cli.chat` answers the same two turns, piped, in a fresh process per method: plain decoding, and the default
method with `--recalibrate`, so that its one-time measurement of the verify cost (the adaptive tree's input) is
timed on its own, right after loading.

Reported: seconds from the command's start to the end of loading (the calibration's notice) and to the first
answer's first byte; the process's resident memory after loading and at its peak, as multiples of the weights'
bytes; and the chat's own line for each turn (tokens/s, prefill). MAT and the answers mean nothing with random
weights (the drafts are a random model's); a step's speed does not depend on the values. Writes
chat_shape_<shape>[_<tier>].{md,json} (bench.machine.tier_suffix).

    python -m bench.chat_shape [--shape vicuna-7b] [--max-new-tokens 48] [--scratch DIR]
"""

import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from bench.load_memory import scratch_folder, write_checkpoint
from bench.machine import machine_info, machine_line, save_results, status_kb, tier_suffix
from bench.shapes import SHAPES
from bench.specbench import DEFAULT_QUESTIONS, load_questions
from tr_engine.cli.args import integer
from tr_engine.cli.common import ArgumentParser, run

STATUS = re.compile(r"\[(\d+) tokens, ([\d.]+) tok/s(?:, MAT ([\d.]+))?, (\w+), prefill (\d+) tokens in ([\d.]+)s\]")
NOTICE = "measuring this machine's verify cost"


def live_kb(pid: int, field: str) -> int | None:
    """bench.machine.status_kb, or None once the process has ended (it may between a poll and the read)."""
    try:
        return status_kb(pid, field)
    except (OSError, RuntimeError):
        return None


def chat(folder: Path, turns: list[str], args: list[str], home: Path) -> dict:
    """One chat process answering `turns`: when its lines came (seconds from the start), its memory, its turns."""
    env = {**os.environ, "TR_ENGINE_HOME": str(home)}
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "tr_engine.chat", "--model", str(folder), "--dtype", "bfloat16",
                             "--no-persist", *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, cwd=Path(__file__).resolve().parents[1])
    proc.stdin.write("".join(t.replace("\n", " ") + "\n" for t in turns).encode())
    proc.stdin.close()
    seen = {"first_byte_s": None, "notice_s": None, "rss_after_load_kb": None, "stderr": []}

    def read_stdout():
        if proc.stdout.read(1):
            seen["first_byte_s"] = time.monotonic() - start
        proc.stdout.read()

    def read_stderr():
        for raw in proc.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            if NOTICE in line and seen["notice_s"] is None:
                seen["notice_s"] = time.monotonic() - start
                seen["rss_after_load_kb"] = live_kb(proc.pid, "VmRSS")
            seen["stderr"].append(line)

    readers = [threading.Thread(target=read_stdout), threading.Thread(target=read_stderr)]
    for r in readers:
        r.start()
    peak = 0
    while proc.poll() is None:
        peak = max(peak, live_kb(proc.pid, "VmHWM") or 0)
        if seen["first_byte_s"] is not None and seen["rss_after_load_kb"] is None:
            seen["rss_after_load_kb"] = live_kb(proc.pid, "VmRSS")  # (plain decoding: at its first answer)
        time.sleep(0.2)
    for r in readers:
        r.join()
    if proc.returncode != 0:
        raise RuntimeError(f"the chat failed ({proc.returncode}): {seen['stderr'][-3:]}")
    turns_out = []
    for line in seen["stderr"]:
        m = STATUS.search(line)
        if m:
            tokens, tps, mat, method, prefill, prefill_s = m.groups()
            turns_out.append({"tokens": int(tokens), "tok_s": float(tps), "mat": float(mat) if mat else None,
                              "method": method, "prefill_tokens": int(prefill), "prefill_s": float(prefill_s)})
    return {"wall_s": time.monotonic() - start, "notice_s": seen["notice_s"], "first_byte_s": seen["first_byte_s"],
            "rss_after_load_bytes": (seen["rss_after_load_kb"] or 0) * 1024, "peak_bytes": peak * 1024,
            "turns": turns_out}


def main(argv=None) -> int:
    from weights_tools.tiny_llama import train_sentencepiece

    ap = ArgumentParser(prog="python -m bench.chat_shape", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="vicuna-7b", choices=sorted(SHAPES))
    ap.add_argument("--max-new-tokens", type=integer(1), default=48)
    ap.add_argument("--question", type=integer(0), default=0, help="which dev question's two turns (its index)")
    ap.add_argument("--scratch", type=Path, default=None, help="where the checkpoint is written (default: a temporary "
                    "folder); it needs the checkpoint's size free")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    questions = load_questions(DEFAULT_QUESTIONS, None, None)
    turns = questions[args.question]["turns"][:2]
    info, runs = machine_info(), {}
    with tempfile.TemporaryDirectory(dir=scratch_folder(args.scratch)) as tmp:
        folder = Path(tmp) / f"{args.shape}-random"
        folder.mkdir()
        pieces = train_sentencepiece(folder, SHAPES[args.shape].vocab_size,
                                     corpus=[t for q in questions for t in q["turns"]])
        weights = write_checkpoint(folder, args.shape, torch.bfloat16, spelled=pieces)
        print(f"wrote {weights / 1e9:.2f} GB of random {args.shape} weights and a {pieces}-piece tokenizer",
              file=sys.stderr, flush=True)
        for name, flags in (("ar", ["--method", "ar"]), ("default", ["--recalibrate"])):
            runs[name] = chat(folder, turns, [*flags, "--max-new-tokens", str(args.max_new_tokens)],
                              Path(tmp) / f"home-{name}")
            print(f"{name}: {runs[name]['turns']}", file=sys.stderr, flush=True)
    lines = [f"# `python -m tr_engine.chat` at {args.shape}'s size, random weights", "",
             f"Machine: {machine_line(info)}. A {weights / 1e9:.2f} GB bf16 checkpoint of random weights and a "
             f"{pieces}-piece sentencepiece tokenizer (Llama-2's kind, trained on the Spec-Bench questions) in a "
             f"folder named `{args.shape}-random` (the chat picks Vicuna's template). The two turns of dev question "
             f"{questions[args.question]['question_id']} ({questions[args.question]['category']}), piped, "
             f"{args.max_new_tokens} new tokens at most, one fresh process per method. MAT and answers are a random "
             "model's: meaningless; the speed of a step does not depend on the values.", "",
             "| method | loaded after | first byte after | resident after loading | peak | turn | tokens | tok/s | "
             "prefill |", "|---|---|---|---|---|---|---|---|---|"]
    for r in runs.values():
        once = ["–" if r["notice_s"] is None else f"{r['notice_s']:.0f} s", f"{r['first_byte_s']:.0f} s",
                f"{r['rss_after_load_bytes'] / weights:.3f}x", f"{r['peak_bytes'] / weights:.3f}x"]
        for i, t in enumerate(r["turns"]):
            cells = [t["method"], *(once if i == 0 else [""] * len(once)), str(i + 1), str(t["tokens"]),
                     f"{t['tok_s']:.2f}", f"{t['prefill_tokens']} tokens in {t['prefill_s']:.1f} s"]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Loaded after: the calibration's notice, printed once the engine is built (the default method "
              "only; `--recalibrate` measures at once). First byte: of the first answer, after loading, the "
              "default's calibration and the first prefill. Resident and peak: VmRSS (after loading: at the notice, "
              "or for plain decoding at its first byte) and VmHWM, as multiples of the weights' bytes."]
    text = "\n".join(lines) + "\n"
    save_results(args.out / f"chat_shape_{args.shape}{tier_suffix(info.get('cpu_tier'))}", text,
                 {"shape": args.shape, "weights_bytes": weights, "tokenizer_pieces": pieces,
                  "max_new_tokens": args.max_new_tokens, "question": questions[args.question]["question_id"],
                  "runs": runs}, info)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
