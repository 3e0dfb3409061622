"""Cost of grouped statistics: the accumulate_groups op (one row per group of
slices along one dimension) against the accumulate op over the same tensor
(one row), timed round-robin in one process; the ratio is the target
(issue: grouped capture <= 1.3 x the ungrouped op).

Cases: a GPT-2 q/k/v projection's output [B, T, 768] per head (12 x 64 along
the last dim), per expert ([8 experts, tokens, hidden] along dim 0), and per
channel (768 groups of 1 along the last dim, the many-groups extreme).

  PYTHONPATH=. python benchmarks/bench_groups.py [--device cuda] [--tokens 2048] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from _machine import machine

from hookcap import Histogram, _layout, _ops
from hookcap.functional import new_state

CASES = {  # name: (shape from tokens, dim, group size)
    "heads 12 x 64": (lambda t: (t, 768), -1, 64),
    "experts 8": (lambda t: (8, t // 8, 768), 0, 1),
    "channels 768 x 1": (lambda t: (t, 768), -1, 1),
}


def round_robin(fns: dict, rounds: int, sync) -> dict:
    """Median ms per call of each of ``fns``, timed round-robin: ``rounds``
    rounds (after two not kept) of 5 calls each, ``sync()`` around them."""
    times = {k: [] for k in fns}
    for rnd in range(rounds + 2):
        for k, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(5):
                fn()
            sync()
            if rnd >= 2:
                times[k].append((time.perf_counter() - t0) / 5 * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def measure(dev: torch.device, tokens: int, rounds: int, say=print) -> list[dict]:
    """Median ms per call of the ungrouped and grouped op on each case's
    tensor, timed round-robin; ``say``: each table line."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    say("| case | dtype | histogram | groups | ungrouped | grouped | grouped / ungrouped |")
    say("|---|---|---|---:|---:|---:|---:|")
    rows_out = []
    for name, (shape_of, dim, size) in CASES.items():
        for dtype in (torch.float32, torch.bfloat16):
            for hname, h in (("none", None), ("log2", Histogram.log2())):
                x = torch.randn(*shape_of(tokens), device=dev).to(dtype)
                groups = x.shape[dim] // size
                width = _layout.HEADER + (h.nbins if h else 0)
                ring = torch.zeros(1, groups, width, dtype=torch.int64, device=dev)
                state = new_state(dev)
                rows = list(range(groups))
                fns = {"ungrouped": lambda: _ops.accumulate(x, ring, state, 0, h),
                       "grouped": lambda: _ops.accumulate_groups(x, ring, state, rows, dim, size, h)}
                med = round_robin(fns, rounds, sync)
                ratio = med["grouped"] / med["ungrouped"]
                say(f"| {name} | {str(dtype)[6:]} | {hname} | {groups} | {med['ungrouped']:.3f} ms | "
                    f"{med['grouped']:.3f} ms | {ratio:.2f} |")
                rows_out.append({"case": name, "dtype": str(dtype), "histogram": hname, "groups": groups,
                                 "shape": list(x.shape), "ms": med, "ratio": ratio})
    return rows_out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=8 * 1024)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    out = {"machine": machine(dev), "device": dev.type, "torch": torch.__version__}
    print(f"{out['machine']}, torch {torch.__version__}, {args.rounds} rounds, medians per call")
    out["cases"] = measure(dev, args.tokens, args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
