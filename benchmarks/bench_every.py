"""Where the cost of ``Monitor(every=N)`` goes, step by step.

``bench_overhead.py`` times whole configurations a few steps at a time; on a
noisy machine its ``every=10`` reading scatters by a point or more between
runs. This script interleaves at the finest grain instead: every Monitor step
is followed by one baseline step (the same model, no hookcap work: the
Monitor's hooks are parked, or detached before a recorded step), so both see
the same machine state. It splits each Monitor step into its training part
(forward, backward, optimizer) and ``mon.step()``, for off-steps and recorded
steps separately, and prints medians as % of the baseline step.

Usage:
  python benchmarks/bench_every.py [--workload cnn|gpt2] [--every 10] [--cycles 30] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import hookcap
from bench_kernel import machine_info
from bench_overhead import WORKLOADS


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="cnn", choices=sorted(WORKLOADS))
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--cycles", type=int, default=30, help="measured cycles of `every` steps")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, loss_fn = WORKLOADS[args.workload](torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mon = hookcap.Monitor(model, capture=("output", "grad_output"), every=args.every).attach()

    def train():
        loss_fn().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2 * args.every):  # warm-up: rows, caches, allocator
        train()
        mon.step()
    t = {k: [] for k in ("base", "off train", "off step()", "rec train", "rec step()")}
    for _ in range(args.cycles * args.every):
        kind = "rec" if mon.current_step % args.every == 0 else "off"
        t0 = time.perf_counter()
        train()
        t1 = time.perf_counter()
        mon.step()
        t2 = time.perf_counter()
        t[f"{kind} train"].append(t1 - t0)
        t[f"{kind} step()"].append(t2 - t1)
        records_next = mon.current_step % args.every == 0
        if records_next:  # hooks are in place for the next step: take them out
            mon.detach()
        t0 = time.perf_counter()
        train()
        t["base"].append(time.perf_counter() - t0)
        if records_next:
            mon.attach()
    mon.detach()
    base = statistics.median(t["base"])
    print(f"# {args.workload}, every={args.every}, {args.cycles} cycles, {args.threads} threads, "
          f"torch {torch.__version__}")
    print(f"{'part':12s} {'median ms':>10s} {'% of base':>10s} {'samples':>8s}")
    for k, v in t.items():
        m = statistics.median(v)
        print(f"{k:12s} {m * 1e3:10.3f} {100 * m / base:10.2f} {len(v):8d}")
    off = statistics.median(t["off train"]) + statistics.median(t["off step()"])
    rec = statistics.median(t["rec train"]) + statistics.median(t["rec step()"])
    n = args.every
    summary = {"off_step_pct": 100 * (off / base - 1), "recorded_step_pct": 100 * (rec / base - 1),
               "cycle_mean_pct": 100 * (((n - 1) * off + rec) / n / base - 1)}
    print(f"off-step overhead {summary['off_step_pct']:+.2f} %, recorded step "
          f"{summary['recorded_step_pct']:+.2f} %, mean over a cycle {summary['cycle_mean_pct']:+.2f} %")
    if args.json:
        result = {"machine": {**machine_info("cpu"), "threads": args.threads},
                  "workload": args.workload, "every": n, "cycles": args.cycles,
                  "median_ms": {k: statistics.median(v) * 1e3 for k, v in t.items()},
                  "samples": {k: len(v) for k, v in t.items()}, **summary}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
