"""The CPU kernel tiers (tr_engine/model/cpu.py, csrc/cpu/tiers.cpp, csrc/cpu/kernels/): one kernel source built for
every instruction set of the architecture, the best this CPU runs chosen when the ops load (or TR_ENGINE_CPU's), each
tier exact by itself, and a build that runs on CPUs with fewer features than the one that built it. The kernels' own
tests (tests/test_<op>.py, the op contract) run once per tier through conftest's cpu_tier fixture; here: choosing,
the build, and on every tier a kernel harness without torch (on aarch64 NEON too, under qemu) and every decoding
method against plain decoding."""

import json
import math
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli import assert_one_line_error, run_module
from conftest import CPU_TIERS
from tr_engine.errors import UserError
from tr_engine.model import cpu

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "kernel_harness.cpp"
KERNELS = ROOT / "csrc" / "cpu" / "kernels"


def test_every_tier_of_this_architecture_is_built():
    assert cpu.for_this_machine(), "no tier for this architecture"
    for t in cpu.for_this_machine():
        assert cpu.library(t) is not None, f"{t.name} is not built"


def test_the_features_the_op_library_sees_are_the_ones_proc_cpuinfo_lists():
    """The op library reads CPUID (and the OS's vector state) itself; Linux lists the same flags, by other names."""
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith(("flags", "Features")):
            flags = set(line.split(":", 1)[1].split())
            break
    linux_name = {"avx512bf16": "avx512_bf16", "neon": "asimd"}
    for feature in sorted({f for t in cpu.TIERS for f in t.needs}):
        if linux_name.get(feature, feature) in flags or (feature == "neon" and "neon" in flags):
            assert feature in cpu.features(), feature
        elif flags:
            assert feature not in cpu.features(), feature


def test_the_default_is_the_best_tier_this_cpu_runs(monkeypatch):
    monkeypatch.delenv(cpu.ENV, raising=False)
    assert cpu.choose() == cpu.runnable()[0]
    assert [t.name for t in cpu.runnable()] == [t.name for t in cpu.TIERS if t.name in CPU_TIERS]
    assert CPU_TIERS[-1] == "scalar"  # the last resort runs anywhere


@pytest.mark.parametrize("bf16", [False, True])
def test_every_tier_measures_its_multiply_add_peak(cpu_tier, bf16):
    """cpu.multiply_add_peak: the active tier's independent vector multiply-adds on torch's threads, timed (the
    compute floor bench.kernels sets the matmuls against), and with bf16 its bf16 arithmetic's (the pair dot product
    where the tier has it); no work is a one-line error."""
    assert cpu.active() == cpu_tier
    rate = cpu.multiply_add_peak(2, bf16)
    assert math.isfinite(rate) and rate > 0
    with pytest.raises(RuntimeError, match="units must be positive, got 0"):
        cpu.multiply_add_peak(0, bf16)


@pytest.mark.parametrize("name", CPU_TIERS)
def test_tr_engine_cpu_forces_a_tier(monkeypatch, name):
    monkeypatch.setenv(cpu.ENV, f" {name.upper()} ")
    assert cpu.choose().name == name


def test_a_tier_that_cannot_be_had_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv(cpu.ENV, "avx1024")
    with pytest.raises(UserError, match=r"unknown CPU tier 'avx1024' \(TR_ENGINE_CPU\); choose one of amx, avx512bf16, "):
        cpu.choose()
    other = "neon" if cpu.tier("neon") not in cpu.for_this_machine() else "avx2"
    monkeypatch.setenv(cpu.ENV, other)
    with pytest.raises(UserError, match=rf"the CPU tier {other} \(TR_ENGINE_CPU\) is for .* CPUs, not "):
        cpu.choose()
    lacking = [t for t in cpu.for_this_machine() if t.name not in CPU_TIERS]
    for t in lacking:  # (on an AVX2 machine: the AVX-512 tiers)
        monkeypatch.setenv(cpu.ENV, t.name)
        with pytest.raises(UserError, match=rf"this CPU cannot run the CPU tier {t.name} \(TR_ENGINE_CPU\): it lacks "):
            cpu.choose()


def test_the_commands_say_which_tier_runs_and_refuse_one_that_cannot(tiny_factory):
    """generate --json reports the tier and the threads (as chat's /stats and the server's /health do); a bad
    TR_ENGINE_CPU ends the command in one line."""
    import os

    folder = str(tiny_factory("tiers", dtype=torch.bfloat16))
    lowest = CPU_TIERS[-2] if len(CPU_TIERS) > 1 else CPU_TIERS[-1]  # a lower tier than the default, where there is one
    env = os.environ | {cpu.ENV: lowest}
    proc = run_module("tr_engine.cli.generate", "--model", folder, "--prompt", "hi", "--max-new-tokens", "4",
                      "--dtype", "bfloat16", "--tree", "2.2.2", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["cpu_tier"] == lowest and 1 <= out["cpu_threads"] <= os.cpu_count()  # (it follows the load)
    proc = run_module("tr_engine.cli.generate", "--model", folder, "--prompt", "hi", "--max-new-tokens", "4",
                      "--tree", "2.2.2", "--json", "--threads", "1")  # (a given count is kept)
    assert proc.returncode == 0 and json.loads(proc.stdout)["cpu_threads"] == 1, proc.stderr
    proc = run_module("tr_engine.cli.generate", "--model", folder, "--prompt", "hi", env=os.environ | {cpu.ENV: "sse9"})
    assert_one_line_error(proc, "unknown CPU tier 'sse9'", "TR_ENGINE_CPU")


# A syscall() that refuses ARCH_REQ_XCOMP_PERM (as Linux before 5.16 does, or a sandbox that filters arch_prctl), and
# passes every other call on: preloaded, it stands between the op library and the kernel.
REFUSE_TILES = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <sys/syscall.h>
long syscall(long n, ...) {
  va_list ap;
  va_start(ap, n);
  long a[6];
  for (int i = 0; i < 6; ++i) a[i] = va_arg(ap, long);
  va_end(ap);
  if (n == SYS_arch_prctl && a[0] == 0x1023) { errno = EPERM; return -1; }
  static long (*real)(long, ...);
  if (!real) real = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
  return real(n, a[0], a[1], a[2], a[3], a[4], a[5]);
}
"""


@pytest.mark.skipif("amx" not in CPU_TIERS, reason="this CPU has no AMX tiles to be refused")
@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc)")
def test_a_process_linux_refuses_the_tiles_runs_the_next_tier(tmp_path):
    """AMX on the CPU, but the tiles not granted to this process: the op library must not offer the amx tier (its first
    tile instruction would kill the process), the default is then avx512bf16, and TR_ENGINE_CPU=amx is one line that
    says the OS, not the CPU, is what refused."""
    import os

    shim = tmp_path / "refuse_tiles.so"
    (tmp_path / "refuse_tiles.c").write_text(REFUSE_TILES)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(shim), str(tmp_path / "refuse_tiles.c"), "-ldl"], check=True)
    env = {k: v for k, v in os.environ.items() if k != cpu.ENV} | {"LD_PRELOAD": str(shim)}
    proc = subprocess.run([sys.executable, "-c", "from tr_engine.model import cpu; print(sorted(cpu.features()), "
                           "cpu.use())"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "amx_tile" not in proc.stdout and proc.stdout.split()[-1] == "avx512bf16", proc.stdout
    proc = run_module("tr_engine.cli.generate", "--prompt", "hi", env=env | {cpu.ENV: "amx"})
    assert_one_line_error(proc, "the CPU tier amx (TR_ENGINE_CPU) needs amx_tile, amx_bf16, which this CPU has but "
                                "Linux did not grant this process")


def test_the_op_library_refuses_a_tier_it_cannot_run():
    """use_cpu_tier checks the CPU before it opens a library, and that the library is the tier it claims; a refusal
    changes nothing."""
    ops, before = torch.ops.tr_engine, cpu.active()
    scalar = str(cpu.library(cpu.tier("scalar")))
    with pytest.raises(RuntimeError, match="the CPU kernel tier scalar needs sve2, which this CPU does not have"):
        ops.use_cpu_tier("scalar", scalar, ["sve2"])
    with pytest.raises(RuntimeError, match="holds the tier scalar, not avx2"):
        ops.use_cpu_tier("avx2", scalar, [])
    with pytest.raises(RuntimeError, match="cannot load the CPU kernel tier"):
        ops.use_cpu_tier("scalar", str(ROOT / "README.md"), [])
    assert cpu.active() == before


def instruction_sets(path: Path) -> set[str]:
    """The vector register files a library's code uses: 'ymm' (AVX), 'zmm' (AVX-512)."""
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(path)], capture_output=True, text=True,
                          check=True).stdout
    return {reg for reg in ("ymm", "zmm") if f"%{reg}" in text}


@pytest.mark.skipif(cpu.tier("avx2") not in cpu.for_this_machine(), reason="x86-64 only")
@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) is not installed")
def test_nothing_is_built_for_more_than_its_tier():
    """A build runs on a CPU with fewer features than the builder's: the op library and the scalar tier are plain
    x86-64 (no AVX at all), the avx2 tier has no AVX-512, and only the AVX-512 tiers use zmm registers."""
    import tr_engine._C

    assert instruction_sets(Path(tr_engine._C.__file__)) == set()
    assert instruction_sets(cpu.library(cpu.tier("scalar"))) == set()
    assert instruction_sets(cpu.library(cpu.tier("avx2"))) == {"ymm"}
    assert "zmm" in instruction_sets(cpu.library(cpu.tier("avx512")))


def test_a_wheel_carries_every_file_the_package_reads():
    """`pip wheel .` ships the tier libraries and the package's Python files by itself; any other file under
    tr_engine/ (the paper's tree) must be in setup.py's package_data, or an installed wheel cannot find it."""
    import fnmatch
    import re

    declared = re.search(r'package_data=\{"tr_engine": \[([^\]]*)\]', (ROOT / "setup.py").read_text())
    assert declared, "setup.py declares no package_data for tr_engine"
    patterns = re.findall(r'"([^"]+)"', declared.group(1))
    tracked = subprocess.run(["git", "ls-files", "tr_engine"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout: the package's files are not listed")
    data = [f.removeprefix("tr_engine/") for f in tracked.stdout.split() if not f.endswith(".py")]
    assert data, "tr_engine/ has no data files: this test has nothing left to guard"
    for f in data:
        assert any(fnmatch.fnmatch(f, p) for p in patterns), f"tr_engine/{f} is not in setup.py's package_data"


@pytest.fixture(scope="module")
def native_harness(tmp_path_factory):
    binary = tmp_path_factory.mktemp("harness") / "kernel_harness"
    compiler = shutil.which("g++") or shutil.which("c++")
    assert compiler, "a C++ compiler is needed (the op library was built with one)"
    subprocess.run([compiler, "-O2", "-std=c++17", "-ffp-contract=off", str(HARNESS), "-o", str(binary), "-ldl",
                    "-pthread"], check=True)
    return binary


@pytest.mark.parametrize("name", CPU_TIERS)
def test_the_kernel_harness_passes_on_every_tier(native_harness, name):
    """tests/kernel_harness.cpp holds a tier library to its contracts without torch: within rounding of float64,
    row-independent bit for bit (a tree row is its decode step; 4 chained decoder-layer rows are 4 decode steps), and
    on x86 no subnormal operand from stale scratch in the attention's padding (seen through MXCSR's denormal flag)."""
    proc = subprocess.run([str(native_harness), str(cpu.library(cpu.tier(name)))], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"tier {name} " in proc.stdout and f"{name}: 0 failed" in proc.stdout
    assert proc.stdout.count("the same bits after calls that left NaN") == 2, proc.stdout  # (float32, bf16)
    if platform.machine() == "x86_64":  # (the padding's flag check ran, not skipped: its flag is x86's)
        # bf16 scores on amx run on AMX's tiles, on avx512bf16 by vdpbf16ps: both read subnormal bf16 as zeros and
        # raise no flag
        bf16_dot = name in ("amx", "avx512bf16")
        assert proc.stdout.count("not stale scratch") == 2 - bf16_dot, proc.stdout
        assert ("skip attention bfloat16: subnormal keys do not raise" in proc.stdout) == bf16_dot, proc.stdout


CROSS = shutil.which("aarch64-linux-gnu-g++")
QEMU = shutil.which("qemu-aarch64")


@pytest.fixture(scope="module")
def aarch64_build(tmp_path_factory):
    """The neon tier and the harness, cross-compiled for aarch64 with the tier's flags (as setup.py builds it)."""
    if CROSS is None:
        pytest.skip("no aarch64 cross-compiler: install Debian's g++-aarch64-linux-gnu (make test does, with apt)")
    out = tmp_path_factory.mktemp("aarch64")
    builds = [subprocess.Popen([CROSS, *cpu.compile_flags(cpu.tier("neon")), "-fPIC", "-shared",
                                f"-Wl,--version-script={KERNELS / 'exports.map'}", str(KERNELS / "tier.cpp"), "-o",
                                str(out / "_cpu_neon.so")]),
              subprocess.Popen([CROSS, "-O2", "-std=c++17", "-ffp-contract=off", str(HARNESS), "-o",
                                str(out / "kernel_harness"), "-ldl", "-pthread"])]  # side by side
    assert [b.wait() for b in builds] == [0, 0], "the aarch64 cross-compile failed (its errors are above)"
    return out


def test_the_neon_tier_cross_compiles_for_aarch64(aarch64_build):
    assert (aarch64_build / "_cpu_neon.so").stat().st_size > 0


@pytest.mark.skipif(QEMU is None, reason="no qemu-aarch64: install Debian's qemu-user (make test does, with apt)")
def test_the_neon_tier_passes_the_kernel_harness_under_qemu(aarch64_build):
    sysroot = "/usr/aarch64-linux-gnu"  # the cross toolchain's C library, for the emulated dynamic linker
    proc = subprocess.run([QEMU, "-L", sysroot, str(aarch64_build / "kernel_harness"),
                           str(aarch64_build / "_cpu_neon.so")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tier neon " in proc.stdout and "neon: 0 failed" in proc.stdout


# ---- every method is plain decoding, on every tier -----------------------------------------------------------------

@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def packed_engine(tiny_factory, request):
    """A tiny random Llama in float32 or bfloat16: packed weights, every step through decoder_layers, the path of a
    real CPU model (test_speculative's float64 one takes the module path)."""
    from tr_engine.engine import Engine

    dtype = getattr(torch, request.param)
    folder = tiny_factory(f"tiers-{request.param}", dtype=dtype, vocab_size=300, std=0.5)
    return Engine.from_pretrained(str(folder), dtype=request.param, max_context=512, tree="2.2.2")


@pytest.fixture(params=CPU_TIERS)
def every_tier(request):
    """Each tier this machine runs, every one (conftest's cpu_tier leaves out a duplicate): its kernels behind the
    ops for the test, then the tier before."""
    before = cpu.active()
    cpu.use(request.param)
    yield request.param
    if before:
        cpu.use(before)


def test_every_method_gives_plain_decodings_tokens_on_every_tier(packed_engine, every_tier):
    """Row independence end to end, per tier: each tier's verify rows are its decode steps' bits, so TR (the paper's
    static tree), hybrid and prompt lookup commit exactly what plain decoding commits on that tier, greedy and
    sampled with a seed. (Tiers may differ from each other in the last bits; a method never differs from plain.)"""
    engine = packed_engine
    words = "the cat sat on a mat while dogs ran past our old red barn at dawn".split()
    drafted = 0
    for i in range(6):
        prompt = " ".join(words[i:i + 3 + i % 4]) * 3  # repeated: drafts come true, so verify rows get accepted
        for sampling in ({}, {"temperature": 0.8, "seed": i}):
            plain = engine.generate(prompt, 40, method="ar", chat_template=False, **sampling)
            for method in ("tr", "hybrid", "pld"):
                got = engine.generate(prompt, 40, method=method, chat_template=False, **sampling)
                assert got.token_ids == plain.token_ids, (every_tier, method, i, sampling)
                drafted += max(got.generation.accept_lengths, default=1) > 1
    assert drafted >= 6  # drafts were accepted: the verify path ran, not only plain steps


def test_a_tier_the_compiler_cannot_build_is_left_out_of_the_build(tmp_path):
    """setup.py builds the tiers its compiler accepts the flags of (cpu.buildable): a compiler too old for AMX costs
    the amx tier, not the build. A stand-in compiler that refuses -mamx-tile, and one that does not run at all."""
    fake = tmp_path / "old-c++"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = -mamx-tile ] && exit 1; done\nexit 0\n')
    fake.chmod(0o755)
    ok, missing = cpu.buildable(cpu.for_this_machine("x86_64"), str(fake))
    assert [t.name for t in missing] == ["amx"]
    assert [t.name for t in ok] == [t.name for t in cpu.for_this_machine("x86_64") if t.name != "amx"]
    ok, missing = cpu.buildable(cpu.for_this_machine("x86_64"), str(tmp_path / "no-such-compiler"))
    assert ok == () and len(missing) == len(cpu.for_this_machine("x86_64"))
    ok, missing = cpu.buildable(cpu.for_this_machine())  # this machine's own compiler built every tier here
    assert missing == () and all(cpu.library(t) is not None for t in ok)
