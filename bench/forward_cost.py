"""The cost of one verify forward against the number of draft-tree tokens and the prefix length, with a plain decode
step (one token) as 1.0: the curve that decides how big a draft tree can pay on a given machine. The engine's own
forward (kernels), a breadth-first 4-ary tree of T tokens (the paper's 2.2.2 tree at T = 81; T = 1 is the plain
step), medians of repeated forwards, every T timed in alternation (tr_engine.core.cost.time_steps, which also measures
the adaptive tree's cost curve). Writes forward_cost_<dtype>.{json,md,png}.

    python -m bench.forward_cost [--dtypes float32 bfloat16] [--prefixes 128 512 1024] [--reps 9]

With --shape (vicuna-7b, llama-3-8b: bench/shapes.py) the model is built in memory with random weights at that shape
instead (no weights on disk: its speed does not depend on their values), and the run also measures this machine's
streaming read bandwidth, so that the plain step stands against its floor (the weights' bytes / that bandwidth: a
decode step must read every weight once), and projects the speedup that Token Recycling would reach at that shape:
MAT(T) / cost(T), with MAT(T), the tokens a step commits when it verifies T, measured on SmolLM2 on real text
(bench/results/tree_mat.json, bench.tree_mat). Writes forward_cost_<shape>_<dtype>.{json,md,png}.

    python -m bench.forward_cost --shape vicuna-7b --dtypes bfloat16
"""

import json
import math
import statistics
import time
from pathlib import Path

import torch

from bench.machine import copy_bandwidth, machine_info, machine_line, read_bandwidth, rss_kb, save_results, \
    tier_suffix
from bench.shapes import SHAPES, held_bytes, weight_bytes
from tr_engine.cli.common import ArgumentParser, run
from tr_engine.core.cost import time_steps
from tr_engine.engine import Engine

TREE_TOKENS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 81, 96, 128)
SHAPE_TREE_TOKENS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)  # (a 7B forward of 128 tokens costs seconds on a CPU)
SHAPE_PREFIXES = (256, 1024)
TREE_MAT = Path(__file__).parent / "results" / "tree_mat.json"


def plot(path: Path, curves: dict[str, dict], title: str, ylabel: str = "cost / plain decode step") -> None:
    """Cost curves (label -> {tree tokens: relative cost}) against a plain step's 1.0; a label with "eager" in it
    is dashed (bench.gpu_check draws eager and graphed steps side by side)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.8, 4.4), dpi=120)
    for label, costs in curves.items():
        ax.plot([int(T) for T in costs], list(costs.values()), marker="o", ms=3, label=label,
                ls="--" if "eager" in label else "-")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("tokens in the verify forward (tree size)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7 if len(curves) > 4 else 9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def project(relative: dict[int, float]) -> dict:
    """Token Recycling's projected speedup at each verify size T that both the cost curve (`relative`: T -> cost in
    plain steps) and bench.tree_mat measured: MAT(T) / cost(T). MAT(T) comes from SmolLM2 on the dev split's text, a
    stand-in for the bigger model's (a bigger model predicts its own text no worse, and the matrix holds its own
    predictions), so this is a projection, not a measurement."""
    measured = json.loads(TREE_MAT.read_text())

    def at_sizes(by_T: dict) -> dict:
        return {int(T): {"mat": mat, "cost": relative[int(T)], "speedup": mat / relative[int(T)]}
                for T, mat in by_T.items() if int(T) in relative}

    rows = {method: at_sizes(by_T) for method, by_T in measured["mat"].items()}
    # By category group (where tree_mat measured them): each group's best size, and their geometric mean, the
    # figure Spec-Bench reports.
    groups = {}
    for method, by_group in measured.get("mat_by_group", {}).items():
        best = {}
        for group, by_T in by_group.items():
            sized = at_sizes(by_T)
            T = max(sized, key=lambda T: sized[T]["speedup"])
            best[group] = {"tokens": T, **sized[T]}
        geo = math.exp(sum(math.log(b["speedup"]) for b in best.values()) / len(best))
        groups[method] = {"groups": best, "geo_mean": geo}
    return {"source": f"{TREE_MAT.relative_to(TREE_MAT.parents[2])}: {measured['model']} {measured['dtype']}, "
                      f"{measured['questions']} dev-split questions, {measured['machine'].get('cpu', '?')}",
            "methods": rows, "by_group": groups}


def against_floor(model, cache, prefix: int, rounds: int = 5) -> list[tuple[float, float]]:
    """(read bandwidth GB/s, plain step seconds) pairs, measured in alternation at `prefix` (the median of 3 steps
    each): this machine's bandwidth swings by tens of percent within minutes, so a step is held to the floor of the
    moment it ran in. The cache's contents do not matter to the time; its first `prefix` slots are attended to."""
    token, position = torch.zeros(1, dtype=torch.long), torch.tensor([prefix])
    pairs = []
    with torch.inference_mode():
        for _ in range(rounds):
            gb_s = read_bandwidth(reps=3)
            steps = []
            for _ in range(3):
                t0 = time.perf_counter()
                model(token, position, cache.data, prefix)
                steps.append(time.perf_counter() - t0)
            pairs.append((gb_s, sorted(steps)[1]))
    return pairs


def shape_run(args, dtype: str, info: dict) -> list[str]:
    """--shape: a random model of that shape against this machine's bandwidth floor, its verify curve, and the
    projected speedup; writes forward_cost_<shape>_<dtype>.*. Returns the report's lines."""
    from tr_engine.core.cost import time_steps
    from tr_engine.model.kv_cache import KVCache
    from tr_engine.model.weights import random_model

    config, dt = SHAPES[args.shape], getattr(torch, dtype)
    sizes, prefixes = SHAPE_TREE_TOKENS, args.prefixes or SHAPE_PREFIXES
    copy_gb_s = copy_bandwidth("cpu", 2**28, 5)
    before, t0 = rss_kb(), time.perf_counter()
    model = random_model(config, dt)
    built_s, held, rss_gb = time.perf_counter() - t0, held_bytes(model), (rss_kb() - before) * 1024 / 1e9
    capacity = max(prefixes) + max(sizes) + 8
    model.set_max_positions(capacity)
    cache = KVCache(config, capacity, dt, "cpu")
    seconds = {P: time_steps(model, cache, sizes, P, args.reps, with_argmax=False) for P in prefixes}
    relative = {P: {T: s[T] / s[1] for T in sizes} for P, s in seconds.items()}
    step_bytes = weight_bytes(config, dt.itemsize)
    pairs = {P: against_floor(model, cache, P) for P in prefixes}
    share = {P: statistics.median(step_bytes / (gb_s * 1e9) / step for gb_s, step in pairs[P]) for P in prefixes}
    read_gb_s = statistics.median(gb_s for P in prefixes for gb_s, _ in pairs[P])
    floor_s = step_bytes / (read_gb_s * 1e9)
    P = max(prefixes)
    projection = project(relative[P])
    name = f"{args.shape} ({dtype}, random weights)"
    lines = [f"# Verify-forward cost at the {name}, plain decode step = 1.0", "",
             f"Machine: {machine_line(info)}. The model built in memory at {args.shape}'s shape "
             f"({held / 1e9:.2f} GB of weights held, packed; {built_s:.0f} s to build; the process grew by "
             f"{rss_gb:.2f} GB = {rss_gb * 1e9 / held:.2f}x the weights). Median of {args.reps} forwards per size, "
             "sizes in alternation; breadth-first 4-ary trees.", "",
             f"A plain step reads {step_bytes / 1e9:.2f} GB of weights; its floor is that over this machine's "
             "streaming read bandwidth (a float32 sum of 256 MiB, more than any cache here), which swings by tens "
             "of percent within minutes here, so each step is timed right after a bandwidth reading, 5 times in "
             "alternation (median of 3 "
             f"steps each), and held to the floor of its moment. Copying ran at {copy_gb_s:.1f} GB/s (read + "
             "written).", "",
             "| prefix | read GB/s (5 readings) | plain step ms | floor ms | floor / step (median) |",
             "|---|---|---|---|---|"]
    for p in prefixes:
        lines.append(f"| {p} | {', '.join(f'{g:.0f}' for g, _ in pairs[p])} | "
                     f"{', '.join(f'{st * 1e3:.0f}' for _, st in pairs[p])} | "
                     f"{', '.join(f'{step_bytes / g / 1e6:.0f}' for g, _ in pairs[p])} | {share[p]:.0%} |")
    lines += ["", "| tree tokens | " + " | ".join(f"prefix {p}" for p in prefixes) + " |",
              "|---|" + "---|" * len(prefixes)]
    for T in sizes:
        lines.append(f"| {T} | " + " | ".join(f"{relative[p][T]:.2f}" for p in prefixes) + " |")
    lines += ["", f"Projected speedup over plain decoding at prefix {P}: MAT(T) / cost(T), MAT from "
              f"{projection['source']} (a projection from a smaller model's acceptance, not a measurement):", ""]
    for method, rows in projection["methods"].items():
        best = max(rows, key=lambda T: rows[T]["speedup"])
        lines += [f"| {method}: tokens verified | " + " | ".join(str(T) for T in rows) + " |",
                  "|---|" + "---|" * len(rows),
                  "| MAT (SmolLM2) | " + " | ".join(f"{r['mat']:.2f}" for r in rows.values()) + " |",
                  f"| cost at {P} | " + " | ".join(f"{r['cost']:.2f}" for r in rows.values()) + " |",
                  "| projected speedup | " + " | ".join(f"{r['speedup']:.2f}x" for r in rows.values()) + " |", "",
                  f"A cost-aware choice settles near {best} tokens a step here ({rows[best]['speedup']:.2f}x).", ""]
    for method, g in projection["by_group"].items():
        lines += [f"{method} by category group, each at its best size: "
                  + ", ".join(f"{grp} {b['speedup']:.2f}x ({b['tokens']} tokens, MAT {b['mat']:.2f})"
                              for grp, b in g["groups"].items()) + f"; geometric mean {g['geo_mean']:.2f}x.", ""]
    stem = args.out / f"forward_cost_{args.shape}_{dtype}{tier_suffix(info.get('cpu_tier'))}"
    lines.append(f"![cost curve]({stem.name}.png)")
    save_results(stem, "\n".join(lines) + "\n",
                 {"shape": args.shape, "dtype": dtype, "random_weights": True, "held_bytes": held,
                  "build_s": built_s, "rss_growth_bytes": rss_gb * 1e9, "read_gb_s": read_gb_s,
                  "floor_pairs": pairs, "floor_share": share, "copy_gb_s": copy_gb_s,
                  "step_weight_bytes": step_bytes, "floor_s": floor_s, "seconds": seconds, "relative": relative,
                  "projection": projection}, info)
    plot(stem.with_suffix(".png"), {f"prefix {p}": c for p, c in relative.items()}, f"{name}: verify / plain step")
    return lines


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m bench.forward_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES),
                    help="a random model of this shape built in memory, instead of --model (module doc)")
    ap.add_argument("--dtypes", nargs="+", default=None, help="default: float32 bfloat16; with --shape bfloat16")
    ap.add_argument("--prefixes", nargs="+", type=int, default=None, help="default: 128 512 1024; with --shape "
                    "256 1024")
    ap.add_argument("--reps", type=int, default=None, help="default: 9; with --shape 3")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    info = machine_info()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.shape:
        args.reps = args.reps or 3
        for dtype in args.dtypes or ["bfloat16"]:
            print("\n".join(shape_run(args, dtype, info)), flush=True)
        return 0
    args.dtypes, args.prefixes, args.reps = args.dtypes or ["float32", "bfloat16"], args.prefixes or [128, 512, 1024], \
        args.reps or 9
    for dtype in args.dtypes:
        engine = Engine.from_pretrained(args.model, dtype=dtype, max_context=max(args.prefixes) + 256)
        seconds = {p: time_steps(engine.model, engine.cache, TREE_TOKENS, p, args.reps, with_argmax=False)
                   for p in args.prefixes}
        curves = {p: {T: s[T] / s[1] for T in TREE_TOKENS} for p, s in seconds.items()}
        name = f"forward_cost_{dtype}{tier_suffix(info.get('cpu_tier'))}"  # (each tier's curve its own)
        lines = [f"# Verify-forward cost on {args.model} ({dtype}), plain decode step = 1.0", "",
                 f"Machine: {machine_line(info)}. Median of {args.reps} forwards per size, sizes in alternation; "
                 "breadth-first 4-ary trees (the paper's 2.2.2 at 81 tokens).", "",
                 "| tree tokens | " + " | ".join(f"prefix {p}" for p in args.prefixes) + " |",
                 "|---|" + "---|" * len(args.prefixes)]
        for T in TREE_TOKENS:
            lines.append(f"| {T} | " + " | ".join(f"{curves[p][T]:.2f}" for p in args.prefixes) + " |")
        lines += ["", "Plain step: " + ", ".join(f"{1e3 * seconds[p][1]:.1f} ms at prefix {p}" for p in args.prefixes)
                  + ".", "", f"![cost curve]({name}.png)"]
        stem = args.out / name
        save_results(stem, "\n".join(lines) + "\n",
                     {"model": args.model, "dtype": dtype, "seconds": seconds, "relative": curves}, info)
        plot(stem.with_suffix(".png"), {f"prefix {p}": c for p, c in curves.items()},
             f"{args.model} {dtype}: verify forward / plain step")
        print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
