"""Where a training step's device time goes, kernel by kernel (torch.profiler).

gpu_check's compiled step profiles each configuration with :func:`profile_steps`
so that one GPU run says which kernels an overhead is made of: hookcap's own
(the accumulate op), Inductor's Triton kernels, and the model's matmuls and
attention.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

# First match wins: hookcap's kernels and ops are named in its namespace.
CATEGORIES = (("hookcap", ("hookcap",)),
              ("attention", ("flash", "fmha", "attention")),
              ("matmul", ("gemm", "cutlass", "xmma", "cublas", "nvjet", "aten::mm", "aten::addmm", "aten::bmm")),
              ("triton", ("triton_",)))


def category(name: str) -> str:
    """The CATEGORIES entry a kernel (or, on the CPU, an op) of this name belongs to, else "other"."""
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def profile_steps(steps: dict, device: torch.device, n: int = 2, top: int = 12) -> dict:
    """For each ``name: step`` (a callable running one training step), the
    device time of ``n`` steps after one unprofiled step, per step: the total
    (ms), by category ({category: {"ms", "calls"}}) and the ``top`` kernels.
    On CUDA the times are the kernels' own (CUDA activity); on the CPU, the
    ops' self CPU time (only to exercise the code without a GPU)."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out = {}
    for name, step in steps.items():
        step()
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            for _ in range(n):
                step()
            if cuda:
                torch.cuda.synchronize()
        kernels = []
        for e in prof.key_averages():
            if cuda:
                if "CUDA" not in str(getattr(e, "device_type", "")):
                    continue
                us = getattr(e, "self_device_time_total", 0.0)
            else:
                us = e.self_cpu_time_total
            if us > 0:
                kernels.append((e.key, us / n, e.count / n))
        kernels.sort(key=lambda k: -k[1])
        by_category: dict = {}
        for key, us, calls in kernels:
            c = by_category.setdefault(category(key), {"ms": 0.0, "calls": 0.0})
            c["ms"] += us / 1e3
            c["calls"] += calls
        out[name] = {"steps": n, "ms_per_step": sum(k[1] for k in kernels) / 1e3, "by_category": by_category,
                     "top": [{"kernel": key[:120], "ms": us / 1e3, "calls": calls} for key, us, calls in kernels[:top]]}
    return out


def summary_lines(profiles: dict) -> list[str]:
    """A Markdown table of :func:`profile_steps`' result: ms per step (launches) by category."""
    cats = [c for c, _ in CATEGORIES] + ["other"]
    lines = ["| config | total ms | " + " | ".join(cats) + " |", "|---|---:|" + "---:|" * len(cats)]
    for name, p in profiles.items():
        cells = []
        for c in cats:
            v = p["by_category"].get(c)
            cells.append(f"{v['ms']:.2f} ({v['calls']:.0f})" if v else "-")
        lines.append(f"| {name} | {p['ms_per_step']:.2f} | " + " | ".join(cells) + " |")
    return lines
