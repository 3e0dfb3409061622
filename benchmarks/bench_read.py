"""Memory of reading a long run: Monitor.history(), one statistic, one histogram.

  python benchmarks/bench_read.py [--metrics 2000] [--steps 1024] [--json PATH]

A model of M/2 Linear(4, 4) layers, each recording its output and output
gradient (M metrics, default log2 histogram), trained for S steps; then, in
this order: ``mon.history()``, ``h["l2norm"]``, ``h.histogram(one name)``, and
for contrast ``h.to_pandas()``-free full decode of every statistic. Each is
measured by the bytes it allocates at its peak (tracemalloc, which sees numpy's
buffers) and the process's resident-set growth, against the host store's
bytes. Targets (issue: reading is lazy): history() <= 1.5x the store's bytes,
h.histogram(name) <= 5 MiB, h["l2norm"] <= 20 MiB.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import time
import tracemalloc

import torch

import hookcap

MiB = 2**20


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(label, fn, out):
    gc.collect()
    r0 = rss()
    tracemalloc.start()
    t = time.perf_counter()
    value = fn()
    dt = time.perf_counter() - t
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    out[label] = {"peak_mib": peak / MiB, "rss_growth_mib": (rss() - r0) / MiB, "seconds": dt}
    print(f"{label:<34} peak {peak / MiB:8.1f} MiB   RSS +{(rss() - r0) / MiB:7.1f} MiB   {dt * 1e3:8.1f} ms",
          flush=True)
    return value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--metrics", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=1024)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(a.metrics // 2)])
    mon = hookcap.Monitor(model, capture=("output", "grad_output")).attach()
    x = torch.randn(2, 4)
    t = time.perf_counter()
    for _ in range(a.steps):
        model(x).sum().backward()
        mon.step()
    mon.detach()
    print(f"recorded {a.metrics} metrics x {a.steps} steps in {time.perf_counter() - t:.1f} s; "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}")
    store = mon._consumers.store.nbytes
    print(f"host store: {store / MiB:.1f} MiB")
    res = {"metrics": a.metrics, "steps": a.steps, "store_mib": store / MiB}
    h = measure("history()", mon.history, res)
    name = h.names[len(h.names) // 2]
    measure('h["l2norm"]', lambda: h["l2norm"], res)
    measure("h.histogram(name)", lambda: h.histogram(name), res)
    measure("every statistic (all decoded)", lambda: [h[s] for s in h.stat_names], res)
    res["targets"] = {
        "history() peak <= 1.5x store": res["history()"]["peak_mib"] <= 1.5 * res["store_mib"],
        "histogram(name) peak <= 5 MiB": res["h.histogram(name)"]["peak_mib"] <= 5,
        'h["l2norm"] peak <= 20 MiB': res['h["l2norm"]']["peak_mib"] <= 20,
    }
    for k, v in res["targets"].items():
        print(f"  {k}: {'met' if v else 'NOT met'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
