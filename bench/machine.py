"""What a benchmark ran on: recorded in every results file, because numbers without their machine mean nothing."""

import os
import platform
import subprocess
from pathlib import Path

import torch


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


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


def machine_info(device: str = "cpu") -> dict:
    info = {
        "cpu": cpu_model(),
        "cores": len(os.sched_getaffinity(0)),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": git_commit(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def machine_line(info: dict) -> str:
    gpu = f", GPU {info['gpu']}" if "gpu" in info else ""
    return (f"{info['cpu']}, {info['cores']} cores, {info['threads']} threads{gpu}; torch {info['torch']}, "
            f"Python {info['python']}, commit {info['commit']}")
