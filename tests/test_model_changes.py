"""A model that changes after attach(): replaced parameters (meta init and
to_empty(), load_state_dict(assign=True), a reassigned nn.Parameter, to(dtype))
and modules added. `param` and `param_grad` follow the tensors the model holds
at each step, and an added module is recorded from the next step, each value
checked against a float64 computation of the tensors themselves."""

import logging

import numpy as np
import pytest
import torch
from torch import nn

import hookcap


def mlp():
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def check(h, step, name, t):
    """The step's statistics of ``name`` equal a float64 computation of ``t``."""
    v = t.detach().double().reshape(-1).numpy()
    s, c = list(h.steps).index(step), h.column(name)
    assert h["count"][s, c] == v.size, (step, name)
    # float32 values are summed in float within a run: exact to ~1e-7 of sum |v|.
    assert abs(h["sum"][s, c] - v.sum()) <= 1e-6 * np.abs(v).sum(), (step, name)
    np.testing.assert_allclose(h["l2norm"][s, c], np.sqrt((v * v).sum()), rtol=1e-6, err_msg=f"{step} {name}")
    assert h["max"][s, c] == v.max() and h["min"][s, c] == v.min()


def train(model, mon, steps, change=None, x=None):
    """SGD steps; ``change(step)`` runs before each step's forward. Returns, per
    step, the parameters (at step()) and gradients (after backward) by name."""
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(1)) if x is None else x
    seen = []
    for step in range(steps):
        if change:
            change(step)
        model(x.to(next(model.parameters()).dtype)).square().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        mon.step()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
        model.zero_grad(set_to_none=True)
        seen.append((params, grads))
    return seen


def check_params(h, seen, steps=None):
    for step, (params, grads) in enumerate(seen):
        if steps is not None and step not in steps:
            continue
        for n in params:
            check(h, step, f"{n}/param", params[n])
            check(h, step, f"{n}/param_grad", grads[n])


def test_meta_init_then_to_empty():
    with torch.device("meta"):
        model = mlp()
    mon = hookcap.Monitor(model, capture=("param", "param_grad", "output")).attach()
    torch.manual_seed(0)
    model.to_empty(device="cpu")
    for m in model:
        if isinstance(m, nn.Linear):
            m.reset_parameters()
    seen = train(model, mon, 3)
    h = mon.history()
    check_params(h, seen)  # step 0 too: the gradient of the replaced parameters, read at step()
    mon.detach()


def test_load_state_dict_assign_and_reassigned_parameter(caplog):
    torch.manual_seed(0)
    model = mlp()
    donor = mlp()
    mon = hookcap.Monitor(model, capture=("param", "param_grad")).attach()

    def change(step):
        if step == 1:
            model.load_state_dict(donor.state_dict(), assign=True)
        if step == 3:
            model[2].weight = nn.Parameter(torch.randn(3, 7))

    with caplog.at_level(logging.INFO, logger="hookcap"):
        seen = train(model, mon, 5, change)
    h = mon.history()
    check_params(h, seen)
    assert any("replaced or added since attach()" in r.getMessage() for r in caplog.records)
    mon.detach()
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())  # every binding's hook removed


def test_to_dtype_after_attach():
    torch.manual_seed(0)
    model = mlp()
    mon = hookcap.Monitor(model, capture=("param", "param_grad")).attach()
    train(model, mon, 1)
    model.to(torch.float64)
    seen = train(model, mon, 2)
    h = mon.history()
    for i, (params, grads) in enumerate(seen):
        for n in params:
            assert params[n].dtype == torch.float64
            check(h, i + 1, f"{n}/param", params[n])
            check(h, i + 1, f"{n}/param_grad", grads[n])
    mon.detach()


@pytest.mark.parametrize("every", [1, 2])
def test_module_added_after_attach_is_hooked_at_the_next_step(every):
    torch.manual_seed(0)
    model = mlp()
    mon = hookcap.Monitor(model, capture=("output", "param"), every=every).attach()
    x = torch.randn(6, 5)
    model(x)
    mon.step()
    model.append(nn.Linear(3, 2))  # qualified name "3"
    outs = []
    for _ in range(4):
        model(x)
        with mon.paused():
            outs.append(model(x))
        mon.step()
    h = mon.history()
    assert "3/output" in h.names and "3.weight/param" in h.names
    # Added during step 1: hooked by the step() that closes it, recorded from step 2.
    for step in h.steps:
        if step < 2:
            assert np.isnan(h["count"][list(h.steps).index(step), h.column("3/output")])
        else:
            check(h, step, "3/output", outs[step - 1])
            check(h, step, "3.weight/param", model[3].weight)
    mon.detach()
    assert not model[3]._forward_hooks
