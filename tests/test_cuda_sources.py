"""Every CUDA kernel compiles for Ampere (sm_80) and Hopper (sm_90) with nvcc alone, so CI checks the GPU code
even on machines with no GPU and no CUDA build of torch."""

import shutil
import subprocess
from pathlib import Path

import pytest

CU_FILES = sorted((Path(__file__).parents[1] / "csrc" / "cuda").glob("*.cu"))


@pytest.mark.parametrize("path", CU_FILES, ids=[p.name for p in CU_FILES])
def test_cuda_kernel_compiles(path, tmp_path):
    nvcc = shutil.which("nvcc")
    assert nvcc, "nvcc is not on PATH: the CUDA compile check needs the CUDA toolkit's compiler"
    cmd = [nvcc, "-std=c++17", "-c", "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
           str(path), "-o", str(tmp_path / "out.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
