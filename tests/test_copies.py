"""Deep copies (EMA, teacher, AveragedModel) and pickles (torch.save(model))
of a watched model: they carry none of hookcap's hooks, record nothing into
the original's Monitor, and the original keeps recording exactly its own calls."""

import copy
import io
import pickle

import numpy as np
import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, update_bn

import hookcap
from hookcap._capture import portable as _portable


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def hookcap_hooks(model):
    """(module name, dict, id) of every module hook whose id a Monitor holds, and
    the parameters with gradient hooks."""
    found = [(n, d, i) for n, m in model.named_modules() for d in _portable.HOOK_DICTS
             for i in getattr(m, d) if i in _portable._ids]
    found += [n for n, p in model.named_parameters() if p._post_accumulate_grad_hooks]
    return found


def check_outputs(h, step, name, tensors):
    """The step's statistics of ``name`` equal a float64 computation of ``tensors``."""
    vals = torch.cat([t.detach().double().reshape(-1) for t in tensors]).numpy()
    s, c = list(h.steps).index(step), h.column(name)
    assert h["count"][s, c] == vals.size
    np.testing.assert_allclose(h["sum"][s, c], vals.sum(), rtol=1e-6, atol=1e-9)
    assert h["max"][s, c] == vals.max() and h["min"][s, c] == vals.min()


def test_ema_copy_records_nothing_and_carries_no_hook():
    model = make_model()
    user_calls = []
    model[0].register_forward_hook(lambda m, a, o: user_calls.append(m))  # the user's own hook
    mon = hookcap.Monitor(model, capture=("output", "grad_output", "param_grad")).attach()
    ema = copy.deepcopy(model)
    assert hookcap_hooks(ema) == [] and len(hookcap_hooks(model)) > 0
    x = torch.randn(8, 6)
    for step in range(3):
        out = model(x)
        out.square().sum().backward()
        with torch.no_grad():  # the EMA update and the EMA model's evaluation
            for pe, p in zip(ema.parameters(), model.parameters()):
                pe.mul_(0.9).add_(p, alpha=0.1)
            ema(x * 50)
        ema(x * 50).sum().backward()
        with mon.paused():
            first = model[0](x)
        mon.step()
        model.zero_grad()
    h = mon.history()
    check_outputs(h, 2, "0/output", [first])
    assert (h["count"][:, h.column("3/output")] == 8 * 3).all()  # the model's own call, once per step
    assert len(user_calls) == 3 + 3 * 3  # the user's hook came along with the copy (3 EMA forwards per step)
    mon.detach()
    assert hookcap_hooks(model) == [] and hookcap_hooks(ema) == []
    assert "__getstate__" not in model[0].__dict__


def test_averaged_model_and_update_bn_leave_the_original_metrics_alone():
    model = make_model()
    mon = hookcap.Monitor(model, capture=("output",)).attach()
    swa = AveragedModel(model)
    x = torch.randn(8, 6)
    model(x)
    swa.update_parameters(model)
    update_bn([torch.randn(8, 6) * 10 for _ in range(4)], swa)
    swa(x)
    mon.step()
    h = mon.history()
    with mon.paused():
        ref = model[0](x)
    assert (h["count"][-1] == [8 * 16, 8 * 16, 8 * 16, 8 * 3]).all()
    check_outputs(h, 0, "0/output", [ref])
    assert hookcap_hooks(swa) == []
    mon.detach()


@pytest.mark.parametrize("how", ["torch.save", "pickle"])
def test_saving_a_watched_model_round_trips_without_hooks(how):
    model = make_model()
    model.eval()
    mon = hookcap.Monitor(model, capture=("output", "param")).attach()
    x = torch.randn(5, 6)
    model(x)
    if how == "torch.save":
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
    else:
        loaded = pickle.loads(pickle.dumps(model))
    assert hookcap_hooks(loaded) == []
    assert all(not getattr(m, d) for m in loaded.modules() for d in _portable.HOOK_DICTS)
    assert "__getstate__" not in loaded[0].__dict__
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    loaded(x * 3)  # records nothing into the original's Monitor
    mon.step()
    h = mon.history()
    assert h["count"][-1, h.column("eval/3/output")] == 2 * 5 * 3  # the model's two calls
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, state[k], rtol=0, atol=0)
    mon.detach()


def test_two_monitors_and_parked_hooks_stay_out_of_copies():
    model = make_model()
    a = hookcap.Monitor(model, capture=("output",)).attach()
    b = hookcap.Monitor(model, capture=("output",), every=2).attach()
    x = torch.randn(4, 6)
    model(x)
    a.step()
    b.step()  # b's hooks are parked for its off-step
    c = copy.deepcopy(model)
    assert hookcap_hooks(c) == []
    a.detach()
    assert "__getstate__" in model[0].__dict__  # b still has hooks there
    assert hookcap_hooks(copy.deepcopy(model)) == []
    b.detach()
    assert "__getstate__" not in model[0].__dict__ and hookcap_hooks(model) == []
