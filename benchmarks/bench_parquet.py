"""Cost of ``hookcap.sinks.Parquet.write`` per step at thousands of metrics.

One real recorded step of a chain of ``--metrics / 2`` small Linear layers
(capture ``output`` and ``grad_output``, log2 histograms, CPU) is taken as a
``DrainedStep``; the sink then writes it ``--steps`` times (step numbers
0, 1, …, float stats perturbed each time) with ``row_group_steps=--group``. Reported, in µs per metric:

- ``buffer``: the median ``write()`` that only buffers the step (numpy, no I/O);
- ``group``: the median ``write()`` that also writes a part file (columns
  concatenated, Arrow table, Parquet encode + compress, fsync, rename);
- ``per step``: all ``write()`` time over all steps (the group writes amortised);

and the bytes on disk per metric-step.

Usage: ``PYTHONPATH=. python benchmarks/bench_parquet.py [--metrics 3000] [--steps 256] [--group 64]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--metrics", type=int, default=3000)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--json", default=None, help="write the results to this file")
    args = ap.parse_args()

    import numpy as np
    import torch
    from torch import nn

    import hookcap
    from hookcap.sinks._base import COUNT_STATS

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(max(1, args.metrics // 2))])
    got = []
    with hookcap.Monitor(model, capture=("output", "grad_output"), histogram=hookcap.Histogram.log2(),
                         sinks=[hookcap.sinks.Callback(got.append)]) as mon:
        model(torch.randn(2, 8)).sum().backward()
        mon.step()
    d = got[0]
    m = len(d)
    off, band = d.histogram_band()
    base, rng = dict(d.stats), np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.parquet")
        sink = hookcap.sinks.Parquet(path, row_group_steps=args.group)
        buffer, group = [], []
        t_all = time.perf_counter()
        for i in range(args.steps):
            d.step = i
            # New float values every step (outside the timing), as in training:
            # repeated values would make the files unrealistically small.
            d.stats = {k: v if k in COUNT_STATS else v * (1 + 1e-6 * rng.standard_normal(m))
                       for k, v in base.items()}
            t0 = time.perf_counter()
            sink.write(d)
            dt = time.perf_counter() - t0
            (group if (i + 1) % args.group == 0 else buffer).append(dt)
        t_all = time.perf_counter() - t_all
        sink.close()
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        t0 = time.perf_counter()
        h = hookcap.load(path)
        t_load = time.perf_counter() - t0
        assert len(h) == args.steps and len(h.names) == m
    us = lambda s: 1e6 * s / m  # noqa: E731
    res = {
        "metrics": m, "steps": args.steps, "row_group_steps": args.group,
        "step_band_bins": int(band.shape[1]),
        "buffer_us_per_metric": us(statistics.median(buffer)),
        "group_us_per_metric": us(statistics.median(group)) if group else None,
        "per_step_us_per_metric": us(t_all / args.steps),
        "bytes_per_metric_step": size / (m * args.steps),
        "load_s": t_load,
        "load1": os.getloadavg()[0],
        "cpus": os.cpu_count(), "torch": torch.__version__,
        "pyarrow": __import__("pyarrow").__version__,
    }
    print(f"{m} metrics, {args.steps} steps, row_group_steps={args.group}, step band {band.shape[1]} bins "
          f"(of {d.histogram_spec.nbins})")
    print(f"write(), buffering only : {res['buffer_us_per_metric']:.3f} us/metric (median)")
    if group:
        print(f"write() + part file     : {res['group_us_per_metric']:.3f} us/metric (median)")
    print(f"all write() / steps     : {res['per_step_us_per_metric']:.3f} us/metric per step")
    print(f"on disk                 : {res['bytes_per_metric_step']:.1f} bytes per metric-step")
    print(f"hookcap.load            : {t_load:.2f} s   (load average {res['load1']:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
