"""Cost of hookcap.SkipStep when nothing trips: bench_overhead's GPT-2 with a
fused AdamW, training steps with no telemetry, with a Monitor recording
outputs and gradients every step, the same plus SkipStep (loss tap,
gradient norm, learning rate), and SkipStep alone (a Monitor watching no
module), timed round-robin in one process (a new order each round, paired
by round). Prints ms per step and each configuration's overhead; the guard's
own cost is the difference of the two Monitor rows.

  PYTHONPATH=. python benchmarks/bench_skip.py [--device cuda] [--rounds 12] [--steps 6] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

import torch
from _machine import machine
from bench_overhead import gpt2_workload

import hookcap

CONFIGS = {  # name: Monitor kwargs (None: no Monitor)
    "no telemetry": None,
    "SkipStep alone": {"modules": "lm_head", "every": 10_000, "skip": True},  # records nothing
    "hookcap every=1": {},
    "hookcap every=1 + SkipStep": {"skip": True},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=6, help="steps per configuration and round (the first not kept)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    model, loss_fn = gpt2_workload(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    guards = {}

    def monitor(name, kw):
        kw = dict(kw)
        if kw.pop("skip", False):
            kw["skip"] = guards[name] = hookcap.SkipStep()
        return hookcap.Monitor(model, optimizer=opt, **kw)

    mons = {name: (monitor(name, kw) if kw is not None else None) for name, kw in CONFIGS.items()}

    def step():
        loss = loss_fn()
        hookcap.tap(loss, "loss")
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    by_round = {name: [] for name in CONFIGS}
    order = random.Random(0)
    for r in range(args.rounds + 2):
        for name in order.sample(list(CONFIGS), len(CONFIGS)):
            gc.collect()
            if mons[name] is not None:
                mons[name].attach()
            samples = []
            for _ in range(args.steps):
                sync()
                t0 = time.perf_counter()
                step()
                sync()
                samples.append(time.perf_counter() - t0)
            if mons[name] is not None:
                mons[name].detach()
            if r >= 2:
                by_round[name].append(statistics.median(samples[1:]))
    base = by_round["no telemetry"]
    rows = []
    print(f"{machine(dev)}, torch {torch.__version__}, GPT-2 (bench_overhead's), fused AdamW, {args.rounds} rounds")
    print("| configuration | ms / step | overhead |")
    print("|---|---:|---:|")
    for name, times in by_round.items():
        ratio = statistics.median(t / b for t, b in zip(times, base))
        rows.append({"config": name, "median_ms": statistics.median(times) * 1e3, "overhead_pct": 100 * (ratio - 1)})
        print(f"| {name} | {rows[-1]['median_ms']:.2f} | {rows[-1]['overhead_pct']:+.2f} % |")
    guard_pct = statistics.median((g - m) / b for g, m, b in zip(by_round["hookcap every=1 + SkipStep"],
                                                                   by_round["hookcap every=1"], base)) * 100
    print(f"SkipStep added to a recorded step: {guard_pct:+.2f} % of the step (target <= 0.5 %); "
          f"steps skipped: {[g.count for g in guards.values()]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(dev), "device": str(dev), "torch": torch.__version__, "rows": rows,
                       "skipstep_added_pct": guard_pct, "skipped": [g.count for g in guards.values()]}, f, indent=1)


if __name__ == "__main__":
    main()
