"""The CPU kernel tiers: the instruction sets the CPU kernels are built for, which one runs here, and how to choose.

The kernels (csrc/cpu/kernels/) are one source compiled once per tier, with the flags below, into
`tr_engine/_cpu_<tier>.so` (setup.py). When the ops load (tr_engine.model.ops), the best tier this CPU can run becomes
the one every CPU op calls, or the tier the environment variable TR_ENGINE_CPU names (`TR_ENGINE_CPU=avx2` on an
AVX-512 machine runs the AVX2 kernels, to see what an AVX2 CPU gets). The op library checks the CPU's features
before it opens a tier's library, so a build made on one machine runs on any x86-64 CPU with the tiers it can run.

Each tier's kernels are row-independent, so on every tier every decoding method emits plain decoding's tokens, in
bfloat16 too. The tiers differ from each other in the last bits of a result (fused multiply-adds or not, the bf16
dot product's rounding, AMX's own order of sums, the order of a vector's horizontal sum), so two tiers may decode a
long answer differently.
"""

import importlib.util
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from tr_engine.errors import UserError

ENV = "TR_ENGINE_CPU"


@dataclass(frozen=True)
class Tier:
    name: str
    machine: str  # platform.machine() of the CPUs it is built for; "" for any
    flags: tuple[str, ...]  # the compiler flags of its library (with -DTR_ENGINE_TIER_<NAME>)
    needs: tuple[str, ...]  # the CPU features it needs, by csrc/cpu/tiers.cpp's names
    about: str


_AVX2 = ("avx2", "fma", "f16c")
_AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")

# Best first: the default is the first one this CPU runs.
TIERS = (
    Tier("amx", "x86_64", ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx2", "-mfma",
                           "-mf16c", "-mamx-tile", "-mamx-bf16"),
         _AVX512 + ("avx512bf16", "amx_tile", "amx_bf16") + _AVX2,
         "avx512bf16 with bf16 matmuls and attention on AMX's tiles (Intel Sapphire Rapids and later)"),
    Tier("avx512bf16", "x86_64", ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx2",
                                  "-mfma", "-mf16c"), _AVX512 + ("avx512bf16",) + _AVX2,
         "AVX-512 with bf16 dot products (AMD Zen 4 and later, Intel Sapphire Rapids and later)"),
    Tier("avx512", "x86_64", ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"),
         _AVX512 + _AVX2, "AVX-512 (Intel Skylake-SP to Ice Lake servers)"),
    Tier("avx2", "x86_64", ("-mavx2", "-mfma", "-mf16c"), _AVX2,
         "AVX2 + FMA + F16C (Intel since Haswell, AMD since Zen; most laptops)"),
    Tier("neon", "aarch64", (), ("neon",), "aarch64 NEON (Apple M-series, Graviton, Ampere)"),
    Tier("scalar", "", (), (), "plain loops, the compiler's baseline vectors (any CPU)"),
)
NAMES = tuple(t.name for t in TIERS)
LINUX_NAMES = {"avx512bf16": "avx512_bf16", "neon": "asimd"}  # the features /proc/cpuinfo spells otherwise


# How every tier's library is compiled (setup.py; the cross-compile test), besides its own flags:
#  -ffp-contract=off: a multiply and an add are fused only where the source says so (numbers.h's fmadd, simd.h's
#     mul_add), so a loop rounds alike in every instantiation of a kernel: its vector body and its tail, a one-row
#     call and a tile of rows. Row independence rests on it.
#  -fno-trapping-math: no value changes (clang's default); it lets the compiler turn a select after a computation
#     into a blend, without which GCC left softmax's exponential a scalar loop on AVX2 (attention 1.3x slower).
#  -fopenmp-simd: the kernels' `omp simd` hints, without OpenMP's runtime (the threads are the op library's).
#  hidden visibility (and setup.py's version script): each tier keeps its own copies of inline and template code.
KERNEL_FLAGS = ("-O3", "-std=c++17", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp-simd", "-fvisibility=hidden",
                "-fvisibility-inlines-hidden")


def compile_flags(t: Tier) -> list[str]:
    """The compiler flags of tier t's library."""
    return [*KERNEL_FLAGS, *t.flags, f"-DTR_ENGINE_TIER_{t.name.upper()}"]


def tier(name: str) -> Tier:
    return next(t for t in TIERS if t.name == name)


def for_this_machine(machine: str | None = None) -> tuple[Tier, ...]:
    """The tiers a build on this kind of machine compiles (platform.machine(), or `machine`)."""
    machine = machine or platform.machine()
    return tuple(t for t in TIERS if t.machine in ("", machine))


def buildable(tiers: tuple[Tier, ...], compiler: str | None = None) -> tuple[tuple[Tier, ...], tuple[Tier, ...]]:
    """(the tiers `compiler` (CXX, else c++) can compile, the ones it cannot): each tier's flags tried on an empty
    file. A compiler too old for a tier's instruction set (AMX needs GCC 11 or Clang 12) then costs that tier, not the
    build; the op library offers only the tiers that are built (runnable)."""
    import shlex
    import subprocess

    command = shlex.split(compiler or os.environ.get("CXX") or "c++")
    ok, missing = [], []
    for t in tiers:
        try:
            proc = subprocess.run([*command, "-x", "c++", "-fsyntax-only", *compile_flags(t), "-"], input="",
                                  capture_output=True, text=True, timeout=60)
            (ok if proc.returncode == 0 else missing).append(t)
        except (OSError, subprocess.TimeoutExpired):
            missing.append(t)
    return tuple(ok), tuple(missing)


def library(t: Tier) -> Path | None:
    """The tier's built library, or None."""
    spec = importlib.util.find_spec(f"tr_engine._cpu_{t.name}")
    return Path(spec.origin) if spec is not None and spec.origin else None


def _ops():
    """torch.ops.tr_engine, with the op library loaded (ImportError when it is not built)."""
    import torch

    import tr_engine._C  # noqa: F401

    return torch.ops.tr_engine


def features() -> frozenset[str]:
    """What this CPU (and its OS) supports of the features the tiers need."""
    return frozenset(_ops().cpu_features())


def _cpuinfo(*fields: str) -> str | None:
    """The first processor's value of the first of `fields` that /proc/cpuinfo lists; None off Linux."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith(fields)), None)


def model_name() -> str:
    """The CPU's model name (what benchmarks record, and the cost curve's cache is keyed by)."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def listed_by_linux() -> frozenset[str]:
    """The tiers' features that /proc/cpuinfo lists for this CPU (by the tiers' names), whether or not the OS lets a
    process use them: features() less these is what the OS withholds (AMX's tiles are granted per process). Empty off
    Linux."""
    flags = set((_cpuinfo("flags", "Features") or "").split())
    return frozenset(f for f in {f for t in TIERS for f in t.needs} if LINUX_NAMES.get(f, f) in flags)


def runnable() -> tuple[Tier, ...]:
    """The built tiers this CPU can run, best first."""
    have = features()
    return tuple(t for t in for_this_machine() if set(t.needs) <= have and library(t) is not None)


def choose(name: str | None = None) -> Tier:
    """The tier `name` asks for, else TR_ENGINE_CPU's, else the best this CPU runs; a one-line error for a name that
    is unknown, or whose tier this CPU cannot run or this build lacks."""
    source = "requested"
    if name is None and os.environ.get(ENV):
        name, source = os.environ[ENV].strip().lower(), ENV
    ok = runnable()
    if name is None:
        if not ok:
            raise UserError("no CPU kernel tier is built for this CPU; run `make install`")
        return ok[0]
    here = f"this CPU runs {', '.join(t.name for t in ok)}"
    if name not in NAMES:
        raise UserError(f"unknown CPU tier {name!r} ({source}); choose one of {', '.join(NAMES)} ({here})")
    t = tier(name)
    if t not in for_this_machine():
        raise UserError(f"the CPU tier {name} ({source}) is for {t.machine} CPUs, not {platform.machine()} ({here})")
    missing = [f for f in t.needs if f not in features()]
    if missing and set(missing) <= listed_by_linux():  # (the CPU has them, the OS does not let this process use them)
        raise UserError(f"the CPU tier {name} ({source}) needs {', '.join(missing)}, which this CPU has but Linux "
                        f"did not grant this process (AMX's tiles need Linux 5.16 or later, and no sandbox that "
                        f"filters arch_prctl) ({here})")
    if missing:
        raise UserError(f"this CPU cannot run the CPU tier {name} ({source}): it lacks {', '.join(missing)} ({here})")
    if library(t) is None:
        raise UserError(f"the CPU tier {name} ({source}) is not built; run `make install`")
    return t


def use(name: str | None = None) -> str:
    """Make tier `name` (or choose()'s default) the one every CPU op calls; returns its name."""
    t = choose(name)
    _ops().use_cpu_tier(t.name, str(library(t)), list(t.needs))
    return t.name


def active() -> str:
    """The tier the CPU ops call now ("" before the ops have loaded one, or where the op library is not built)."""
    try:
        return _ops().cpu_tier()
    except ImportError:
        return ""


def multiply_add_peak(units: int, bf16: bool = False) -> float:
    """The active tier's arithmetic rate in GFLOPS: `units` units of independent multiply-add chains on every thread
    of torch's pool, timed (csrc/cpu/kernels/peak.h); with `bf16`, the rate of its bf16 arithmetic (the AVX512-BF16
    pair dot product, twice the float multiply-add's work an instruction, where the tier has it; elsewhere the
    multiply-add's). A benchmark's compute floor; bench.machine takes the best of a few runs."""
    return _ops().multiply_add_peak(units, bf16)


def tier_of(ops, device) -> str | None:
    """The tier an ops namespace runs on `device`: this tier's name for the compiled kernels, "reference" for the
    pure-PyTorch ops, None off the CPU."""
    if device.type != "cpu":
        return None
    return active() if "kernels" in ops.kind else "reference"
