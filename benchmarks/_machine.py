"""The machine a benchmark ran on, for its printed table and raw JSON: the
GPU's name on CUDA, else the CPU model and how many CPUs the process sees."""

from __future__ import annotations

import os
import platform

import torch


def machine(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.machine()
    return f"{name}, {os.cpu_count()} CPUs"
