"""The report's plots of attention, mixture-of-experts and outlier-channel
metrics (docs/attention-moe.md), from the groups in a run:

- ``attention.png``: each head's max logit (``{module}/attn.logit[h]``'s
  ``max``), layers x heads at the latest recorded step, and every (layer,
  head) over the steps.
- ``experts.png``: tokens per expert (``{router}/router.tokens[e]``'s
  ``count``) over the steps, as a share of the layer's mean load (1: balanced,
  0: no token, marked).
- ``channels.png``: per summarised tensor (``hookcap.Channels``), the ids of
  its top channels at each step (largest first, darker) and the largest over
  the median channel's absmax.
"""

from __future__ import annotations

import re

import numpy as np

from ._plot import heatmap_figure, import_mpl, label_axes
from .groups import split_group


def grouped(run, base_pattern: str) -> dict[str, list[int]]:
    """``{metric: [column of group 0, 1, ...]}`` for the grouped metrics of
    ``run`` whose name matches ``base_pattern`` (a regex, whole name), in
    first-execution order; groups missing from the run are left out."""
    cols: dict[str, dict[int, int]] = {}
    pattern = re.compile(base_pattern)
    for i, name in enumerate(run.names):
        metric, g = split_group(name)
        if g is not None and pattern.fullmatch(metric):
            cols.setdefault(metric, {})[g] = i
    return {base: [c[g] for g in sorted(c)] for base, c in cols.items()}


def _groups_of(run, stat: str, suffix: str) -> list[tuple[str, np.ndarray]]:
    """``[(owner, stat [S, G])]`` for the grouped metrics ``f"{owner}{suffix}"``
    of ``run``; empty where it has none, or not ``stat``."""
    if stat not in run.stats:
        return []
    v = run.stats[stat]
    return [(base.removesuffix(suffix), v[:, cols]) for base, cols in grouped(run, ".*" + re.escape(suffix)).items()]


def _last_recorded(values: np.ndarray) -> int | None:
    """The last row (step) of ``values`` [S, G] with a finite value."""
    ok = np.flatnonzero(np.isfinite(values).any(axis=1))
    return int(ok[-1]) if ok.size else None


def plot_attention(run, path: str) -> str | None:
    """Per-head max logits (module docstring), or None without attention groups."""
    layers = _groups_of(run, "max", "/attn.logit")
    if not layers:
        return None
    Figure = import_mpl()
    grid = np.full((len(layers), max(v.shape[1] for _, v in layers)), np.nan)
    for li, (_, v) in enumerate(layers):
        s = _last_recorded(v)
        if s is not None:
            grid[li, :v.shape[1]] = v[s]
    rows = [r for _, v in layers for r in v.T]
    labels = [f"{owner} h{h}" for owner, v in layers for h in range(v.shape[1])]
    fig = heatmap_figure(Figure, len(rows), len(run.steps))
    left, right = fig.subplots(1, 2, width_ratios=[1, 2])
    im = left.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap="magma")
    fig.colorbar(im, ax=left, label="max logit")
    left.set_xlabel("head")
    left.set_yticks(range(len(layers)))
    left.set_yticklabels([owner for owner, _ in layers], fontsize=7)
    left.set_title("max logit per head, latest step")
    im = right.imshow(np.ma.masked_invalid(np.array(rows)), aspect="auto", cmap="magma")
    fig.colorbar(im, ax=right, label="max logit")
    label_axes(right, run, labels)
    right.set_title("max logit per (layer, head) and step (grey: not recorded)")
    fig.savefig(path)
    return path


def plot_experts(run, path: str) -> str | None:
    """Expert load over time (module docstring), or None without routers."""
    routers = _groups_of(run, "count", "/router.tokens")
    if not routers:
        return None
    from matplotlib.colors import ListedColormap

    Figure = import_mpl()
    with np.errstate(invalid="ignore", divide="ignore"):
        rows = [r for _, v in routers for r in (v / v.mean(axis=1, keepdims=True)).T]
    labels = [f"{owner} e{e}" for owner, v in routers for e in range(v.shape[1])]
    share = np.array(rows)
    fig = heatmap_figure(Figure, len(rows), len(run.steps))
    ax = fig.add_subplot()
    top = max(2.0, float(np.nanmax(share)) if np.isfinite(share).any() else 2.0)
    im = ax.imshow(np.ma.masked_invalid(share), aspect="auto", cmap="RdBu_r", vmin=0, vmax=top)
    fig.colorbar(im, ax=ax, label="tokens / the layer's mean per expert")
    dead = share == 0
    if dead.any():
        ax.imshow(np.ma.masked_where(~dead, np.ones(share.shape)), aspect="auto",
                  cmap=ListedColormap(["black"]), vmin=0, vmax=1, interpolation="nearest")
    label_axes(ax, run, labels)
    ax.set_title("expert load per (router, expert) and step (1: balanced; black: no token; grey: not recorded)")
    fig.savefig(path)
    return path


def plot_channels(run, path: str, most: int = 6) -> str | None:
    """Top channel ids over time (module docstring), or None without them."""
    shown = _groups_of(run, "max", ".top_channels")[:most]
    if not shown:
        return None
    Figure = import_mpl()
    fig = Figure(figsize=(12, 2.6 * len(shown)), dpi=100, layout="constrained")
    axes = fig.subplots(len(shown), 1, squeeze=False)[:, 0]
    mx = run.stats["max"]
    for ax, (name, ids) in zip(axes, shown):
        for r in range(ids.shape[1]):
            ax.scatter(run.steps, ids[:, r], s=14 if r == 0 else 6, color=str(0.6 * r / max(1, ids.shape[1] - 1)),
                       label="largest" if r == 0 else None)
        ax.set_ylabel("channel id")
        ratio = name + ".top_over_median"
        if ratio in run.names:
            twin = ax.twinx()
            twin.plot(run.steps, mx[:, run.names.index(ratio)], color="tab:red", lw=1)
            twin.set_ylabel("largest / median", color="tab:red")
        ax.set_title(f"{name}: top channels by absmax (black: the largest)")
    axes[-1].set_xlabel("step")
    fig.savefig(path)
    return path
