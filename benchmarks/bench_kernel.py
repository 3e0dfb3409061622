"""Throughput of the hookcap accumulate op (one pass: every statistic) against torch.sum and the equivalent chain of torch ops.

GB/s = bytes of the input tensor / median seconds per call after warm-up (the device-to-device
copy yardstick on CUDA counts 2x: read + write). All configurations of one (size, dtype, threads)
point are timed round-robin, so drift on a noisy machine hits them alike.

  PYTHONPATH=. python benchmarks/bench_kernel.py                  # 64Mi float32, targets
  PYTHONPATH=. python benchmarks/bench_kernel.py --sweep          # 1e3..1e8 x fp32/bf16/fp16
  PYTHONPATH=. python benchmarks/bench_kernel.py --sweep --sizes 4096,65536,1048576 --dtypes float32 --shape
  PYTHONPATH=. python benchmarks/bench_kernel.py --device cuda    # CUDA events, vs d2d copy
  add --json benchmarks/results/kernel.json to keep the results with the machine they ran on.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

import hookcap
from hookcap import _layout, _ops

DEFAULT_SIZE = 64 * 2**20
SWEEP_SIZES = [10**k for k in range(3, 9)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHAIN_DOC = ("torch chain = x.sum, (x*x).sum, aminmax, abs().max, isnan().sum, isinf().sum, "
             "eq(0).sum, histc(x.float(), bins=131), each read back to the host (.item()/.tolist())")
# (config, reference, minimum ratio of GB/s): issue 2 "Speed"; the copy target is issue 5 "GPU".
TARGETS = [("hookcap", "torch.sum", 0.6), ("hookcap+log2", "torch.sum", 0.4),
           ("hookcap", "torch chain", 30.0), ("hookcap+log2", "torch chain", 30.0)]
CUDA_TARGETS = [("hookcap", "d2d copy", 0.8)]
SAMPLE_S = 1e-3  # calls per sample are batched up to this, so timer overhead stays small
SLICE_S = 0.05  # least time each configuration takes per round-robin round


def torch_chain(x: torch.Tensor) -> None:
    """The same statistics from separate torch ops, each read back as a real tool would."""
    x.sum().item()
    (x * x).sum().item()
    lo, hi = torch.aminmax(x)
    lo.item()
    hi.item()
    x.abs().max().item()
    x.isnan().sum().item()
    x.isinf().sum().item()
    x.eq(0).sum().item()
    torch.histc(x.float(), bins=131).tolist()


def op_call(x: torch.Tensor, hist: hookcap.Histogram | None, moments: int = 2):
    """A call of the accumulate op into a one-row ring; repeated calls merge into the same row."""
    width = _layout.HEADER + (hist.nbins if hist else 0)
    ring = torch.empty((1, 1, width), dtype=torch.int64, device=x.device)
    state = hookcap.functional.new_state(x.device)
    _ops.reset_slot(ring, state)
    return lambda: _ops.accumulate(x, ring, state, 0, hist, moments)


def configs(x: torch.Tensor, shape: bool = False) -> dict:
    """name -> (zero-argument callable, bytes moved per call). ``shape``: also
    the distribution-shape histograms (4 bins per octave; signed) and
    "+moments=4": moments=4 with the default log2 histogram."""
    nbytes = x.numel() * x.element_size()
    out = {
        "hookcap": (op_call(x, None), nbytes),
        "hookcap+log2": (op_call(x, hookcap.Histogram.log2()), nbytes),
        **({"+log2 sub=4": (op_call(x, hookcap.Histogram.log2(sub=4)), nbytes),
            "+log2 signed": (op_call(x, hookcap.Histogram.log2(signed=True)), nbytes)} if shape else {}),
        **({"+moments=4": (op_call(x, hookcap.Histogram.log2(), 4), nbytes)} if shape else {}),
        "torch.sum": (lambda: torch.sum(x), nbytes),
        "torch chain": (lambda: torch_chain(x), nbytes),
    }
    if x.is_cuda:
        y = torch.empty_like(x)
        out["d2d copy"] = (lambda: y.copy_(x), 2 * nbytes)
    return out


def sample_cpu(fn, number: int) -> float:
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return time.perf_counter() - t0


def sample_cuda(fn, number: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(number):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def measure(fns: dict, sample, budget: float, min_rounds: int) -> dict:
    """name -> (median seconds per call, samples, calls per sample).

    Each fn is warmed up and its calls batched (doubling) into samples of >= SAMPLE_S. Then
    rounds run round-robin until min_rounds are done and budget * len(fns) seconds have passed;
    in a round each fn takes samples for about max(SLICE_S, a quarter of the slowest fn's
    sample), so fast fns get many samples beside a slow one."""
    number, sample_s = {}, {}
    for name, fn in fns.items():
        sample(fn, 1)
        n = 1
        while (t := sample(fn, n)) < SAMPLE_S:
            n *= 2
        number[name], sample_s[name] = n, t
    slice_s = max(SLICE_S, max(sample_s.values()) / 4)
    per_round = {name: max(1, round(slice_s / sample_s[name])) for name in fns}
    times = {name: [] for name in fns}
    t_end = time.perf_counter() + budget * len(fns)
    rounds = 0
    while rounds < min_rounds or time.perf_counter() < t_end:
        for name, fn in fns.items():
            times[name] += [sample(fn, number[name]) / number[name] for _ in range(per_round[name])]
        rounds += 1
    return {name: (statistics.median(t), len(t), number[name]) for name, t in times.items()}


def run_point(n: int, dtype: str, threads: int, device: str, budget: float, min_rounds: int,
              shape: bool = False) -> dict:
    """Time every configuration on one randn tensor; config name -> result record."""
    torch.set_num_threads(threads)
    x = torch.randn(n, dtype=DTYPES[dtype], device=device)
    cfgs = configs(x, shape)
    sample = sample_cuda if device == "cuda" else sample_cpu
    timed = measure({name: fn for name, (fn, _) in cfgs.items()}, sample, budget, min_rounds)
    return {
        name: {"config": name, "size": n, "dtype": dtype, "threads": threads, "bytes": cfgs[name][1],
               "gbps": cfgs[name][1] / med / 1e9, "us_per_call": med * 1e6, "samples": samples,
               "calls_per_sample": number}
        for name, (med, samples, number) in timed.items()
    }


def git_describe() -> str:
    """Commit of the checkout this runs from (+ "-dirty" with local changes), or "unknown"."""
    out = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    return out.stdout.strip() or "unknown"


def machine_info(device: str) -> dict:
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info = {"cpu": cpu, "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "hookcap": hookcap.__version__,
            "build_info": hookcap.build_info(), "device": device, "git": git_describe()}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def print_default(points: dict, device: str) -> list:
    """Table of one size per threads setting, then the targets; returns the target records."""
    refs = ["torch.sum", "d2d copy", "torch chain"] if device == "cuda" else ["torch.sum", "torch chain"]
    print(f"{'threads':>7}  {'config':<13}{'GB/s':>9}" + "".join(f"{'× ' + r:>15}" for r in refs))
    for threads, res in points.items():
        for name, r in res.items():
            ratios = "".join(f"{r['gbps'] / res[ref]['gbps']:>15.2f}" for ref in refs)
            print(f"{threads:>7}  {name:<13}{r['gbps']:>9.2f}{ratios}")
    print("\ntargets (ratio of GB/s):")
    records = []
    for cfg, ref, goal in TARGETS + (CUDA_TARGETS if device == "cuda" else []):
        line = f"  {cfg:<13} >= {goal:>3g}× {ref:<11}"
        for threads, res in points.items():
            ratio = res[cfg]["gbps"] / res[ref]["gbps"]
            verdict = "PASS" if ratio >= goal else "MISS"
            line += f"  threads {threads}: {ratio:6.2f} {verdict}"
            records.append({"config": cfg, "reference": ref, "goal": goal, "threads": threads,
                            "ratio": ratio, "pass": ratio >= goal})
        print(line)
    return records


def print_sweep_header(dtype: str, names: list) -> None:
    cols = "".join(f"{name:>13}" for name in names)
    copy = " | hookcap × copy" if "d2d copy" in names else ""
    print(f"\n{dtype}: GB/s | µs per call{copy}")
    print(f"{'size':>11}{'thr':>4}{cols} |{cols}{copy}")


def fmt_size(n: int) -> str:
    k = round(math.log10(n))
    return f"1e{k}" if 10**k == n else f"{n:,}"


def print_sweep_row(res: dict) -> None:
    first = next(iter(res.values()))
    gbps = "".join(f"{r['gbps']:>13.2f}" for r in res.values())
    us = "".join(f"{r['us_per_call']:>13.1f}" for r in res.values())
    copy = f" |{res['hookcap']['gbps'] / res['d2d copy']['gbps']:>15.2f}" if "d2d copy" in res else ""
    print(f"{fmt_size(first['size']):>11}{first['threads']:>4}{gbps} |{us}{copy}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sweep", action="store_true", help="sizes 1e3..1e8 x float32/bfloat16/float16")
    p.add_argument("--max-size", type=float, default=1e8, help="largest sweep size (default 1e8)")
    p.add_argument("--sizes", type=lambda s: [int(float(t)) for t in s.split(",")],
                   help="sweep these sizes instead (comma list, e.g. 4096,65536,1048576,16777216)")
    p.add_argument("--shape", action="store_true",
                   help="also time log2 with 4 bins per octave and signed log2 (sweep)")
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=list(DTYPES),
                   help="sweep these dtypes (comma list of float32,bfloat16,float16)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads", type=lambda s: [int(t) for t in s.split(",")],
                   help="comma list of torch.set_num_threads values (default 1,2 on cpu, current on cuda)")
    p.add_argument("--budget", type=float,
                   help="seconds of timing per configuration and point (default 2, sweep 0.3)")
    p.add_argument("--json", metavar="PATH", help="write results, e.g. benchmarks/results/kernel.json")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_kernel: --device cuda but torch.cuda.is_available() is False (no GPU or driver)")
    if args.device == "cuda" and not _layout.CUDA_BUILT:
        sys.exit("bench_kernel: --device cuda but hookcap was built without CUDA kernels (see build_info())")
    sizes = args.sizes or [n for n in SWEEP_SIZES if n <= args.max_size]
    if any(d not in DTYPES for d in args.dtypes):
        p.error(f"--dtypes: each of {', '.join(DTYPES)}, got {args.dtypes}")
    if not sizes:
        p.error(f"--max-size {args.max_size:g} is below the smallest sweep size {SWEEP_SIZES[0]:g}")
    threads = args.threads or ([1, 2] if args.device == "cpu" else [torch.get_num_threads()])
    budget = args.budget if args.budget is not None else (0.3 if args.sweep else 2.0)
    min_rounds = 3 if args.sweep else 5
    info = machine_info(args.device)

    gpu = f", {info['gpu']}" if args.device == "cuda" else ""
    print(f"hookcap kernel benchmark on {args.device}{gpu}: {info['cpu']} ({info['cpu_count']} cores), "
          f"torch {info['torch']}, cpu_isa {info['build_info']['cpu_isa']}")
    timer = "CUDA events" if args.device == "cuda" else "perf_counter"
    print(f"GB/s = input bytes / median time per call ({timer}, after warm-up, configs round-robin)")
    print(CHAIN_DOC)
    load_before = os.getloadavg()[0]
    print(f"1-min load average before: {load_before:.2f} (other work on the cores skews 2-thread rows most)")

    results, targets = [], []
    if args.sweep:
        for dtype in args.dtypes:
            for n in sizes:
                for t in threads:
                    res = run_point(n, dtype, t, args.device, budget, min_rounds, args.shape)
                    if n == sizes[0] and t == threads[0]:
                        print_sweep_header(dtype, list(res))
                    print_sweep_row(res)
                    results += res.values()
    else:
        print(f"\n{DEFAULT_SIZE:,} float32 elements ({DEFAULT_SIZE * 4 / 2**20:.0f} MiB)")
        points = {t: run_point(DEFAULT_SIZE, "float32", t, args.device, budget, min_rounds)
                  for t in threads}
        targets = print_default(points, args.device)
        results = [r for res in points.values() for r in res.values()]

    load_after = os.getloadavg()[0]
    print(f"\n1-min load average after: {load_after:.2f}")
    if args.json:
        record = {"benchmark": "bench_kernel", "command": sys.argv,
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "mode": "sweep" if args.sweep else "default", "machine": info,
                  "load_average_1min": {"before": load_before, "after": load_after},
                  "budget_s": budget, "min_rounds": min_rounds, "torch_chain": CHAIN_DOC,
                  "results": results, "targets": targets}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json + ".tmp", "w") as f:
            json.dump(record, f, indent=1)
        os.replace(args.json + ".tmp", args.json)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
