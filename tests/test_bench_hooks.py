"""bench_overhead's direct per-hook timing measures the hook recording:
each direct call is a steady-state write of the module's output."""

import math
import pathlib
import sys

import numpy as np
import torch
from torch import nn

import hookcap

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_overhead  # noqa: E402


class Scale(nn.Module):
    def __init__(self, k):
        super().__init__()
        self.k = k

    def forward(self, x):
        return x * self.k


def test_direct_hook_cost_records_each_module_once_per_step():
    model = nn.Sequential(*[Scale(float(k + 1)) for k in range(5)])
    x = torch.tensor([1.0, -2.0, 0.0, 4.5])
    mon = hookcap.Monitor(model, capture="output")
    reps = 3
    us = bench_overhead.direct_hook_cost(model, x, mon, reps)
    assert set(us) == {"C", "Python"} and all(math.isfinite(v) for v in us.values())
    h = mon.history()
    xs = x.double().numpy()
    for k in range(5):
        c = h.column(f"{k}/output")
        # step 0: the chained forward pass (module k returns (k + 1)! x); then
        # one direct call per module, rep and hook (C, Python), on the
        # module's own output of x
        assert list(h["count"][:, c]) == [4] * (2 * reps + 1)
        want = [math.factorial(k + 1)] + [k + 1] * (2 * reps)
        np.testing.assert_allclose(h["sum"][:, c], np.array(want) * xs.sum(), rtol=1e-12)
        np.testing.assert_allclose(h["max"][:, c], np.array(want) * xs.max(), rtol=1e-12)
