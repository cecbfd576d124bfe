"""Every CUDA kernel compiles for Ampere (sm_80) and Hopper (sm_90) with nvcc alone, so CI checks the GPU code
even on machines with no GPU and no CUDA build of torch."""

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension

CU_FILES = sorted((Path(__file__).parents[1] / "csrc" / "cuda").glob("*.cu"))


@pytest.mark.parametrize("path", CU_FILES, ids=[p.name for p in CU_FILES])
def test_cuda_kernel_compiles(path, tmp_path):
    nvcc = shutil.which("nvcc")
    assert nvcc, "nvcc is not on PATH: the CUDA compile check needs the CUDA toolkit's compiler"
    cmd = [nvcc, "-std=c++17", "-c", "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
           "--threads", "2", str(path), "-o", str(tmp_path / "out.o")]  # (the two architectures side by side)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_cuda_launchers_compile(tmp_path):
    """The torch-facing launchers (csrc/cuda/ops_cuda.cpp) compile against torch's own headers (nvcc drives the host
    compiler and adds the CUDA include paths).

    CPU wheels of torch ship the c10/cuda headers but not one generated file, c10/cuda/impl/cuda_cmake_macros.h,
    which only defines build macros; an empty stand-in lets the rest be checked.
    """
    nvcc = shutil.which("nvcc")
    assert nvcc, "nvcc is not on PATH: the CUDA compile check needs the CUDA toolkit's compiler"
    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    includes = [tmp_path, *torch.utils.cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    # (-fsyntax-only: the host compiler checks the file, templates instantiated, and writes no code: 8 s, not 13)
    cmd = [nvcc, "-std=c++17", "-c", *[f"-I{p}" for p in includes], str(CU_FILES[0].parent / "ops_cuda.cpp"),
           "-Xcompiler", "-fsyntax-only", "-o", str(tmp_path / "ops_cuda.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def nvcc_compile(path: Path, out: Path) -> subprocess.CompletedProcess:
    nvcc = shutil.which("nvcc")
    assert nvcc, "nvcc is not on PATH: the CUDA compile check needs the CUDA toolkit's compiler"
    return subprocess.run([nvcc, "-std=c++17", "-c", str(path), "-o", str(out)], capture_output=True, text=True)


@pytest.mark.parametrize("path", CU_FILES, ids=[p.name for p in CU_FILES])
def test_a_launcher_that_drifts_from_its_declaration_does_not_compile(path, tmp_path):
    """Each .cu defines its launcher as tr_engine::launch_* against csrc/cuda/launchers.h, which ops_cuda.cpp calls
    through: give the definition one more parameter and the kernel file no longer compiles (were it a plain overload,
    the mismatch would surface only as an undefined symbol when the library loads on a GPU machine)."""
    source = path.read_text()
    definition = source.index("tr_engine::launch_")
    drift = source[definition:].replace("cudaStream_t stream)", "cudaStream_t stream, int drift)", 1)
    drifted = source[:definition] + drift
    assert drifted != source
    (tmp_path / "launchers.h").write_text((path.parent / "launchers.h").read_text())
    (tmp_path / path.name).write_text(drifted)
    proc = nvcc_compile(tmp_path / path.name, tmp_path / "out.o")
    assert proc.returncode != 0 and "launch_" in proc.stderr, proc.stderr
