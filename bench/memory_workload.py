"""Write bench/data/memory.jsonl: a workload where what the engine answered before helps it answer now.

Spec-Bench's questions are each asked once, about unrelated things: a draft can only come from the recycling matrix
and the conversation itself. Servers see something else: the same kind of task over many inputs, the same question
from many users, agents editing one function again and again, follow-ups that rewrite the last answer. This file is
that traffic, built offline from what this project already has (no download, no hand-written answers): functions
from Python's own standard library (`inspect.getsource`) as the inputs, and a handful of fixed instructions. The
model writes every answer itself when the benchmark runs.

Categories (each row is a Spec-Bench-format question: question_id, category, turns; `warmup: true` rows are the hot
start: the benchmark runs them first, never measures them, and none repeats a measured request):
- extract (16): one instruction, "this function's signature as JSON", over 16 functions;
- edit (18): 6 functions, each edited three ways in three separate requests (as a coding agent sends them);
- faq (10): 5 programming questions, each asked by two users, word for word;
- follow-up (8 conversations, 16 turns): write a small function, then "add input validation and show it all again".
Warm-up: 3 extract, 2 edit and 2 follow-up rows on other functions and tasks, 1 faq question asked once.

    python -m bench.memory_workload            # rewrites bench/data/memory.jsonl (the committed one is canonical:
                                               # another Python's standard library may differ in a line)
    python -m bench.specbench --questions bench/data/memory.jsonl --methods hybrid hybrid-suffix --dtype bfloat16 \\
        --max-new-tokens 128 --out bench/results/memory_bf16
"""

import argparse
import importlib
import inspect
import json
from pathlib import Path

OUT = Path(__file__).resolve().parent / "data" / "memory.jsonl"

EXTRACT = ("Extract this function's signature as JSON with the keys \"name\", \"parameters\" (a list of objects with "
           "\"name\" and \"default\") and \"returns\". Answer with the JSON only.")
EXTRACT_FUNCTIONS = ["textwrap.indent", "shlex.quote", "string.capwords", "colorsys.rgb_to_hsv", "colorsys.hsv_to_rgb",
                     "html.escape", "calendar.isleap", "calendar.leapdays", "glob.has_magic", "colorsys.rgb_to_yiq",
                     "statistics.median", "statistics.mean", "fnmatch.filter", "calendar.weekday", "base64.b64encode",
                     "statistics.multimode"]
EDITS = ["Add type hints to this function. Return the whole function.",
         "Add a docstring to this function that explains each parameter. Return the whole function.",
         "Rename every local variable in this function to a longer, more descriptive name. Return the whole function."]
EDIT_FUNCTIONS = ["textwrap.shorten", "shlex.split", "calendar.monthrange", "html.unescape", "glob.escape",
                  "statistics.median_low"]
FAQ = ["How do I read a file line by line in Python?", "What is the difference between a list and a tuple in Python?",
       "How do I reverse a string in Python?", "What does `if __name__ == \"__main__\":` do in Python?",
       "How do I remove duplicates from a list in Python?"]
FOLLOW_UP = "Add input validation to your function and show the whole function again."
TASKS = ["checks whether a string is a palindrome", "returns the n-th Fibonacci number", "counts the words in a text",
         "merges two sorted lists into one sorted list", "converts a temperature from Celsius to Fahrenheit",
         "returns the largest element of a list", "checks whether a number is prime",
         "returns the factorial of a number"]
WARM_EXTRACT = ["base64.urlsafe_b64encode", "colorsys.hls_to_rgb", "statistics.median_high"]
WARM_EDIT = ["textwrap.fill", "secrets.token_hex"]
WARM_FAQ = ["How do I sort a dictionary by its values in Python?"]
WARM_TASKS = ["returns the sum of the digits of a number", "counts the vowels in a string"]


def source(dotted: str) -> str:
    """The source of a standard-library function, by its dotted name."""
    module, _, name = dotted.partition(".")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return inspect.getsource(obj)


def code_question(instruction: str, dotted: str) -> str:
    return f"{instruction}\n\n```python\n{source(dotted)}```"


def rows() -> list[dict]:
    out = []

    def add(category: str, turns: list[str], warmup: bool = False) -> None:
        out.append({"question_id": f"memory-{len(out)}", "category": category, "turns": turns}
                   | ({"warmup": True} if warmup else {}))

    for f in WARM_EXTRACT:
        add("extract", [code_question(EXTRACT, f)], warmup=True)
    for f in WARM_EDIT:
        add("edit", [code_question(EDITS[0], f)], warmup=True)
    for q in WARM_FAQ:
        add("faq", [q], warmup=True)
    for task in WARM_TASKS:
        add("follow-up", [f"Write a Python function that {task}.", FOLLOW_UP], warmup=True)
    # the measured requests, interleaved as a server would see them: each kind comes back now and then
    extract = [[code_question(EXTRACT, f)] for f in EXTRACT_FUNCTIONS]
    edit = [[code_question(e, f)] for f in EDIT_FUNCTIONS for e in EDITS]
    faq = [[q] for q in FAQ] * 2
    follow = [[f"Write a Python function that {task}.", FOLLOW_UP] for task in TASKS]
    for i in range(max(len(extract), len(edit), len(faq), len(follow))):
        for category, questions in (("extract", extract), ("edit", edit), ("faq", faq), ("follow-up", follow)):
            if i < len(questions):
                add(category, questions[i])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.memory_workload", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    written = rows()
    args.out.write_text("".join(json.dumps(r) + "\n" for r in written))
    measured = [r for r in written if not r.get("warmup")]
    print(f"{args.out}: {len(measured)} questions ({sum(len(r['turns']) for r in measured)} requests) and "
          f"{len(written) - len(measured)} warm-up questions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
