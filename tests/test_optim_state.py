"""capture="optim_state": each watched parameter's optimizer state after the
optimizer's step, against float64 copies of the real torch.optim state
tensors."""

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import assert_recorded

import hookcap
from hookcap import Monitor

OPTIMIZERS = {
    "sgd-momentum": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
                     ["momentum_buffer"]),
    "adam": (lambda ps: torch.optim.Adam(ps, lr=1e-2), ["exp_avg", "exp_avg_sq"]),
    "adamw-amsgrad-foreach": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, foreach=True),
                              ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]),
}


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


@pytest.mark.parametrize("which", list(OPTIMIZERS))
def test_state_after_each_step_equals_the_optimizers(which):
    make_opt, keys = OPTIMIZERS[which]
    model = make_model()
    opt = make_opt(model.parameters())
    g = torch.Generator().manual_seed(1)
    kept = []
    with Monitor(model, capture=("param", "optim_state"), optimizer=opt) as mon:
        for _ in range(3):
            model(torch.randn(5, 6, generator=g)).pow(2).mean().backward()
            opt.step()  # the Monitor's step() runs right after it
            kept.append({(n, k): opt.state[p][k].double().clone() for n, p in model.named_parameters()
                         for k in keys})
            opt.zero_grad()
    h = mon.history()
    assert h.steps.tolist() == [0, 1, 2]
    for step, state in enumerate(kept):
        for (pname, key), v in state.items():
            metric = f"{pname}/state.{key}"
            assert_recorded(h, step, metric, [v])
            assert h.meta(metric)["kind"] == "optim_state"
            assert h.meta(metric)["module_type"] == type(opt).__name__
    # Adam's 0-d step counter is left out (not the parameter's shape).
    assert not [n for n in h.names if n.endswith("state.step")]


def test_every_and_wrapped_optimizer():
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    class Wrapper:  # accelerate-style: the real optimizer at .optimizer
        def __init__(self, o):
            self.optimizer = o

        def step(self):
            self.optimizer.step()

    with Monitor(model, capture="optim_state", optimizer=Wrapper(opt), every=2) as mon:
        for _ in range(4):
            model(torch.randn(3, 6)).sum().backward()
            opt.step()
            opt.zero_grad()
    h = mon.history()
    assert h.steps.tolist() == [0, 2]
    assert set(h.names) == {f"{n}/state.{k}" for n, _ in model.named_parameters() for k in ("exp_avg", "exp_avg_sq")}
    np.testing.assert_array_equal(h["count"][:, h.column("0.weight/state.exp_avg")], [48, 48])


def test_without_the_optimizer_one_warning_and_no_state(caplog, monkeypatch):
    from hookcap._capture import optim as _optim

    monkeypatch.setattr(_optim, "_warned_no_optimizer", False)
    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    with caplog.at_level("WARNING", logger="hookcap"):
        for _ in range(2):
            with Monitor(model, capture=hookcap.CAPTURE_KINDS) as mon:
                model(torch.randn(2, 6)).sum().backward()
                opt.step()
                mon.step()
    assert sum("optim_state" in r.getMessage() for r in caplog.records) == 1  # once per process
    assert not [n for n in mon.history().names if "/state." in n]
