"""Build metadata and the torch-version guard, run before the extension loads."""

from __future__ import annotations

import json
import os

import torch

_META_PATH = os.path.join(os.path.dirname(__file__), "_build_meta.json")


def _read_meta() -> dict:
    try:
        with open(_META_PATH) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ImportError(
            "hookcap: the compiled extension was not built (no _build_meta.json). Install with "
            "`pip install --no-build-isolation -e .` or run `python setup.py build_ext --inplace`."
        ) from None


def check_and_load() -> dict:
    meta = _read_meta()
    built = meta.get("torch_version")
    if built != torch.__version__:
        raise ImportError(
            f"hookcap was built for torch {built} but torch {torch.__version__} is installed; "
            "rebuild hookcap (pip install --no-build-isolation -e .) against the installed torch."
        )
    from . import _C  # noqa: F401  (registers the torch.ops.hookcap ops)

    return meta


def build_info() -> dict:
    """What the installed extension was built with: ``torch_version``,
    ``torch_cuda``, ``cuda`` (True if CUDA kernels were compiled), ``cuda_reason``,
    ``cuda_home``, ``arch_list`` (the GPU archs compiled for, ``+PTX``: also as PTX the
    driver compiles for newer GPUs), ``cxx_flags``, ``nvcc_flags``, ``cxx_abi``,
    ``build_seconds`` (wall seconds the extension's build took) and ``build_jobs`` (its
    parallel compile jobs), plus ``cpu_isa`` (the CPU loop selected at run time)."""
    meta = dict(_read_meta())
    meta["cpu_isa"] = _cpu_isa()
    return meta


def _cpu_isa() -> str:
    if os.environ.get("HOOKCAP_CPU_ISA") == "baseline":
        return "baseline"
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
        # The AVX2 loop also converts fp16 with F16C (present on every AVX2 CPU).
        ok = all(f" {f}" in flags for f in ("avx2", "fma", "f16c"))
        return "avx2+fma" if ok else "baseline"
    except OSError:
        return "unknown"
