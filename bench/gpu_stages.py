"""The GPU check's stages (bench/gpu_check.py runs each in a process of its own): what each measures, on a GPU or,
in the rehearsal, at tiny shapes on the CPU. A stage returns its numbers; what it could not do and why goes in
`skipped`, problems it found in `failures`; run_stage writes all three to the work folder for the orchestrator.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERIFY_SIZES = (1, 2, 4, 8, 16, 32, 48, 64, 80, 81, 96, 128)
PREFIXES = (512, 1024, 2048)
HEADLINE_PREFIX, HEADLINE_TREE = 1024, 81  # the paper's tree, at a typical conversation's length


class Stage:
    """What a stage works with: the device, the work folder the stages share, and its skipped/failures lists."""

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
    """`python setup.py build_ext --inplace -j N`, as `make install` does: objects under build/ (a rebuild recompiles
    only what changed), the libraries in tr_engine/. On a GPU, for its own architecture only and with every core."""
    import torch

    env = {**os.environ, "MAX_JOBS": str(os.cpu_count() or 1)}
    if s.gpu:
        major, minor = torch.cuda.get_device_capability(0)
        env["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
    else:
        s.skipped.append("CUDA kernels: no CUDA device, so the CPU kernels alone are built")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace", "-j", str(os.cpu_count() or 1)],
                          cwd=ROOT, env=env, capture_output=True, text=True)
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

    from bench.kernels import median_ms
    from bench.machine import copy_bandwidth

    n_bytes = 2**31 if s.gpu else 2**27
    copy_gb_s = copy_bandwidth(s.device, n_bytes, 20 if s.gpu else 5)
    n = 8192 if s.gpu else 512
    a = torch.randn(n, n, device=s.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=s.device, dtype=torch.bfloat16)
    mm_s = median_ms({"matmul": lambda: a @ b}, 20 if s.gpu else 3, s.device)["matmul"] / 1e3
    return {"copy_gb_s": round(copy_gb_s, 1), "copy_bytes": n_bytes,
            "bf16_matmul_tflops": round(2 * n**3 / mm_s / 1e12, 2), "matmul_n": n}


def stage_steps(s: Stage, shape: str) -> dict:
    """For each dtype: the plain decode step's seconds at prefix 512 against the floor (weight bytes / measured copy
    bandwidth) and the verify cost curve, eager and as CUDA graphs (in the rehearsal: the graphs' uncaptured
    static-buffer twin, since capturing needs a GPU)."""
    import torch

    from bench.shapes import SHAPES, STAND_INS

    measured = shape if s.gpu else STAND_INS[shape]
    config = SHAPES[measured]
    bw = ((s.load("bandwidth") or {}).get("results") or {}).get("copy_gb_s")  # (None: that stage failed)
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
    from tr_engine.core.cost import time_steps
    from tr_engine.model.graphs import StepGraphs
    from tr_engine.model.kv_cache import KVCache
    from tr_engine.model.weights import random_model

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
    """Every method on a tiny random model, in float32 eager and with CUDA graphs, and in half precision with graphs:
    the same tokens as plain decoding (in float32 on a GPU, cuBLAS's results for different row counts may differ in
    the last bit, which greedy decoding almost never notices; a difference is reported, not hidden)."""
    import torch

    from weights_tools.tiny_llama import write_tiny_llama

    folder = write_tiny_llama(s.work / "tiny-llama", vocab_size=320, std=0.5)
    prompts = ["the quick brown fox jumps over the lazy dog " * 3, "def add(a, b):\n    return a + b\n" * 2,
               "Paris is the capital of France; Berlin is the capital of Germany.", "1, 2, 3, 4, 5, 6, 7, 8, 9"]
    # float32 must give plain decoding's tokens; half precision too on a CPU (row-independent kernels), while on a
    # GPU, whose matmuls round differently for different row counts, its match rate is reported, not required.
    half = "float16" if s.gpu else "bfloat16"
    out = {}
    for mode, dtype, graphs in (("eager", "float32", False), ("graphs", "float32", True),
                                (f"graphs {half}", half, True)):
        rows = s.attempt(mode, _methods_of, s, folder, prompts, mode, dtype, graphs,
                         strict=dtype == "float32" or not s.gpu)
        if rows is not None:
            out[mode] = rows
    if s.gpu:
        torch.cuda.empty_cache()
    return out


def _methods_of(s: Stage, folder, prompts: list[str], mode: str, dtype: str, graphs: bool, strict: bool) -> dict:
    """One engine (eager, or with CUDA graphs: on a CPU their uncaptured twin), every method on every prompt; with
    `strict`, a method whose tokens differ from plain decoding's is a failure."""
    from tr_engine.core.cost import BUCKETS
    from tr_engine.engine import Engine

    engine = Engine.from_pretrained(str(folder), device=s.device, dtype=dtype, max_context=512,
                                    cuda_graphs=graphs and s.gpu)
    if graphs and not s.gpu:
        skip = "graph capture: no CUDA device (the uncaptured static-buffer steps run instead)"
        if skip not in s.skipped:
            s.skipped.append(skip)
        engine.runners.use_graphs(BUCKETS, engine.tree.size, capture=False)
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
        tokens = row.pop("tokens")
        row["same_as_plain"] = sum(a == b for a, b in zip(tokens, plain))  # answers, of len(prompts)
        row["answers"] = len(prompts)
        row["identical"] = row["same_as_plain"] == len(prompts)
        row["speedup"] = rows["ar"]["decode_s"] / row["decode_s"] if row["decode_s"] else None
        if strict and not row["identical"]:
            s.failures.append(f"{mode} {method}: {len(prompts) - row['same_as_plain']} of {len(prompts)} answers "
                              "differ from plain decoding's")
        print(f"{mode:15} {method:6} same as plain {row['same_as_plain']}/{len(prompts)} MAT {row['mat']:.2f} "
              f"decode {row['decode_s']:.3f} s", flush=True)
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
    (work / f"{name}.json").write_text(json.dumps(record, indent=1, default=jsonable) + "\n")
    return 1 if s.failures else 0


def describe(e: BaseException) -> str:
    """An exception in one line: its type and the first line of its message."""
    first = str(e).splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"[:400]


def jsonable(x):
    return str(x)
