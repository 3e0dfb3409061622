"""Where fused=True's time goes on a GPU: the compiled GPT-2 step with forms of the
fused statistics side by side, each compiled once, timed interleaved in one process.

  PYTHONPATH=. python benchmarks/bench_fused_variants.py [--device cuda] [--layers 2] [--workload cnn] [--json FILE]

Configurations (outputs and output gradients of the default modules, histogram=None):
- no telemetry; the op;
- fused=True as hookcap computes it;
- "packed counts": the four class counts (zeros, +Inf, -Inf, non-finite) as one int64 sum of
  16-bit fields per block (exact for blocks under 65,536 values): one accumulator instead of four;
- "float32 sums": the sums in float32 (inexact: a diagnostic of what float64 costs);
- "no merge kernel": the partials computed and handed to a merge that finds no Monitor (no kernel):
  the merge kernels' share;
- "no shift kernel": the sums about a constant 0 instead of the row's shift (no fused_shift
  kernel; a diagnostic): the shift kernels' share;
- "MLP rows in 1,024 blocks": rows wider than 2,304 values (GPT-2's MLP tensors, 3,072 wide) reduced
  as 1,024 equal runs instead of their 8,192 rows: the same kernels (the GELU ones) with 8 times
  fewer per-block reductions and partials;
- "two statistics": only the finite count and the sum per block (the other partials constant,
  wrong values): what two reductions inside the model's kernels cost;
- "one float32 sum": only the float32 sum of the values per block (the rest constant, wrong
  values): the least any statistic inside the model's kernels can cost.
--configs picks them by name (separated by ";"); by default the ones not yet measured on a GPU
beside no telemetry, the op and fused=True (the others were: benchmarks/results/fused_variants_h200.json).
--workload cnn times resnet18 instead (torchvision, weights=None; float32, channels-last as Inductor
lays out convolutions on a GPU, 32 images of 224 pixels square, 10 classes; on the CPU or with
--quick 2 of 32), by default no telemetry, the op,
fused=True and the two without a merge or a shift kernel: in float32 the kernels the statistics
join are bound by bytes, with instruction issue to spare (benchmarks/triton_issue.py --cnn), so
there the fixed cost per capture (the merge and shift launches) decides.
A variant replaces hookcap._capture.fused functions only while its first step traces. Per
configuration: the first step (compile), the median step and its overhead paired by round,
Triton launches in the generated code, and device time by kernel category and by kernel
(torch.profiler). --seconds bounds the timed rounds, counted after the compiles.
On the CPU (Inductor's C++ backend) the fused path is timed as well, only to exercise the code.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import time
from unittest import mock

import torch

import hookcap._capture.fused

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]

ABSENT_SINK = -7  # no Monitor has it: merge_partials launches nothing
_ROWS_ARE_BLOCKS = hookcap._capture.fused._rows_are_blocks  # as hookcap has it, unpatched


def variant_partials(x, k, rows=False, strided=False, *, packed_counts=False, float_sums=False,
                     two_statistics=False, one_sum=False):
    """hookcap._capture.fused.partials, with ``packed_counts`` the class counts as one
    int64 sum of 16-bit fields (blocks under 65,536 values; else four int64
    sums), with ``float_sums`` s1 and s2 summed in float32 (inexact), with
    ``two_statistics`` only the finite count and s1 (the other partials
    constant: a cost, not values), with ``one_sum`` only the float32 sum of
    the values (in s1; a cost floor, not values)."""
    from hookcap._capture import fused as _fused
    from hookcap import _layout

    v, whole = _fused.block_view(x, rows, strided)
    if v is None:
        return _fused._empty_partials(x.device)
    size = v.numel() if whole else v.shape[-1]
    red = _fused.reducer(whole)
    inf, i64 = float("inf"), torch.int64
    fin = v.abs() < inf
    if one_sum:
        s1 = red(v, torch.sum).double()
        zero = torch.zeros_like(s1)
        cols = [zero] * _layout.PARTIALS
        cols[_layout.P_S1], cols[_layout.P_MIN], cols[_layout.P_MAX] = s1, zero + inf, zero - inf
        return _fused.stack_partials(cols)
    if two_statistics:
        finite = red(fin, torch.sum, dtype=torch.int32).double()
        s1 = red(torch.where(fin, v.double() - k, 0.0), torch.sum)
        zero = torch.zeros_like(s1)
        cols = [zero] * _layout.PARTIALS
        cols[_layout.P_FINITE], cols[_layout.P_S1] = finite, s1
        cols[_layout.P_MIN], cols[_layout.P_MAX] = zero + inf, zero - inf
        return _fused.stack_partials(cols)
    classes = (v == 0, v == inf, v == -inf, ~fin)
    if packed_counts and _fused._known(size < 65536):
        c = red(classes[0].to(i64) | (classes[1].to(i64) << 16) | (classes[2].to(i64) << 32)
                | (classes[3].to(i64) << 48), torch.sum)
        zeros, posinf, neginf, other = (c >> s & 0xFFFF for s in (0, 16, 32, 48))
    else:
        zeros, posinf, neginf, other = (red(m, torch.sum, dtype=i64) for m in classes)
    d = torch.where(fin, v - k.float(), 0.0) if float_sums else torch.where(fin, v.double() - k, 0.0)
    cols = {
        _layout.P_NAN: (other - posinf - neginf).double(), _layout.P_POSINF: posinf.double(),
        _layout.P_NEGINF: neginf.double(), _layout.P_ZEROS: zeros.double(),
        _layout.P_FINITE: (size - other).double(), _layout.P_S1: red(d, torch.sum).double(),
        _layout.P_S2: red(d * d, torch.sum).double(),
        _layout.P_MIN: red(torch.where(fin, v, inf), torch.amin).double(),
        _layout.P_MAX: red(torch.where(fin, v, -inf), torch.amax).double(),
    }
    return _fused.stack_partials([cols[i] for i in range(_layout.PARTIALS)])


def wide_rows_in_blocks(x, b) -> bool:
    """hookcap._capture.fused._rows_are_blocks, except that rows wider than 2,304
    values are not blocks: such a tensor is reduced as blocks(n) equal runs
    (1,024 for GPT-2's [8, 1,024, 3,072] MLP tensors)."""
    return False if x.dim() >= 2 and x.shape[-1] > 2304 else _ROWS_ARE_BLOCKS(x, b)


def merge_without_shift(x, sink, rid, rows=False, strided=False):
    """hookcap._capture.fused.merge about a constant shift 0 (no fused_shift kernel:
    its share; the sums lose the shift's precision, a diagnostic)."""
    from hookcap._capture import fused as _fused

    k = torch.zeros((), dtype=torch.float64, device=x.device)
    _fused._MERGE(_fused.partials(x, k, rows, strided), k, sink, rid)


def merge_to_no_monitor(x, sink, rid, rows=False, strided=False):
    """hookcap._capture.fused.merge, its partials merged into an absent sink."""
    from hookcap._capture import fused as _fused

    k = _fused._SHIFT(torch.empty(0, device=x.device), sink, rid)
    _fused._MERGE(_fused.partials(x, k, rows, strided), k, ABSENT_SINK, rid)


FUSED = {"histogram": None, "fused": True}
CONFIGS = (  # name, Monitor kwargs (None: unwatched), {hookcap._capture.fused attribute: replacement while tracing}
    ("no telemetry", None, {}),
    ("op histogram=None", {"histogram": None}, {}),
    ("fused=True", FUSED, {}),
    ("fused, packed counts", FUSED, {"partials": functools.partial(variant_partials, packed_counts=True)}),
    ("fused, float32 sums", FUSED, {"partials": functools.partial(variant_partials, float_sums=True)}),
    ("fused, no merge kernel", FUSED, {"merge": merge_to_no_monitor}),
    ("fused, no shift kernel", FUSED, {"merge": merge_without_shift}),
    ("fused, MLP rows in 1,024 blocks", FUSED, {"_rows_are_blocks": wide_rows_in_blocks}),
    ("fused, two statistics", FUSED, {"partials": functools.partial(variant_partials, two_statistics=True)}),
    ("fused, one float32 sum", FUSED, {"partials": functools.partial(variant_partials, one_sum=True)}),
)
DEFAULT_CONFIGS = ("no telemetry", "op histogram=None", "fused=True", "fused, MLP rows in 1,024 blocks",
                   "fused, two statistics", "fused, one float32 sum")
CNN_CONFIGS = ("no telemetry", "op histogram=None", "fused=True", "fused, no merge kernel", "fused, no shift kernel")
CNN_SHAPE = {"batch": 32, "size": 224, "channels_last": True}  # CPU and --quick: 2 images of 32 pixels


@contextlib.contextmanager
def traced_with(replace: dict):
    with contextlib.ExitStack() as stack:
        for name, fn in replace.items():
            stack.enter_context(mock.patch.object(hookcap._capture.fused, name, fn))
        yield


def measure(device: torch.device, layers: int, rounds: int, steps_per_round: int, seconds: float | None = None,
            quick: bool = False, names=DEFAULT_CONFIGS, workload: str = "gpt2") -> dict:
    """The configurations of CONFIGS called ``names`` on the compiled GPT-2
    step (``workload="cnn"``: resnet18's, float32, CNN_SHAPE), timed rounds
    for at most ``seconds`` after the compiles; see the module docstring."""
    import bench_overhead
    from _fusion import triton_launches
    from _profile_steps import profile_steps
    from gpu_check import cnn_workload, compiled_gpt2_setup, first_compiled_step, train_step
    from torch._dynamo.utils import counters

    cuda = device.type == "cuda"
    shape, autocast = compiled_gpt2_setup(device, quick, layers)
    make = None
    if workload == "cnn":
        shape = CNN_SHAPE if cuda and not quick else {**CNN_SHAPE, "batch": 2, "size": 32}
        autocast, make = torch.autocast(device.type, enabled=False), cnn_workload
    if steps_per_round < 2:
        raise SystemExit("--steps-per-round must be at least 2: the first step of each round is not kept")
    if "no telemetry" not in names:  # the base every overhead is paired with
        names = ("no telemetry", *names)
    unknown = set(names) - {c[0] for c in CONFIGS}
    if unknown:
        raise SystemExit(f"unknown configurations {sorted(unknown)}; known: {[c[0] for c in CONFIGS]}")
    runs, rows = {}, {}
    for name, kw, replace in (c for c in CONFIGS if c[0] in names):
        first = first_compiled_step(shape, device, autocast, kw, traced_with(replace), make)
        desc = first.desc
        rows[name] = {"config": name, "compile_s": first.seconds,
                      "triton_launches_in_code": len(triton_launches(first.codes))}
        runs[name] = (first.loss_fn, first.opt, first.cfg, first.mon)
        print(f"  {name}: first step {rows[name]['compile_s']} s", flush=True)
    graphs = counters["stats"]["unique_graphs"]
    deadline = None if seconds is None else time.time() + seconds

    def stop(measured: int) -> bool:
        return deadline is not None and deadline - time.time() < 30

    steps = {name: (lambda loss_fn=loss_fn, opt=opt, cfg=cfg: train_step(autocast, loss_fn, opt, cfg))
             for name, (loss_fn, opt, cfg, _) in runs.items()}
    times, by_round = bench_overhead.interleaved(steps, bench_overhead.timer(device), rounds, steps_per_round, 1, stop)
    for name in runs:
        rows[name].update(bench_overhead.paired_row(name, times, by_round))
        print(f"  {name}: {rows[name]['median_ms']:.2f} ms, {rows[name]['overhead_pct']:+.1f} %", flush=True)
    prof = profile_steps(steps, device, top=40) if deadline is None or deadline - time.time() > 20 else {}
    for name, p in prof.items():
        rows[name]["device_ms"] = {c: round(v["ms"], 3) for c, v in p["by_category"].items()}
        rows[name]["launches"] = {c: v["calls"] for c, v in p["by_category"].items()}
    hist = {name: runs[name][3].history() for name in runs if runs[name][3] is not None}
    for _, _, _, mon in runs.values():
        if mon is not None:
            mon.detach()
    return {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
            "model": desc, "shape": shape, "rounds": len(by_round["no telemetry"]),
            "steps_per_round": steps_per_round, "rows": list(rows.values()), "profile": prof,
            "graphs_compiled_after_first_steps": counters["stats"]["unique_graphs"] - graphs,
            "histories": hist}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps-per-round", type=int, default=5)
    p.add_argument("--seconds", type=float, default=None, help="stop timing rounds this long after the compiles")
    p.add_argument("--configs", default=None,
                   help="names of CONFIGS separated by ';' (default: DEFAULT_CONFIGS, with --workload cnn CNN_CONFIGS)")
    p.add_argument("--workload", choices=("gpt2", "cnn"), default="gpt2",
                   help="cnn: resnet18, float32, 32 images of 224 pixels square (--layers does not apply)")
    p.add_argument("--quick", action="store_true", help="the small CPU shape of gpu_check")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    default = CNN_CONFIGS if args.workload == "cnn" else DEFAULT_CONFIGS
    names = [n.strip() for n in (args.configs or ";".join(default)).split(";") if n.strip()]
    out = measure(torch.device(args.device), args.layers, args.rounds, args.steps_per_round, args.seconds, args.quick,
                  names, args.workload)
    out.pop("histories")
    from bench_overhead import write_json

    print("| config | first step s | median ms | overhead | Triton launches (code) | device ms by category |")
    print("|---|---:|---:|---:|---:|---|")
    for r in out["rows"]:
        cats = ", ".join(f"{c} {v:.2f} ({r['launches'][c]:.0f})" for c, v in r.get("device_ms", {}).items())
        print(f"| {r['config']} | {r['compile_s']} | {r['median_ms']:.2f} | {r['overhead_pct']:+.1f} % | "
              f"{r['triton_launches_in_code']} | {cats} |")
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
