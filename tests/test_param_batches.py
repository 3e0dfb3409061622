"""``param`` and ``param_grad`` recorded together: every parameter of a step
(``param``) or of a backward (``param_grad``) in one ``accumulate_many``
call per ring, with each gradient at its place in the execution order, the
values of each parameter alone (float64 references), and the cases where a
gradient must be read at once."""

import logging

import numpy as np
import torch
from torch import nn

from hookcap import Monitor


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _check(h, name, step, t):
    """The row of ``name`` at ``step`` equals float64 statistics of ``t``."""
    i = list(h.steps).index(step)
    r = t.detach().double()
    assert h["count"][:, h.column(name)][i] == r.numel()
    np.testing.assert_allclose(h["sum"][:, h.column(name)][i], r.sum().item(), rtol=1e-6, atol=1e-6 * r.abs().sum().item())
    np.testing.assert_allclose(h["sumsq"][:, h.column(name)][i], r.square().sum().item(), rtol=1e-6, atol=1e-12)
    assert h["max"][:, h.column(name)][i] == r.max().item() and h["min"][:, h.column(name)][i] == r.min().item()


def test_accumulated_gradients_are_recorded_once_per_step():
    """Two backward passes per step: the row holds the final accumulated
    gradient (count = numel, one call), and parameters are their values at step()."""
    model = _model()
    mon = Monitor(model, capture=("param", "param_grad", "output", "grad_output")).attach()
    seen = []
    for s in range(3):
        for _ in range(2):
            model(torch.randn(4, 5)).square().sum().backward()
        seen.append({n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()})
        mon.step()
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-0.1)
            p.grad = None
    mon.detach()
    h = mon.history()
    for s, params in enumerate(seen):
        for n, (w, g) in params.items():
            _check(h, f"{n}/param_grad", s, g)
            _check(h, f"{n}/param", s, w)


def test_gradients_keep_their_place_in_the_execution_order():
    """Each gradient sits where its parameter's gradient accumulated: after
    the gradient of the output of the module that owns it, before the next
    module's (backward order)."""
    model = _model()
    mon = Monitor(model, capture=("param_grad", "grad_output")).attach()
    model(torch.randn(4, 5)).sum().backward()
    mon.step()
    mon.detach()
    order = [n for n in mon.history().order(0) if not n.endswith("bias/param_grad")]
    assert order.index("2/grad_output") < order.index("2.weight/param_grad") < order.index("0/grad_output") \
        < order.index("0.weight/param_grad")


def test_an_optimizer_step_in_the_backward_reads_the_gradient_first():
    """A parameter with another post-accumulate hook (an optimizer step fused
    into the backward, which frees the gradient) is read at once, before it."""
    model = _model()
    mon = Monitor(model, capture="param_grad").attach()
    seen = {}

    def step_in_backward(p):
        seen[id(p)] = p.grad.clone()
        with torch.no_grad():
            p.add_(p.grad, alpha=-0.1)
        p.grad = None

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step_in_backward)
    model(torch.randn(4, 5)).square().sum().backward()
    mon.step()
    mon.detach()
    h = mon.history()
    for n, p in model.named_parameters():
        _check(h, f"{n}/param_grad", 0, seen[id(p)])


def test_a_gradient_changed_in_place_before_the_backward_ends_is_not_recorded(caplog):
    """Never a silently wrong value: a held gradient changed in place after it
    accumulated is left out of that step (NaN), with a warning; the others stand."""
    model = _model()
    mon = Monitor(model, capture="param_grad").attach()
    w2 = model[2].weight
    # model[0].weight accumulates after model[2].weight (backward order): its hook zeroes w2's gradient.
    def zero_w2(g):
        if w2.grad is not None:
            w2.grad.mul_(0)

    model[0].weight.register_hook(zero_w2)
    with caplog.at_level(logging.WARNING, logger="hookcap"):
        model(torch.randn(4, 5)).square().sum().backward()
    mon.step()
    mon.detach()
    h = mon.history()
    assert np.isnan(h["count"][:, h.column("2.weight/param_grad")][0])
    _check(h, "0.weight/param_grad", 0, model[0].weight.grad)
    assert any("changed in place" in r.getMessage() for r in caplog.records)


def test_a_backward_that_raises_leaves_nothing_held():
    model = _model()
    mon = Monitor(model, capture="param_grad").attach()

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("boom")

    x = torch.randn(4, 5, requires_grad=True)
    y = model(Boom.apply(x)).sum()
    try:
        y.backward()
    except RuntimeError:
        pass
    mon.step()
    for p in model.parameters():
        p.grad = None
    model(torch.randn(4, 5)).sum().backward()
    mon.step()
    mon.detach()
    h = mon.history()
    for n, p in model.named_parameters():
        _check(h, f"{n}/param_grad", 1, p.grad)


def test_one_bad_tensor_skips_only_its_own_metric(caplog):
    """A parameter the op cannot read (an int8 tensor given as a watched
    tensor's value) is skipped with a warning; the others of the call stand."""
    model = _model()
    mon = Monitor(model, capture="param").attach()
    model(torch.randn(2, 5))
    rec = mon._recorder
    with caplog.at_level(logging.WARNING, logger="hookcap"):
        rec.write_rows("param", [("a", torch.randn(6)), ("b", torch.randn(3, dtype=torch.complex64)),
                                 ("c", torch.randn(4))], "Parameter")
    mon.step()
    mon.detach()
    h = mon.history()
    assert "b/param" not in h.names and h["count"][:, h.column("a/param")][0] == 6 and h["count"][:, h.column("c/param")][0] == 4
    assert any("b/param" in r.getMessage() for r in caplog.records)
