"""torch.amp.GradScaler on the CPU with fused and non-fused AdamW and SGD,
inf gradients planted at two iterations: one hookcap step per iteration,
History.skipped at those, update exactly 0 and no adam_ratio there, and
elsewhere update and adam_ratio of the unscaled step against float64."""

import numpy as np
import pytest
import torch
import torch.nn as nn

import hookcap
from hookcap import Monitor

SKIP_AT = (2, 4)
ITERATIONS = 6


def _opt(kind, params):
    if kind.startswith("adamw"):
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=kind.endswith("fused"),
                                 foreach=False if not kind.endswith("fused") else None)
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9, fused=kind.endswith("fused"),
                           foreach=False if not kind.endswith("fused") else None)


def _run(kind, pass_scaler):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 2))
    opt = _opt(kind, model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    adam = kind.startswith("adamw")
    capture = ("output", "update", "adam_ratio") if adam else ("output", "update")
    mon = Monitor(model, capture=capture, optimizer=opt, grad_scaler=scaler if pass_scaler else None).attach()
    g = torch.Generator().manual_seed(1)
    ref = []
    for it in range(ITERATIONS):
        loss = model(torch.randn(8, 6, generator=g)).pow(2).mean()
        hookcap.tap(loss, "loss")
        scaler.scale(loss).backward()
        if it in SKIP_AT:
            model[0].weight.grad[0, 0] = float("inf")
        scale = float(scaler.get_scale())
        before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
        grads = {n: p.grad.double() / scale for n, p in model.named_parameters()}
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        after = {n: p.detach().double().clone() for n, p in model.named_parameters()}
        ratio = {}
        if adam and it not in SKIP_AT:
            b2, eps = opt.param_groups[0]["betas"][1], opt.param_groups[0]["eps"]
            for n, p in model.named_parameters():
                st = opt.state[p]
                v = st["exp_avg_sq"].double() / (1 - b2 ** float(st["step"]))
                ratio[n] = grads[n] / (v.sqrt() + eps)
        ref.append({n: (after[n] - before[n], before[n], ratio.get(n)) for n in before})
    mon.detach()
    return mon.history(), ref


@pytest.mark.parametrize("kind,flag_on_device", [("adamw-fused", False), ("adamw", False), ("sgd-fused", False),
                                                  ("sgd", False), ("adamw-fused", True), ("sgd-fused", True)])
def test_skipped_steps_record_update_zero_and_one_step_per_iteration(kind, flag_on_device, monkeypatch):
    """flag_on_device: a fused step's found_inf treated as a GPU's, never
    read on the host: update against copies, adam_ratio in calls that
    record nothing where found_inf is set (DeviceRing.gated_state)."""
    if flag_on_device:
        monkeypatch.setattr(hookcap._capture.scaler, "flag_on_host", lambda found_inf: False)
    h, ref = _run(kind, pass_scaler=True)
    assert h.steps.tolist() == list(range(ITERATIONS))
    assert h.skipped.tolist() == [i in SKIP_AT for i in range(ITERATIONS)]
    c_loss = h.column("loss")
    assert h["count"][:, c_loss].tolist() == [1.0] * ITERATIONS  # no iteration folds into the next
    for s, per_param in enumerate(ref):
        for name, (delta, w0, ratio) in per_param.items():
            c = h.column(f"{name}/update")
            assert h["count"][s, c] == delta.numel()
            if s in SKIP_AT:
                assert float(delta.abs().max()) == 0.0
                assert h["zeros"][s, c] == delta.numel() and h["l2norm"][s, c] == 0.0
                if kind.startswith("adamw"):
                    assert np.isnan(h["count"][s, h.column(f"{name}/adam_ratio")])
                continue
            tol = 4 * 2.0 ** -24 * float(w0.abs().max()) * delta.numel() ** 0.5
            assert abs(h["l2norm"][s, c] - float(delta.norm())) <= tol + 1e-6 * float(delta.norm()), (s, name)
            if ratio is not None:
                cr = h.column(f"{name}/adam_ratio")
                assert h["count"][s, cr] == ratio.numel()
                np.testing.assert_allclose(h["l2norm"][s, cr], float(ratio.norm()), rtol=1e-5)
                np.testing.assert_allclose(h["max"][s, cr], float(ratio.max()), rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("kind", ["adamw-fused", "sgd-fused"])
def test_fused_optimizers_need_no_grad_scaler_argument(kind):
    """A fused optimizer's step is called on skipped iterations too (with
    GradScaler's found_inf): without grad_scaler= the same record."""
    h, ref = _run(kind, pass_scaler=False)
    assert h.steps.tolist() == list(range(ITERATIONS))
    assert h.skipped.tolist() == [i in SKIP_AT for i in range(ITERATIONS)]
    for s in SKIP_AT:
        assert h["l2norm"][s, h.column("0.weight/update")] == 0.0


def test_grad_scaler_needs_an_optimizer():
    with pytest.raises(ValueError, match="grad_scaler"):
        Monitor(nn.Linear(2, 2), grad_scaler=torch.amp.GradScaler("cpu"))
