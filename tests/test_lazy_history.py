"""History decodes on demand: each statistic and histogram equals a full
decode of the steps' rows, and reading one costs memory of that one metric or
statistic, not of the whole run."""

import tracemalloc

import numpy as np
import torch

import hookcap
from hookcap import _layout


def run(metrics=60, steps=12, histogram=hookcap.Histogram.log2(), timing=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(metrics // 2)])
    mon = hookcap.Monitor(model, capture=("output", "grad_output"), histogram=histogram, timing=timing).attach()
    for step in range(steps):
        x = torch.randn(3, 4)
        if step % 3 == 1:
            x[0, 0] = float("nan")
        x[1] = 0.0  # zeros: log2's bin 0 comes from the zeros column
        model(x).sum().backward()
        mon.step()
    mon.detach()
    return mon


def test_each_statistic_and_histogram_equals_a_full_decode():
    for histogram in (hookcap.Histogram.log2(), hookcap.Histogram.linear(-2, 2, 50), None):
        mon = run(histogram=histogram, timing=histogram is None)
        h = mon.history()
        S, M = len(h.steps), len(h.names)
        full = np.zeros((S, M, _layout.HEADER), dtype=np.int64)
        for s, r in enumerate(h._records):
            full[s, r.metrics] = r.packed.header() if r.packed is not None else r.header
        want = _layout.decode(full)
        recorded = full[..., _layout.CALLS] > 0
        for stat in _layout.STAT_NAMES:
            w = np.where(recorded, want[stat], np.nan)
            np.testing.assert_array_equal(h[stat], w, err_msg=stat)
        if histogram is not None:
            for m, name in enumerate(h.names):
                ref = np.zeros((S, histogram.nbins), dtype=np.int64)
                for s, r in enumerate(h._records):
                    lo, band = r.packed.histogram()
                    hit = np.flatnonzero(r.metrics == m)
                    if hit.size:
                        ref[s, lo:lo + band.shape[1]] = band[hit[0]]
                np.testing.assert_array_equal(h.histogram(name), ref, err_msg=name)
        else:
            assert "fwd_ms" in h.stat_names and np.isfinite(h["fwd_ms"]).any()
        assert hookcap.History.concat([h]) == h


def peak(fn):
    tracemalloc.start()
    fn()
    _, p = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return p


def test_reading_one_metric_costs_memory_of_that_metric():
    mon = run(metrics=400, steps=40)
    S, M, B = 40, 400, hookcap.Histogram.log2().nbins
    # Records over the store's packed steps: nothing decoded (eagerly, every statistic: 17 x S x M x 8).
    assert peak(mon.history) < mon._consumers.store.nbytes < 17 * S * M * 8
    h = mon.history()
    assert peak(lambda: h["l2norm"]) < 3 * S * M * 8  # the [S, M] answer and a step's columns
    assert peak(lambda: h.histogram(h.names[5])) < 4 * S * B * 8 + 64 * 1024  # one metric's [S, B]
