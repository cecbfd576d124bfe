"""The cost of one verify forward against the number of draft-tree tokens and the prefix length, with a plain decode
step (one token) as 1.0: the curve that decides how big a draft tree can pay on a given machine. The engine's own
forward (kernels), a breadth-first 4-ary tree of T tokens (the paper's 2.2.2 tree at T = 81; T = 1 is the plain
step), medians of repeated forwards, every T timed in alternation (tr_engine.cost.time_steps, which also measures the
adaptive tree's cost curve). Writes forward_cost_<dtype>.{json,md,png}.

    python -m bench.forward_cost [--dtypes float32 bfloat16] [--prefixes 128 512 1024] [--reps 9]
"""

import json
from pathlib import Path

import torch

from bench.machine import machine_info, machine_line
from tr_engine.cli import ArgumentParser, run
from tr_engine.cost import time_steps
from tr_engine.engine import Engine

TREE_TOKENS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 81, 96, 128)


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


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m bench.forward_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--prefixes", nargs="+", type=int, default=[128, 512, 1024])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    info = machine_info()
    args.out.mkdir(parents=True, exist_ok=True)
    for dtype in args.dtypes:
        engine = Engine.from_pretrained(args.model, dtype=dtype, max_context=max(args.prefixes) + 256)
        seconds = {p: time_steps(engine.model, engine.cache, TREE_TOKENS, p, args.reps, with_argmax=False)
                   for p in args.prefixes}
        curves = {p: {T: s[T] / s[1] for T in TREE_TOKENS} for p, s in seconds.items()}
        lines = [f"# Verify-forward cost on {args.model} ({dtype}), plain decode step = 1.0", "",
                 f"Machine: {machine_line(info)}. Median of {args.reps} forwards per size, sizes in alternation; "
                 "breadth-first 4-ary trees (the paper's 2.2.2 at 81 tokens).", "",
                 "| tree tokens | " + " | ".join(f"prefix {p}" for p in args.prefixes) + " |",
                 "|---|" + "---|" * len(args.prefixes)]
        for T in TREE_TOKENS:
            lines.append(f"| {T} | " + " | ".join(f"{curves[p][T]:.2f}" for p in args.prefixes) + " |")
        lines += ["", "Plain step: " + ", ".join(f"{1e3 * seconds[p][1]:.1f} ms at prefix {p}" for p in args.prefixes)
                  + ".", "", f"![cost curve](forward_cost_{dtype}.png)"]
        stem = args.out / f"forward_cost_{dtype}"
        (stem.with_suffix(".md")).write_text("\n".join(lines) + "\n")
        (stem.with_suffix(".json")).write_text(json.dumps(
            {"machine": info, "model": args.model, "dtype": dtype, "seconds": seconds, "relative": curves},
            indent=2) + "\n")
        plot(stem.with_suffix(".png"), {f"prefix {p}": c for p, c in curves.items()},
             f"{args.model} {dtype}: verify forward / plain step")
        print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
