"""What a few rows cost against one in the projections alone, timed from C++: all of one forward's projections through a
CPU tier library's packed_rows back to back, with no torch dispatch between them (bench/native_rows.cpp, built here
with the C++ compiler). Through torch (bench.kernels' "projections" rows) each of a SmolLM2 step's 121 calls pays
~5-10 us of dispatch: ~1 ms on a 5-8 ms step, which hides the few-rows effects a kernel change moves (the prefetch
hints of `lead_once`, csrc/cpu/kernels/linear.h, were found this way). The row counts are timed in alternation, each
pass over all the weights, so a slow spell of the memory hits every count alike; read the ratios to one row.
Writes bench/results/native_rows_<shape>_<dtype>[_<tier>].{md,json}.

    python -m bench.native_rows [--shape smollm2] [--dtypes bfloat16 float32] [--rows 1 2 3 4 6 8 12 16]
                                [--tier avx2] [--threads 2] [--reps 30]
"""

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from bench.machine import machine_info, machine_line, save_results, tier_suffix
from bench.shapes import SHAPES, projections
from tr_engine.cli.args import integer
from tr_engine.cli.common import ArgumentParser, run
from tr_engine.errors import UserError
from tr_engine.model import cpu

SOURCE = Path(__file__).with_name("native_rows.cpp")


def build(folder: Path) -> Path:
    """The timing program, compiled into `folder` (g++ or c++; -O2, as tests/kernel_harness.cpp)."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise UserError("bench.native_rows needs a C++ compiler (g++ or c++ on the PATH, or CXX): install one, e.g. "
                        "`apt install g++`")
    binary = folder / "native_rows"
    proc = subprocess.run([compiler, "-O2", "-std=c++17", str(SOURCE), "-o", str(binary), "-ldl", "-pthread"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"bench.native_rows: {SOURCE.name} did not compile: {proc.stderr.strip().splitlines()[-1]}")
    return binary


def measure(binary: Path, library: Path, dtype: str, shapes: list[tuple[int, int]], rows: list[int], reps: int,
            threads: int) -> dict[int, dict]:
    """{rows: {"median_ms", "min_ms"}} of one pass over `shapes` through `library`'s packed_rows."""
    proc = subprocess.run([str(binary), str(library), dtype, str(reps), str(threads), *map(str, rows)],
                          input="".join(f"{n} {k}\n" for n, k in shapes), capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"bench.native_rows: the timing program failed on {library.name}: {proc.stderr.strip()}")
    out = {}
    for line in proc.stdout.splitlines():
        _, r, _, median, _, least = line.split()
        out[int(r)] = {"median_ms": float(median), "min_ms": float(least)}
    return out


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m bench.native_rows", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="smollm2", choices=list(SHAPES))
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--rows", nargs="+", type=integer(1), default=[1, 2, 3, 4, 6, 8, 12, 16])
    ap.add_argument("--tier", choices=cpu.NAMES, default=None,
                    help="the CPU kernel tier to time (default: TR_ENGINE_CPU's, else the best this CPU runs)")
    ap.add_argument("--threads", type=integer(1), default=2)
    ap.add_argument("--reps", type=integer(1), default=30)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args(argv)
    tier = cpu.use(args.tier)  # (a tier this CPU cannot run, or one not built: a one-line error)
    library = cpu.library(cpu.tier(tier))
    if library is None:
        raise UserError(f"the {tier} tier's library is not built: run `make install`")
    rows = sorted(set(args.rows) | {1})  # (one row is what the others stand against)
    shapes = projections(SHAPES[args.shape])
    info = machine_info()
    info["threads"] = args.threads
    record, lines = {}, []
    with tempfile.TemporaryDirectory() as folder:
        binary = build(Path(folder))
        for dtype in args.dtypes:
            got = measure(binary, library, dtype, shapes, rows, args.reps, args.threads)
            record[dtype] = {str(r): v for r, v in got.items()}
            one = got[1]["median_ms"]
            lines += [f"## {dtype}", "", "| rows | median ms | min ms | against one row |", "|---|---|---|---|"]
            lines += [f"| {r} | {v['median_ms']:.3f} | {v['min_ms']:.3f} | {v['median_ms'] / one:.2f} |"
                      for r, v in got.items()]
            lines.append("")
    head = [f"# {args.shape}'s projections from C++, by rows of x ({len(shapes)} weights a pass)", "",
            f"Machine: {machine_line(info)}. Each pass runs every projection of one forward through the tier library's "
            f"packed_rows (bench/native_rows.cpp), the row counts in alternation; median and least of {args.reps} "
            "passes.", ""]
    text = "\n".join(head + lines)
    stem = args.out / f"native_rows_{args.shape}_{'_'.join(args.dtypes)}{tier_suffix(tier)}"
    save_results(stem, text, {"shape": args.shape, "rows": rows, "reps": args.reps, "ms": record}, info)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
