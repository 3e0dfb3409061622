"""Cost of recording the optimizer's update, Adam's ratio and state per
parameter, side by side in one process: GPT-2's parameters
(benchmarks/_gpt2.py; 148 tensors) stepped by AdamW (fused on CUDA, foreach on
the CPU), with

  step only        opt.step()
  hookcap          + Monitor(capture=KINDS) recording every step (default: update,
                     optim_state, adam_ratio): the fused op (norm, extrema, counts,
                     log2 histogram of Δw, w_before, g/(√v̂+ε), exp_avg and
                     exp_avg_sq), one pass, no copy, no host sync
  bare_norm        + torch._foreach_norm of the parameters after the step: one
                     read of each, the floor of any per-tensor statistic
  read_floor       + torch._foreach_norm of every tensor hookcap's pass reads
                     (update: w, exp_avg, exp_avg_sq; adam_ratio: also .grad;
                     optim_state: exp_avg, exp_avg_sq): the floor of its bytes
  foreach_norm     + the peers' cheapest way to one norm per tensor of the same
                     quantities: copy the parameters before the step
                     (torch._foreach_copy_ into buffers allocated once), then
                     torch._foreach_sub and torch._foreach_norm of Δw (update);
                     torch._foreach_norm of exp_avg and exp_avg_sq (optim_state);
                     the ratio made with foreach ops, then its torch._foreach_norm
                     (adam_ratio). Norms only.

Configurations are timed round-robin (drift hits them alike); medians per step.
Prints the time each adds over "step only" (the median of the rounds' paired
differences) and their ratios.

  PYTHONPATH=. python benchmarks/bench_update.py [--device cuda] [--layers N] [--histogram log2|none]
      [--capture update,optim_state,adam_ratio] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _gpt2 import GPT2Config, GPT2LMHeadModel  # noqa: E402
from _machine import machine  # noqa: E402

import hookcap  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=None, help="GPT-2 layers (default: 12 on CUDA, 2 on the CPU)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--histogram", choices=["log2", "none"], default="log2")
    ap.add_argument("--capture", default="update,optim_state,adam_ratio",
                    help="comma-separated kinds among update, optim_state, adam_ratio")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true",
                    help="then 5 steps of 'hookcap' under torch.profiler: where the time goes")
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
    kinds = tuple(k.strip() for k in args.capture.split(",") if k.strip())
    bad = set(kinds) - {"update", "optim_state", "adam_ratio"}
    if bad or not kinds:
        ap.error(f"--capture: kinds among update, optim_state, adam_ratio, got {args.capture!r}")
    mon = hookcap.Monitor(model, capture=kinds, optimizer=opt, detectors=[], histogram=hist)
    beta2 = opt.param_groups[0]["betas"][1]
    eps = opt.param_groups[0]["eps"]
    steps_taken = [0]  # the peer's own step count on the host (Adam's may be on the device)
    opt.register_step_post_hook(lambda *a: steps_taken.__setitem__(0, steps_taken[0] + 1))

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def step_only():
        opt.step()

    def step_hookcap():
        opt.step()  # the Monitor's step() follows as the optimizer's post-hook

    def step_bare_norm():
        opt.step()
        return torch._foreach_norm(params)  # one read of each parameter: the floor of any per-tensor statistic

    def read_set():
        states = [opt.state[p] for p in params]
        out = []
        if "update" in kinds or "adam_ratio" in kinds:
            out += params
        if "adam_ratio" in kinds:
            out += [p.grad for p in params]
        return out + [s["exp_avg"] for s in states] + [s["exp_avg_sq"] for s in states]

    def step_read_floor():
        opt.step()
        return torch._foreach_norm(read_set())  # each tensor the pass reads, read once

    def step_foreach_norm():
        if "update" in kinds:
            torch._foreach_copy_(copies, params)
        opt.step()
        norms = []
        if "update" in kinds:
            norms += torch._foreach_norm(torch._foreach_sub(params, copies))
        states = [opt.state[p] for p in params]
        if "optim_state" in kinds:
            norms += torch._foreach_norm([s["exp_avg"] for s in states])
            norms += torch._foreach_norm([s["exp_avg_sq"] for s in states])
        if "adam_ratio" in kinds:
            t = steps_taken[0]
            denom = torch._foreach_sqrt([s["exp_avg_sq"] for s in states])
            torch._foreach_div_(denom, (1 - beta2 ** t) ** 0.5)
            torch._foreach_add_(denom, eps)
            norms += torch._foreach_norm(torch._foreach_div([p.grad for p in params], denom))
        return norms

    configs = {"step only": step_only, "hookcap": step_hookcap, "bare_norm": step_bare_norm,
               "read_floor": step_read_floor, "foreach_norm": step_foreach_norm}
    times = {k: [] for k in configs}
    steps_per_round = 5
    for rnd in range(args.rounds + 2):
        for name, fn in configs.items():
            if name == "hookcap":
                mon.attach()
            sync()
            t = time.perf_counter()
            for _ in range(steps_per_round):
                fn()
            sync()
            dt = (time.perf_counter() - t) / steps_per_round * 1e3
            if name == "hookcap":
                mon.detach()
            if rnd >= 2:  # warm-up rounds
                times[name].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    # Added time: the median over rounds of each round's difference from the
    # same round's "step only" (pairs share the machine's state of the moment).
    added = {k: statistics.median(t - b for t, b in zip(times[k], times["step only"]))
             for k in configs if k != "step only"}
    n_params = sum(p.numel() for p in params)
    machine_name = machine(dev)
    print(f"GPT-2 {layers} layers, {len(params)} parameter tensors, {n_params / 1e6:.1f} M values, "
          f"{params[0].dtype}, AdamW {'fused' if 'fused' in kw else 'foreach'}, {dev.type} ({machine_name}), "
          f"{args.rounds} rounds x {steps_per_round} steps, histogram {args.histogram}, capture {','.join(kinds)}")
    print("| config | ms per step | added over step only |")
    print("|---|---:|---:|")
    for k in configs:
        print(f"| {k} | {med[k]:.3f} | {'-' if k == 'step only' else f'{added[k]:+.3f} ms'} |")
    ratio = added["hookcap"] / added["foreach_norm"] if added["foreach_norm"] > 0 else float("nan")
    bare = added["hookcap"] / added["bare_norm"] if added["bare_norm"] > 0 else float("nan")
    floor = added["hookcap"] / added["read_floor"] if added["read_floor"] > 0 else float("nan")
    floor_bare = added["read_floor"] / added["bare_norm"] if added["bare_norm"] > 0 else float("nan")
    print(f"hookcap adds {bare:.2f} x what bare_norm adds (one torch._foreach_norm of the parameters)")
    print(f"hookcap adds {floor:.2f} x what read_floor adds (one norm of each tensor it reads: "
          f"{len(read_set())} tensors, {floor_bare:.2f} x bare_norm)")
    print(f"hookcap adds {ratio:.2f} x what foreach_norm adds (copy + sub + norms of the same kinds: norms only)")
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
            json.dump({"device": dev.type, "histogram": args.histogram, "capture": list(kinds), "machine": machine_name,
                       "layers": layers,
                       "tensors": len(params),
                       "values": n_params, "median_ms": med, "added_ms": added, "ratio": ratio,
                       "ratio_bare_norm": bare, "ratio_read_floor": floor,
                       "read_floor_over_bare_norm": floor_bare,
                       "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
