"""``python -m hookcap report PATH``: PNG plots and an ``index.html`` from a
dump (``.npz``, ``hookcap.load``), a Parquet dataset directory written by
``hookcap.sinks.Parquet`` (``hookcap.load``) or a JSONL file written by
``hookcap.sinks.JSONL``. Needs matplotlib (``pip install 'hookcap[plot]'``).

Plots (matplotlib, Agg canvas; the caller's pyplot backend is not touched):

- ``heatmap.png``: one stat (default ``l2norm``), metrics x recorded steps, log
  colour scale (symmetric log when the stat takes negative values).
- ``nonfinite.png``: NaN + Inf count per metric and step, with the first
  offender marked (the first ``"nonfinite"`` anomaly of a dump; otherwise the
  first metric in execution order holding NaN/Inf at the earliest such step).
- ``histogram.png``: the chosen metric's histogram over time (share of its
  finite values per bin, log colour scale); default metric: the one with the
  largest value of the stat. Only when the file has histograms.
- ``quantiles.png``: the same metric's median and p1-p99, p0.1-p99.9 bands
  over steps, estimated from its histogram (of ``|x|`` for log2 bins). Only
  when the file has histograms.
- ``crest.png``: the ``crest`` heatmap (absmax / rms per metric and step):
  where outliers stand out from the bulk.
- ``kurtosis.png``: the ``kurtosis`` heatmap, when recorded
  (``Monitor(moments=4)``): heavy tails per metric and step (3: normal).
- ``signals.png``: the loss-spike signals over steps, when the file has them
  (see ``spike_signals``): the tapped ``loss``, each parameter's update ratio
  ``||dw|| / ||w_before||`` and its Adam ratio RMS, one thin line per
  parameter and the largest across parameters in bold, with the steps of the
  ``spike`` anomalies marked.
- ``moved.png``: what moved first before the latest anomaly (a dump's), from
  :func:`hookcap.explain` (hookcap.report_moved).
- ``attention.png``, ``experts.png``, ``channels.png``: per-head max logits,
  expert load and outlier channels, when recorded (``hookcap.report_inside``).
- ``index.html``: shows them, with the file, steps, metrics and anomalies.
"""

from __future__ import annotations

import html
import json
import math
import os
from dataclasses import dataclass, field

import numpy as np

from ._layout import MOMENT_NAMES, STAT_NAMES
from .histogram import Histogram
from .sinks.jsonl import full_histogram
from .history import History, load
from ._plot import heatmap_figure, import_mpl, label_axes
from .report_inside import plot_attention, plot_channels, plot_experts
from .report_moved import plot_moved


@dataclass
class RunData:
    """What the report needs, read from a dump, a Parquet dataset or a JSONL file."""

    source: str
    steps: np.ndarray  # int64 [S]
    names: list[str]  # [M], first-execution order
    stats: dict[str, np.ndarray]  # stat -> float64 [S, M], NaN where not recorded
    orders: dict[int, list[str]]  # step -> metric names in execution order
    hist_spec: Histogram | None = None
    anomalies: list = field(default_factory=list)  # hookcap.Anomaly (dumps only)
    _hist: object = None  # History, or dict name -> int64 [S, B]

    def has_histograms(self) -> bool:
        if self.hist_spec is None:
            return False
        return not isinstance(self._hist, dict) or bool(self._hist)

    def histogram(self, name: str) -> np.ndarray:
        if isinstance(self._hist, dict):
            if name in self._hist:
                return self._hist[name]
            return np.zeros((len(self.steps), self.hist_spec.nbins), dtype=np.int64)
        return self._hist.histogram(name)


def from_history(h: History, source: str = "<History>") -> RunData:
    orders = dict(zip(h.steps.tolist(), h._step_orders()))  # h.order(s), in one pass
    stats = {s: h[s] for s in STAT_NAMES + MOMENT_NAMES if s in h}
    return RunData(source, h.steps.copy(), list(h.names), stats,
                   orders, h.histogram_spec, list(h.anomalies), h)


def read_jsonl(path) -> RunData:
    """A JSONL file of ``hookcap.sinks.JSONL`` -> RunData (lines of one step
    are in execution order; ``null`` is NaN)."""
    path = os.fspath(path)
    rows, spec = [], None
    with open(path, encoding="utf-8") as f:
        for ln, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                rows.append(d)
                int(d["step"]), str(d["name"])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{ln}: not a hookcap JSONL line ({e})") from None
            if spec is None and d.get("hist_spec"):
                spec = Histogram.from_dict(d["hist_spec"])
    if not rows:
        raise ValueError(f"{path}: no data lines")
    steps = sorted({int(d["step"]) for d in rows})
    names, orders = [], {}
    for d in rows:
        if d["name"] not in orders.setdefault(int(d["step"]), []):
            orders[int(d["step"])].append(d["name"])
        if d["name"] not in names:
            names.append(d["name"])
    si = {s: i for i, s in enumerate(steps)}
    mi = {n: i for i, n in enumerate(names)}
    present = [s for s in STAT_NAMES + MOMENT_NAMES if any(s in d for d in rows)]
    stats = {s: np.full((len(steps), len(names)), np.nan) for s in present}
    hist: dict[str, np.ndarray] = {}
    for d in rows:
        i, j = si[int(d["step"])], mi[d["name"]]
        for s in present:
            v = d.get(s)
            if v is not None:
                stats[s][i, j] = float(v)
        if spec is not None and d.get("hist") is not None:
            a = hist.setdefault(d["name"], np.zeros((len(steps), spec.nbins), dtype=np.int64))
            a[i] = full_histogram(d, spec.nbins)
    return RunData(path, np.array(steps, dtype=np.int64), names, stats, orders, spec, [], hist)


def load_run(source) -> RunData:
    """A History, a dump path (``.npz``), a Parquet dataset directory (or a
    path ending in ``.parquet``) or a JSONL path -> RunData."""
    if isinstance(source, History):
        return from_history(source)
    path = os.fspath(source)
    if path.endswith(".npz") or os.path.isdir(path) or path.rstrip("/" + os.sep).endswith(".parquet"):
        return from_history(load(path), path)
    return read_jsonl(path)


def first_nonfinite(run: RunData):
    """(step, metric name, how found) of the first NaN/Inf, or None."""
    for a in run.anomalies:
        if a.kind == "nonfinite":
            return int(a.step), a.name, "anomaly"
    bad = _nonfinite_counts(run)
    if bad is None:
        return None
    rows = np.flatnonzero(np.nansum(bad, axis=1) > 0)
    if rows.size == 0:
        return None
    s = int(run.steps[rows[0]])
    for name in run.orders.get(s, run.names):
        if bad[rows[0], run.names.index(name)] > 0:
            return s, name, "order"
    return None


def _nonfinite_counts(run: RunData):
    st = run.stats
    if "nan" in st and "inf" in st:
        return st["nan"] + st["inf"]
    if "nan" in st and "posinf" in st and "neginf" in st:
        return st["nan"] + st["posinf"] + st["neginf"]
    return None


def _norm(values: np.ndarray):
    """Log colour scale; symmetric log when there are negative values."""
    from matplotlib.colors import LogNorm, Normalize, SymLogNorm

    fin = values[np.isfinite(values)]
    if fin.size == 0:
        return Normalize(0, 1), "no finite values"
    if (fin < 0).any():
        nz = np.abs(fin[fin != 0])
        lin = float(np.percentile(nz, 10)) if nz.size else 1.0
        m = float(np.abs(fin).max()) or 1.0
        return SymLogNorm(linthresh=lin, vmin=-m, vmax=m, base=10), "symmetric log scale"
    pos = fin[fin > 0]
    if pos.size == 0:
        return Normalize(0, 1), "all values are 0"
    lo, hi = float(pos.min()), float(pos.max())
    return LogNorm(vmin=lo, vmax=hi if hi > lo else lo * 10), "log scale"


_NO_FINITE_COLOUR = "#e7298a"  # magenta: recorded, but no finite value (all NaN/Inf)


def no_finite_cells(run: RunData) -> np.ndarray | None:
    """bool [S, M]: recorded cells that held no finite value, or None when
    the source lacks the counts to tell."""
    st = run.stats
    if "count" not in st:
        return None
    count = st["count"]
    if "finite" in st:
        finite = st["finite"]
    else:
        bad = _nonfinite_counts(run)
        if bad is None:
            return None
        finite = count - bad
    with np.errstate(invalid="ignore"):
        return (count > 0) & (finite == 0)


def plot_heatmap(run: RunData, stat: str, path: str) -> str:
    Figure = import_mpl()
    import matplotlib
    from matplotlib.colors import ListedColormap

    v = run.stats[stat].T  # [M, S]
    norm, how = _norm(v)
    diverging = isinstance(norm, matplotlib.colors.SymLogNorm)  # signed stat: 0 in the middle
    cmap = matplotlib.colormaps["RdBu_r" if diverging else "viridis"]
    cmap = cmap.with_extremes(bad="#d0d0d0", under="white")
    shown = v.copy()
    if isinstance(norm, matplotlib.colors.LogNorm):
        shown[shown <= 0] = norm.vmin / 2  # zeros drawn in the 'under' colour, not as missing
    fig = heatmap_figure(Figure, len(run.names), len(run.steps))
    ax = fig.add_subplot()
    im = ax.imshow(np.ma.masked_invalid(shown), aspect="auto", cmap=cmap, norm=norm)
    fig.colorbar(im, ax=ax, extend="min" if isinstance(norm, matplotlib.colors.LogNorm) else "neither",
                 label=stat)
    dead = no_finite_cells(run)
    magenta = ""
    if dead is not None and dead.any():  # drawn over whatever the stat reads (NaN, or 0 for l2norm)
        ax.imshow(np.ma.masked_where(~dead.T, np.ones(v.shape)), aspect="auto",
                  cmap=ListedColormap([_NO_FINITE_COLOUR]), vmin=0, vmax=1, interpolation="nearest")
        magenta = ", magenta: no finite value"
    label_axes(ax, run, run.names)
    ax.set_title(f"{stat} per metric and step ({how}; grey: not recorded"
                 f"{', white: 0' if isinstance(norm, matplotlib.colors.LogNorm) else ''}{magenta})")
    fig.savefig(path)
    return path


def plot_nonfinite(run: RunData, path: str, first) -> str | None:
    """Markers rather than an image: a single NaN step among thousands must
    not vanish when columns are downsampled to pixels."""
    Figure = import_mpl()
    import matplotlib
    from matplotlib.colors import ListedColormap, LogNorm

    bad = _nonfinite_counts(run)
    if bad is None:
        return None
    v = np.where(np.isnan(bad), 0.0, bad)  # [S, M]
    fig = heatmap_figure(Figure, len(run.names), len(run.steps))
    ax = fig.add_subplot()
    si, mi = np.nonzero(v > 0)
    if si.size:
        # Reds without its near-white end, so a count of 1 is visible.
        cmap = ListedColormap(matplotlib.colormaps["Reds"](np.linspace(0.35, 1.0, 256)))
        hi = float(v.max())
        sc = ax.scatter(run.steps[si], mi, c=v[si, mi], cmap=cmap, norm=LogNorm(vmin=1, vmax=max(hi, 2.0)),
                        marker="s", s=30, linewidths=0)
        fig.colorbar(sc, ax=ax, label="NaN + Inf count")
        title = "NaN + Inf per metric and step"
    else:
        title = "no NaN/Inf in any recorded step"
    if first is not None:
        s, name, _ = first
        title += f" - first: {name} at step {s}"
        if name in run.names:
            y = run.names.index(name)
            ax.plot([s], [y], marker="o", markersize=16, markerfacecolor="none",
                    markeredgecolor="#0060ff", markeredgewidth=2.5)
            ax.annotate(f"first: {name} @ step {s}", (s, y), xytext=(14, -14),
                        textcoords="offset points", color="#0060ff", fontsize=9, fontweight="bold")
    if len(run.steps):
        pad = max(0.5, 0.01 * float(run.steps[-1] - run.steps[0]))
        ax.set_xlim(float(run.steps[0]) - pad, float(run.steps[-1]) + pad)
    ax.set_ylim(len(run.names) - 0.5, -0.5)
    ax.grid(True, axis="y", color="#eeeeee", linewidth=0.5)
    ax.set_axisbelow(True)
    k = max(1, math.ceil(len(run.names) / 150))
    ax.set_yticks(range(0, len(run.names), k))
    ax.set_yticklabels(run.names[::k], fontsize=7 if len(run.names) > 30 else 8)
    ax.set_xlabel("step")
    ax.set_title(title)
    fig.savefig(path)
    return path


def bin_labels(spec: Histogram) -> list[str]:
    """A short label per bin (log2: of |x|)."""
    if spec.kind == "log2":
        lo, hi, sub = int(spec.lo), int(spec.hi), spec.sub
        inner = [f"2^{e}" if j == 0 else f"2^{e}*{1 + j / sub:g}" for e in range(lo, hi) for j in range(sub)]
        mags = [f"<2^{lo}"] + inner + [f">=2^{hi}"]
        if not spec.signed:
            return ["0"] + mags
        return ["-" + m for m in mags[::-1]] + ["0"] + mags
    e = spec.bin_edges
    return [f"<{e[1]:.3g}"] + [f"{e[i]:.3g}" for i in range(1, len(e) - 2)] + [f">={e[-2]:.3g}"]


def default_metric(run: RunData, stat: str) -> str:
    v = run.stats[stat]
    with np.errstate(all="ignore"):
        peak = np.where(np.isfinite(v), v, -np.inf).max(axis=0) if v.size else np.array([])
    return run.names[int(np.argmax(peak))] if peak.size and np.isfinite(peak).any() else run.names[0]


def plot_histogram(run: RunData, metric: str, path: str) -> str | None:
    if not run.has_histograms():
        return None
    Figure = import_mpl()
    import matplotlib
    from matplotlib.colors import ListedColormap, LogNorm

    counts = run.histogram(metric).astype(np.float64)  # [S, B]
    used = np.flatnonzero(counts.sum(axis=0))
    if used.size == 0:
        return None
    a, b = int(used[0]), int(used[-1]) + 1
    tot = counts.sum(axis=1, keepdims=True)
    share = np.divide(counts, tot, out=np.zeros_like(counts), where=tot > 0)[:, a:b].T  # [B', S]
    labels = bin_labels(run.hist_spec)[a:b]
    fig = heatmap_figure(Figure, len(labels), len(run.steps))
    ax = fig.add_subplot()
    cmap = matplotlib.colormaps["magma"].with_extremes(bad="white")
    pos = share[share > 0]
    im = ax.imshow(np.ma.masked_less_equal(share, 0), aspect="auto", origin="lower",
                   cmap=cmap, norm=LogNorm(vmin=max(float(pos.min()), 1e-9), vmax=1.0))
    fig.colorbar(im, ax=ax, label="share of finite values")
    dead = no_finite_cells(run)
    magenta = ""
    if dead is not None and metric in run.names and dead[:, run.names.index(metric)].any():
        cols = np.broadcast_to(dead[:, run.names.index(metric)], share.shape)  # steps with no finite value
        ax.imshow(np.ma.masked_where(~cols, np.ones(share.shape)), aspect="auto", origin="lower",
                  cmap=ListedColormap([_NO_FINITE_COLOUR]), vmin=0, vmax=1, interpolation="nearest")
        magenta = ", magenta: no finite value"
    label_axes(ax, run, labels)
    what = ("log2 bins of |x|" if run.hist_spec.magnitudes else "signed log2 bins"
            if run.hist_spec.kind == "log2" else "linear bins")
    ax.set_ylabel("bin (lower edge)")
    ax.set_title(f"{metric}: histogram over time ({what}; white: empty{magenta})")
    fig.savefig(path)
    return path


def plot_quantiles(run: RunData, metric: str, path: str) -> str | None:
    """Median and p1-p99 / p0.1-p99.9 bands of ``metric`` over steps."""
    if not run.has_histograms() or metric not in run.names:
        return None
    from .quantiles import from_stats

    Figure = import_mpl()
    j = run.names.index(metric)
    log2 = run.hist_spec.magnitudes
    st = run.stats
    qs = from_stats(run.histogram(metric), run.hist_spec, [0.001, 0.01, 0.5, 0.99, 0.999],
                    lambda s: st[s][:, j] if s in st else None)
    v = qs.value
    if not np.isfinite(v).any():
        return None
    fig = Figure(figsize=(11, 4), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    x = run.steps
    ax.fill_between(x, v[:, 0], v[:, 4], color="#c6dbef", label="p0.1 - p99.9", step=None)
    ax.fill_between(x, v[:, 1], v[:, 3], color="#6baed6", label="p1 - p99")
    ax.plot(x, v[:, 2], color="#08306b", linewidth=1.6, label="median")
    fin = v[np.isfinite(v)]
    if log2 and fin.size and (fin > 0).all():
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_title(f"{metric}: quantiles of {qs.of} over time (from the histogram; "
                 f"largest bound on the median: {np.nanmax(qs.rel_error[:, 2]):.2g} relative)", fontsize=10)
    ax.grid(True, color="#eeeeee", linewidth=0.5)
    ax.legend(loc="upper left", fontsize=8)
    fig.savefig(path)
    return path


def spike_signals(run: RunData) -> dict[str, dict[str, np.ndarray]]:
    """The loss-spike signals a run holds, each ``{label: float64 [S]}``
    (NaN where not recorded): ``"loss"`` (``mean`` of the metric ``loss``,
    i.e. the tapped scalar), ``"update_ratio"`` (``l2norm`` of
    ``{param}/update`` over that of ``{param}/update.base``, per parameter)
    and ``"adam_ratio"`` (``rms`` of ``{param}/adam_ratio``). Absent keys:
    the run did not record that signal."""
    st, col = run.stats, {n: i for i, n in enumerate(run.names)}
    out: dict[str, dict[str, np.ndarray]] = {}
    if "loss" in col and "mean" in st:
        out["loss"] = {"loss": st["mean"][:, col["loss"]]}
    if "l2norm" in st:
        ratios = {}
        for n in run.names:
            if n.endswith("/update") and n + ".base" in col:
                with np.errstate(divide="ignore", invalid="ignore"):
                    ratios[n[:-len("/update")]] = st["l2norm"][:, col[n]] / st["l2norm"][:, col[n + ".base"]]
        if ratios:
            out["update_ratio"] = ratios
    if "rms" in st:
        adam = {n[:-len("/adam_ratio")]: st["rms"][:, col[n]] for n in run.names if n.endswith("/adam_ratio")}
        if adam:
            out["adam_ratio"] = adam
    return out


def plot_signals(run: RunData, path: str) -> str | None:
    """One panel per signal of ``spike_signals`` sharing the step axis; None
    when the run has neither update nor Adam ratios."""
    sig = spike_signals(run)
    if "update_ratio" not in sig and "adam_ratio" not in sig:
        return None
    Figure = import_mpl()
    titles = {"loss": "loss (tapped)", "update_ratio": "update ratio ||dw|| / ||w_before||",
              "adam_ratio": "Adam ratio RMS  g / (sqrt(v_hat) + eps)"}
    keys = [k for k in titles if k in sig]
    fig = Figure(figsize=(11, 2.6 * len(keys) + 0.6), dpi=100, layout="constrained")
    axes = fig.subplots(len(keys), 1, sharex=True, squeeze=False)[:, 0]
    spikes = sorted({int(a.step) for a in run.anomalies if a.kind == "spike"})
    x = run.steps
    for ax, k in zip(axes, keys):
        lines = np.array(list(sig[k].values()))  # [P, S]
        with np.errstate(all="ignore"):
            fin = np.where(np.isfinite(lines), lines, np.nan)
            top = np.nanmax(np.where(np.isnan(fin), -np.inf, fin), axis=0) if len(lines) else fin
        top = np.where(np.isfinite(top), top, np.nan)
        if len(lines) > 1:
            for v in fin:
                ax.plot(x, v, color="#9ab", linewidth=0.6, alpha=0.6)
        ax.plot(x, top, color="#c03", linewidth=1.8, label="max over parameters" if len(lines) > 1 else k)
        pos = fin[np.isfinite(fin)]
        if k != "loss" and pos.size and (pos > 0).all():
            ax.set_yscale("log")
        for s in spikes:
            ax.axvline(s, color="#f80", linewidth=1.0, linestyle="--")
        ax.set_title(titles[k] + (f" ({len(lines)} parameters)" if k != "loss" else ""), fontsize=10)
        ax.grid(True, color="#eeeeee", linewidth=0.5)
        if len(lines) > 1:
            ax.legend(loc="upper left", fontsize=8)
    axes[-1].set_xlabel("step" + ("  (dashed: spike anomalies)" if spikes else ""))
    fig.savefig(path)
    return path


def report(source, out=None, stat: str = "l2norm", metric: str | None = None) -> dict:
    """Write the plots and ``index.html`` for ``source`` (a History, a dump
    ``.npz``, a Parquet dataset directory or a JSONL file) into ``out``
    (default: ``<source>-report`` next to the file or directory, without its
    extension). Returns ``{"index", "heatmap", "nonfinite", "histogram",
    "quantiles", "crest", "kurtosis", "signals"}``
    -> path written (None for a plot the data cannot make)."""
    import_mpl()
    run = load_run(source)
    if stat not in run.stats:
        raise ValueError(f"--stat {stat!r}: not in {run.source}; available: {', '.join(run.stats)}")
    if metric is not None and metric not in run.names:
        raise ValueError(f"--metric {metric!r}: not in {run.source}; e.g. {', '.join(run.names[:5])}")
    if out is None:
        if not isinstance(source, (str, os.PathLike)):
            raise ValueError("report: out= is needed when the source is not a file")
        # Beside a dataset directory, never inside it ("run.parquet/" -> "run-report").
        out = os.path.splitext(os.fspath(source).rstrip("/" + os.sep))[0] + "-report"
    os.makedirs(out, exist_ok=True)
    first = first_nonfinite(run)
    metric = metric or default_metric(run, stat)
    files = {
        "heatmap": plot_heatmap(run, stat, os.path.join(out, "heatmap.png")),
        "nonfinite": plot_nonfinite(run, os.path.join(out, "nonfinite.png"), first),
        "histogram": plot_histogram(run, metric, os.path.join(out, "histogram.png")),
        "quantiles": plot_quantiles(run, metric, os.path.join(out, "quantiles.png")),
        "crest": plot_heatmap(run, "crest", os.path.join(out, "crest.png")) if "crest" in run.stats else None,
        "kurtosis": (plot_heatmap(run, "kurtosis", os.path.join(out, "kurtosis.png"))
                     if np.isfinite(run.stats.get("kurtosis", np.nan)).any() else None),
        "signals": plot_signals(run, os.path.join(out, "signals.png")),
        "attention": plot_attention(run, os.path.join(out, "attention.png")),
        "experts": plot_experts(run, os.path.join(out, "experts.png")),
        "channels": plot_channels(run, os.path.join(out, "channels.png")),
        "moved": plot_moved(run, os.path.join(out, "moved.png"))[0] if run.anomalies else None,
    }
    files["index"] = _write_index(run, out, stat, metric, first, files)
    return files


def _write_index(run: RunData, out: str, stat: str, metric: str, first, files: dict) -> str:
    e = html.escape
    steps = run.steps
    span = f"{len(steps)} recorded steps ({int(steps[0])}..{int(steps[-1])})" if len(steps) else "no steps"
    items = []
    if run.anomalies:
        for a in run.anomalies[:200]:
            items.append(f"<li>step {a.step} <b>{e(a.kind)}</b> <code>{e(a.name)}</code>: "
                         f"{e(a.message)}</li>")
        if len(run.anomalies) > 200:
            items.append(f"<li>... {len(run.anomalies) - 200} more</li>")
    elif first is not None:
        items.append(f"<li>step {first[0]} <b>nonfinite</b> <code>{e(first[1])}</code>: first metric in "
                     "execution order with NaN/Inf (from the data; the file holds no anomaly list)</li>")
    anomalies = "<ul>" + "".join(items) + "</ul>" if items else "<p>none</p>"
    skipped = ""
    if "optimizer/skipped" in run.names and "max" in run.stats:
        col = np.nan_to_num(run.stats["max"][:, run.names.index("optimizer/skipped")], nan=0.0)
        at = [int(x) for x in steps[col > 0]]
        skipped = f"<br>\n<b>skipped optimizer steps</b>: {len(at)}" + (f" (steps {', '.join(map(str, at[:50]))}" +
                                                                         (" ...)" if len(at) > 50 else ")") if at else "")
    sections = []
    captions = {
        "heatmap": f"{stat} per metric (rows, first-execution order) and step (columns)",
        "nonfinite": "NaN + Inf counts; the circle marks the first offender",
        "histogram": f"histogram of <code>{e(metric)}</code> over time",
        "quantiles": f"quantiles of <code>{e(metric)}</code> over time (median, p1-p99, p0.1-p99.9)",
        "crest": "crest factor (absmax / rms) per metric and step: outliers standing out from the bulk",
        "kurtosis": "kurtosis (Pearson; 3 for a normal distribution) per metric and step: heavy tails",
        "signals": "loss-spike signals: loss, update ratio and Adam ratio per parameter (bold: largest)",
        "attention": "max logit per attention head: layers x heads at the latest step, and over steps",
        "experts": "tokens per expert over steps, relative to the layer's mean (black: no token)",
        "channels": "outlier channels: the top channels by absmax at each step, and largest / median",
        "moved": "what moved first: the first movers before the anomaly, each row by its own z-score",
    }
    missing = {
        "nonfinite": "no non-finite timeline: the file has no nan/inf columns",
        "histogram": f"no histogram plot: {e(run.source)} holds no histograms for this metric",
    }
    optional = ("moved", "signals", "quantiles", "crest", "kurtosis", "attention", "experts", "channels")
    for key in ("moved", "signals", "heatmap", "nonfinite", "histogram", "quantiles", "crest", "kurtosis", "attention",
                "experts", "channels"):
        if key in optional and not files.get(key):
            continue  # nothing recorded for it: nothing to say
        if files.get(key):
            name = os.path.basename(files[key])
            sections.append(f'<h2>{captions[key]}</h2>\n<img src="{e(name)}" alt="{key}">')
        else:
            sections.append(f"<p><i>{missing[key]}</i></p>")
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>hookcap report: {e(os.path.basename(run.source))}</title>
<style>body{{font-family:sans-serif;margin:2em}} img{{max-width:100%;border:1px solid #ccc}}
code{{background:#f3f3f3}}</style></head>
<body>
<h1>hookcap report</h1>
<p><b>file</b>: <code>{e(run.source)}</code><br>
<b>steps</b>: {span}<br>
<b>metrics</b>: {len(run.names)}<br>
<b>stat</b>: {e(stat)}{skipped}</p>
<h2>anomalies</h2>
{anomalies}
{chr(10).join(sections)}
</body></html>
"""
    path = os.path.join(out, "index.html")
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return path


__all__ = ["RunData", "bin_labels", "first_nonfinite", "load_run", "plot_quantiles", "plot_signals", "read_jsonl", "report",
           "spike_signals"]
