"""``hookcap.summary``: a torchinfo-style table of a model with real statistics
of every module's output from one forward (and optional backward) pass."""

from __future__ import annotations

import math

import torch
from torch import nn

from ._layout import STAT_NAMES
from ._capture.tree import tensor_leaves
from .histogram import Histogram
from .monitor import ROOT_NAME, Monitor


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.3g}"


def _naninf(row, prefix="") -> str:
    n, i = row.get(prefix + "nan"), row.get(prefix + "inf")
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    return f"{int(n)}/{int(i)}"


class ModelSummary(list):
    """The rows of :func:`summary` (a list of dicts, execution order); ``str()``
    renders the table.

    Each row: ``name`` (module qualname, root ``"model"``), ``output`` (path of
    the tensor inside the module's output, ``""`` for a bare tensor), ``metric``
    (the Monitor's metric name, or None for a non-floating output), ``type``,
    ``depth``, ``calls`` (times the module ran; stats merge all calls),
    ``shape``, ``dtype``, ``params`` (parameters owned directly by the module),
    every stat of ``hookcap.STAT_NAMES`` (NaN for non-floating outputs), with
    ``backward=True`` the same stats of the output's gradient prefixed
    ``grad_``, and with a ``histogram`` the bin counts as ``hist`` /
    ``grad_hist``. Also: ``.history`` (the Monitor's History),
    ``.total_params``, ``.trainable_params``, ``.first_nonfinite`` (the first
    metric in execution order holding NaN/Inf, or None).
    """

    backward: bool = False
    history = None
    total_params = 0
    trainable_params = 0
    first_nonfinite: str | None = None

    def table(self) -> str:
        cols = ["module", "type", "output shape", "dtype", "params", "mean", "std", "absmax",
                "zero_frac", "nan/inf"]
        if self.backward:
            cols += ["grad std", "grad absmax", "grad nan/inf"]
        lines = []
        for k, r in enumerate(self):
            first = k == 0 or self[k - 1]["name"] != r["name"]  # a module's further outputs: no repeat
            label = "  " * r["depth"] + (r["name"] if first else "")
            label += f" .{r['output']}" if r["output"] else ""
            if first and r["calls"] > 1:
                label += f" (x{r['calls']})"
            shape = ("x".join(map(str, r["shape"])) or "scalar") if r["shape"] is not None else "-"
            cells = [label, r["type"] if first else "", shape, r["dtype"] or "-",
                     (f"{r['params']:,}" if r["params"] else "--") if first else "",
                     _fmt(r["mean"]), _fmt(r["std"]), _fmt(r["absmax"]), _fmt(r["zero_frac"]), _naninf(r)]
            if self.backward:
                cells += [_fmt(r.get("grad_std")), _fmt(r.get("grad_absmax")), _naninf(r, "grad_")]
            lines.append(cells)
        widths = [max(len(c[i]) for c in lines + [cols]) for i in range(len(cols))]
        left = 4  # text columns left-aligned, numbers right-aligned

        def fmt(c):
            return "  ".join(v.ljust(w) if i < left else v.rjust(w)
                             for i, (v, w) in enumerate(zip(c, widths)))

        out = [fmt(cols), fmt(["-" * w for w in widths])] + [fmt(c) for c in lines]
        out.append(f"total params: {self.total_params:,} (trainable: {self.trainable_params:,}); "
                   f"{len({r['name'] for r in self})} modules ran")
        if self.first_nonfinite:
            out.append(f"first non-finite values in execution order: {self.first_nonfinite}")
        return "\n".join(out)

    def to_pandas(self):
        import pandas as pd

        return pd.DataFrame(list(self))

    def __str__(self) -> str:
        return self.table()

    __repr__ = __str__


def summary(model: nn.Module, *example_inputs, backward: bool = False, loss_fn=None,
            histogram: Histogram | None = None, train: bool | None = None, print_table: bool = True,
            **forward_kwargs) -> ModelSummary:
    """Run ``model(*example_inputs, **forward_kwargs)`` once with a Monitor on
    every module (containers and the root included, so e.g. an attention
    module whose ``out_proj`` child never runs still shows its output) and
    return a :class:`ModelSummary`: one row per output tensor of each module
    that ran, in the order the modules were entered (a pre-order walk, like
    torchinfo), with that output's real statistics.

    Args:
        backward: also run a backward pass of ``loss_fn(output)`` (default: the
            sum of ``.sum()`` of the floating outputs that require grad) and
            report each output's gradient stats (``grad_*``).
        histogram: record histograms (``hookcap.Histogram``) into ``hist``.
        train: run in ``train()`` (True) or ``eval()`` (False) mode; None keeps
            the model's mode.
        print_table: print the table.

    The model is left as it was: training flags, buffer values (e.g. BatchNorm
    running stats), the ``.grad`` of every parameter, and the CPU/CUDA RNG
    state are restored. Without ``backward`` the pass runs under ``no_grad``.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"summary: expected an nn.Module, got {type(model).__name__}")
    if loss_fn is not None and not backward:
        raise ValueError("summary: loss_fn is only used with backward=True")
    modes = [(m, m.training) for m in model.modules()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    params = list(model.parameters())
    grads = [p.grad for p in params]
    names = {mod: qual or ROOT_NAME for qual, mod in model.named_modules()}
    entered: dict[str, int] = {}  # name -> calls, in first-call order
    outputs: dict[str, list] = {}
    handles = []

    def pre(mod, args):
        n = names[mod]
        entered[n] = entered.get(n, 0) + 1

    def post(mod, args, out):
        n = names[mod]
        if n not in outputs:  # shapes as first seen, like the Monitor's metas
            outputs[n] = [(p, tuple(t.shape), str(t.dtype).replace("torch.", ""), t.is_floating_point())
                          for p, t in tensor_leaves(out, floating_only=False)]

    devices = sorted({t.device.index or 0 for t in [*params, *_flat(example_inputs, forward_kwargs)]
                      if t.device.type == "cuda"})
    capture = ("output", "grad_output") if backward else ("output",)
    # One pass in whatever mode the model is in: nothing to keep apart.
    mon = Monitor(model, modules=lambda n, m: True, capture=capture, histogram=histogram,
                  capacity=1, detectors=[], eval_forwards="merge")
    try:
        with torch.random.fork_rng(devices=devices):
            if train is not None:
                model.train(train)
            for mod in names:
                handles.append(mod.register_forward_pre_hook(pre))
                handles.append(mod.register_forward_hook(post))
            with mon:
                if backward:
                    for p in params:
                        p.grad = None  # so backward never writes into the caller's grads
                    with torch.enable_grad():
                        out = model(*example_inputs, **forward_kwargs)
                        loss = loss_fn(out) if loss_fn is not None else _sum_outputs(out)
                        loss.backward()
                else:
                    with torch.no_grad():
                        model(*example_inputs, **forward_kwargs)
                mon.step()
    finally:
        for h in handles:
            h.remove()
        for p, g in zip(params, grads):
            p.grad = g
        with torch.no_grad():
            for b, v in buffers:
                b.copy_(v)
        for m, t in modes:
            m.training = t
    h = mon.history()
    rows = _rows(h, names, entered, outputs, backward, histogram is not None)
    rows.history = h
    rows.backward = backward
    rows.total_params = sum(p.numel() for p in params)
    rows.trainable_params = sum(p.numel() for p in params if p.requires_grad)
    if len(h):
        bad = h["nan"][0] + h["inf"][0]
        first = [n for n in h.order(int(h.steps[0])) if bad[h.column(n)] > 0]
        rows.first_nonfinite = first[0] if first else None
    if print_table:
        print(rows)
    return rows


def _flat(args, kwargs):
    return [t for _, t in tensor_leaves((list(args), dict(kwargs)), floating_only=False)]


def _sum_outputs(out) -> torch.Tensor:
    ts = [t for _, t in tensor_leaves(out) if t.requires_grad]
    if not ts:
        raise ValueError("summary(backward=True): no floating output of the model requires grad; "
                         "pass loss_fn= or inputs/parameters that require grad")
    return sum(t.sum() for t in ts)


def _rows(h, names, entered, outputs, backward, with_hist) -> ModelSummary:
    mods = {n: m for m, n in names.items()}
    rows = ModelSummary()
    cols = {n: i for i, n in enumerate(h.names)} if len(h) else {}

    def stats_of(metric, prefix=""):
        out = {}
        col = cols.get(metric)
        for s in STAT_NAMES:
            out[prefix + s] = float(h[s][0, col]) if col is not None else math.nan
        if with_hist:
            out[prefix + "hist"] = h.histogram(metric)[0] if col is not None else None
        return out

    for name, calls in entered.items():
        mod = mods[name]
        depth = 0 if name == ROOT_NAME else name.count(".") + 1
        base = {"name": name, "type": type(mod).__name__, "depth": depth, "calls": calls,
                "params": sum(p.numel() for p in mod.parameters(recurse=False))}
        outs = outputs.get(name) or [("", None, None, False)]  # returned no tensor
        for path, shape, dtype, floating in outs:
            metric = (f"{name}/output.{path}" if path else f"{name}/output") if floating else None
            row = {**base, "output": path, "metric": metric, "shape": shape, "dtype": dtype}
            row.update(stats_of(metric) if metric else {s: math.nan for s in STAT_NAMES})
            if backward:
                g = f"{name}/grad_output.{path}" if path else f"{name}/grad_output"
                row.update(stats_of(g, "grad_") if metric else {"grad_" + s: math.nan for s in STAT_NAMES})
            rows.append(row)
    return rows


__all__ = ["ModelSummary", "summary"]
