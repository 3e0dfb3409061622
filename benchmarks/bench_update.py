"""Cost of recording the optimizer's update per parameter, side by side in one
process: GPT-2's parameters (benchmarks/_gpt2.py; 148 tensors) stepped by
AdamW (fused on CUDA, foreach on the CPU), with

  step only        opt.step()
  hookcap update   + Monitor(capture="update") recording every step: the fused op
                     (norm, extrema, counts, log2 histogram of Δw and of w_before),
                     no copy, no host sync
  foreach_norm     + what a peer does: copy the parameters before the step
                     (torch._foreach_copy_ into buffers allocated once), then
                     torch._foreach_sub and torch._foreach_norm after it (norms only)

Configurations are timed round-robin (drift hits them alike); medians per step.
Prints the time each adds over "step only" and their ratio.

  PYTHONPATH=. python benchmarks/bench_update.py [--device cuda] [--layers N] [--histogram log2|none]
      [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _gpt2 import GPT2Config, GPT2LMHeadModel  # noqa: E402

import hookcap  # noqa: E402


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} CPUs"
    except OSError:
        pass
    return platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=None, help="GPT-2 layers (default: 12 on CUDA, 2 on the CPU)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--histogram", choices=["log2", "none"], default="log2")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true",
                    help="then 5 steps of 'hookcap update' under torch.profiler: where the time goes")
    args = ap.parse_args()
    dev = torch.device(args.device)
    layers = args.layers or (12 if dev.type == "cuda" else 2)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=layers)).to(dev)
    params = [p for p in model.parameters()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    kw = {"fused": True} if dev.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, **kw)
    copies = [torch.empty_like(p) for p in params]
    hist = hookcap.Histogram.log2() if args.histogram == "log2" else None
    mon = hookcap.Monitor(model, capture="update", optimizer=opt, detectors=[], histogram=hist)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def step_only():
        opt.step()

    def step_hookcap():
        opt.step()  # the Monitor's step() follows as the optimizer's post-hook

    def step_foreach_norm():
        torch._foreach_copy_(copies, params)
        opt.step()
        diffs = torch._foreach_sub(params, copies)
        return torch._foreach_norm(diffs)

    configs = {"step only": step_only, "hookcap update": step_hookcap, "foreach_norm": step_foreach_norm}
    times = {k: [] for k in configs}
    steps_per_round = 5
    for rnd in range(args.rounds + 2):
        for name, fn in configs.items():
            if name == "hookcap update":
                mon.attach()
            sync()
            t = time.perf_counter()
            for _ in range(steps_per_round):
                fn()
            sync()
            dt = (time.perf_counter() - t) / steps_per_round * 1e3
            if name == "hookcap update":
                mon.detach()
            if rnd >= 2:  # warm-up rounds
                times[name].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["step only"]
    added = {k: med[k] - base for k in configs if k != "step only"}
    n_params = sum(p.numel() for p in params)
    machine = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_name()
    print(f"GPT-2 {layers} layers, {len(params)} parameter tensors, {n_params / 1e6:.1f} M values, "
          f"{params[0].dtype}, AdamW {'fused' if 'fused' in kw else 'foreach'}, {dev.type} ({machine}), "
          f"{args.rounds} rounds x {steps_per_round} steps, histogram {args.histogram}")
    print("| config | ms per step | added over step only |")
    print("|---|---:|---:|")
    for k in configs:
        print(f"| {k} | {med[k]:.3f} | {'-' if k == 'step only' else f'{added[k]:+.3f} ms'} |")
    ratio = added["hookcap update"] / added["foreach_norm"] if added["foreach_norm"] > 0 else float("nan")
    print(f"hookcap update adds {ratio:.2f} x what foreach_norm adds (which gives norms only)")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        mon.attach()
        with profile(activities=acts) as prof:
            for _ in range(5):
                step_hookcap()
            sync()
        mon.detach()
        key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=12))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev.type, "histogram": args.histogram, "machine": machine, "layers": layers,
                       "tensors": len(params),
                       "values": n_params, "median_ms": med, "added_ms": added, "ratio": ratio,
                       "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
