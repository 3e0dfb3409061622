"""Per-kind cadence, ``Monitor(every={kind: N})``: each kind records exactly
the steps its N divides, with the values of those steps (float64 reference),
and launches nothing on the others."""

import collections

import numpy as np
import pytest
import torch
from torch import nn

import hookcap
from conftest import CountOps
from hookcap import Monitor


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


def _run(every, steps, capture=("output", "grad_output", "param_grad", "update"), **kw):
    """Train ``steps`` steps; returns (history, per-step float64 references)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref = collections.defaultdict(dict)
    mon = Monitor(model, capture=capture, every=every, optimizer=opt, **kw).attach()
    grads = {}
    model[2].register_full_backward_hook(lambda m, gi, go: grads.__setitem__("g", go[0].detach().double()))
    try:
        for s in range(steps):
            x = torch.randn(5, 6)
            y = model(x)
            loss = y.square().mean()
            hookcap.tap(loss.detach(), "loss")
            loss.backward()
            w0 = model[0].weight.detach().clone()
            ref["2/output"][s] = y.detach().double()
            ref["0.weight/param_grad"][s] = model[0].weight.grad.double()
            ref["2/grad_output"][s] = grads["g"]
            ref["loss"][s] = loss.detach().double().reshape(1)
            opt.step()
            ref["0.weight/update"][s] = (model[0].weight.detach() - w0).double()  # Δw as applied, float32
            opt.zero_grad()
    finally:
        mon.detach()
    return mon.history(), ref


@pytest.mark.parametrize("every", [
    {"output": 3, "grad_output": 3, "param_grad": 1, "update": 2},
    {"*": 4, "param_grad": 6},  # steps nothing records: 1, 2, 3, 5, 7, ...
    {"output": 5, "grad_output": 2, "tap": 3},  # output and gradient of one module apart
])
def test_each_kind_records_the_steps_its_n_divides(every):
    steps = 13
    h, ref = _run(every, steps)
    kind_of = {"2/output": "output", "2/grad_output": "grad_output", "0.weight/param_grad": "param_grad",
               "0.weight/update": "update", "loss": "tap"}
    n_of = {k: every.get(kind, every.get("*", 1)) for k, kind in kind_of.items()}
    union = sorted({s for s in range(steps) for n in n_of.values() if s % n == 0})
    assert list(h.steps) == union  # a step no kind records is not a step of the history
    for name, n in n_of.items():
        pos = {s: i for i, s in enumerate(h.steps)}
        for s in union:
            got = {st: h[st][:, h.column(name)][pos[s]] for st in ("count", "sum", "sumsq", "max", "absmax")}
            if s % n:
                assert np.isnan(got["count"]), (name, s)
                continue
            r = ref[name][s]
            assert got["count"] == r.numel(), (name, s)
            np.testing.assert_allclose(got["sum"], r.sum().item(), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(got["sumsq"], r.square().sum().item(), rtol=1e-5, atol=1e-7)
            # update: the step's formula in float64, against Δw as applied in float32
            np.testing.assert_allclose(got["max"], r.max().item(), rtol=1e-5)
            np.testing.assert_allclose(got["absmax"], r.abs().max().item(), rtol=1e-5)


def test_wraps_the_ring_many_times():
    """Rings of different cadences reuse their slots at their own pace (CPU:
    the host resets a slot for the step it next holds)."""
    h, ref = _run({"output": 7, "grad_output": 7, "param_grad": 2, "update": 3, "tap": 5}, 60)
    for name, n in (("2/output", 7), ("0.weight/param_grad", 2), ("0.weight/update", 3), ("loss", 5)):
        col = h["sum"][:, h.column(name)]
        for i, s in enumerate(h.steps):
            if s % n == 0:
                np.testing.assert_allclose(col[i], ref[name][s].sum().item(), rtol=1e-5, atol=1e-6)
            else:
                assert np.isnan(col[i])


def test_off_kinds_launch_nothing():
    """Activations every 10, gradients and updates every step: on the other
    steps no module hook runs a statistics op, and the parameter kinds do."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = Monitor(model, capture=("output", "grad_output", "param_grad", "update"),
                  every={"output": 10, "grad_output": 10, "param_grad": 1, "update": 1}, optimizer=opt).attach()
    per_step = []
    for s in range(12):
        count = CountOps()
        with count:
            model(torch.randn(4, 6)).sum().backward()
            opt.step()
            opt.zero_grad()
        per_step.append(dict(count.calls))
    mon.detach()
    for s, calls in enumerate(per_step):
        module_rows = 6 if s % 10 == 0 else 0  # 3 outputs and 3 gradients
        assert calls.get("accumulate", 0) == module_rows, (s, calls)
        assert calls.get("accumulate_many", 0) == 1 and calls.get("accumulate_updates", 0) == 1  # every gradient


def test_paused_and_resumed_steps_keep_each_cadence():
    """start_step, a paused block and load_state_dict's jump: each kind's
    rings keep their own step pattern."""
    model = _model()
    mon = Monitor(model, capture=("output", "param"), every={"output": 2, "param": 3}, start_step=4).attach()

    def steps(n):
        for _ in range(n):
            model(torch.randn(2, 6))
            mon.step()

    steps(2)  # 4, 5
    with mon.paused():
        steps(3)  # 6, 7, 8
    steps(4)  # 9 .. 12
    mon.load_state_dict({**mon.state_dict(), "step": 21})
    steps(4)  # 21 .. 24
    mon.detach()
    h = mon.history()
    out, par = h["count"][:, h.column("2/output")], h["count"][:, h.column("0.weight/param")]
    got = {s: (not np.isnan(o), not np.isnan(p)) for s, o, p in zip(h.steps, out, par)}
    want = {s: (s % 2 == 0, s % 3 == 0) for s in (4, 9, 10, 12, 21, 22, 24)}
    want |= {6: (False, False), 8: (False, False)}  # paused steps of a kind: recorded empty, as with every=N
    assert got == want, got


def test_compiled_model_keeps_each_cadence():
    model = _model()
    compiled = torch.compile(model, backend="aot_eager")
    mon = Monitor(model, capture=("output", "param"), every={"output": 3, "param": 2}).attach()
    ref = {}
    for s in range(7):
        x = torch.randn(3, 6)
        ref[s] = model(x).detach().double()
        compiled(x)
        mon.step()
    mon.detach()
    h = mon.history()
    col = h["sum"][:, h.column("2/output")]
    for i, s in enumerate(h.steps):
        if s % 3 == 0:  # the eager and the compiled call, merged
            np.testing.assert_allclose(col[i], 2 * ref[s].sum().item(), rtol=1e-5, atol=1e-6)
        else:
            assert np.isnan(col[i])
    assert list(h.steps) == [0, 2, 3, 4, 6]


def test_timing_follows_the_module_kinds():
    """Times belong to a module's metrics: timing rows are recorded at every
    step some module kind records (4 and 6: every 2nd)."""
    model = _model()
    mon = Monitor(model, capture=("output", "grad_output"), timing=True,
                  every={"output": 4, "grad_output": 6}).attach()
    for _ in range(13):
        model(torch.randn(2, 6)).sum().backward()
        mon.step()
    mon.detach()
    h = mon.history()
    assert list(h.steps) == [0, 4, 6, 8, 12]
    for name, n in (("2/output", 4), ("2/grad_output", 6)):
        recorded = [s % n == 0 for s in h.steps]
        assert [not np.isnan(v) for v in h["count"][:, h.column(name)]] == recorded
        assert [v > 0 for v in h["fwd_ms"][:, h.column(name)]] == recorded


@pytest.mark.parametrize("every, message", [
    ({"outptu": 2}, "unknown key 'outptu'"),
    ({"input": 2}, "'input' is not captured"),
    ({"timing": 2}, "unknown key 'timing'"),
    ({"output": 0}, "every\\['output'\\]: must be an int >= 1"),
    ({"*": 1.5}, "every\\['\\*'\\]: must be an int >= 1"),
    (0, "every: must be an int >= 1"),
])
def test_bad_every_is_a_clear_error(every, message):
    with pytest.raises(ValueError, match=message):
        Monitor(_model(), every=every)


def test_every_is_reported_as_given():
    every = {"output": 10, "*": 2}
    mon = Monitor(_model(), every=every)
    every["output"] = 1  # the caller's dict is not the Monitor's
    assert mon.every == {"output": 10, "*": 2}
