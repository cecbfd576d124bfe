"""Builds tr_engine, its op library tr_engine._C (the ops' registrations and argument checks; the CUDA kernels when
torch has CUDA and nvcc is found) and one CPU kernel library per instruction-set tier, tr_engine/_cpu_<tier>.so
(tr_engine/model/cpu.py lists the tiers and their flags). Install without build isolation so the build uses the torch
already installed:

    pip install --no-build-isolation -e .

`make install` builds in place instead (`python setup.py build_ext --inplace -j N`: the libraries side by side,
objects kept under build/, so a change recompiles only the libraries it touches), then installs the package editable
with TR_ENGINE_PREBUILT=1, which skips the extensions (already in the source tree). bench/gpu_check.py builds the same
way on a bare GPU machine.

Nothing is compiled for the building machine's own CPU: _C for the architecture's baseline, each tier for its
instruction set, so a build (or a wheel) runs on any CPU of the architecture, with the best tier that CPU supports.
"""

import glob
import os
import sys
import threading
from pathlib import Path

from setuptools import Extension, find_packages, setup
from torch.utils import cpp_extension

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from tr_engine.model.cpu import buildable, compile_flags, for_this_machine  # noqa: E402  (the tier table; nothing heavy)


def generated(name: str, text: str) -> str:
    """A file under build/ (rewritten only when its text changes, so ninja sees it unchanged), as a path from here."""
    path = Path(HERE, "build", name)
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return os.path.relpath(path, HERE)


def op_library_unit() -> str:
    """registration.cpp and csrc/cpu/*.cpp as one translation unit (build/op_library.cpp, a list of #includes): torch's
    headers, most of each file's 14 s to compile, are parsed once instead of nine times (the op library's clean build:
    nine units, 126 s of CPU time -> one, 20 s). The files stay separate to read; anything at file scope in one must
    not clash with another's (each keeps its helpers in an anonymous namespace, under names of their own)."""
    files = ["csrc/registration.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
    lines = [f'#include "../{f}"' for f in files]
    return generated("op_library.cpp", "// The op library's C++ sources as one unit (setup.py, op_library_unit).\n"
                     + "\n".join(lines) + "\n")


def op_library():
    sources = [op_library_unit()]
    # What the unit includes, so that setuptools rebuilds it when one changes (it compares these with the library).
    depends = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/*.h") + glob.glob("csrc/cpu/*.cpp")
                     + glob.glob("csrc/cpu/*.h") + ["csrc/cpu/kernels/api.h", "csrc/cpu/kernels/types.h",
                                                     "csrc/cpu/kernels/tiles.h"])
    # -fopenmp is what makes at::parallel_for parallel: its OpenMP loop is inline in ATen's headers, so without the
    # flag it runs on one thread (torch's own libgomp is the runtime it links against).
    cxx = ["-O3", "-std=c++17", "-fopenmp", "-g0"]  # (-g0: Python's own CFLAGS ask for -g, 40% of the build's time)
    import torch

    with_cuda = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if os.environ.get("TR_ENGINE_NO_CUDA") == "1":
        with_cuda = False
    if not with_cuda:
        return cpp_extension.CppExtension(
            "tr_engine._C", sources, depends=depends, extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"]
        )
    sources += sorted(glob.glob("csrc/cuda/*.cpp")) + sorted(glob.glob("csrc/cuda/*.cu"))
    nvcc = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo"]
    depends += sorted(glob.glob("csrc/cuda/*.h") + glob.glob("csrc/cuda/*.cuh"))
    return cpp_extension.CUDAExtension(
        "tr_engine._C", sources, depends=depends, extra_compile_args={"cxx": cxx, "nvcc": nvcc},
        extra_link_args=["-fopenmp"]
    )


def tier_source(tier) -> str:
    """csrc/cpu/kernels/tier.cpp under a name of the tier's own (a one-line file under build/), so that each tier's
    object file is its own and the tiers compile side by side (`build_ext -j`)."""
    text = f'// The {tier.name} tier (setup.py): every CPU kernel, compiled with its flags.\n#include "../../csrc/cpu/kernels/tier.cpp"\n'
    return generated(f"tiers/{tier.name}.cpp", text)


def tier_library(tier):
    """One tier's kernels: csrc/cpu/kernels/ (no torch) with the tier's flags (tr_engine/model/cpu.py says why each),
    and a version script that exports the one entry point."""
    return Extension(f"tr_engine._cpu_{tier.name}", [tier_source(tier)], language="c++",
                     depends=sorted(glob.glob("csrc/cpu/kernels/*.h")) + ["csrc/cpu/kernels/tier.cpp"],
                     extra_compile_args=[*compile_flags(tier), "-g0"],
                     extra_link_args=[f"-Wl,--version-script={os.path.join(HERE, 'csrc/cpu/kernels/exports.map')}"])


class BuildExtension(cpp_extension.BuildExtension):
    """torch's ninja build, with each extension's objects and ninja files in a folder of its own under build/: `-j`
    builds the extensions side by side, one ninja each, and ninjas sharing a folder corrupt each other's dependency
    log (every later build then recompiles everything)."""

    _building = threading.local()  # the extension this thread builds

    @property
    def build_temp(self):
        name = getattr(self._building, "name", None)
        return self._build_temp if name is None else os.path.join(self._build_temp, name)

    @build_temp.setter
    def build_temp(self, value):
        self._build_temp = value

    def build_extension(self, ext):
        self._building.name = ext.name
        try:
            super().build_extension(ext)
        finally:
            self._building.name = None


TIERS, UNBUILDABLE = buildable(for_this_machine())
for t in UNBUILDABLE:
    print(f"setup.py: this compiler cannot build the {t.name} tier ({' '.join(t.flags)}); building the others",
          file=sys.stderr)
extensions = [op_library()] + [tier_library(t) for t in TIERS]
setup(
    name="tr_engine",
    version="0.1.0",
    description="Token Recycling: lossless speculative decoding with no draft model, with C++/CUDA kernels",
    packages=find_packages(include=["tr_engine", "tr_engine.*", "weights_tools", "weights_tools.*"]),
    package_data={"tr_engine": ["core/trees/*.json"]},  # the paper's tree (--tree 2.2.2, and the adaptive tree's shape)
    python_requires=">=3.10",
    ext_modules=[] if os.environ.get("TR_ENGINE_PREBUILT") == "1" else extensions,
    cmdclass={"build_ext": BuildExtension},
)
