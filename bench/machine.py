"""What a benchmark ran on: recorded in every results file, because numbers without their machine mean nothing."""

import json
import os
import platform
import subprocess
from pathlib import Path

import torch


def git_commit() -> str:
    """The checkout's short commit (-dirty with uncommitted changes); TR_ENGINE_COMMIT where there is no .git (a
    working tree copied to a GPU machine)."""
    if os.environ.get("TR_ENGINE_COMMIT"):
        return os.environ["TR_ENGINE_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).parent).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except OSError:
        return "unknown"


def cpu_tier() -> str:
    """The CPU kernel tier the ops run (tr_engine/model/cpu.py), loading the default one if none is yet."""
    from tr_engine.model import cpu
    from tr_engine.errors import UserError

    try:
        return cpu.active() or cpu.use()
    except (UserError, ImportError):  # not built, or TR_ENGINE_CPU names a tier this CPU cannot run
        return "none"


def machine_info(device: str = "cpu") -> dict:
    from tr_engine.model import cpu

    info = {
        "cpu": cpu.model_name(),
        "cpu_tier": cpu_tier(),
        "cores": len(os.sched_getaffinity(0)),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": git_commit(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def save_results(stem: Path, text: str, record: dict, info: dict) -> str:
    """Write a benchmark's results beside each other: `stem`.md, the report people read, and `stem`.json, its numbers
    with the machine they ran on first (machine_info). The folder is made if needed. Returns `text`."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    (stem.parent / f"{stem.name}.md").write_text(text)
    (stem.parent / f"{stem.name}.json").write_text(json.dumps({"machine": info, **record}, indent=1) + "\n")
    return text


def tier_suffix(tier: str | None) -> str:
    """What a CPU result's file name adds for the kernel tier it ran on: "_<tier>", except for avx512bf16 (the tier of
    the hosts the first results came from, which carry no suffix) and none (a GPU run). So an AMX host's run
    (kernels_cpu_amx) or an AVX2 one's lies beside the AVX-512 host's instead of replacing it."""
    return "" if tier in (None, "none", "avx512bf16") else f"_{tier}"


def machine_line(info: dict) -> str:
    gpu = f", GPU {info['gpu']}" if "gpu" in info else ""
    tier = f", kernel tier {info['cpu_tier']}" if info.get("cpu_tier") else ""
    return (f"{info['cpu']}{tier}, {info['cores']} cores, {info['threads']} threads{gpu}; torch {info['torch']}, "
            f"Python {info['python']}, commit {info['commit']}")


def copy_bandwidth(device: str = "cpu", n_bytes: int | None = None, reps: int = 10) -> float:
    """The device's copy bandwidth in GB/s (bytes read plus bytes written), the median of timed copies of a buffer
    far bigger than the caches: the ceiling of a memory-bound kernel, measured where it runs."""
    import statistics
    import time

    gpu = device.startswith("cuda")
    n_bytes = n_bytes or (2**31 if gpu else 2**28)
    src = torch.randn(n_bytes // 4, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    times = []
    for i in range(reps + 2):  # two warm-up copies
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return 2 * n_bytes / statistics.median(times) / 1e9


def read_bandwidth(n_bytes: int = 2**28, reps: int = 7) -> float:
    """This CPU's streaming read bandwidth in GB/s: the median of timed sums of a float32 buffer far bigger than the
    caches (a sum reads every byte once and writes nothing, as a decode step reads its weights), on the threads
    torch uses. Bytes of weights / this = the fastest a memory-bound decode step can be."""
    import statistics
    import time

    x = torch.ones(n_bytes // 4)
    times = []
    for i in range(reps + 2):  # two warm-up passes
        t0 = time.perf_counter()
        x.sum()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return n_bytes / statistics.median(times) / 1e9


def multiply_add_peak(reps: int = 5, bf16: bool = False) -> float | None:
    """The active CPU tier's arithmetic peak in GFLOPS on torch's threads: the best of `reps` timed runs of its
    independent multiply-add chains (csrc/cpu/kernels/peak.h, ~0.03-0.1 s each); with `bf16`, of its bf16 arithmetic
    (the pair dot product where the tier has it: twice the float rate); None where the ops are not built. The compute
    floor of a matmul is its FLOPs over this, as its memory floor is its bytes over the bandwidth."""
    from tr_engine.model import cpu

    if cpu_tier() == "none":
        return None
    units = 256 * torch.get_num_threads()
    cpu.multiply_add_peak(units // 8, bf16)  # (the threads awake)
    return max(cpu.multiply_add_peak(units, bf16) for _ in range(reps))


def status_kb(pid: int | str, field: str) -> int:
    """A memory figure of a process's /proc status (VmRSS, VmHWM, ...), in KiB; OSError once the process is gone."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for process {pid}")


def rss_kb(pid: int | str = "self") -> int:
    """A process's resident memory (VmRSS), in KiB."""
    return status_kb(pid, "VmRSS")
