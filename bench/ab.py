"""Two checkouts of tr-engine, interleaved question by question: did a change move decode speed, and are the tokens
the same? (A refactor's before/after, or a kernel change's.)

    python -m bench.ab --before /tmp/before --after . --dtypes bfloat16 float32 --questions 24

Each checkout answers in its own worker process (its own tr_engine, imported from that folder; build its op library
there first: `python setup.py build_ext --inplace -j 2`), loaded once and kept warm, so the two alternate question by
question (A B, then B A) and share whatever drift the machine has. Both start from an empty recycling matrix and see
the same questions in the same order, so a lossless engine gives both the same tokens; each measures its verify cost
curve afresh at its start (the adaptive trees' prices), one after the other. Reported: tokens per second of
each over the whole run, their ratio, the median and spread of the per-question ratios, how many answers are
identical, and where the ratio comes from: forwards, milliseconds per forward, tokens verified per forward.

Two measurements of one machine's curve differ by a few percent, and the trees planned from them differ with them:
this checkout against itself read 0.986x on SmolLM2 fp32 hybrid (1337 against 1387 forwards; 8-token verifies priced
at 1.43 and 1.55 plain steps). `--shared-curve` takes the calibration out of the comparison: the after side measures
the curve and the before side plans with the same one. The trees can still part: each side corrects its prices
online from its own step times (tr_engine/core/adaptive.py, StepTimes), and one different tree sends the recycling
matrix down another path. So read the forwards and ms per forward beside the ratio, and a few percent either way as
noise.

`--before-tier` and `--after-tier` run a side on a CPU kernel tier of its own (TR_ENGINE_CPU): one checkout against
itself on two tiers (`--before . --before-tier avx512bf16 --after-tier amx`). Tiers round differently in the last
bits, so their answers may part; each is exact against its own plain decoding (the tests). So may two checkouts whose
kernels sum in another order: each side's tokens per second are over its own tokens, and `identical` says how many
answers agree.

`--curve FILE` gives both sides one curve from a file (a cached curve of $TR_ENGINE_HOME/costs/, or one a bad spell
measured): how each checkout's planning copes with that curve.

`--batch N` compares batched decoding (generate_batch, up to N sequences a forward, as bench.batch runs it): each side
warms its matrix and suffix index on the file's own warm-up rows (bench/data/memory.jsonl has them) or else on 4 other
questions, keeps that state, and answers all the questions at once from
it, `--rounds` times, the two sides alternating round by round (A B, then B A). Forwards are then sequence-steps (a
request's share of a batched forward), and ms per forward the decode's seconds over them.

    python -m bench.ab --before /tmp/before --dtypes bfloat16 --questions 16 --batch 16 --rounds 6 --shared-curve
"""

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SIDES = ("before", "after")
WARM = 4  # --batch: the questions that warm each side's matrix and suffix index first


def worker() -> None:
    """The worker: a config line on stdin, then one prompt per line; one JSON answer per line on stdout."""
    from tr_engine.engine import Engine

    config = json.loads(sys.stdin.readline())
    engine = Engine.from_pretrained(config["model"], dtype=config["dtype"], threads=config["threads"],
                                    **({"max_batch": config["batch"]} if config.get("batch") else {}))
    # Measured afresh before the first timed question, the two sides one after the other: a cached curve may come
    # from another spell of this machine (one measured while it was slow priced a 6-token fp32 verify at one plain
    # step, its trees grew, and hybrid read 0.970x against a side that had measured its own).
    if config.get("curve"):  # the other side's curve (set as the engine's own: an older checkout has no use_cost)
        try:
            from tr_engine.core.cost import CostModel
        except ImportError:  # a checkout from before the sub-packages
            from tr_engine.cost import CostModel

        c = config["curve"]
        if hasattr(engine, "drafting"):
            engine.use_cost(CostModel(tuple(c["sizes"]), tuple(c["prefixes"]), c["relative"], c["plain_s"],
                                      engine.drafting.key))
        else:  # (older checkouts)
            key = engine._cost_key() if hasattr(engine, "_cost_key") else engine._cost_location()[0]
            engine._cost = CostModel(tuple(c["sizes"]), tuple(c["prefixes"]), c["relative"], c["plain_s"], key)
    cost = engine.cost_model(recalibrate=not config.get("curve"))
    # the curve this side plans with: two sides' trees differ where their curves do
    print(json.dumps({"ready": True, "curve": {"sizes": list(cost.buckets), "prefixes": list(cost.prefixes),
                                               "relative": cost.relative, "plain_s": cost.plain_s},
                      "tier": getattr(engine, "cpu_tier", None)}), flush=True)
    if config.get("batch"):
        batches(engine, config)
        return
    for line in sys.stdin:
        r = engine.generate(json.loads(line), config["max_new_tokens"], method=config["method"])
        g = r.generation
        print(json.dumps({"token_ids": r.token_ids, "seconds": g.prefill_s + g.decode_s, "decode_s": g.decode_s,
                          "forwards": g.steps, "verified": sum(g.verify_tokens) or g.steps}), flush=True)


def batches(engine, config: dict) -> None:
    """The worker of --batch: warm the shared matrix and suffix index on config["warm"], then answer each line's
    prompts with generate_batch from that warm state; one JSON answer per line on stdout."""
    for prompt in config["warm"]:
        engine.generate(prompt, config["max_new_tokens"], method=config["method"])
    matrix = engine.matrix.table.clone(), engine.matrix.confidence.clone()
    index = getattr(getattr(engine, "drafting", None), "suffix", None)
    held = None
    if index is not None:
        from tr_engine.core.suffix import BYTES_PER_TOKEN, SuffixIndex

        held = SuffixIndex(index.vocab_size, index.capacity * BYTES_PER_TOKEN)
        held.copy_(index)
    for line in sys.stdin:
        engine.matrix.copy_(*matrix)  # every round from the warm state: none drafts from an earlier round's answers
        if held is not None:
            index.copy_(held)
        t0 = time.perf_counter()
        results = engine.generate_batch(json.loads(line), config["max_new_tokens"], method=config["method"],
                                        batch_size=config["batch"])
        wall = time.perf_counter() - t0
        prefill = sum(r.generation.prefill_s for r in results)  # (between steps: nothing decodes meanwhile)
        print(json.dumps({"token_ids": [r.token_ids for r in results], "seconds": wall, "decode_s": wall - prefill,
                          "forwards": sum(r.generation.steps for r in results),
                          "verified": sum(sum(r.generation.verify_tokens) or r.generation.steps for r in results)}),
              flush=True)


class Worker:
    def __init__(self, checkout: Path, config: dict, tier: str | None = None):
        env = {**os.environ, "PYTHONPATH": str(checkout.resolve())}
        if tier:  # the CPU kernel tier this side runs (tr_engine/model/cpu.py)
            env["TR_ENGINE_CPU"] = tier
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker"], cwd=checkout, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        ready = self.ask(config)
        self.curve, self.tier = ready["curve"], ready.get("tier")

    def ask(self, message) -> dict:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"a worker ended early (exit {self.proc.wait()}); see its error above")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def run(args) -> dict:
    from bench.specbench import group_of, load_questions, warm_up_questions

    questions = load_questions(args.questions_file, None, None)
    warm = []
    if args.batch:  # (bench.batch's choice: the questions and the file's own warm-up rows, else the 4 after them)
        own = warm_up_questions(args.questions_file, 0)
        spread = questions[:: max(len(questions) // (args.questions + (0 if own else WARM)), 1)]
        chosen = spread[: args.questions]
        warm = [q["turns"][0] for q in own or spread[args.questions : args.questions + WARM]]
    else:
        chosen = questions[:: max(len(questions) // args.questions, 1)][: args.questions]
    out = {}
    for dtype in args.dtypes:
        config = dict(model=args.model, dtype=dtype, threads=args.threads, method=args.method,
                      max_new_tokens=args.max_new_tokens, batch=args.batch, warm=warm)
        given = curve_file(args.curve) if args.curve else None
        workers = {"after": Worker(Path(args.after), {**config, "curve": given}, args.after_tier)}
        try:
            workers["before"] = Worker(Path(args.before), {**config, "curve": given or (
                workers["after"].curve if args.shared_curve else None)}, args.before_tier)
        except BaseException:
            workers["after"].close()
            raise
        rows = []
        try:
            if args.batch:
                rows = rounds(workers, chosen, args.rounds, dtype)
            for i, q in enumerate([] if args.batch else chosen):
                prompt = [{"role": "user", "content": q["turns"][0]}]
                order = SIDES if i % 2 == 0 else SIDES[::-1]
                answers = {side: workers[side].ask(prompt) for side in order}
                rows.append({"question_id": q.get("question_id"), "group": group_of(q["category"]),
                             **{f"{s}_s": answers[s]["seconds"] for s in SIDES},
                             **{f"{s}_{k}": answers[s][k] for s in SIDES for k in ("decode_s", "forwards", "verified")},
                             **{f"{s}_tokens": len(answers[s]["token_ids"]) for s in SIDES},
                             "identical": answers["before"]["token_ids"] == answers["after"]["token_ids"]})
                print(f"{dtype} {i + 1}/{len(chosen)} {rows[-1]['group']}: before {rows[-1]['before_s']:.2f}s "
                      f"after {rows[-1]['after_s']:.2f}s", file=sys.stderr)
        finally:
            for w in workers.values():
                w.close()
        # Each side's speed over its own tokens: where the two round differently (another tier, a kernel that sums in
        # another order) their answers part, and the token counts with them.
        speed = {s: sum(r[f"{s}_tokens"] for r in rows) / sum(r[f"{s}_s"] for r in rows) for s in SIDES}
        ratios = sorted(r["after_tokens"] / r["after_s"] / (r["before_tokens"] / r["before_s"]) for r in rows)
        # Where a ratio comes from: fewer forwards (a better tree plan) or cheaper ones (faster kernels).
        forwards = {s: sum(r[f"{s}_forwards"] for r in rows) for s in SIDES}
        per_forward_ms = {s: 1e3 * sum(r[f"{s}_decode_s"] for r in rows) / max(forwards[s], 1) for s in SIDES}
        verified = {s: sum(r[f"{s}_verified"] for r in rows) / max(forwards[s], 1) for s in SIDES}
        # The prompts' prefill (a question's seconds less its decode's): the same prompts on both sides.
        prefill = {s: sum(r[f"{s}_s"] - r[f"{s}_decode_s"] for r in rows) for s in SIDES}
        out[dtype] = {"rows": rows, "tokens_per_s": speed, "speed_ratio": speed["after"] / speed["before"],
                      "prefill_s": prefill,
                      "curves": {s: workers[s].curve for s in SIDES}, "forwards": forwards,
                      "tiers": {s: workers[s].tier for s in SIDES},
                      "per_forward_ms": per_forward_ms, "verified_per_forward": verified,
                      "median_ratio": statistics.median(ratios), "ratio_range": [ratios[0], ratios[-1]],
                      "identical": sum(r["identical"] for r in rows),
                      "questions": sum(r.get("requests", 1) for r in rows)}
    return out


def rounds(workers: dict, chosen: list[dict], count: int, dtype: str) -> list[dict]:
    """--batch: every question at once, `count` times, the sides alternating; a row a round (identical: requests)."""
    prompts = [[{"role": "user", "content": q["turns"][0]}] for q in chosen]
    rows = []
    for i in range(count):
        order = SIDES if i % 2 == 0 else SIDES[::-1]
        answers = {side: workers[side].ask(prompts) for side in order}
        rows.append({"question_id": None, "group": f"round {i + 1}", **{f"{s}_s": answers[s]["seconds"] for s in SIDES},
                     **{f"{s}_{k}": answers[s][k] for s in SIDES for k in ("decode_s", "forwards", "verified")},
                     **{f"{s}_tokens": sum(map(len, answers[s]["token_ids"])) for s in SIDES},
                     "identical": sum(a == b for a, b in zip(answers["before"]["token_ids"],
                                                             answers["after"]["token_ids"])),
                     "requests": len(prompts)})
        print(f"{dtype} round {i + 1}/{count}: before {rows[-1]['before_s']:.2f}s after {rows[-1]['after_s']:.2f}s",
              file=sys.stderr)
    return rows


def describe(checkout: Path) -> str:
    """A checkout's commit (with -dirty when it has changes), or its folder where git cannot say."""
    git = ["git", "-C", str(checkout)]
    try:
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return str(checkout)
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def price(curve: dict, tokens: int) -> str:
    """A verify of `tokens` in plain steps on a side's curve, at its first prefix ("-" where it has no such size)."""
    sizes = curve["sizes"]
    return f"{curve['relative'][0][sizes.index(tokens)]:.2f}" if tokens in sizes else "-"


def curve_file(path: Path) -> dict:
    """A cost curve from a JSON file as the engine caches them (buckets, prefixes, relative, plain_s)."""
    from tr_engine.errors import UserError

    try:
        c = json.loads(path.read_text())
        return {"sizes": list(c["buckets"]), "prefixes": list(c["prefixes"]), "relative": c["relative"],
                "plain_s": c["plain_s"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--curve {path} is not a cost curve file ({e}); give one of $TR_ENGINE_HOME/costs/") from None


def write(path: Path, data: dict, info: dict, args) -> str:
    from bench.machine import machine_line, save_results

    # Each side's tier as its worker reported it, forced or its own choice: an older checkout may lack the tier this
    # one picks (before the amx tier, a checkout on an AMX host runs avx512bf16), and a ratio across tiers says so.
    tiers = next(iter(data.values()), {}).get("tiers", {})
    before, after = (describe(getattr(args, s)) + (f" on the {tier} tier" if (tier := tiers.get(s) or getattr(
        args, s + "_tier")) else "") for s in SIDES)
    lines = [f"# Before ({before}) and after ({after})", "",
             f"{machine_line(info)}. {args.method}, greedy, {args.max_new_tokens} new tokens at most, {args.threads} "
             f"threads; {args.questions} questions of {args.questions_file.name} (first turns), "
             + (f"all at once through generate_batch (up to {args.batch} a forward), {args.rounds} rounds alternating "
                f"in two warm processes, each round from the state the warm-up questions left (forwards: "
                "sequence-steps), and " if args.batch else
                "interleaved question by question in two warm processes, each from an empty matrix and ")
             + (f"the cost curve of {args.curve}." if args.curve else
                "the cost curve the after side measured at its start." if args.shared_curve
                else "a cost curve it measured at its start."), "",
             f"| dtype | before tok/s | after tok/s | after/before | per-{'round' if args.batch else 'question'} "
             "median (min-max) | identical "
             "| forwards before/after | ms per forward before/after | tokens verified per forward before/after "
             "| an 8-token verify in plain steps before/after | prefill seconds before/after |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for dtype, d in data.items():
        lines.append(f"| {dtype} | {d['tokens_per_s']['before']:.2f} | {d['tokens_per_s']['after']:.2f} | "
                     f"{d['speed_ratio']:.3f}x | {d['median_ratio']:.3f}x ({d['ratio_range'][0]:.2f}-"
                     f"{d['ratio_range'][1]:.2f}) | {d['identical']}/{d['questions']} | "
                     f"{d['forwards']['before']}/{d['forwards']['after']} | {d['per_forward_ms']['before']:.2f}/"
                     f"{d['per_forward_ms']['after']:.2f} | {d['verified_per_forward']['before']:.2f}/"
                     f"{d['verified_per_forward']['after']:.2f} | {price(d['curves']['before'], 8)}/"
                     f"{price(d['curves']['after'], 8)} | {d['prefill_s']['before']:.2f}/"
                     f"{d['prefill_s']['after']:.2f} |")
    meta = {"before": before, "after": after, "method": args.method, "shared_curve": args.shared_curve,
            "curve": str(args.curve) if args.curve else None,
            "max_new_tokens": args.max_new_tokens, "threads": args.threads, "batch": args.batch,
            "rounds": args.rounds if args.batch else None}
    return save_results(path, "\n".join(lines) + "\n", {**meta, **data}, info)


def main(argv=None) -> int:  # (the imports here, not at the top: a worker imports its own checkout's tr_engine alone)
    from bench.machine import machine_info
    from bench.specbench import DEFAULT_QUESTIONS
    from tr_engine.cli.args import integer
    from tr_engine.cli.common import ArgumentParser

    ap = ArgumentParser(prog="python -m bench.ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="the checkout to compare against (its ops built)")
    ap.add_argument("--after", type=Path, default=Path("."), help="the checkout with the change (default: here)")
    for side in SIDES:
        ap.add_argument(f"--{side}-tier", default=None, metavar="TIER",
                        help=f"the CPU kernel tier the {side} side runs (TR_ENGINE_CPU; default: the best this CPU runs)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--method", default="hybrid")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["float32", "bfloat16"])
    ap.add_argument("--questions", type=int, default=24, help="questions, spread over the file")
    ap.add_argument("--questions-file", type=Path, default=DEFAULT_QUESTIONS)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shared-curve", action="store_true",
                    help="both sides plan with the after side's cost curve (the kernels and loop compared alone)")
    ap.add_argument("--curve", type=Path, default=None, metavar="FILE",
                    help="both sides plan with the cost curve in FILE (a JSON curve as $TR_ENGINE_HOME/costs/ holds)")
    ap.add_argument("--batch", type=integer(1, 64), default=None, metavar="N",
                    help="compare batched decoding: all the questions at once, up to N a forward, --rounds times")
    ap.add_argument("--rounds", type=integer(1, 100), default=4, help="--batch: rounds of all the questions")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "ab")
    args = ap.parse_args(argv)
    for side in SIDES:
        if not (getattr(args, side) / "tr_engine").is_dir():
            ap.error(f"--{side} {getattr(args, side)} is not a tr-engine checkout (no tr_engine/ folder)")
    if args.after_tier:  # the machine line names the after side's tier (the header says each side's)
        from tr_engine.model import cpu

        cpu.use(args.after_tier)
    info = machine_info()
    print(write(args.out, run(args), info, args))
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker()
    else:
        from tr_engine.cli.common import run as run_cli

        raise SystemExit(run_cli(main))
