"""Command line: ``python -m hookcap demo [--steps N] [--device D] [--every K] [--out DIR]``,
``python -m hookcap report PATH [--stat S] [--metric NAME] [--out DIR]``, ``python -m hookcap
info`` and ``python -m hookcap --version`` (whether the CUDA kernels were built)."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np
import torch

import hookcap
from hookcap.models import TinyTransformer


def _fmt(v: float) -> str:
    if isinstance(v, float) and math.isnan(v):
        return "-"
    return f"{v:.3g}"


def latest_table(h: hookcap.History) -> str:
    """Per-metric table of the newest recorded step."""
    cols = ("mean", "std", "absmax", "l2norm", "zero_frac")
    s = len(h) - 1
    rows = []
    for m, name in enumerate(h.names):
        if math.isnan(h["count"][s, m]):
            continue
        meta = h.meta(name)
        shape = "x".join(map(str, meta["shape"])) or "scalar"
        naninf = f"{int(h['nan'][s, m])}/{int(h['inf'][s, m])}"
        rows.append([name, shape] + [_fmt(h[c][s, m]) for c in cols] + [naninf])
    head = ["name", "shape", *cols, "nan/inf"]
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    line = lambda r: "  ".join(str(v).ljust(w) if i < 2 else str(v).rjust(w)  # noqa: E731
                               for i, (v, w) in enumerate(zip(r, widths)))
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def demo(args) -> int:
    torch.manual_seed(0)
    device = torch.device(args.device)
    vocab, ctx, batch = 64, 32, 16
    model = TinyTransformer(vocab=vocab, dim=64, layers=2, heads=4, ctx=ctx).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    mon = hookcap.Monitor(model, capture=("output", "grad_output"), every=args.every,
                          histogram=hookcap.Histogram.log2(), capacity=max(args.steps, 1))
    t0 = time.perf_counter()
    with mon:
        for step in range(args.steps):
            # Synthetic language: each sequence counts up by a random stride mod vocab.
            start = torch.randint(vocab, (batch, 1), generator=g)
            stride = torch.randint(1, 4, (batch, 1), generator=g)
            seq = ((start + stride * torch.arange(ctx + 1)) % vocab).to(device)
            logits = model(seq[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), seq[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            mon.step()
            if step % max(args.steps // 5, 1) == 0 or step == args.steps - 1:
                print(f"step {step:4d}  loss {loss.item():.4f}")
    elapsed = time.perf_counter() - t0
    h = mon.history()
    print(f"\n{args.steps} steps in {elapsed:.1f} s on {device}; {len(h)} recorded steps, "
          f"{len(h.names)} metrics, dropped {mon.dropped_steps}\n")
    print(f"latest recorded step ({int(h.steps[-1])}):")
    print(latest_table(h))
    os.makedirs(args.out, exist_ok=True)
    path = h.save(os.path.join(args.out, "history.npz"))
    print(f"\nhistory written to {path} (read it with hookcap.load)")
    try:
        from hookcap.report import report

        files = report(path, out=args.out)
        print(f"report written to {files['index']}")
    except ImportError as e:  # matplotlib is an optional extra
        print(f"no report: {e}")
    return 0


def version_line() -> str:
    """``hookcap X (torch Y; CUDA kernels built for ... | not built: why)``."""
    import hookcap

    b = hookcap.build_info()
    if b.get("cuda"):
        kernels = f"CUDA kernels built for {b.get('arch_list') or '?'}"
    else:
        kernels = f"CUDA kernels not built: {b.get('cuda_reason') or 'unknown'}"
    return f"hookcap {hookcap.__version__} (torch {b.get('torch_version')}; {kernels}; CPU loop {b['cpu_isa']})"


def info_text() -> str:
    """The version line, then every field of ``hookcap.build_info()``."""
    import hookcap

    b = hookcap.build_info()
    return "\n".join([version_line(), *(f"  {k}: {b[k]}" for k in sorted(b))])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hookcap",
                                description="hookcap: per-layer training telemetry for PyTorch.",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=version_line())
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="the installed build: version, torch, whether the CUDA kernels were built")
    d = sub.add_parser("demo", help="train a small transformer with a Monitor attached")
    d.add_argument("--steps", type=int, default=300)
    d.add_argument("--device", default="cpu")
    d.add_argument("--every", type=int, default=1)
    d.add_argument("--out", default="hookcap-demo")
    r = sub.add_parser("report", help="PNG plots + index.html from a dump (.npz), a Parquet dataset "
                       "directory or a JSONL sink file")
    r.add_argument("path", help="a dump written by Monitor.dump / History.save, a directory written by "
                   "hookcap.sinks.Parquet, or a hookcap JSONL file")
    r.add_argument("--stat", default="l2norm", help="stat of the heatmap (default l2norm)")
    r.add_argument("--metric", default=None, help="metric of the histogram plot (default: largest stat)")
    r.add_argument("--out", default=None, help="output folder (default: PATH without extension + '-report')")
    args = p.parse_args(argv)
    np.set_printoptions(precision=4)
    if args.cmd == "info":
        print(info_text())
        return 0
    if args.cmd == "demo":
        return demo(args)
    if args.cmd == "report":
        from hookcap.report import report

        try:
            files = report(args.path, out=args.out, stat=args.stat, metric=args.metric)
        except (ImportError, ValueError, OSError) as e:
            print(f"hookcap report: {e}", file=sys.stderr)
            return 1
        for k, path in files.items():  # every plot made, the index last
            if path and k != "index":
                print(f"wrote {path}")
        print(f"wrote {files['index']}")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
