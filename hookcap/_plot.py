"""Matplotlib helpers the report's plots share (hookcap.report,
hookcap.report_inside): the import with its install hint, the figure size
for a heatmap, and step / row labels."""

from __future__ import annotations

import math


def import_mpl():
    try:
        import matplotlib  # noqa: F401
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("hookcap report needs matplotlib: pip install matplotlib  "
                          "(or pip install 'hookcap[plot]')") from e
    return Figure


def heatmap_figure(Figure, rows: int, cols: int):
    height = min(max(2.5 + 0.16 * rows, 3.5), 40.0)
    width = min(max(6.0 + 0.03 * cols, 10.0), 24.0)
    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def label_axes(ax, run, labels: list[str]):
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    steps = run.steps
    ax.xaxis.set_major_locator(MaxNLocator(nbins=12, integer=True))
    ax.xaxis.set_major_formatter(FuncFormatter(
        lambda x, _: str(int(steps[int(round(x))])) if 0 <= round(x) < len(steps) else ""))
    ax.set_xlabel("step")
    k = max(1, math.ceil(len(labels) / 150))  # at most ~150 readable labels
    ax.set_yticks(range(0, len(labels), k))
    ax.set_yticklabels(labels[::k], fontsize=7 if len(labels) > 30 else 8)
