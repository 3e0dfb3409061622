"""Gradients captured by C++ tensor hooks (csrc/grad_hooks.cpp) against the
Python tensor-hook path they replace: the same rows, values, execution order
and fallbacks."""

import os
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn

import hookcap
import hookcap._capture.compile as compile_mod
from hookcap import Monitor


class Deep(nn.Module):
    """Enough layers that the ring (64 rows to start) grows, once in the
    forward and again in the backward (param_grad rows), with one module
    called twice per forward."""

    def __init__(self, n=24):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))
        self.act = nn.Tanh()

    def forward(self, x):
        for layer in self.layers:
            x = self.act(layer(x))
        return x


def run(python_hooks, monkeypatch, steps=3, micro=2):
    monkeypatch.setattr(compile_mod, "PYTHON_GRAD_HOOKS", python_hooks)
    torch.manual_seed(0)
    model = Deep()
    g = torch.Generator().manual_seed(1)
    xs = [[torch.randn(4, 8, generator=g) for _ in range(micro)] for _ in range(steps)]
    calls = []  # per step: the metric of every call, in execution order
    mon = Monitor(model, capture=("output", "grad_output", "param_grad"),
                  sinks=[hookcap.sinks.Callback(lambda d: calls.append(list(d.calls)))]).attach()
    for batch in xs:
        for x in batch:  # microbatches: forward, backward, forward, backward
            model(x).pow(2).sum().backward()
        model.zero_grad()
        mon.step()
    mon.detach()
    h = mon.history()
    return h, [h.order(s) for s in h.steps.tolist()], calls


def test_cpp_and_python_gradient_paths_agree(monkeypatch):
    h_py, order_py, calls_py = run(True, monkeypatch)
    h_cpp, order_cpp, calls_cpp = run(False, monkeypatch)
    assert sorted(h_cpp.names) == sorted(h_py.names)
    assert sum("/grad_output" in n for n in h_cpp.names) == 25  # 24 Linear + the shared Tanh
    assert h_cpp.steps.tolist() == h_py.steps.tolist() == [0, 1, 2]
    # Execution order (used to place the first NaN) is the same call by call,
    # across microbatches and param_grad writes made from Python mid-backward.
    assert order_cpp == order_py
    assert calls_cpp == calls_py
    for name in h_py.names:
        a, b = h_py.column(name), h_cpp.column(name)
        for stat in hookcap.STAT_NAMES:
            # Rows are created in a different order (C++ gradient rows at the
            # forward), so a reused module's calls merge in another order:
            # sums may differ in the last bit, nothing else.
            np.testing.assert_allclose(h_cpp[stat][:, b], h_py[stat][:, a], rtol=1e-13, atol=0,
                                       err_msg=f"{name} {stat}")
        for stat in ("count", "nan", "zeros", "min", "max", "absmax"):
            np.testing.assert_array_equal(h_cpp[stat][:, b], h_py[stat][:, a], err_msg=f"{name} {stat}")
        np.testing.assert_array_equal(h_cpp.histogram(name), h_py.histogram(name), err_msg=name)


def test_cpp_gradients_equal_float64_reference():
    # d(sum(y^2))/dy = 2y for the last layer's output.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    x = torch.randn(6, 5)
    with Monitor(model, capture=("output", "grad_output")) as mon:
        y = model(x)
        y.pow(2).sum().backward()
        mon.step()
    h = mon.history()
    got = {k: h[k][0, h.column("1/grad_output")] for k in ("count", "sum", "sumsq", "min", "max")}
    ref = hookcap.reference.tensor_stats(2 * y.detach())
    assert got["count"] == 18
    assert got["sum"] == pytest.approx(ref["sum"], rel=1e-6, abs=1e-6)
    assert got["sumsq"] == pytest.approx(ref["sumsq"], rel=1e-6)
    assert (got["min"], got["max"]) == (ref["min"], ref["max"])


def test_gradient_never_computed_leaves_no_metric():
    # A forward whose outputs require grad but never see a backward
    # (validation with grad enabled) names no gradient metric.
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with Monitor(model) as mon:
        model(torch.randn(2, 4))
        mon.step()
        model(torch.randn(2, 4)).sum().backward()
        mon.step()
    h = mon.history()
    assert h.names[:2] == ["0/output", "1/output"]
    assert set(h.names[2:]) == {"0/grad_output", "1/grad_output"}
    assert np.isnan(h["count"][0, h.column("0/grad_output")])
    assert h["count"][1, h.column("0/grad_output")] == 8


def test_detach_before_backward_records_no_gradient():
    model = nn.Sequential(nn.Linear(4, 4))
    mon = Monitor(model).attach()
    y = model(torch.randn(3, 4))
    mon.detach()
    y.sum().backward()  # the C++ hook is still on the graph: it must stay quiet
    mon.attach()
    mon.step()
    h = mon.history()
    assert "0/grad_output" not in h.names
    assert h["count"][0, h.column("0/output")] == 12


def test_compiled_autograd_around_eager_forward_uses_python_hooks():
    # Compiled autograd cannot trace C++ hooks: with it on, the Monitor
    # registers Python hooks, and the gradients still come out right.
    pytest.importorskip("torch._dynamo")
    from torch._dynamo import compiled_autograd

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    x = torch.randn(5, 4)
    with Monitor(model, capture=("output", "grad_output")) as mon:
        with compiled_autograd._enable(torch.compile(backend="eager")):
            y = model(x)
            y.pow(2).sum().backward()
        mon.step()
    h = mon.history()
    ref = hookcap.reference.tensor_stats(2 * y.detach())
    c = h.column("2/grad_output")
    assert h["count"][0, c] == 10
    assert h["sum"][0, c] == pytest.approx(ref["sum"], rel=1e-6, abs=1e-6)


def test_group_merge_of_mostly_single_rows_equals_full_merge():
    # step() merges only the metrics written by several calls and passes the
    # others through; the result must be the full merge, bit for bit.
    from hookcap import _layout as L

    rng = np.random.default_rng(0)
    split_plans = 0
    for _ in range(300):
        n = int(rng.integers(2, 40))
        groups = rng.integers(0, 2 * n, size=n)
        rows = rng.integers(0, 100, size=(n, L.HEADER + 5)).astype(np.int64)
        rows[:, 15] = 0  # the reserved column is always 0 in a ring
        rows[:, [L.SUM, L.SUMSQ, L.S1, L.S2, L.SHIFT]] = rng.normal(size=(n, 5)).view(np.int64)
        rows[rng.random(n) < 0.2, L.SHIFT] = L.SHIFT_UNSET
        fast = L.GroupPlan(groups)
        split_plans += fast.split is not None
        ids_a, out_a = L.merge_groups(rows, groups, L.GroupPlan(groups, _sub=False))
        ids_b, out_b = L.merge_groups(rows, groups, fast)
        np.testing.assert_array_equal(ids_a, ids_b)
        np.testing.assert_array_equal(out_a, out_b)
    assert split_plans > 100


@pytest.mark.parametrize("python_hooks", [True, False])
def test_backward_after_step_into_off_step_records_nothing(python_hooks, monkeypatch):
    # every=2: the forward of step 0 is recorded, its backward runs after
    # step() (step 1 records nothing), then step 2 runs normally. Both
    # gradient paths must leave step 0 without gradients and step 2 intact.
    monkeypatch.setattr(compile_mod, "PYTHON_GRAD_HOOKS", python_hooks)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    mon = Monitor(model, every=2).attach()
    y = model(torch.randn(3, 4))
    mon.step()
    y.sum().backward()
    mon.step()
    model(torch.randn(3, 4)).sum().backward()
    mon.step()
    mon.detach()
    h = mon.history()
    assert h.steps.tolist() == [0, 2]
    g = h.column("0/grad_output")
    assert np.isnan(h["count"][0, g]) and h["count"][1, g] == 12
    assert h.order(2) == ["0/output", "1/output", "1/grad_output", "0/grad_output"]


def test_cached_output_rows_follow_grad_mode_changes():
    # After a module's first calls, its rows are cached (one C call per
    # output); switching between no_grad and training must still record
    # exactly the kinds each step produced.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    x = torch.randn(3, 4)
    with Monitor(model) as mon:
        with torch.no_grad():
            model(x)
        mon.step()
        for _ in range(2):
            model(x).sum().backward()
            mon.step()
        with torch.no_grad():
            model(x)
        mon.step()
        model(x).pow(2).sum().backward()
        mon.step()
    h = mon.history()
    out, grad = h.column("1/output"), h.column("1/grad_output")
    np.testing.assert_array_equal(h["count"][:, out], [12] * 5)
    np.testing.assert_array_equal(h["count"][:, grad], [np.nan, 12, 12, np.nan, 12])
    y = model(x).detach()
    assert h["sum"][4, grad] == pytest.approx(float((2 * y).double().sum()), rel=1e-6, abs=1e-9)
    assert h["sum"][2, grad] == pytest.approx(12.0)  # d(sum y)/dy = 1


def test_failing_gradient_kernel_warns_and_never_breaks_backward(caplog):
    # If the op rejects a gradient inside a C++ hook (here: the sink is
    # pointed at a ring of the wrong width), backward still completes with
    # the same gradients, that call is reported once and skipped, and the
    # metric's later gradients are recorded as usual.
    from hookcap import _C

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    x = torch.randn(3, 4)
    ref = nn.Sequential(nn.Linear(4, 4))
    ref.load_state_dict(model.state_dict())
    ref(x).sum().backward()
    mon = Monitor(model).attach()
    y = model(x)
    rec = mon._recorder
    ring = rec.ring_list[0]
    bad = torch.zeros(ring.ring.shape[0], ring.ring.shape[1], 3, dtype=torch.int64)
    rec.fast.set_ring(ring.index, bad, ring.state)
    y.sum().backward()
    rec.fast.set_ring(ring.index, ring.ring, ring.state)
    with caplog.at_level("WARNING", logger="hookcap"):
        mon.step()
        model(x).sum().backward()
        mon.step()
    mon.detach()
    torch.testing.assert_close(model[0].weight.grad, 2 * ref[0].weight.grad)
    msgs = [r.getMessage() for r in caplog.records if "0/grad_output: a call was not recorded" in r.getMessage()]
    assert len(msgs) == 1 and "\n" not in msgs[0]
    h = mon.history()
    g = h.column("0/grad_output")
    np.testing.assert_array_equal(h["count"][:, g], [np.nan, 12])
    assert h["count"][1, h.column("0/output")] == 12


def test_steady_state_forward_takes_the_c_path_with_reference_values(monkeypatch):
    # After a step has taught the sink each call's rows, forward hooks make
    # no Python write at all (one C call each), and the values still match a
    # float64 reference for every call of the reused module.
    torch.manual_seed(0)
    model = Deep(n=3)
    g = torch.Generator().manual_seed(2)
    mon = Monitor(model).attach()
    model(torch.randn(4, 8, generator=g)).sum().backward()
    mon.step()
    writes = []
    real_write = mon._recorder.write
    monkeypatch.setattr(mon._recorder, "write", lambda *a, **k: (writes.append(a[:2]), real_write(*a, **k)))
    x = torch.randn(4, 8, generator=g)
    model(x).sum().backward()
    mon.step()
    mon.detach()
    assert writes == []
    h = mon.history()
    acts, y = [], x.double()
    with torch.no_grad():
        for layer in model.layers:
            y = torch.tanh(y @ layer.weight.double().T + layer.bias.double())
            acts.append(y)
    tanh = torch.cat([a.flatten() for a in acts])
    assert h["count"][1, h.column("act/output")] == tanh.numel()
    assert h["sum"][1, h.column("act/output")] == pytest.approx(float(tanh.sum()), rel=1e-5)
    assert h["max"][1, h.column("act/output")] == pytest.approx(float(tanh.max()), rel=1e-6)


def hookcap_python_calls(fn):
    """Names of hookcap's Python functions that ``fn()`` calls (sys.setprofile)."""
    here = os.path.dirname(hookcap.__file__)
    seen = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(here):
            seen.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def test_steady_state_forward_hooks_run_no_python_code():
    # The registered forward hook is C (grad_hooks.cpp output_hook): once the
    # sink knows a call's rows, a train-mode forward runs none of hookcap's
    # Python. First calls take the Python general path (tail); eval-mode calls
    # the Python hook (recorded under eval/). Planted: registering the Python
    # hook itself gives 8 "hook" calls on the second forward, and a C hook that
    # ignores the mode records the eval calls as train-mode ones.
    torch.manual_seed(0)
    model = Deep(n=4)
    x = torch.randn(3, 8)
    mon = Monitor(model, capture="output").attach()
    first = hookcap_python_calls(lambda: model(x))
    mon.step()
    second = hookcap_python_calls(lambda: model(x))
    mon.step()
    model.eval()
    evaluated = hookcap_python_calls(lambda: model(x))
    mon.step()
    mon.detach()
    assert first.count("tail") == 8  # 4 Linear + Tanh called 4 times
    assert second == []
    assert evaluated.count("hook") == 16  # the train-mode hook hands each call to the eval one
    h = mon.history()
    cols = [h.column(n) for n in h.names if not n.startswith("eval/")]
    assert len(cols) == 5
    for stat in ("count", "sum", "sumsq", "min", "max"):
        np.testing.assert_array_equal(h[stat][0, cols], h[stat][1, cols])  # the general path, then C
    assert h["count"][2, h.column("eval/act/output")] == 4 * 3 * 8
    with torch.no_grad():
        y = model.layers[0](x).double()
    assert h["sum"][1, h.column("layers.0/output")] == pytest.approx(float(y.sum()), rel=1e-6)


def test_failing_forward_kernel_in_the_c_path_warns_and_skips_the_row(caplog):
    # A cached output row whose kernel call fails (the sink pointed at a ring
    # of the wrong width) falls back to the general path, which reports that
    # call once and skips it; later calls are recorded; the gradient and the
    # model's outputs are untouched.
    from hookcap import _C

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    x = torch.randn(3, 4)
    mon = Monitor(model).attach()
    model(x).sum().backward()
    mon.step()
    rec = mon._recorder
    ring = rec.ring_list[0]
    bad = torch.zeros(ring.ring.shape[0], ring.ring.shape[1], 3, dtype=torch.int64)
    rec.fast.set_ring(ring.index, bad, ring.state)
    with caplog.at_level("WARNING", logger="hookcap"):
        y = model(x)
    rec.fast.set_ring(ring.index, ring.ring, ring.state)
    y.sum().backward()
    mon.step()
    model(x).sum().backward()
    mon.step()
    mon.detach()
    torch.testing.assert_close(y, model(x))
    assert sum("0/output: a call was not recorded" in r.getMessage() for r in caplog.records) == 1
    h = mon.history()
    out, grad = h.column("0/output"), h.column("0/grad_output")
    np.testing.assert_array_equal(h["count"][:, out], [12, np.nan, 12])
    np.testing.assert_array_equal(h["count"][:, grad], [12, 12, 12])


def test_direct_kernel_calls_equal_the_op_and_stay_visible_to_profilers():
    # The C++ hooks call the kernel directly (no dispatcher round trip) unless
    # a profiler or a Python dispatch mode watches: a profiled step records the
    # same rows as an unprofiled one, and the profiler sees one op per write.
    torch.manual_seed(0)
    model = Deep(4)
    x = torch.randn(3, 8)
    mon = Monitor(model, capture=("output", "grad_output")).attach()
    model(x).sum().backward()  # the first call of each module: Python's op path
    mon.step()
    fast = mon._recorder.fast
    op_writes = []
    for profiled in (False, True):
        before = fast.op_writes()
        if profiled:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                model(x).sum().backward()
        else:
            model(x).sum().backward()
        mon.step()
        op_writes.append(fast.op_writes() - before)
    mon.detach()
    # Unprofiled, every cached write went straight to the kernel (the tensors
    # carry autograd and autocast keys, which the op falls through).
    assert op_writes == [0, 16]
    h = mon.history()
    assert len(h.names) == 10  # 4 Linear + the Tanh called 4 times, output and grad_output
    for stat in ("count", "sum", "sumsq", "min", "max", "absmax"):
        direct, through_op = h[stat][1:]  # steps 1 and 2
        np.testing.assert_array_equal(direct, through_op)
    ops = [e for e in prof.events() if e.name == "hookcap::accumulate"]
    assert len(ops) == 16  # one per module call and per gradient


@pytest.mark.parametrize("make", [torch._neg_view, torch._efficientzerotensor], ids=["neg_view", "zero_tensor"])
def test_lazy_tensors_resolve_before_the_direct_kernel(make):
    # A negated view (its memory holds -value) and an efficient zero tensor (no
    # memory) are resolved by the dispatcher: the C++ hooks' direct kernel calls
    # must not read their memory as values, on the cached steps either.
    class Lazy(nn.Module):
        def forward(self, x):
            y = x * 2.0
            return make(y) if make is torch._neg_view else make(y.shape)

    x = torch.randn(4, 8, dtype=torch.float64)
    model = Lazy()
    mon = Monitor(model, capture="output").attach()
    for _ in range(3):
        model(x)
        mon.step()
    mon.detach()
    h = mon.history()
    ref = -2.0 * x if make is torch._neg_view else torch.zeros_like(x)
    for stat, want in (("sum", ref.sum()), ("min", ref.min()), ("max", ref.max()), ("count", ref.numel())):
        np.testing.assert_allclose(h[stat][:, 0], float(want), rtol=1e-12)
