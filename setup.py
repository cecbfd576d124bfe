"""Builds tr_engine and its op library tr_engine._C (C++ CPU kernels always; CUDA kernels when torch has CUDA and
nvcc is found). Install without build isolation so the build uses the torch already installed:

    pip install --no-build-isolation -e .

`make install` builds in place instead (`python setup.py build_ext --inplace`: objects kept under build/, so a changed
kernel recompiles alone), then installs the package editable with TR_ENGINE_PREBUILT=1, which skips the extension
(already in the source tree). bench/gpu_check.py builds the same way on a bare GPU machine.
"""

import glob
import os

from setuptools import find_packages, setup
from torch.utils import cpp_extension


def extension():
    sources = ["csrc/registration.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
    # The CPU kernels are plain loops that the compiler vectorises for this machine's instruction set; set
    # TR_ENGINE_MARCH (e.g. x86-64-v3) to build for other machines than the one building. -fopenmp is what makes
    # at::parallel_for parallel: its OpenMP loop is inline in ATen's headers, so without the flag it runs on one
    # thread (torch's own libgomp is the runtime it links against).
    cxx = ["-O3", "-std=c++17", "-fopenmp", f"-march={os.environ.get('TR_ENGINE_MARCH', 'native')}"]
    import torch

    with_cuda = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if os.environ.get("TR_ENGINE_NO_CUDA") == "1":
        with_cuda = False
    if not with_cuda:
        return cpp_extension.CppExtension(
            "tr_engine._C", sources, extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"]
        )
    sources += sorted(glob.glob("csrc/cuda/*.cpp")) + sorted(glob.glob("csrc/cuda/*.cu"))
    nvcc = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo"]
    return cpp_extension.CUDAExtension(
        "tr_engine._C", sources, extra_compile_args={"cxx": cxx, "nvcc": nvcc}, extra_link_args=["-fopenmp"]
    )


setup(
    name="tr_engine",
    version="0.1.0",
    description="Token Recycling: lossless speculative decoding with no draft model, with C++/CUDA kernels",
    packages=find_packages(include=["tr_engine", "tr_engine.*", "weights_tools", "weights_tools.*"]),
    python_requires=">=3.10",
    ext_modules=[] if os.environ.get("TR_ENGINE_PREBUILT") == "1" else [extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
)
