"""Monitor(timing=True): per-module forward/backward durations in the ring.

Durations are checked against sleeps of known length inside the module's
forward and inside a custom backward (the reference: a module cannot finish
before its sleep has), with generous upper bounds because the machine is
shared. Nothing here asserts an absolute speed."""

import json
import math
import time

import numpy as np
import pytest
import torch
import torch.nn as nn

import hookcap
from hookcap import Monitor, _C, _layout, _ops
from hookcap.functional import new_state
from hookcap.models import TinyResNet

FWD_S, BWD_S = 0.02, 0.03
SLACK_MS = 400.0  # upper bound slack for a loaded machine


class SleepBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        time.sleep(BWD_S)
        return g


class Slow(nn.Module):
    """Sleeps FWD_S in forward and BWD_S in backward."""

    def __init__(self, n=8):
        super().__init__()
        self.lin = nn.Linear(n, n)

    def forward(self, x):
        time.sleep(FWD_S)
        return SleepBackward.apply(self.lin(x))


class Net(nn.Module):
    def __init__(self, n=8):
        super().__init__()
        self.first = nn.Linear(n, n)
        self.slow = Slow(n)
        self.act = nn.ReLU(inplace=True)
        self.last = nn.Linear(n, 1)

    def forward(self, x, twice=False):
        h = self.slow(self.first(x))
        if twice:
            h = self.slow(h)
        return self.last(self.act(h))


def run(model, mon, steps=2, twice=False):
    torch.manual_seed(1)
    for _ in range(steps):
        model(torch.randn(4, 8), twice=twice).sum().backward()
        mon.step()
    return mon.history()


def col(h, name):
    return h.column(name)


@pytest.mark.parametrize("python_hooks", [False, True], ids=["cpp-grad-hooks", "python-grad-hooks"])
def test_forward_and_backward_durations_bound_the_sleeps(monkeypatch, python_hooks):
    # Backward marks come from C++ tensor hooks, or Python ones where C++
    # hooks cannot run (compiled autograd; HOOKCAP_PYTHON_GRAD_HOOKS=1).
    monkeypatch.setattr(hookcap._capture.compile, "PYTHON_GRAD_HOOKS", python_hooks)
    torch.manual_seed(0)
    model = Net()
    mon = Monitor(model, modules=["first", "slow", "last"], timing=True).attach()
    h = run(model, mon, steps=3)
    fwd, bwd = h["fwd_ms"], h["bwd_ms"]
    assert fwd.shape == (3, len(h.names)) == bwd.shape
    for kind in ("output", "grad_output"):  # every metric of a module carries its times
        c = col(h, f"slow/{kind}")
        assert np.all(fwd[:, c] >= FWD_S * 1e3) and np.all(fwd[:, c] < FWD_S * 1e3 + SLACK_MS)
        assert np.all(bwd[:, c] >= BWD_S * 1e3) and np.all(bwd[:, c] < BWD_S * 1e3 + SLACK_MS)
    # Modules without sleeps are timed too, and far below the sleeps.
    c = col(h, "last/output")
    assert np.all(np.isfinite(fwd[:, c])) and np.all(fwd[:, c] >= 0) and np.all(fwd[:, c] < FWD_S * 1e3)
    assert np.all(np.isfinite(bwd[:, c])) and np.all(bwd[:, c] >= 0)
    # The first layer's input does not require grad: no backward end mark.
    c = col(h, "first/output")
    assert np.all(np.isfinite(fwd[:, c])) and np.all(np.isnan(bwd[:, c]))
    mon.detach()


def test_durations_sum_over_calls_in_a_step():
    model = Net()
    mon = Monitor(model, modules=["slow"], timing=True).attach()
    h = run(model, mon, steps=2, twice=True)
    c = col(h, "slow/output")
    assert np.all(h["fwd_ms"][:, c] >= 2 * FWD_S * 1e3)
    assert np.all(h["bwd_ms"][:, c] >= 2 * BWD_S * 1e3)
    assert np.all(h["fwd_ms"][:, c] < 2 * FWD_S * 1e3 + SLACK_MS)
    mon.detach()


def test_host_clock_matches_an_independent_stopwatch():
    # Forward time of a whole model (its root module) against perf_counter
    # around the same call: the marks sit inside the stopwatch's interval.
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    mon = Monitor(model, modules=lambda n, m: n == ".", timing=True).attach()
    walls = []
    for _ in range(3):
        x = torch.randn(256, 64)
        t0 = time.perf_counter()
        model(x)
        walls.append((time.perf_counter() - t0) * 1e3)
        mon.step()
    got = mon.history()["fwd_ms"][:, col(mon.history(), "./output")]
    assert np.all(got > 0) and np.all(got <= np.array(walls))
    mon.detach()


def test_every_and_untimed_steps():
    model = Net()
    mon = Monitor(model, modules=["slow"], timing=True, every=2).attach()
    h = run(model, mon, steps=4)
    assert list(h.steps) == [0, 2]
    assert np.all(h["fwd_ms"][:, col(h, "slow/output")] >= FWD_S * 1e3)
    mon.detach()


def test_forward_that_raises_reads_nan_then_recovers():
    class Flaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.fail = True

        def forward(self, x):
            if self.fail:
                self.fail = False
                raise RuntimeError("boom")
            return self.lin(x)

    model = Flaky()
    mon = Monitor(model, modules=lambda n, m: n == ".", timing=True).attach()
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError):
        model(x)
    model(x).sum().backward()  # same step: one start mark never closed
    mon.step()
    model(x).sum().backward()
    mon.step()
    h = mon.history()
    f = h["fwd_ms"][:, col(h, "./output")]
    assert math.isnan(f[0]) and np.isfinite(f[1]) and f[1] >= 0
    mon.detach()


def test_failing_backward_mark_is_reported_not_raised(caplog):
    # A backward mark runs in a C++ tensor hook: make its kernel fail (the sink
    # handed an int32 ring) and the error must surface as one warning at
    # step(), the step's bwd_ms NaN, training unharmed.
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    mon = Monitor(model, capture="output", timing=True).attach()
    x = torch.randn(3, 4)
    model(x).sum().backward()
    mon.step()
    y = model(x)
    rec = mon._recorder
    ring = rec.ring_list[0]
    rec.fast.set_ring(ring.index, ring.ring.int(), ring.state)
    y.sum().backward()
    rec.fast.set_ring(ring.index, ring.ring, ring.state)
    with caplog.at_level("WARNING", logger="hookcap"):
        mon.step()
    assert [r for r in caplog.records if "1 is no longer timed" in r.getMessage()]
    model(x).sum().backward()
    mon.step()
    h = mon.history()
    c0, c1 = col(h, "0/output"), col(h, "1/output")
    assert np.isfinite(h["bwd_ms"][0, c1]) and math.isnan(h["bwd_ms"][1, c1])
    assert np.isfinite(h["fwd_ms"][1, c1]) and math.isnan(h["fwd_ms"][2, c1])  # off from then on
    assert np.isfinite(h["fwd_ms"][2, c0])
    mon.detach()


def test_inplace_module_timed_without_a_gradient_copy():
    # First call: the input alias is modified in place (CopySlices) and the end
    # mark moves to that node. Later calls hook the input itself: no alias, so
    # autograd keeps the plain in-place graph (no CopySlices gradient copy).
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 1))
    mon = Monitor(model, capture="output", timing=True).attach()
    x = torch.randn(4, 8)
    kinds = []
    for _ in range(3):
        h1 = model[1](model[0](x))
        kinds.append(type(h1.grad_fn).__name__)
        model[2](h1).sum().backward()
        mon.step()
    assert kinds[0] != "ReluBackward0" and kinds[1:] == ["ReluBackward0"] * 2
    h = mon.history()
    bwd = h["bwd_ms"][:, col(h, "1/output")]
    assert np.all(np.isfinite(bwd)) and np.all(bwd >= 0)
    mon.detach()


def test_timing_does_not_change_outputs_or_gradients():
    def train(timing):
        torch.manual_seed(0)
        model = TinyResNet()  # in-place ReLUs after the aliased inputs
        mon = Monitor(model, timing=timing, capture=("output", "grad_output", "grad_input")).attach()
        outs = []
        for _ in range(2):
            torch.manual_seed(5)
            x = torch.randn(2, 3, 16, 16)
            y = model(x)
            y.float().square().mean().backward()
            outs.append(y.detach().clone())
            mon.step()
        grads = [p.grad.clone() for p in model.parameters()]
        mon.detach()
        return outs, grads, mon.history()

    o0, g0, h0 = train(False)
    o1, g1, h1 = train(True)
    for a, b in zip(o0 + g0, o1 + g1):
        assert torch.equal(a, b)
    assert h1.names == h0.names  # timing rows are not metrics
    for s in _layout.STAT_NAMES:
        np.testing.assert_array_equal(h1[s], h0[s])
    with pytest.raises(KeyError, match="timing=True"):
        h0["fwd_ms"]
    assert h1.stat_names == _layout.STAT_NAMES + _layout.TIMING_NAMES
    assert np.isfinite(h1["fwd_ms"]).any() and np.isfinite(h1["bwd_ms"]).any()


def test_ring_growth_between_forward_and_backward():
    # 40 layers: timing and stats rows outgrow the ring's first 64 rows during
    # the first forward; marks written before the growth must survive it.
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(40)])
    mon = Monitor(model, timing=True).attach()
    x = torch.randn(2, 4, requires_grad=True)
    for _ in range(2):
        model(x).sum().backward()
        mon.step()
    h = mon.history()
    cols = [col(h, f"{i}/output") for i in range(40)]
    assert np.all(np.isfinite(h["fwd_ms"][:, cols])) and np.all(np.isfinite(h["bwd_ms"][:, cols]))
    assert np.all(h["fwd_ms"][:, cols] >= 0) and np.all(h["bwd_ms"][:, cols] >= 0)
    mon.detach()


def test_save_load_drained_and_sinks(tmp_path):
    seen = []
    model = Net()
    sink = hookcap.sinks.JSONL(tmp_path / "s.jsonl", stats=("mean", "fwd_ms", "bwd_ms"))
    mon = Monitor(model, modules=["slow", "first"], timing=True, detectors=[],
                  sinks=[sink, hookcap.sinks.Callback(seen.append)]).attach()
    h = run(model, mon, steps=2)
    mon.detach()
    back = hookcap.load(h.save(tmp_path / "h"))
    assert back == h
    np.testing.assert_array_equal(back["fwd_ms"], h["fwd_ms"])
    d = seen[-1]
    i = d.names.index("slow/output")
    assert d.stats["fwd_ms"][i] == h["fwd_ms"][-1, col(h, "slow/output")]
    lines = [json.loads(line) for line in open(tmp_path / "s.jsonl")]
    last = [r for r in lines if r["name"] == "slow/output"][-1]
    assert last["fwd_ms"] == pytest.approx(h["fwd_ms"][-1, col(h, "slow/output")], rel=1e-12)
    assert [r for r in lines if r["name"] == "first/output"][-1]["bwd_ms"] is None


def test_everything_times_global_modules():
    model = Net()
    with Monitor.everything(model, timing=True) as mon:
        run(model, mon, steps=2)
    h = mon.history()
    assert np.all(h["fwd_ms"][:, col(h, "slow/output")] >= FWD_S * 1e3)


def test_bad_timing_argument():
    with pytest.raises(ValueError, match="timing"):
        Monitor(Net(), timing="yes")


def test_time_mark_op_cpu_and_opcheck():
    ring = torch.zeros((2, 3, _layout.HEADER), dtype=torch.int64)
    st = new_state("cpu")
    _ops.reset_slot(ring, st)
    _ops.time_mark(ring, st, 1, 0, True)
    time.sleep(0.005)
    _ops.time_mark(ring, st, 1, 0, False)
    r = ring[0, 1]
    assert r[_layout.FWD_OPEN] == 0 and r[_layout.FWD_ENDS] == 1 and r[_layout.FWD_NS] >= 5_000_000
    assert r[_layout.BWD_NS] == 0 and ring[0, 0].tolist() == ring[0, 2].tolist()
    with pytest.raises(RuntimeError, match="phase"):
        _ops.time_mark(ring, st, 1, 2, True)
    with pytest.raises(RuntimeError, match="out of range"):
        _ops.time_mark(ring, st, 3, 0, True)
    st[1] = 0  # disabled step: nothing written
    before = ring.clone()
    _ops.time_mark(ring, st, 1, 1, True)
    assert torch.equal(ring, before)
    torch.library.opcheck(torch.ops.hookcap.time_mark.default, (ring, new_state("cpu"), 0, 1, True))
