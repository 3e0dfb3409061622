"""How hookcap's host side scales with the number of metrics.

For each metric count (a chain of small Linear layers, capture ``output`` and
``grad_output``, log2 histograms, CPU) one child process trains ``--steps``
recorded steps (forward, backward, an SGD step, then ``Monitor.step()``) and reports:

- ``step()`` µs per metric (median over the recorded steps, after warm-up); and, on every
  other step, the same with the heap settled first: glibc folds the small blocks the training
  step freed into its free lists at the first large allocation after them, whoever makes it
  (up to 0.3 ms for 1,600 layers here), and that allocation may be step()'s;
- host bytes per metric per recorded step held by the history store;
- ``history()`` and ``dump()`` time, and the process's peak RSS growth during ``dump()``;
- the cost of a ``hookcap.sinks.Parquet`` sink per metric per step (mean step() with the sink
  minus mean step() without, part-file writes included).

Usage: ``PYTHONPATH=. python benchmarks/bench_scale.py [--metrics 200,800,2000,3200,5000] [--steps 1024]``
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time


def _heap_settler():
    """glibc only: a call that makes malloc fold the small blocks the training
    step freed (its fastbins) now, as the first large allocation after the
    training step would anyway, whoever makes it; None elsewhere."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc.restype = ctypes.c_void_p
        libc.free.argtypes = [ctypes.c_void_p]
    except (OSError, AttributeError):
        return None

    def settle():
        libc.free(libc.malloc(1 << 17))

    return settle


def child(metrics: int, steps: int) -> dict:
    import numpy as np
    import torch
    from torch import nn

    import hookcap

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = max(1, metrics // 2)  # output + grad_output per layer
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])
    x = torch.randn(2, 8)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)  # tiny: 1,600 layers stay finite

    settle = _heap_settler()

    def run(mon, n, settled=None):
        times = []
        for i in range(n + 8):
            model(x * (1 + i % 5)).sum().backward()
            opt.step()
            opt.zero_grad()
            settling = settled is not None and settle is not None and i % 2 == 1
            if settling:
                settle()
            t0 = time.perf_counter()
            mon.step()
            if i >= 8:
                (settled if settling else times).append(time.perf_counter() - t0)
        return np.asarray(times)

    mon = hookcap.Monitor(model, capture=("output", "grad_output"), capacity=steps).attach()
    settled = []
    times = run(mon, steps, settled)
    t0 = time.perf_counter()
    h = mon.history()
    t_hist = time.perf_counter() - t0
    store = mon._consumers.store
    cells = sum(len(p.metrics) for p in store.steps)
    with tempfile.TemporaryDirectory() as d:
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        path = mon.dump(os.path.join(d, "run.npz"))
        t_dump = time.perf_counter() - t0
        rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        size = os.path.getsize(path)
        mon.detach()
        # The same run with a Parquet sink (part files of 64 steps): its cost
        # per step is the mean step() difference, part-file writes included.
        n_pq = min(steps, 256)
        pq = hookcap.Monitor(model, capture=("output", "grad_output"), capacity=steps,
                             sinks=[hookcap.sinks.Parquet(os.path.join(d, "run.parquet"))]).attach()
        with_sink = run(pq, n_pq)
        pq.detach()
        plain = hookcap.Monitor(model, capture=("output", "grad_output"), capacity=steps).attach()
        without = run(plain, n_pq)
        plain.detach()
    M = len(h.names)
    return {"metrics": M, "steps": len(h), "step_us_per_metric": float(np.median(times)) * 1e6 / M,
            "step_us_per_metric_heap_settled": (float(np.median(settled)) * 1e6 / M) if settled else None,
            "bytes_per_metric_step": store.nbytes / max(cells, 1), "store_mb": store.nbytes / 2**20,
            "history_s": t_hist, "dump_s": t_dump, "dump_peak_rss_growth_mb": (rss1 - rss0) / 1024,
            "file_mb": size / 2**20,
            "parquet_us_per_metric_step": float(with_sink.mean() - without.mean()) * 1e6 / M}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--metrics", default="200,800,2000,3200,5000")
    p.add_argument("--steps", type=int, default=1024)
    p.add_argument("--json", default=None)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child, args.steps)))
        return
    rows = []
    for m in [int(v) for v in args.metrics.split(",") if v]:
        out = subprocess.run([sys.executable, __file__, "--child", str(m), "--steps", str(args.steps)],
                             capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"# {args.steps} recorded steps, capture output+grad_output, log2 histograms, CPU, 1 thread")
    print(f"{'metrics':>8} {'step() us/metric':>17} {'heap settled':>13} {'B/metric-step':>14} {'store MB':>9} "
          f"{'history() s':>12} {'dump() s':>9} {'dump RSS +MB':>13} {'file MB':>8} {'Parquet us/metric':>18}")
    for r in rows:
        settled = r["step_us_per_metric_heap_settled"]
        print(f"{r['metrics']:>8} {r['step_us_per_metric']:>17.2f} "
              f"{'n/a' if settled is None else f'{settled:.2f}':>13} {r['bytes_per_metric_step']:>14.0f} "
              f"{r['store_mb']:>9.1f} {r['history_s']:>12.2f} {r['dump_s']:>9.2f} "
              f"{r['dump_peak_rss_growth_mb']:>13.0f} {r['file_mb']:>8.1f} {r['parquet_us_per_metric_step']:>18.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
