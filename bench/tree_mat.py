"""Mean accepted tokens per step (MAT) against the number of tokens a step verifies, measured on the CPU with the real
default model: the other half of a speedup projection. A GPU measures what a verify of T tokens costs (bench.gpu_check,
with random weights: a bare GPU machine has no trained model), this measures what T tokens buy, and MAT(T) / cost(T)
projects the speedup at each size.

Each size T is an adaptive tree pinned to a flat cost of at most T tokens (so every step verifies the largest bucket
of at most T: the T most probable nodes), for Token Recycling (and with --methods tr hybrid hybrid-suffix, hybrid
drafting, and hybrid with a suffix index of every answer it gave before: the engine's default), each with its own
matrix warmed on 2 questions first; plus the paper's static 2.2.2 tree (81 tokens). Greedy, first turns
of the dev split. MAT depends on the model and the text, not on the machine, so it carries to a GPU. On a 2-core CPU
a 128-token verify costs ~9 plain steps: the default run takes about 15 minutes. Writes tree_mat.{json,md}.

    python -m bench.tree_mat [--dtype bfloat16] [--questions 8 | --per-group 2] [--max-new-tokens 64]
                             [--methods tr hybrid hybrid-suffix] [--sizes 4 8 16 …]
"""

from pathlib import Path

from bench.machine import machine_info, machine_line, save_results
from bench.specbench import DEFAULT_QUESTIONS, group_of, load_questions, own_drafter
from tr_engine.cli.args import integer
from tr_engine.cli.common import ArgumentParser, run
from tr_engine.core.cost import BUCKETS
from tr_engine.engine import Engine

SIZES = (4, 8, 16, 32, 64, 80, 128)
WARM_UP = 2


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m bench.tree_mat", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--questions", type=integer(1), default=8, help="measured questions, spread over the file")
    ap.add_argument("--per-group", type=integer(1), default=None, metavar="N",
                    help="instead: the first N questions of each category group (after the warm-up ones)")
    ap.add_argument("--methods", nargs="+", default=["tr"], choices=["tr", "hybrid", "hybrid-suffix"])
    ap.add_argument("--max-new-tokens", type=integer(1), default=64)
    ap.add_argument("--sizes", nargs="+", type=int, default=list(SIZES), help=f"tree sizes (buckets), default "
                    f"{' '.join(map(str, SIZES))}")
    ap.add_argument("--threads", type=integer(1), default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    if not set(args.sizes) <= set(BUCKETS):
        ap.error(f"--sizes must be verify buckets: {', '.join(map(str, BUCKETS))}")
    sizes = tuple(sorted(set(args.sizes)))
    info = machine_info()
    engine = Engine.from_pretrained(args.model, dtype=args.dtype, threads=args.threads)
    questions = load_questions(DEFAULT_QUESTIONS, None, None)
    step = max((len(questions) - WARM_UP) // args.questions, 1)
    warm, chosen = questions[:WARM_UP], questions[WARM_UP::step][: args.questions]
    if args.per_group:
        chosen, counts = [], {}
        for q in questions[WARM_UP:]:
            group = group_of(q["category"])
            if counts.get(group, 0) < args.per_group:
                chosen.append(q)
                counts[group] = counts.get(group, 0) + 1
    # (hybrid-suffix: hybrid with a suffix index of its own, fed by every answer it gives, as bench.specbench's)
    drafters = {(m, T): own_drafter(engine, m.removesuffix("-suffix"), "adaptive", T, m.endswith("-suffix"))
                for m in args.methods for T in sizes}
    drafters[("tr", "2.2.2")] = engine.new_drafter("tr", "2.2.2")
    steps = {key: [] for key in drafters}  # committed tokens per step
    by_group = {}  # (method, T, group) -> committed tokens per step
    for i, q in enumerate(warm + chosen):
        # Every call answers the same prompt, all but its last token's K/V kept in the cache from the first call
        # (prefilled once, not 22 times); the plain answer is made the same way, so the outputs compare bit for bit.
        again = dict(max_new_tokens=args.max_new_tokens, reuse_cache=True)
        engine.generate(q["turns"][0], max_new_tokens=1, method="ar")
        plain = engine.generate(q["turns"][0], method="ar", **again).token_ids
        for key, drafter in drafters.items():
            g = engine.generate(q["turns"][0], drafter=drafter, **again).generation
            if g.token_ids != plain:
                raise AssertionError(f"{key} changed the output on question {q['question_id']}")
            if i >= WARM_UP:
                steps[key] += g.accept_lengths
                by_group.setdefault((*key, group_of(q["category"])), []).extend(g.accept_lengths)
        print(f"question {i + 1}/{len(warm) + len(chosen)} ({group_of(q['category'])}"
              f"{', warm-up' if i < WARM_UP else ''}) done", flush=True)
    mat = {m: {T: sum(steps[(m, T)]) / len(steps[(m, T)]) for T in sizes} for m in args.methods}
    groups = list(dict.fromkeys(group_of(q["category"]) for q in chosen))
    mat_by_group = {m: {grp: {T: sum(a) / len(a) for T in sizes if (a := by_group.get((m, T, grp)))}
                        for grp in groups} for m in args.methods}
    static = sum(steps[("tr", "2.2.2")]) / len(steps[("tr", "2.2.2")])
    lines = [f"# Mean accepted tokens per step by tree size ({args.model}, {args.dtype})", "",
             f"Machine: {machine_line(info)}. {len(chosen)} dev-split questions (first turn, greedy, "
             f"{args.max_new_tokens} new tokens) after {WARM_UP} warm-up questions; every output identical to plain "
             "decoding. Size T: the adaptive tree pinned to a flat cost of at most T tokens (every step verifies T, "
             "the root included).", "",
             "| tokens verified | " + " | ".join(str(T) for T in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for m in args.methods:
        lines.append(f"| {m} MAT | " + " | ".join(f"{mat[m][T]:.2f}" for T in sizes) + " |")
    for m in args.methods:
        lines += ["", f"{m} by category group (questions: "
                  + ", ".join(f"{grp} {sum(group_of(q['category']) == grp for q in chosen)}" for grp in groups) + "):",
                  "", "| group | " + " | ".join(str(T) for T in sizes) + " |", "|---|" + "---|" * len(sizes)]
        for grp in groups:
            lines.append(f"| {grp} | " + " | ".join(f"{mat_by_group[m][grp][T]:.2f}" for T in sizes) + " |")
    lines += ["", f"The paper's static 2.2.2 tree (81 tokens), same questions: MAT {static:.2f}.", "",
              "bench.gpu_check divides these by the verify cost it measures on a GPU (plain step = 1) to project "
              "the speedup at each size."]
    save_results(args.out / "tree_mat", "\n".join(lines) + "\n",
                 {"model": args.model, "dtype": args.dtype, "questions": len(chosen),
                  "max_new_tokens": args.max_new_tokens, "sizes": sizes, "mat": mat, "mat_by_group": mat_by_group,
                  "static_2_2_2": {"tokens": 81, "mat": static}}, info)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
