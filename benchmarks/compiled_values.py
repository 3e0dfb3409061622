"""Does watching a compiled model change its values, and do fused=True and the op agree?

  python benchmarks/compiled_values.py cuda|cpu OUTDIR

Linear(64, 256) -> GELU -> Linear(256, 64) -> LayerNorm (tests/test_cuda.py's model), 4 steps
of 128 rows (a NaN in step 2), each compiled afresh with no telemetry ("none"), the op ("op"),
fused=True ("fused") or both Monitors on the one model ("both"), for two losses: sum(y**2),
whose gradient is mostly rounding (LayerNorm's output has a fixed norm), and sum(y * w) with a
random w. Prints, per step, how many elements of the output and of each parameter's gradient
differ bitwise between two runs (largest absolute and relative difference), and which recorded
statistics differ between the op and fused=True, in separate compiles and in one compile (sum
and sum of squares: relative differences over 1e-6, large where a sum cancels).
Writes Inductor's code of the fused step to OUTDIR/code_fused.txt.
"""
import os
import sys
import time
import traceback

import numpy as np
import torch

sys.path[:0] = ["tests", "benchmarks", "."]
import hookcap  # noqa: E402
import hookcap._capture.fused  # noqa: E402
from conftest import assert_fused_matches_op  # noqa: E402

dev = sys.argv[1]
outdir = sys.argv[2]
hookcap._capture.fused.DEVICE_TYPES.add(dev)
CAPTURE = ("output", "grad_output", "grad_input")


def make():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64),
                               torch.nn.LayerNorm(64)).to(dev)


g = torch.Generator().manual_seed(1)
XS = [torch.randn(128, 64, generator=g).to(dev) for _ in range(4)]
XS[2][0, 0] = float("nan")
W = torch.randn(128, 64, generator=g).to(dev)
LOSSES = {"pow2": lambda y: y.pow(2).sum(), "proj": lambda y: (y * W).sum()}


def run(mode, loss):
    torch._dynamo.reset()
    model = make()
    mons = []
    if mode in ("op", "both"):
        mons.append(hookcap.Monitor(model, capture=CAPTURE, histogram=None, detectors=[]).attach())
    if mode in ("fused", "both"):
        mons.append(hookcap.Monitor(model, capture=CAPTURE, histogram=None, detectors=[], fused=True).attach())
    cm = torch.compile(model)
    outs, grads = [], []
    for x in XS:
        y = cm(x)
        LOSSES[loss](y).backward()
        outs.append(y.detach().clone())
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
        for m in mons:
            m.step()
    for m in mons:
        m.detach()
    return outs, grads, [m.history() for m in mons]


def differ(a, b):
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    d = (a.double() - b.double()).abs().nan_to_num(0)
    rel = (d / b.double().abs().clamp_min(1e-30)).nan_to_num(0)
    return int((~same).sum()), float(d.max()), float(rel.max())


def compare(r1, r2, label):
    o1, g1, _ = r1
    o2, g2, _ = r2
    lines = []
    for s in range(len(XS)):
        n, d, rel = differ(o1[s], o2[s])
        gl = [differ(a, b) for a, b in zip(g1[s], g2[s])]
        lines.append(f"  step {s}: out differ {n} (abs {d:.2e}, rel {rel:.2e}); grads differ "
                     + ", ".join(f"{n}({d:.1e},{r:.1e})" for n, d, r in gl))
    print(f"{label}:\n" + "\n".join(lines), flush=True)


def stat_mismatches(op, fused):
    res = []
    for name in op.names:
        a, b = op.column(name), fused.column(name)
        for stat in ("count", "nan", "posinf", "neginf", "zeros", "finite", "min", "max", "absmax"):
            x, y = fused[stat][:, b], op[stat][:, a]
            bad = ~((x == y) | (np.isnan(x) & np.isnan(y)))
            if bad.any():
                i = int(np.argmax(bad))
                res.append(f"{name} {stat} steps {np.flatnonzero(bad).tolist()}: fused {x[i]!r} op {y[i]!r}")
        for stat in ("sumsq", "sum"):
            x, y = fused[stat][:, b], op[stat][:, a]
            rel = np.nanmax(np.abs(x - y) / np.maximum(np.abs(y), 1e-30)) if np.isfinite(y).any() else 0
            if rel > 1e-6:
                res.append(f"{name} {stat} max rel {rel:.2e}")
    return res


def main():
    t0 = time.time()
    for loss, modes in (("pow2", ("none", "op", "fused", "both")), ("proj", ("none", "fused", "both"))):
        runs = {}
        for mode in modes:
            try:
                runs[mode] = run(mode, loss)
            except Exception:
                print(f"{loss} {mode} FAILED\n{traceback.format_exc()}", flush=True)
        print(f"== loss {loss} ({time.time() - t0:.0f} s)", flush=True)
        for a, b in (("none", "op"), ("none", "fused"), ("none", "both"), ("op", "fused")):
            if a in runs and b in runs:
                compare(runs[a], runs[b], f"{loss}: {a} vs {b} (model values bitwise)")
        if "op" in runs and "fused" in runs:
            mm = stat_mismatches(runs["op"][2][0], runs["fused"][2][0])
            print(f"{loss}: op run vs fused run, stat mismatches {len(mm)}:\n  " + "\n  ".join(mm), flush=True)
        if "both" in runs:
            op_h, fu_h = runs["both"][2]
            mm = stat_mismatches(op_h, fu_h)
            print(f"{loss}: SAME GRAPH op vs fused, stat mismatches {len(mm)}:\n  " + "\n  ".join(mm), flush=True)
            try:
                assert_fused_matches_op(op_h, fu_h)
                print(f"{loss}: SAME GRAPH assert_fused_matches_op: ok", flush=True)
            except AssertionError as e:
                print(f"{loss}: SAME GRAPH assert_fused_matches_op FAILED: {str(e)[:600]}", flush=True)
    # Inductor's code of the fused step (sum(y**2) loss), for reading offline.
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model = make()
    mon = hookcap.Monitor(model, capture=CAPTURE, histogram=None, detectors=[], fused=True).attach()
    cm = torch.compile(model)
    codes = run_and_get_code(lambda: cm(XS[0]).pow(2).sum().backward())[1]
    with open(os.path.join(outdir, "code_fused.txt"), "w") as f:
        f.write("\n# =====\n".join(codes))
    mon.detach()
    print(f"done {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
