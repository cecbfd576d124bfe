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
(tests/test_gpu_check.py), so the script is known to work before a GPU is ever seen.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tr_engine.cli import ArgumentParser, run
from tr_engine.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
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
VERIFY_SIZES = (1, 2, 4, 8, 16, 32, 48, 64, 80, 81, 96, 128)
PREFIXES = (512, 1024, 2048)
HEADLINE_PREFIX, HEADLINE_TREE = 1024, 81  # the paper's tree, at a typical conversation's length
TARGETS = {"floor_share": 0.70, "verify81": 1.15}  # the targets: 7B fp16 plain step, 81-token verify


# ---------------------------------------------------------------------------------------------------------------------
# The stages. Each runs in a fresh process (python -m bench.gpu_check --stage NAME) and returns a dict: its numbers
# under "results", what it could not do and why under "skipped", problems found under "failures".


class Stage:
    def __init__(self, device: str, work: Path):
        self.device, self.work = device, work
        self.gpu = device.startswith("cuda")
        self.skipped: list[str] = []
        self.failures: list[str] = []

    def load(self, name: str) -> dict | None:
        """An earlier stage's output, if it ran."""
        path = self.work / f"{name}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def attempt(self, what: str, fn, *args, **kwargs):
        """fn(*args, **kwargs), or None with the error recorded as a failure of `what`: one shape's or dtype's
        failure (out of memory, a kernel error) leaves the others' numbers."""
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            import traceback

            traceback.print_exc()
            self.failures.append(f"{what}: {describe(e)}")
            return None

    def sync(self) -> None:
        if self.gpu:
            import torch

            torch.cuda.synchronize()


def stage_env(s: Stage) -> dict:
    import platform

    import torch

    from bench.machine import machine_info

    out = {**machine_info(s.device), "python_path": sys.executable, "cuda_runtime": torch.version.cuda,
           "cpu_count": os.cpu_count()}
    nvcc = _run(["nvcc", "--version"])
    out["nvcc"] = nvcc.splitlines()[-1].strip() if nvcc else None
    if s.gpu:
        p = torch.cuda.get_device_properties(0)
        out.update(gpu=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                   memory_gib=round(p.total_memory / 2**30, 1), l2_mib=round(getattr(p, "L2_cache_size", 0) / 2**20, 1))
        smi = _run(["nvidia-smi", "--query-gpu=driver_version,clocks.sm,clocks.mem,power.limit,temperature.gpu",
                    "--format=csv,noheader"])
        out["nvidia_smi"] = smi.strip() if smi else None
    else:
        s.skipped.append("GPU properties and nvidia-smi: no CUDA device")
    out["platform"] = platform.platform()
    return out


def _run(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def stage_build(s: Stage) -> dict:
    """`python setup.py build_ext --inplace`, as `make install` does: objects under build/ (a rebuild recompiles only
    what changed), the library in tr_engine/. On a GPU, for its own architecture only and with every core."""
    import torch

    env = {**os.environ, "MAX_JOBS": str(os.cpu_count() or 1)}
    if s.gpu:
        major, minor = torch.cuda.get_device_capability(0)
        env["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
    else:
        s.skipped.append("CUDA kernels: no CUDA device, so the CPU kernels alone are built")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    print(proc.stdout, proc.stderr, sep="\n")  # the whole build log goes to log.txt
    if proc.returncode != 0:  # (ninja reports a compiler's errors on stdout)
        raise RuntimeError(f"the build failed (exit {proc.returncode}): " + _last_error(proc.stdout + proc.stderr))
    # What did it build? (a fresh process would load the new library; this one has not imported it yet)
    import tr_engine._C  # noqa: F401

    has = torch._C._dispatch_has_kernel_for_dispatch_key
    cuda_ops = [op for op in ("tree_attention", "tree_attention_dynamic", "compact_kv_", "recycle_update_",
                              "skinny_linear") if has(f"tr_engine::{op}", "CUDA")]
    if s.gpu and len(cuda_ops) < 5:
        s.failures.append(f"the library has CUDA kernels for {cuda_ops} only")
    return {"seconds": round(seconds, 1), "arch_list": env.get("TORCH_CUDA_ARCH_LIST"), "jobs": env["MAX_JOBS"],
            "cuda_ops": cuda_ops, "library": tr_engine._C.__file__}


def _last_error(text: str) -> str:
    """The first line that reports an error, else the last line: what the stage's failure says in one line."""
    lines = [line for line in text.splitlines() if "error" in line.lower() and "-werror" not in line.lower()]
    return (lines[0] if lines else (text.strip().splitlines() or ["no output"])[-1])[:300]


def stage_cuda_tests(s: Stage) -> dict:
    """pytest -m cuda over the test files that hold cuda-marked tests (the others may need the default model, which a
    bare machine has not got)."""
    import xml.etree.ElementTree as ET

    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                   if "pytest.mark.cuda" in p.read_text())
    junit = s.work / "cuda-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", f"--junitxml={junit}", *files]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    print(proc.stdout[-12000:], proc.stderr[-4000:], sep="\n")
    if not junit.is_file():
        raise RuntimeError(f"pytest wrote no report (exit {proc.returncode}): "
                           + _last_error(proc.stdout + proc.stderr))
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    s.failures += [f"test failed: {name}" for name in failed]
    if counts["skipped"]:
        s.skipped.append(f"{counts['skipped']} of {counts['tests']} cuda-marked tests skipped"
                         + ("" if s.gpu else " (no CUDA device)"))
    return {**counts, "files": files, "failed": failed}


def stage_bandwidth(s: Stage) -> dict:
    """Device-to-device copy bandwidth (bytes read + written per second; the decode step's ceiling) and a large
    bf16 matrix product's rate (the prefill's), on random data, medians of timed repeats."""
    import torch

    n_bytes = 2**31 if s.gpu else 2**27
    src = torch.randn(n_bytes // 4, device=s.device)
    dst = torch.empty_like(src)
    copy_s = _median_s(lambda: dst.copy_(src), 20 if s.gpu else 5, s)
    n = 8192 if s.gpu else 512
    a = torch.randn(n, n, device=s.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=s.device, dtype=torch.bfloat16)
    mm_s = _median_s(lambda: a @ b, 20 if s.gpu else 3, s)
    return {"copy_gb_s": round(2 * n_bytes / copy_s / 1e9, 1), "copy_bytes": n_bytes,
            "bf16_matmul_tflops": round(2 * n**3 / mm_s / 1e12, 2), "matmul_n": n}


def _median_s(fn, reps: int, s: Stage) -> float:
    """Median seconds of fn() (synchronised), after two warm-up calls."""
    import statistics

    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        s.sync()
        t0 = time.perf_counter()
        fn()
        s.sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def stage_steps(s: Stage, shape: str) -> dict:
    """For each dtype: the plain decode step's seconds at prefix 512 against the floor (weight bytes / measured copy
    bandwidth) and the verify cost curve, eager and as CUDA graphs (in the rehearsal: the graphs' uncaptured
    static-buffer twin, since capturing needs a GPU)."""
    import torch

    from bench.shapes import SHAPES, STAND_INS

    measured = shape if s.gpu else STAND_INS[shape]
    config = SHAPES[measured]
    bw = (s.load("bandwidth") or {}).get("results", {}).get("copy_gb_s")
    if bw is None:
        s.skipped.append("the bandwidth floor: the bandwidth stage did not run")
    dtypes = (torch.float16, torch.bfloat16) if s.gpu else (torch.bfloat16,)
    if not s.gpu:
        s.skipped.append(f"the {shape} shape and float16: the rehearsal runs {measured} in bfloat16 on the CPU")
        s.skipped.append("graph capture: no CUDA device (the uncaptured static-buffer steps run instead)")
    reps = 15 if s.gpu else 2
    out = {"shape": measured, "sizes": VERIFY_SIZES, "prefixes": PREFIXES, "dtypes": {}}
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        row = s.attempt(name, _steps_of, s, config, measured, dtype, bw, reps)
        if row is not None:
            out["dtypes"][name] = row
        if s.gpu:
            torch.cuda.empty_cache()
    return out


def _steps_of(s: Stage, config, measured: str, dtype, bw: float | None, reps: int) -> dict:
    """One dtype of stage_steps: a random model, its plain step against the floor, its verify curve, both modes."""
    from bench.shapes import kv_bytes, weight_bytes
    from tr_engine.cost import time_steps
    from tr_engine.graphs import StepGraphs
    from tr_engine.kv_cache import KVCache
    from tr_engine.weights import random_model

    name = str(dtype).removeprefix("torch.")
    capacity = max(PREFIXES) + max(VERIFY_SIZES) + 8
    model = random_model(config, dtype, s.device)
    model.set_max_positions(capacity)
    cache = KVCache(config, capacity, dtype, s.device)
    modes = {"eager": model, "graphs": StepGraphs(model, cache, VERIFY_SIZES, capture=s.gpu)}
    row = {"weight_bytes": weight_bytes(config, dtype.itemsize)}
    for mode, runner in modes.items():
        seconds = {P: time_steps(runner, cache, VERIFY_SIZES, P, reps, with_argmax=False) for P in PREFIXES}
        row[mode] = {"seconds": seconds,
                     "relative": {P: {T: sec / by_T[1] for T, sec in by_T.items()} for P, by_T in seconds.items()}}
        if mode == "graphs" and s.gpu and runner.failures:
            s.failures += [f"{name} graph capture failed for {b} tokens: {why}" for b, why in runner.failures.items()]
        plain = seconds[512][1]
        row[mode]["plain_ms"] = plain * 1e3
        if bw:
            floor = row["weight_bytes"] / (bw * 1e9)
            floor_kv = (row["weight_bytes"] + kv_bytes(config, dtype.itemsize, 512)) / (bw * 1e9)
            row[mode].update(floor_ms=floor * 1e3, floor_share=floor / plain, floor_kv_share=floor_kv / plain)
        row[mode]["verify81"] = row[mode]["relative"][HEADLINE_PREFIX][HEADLINE_TREE]
        print(f"{measured} {name} {mode}: plain step {plain * 1e3:.3f} ms at prefix 512"
              + (f" ({row[mode]['floor_share']:.0%} of the bandwidth floor)" if bw else "")
              + f", 81-token verify at {HEADLINE_PREFIX} = {row[mode]['verify81']:.2f} plain steps", flush=True)
    return row


def stage_kernels(s: Stage) -> dict:
    from bench import kernels

    shapes = ("vicuna-7b", "smollm2") if s.gpu else ("tiny",)
    if not s.gpu:
        s.skipped.append("the CUDA kernels: no CUDA device (the CPU kernels run at the tiny shape instead)")
    out = {}
    for shape in shapes:
        out[shape] = s.attempt(shape, kernels.measure, s.device, shape, 10 if s.gpu else 2,
                               log=lambda line: print(line, flush=True))
    return out


def stage_methods(s: Stage) -> dict:
    """Every method on a tiny random model in float32, eager and with CUDA graphs: the same tokens as plain decoding
    (float32 on a GPU: cuBLAS's results for different row counts may differ in the last bit, which greedy decoding
    almost never notices in float32; a difference is reported, not hidden)."""
    import torch

    from weights_tools.tiny_llama import write_tiny_llama

    folder = write_tiny_llama(s.work / "tiny-llama", vocab_size=320, std=0.5)
    prompts = ["the quick brown fox jumps over the lazy dog " * 3, "def add(a, b):\n    return a + b\n" * 2,
               "Paris is the capital of France; Berlin is the capital of Germany.", "1, 2, 3, 4, 5, 6, 7, 8, 9"]
    out = {}
    for graphs in (False, True):
        rows = s.attempt("graphs" if graphs else "eager", _methods_of, s, folder, prompts, graphs)
        if rows is not None:
            out["graphs" if graphs else "eager"] = rows
    if s.gpu:
        torch.cuda.empty_cache()
    return out


def _methods_of(s: Stage, folder, prompts: list[str], graphs: bool) -> dict:
    """One engine (eager, or with CUDA graphs: on a CPU their uncaptured twin), every method on every prompt."""
    from tr_engine.cost import BUCKETS
    from tr_engine.engine import Engine
    from tr_engine.graphs import StepGraphs, graph_buckets

    engine = Engine.from_pretrained(str(folder), device=s.device, dtype="float32", max_context=512,
                                    cuda_graphs=graphs and s.gpu)
    if graphs and not s.gpu:
        s.skipped.append("graph capture: no CUDA device (the uncaptured static-buffer steps run instead)")
        engine.runner = StepGraphs(engine.model, engine.cache,
                                   graph_buckets(BUCKETS, engine.tree.size, engine.cache.capacity), capture=False)
    mode = "graphs" if graphs else "eager"
    rows = {}
    for method in ("ar", "tr", "hybrid", "pld"):
        for p in prompts[:1]:  # warm-up: kernel selection, graph capture, the adaptive tree's cost curve
            engine.generate(p, max_new_tokens=32, method=method)
        tokens, steps, seconds, phases = [], 0, 0.0, {}
        for p in prompts:
            g = engine.generate(p, max_new_tokens=64, method=method).generation
            tokens.append(g.token_ids)
            steps += g.steps
            seconds += g.decode_s
            for phase, sec in g.phase_s.items():
                phases[phase] = phases.get(phase, 0.0) + sec
        # Host clocks: on a GPU they see launches, except accept's sync, which absorbs the wait for the verify;
        # retrieve's share is the drafting work on the critical path (the adaptive tree plans on the host).
        rows[method] = {"tokens": tokens, "steps": steps, "decode_s": seconds,
                        "mat": sum(len(t) - 1 for t in tokens) / max(steps, 1),
                        "phase_ms_per_step": {k: 1e3 * v / max(steps, 1) for k, v in phases.items()}}
    plain = rows["ar"]["tokens"]
    for method, row in rows.items():
        row["identical"] = row.pop("tokens") == plain
        row["speedup"] = rows["ar"]["decode_s"] / row["decode_s"] if row["decode_s"] else None
        if not row["identical"]:
            s.failures.append(f"{mode} {method}: tokens differ from plain decoding's")
        print(f"{mode:6} {method:6} identical={row['identical']} MAT {row['mat']:.2f} decode {row['decode_s']:.3f} s",
              flush=True)
    return rows


def stage_projection(s: Stage) -> dict:
    """speedup(T) = MAT(T) / cost(T): MAT from the CPU's bench/results/tree_mat.json (trained model, real text),
    cost from this run's Vicuna-7B-shaped verify curve at prefix 1024 (the rehearsal: the tiny shape's)."""
    mat_file = ROOT / "bench" / "results" / "tree_mat.json"
    steps = s.load("steps-vicuna-7b")
    if steps is None or not steps.get("results"):
        raise RuntimeError("the steps-vicuna-7b stage left no verify curve to project with")
    if not mat_file.is_file():  # (it is committed: measured on a CPU, where the trained model is)
        raise RuntimeError(f"{mat_file.relative_to(ROOT)} is missing: run python -m bench.tree_mat on a CPU first")
    measured = json.loads(mat_file.read_text())
    out = {"mat_source": f"{measured['model']} {measured['dtype']}, {measured['questions']} questions", "rows": {}}
    for dtype, row in steps["results"]["dtypes"].items():
        for mode in ("eager", "graphs"):
            relative = row[mode]["relative"][str(HEADLINE_PREFIX)]
            proj = {}
            for method, by_T in measured["mat"].items():
                proj[method] = {T: by_T[T] / relative[T] for T in by_T if T in relative}
            static = measured["static_2_2_2"]["mat"] / relative["81"]
            best = {m: max(p.items(), key=lambda kv: kv[1]) for m, p in proj.items()}
            out["rows"][f"{dtype} {mode}"] = {"projected": proj, "static_2_2_2": static,
                                              "paper_2_2_2": 2.70 / relative["81"], "best": best}
    return out


STAGE_FUNCS = {"env": stage_env, "build": stage_build, "cuda-tests": stage_cuda_tests, "bandwidth": stage_bandwidth,
               "steps-vicuna-7b": lambda s: stage_steps(s, "vicuna-7b"),
               "steps-smollm2": lambda s: stage_steps(s, "smollm2"), "methods": stage_methods,
               "kernels": stage_kernels, "projection": stage_projection}


def run_stage(name: str, device: str, work: Path) -> int:
    """The body of one stage's process: run it, write work/NAME.json (also on failure, with the error)."""
    s = Stage(device, work)
    if not s.gpu:
        import torch

        torch.set_num_threads(1)  # tiny shapes gain nothing from threads, and one thread never spins on a busy CPU
    record = {"results": None}
    try:
        record["results"] = STAGE_FUNCS[name](s)
    except Exception as e:  # recorded, not raised: the orchestrator reads the record and goes on
        import traceback

        traceback.print_exc()
        s.failures.append(describe(e))
    record.update(skipped=s.skipped, failures=s.failures)
    (work / f"{name}.json").write_text(json.dumps(record, indent=1, default=_jsonable) + "\n")
    return 1 if s.failures else 0


def describe(e: BaseException) -> str:
    """An exception in one line: its type and the first line of its message."""
    first = str(e).splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"[:400]


def _jsonable(x):
    return str(x)


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
    (out / "results.json").write_text(json.dumps(results, indent=1, default=_jsonable) + "\n")
    (out / "summary.md").write_text(summary(results))
    if final:
        try:
            plot(out / "verify_cost.png", stages)
        except Exception as e:  # a missing matplotlib must not lose the summary
            print(f"[gpu_check] no plot: {type(e).__name__}: {e}", flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# The report.


def summary(results: dict) -> str:
    st = results["stages"]
    rehearsal = results["rehearsal"]
    env = (st.get("env") or {}).get("results") or {}
    title = "CPU rehearsal of the GPU check" if rehearsal else f"GPU check on {env.get('gpu', 'a GPU')}"
    lines = [f"# {title}", ""]
    if env:
        lines.append(f"Machine: {env.get('gpu', env.get('cpu'))}"
                     + (f" (sm_{env['capability'].replace('.', '')}, {env['sms']} SMs, {env['memory_gib']} GiB)"
                        if "capability" in env else "")
                     + f"; torch {env.get('torch')}, CUDA {env.get('cuda_runtime')}, {env.get('nvcc') or 'no nvcc'}; "
                     f"Python {env.get('python')}; commit {env.get('commit')}.")
    lines.append(f"Total {results['total_s']:.0f} s of a {results['budget_s']:.0f}-second budget."
                 + (" Rehearsal: tiny shapes on the CPU; what needs CUDA is skipped and listed below." if rehearsal
                    else ""))
    lines += ["", "## Stages", "", "| stage | status | seconds | skipped | failures |", "|---|---|---|---|---|"]
    for name, s in st.items():
        lines.append(f"| {name} | {s['status']} | {s['seconds']:.1f} | {'; '.join(s['skipped']) or '-'} | "
                     f"{'; '.join(s['failures']) or '-'} |")
    lines += _headline(st, rehearsal)
    lines += _details(st)
    return "\n".join(lines) + "\n"


def _res(st: dict, name: str) -> dict:
    return (st.get(name) or {}).get("results") or {}


def _headline(st: dict, rehearsal: bool) -> list[str]:
    lines = ["", "## Headline", ""]
    b = _res(st, "build")
    if b:
        arch = b["arch_list"] or "the host CPU only"
        lines.append(f"- Build: {b['seconds']:.0f} s with {b['jobs']} jobs for {arch}; "
                     f"CUDA kernels: {', '.join(b['cuda_ops']) or 'none'}.")
    t = _res(st, "cuda-tests")
    if t:
        lines.append(f"- CUDA tests: {t['passed']} passed, {t['failures'] + t['errors']} failed, "
                     f"{t['skipped']} skipped "
                     f"of {t['tests']}.")
    bw = _res(st, "bandwidth")
    if bw:
        lines.append(f"- Copy bandwidth {bw['copy_gb_s']:.0f} GB/s; bf16 matmul {bw['bf16_matmul_tflops']:.1f} TFLOP/s "
                     f"({bw['matmul_n']}^3).")
    for shape in ("vicuna-7b", "smollm2"):
        r = _res(st, f"steps-{shape}")
        for dtype, row in (r.get("dtypes") or {}).items():
            for mode in ("eager", "graphs"):
                m = row[mode]
                floor = (f", {m['floor_share']:.0%} of the bandwidth floor ({m['floor_ms']:.3f} ms)"
                         if "floor_share" in m else "")
                target = ""
                if shape == "vicuna-7b" and dtype == "float16" and not rehearsal:
                    target = (f" [targets: floor share >= {TARGETS['floor_share']:.0%}, "
                              f"81-token verify <= {TARGETS['verify81']:.2f}x]")
                lines.append(f"- {r['shape']} {dtype} {mode}: plain step {m['plain_ms']:.3f} ms at prefix 512{floor}; "
                             f"81-token verify at prefix {HEADLINE_PREFIX} = {m['verify81']:.2f} plain steps{target}.")
    meth = _res(st, "methods")
    for mode, rows in meth.items():
        lines.append(f"- Methods ({mode}, tiny float32): " + ", ".join(
            f"{m} {'identical' if r['identical'] else 'DIFFERENT'} MAT {r['mat']:.2f}" for m, r in rows.items()) + ".")
    proj = _res(st, "projection")
    for key, row in (proj.get("rows") or {}).items():
        best = ", ".join(f"{m} {v:.2f}x at {T} tokens" for m, (T, v) in row["best"].items())
        lines.append(f"- Projected speedup ({key}): best {best}; static 2.2.2 {row['static_2_2_2']:.2f}x "
                     f"(the paper's MAT 2.70: {row['paper_2_2_2']:.2f}x).")
    return lines


def _details(st: dict) -> list[str]:
    lines = []
    for shape in ("vicuna-7b", "smollm2"):
        r = _res(st, f"steps-{shape}")
        for dtype, row in (r.get("dtypes") or {}).items():
            lines += ["", f"## Verify cost, {r['shape']} {dtype} (plain step = 1.00)", "",
                      "| tokens | " + " | ".join(f"eager P={P} | graphs P={P}" for P in r["prefixes"]) + " |",
                      "|---|" + "---|---|" * len(r["prefixes"])]
            for T in r["sizes"]:
                cells = [f"{row[mode]['relative'][str(P)][str(T)]:.2f}" for P in r["prefixes"]
                         for mode in ("eager", "graphs")]
                lines.append(f"| {T} | " + " | ".join(cells) + " |")
            lines.append("")
            lines.append("Plain step (ms): " + ", ".join(
                f"{mode} {row[mode]['seconds'][str(P)]['1'] * 1e3:.3f} at P={P}" for mode in ("eager", "graphs")
                for P in r["prefixes"]) + ".")
    proj = _res(st, "projection")
    if proj:
        lines += ["", f"## Projected speedup by tree size (MAT from {proj['mat_source']} / verify cost at prefix "
                  f"{HEADLINE_PREFIX})", ""]
        for key, row in proj["rows"].items():
            for method, by_T in row["projected"].items():
                lines.append(f"- {key}, {method}: " + ", ".join(f"{T}: {v:.2f}x" for T, v in by_T.items()))
    meth = _res(st, "methods")
    if meth:
        phases = ("retrieve", "verify", "accept", "compact", "recycle")
        lines += ["", "## Methods on a tiny random model, float32 (host ms per step by phase)", "",
                  "| mode | method | same tokens as plain | MAT | decode s | vs plain | " + " | ".join(phases) + " |",
                  "|---|---|---|---|---|---|" + "---|" * len(phases)]
        for mode, rows in meth.items():
            for method, r in rows.items():
                ph = r.get("phase_ms_per_step", {})
                lines.append(f"| {mode} | {method} | {'yes' if r['identical'] else 'NO'} | {r['mat']:.2f} | "
                             f"{r['decode_s']:.3f} | {r['speedup']:.2f}x | "
                             + " | ".join(f"{ph[p]:.3f}" if p in ph else "-" for p in phases) + " |")
    k = _res(st, "kernels")
    for shape, rows in k.items():
        from bench.kernels import table

        lines += ["", f"## Kernels at {shape} shapes", "", *table(rows)]
    return lines


def plot(path: Path, stages: dict) -> None:
    curves = {}
    for shape in ("vicuna-7b", "smollm2"):
        r = _res(stages, f"steps-{shape}")
        for dtype, row in (r.get("dtypes") or {}).items():
            for mode in ("eager", "graphs"):
                curves[f"{r['shape']} {dtype} {mode}"] = row[mode]["relative"][str(HEADLINE_PREFIX)]
    if curves:
        from bench.forward_cost import plot as plot_curves

        plot_curves(path, curves, "Verify cost by tree size", f"cost / plain decode step (prefix {HEADLINE_PREFIX})")


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
