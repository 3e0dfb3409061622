"""The report's "what moved first" page (``moved.png``): for the latest
anomaly of a run (or its last step), the first movers of
:func:`hookcap.explain`, one row each, first mover on top, coloured by each
row's own robust z-score over the steps before the anomaly (normalised per
row: a small layer's change shows as much as a large one's), the anomaly's
step marked and each row's first move circled."""

from __future__ import annotations

import numpy as np

from ._plot import import_mpl
from .movers import explain


class _RunView:
    """A report's RunData seen as explain() reads a History."""

    def __init__(self, run) -> None:
        self.steps, self.names, self.anomalies = run.steps, run.names, run.anomalies
        self._run = run

    def __contains__(self, stat: str) -> bool:
        return stat in self._run.stats

    def __getitem__(self, stat: str) -> np.ndarray:
        return self._run.stats[stat]

    def order(self, step: int) -> list[str]:
        return self._run.orders.get(step, [])


def plot_moved(run, path: str, top: int = 30, horizon: int = 48):
    """``moved.png`` (module docstring); returns ``(path, explanation)``, or
    ``(None, explanation)`` where nothing moved or the run is too short."""
    ex = explain(_RunView(run), horizon=horizon, top=top)
    if not len(ex):
        return None, ex
    Figure = import_mpl()
    z = np.clip(np.nan_to_num(ex.zscores, nan=0.0, posinf=12.0, neginf=-12.0), -12, 12).T  # [movers, steps]
    fig = Figure(figsize=(12, min(2.0 + 0.22 * len(ex), 16)), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    im = ax.imshow(z, aspect="auto", cmap="RdBu_r", vmin=-12, vmax=12, interpolation="nearest")
    fig.colorbar(im, ax=ax, label="robust z against the row's own trailing baseline (clipped at ±12)")
    steps = list(ex.steps)
    for r, m in enumerate(ex):
        ax.plot(steps.index(m.step), r, "o", mfc="none", mec="black", ms=7)
    if ex.step in steps:
        ax.axvline(steps.index(ex.step), color="black", lw=1.5, ls="--")
    ticks = list(range(0, len(steps), max(1, len(steps) // 12)))
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(int(steps[i])) for i in ticks])
    ax.set_xlabel("step")
    ax.set_yticks(range(len(ex)))
    ax.set_yticklabels([f"{m.name} ({m.stat}, {m.lead} before)" for m in ex], fontsize=7 if len(ex) > 20 else 8)
    ax.set_title(f"what moved first before the anomaly at step {ex.step} (circle: first move; dashed: anomaly)")
    fig.savefig(path)
    return path, ex
