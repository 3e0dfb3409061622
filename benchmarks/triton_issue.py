"""Instruction issue of the Triton kernels a GPU runs for a compiled step, counted without a GPU.

  PYTHONPATH=. python benchmarks/triton_issue.py --code OUT/code_fused_True_histogram_None.txt [--profile OUT/gpu_check.json --config "fused=True histogram=None"] [--json FILE]
  PYTHONPATH=. python benchmarks/triton_issue.py --forms [--json FILE]
  PYTHONPATH=. python benchmarks/triton_issue.py --cnn [--batch 32] [--size 224] [--json FILE]

Each kernel of an Inductor code dump (the code_<config>.txt files gpu_check.py writes) is compiled
for sm_90 with every config Inductor autotunes among (Triton, then its bundled cuobjdump), and its
SASS instructions are counted: the loop over a reduction's blocks once per iteration, the rest once
per program. The config that executes the fewest instructions stands for the kernel (autotuning picks
by time, which needs a GPU). Per kernel it prints instructions per element (per lane: warp
instructions x 32 / elements) and two floors for one launch: issue (warp instructions / (SMs x 4
schedulers x clock)) and bytes (the bytes it moves, benchmarks/_fusion.py, / memory bandwidth). With
--profile, the measured device time per kernel from that gpu_check run's profile of --config sits beside
them, and their ratio to the larger floor.

--forms compiles a Linear(768 -> 3,072) -> GELU step under bfloat16 autocast on the CPU
(_fusion.triton_codegen) with no telemetry, and with fused=True in hookcap's form and in the
diagnostic forms of bench_fused_variants.py, and prints the GELU kernels' instructions per element:
what each form of the statistics adds per element and captured tensor.

--cnn generates gpu_check's resnet18 training step (float32, channels-last; --nchw: NCHW, which
Inductor lays out channels-last on a GPU after tracing, so fused=True hands most captures to the op)
with no telemetry, the op and
fused=True (histogram=None, outputs and output gradients of the default modules) and prints each
one's floors summed over its Triton launches, the bytes the op reads (an eager step's recorded
counts x 4) and hookcap's calls in the generated code (merges, shifts, records: a launch each).

Defaults are an H200's (132 SMs, 1.98 GHz, 4.8 TB/s); --sms, --ghz and --tbps change them.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import subprocess
import sys
import tempfile

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]

GELU_WIDTH, GELU_ROWS, GELU_IN = 3072, 2048, 768


def split_code_dump(path: str) -> list[str]:
    """The Inductor modules of a code dump written by gpu_check.write_codes."""
    with open(path) as f:
        return [m for m in re.split(r"^# ===== module \d+ =====\n", f.read(), flags=re.M) if m.strip()]


def sass(fn, meta, cfg, tmp: str) -> tuple[list, int]:
    """(SASS instructions as (address, text), registers per thread) of ``fn``
    compiled for sm_90 under ``cfg``."""
    import triton
    from triton_registers import compile_sm90

    compiled = compile_sm90(fn, meta, cfg)
    cubin = os.path.join(tmp, "k.cubin")
    with open(cubin, "wb") as f:
        f.write(compiled.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    text = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    ins = [(int(a, 16), t) for a, t in re.findall(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", text, re.M)]
    return ins, int(re.search(r"REG:(\d+)", usage).group(1))


def loop_body(ins) -> int:
    """Instructions inside the backward branches' ranges (the loops)."""
    loops = [(int(t.group(1), 16), a) for a, text in ins if "BRA" in text
             for t in [re.search(r"0x([0-9a-f]+)", text)] if t and int(t.group(1), 16) < a]
    return sum(1 for a, _ in ins if any(lo <= a <= hi for lo, hi in loops))


def executed_warp_instructions(source: str, cfg, body: int, total: int) -> int:
    """Warp instructions one launch executes under ``cfg``: each program runs
    its loop body once per block of the reduction and the rest once."""
    def size(name):
        m = re.search(rf"\b{name} = (\d+)", source[source.index("@triton.jit"):])
        return int(m.group(1)) if m else 1

    kw = cfg.kwargs
    programs = -(-size("xnumel") // kw.get("XBLOCK", 1)) * -(-size("ynumel") // kw.get("YBLOCK", 1))
    if body and "R0_BLOCK" in kw:
        per_program = body * -(-size("r0_numel") // kw["R0_BLOCK"]) + total - body
    elif body and "RSPLIT_SIZE" in kw:  # a program reduces RSPLIT_SIZE rows in a loop
        programs = -(-size("xnumel") // kw["RSPLIT_SIZE"])
        per_program = body * kw["RSPLIT_SIZE"] // kw.get("XBLOCK", 1) + total - body
    else:
        per_program = total
    return programs * cfg.num_warps * per_program


def kernel_rows(kernels, sms: int, ghz: float, tbps: float) -> list[dict]:
    """One row per distinct kernel of ``kernels`` (_fusion.TritonKernel
    launches, in order), with its launches and floors per launch."""
    from triton_registers import _load, warps_per_sm

    rate = sms * 4 * ghz * 1e9  # warp instructions per second
    rows, seen = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, k in enumerate(kernels):
            if k.source in seen:
                seen[k.source]["launches"] += 1
                continue
            fn, meta, configs, _ = _load(k.source, tmp, i)
            best = None
            for cfg in configs:
                ins, regs = sass(fn, meta, cfg, tmp)
                body = loop_body(ins)
                w = executed_warp_instructions(k.source, cfg, body, len(ins))
                if best is None or w < best[0]:
                    best = (w, regs, cfg)
            w, regs, cfg = best
            elements = max(k.elements, 1)
            seen[k.source] = row = {
                "kernel": k.name, "launches": 1, "elements": k.elements, "reductions": k.reductions,
                "instructions_per_element": round(w * 32 / elements, 1), "regs": regs,
                "warps_per_sm": warps_per_sm(regs, cfg.num_warps), "config": {**cfg.kwargs, "num_warps": cfg.num_warps},
                "issue_us": round(w / rate * 1e6, 2), "bytes_us": round(k.traffic / (tbps * 1e12) * 1e6, 2)}
            rows.append(row)
    return rows


def measured_us(profile: dict, rows: list[dict]) -> None:
    """Add each row's measured device time per launch (``measured_us``) from a
    gpu_check profile entry. The profile keys kernels by their first 120
    characters, so kernels whose names share those are one group there: each
    gets the group's mean per launch, and the ratio is the group's."""
    top: dict[str, list] = {}
    for t in profile.get("top", []):
        top.setdefault(t["kernel"], [0.0, 0.0])
        top[t["kernel"]][0] += t["ms"] * 1e3
        top[t["kernel"]][1] += t["calls"]
    groups: dict[str, list] = {}
    for r in rows:
        groups.setdefault(r["kernel"][:120], []).append(r)
    for key, rs in groups.items():
        if key not in top or not top[key][1]:
            continue
        us, calls = top[key]
        floor = sum(r["launches"] * max(r["issue_us"], r["bytes_us"]) for r in rs) or 1e-9
        for r in rs:
            r["measured_us"] = round(us / calls, 1)
            r["measured_over_floor"] = round(us * sum(r["launches"] for r in rs) / calls / floor, 2)


def print_rows(rows: list[dict], limit: int = 25) -> None:
    print("| kernel | launches | elements | instr./element | issue µs | bytes µs | measured µs | ratio | regs | warps/SM |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    key = (lambda r: -r["launches"] * max(r["issue_us"], r["bytes_us"]))
    for r in sorted(rows, key=key)[:limit]:
        print(f"| {r['kernel'][:72]} | {r['launches']} | {r['elements']:,} | {r['instructions_per_element']} | "
              f"{r['issue_us']} | {r['bytes_us']} | {r.get('measured_us', '–')} | {r.get('measured_over_floor', '–')} | "
              f"{r['regs']} | {r['warps_per_sm']} |")


def totals(rows: list[dict]) -> dict:
    """Per step: the issue floors, the bytes floors and the larger of the two,
    summed over launches (µs)."""
    s = {"issue_us": 0.0, "bytes_us": 0.0, "max_us": 0.0}
    for r in rows:
        s["issue_us"] += r["launches"] * r["issue_us"]
        s["bytes_us"] += r["launches"] * r["bytes_us"]
        s["max_us"] += r["launches"] * max(r["issue_us"], r["bytes_us"])
    return {k: round(v, 1) for k, v in s.items()}


FUSED = {"histogram": None, "fused": True}
FORMS = (  # name, Monitor kwargs (None: unwatched), bench_fused_variants.variant_partials options (None: hookcap's)
    ("no telemetry", None, None),
    ("fused=True", FUSED, None),
    ("fused, packed counts", FUSED, {"packed_counts": True}),
    ("fused, float32 sums", FUSED, {"float_sums": True}),
    ("fused, two statistics", FUSED, {"two_statistics": True}),
    ("fused, one float32 sum", FUSED, {"one_sum": True}),
)


def generated_step(build, kw, patch=None):
    """The ``_fusion.triton_codegen`` (its ``codes``, ``kernels()``) of one
    step of ``build()`` -> (model, step), the model compiled in place and
    watched over outputs and output gradients by a Monitor of ``kw`` (None:
    unwatched), the fused path on the CPU, under the context ``patch``."""
    import contextlib

    import hookcap
    import hookcap._capture.fused
    from _fusion import triton_codegen

    types = hookcap._capture.fused.DEVICE_TYPES
    added = "cpu" not in types
    types.add("cpu")
    try:
        with triton_codegen() as tc, patch or contextlib.nullcontext():
            model, step = build()
            mon = None if kw is None else hookcap.Monitor(model, detectors=[], capture=("output", "grad_output"),
                                                          **kw).attach()
            model.compile()
            tc.run(step)
            if mon is not None:
                mon.detach()
    finally:
        if added:
            types.discard("cpu")
    return tc


def gelu_kernels(kw, options) -> list:
    """The GELU kernels' launches of a compiled Linear -> GELU training step
    under bfloat16 autocast (:func:`generated_step`), the partials in
    bench_fused_variants' form of ``options`` (None: hookcap's)."""
    from unittest import mock

    import torch
    import torch.nn as nn

    import hookcap._capture.fused
    from bench_fused_variants import variant_partials

    def build():
        torch.manual_seed(0)
        model, x = nn.Sequential(nn.Linear(GELU_IN, GELU_WIDTH), nn.GELU()), torch.randn(GELU_ROWS, GELU_IN)

        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = model(x)
            y.float().pow(2).sum().backward()

        return model, step

    patch = None if options is None else mock.patch.object(
        hookcap._capture.fused, "partials", functools.partial(variant_partials, **options))
    return [k for k in generated_step(build, kw, patch).kernels() if "gelu" in k.name]


def cnn_step(kw, batch: int, size: int, channels_last: bool = True) -> tuple[list, int, int, dict]:
    """(Triton launches, captured bytes, captures, :func:`hookcap_calls`) of a
    float32 training step of gpu_check's resnet18 (weights=None, 10 classes;
    hookcap's TinyResNet without torchvision; channels-last unless
    ``channels_last`` is False) on ``batch`` x 3 x ``size`` x ``size`` images
    (:func:`generated_step`). The bytes are those the op reads, counted in an
    eager step of the same Monitor with histogram=None."""
    import torch

    import hookcap
    from _fusion import hookcap_calls
    from gpu_check import cnn_workload

    def build():
        shape = {"batch": batch, "size": size, "channels_last": channels_last}
        model, loss_fn, _ = cnn_workload(shape, torch.device("cpu"))
        return model, lambda: loss_fn().backward()

    captured = [0, 0]
    if kw is not None:  # the values the op reads: the recorded counts of an eager step (float32)
        model, step = build()
        mon = hookcap.Monitor(model, histogram=None, detectors=[], capture=("output", "grad_output")).attach()
        step()
        mon.step()
        counts = mon.history()["count"][0]
        mon.detach()
        captured = [int(counts.sum()) * 4, int((counts > 0).sum())]
    tc = generated_step(build, kw)
    return tc.kernels(), captured[0], captured[1], hookcap_calls(tc.codes)


def cnn(args) -> dict:
    """Per configuration the step's Triton floors (µs), and the op's own
    bytes floor: a lower bound of what each path adds."""
    out = {}
    for name, kw in (("no telemetry", None), ("op", {"histogram": None}), ("fused=True", FUSED)):
        kernels, nbytes, captures, calls = cnn_step(kw, args.batch, args.size, not args.nchw)
        rows = kernel_rows(kernels, args.sms, args.ghz, args.tbps)
        out[name] = {"launches": len(kernels), "triton": totals(rows), "captured_bytes": nbytes,
                     "captures": captures, "hookcap_calls": calls, "kernels": rows}
        print(f"== {name}: {len(kernels)} Triton launches, floors {totals(rows)}, hookcap calls {calls}", flush=True)
    base = out["no telemetry"]["triton"]["max_us"]
    op_read = out["op"]["captured_bytes"] / (args.tbps * 1e12) * 1e6
    print(f"op: Triton kernels {out['op']['triton']['max_us'] - base:+.1f} µs, its own read of "
          f"{out['op']['captured_bytes'] / 1e6:.1f} MB ({out['op']['captures']} captures) {op_read:.1f} µs; "
          f"fused=True: Triton kernels {out['fused=True']['triton']['max_us'] - base:+.1f} µs "
          f"(merges and the op's reads of the captures it hands over not counted)")
    return out


def forms(args) -> dict:
    out = {}
    for name, kw, options in FORMS:
        rows = kernel_rows(gelu_kernels(kw, options), args.sms, args.ghz, args.tbps)
        out[name] = {("backward" if "backward" in r["kernel"] else "forward"): r for r in rows}
        print(f"== {name}: " + "; ".join(f"GELU {d}: {r['instructions_per_element']} instructions per element, "
                                         f"{r['regs']} registers" for d, r in out[name].items()), flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--code", nargs="*", default=[], help="Inductor code dumps (gpu_check's code_<config>.txt)")
    p.add_argument("--profile", default=None, help="the gpu_check.json of the run that wrote the dumps")
    p.add_argument("--config", nargs="*", default=[], help="per --code file, its configuration in that profile")
    p.add_argument("--forms", action="store_true", help="the GELU kernels under the forms of the statistics")
    p.add_argument("--cnn", action="store_true", help="a float32 resnet18 step: none, the op, fused=True")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--nchw", action="store_true", help="--cnn in NCHW (default: channels-last)")
    p.add_argument("--sms", type=int, default=132)
    p.add_argument("--ghz", type=float, default=1.98)
    p.add_argument("--tbps", type=float, default=4.8)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import json

    from _fusion import triton_launches

    out = {"sms": args.sms, "ghz": args.ghz, "tbps": args.tbps, "codes": {}}
    profiles = {}
    if args.profile:
        with open(args.profile) as f:
            for step in json.load(f)["steps"]:
                profiles.update((step.get("details") or {}).get("profile") or {})
    for i, path in enumerate(args.code):
        rows = kernel_rows(triton_launches(split_code_dump(path)), args.sms, args.ghz, args.tbps)
        config = args.config[i] if i < len(args.config) else None
        if config in profiles:
            measured_us(profiles[config], rows)
        out["codes"][os.path.basename(path)] = {"config": config, "totals": totals(rows), "kernels": rows}
        print(f"== {path}: floors per step {totals(rows)}", flush=True)
        print_rows(rows)
    if args.forms:
        out["forms"] = forms(args)
    if args.cnn:
        out["cnn"] = {"batch": args.batch, "size": args.size, "channels_last": not args.nchw, **cnn(args)}
    if args.json:  # not bench_overhead's writer: that imports hookcap, which a dump needs not be built for
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
