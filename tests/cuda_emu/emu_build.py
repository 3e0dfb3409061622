"""Build the CUDA emulation harness (emu_ops.cpp: the real kernels executed on
the CPU) as a Python module; shared by tests/test_cuda_emu.py and
benchmarks/bench_sass.py. Built once into tests/cuda_emu/build/py (ninja keeps it)."""

from __future__ import annotations

import os
from pathlib import Path

EMU = Path(__file__).resolve().parent
ROOT = EMU.parents[1]
BUILD = EMU / "build"  # ignored by git (build/)
CXX = os.environ.get("CXX", "c++")
# Same FP contract as the real builds (no FMA contraction: linear bin edges).
CFLAGS = ["-O1", "-std=c++20", "-ffp-contract=off", "-fno-strict-aliasing", "-Wno-unknown-pragmas"]


def load():
    """The harness module (needs a C++20 compiler and torch's headers)."""
    import torch.utils.cpp_extension as cpp_ext

    BUILD.joinpath("py").mkdir(parents=True, exist_ok=True)
    return cpp_ext.load(
        name="hookcap_cuda_emu",
        sources=[str(EMU / "emu_ops.cpp")],
        extra_include_paths=[str(ROOT / "csrc"), str(EMU)],
        extra_cflags=CFLAGS,
        build_directory=str(BUILD / "py"),
        verbose=False,
    )
