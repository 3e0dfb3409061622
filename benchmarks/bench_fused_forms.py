"""What the statistics cost as graph reductions on the CPU (torch.compile, Inductor's C++
backend), against hookcap's accumulate op on the same tensor, and the histogram as graph ops.

One compiled elementwise producer, relu(x * 1.5) over 524,288 float32 values (a 2 MiB tensor,
the size of a TinyResNet activation), alone ("producer") and with its statistics computed in
the same graph in several forms; the op's row times the producer followed by the accumulate
op. Medians of 40 calls, 5 interleaved rounds; "added" is over the producer alone.

  fused=True      the form hookcap uses (hookcap._capture.fused.partials: float64 sums, int32 counts,
                  finite-only extrema; 9 values)
  isnan int64     the same statistics with torch.isnan / torch.isfinite and int64 counts
  float32         the same in float32 (counts exact only below 2**24 values)
  lean float32    zeros count, sum, sum of squares, min, max: no NaN/Inf handling (not exact
                  with non-finite values; a lower bound for any exact form)
  hist scatter    a 64-bin log2 histogram: frexp exponent, scatter_add into 64 counters
  hist one-hot    the same by comparing each value's bin with every bin

--device cuda: the same forms as Triton kernels on 2**26 values (CUDA events), the op's CUDA
kernel; gpu_check.py's compiled step runs it.

Usage: python benchmarks/bench_fused_forms.py [--threads 2] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench_kernel import machine_info
from hookcap import Histogram, _layout, _ops
from hookcap._capture.fused import partials

N = 8 * 16 * 64 * 64
LO, NB = -40, 64


def producer(x):
    return torch.relu(x * 1.5)


def fused(x, k):
    y = producer(x)
    return y, partials(y, k)


def float32(x, k):
    y = producer(x)
    fin = y.abs() < float("inf")
    d = torch.where(fin, y - k.float(), 0.0)

    def c(m):
        return m.to(torch.float32).sum()

    finite, pinf, ninf = c(fin), c(y == float("inf")), c(y == -float("inf"))
    return y, torch.stack([y.numel() - finite - pinf - ninf, pinf, ninf, c(y == 0), finite,
                           d.sum(), (d * d).sum(), torch.where(fin, y, float("inf")).amin(),
                           torch.where(fin, y, -float("inf")).amax()])


def isnan_int64(x, k):
    y = producer(x)
    fin = torch.isfinite(y)
    d = torch.where(fin, y.double() - k, 0.0)

    def c(m):
        return m.to(torch.int64).sum().double()

    return y, torch.stack([c(torch.isnan(y)), c(y == float("inf")), c(y == -float("inf")), c(y == 0), c(fin),
                           d.sum(), (d * d).sum(), torch.where(fin, y, float("inf")).amin().double(),
                           torch.where(fin, y, -float("inf")).amax().double()])


def lean(x, k):
    y = producer(x)
    d = y - k.float()
    return y, torch.stack([(y == 0).to(torch.float32).sum(), d.sum(), (d * d).sum(), y.amin(), y.amax()])


def bins(y):
    _, e = torch.frexp(y)
    return torch.where(y == 0, 0, (e - LO).clamp(1, NB - 1))


def hist_scatter(x, k):
    y = producer(x)
    b = bins(y).reshape(-1).to(torch.int64)
    return y, torch.zeros(NB, dtype=torch.int64, device=y.device).scatter_add(0, b, torch.ones_like(b))


def hist_onehot(x, k):
    y = producer(x)
    return y, (bins(y).reshape(-1, 1) == torch.arange(NB, device=y.device)).sum(0)


def measure_forms(device: str = "cpu", n: int = N, calls: int = 40, rounds: int = 5) -> list:
    """Rows {form, us, added_us, added_vs_op}: median time per call of each form,
    what it adds to the producer alone, and that over what the op adds."""
    dev = torch.device(device)
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(dev)
    k = torch.zeros((), dtype=torch.float64, device=dev)
    forms = {"producer": lambda x, k: producer(x), "fused=True": fused, "isnan int64": isnan_int64,
             "float32": float32, "lean float32": lean, "hist scatter": hist_scatter}
    if dev.type == "cpu":
        forms["hist one-hot"] = hist_onehot  # 64 compares per value: minutes at GPU sizes
    fns = {name: torch.compile(f) for name, f in forms.items()}
    for f in fns.values():
        f(x, k)
        f(x, k)
    h = Histogram.log2()
    ring = torch.zeros((2, 2, _layout.HEADER + h.nbins), dtype=torch.int64, device=dev)
    state = torch.tensor([0, 1, 0], device=dev)
    _ops.reset_slot(ring, state)
    ops = {"op histogram=None": lambda y: _ops.accumulate(y, ring, state, 0, None),
           "op log2": lambda y: _ops.accumulate(y, ring, state, 1, h)}

    def timed(fn, after=None):
        ts = []
        for _ in range(calls):
            if dev.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
            t = time.perf_counter()
            y = fn(x, k)
            if after is not None:
                after(y)
            if dev.type == "cuda":
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b) * 1e-3)
            else:
                ts.append(time.perf_counter() - t)
        return statistics.median(ts) * 1e6

    res = {name: [] for name in list(fns) + list(ops)}
    for _ in range(rounds):
        for name, f in fns.items():
            res[name].append(timed(f))
        for name, op in ops.items():
            res[name].append(timed(fns["producer"], op))
    base = statistics.median(res["producer"])
    op_added = statistics.median(res["op histogram=None"]) - base
    rows = []
    for name, v in res.items():
        med = statistics.median(v)
        rows.append({"form": name, "us": med, "added_us": med - base, "added_vs_op": (med - base) / op_added})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    n = N if args.device == "cpu" else 2**26
    rows = measure_forms(args.device, n)
    print(f"# {machine_info(args.device)['cpu']}, {args.threads} threads, torch {torch.__version__}, "
          f"{args.device}; {n:,} float32 values")
    print(f"{'form':20s} {'µs':>9s} {'added µs':>9s} {'added / op':>11s}")
    for r in rows:
        print(f"{r['form']:20s} {r['us']:9.1f} {r['added_us']:9.1f} {r['added_vs_op']:11.2f}")


if __name__ == "__main__":
    main()
