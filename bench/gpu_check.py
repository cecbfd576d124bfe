"""The GPU check: one command that proves the CUDA path on a bare GPU machine (a system python3 with a CUDA torch, no
venv, no internet, no model weights: only this repository) and measures it, in one run of at most 9 minutes.

    python -m bench.gpu_check --out DIR                 # on a GPU (make gpu-check)
    python -m bench.gpu_check --out DIR --device cpu    # the rehearsal, tiny shapes (make gpu-check DEVICE=cpu)

Stages, in order, each in its own process with its own time limit (a hung kernel or a poisoned CUDA context ends
that stage only; a failing stage is recorded and the next one runs), all under one hard budget:

  env          the machine: GPU, capability, memory, driver, torch, nvcc
  build        the extension for this GPU's architecture only (TORCH_CUDA_ARCH_LIST from the device), all cores
  cuda-tests   the cuda-marked tests (the kernels against their references, CUDA graphs, losslessness on the GPU)
  bandwidth    the ceilings: device-to-device copy bandwidth, a large matrix product's rate
  steps-*      random models of Vicuna-7B's and SmolLM2's shapes in float16 and bfloat16: the plain decode step
               against the bandwidth floor (weight bytes / copy bandwidth), the verify step of 1..128 tokens at
               prefixes 512, 1024 and 2048 relative to the plain step, eager and as CUDA graphs
  projection   the speedup each tree size would give: MAT measured on the CPU (bench/results/tree_mat.json) over
               the 7B verify cost measured here
  methods      TR, hybrid and prompt lookup against plain decoding on a tiny random model in float32 (same tokens)
  kernels      each op against stock PyTorch and its reference at both shapes (bench.kernels, synchronised timers)

Writes DIR/results.json (every number, each stage's status, seconds and what it skipped), DIR/summary.md (the
headline numbers first), DIR/verify_cost.png and DIR/log.txt (every stage's output). The rehearsal runs the same
stages at tiny shapes on the CPU, skipping only what needs CUDA and saying so, in about a minute; CI runs it
(tests/test_gpu_check.py), so the script is known to work before a GPU is ever seen. The stages themselves are in
bench/gpu_stages.py, the report in bench/gpu_report.py.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.gpu_report import plot, summary
from bench.gpu_stages import ROOT, STAGE_FUNCS, jsonable, run_stage
from tr_engine.cli.common import ArgumentParser, run
from tr_engine.errors import UserError

BUDGET_S = 540  # 9 minutes, whatever happens
RESERVE_S = 15  # kept back for writing the results

# name: (what it does, seconds allowed on a GPU, in the rehearsal)
STAGES = {
    "env": ("the machine", 30, 30),
    "build": ("the extension for this GPU", 240, 120),
    "cuda-tests": ("the cuda-marked tests", 150, 90),
    "bandwidth": ("copy bandwidth and matmul rate", 30, 20),
    "steps-vicuna-7b": ("plain and verify steps, Vicuna-7B shape", 120, 40),
    "projection": ("projected speedup by tree size", 20, 20),
    "steps-smollm2": ("plain and verify steps, SmolLM2 shape", 60, 40),
    "methods": ("TR, hybrid, PLD vs plain decoding", 60, 40),
    "kernels": ("each op vs stock PyTorch and its reference", 120, 40),
}  # in order of what matters most, should the budget run short
assert set(STAGES) == set(STAGE_FUNCS)


# ---------------------------------------------------------------------------------------------------------------------
# The orchestrator: each stage in its own process group, time-boxed, under the budget.


def orchestrate(out: Path, device: str, budget: float, only: list[str] | None, limits: dict[str, float]) -> int:
    t_start = time.monotonic()
    deadline = t_start + budget
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "log.txt").open("w")
    stages = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = Path(tmp)
        for name, (what, cap_gpu, cap_cpu) in STAGES.items():
            if only and name not in only:
                continue
            cap = limits.get(name, cap_gpu if device.startswith("cuda") else cap_cpu)
            left = deadline - time.monotonic() - RESERVE_S
            if left < 5:
                stages[name] = {"status": "not run", "seconds": 0.0, "what": what,
                                "failures": [f"the {budget:.0f}-second budget was spent"], "skipped": []}
                continue
            limit = min(cap, left)
            print(f"[gpu_check] {name}: {what} (up to {limit:g} s)", flush=True)
            log.write(f"\n===== {name}: {what} (up to {limit:g} s) =====\n")
            log.flush()
            t0 = time.monotonic()
            cmd = [sys.executable, "-m", "bench.gpu_check", "--stage", name, "--device", device, "--work", str(work)]
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
            try:
                rc = proc.wait(timeout=limit)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the stage and anything it started (a build, pytest)
                proc.wait()
                rc, timed_out = None, True
            seconds = time.monotonic() - t0
            record_path = work / f"{name}.json"
            record = json.loads(record_path.read_text()) if record_path.is_file() else {}
            failures = list(record.get("failures", []))
            if timed_out:
                failures.append(f"timed out after {seconds:.0f} s (its limit)")
            elif not record:
                failures.append(f"the stage's process died (exit {rc}) before writing its record; see log.txt")
            status = "timed out" if timed_out else ("failed" if failures else "ok")
            stages[name] = {"status": status, "seconds": round(seconds, 1), "what": what, "limit_s": round(limit),
                            "results": record.get("results"), "skipped": record.get("skipped", []),
                            "failures": failures}
            print(f"[gpu_check] {name}: {status} in {seconds:.1f} s"
                  + "".join(f"\n    failure: {f}" for f in failures)
                  + "".join(f"\n    skipped: {k}" for k in record.get("skipped", [])), flush=True)
            report(out, device, budget, time.monotonic() - t_start, stages)  # after every stage: a kill loses none
        log.close()
    report(out, device, budget, time.monotonic() - t_start, stages, final=True)
    print((out / "summary.md").read_text())
    return 1 if any(st["status"] != "ok" for st in stages.values()) else 0


def report(out: Path, device: str, budget: float, total: float, stages: dict, final: bool = False) -> None:
    """results.json and summary.md as they stand (and, at the end, the plot)."""
    results = {"device": device, "rehearsal": not device.startswith("cuda"), "budget_s": budget,
               "total_s": round(total, 1), "complete": final, "stages": stages}
    (out / "results.json").write_text(json.dumps(results, indent=1, default=jsonable) + "\n")
    (out / "summary.md").write_text(summary(results))
    if final:
        try:
            plot(out / "verify_cost.png", stages)
        except Exception as e:  # a missing matplotlib must not lose the summary
            print(f"[gpu_check] no plot: {type(e).__name__}: {e}", flush=True)


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="folder for results.json, summary.md, verify_cost.png, log.txt")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cuda (default): the GPU check; cpu: its rehearsal at tiny shapes")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help=f"seconds for everything (default {BUDGET_S})")
    ap.add_argument("--only", nargs="+", choices=list(STAGES), help="run only these stages")
    ap.add_argument("--limit", nargs="+", default=[], metavar="STAGE=SECONDS",
                    help="another time limit for a stage (default: the table in this file's STAGES)")
    ap.add_argument("--stage", choices=list(STAGES), help=argparse_hidden())
    ap.add_argument("--work", type=Path, help=argparse_hidden())
    args = ap.parse_args(argv)
    if args.stage:
        return run_stage(args.stage, args.device, args.work)
    if args.out is None:
        raise UserError("--out DIR is required: the folder the results go to")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UserError("no CUDA device here (torch sees none); on a CPU run the rehearsal: make gpu-check "
                            "DEVICE=cpu")
    if not 30 <= args.budget <= 3600:
        raise UserError(f"--budget {args.budget:g} is outside 30..3600 seconds")
    return orchestrate(args.out, args.device, args.budget, args.only, parse_limits(args.limit))


def parse_limits(items: list[str]) -> dict[str, float]:
    limits = {}
    for item in items:
        name, _, seconds = item.partition("=")
        try:
            value = float(seconds)
        except ValueError:
            value = -1.0
        if name not in STAGES or not 0 < value <= 3600:
            raise UserError(f"--limit {item!r}: expected STAGE=SECONDS with a stage of {', '.join(STAGES)} and "
                            "0 < SECONDS <= 3600")
        limits[name] = value
    return limits


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    raise SystemExit(run(main))
