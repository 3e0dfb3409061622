"""A long run with a bounded host history and the full history on disk.

A chain of ``nn.Linear(8, 8)`` layers (capture ``input``, ``output``,
``grad_input``, ``grad_output``: four metrics per layer, log2 histograms, CPU,
one thread) trains ``--steps``
steps with ``capacity=--capacity`` and a ``hookcap.sinks.Parquet`` sink.
Prints the process RSS every ``--report`` steps, then checks that the Parquet
dataset holds every step with every metric (none lost) and that its last
steps equal the in-memory history's, bit for bit.

Usage: ``PYTHONPATH=. python benchmarks/bench_soak.py [--steps 100000] [--metrics 500]``
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def soak(steps: int, metrics: int, capacity: str, row_group_steps: int, folder: str, report: int = 0) -> dict:
    """Run the soak in this process; returns its measurements (see module doc)."""
    import numpy as np
    import torch
    from torch import nn

    import hookcap

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(max(1, metrics // 4))])
    x = torch.randn(4, 8, requires_grad=True)  # so the first layer has a grad_input too
    path = os.path.join(folder, "soak.parquet")
    sink = hookcap.sinks.Parquet(path, row_group_steps=row_group_steps)
    mon = hookcap.Monitor(model, capture=("input", "output", "grad_input", "grad_output"), capacity=capacity,
                          sinks=[sink]).attach()
    rss, step_s = [], []
    t_start = time.perf_counter()
    for i in range(steps):
        model(x * (1.0 + (i % 7) / 7)).sum().backward()
        t0 = time.perf_counter()
        mon.step()
        step_s.append(time.perf_counter() - t0)
        if i + 1 == max(1, steps // 10) or (i + 1) % max(1, steps // 10) == 0:
            rss.append((i + 1, rss_mb()))
            if report:
                print(f"step {i + 1:>7}: RSS {rss[-1][1]:.1f} MB, history {mon.history_bytes / 2**20:.2f} MB, "
                      f"{len(mon._consumers.store)} steps kept, {mon.evicted_steps} evicted", flush=True)
    wall = time.perf_counter() - t_start
    h = mon.history()
    mon.detach()  # closes the sink: the last group is written
    import pyarrow.dataset as ds

    # Streamed, one batch at a time: the dataset of a long run does not fit in memory.
    dataset = ds.dataset(path, format="parquet")
    per_step = np.zeros(steps, dtype=np.int64)
    for batch in dataset.to_batches(columns=["step"]):
        per_step += np.bincount(batch.column("step").to_numpy(), minlength=steps)[:steps]
    file_steps = np.flatnonzero(per_step)
    # The steps the history still holds, read back with a filter on step.
    tail = dataset.to_table(columns=["step", "name", "l2norm"], filter=ds.field("step") >= int(h.steps[0]))
    col = {n: j for j, n in enumerate(h.names)}
    disk = np.full((len(h), len(h.names)), np.nan)
    rows_of_step = np.searchsorted(h.steps, tail.column("step").to_numpy())
    cols = np.array([col[n] for n in tail.column("name").to_pylist()])
    disk[rows_of_step, cols] = tail.column("l2norm").to_numpy()
    same = bool(np.array_equal(disk, h["l2norm"], equal_nan=True)
                and np.array_equal(np.unique(tail.column("step").to_numpy()), h.steps))
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    step_s = np.asarray(step_s[min(50, steps // 2):])
    return {
        "steps": steps, "metrics": len(h.names), "capacity": capacity, "row_group_steps": row_group_steps,
        "rss_mb": rss, "rss_growth_mb": rss[-1][1] - rss[0][1],
        "history_mb": mon.history_bytes / 2**20, "kept_steps": len(h), "evicted_steps": mon.evicted_steps,
        "file_steps": int(len(file_steps)), "every_step_complete": bool((per_step == len(h.names)).all()),
        "last_steps_equal_history": same, "parquet_mb": size / 2**20,
        "step_us_per_metric_median": float(np.median(step_s)) * 1e6 / len(h.names),
        "step_us_per_metric_mean": float(step_s.mean()) * 1e6 / len(h.names),
        "wall_s": wall,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--metrics", type=int, default=500)
    p.add_argument("--capacity", default="64MiB")
    p.add_argument("--row-group-steps", type=int, default=256)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        r = soak(args.steps, args.metrics, args.capacity, args.row_group_steps, d, report=1)
    print(json.dumps({k: v for k, v in r.items() if k != "rss_mb"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
