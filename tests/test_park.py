"""Off-steps (every > 1) take the Monitor's module hooks out of PyTorch's hook
dicts, so the model runs nn.Module's fast call path, and put them back in
their places for the recorded steps (hookcap/_capture/park.py)."""

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.nn.modules import module as nn_module

from hookcap import Monitor
from hookcap._capture.park import HookPark
from hookcap.reference import stats_from_values


def ours(mon, d):
    """Keys of dict ``d`` that belong to the Monitor's hook handles."""
    ids = {h.id for h in mon._hooks.handles if hasattr(h, "id")}
    return [k for k in d if k in ids]


def hook_dicts(mod):
    return (mod._forward_hooks, mod._forward_pre_hooks)


# -- HookPark on its own ------------------------------------------------------
def test_unpark_restores_place_among_other_hooks():
    m = nn.Identity()
    calls = []

    def tag(t):
        return lambda mod, args, out: calls.append(t)

    user_a = m.register_forward_hook(tag("a"))
    park = HookPark()
    mine1 = m.register_forward_hook(tag("mine1"))
    park.add(mine1)
    user_b = m.register_forward_hook(tag("b"))
    mine2 = m.register_forward_hook(tag("mine2"), prepend=True)  # runs first
    park.add(mine2)
    m(torch.ones(1))
    assert calls == ["mine2", "a", "mine1", "b"]

    park.park()
    calls.clear()
    m(torch.ones(1))
    assert calls == ["a", "b"]
    # Meanwhile the user removes a hook and adds two (one prepended).
    user_a.remove()
    m.register_forward_hook(tag("c"))
    m.register_forward_hook(tag("d"), prepend=True)
    park.unpark()
    calls.clear()
    m(torch.ones(1))
    # mine2 had no predecessor: it goes back to the front. mine1 followed
    # "a", gone now: it goes back after "a"'s predecessor that remains (none).
    assert calls == ["mine2", "mine1", "d", "b", "c"]
    park.unpark()  # idempotent
    park.park()
    park.park()
    calls.clear()
    m(torch.ones(1))
    assert calls == ["d", "b", "c"]
    user_b.remove()


def test_parked_with_kwargs_pre_hook_comes_back_with_kwargs():
    m = nn.Identity()
    seen = []
    h = m.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(dict(kwargs)), with_kwargs=True)
    park = HookPark()
    park.add(h)
    park.park()
    m(torch.ones(1))
    assert seen == [] and not m._forward_pre_hooks
    park.unpark()
    m(torch.ones(1))
    assert seen == [{}]


def test_remove_while_parked_removes_for_good():
    m = nn.Identity()
    h = m.register_forward_pre_hook(lambda mod, args, kwargs: None, with_kwargs=True)
    park = HookPark()
    park.add(h)
    park.park()
    h.remove()
    park.clear()
    park.unpark()
    assert not m._forward_pre_hooks and not m._forward_pre_hooks_with_kwargs


# -- through the Monitor ------------------------------------------------------
def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


@pytest.mark.parametrize("timing", [False, True])
def test_off_steps_run_without_hooks_and_records_match_reference(timing):
    model, twin = make_model(), make_model()
    capture = ("input", "output", "grad_input", "grad_output", "param_grad")
    mon = Monitor(model, capture=capture, every=3, timing=timing).attach()
    torch.manual_seed(1)
    xs = [torch.randn(5, 6, requires_grad=True) for _ in range(8)]
    ref = {}
    for step, x in enumerate(xs):
        hooked = [bool(d) for m in model.modules() for d in hook_dicts(m)]
        assert any(hooked) == (step % 3 == 0), f"step {step}: hooks present {hooked}"
        # telemetry changes nothing: same outputs and gradients as an unwatched twin
        x2 = x.detach().clone().requires_grad_()
        y, y2 = model(x), twin(x2)
        torch.testing.assert_close(y, y2, rtol=0, atol=0)
        y.pow(2).sum().backward()
        y2.pow(2).sum().backward()
        torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)
        with torch.no_grad():  # the first layer's output, without the hooks (the same op)
            ref[step] = torch.nn.functional.linear(x, model[0].weight, model[0].bias).double()
        for p in (*model.parameters(), *twin.parameters()):
            p.grad = None
        mon.step()
    mon.detach()
    assert not any(d for m in model.modules() for d in hook_dicts(m))
    h = mon.history()
    assert h.steps.tolist() == [0, 3, 6]
    c = h.column("0/output")
    for i, step in enumerate(h.steps.tolist()):
        r = stats_from_values(ref[step].numpy())
        assert h["count"][i, c] == r["count"]
        assert h["max"][i, c] == pytest.approx(r["max"], rel=1e-6)
        assert h["sum"][i, c] == pytest.approx(r["sum"], rel=1e-5, abs=1e-5)
        np.testing.assert_array_equal(h.histogram("0/output")[i], r["hist"])
    if timing:
        assert np.isfinite(h["fwd_ms"][:, c]).all()


def test_user_hook_after_the_monitor_stays_after_across_parking():
    # A user hook registered after the Monitor that replaces the output: the
    # Monitor ran first when attached, so it records the layer's own output;
    # it must still do so after every park/unpark cycle.
    model = make_model()
    mon = Monitor(model, capture="output", every=2).attach()
    model[0].register_forward_hook(lambda mod, args, out: out * 100)
    order0 = list(model[0]._forward_hooks)
    torch.manual_seed(2)
    raw = {}
    for step in range(6):
        x = torch.randn(4, 6)
        with torch.no_grad():
            raw[step] = (x @ model[0].weight.T + model[0].bias).double()
            model(x)
        if step % 2 == 0:
            assert list(model[0]._forward_hooks) == order0
        mon.step()
    h = mon.history()
    c = h.column("0/output")
    for i, step in enumerate(h.steps.tolist()):
        assert h["max"][i, c] == pytest.approx(raw[step].max().item(), rel=1e-6)


def test_detach_while_parked_and_reattach():
    model = make_model()
    mon = Monitor(model, capture="output", every=2).attach()
    x = torch.randn(3, 6)
    model(x)
    mon.step()  # step 1: off, parked
    assert not any(d for m in model.modules() for d in hook_dicts(m))
    mon.detach()
    assert not any(d for m in model.modules() for d in hook_dicts(m))
    mon.step()  # step 2 records, but detached: nothing is hooked
    assert not any(d for m in model.modules() for d in hook_dicts(m))
    mon.attach()  # still step 2, a recorded one: hooks in
    assert all(ours(mon, m._forward_hooks) for m in model.children())
    model(x)
    mon.step()
    mon.attach()  # idempotent on an off-step: stays parked
    assert not any(d for m in model.modules() for d in hook_dicts(m))
    mon.detach()
    h = mon.history()
    assert h.steps.tolist() == [0, 2]
    c = h.column("2/output")
    assert h["max"][0, c] == h["max"][1, c]


def test_every_one_never_parks():
    model = make_model()
    mon = Monitor(model, capture="output").attach()
    for _ in range(3):
        model(torch.randn(2, 6))
        mon.step()
        assert all(ours(mon, m._forward_hooks) for m in model.children())
    mon.detach()


def test_global_hooks_are_parked_too():
    model = make_model()
    before = dict(nn_module._global_forward_hooks)
    mon = Monitor.everything(model, capture="output", every=2).attach()
    try:
        model(torch.randn(2, 6))
        assert ours(mon, nn_module._global_forward_hooks)
        mon.step()
        assert not ours(mon, nn_module._global_forward_hooks)
        model(torch.randn(2, 6))
        mon.step()
        assert ours(mon, nn_module._global_forward_hooks)
        model(torch.randn(2, 6))
        mon.step()
    finally:
        mon.detach()
    assert dict(nn_module._global_forward_hooks) == before
    assert mon.history().steps.tolist() == [0, 2]


def test_model_first_compiled_during_an_off_step_still_records():
    # The first trace starts with the hooks parked: dynamo's compile-start
    # callback puts them back for good before it traces (dynamo does not
    # guard on module hooks: a graph traced without them would never record).
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    model = make_model()
    mon = Monitor(model, capture="output", every=3).attach()
    fn = torch.compile(model, fullgraph=True)
    torch.manual_seed(3)
    xs = [torch.randn(4, 6) for _ in range(10)]
    mon.step()  # step 0 records nothing: the first call is at step 1, parked
    graphs = []
    for x in xs[1:]:
        fn(x)
        mon.step()
        graphs.append(counters["stats"]["unique_graphs"])
    mon.detach()
    torch._dynamo.reset()
    assert not mon._hooks.park_ok
    assert graphs[0] == graphs[-1]  # traced once, with the hooks: no recompile
    h = mon.history()
    assert h.steps.tolist() == [0, 3, 6, 9]  # step 0 kept, empty (all NaN)
    c = h.column("0/output")
    assert np.isnan(h["count"][0, c])
    for i, step in enumerate(h.steps.tolist()[1:], start=1):
        ref = (xs[step] @ model[0].weight.T + model[0].bias).detach().double()
        assert h["count"][i, c] == ref.numel()
        assert h["max"][i, c] == pytest.approx(ref.max().item(), rel=1e-6)
        assert h["sum"][i, c] == pytest.approx(ref.sum().item(), rel=1e-5, abs=1e-5)


def test_model_compiled_at_a_recorded_step_keeps_its_hooks():
    # Traced with the hooks in place: the Monitor stops parking (a dynamo that
    # guards on module hooks would otherwise recompile at every change).
    torch._dynamo.reset()
    model = make_model()
    mon = Monitor(model, capture="output", every=3).attach()
    fn = torch.compile(model, fullgraph=True)
    for _ in range(4):
        fn(torch.randn(2, 6))
        mon.step()
        assert all(ours(mon, m._forward_hooks) for m in model.children())
    mon.detach()
    torch._dynamo.reset()
    assert mon.history().steps.tolist() == [0, 3]
