"""capture="update" and "adam_ratio": the optimizer's step per parameter,
recomputed by the fused op from the parameter and the optimizer's state after
the step, against an independent float64 recomputation of the same step from
float64 copies of what the optimizer held before it (the real torch.optim
classes, hypothesis-drawn hyper-parameters)."""

import logging

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import hookcap
from hookcap import Monitor

RTOL = 1e-6  # norms and extrema; counts exact


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 16), nn.Tanh(), nn.Linear(16, 3))


# -- the float64 reference: torch.optim's documented algorithms, step by step --------------


def ref_sgd(w0, g, buf, hp):
    g = -g if hp["maximize"] else g
    if hp["weight_decay"]:
        g = g + hp["weight_decay"] * w0
    if hp["momentum"]:
        buf = g.copy() if buf is None else hp["momentum"] * buf + (1 - hp["dampening"]) * g
        d = g + hp["momentum"] * buf if hp["nesterov"] else buf
    else:
        d = g
    return {"update": -hp["lr"] * d}


def ref_adam(w0, g, st_, hp, decoupled):
    b1, b2 = hp["betas"]
    g = -g if hp["maximize"] else g
    wd = hp["weight_decay"]
    if wd and not decoupled:
        g = g + wd * w0
    t = st_["step"] + 1
    m = b1 * st_["exp_avg"] + (1 - b1) * g
    v = b2 * st_["exp_avg_sq"] + (1 - b2) * g * g
    if hp["amsgrad"]:
        v = np.maximum(st_["max_exp_avg_sq"], v)
    denom = np.sqrt(v) / np.sqrt(1 - b2 ** t) + hp["eps"]
    upd = -(hp["lr"] / (1 - b1 ** t)) * m / denom
    if wd and decoupled:
        upd = upd - hp["lr"] * wd * w0
    return {"update": upd, "adam_ratio": g / denom}


def before_step(opt, model):
    """float64 copies of every parameter, gradient and state tensor."""
    out = {}
    for n, p in model.named_parameters():
        s = opt.state.get(p, {})
        out[n] = {
            "w": p.detach().double().numpy().copy(),
            "g": p.grad.double().numpy().copy(),
            "state": {k: (float(v) if k == "step" else v.double().numpy().copy())
                      for k, v in s.items() if isinstance(v, torch.Tensor)},
        }
    return out


def reference(opt, snap):
    hp = opt.param_groups[0]
    out = {}
    if not isinstance(opt, (torch.optim.SGD, torch.optim.Adam)):
        return out
    for n, d in snap.items():
        if isinstance(opt, torch.optim.SGD):
            r = ref_sgd(d["w"], d["g"], d["state"].get("momentum_buffer"), hp)
        else:
            st_ = {"step": 0.0, "exp_avg": 0 * d["w"], "exp_avg_sq": 0 * d["w"], "max_exp_avg_sq": 0 * d["w"]}
            st_.update(d["state"])
            r = ref_adam(d["w"], d["g"], st_, hp, isinstance(opt, torch.optim.AdamW)
                         or hp.get("decoupled_weight_decay", False))
        r["base"] = d["w"]
        out[n] = r
    return out


def assert_close(h, step, name, vals):
    """``name``'s stats at ``step`` against the float64 values: counts exact,
    norms within RTOL, mean and signed extrema within RTOL of the scale."""
    vals = np.asarray(vals, np.float64).reshape(-1)
    s = h.steps.tolist().index(step)
    m = h.column(name)
    want = hookcap.reference.stats_from_values(vals, None)
    for k in ("count", "nan", "inf", "finite"):
        assert h[k][s, m] == want[k], (name, k)
    for k in ("l2norm", "rms", "absmax"):
        np.testing.assert_allclose(h[k][s, m], want[k], rtol=RTOL, err_msg=f"{name} {k}")
    # An element's value can cancel (g + μ·buf), and each stored state value
    # carries its dtype's rounding: signed extrema and the mean are held to
    # RTOL of the tensor's scale.
    for k, scale in (("min", want["absmax"]), ("max", want["absmax"]), ("mean", float(np.abs(vals).mean()))):
        assert abs(h[k][s, m] - want[k]) <= RTOL * scale, (name, k, h[k][s, m], want[k])
    if h.histogram_spec is not None:
        assert h.histogram(name)[s].sum() == want["finite"]


def run(make_opt, kinds=("update",), steps=3, seed=0, **mon_kw):
    model = make_model(seed)
    opt = make_opt(model.parameters())
    g = torch.Generator().manual_seed(seed + 1)
    refs = []
    with Monitor(model, capture=kinds, optimizer=opt, **mon_kw) as mon:
        for _ in range(steps):
            model(torch.randn(5, 7, generator=g)).pow(2).mean().backward()
            snap = before_step(opt, model)
            opt.step()
            refs.append(reference(opt, snap))
            opt.zero_grad()
    return mon.history(), refs


def check_all(h, refs, kinds):
    for step, ref in enumerate(refs):
        for pname, r in ref.items():
            for kind in kinds:
                assert_close(h, step, f"{pname}/{kind}", r[kind])
            if "update" in kinds:
                assert_close(h, step, f"{pname}/update.base", r["base"])
                want = np.linalg.norm(r["update"]) / np.linalg.norm(r["base"])
                np.testing.assert_allclose(h.update_ratio(pname)[step], want, rtol=RTOL)


SGD_CASES = st.fixed_dictionaries({
    "lr": st.floats(1e-4, 0.5), "weight_decay": st.sampled_from([0.0, 1e-3, 0.1]),
    "momentum": st.sampled_from([0.0, 0.5, 0.9]), "dampening": st.sampled_from([0.0, 0.3]),
    "nesterov": st.booleans(), "maximize": st.booleans(), "impl": st.sampled_from(["for", "foreach", "fused"]),
})


@settings(max_examples=30, deadline=None)
@given(SGD_CASES)
def test_sgd_update_matches_float64_recomputation(hp):
    if hp["nesterov"] and (hp["momentum"] == 0 or hp["dampening"] != 0):
        hp["nesterov"] = False  # torch: Nesterov needs momentum and zero dampening
    impl = hp.pop("impl")
    kw = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    h, refs = run(lambda ps: torch.optim.SGD(ps, **hp, **kw))
    check_all(h, refs, ("update",))


ADAM_CASES = st.fixed_dictionaries({
    "lr": st.floats(1e-4, 0.1), "weight_decay": st.sampled_from([0.0, 1e-2, 0.1]),
    "betas": st.tuples(st.sampled_from([0.0, 0.8, 0.9]), st.sampled_from([0.9, 0.99, 0.999])),
    "eps": st.sampled_from([1e-8, 1e-6, 1e-3]), "amsgrad": st.booleans(), "maximize": st.booleans(),
    "cls": st.sampled_from(["Adam", "AdamW"]), "impl": st.sampled_from(["for", "foreach", "fused"]),
})


@settings(max_examples=40, deadline=None)
@given(ADAM_CASES)
def test_adam_update_and_ratio_match_float64_recomputation(hp):
    cls = getattr(torch.optim, hp.pop("cls"))
    impl = hp.pop("impl")
    kw = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    kinds = ("update", "adam_ratio")
    h, refs = run(lambda ps: cls(ps, **hp, **kw), kinds=kinds)
    check_all(h, refs, kinds)


def test_adam_decoupled_weight_decay_flag_and_histogram():
    """Adam(decoupled_weight_decay=True) steps as AdamW; log2 histogram counts every finite value."""
    h, refs = run(lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
                  kinds=("update", "adam_ratio"), histogram=hookcap.Histogram.log2())
    check_all(h, refs, ("update", "adam_ratio"))


def test_every_names_kinds_and_no_update_off_step():
    h, refs = run(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), steps=4, every=2)
    assert h.steps.tolist() == [0, 2]
    assert h.meta("0.weight/update")["kind"] == "update"
    assert h.meta("0.weight/update.base")["kind"] == "update"
    assert h.meta("0.weight/update")["module_type"] == "SGD"
    for step in (0, 2):
        for pname, r in refs[step].items():
            assert_close(h, step, f"{pname}/update", r["update"])
    ratio = h.update_ratio("0.weight")
    assert ratio.shape == (2,) and np.isfinite(ratio).all()


class Sign(torch.optim.Optimizer):
    """An optimizer hookcap does not recompute: w -= lr * sign(g)."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(torch.sign(p.grad), alpha=-group["lr"])


def test_other_optimizers_need_a_snapshot(caplog):
    with caplog.at_level(logging.WARNING, logger="hookcap"):
        h, _ = run(lambda ps: Sign(ps), steps=2)
    assert "Sign is not SGD, Adam or AdamW" in caplog.text and "update_snapshot=True" in caplog.text
    assert not [n for n in h.names if n.endswith("/update")]

    model = make_model()
    opt = Sign(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    kept = []
    with Monitor(model, capture="update", optimizer=opt, update_snapshot=True, every=2) as mon:
        for _ in range(4):
            model(torch.randn(5, 7, generator=g)).pow(2).mean().backward()
            w0 = {n: p.detach().double().clone() for n, p in model.named_parameters()}
            opt.step()
            kept.append({n: (p.detach().double() - w0[n], w0[n]) for n, p in model.named_parameters()})
            opt.zero_grad()
    h = mon.history()
    assert h.steps.tolist() == [0, 2]
    for step in (0, 2):
        for n, (delta, w0) in kept[step].items():
            assert_close(h, step, f"{n}/update", delta.numpy())
            assert_close(h, step, f"{n}/update.base", w0.numpy())
    # copies refreshed on recorded steps only: one per parameter, made once
    assert set(mon._hooks.updates._copies) == {n for n, _ in model.named_parameters()}


def test_adam_ratio_on_sgd_warns_and_records_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="hookcap"):
        h, _ = run(lambda ps: torch.optim.SGD(ps, lr=0.1), kinds=("adam_ratio",), steps=1)
    assert "adam_ratio needs Adam or AdamW" in caplog.text
    assert not [n for n in h.names if n.endswith("adam_ratio")]


def test_telemetry_leaves_the_training_unchanged():
    def train(watch):
        model = make_model(3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=True)
        mon = Monitor(model, capture=("update", "adam_ratio"), optimizer=opt).attach() if watch else None
        g = torch.Generator().manual_seed(4)
        for _ in range(3):
            model(torch.randn(5, 7, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        if mon:
            mon.detach()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(train(False), train(True)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rule_bug", ["bias1", "decoupled"])
def test_a_wrong_recomputation_is_caught(rule_bug):
    """The reference is sharp enough to catch a planted error: a bias
    correction left out, weight decay coupled where it is decoupled."""
    h, refs = run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), kinds=("update",))
    for ref in refs:
        for r in ref.values():
            r["update"] = r["update"] * (0.9 if rule_bug == "bias1" else 1.0) + (
                0.1 * 1e-2 * r["base"] if rule_bug == "decoupled" else 0.0)
    with pytest.raises(AssertionError):
        check_all(h, refs, ("update",))


def test_op_rejects_mismatched_state():
    from hookcap.functional import new_state

    ring = torch.zeros(1, 2, hookcap._layout.HEADER, dtype=torch.int64)
    state = new_state("cpu")
    hookcap._ops.reset_slot(ring, state)
    w = torch.randn(4, 3)
    hyper = [0.1, 0.0, 0.0, 0.9, 0.999, 1e-8, 0.0, 1.0]
    with pytest.raises(RuntimeError, match="exp_avg_sq must have the parameter's dtype"):
        torch.ops.hookcap.accumulate_update(w, None, w.clone(), w.t().contiguous().t(), None, hyper, 1,
                                            ring, state, [0, -1, -1, -1, -1], 0, 0.0, 0.0, 0)
    with pytest.raises(RuntimeError, match="rule 1 with these rows needs exp_avg"):
        torch.ops.hookcap.accumulate_update(w, None, None, None, None, hyper, 1, ring, state, [0, -1, -1, -1, -1],
                                            0, 0.0, 0.0, 0)
    with pytest.raises(RuntimeError, match="the ratio row needs rule 1"):
        torch.ops.hookcap.accumulate_update(w, w, w, None, None, hyper, 0, ring, state, [-1, -1, 0, -1, -1],
                                            0, 0.0, 0.0, 0)
    with pytest.raises(RuntimeError, match="records nothing"):
        torch.ops.hookcap.accumulate_update(w, None, w, w, None, hyper, 1, ring, state, [-1] * 5, 0, 0.0, 0.0, 0)
    with pytest.raises(RuntimeError, match="rows needs 5 entries"):
        torch.ops.hookcap.accumulate_update(w, None, w, w, None, hyper, 1, ring, state, [0, 1], 0, 0.0, 0.0, 0)


def test_no_host_read_on_the_update_path(monkeypatch):
    """The recording after the step reads no tensor value on the host (no
    .item(), .cpu(), .tolist(), float() or bool() of a tensor): the same path
    runs on CUDA, where any of them would sync."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=True, foreach=True)
    mon = Monitor(model, capture=("update", "adam_ratio", "optim_state"), optimizer=opt).attach()
    model(torch.randn(5, 7)).pow(2).mean().backward()
    opt.step()  # records step 0 (rows made)
    model(torch.randn(5, 7)).pow(2).mean().backward()
    opt.step.__self__._optimizer_step_post_hooks.clear()  # run the recording by hand below
    opt.step()

    def refuse(*a, **k):
        raise AssertionError("a tensor value was read on the host")

    for name in ("item", "cpu", "tolist", "__float__", "__bool__", "__int__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    mon._hooks.record_optimizer()
    monkeypatch.undo()
    mon._hooks.optimizer_followed = True  # recorded above: not again at step()
    mon.step()
    mon.detach()
    h = mon.history()
    assert h["count"][1, h.column("0.weight/update")] == 7 * 16
    assert h["count"][1, h.column("0.weight/adam_ratio")] == 7 * 16


def test_paused_records_no_update():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with Monitor(model, capture="update", optimizer=opt) as mon:
        for i in range(3):
            model(torch.randn(5, 7)).pow(2).mean().backward()
            if i == 1:
                with mon.paused():
                    opt.step()
            else:
                opt.step()
            opt.zero_grad()
    h = mon.history()
    col = h.column("0.weight/update")
    assert not np.isnan(h["count"][h.steps.tolist().index(0), col])
    assert 1 not in h.steps.tolist() or np.isnan(h["count"][h.steps.tolist().index(1), col])


def test_drained_steps_carry_the_update_ratio():
    """DrainedStep.stats["update_ratio"]: History.update_ratio at each
    {param}/update metric, NaN at every other metric."""
    from hookcap.sinks import Callback

    got = []
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with Monitor(model, capture=("output", "update"), optimizer=opt, sinks=[Callback(got.append)]) as mon:
        for _ in range(3):
            model(torch.randn(5, 7)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    h = mon.history()
    assert [d.step for d in got] == [0, 1, 2]
    for d in got:
        for i, name in enumerate(d.names):
            r = d.stats["update_ratio"][i]
            if name.endswith("/update"):
                assert r == h.update_ratio(name[:-len("/update")])[d.step] and np.isfinite(r)
            else:
                assert np.isnan(r)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_optim_state_of_the_step_is_read_in_the_update_pass(monkeypatch, amsgrad):
    """With torch's Adam, exp_avg and the second moment the step used are
    recorded by the update op's pass (one read of each tensor), the other
    state keys by the statistics op; the values equal the state tensors."""
    from hookcap._rows.recorder import Recorder

    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, amsgrad=amsgrad)
    generic = []
    write = Recorder.write
    monkeypatch.setattr(Recorder, "write", lambda self, name, kind, path, *a, **k: (
        generic.append((name, kind, path)), write(self, name, kind, path, *a, **k))[1])
    with Monitor(model, capture=("update", "adam_ratio", "optim_state"), optimizer=opt) as mon:
        model(torch.randn(5, 7)).pow(2).mean().backward()
        opt.step()
        kept = {(n, k): v.double().clone() for n, p in model.named_parameters() for k, v in opt.state[p].items()
                if k != "step"}
    h = mon.history()
    assert {(n, path) for n, kind, path in generic if kind == "optim_state"} == (
        {(n, "exp_avg_sq") for n, _ in model.named_parameters()} if amsgrad else set())
    for (pname, key), v in kept.items():
        col = h.column(f"{pname}/state.{key}")
        assert h["count"][0, col] == v.numel()
        np.testing.assert_allclose(h["l2norm"][0, col], float(v.norm()), rtol=1e-6)
        np.testing.assert_allclose(h["max"][0, col], float(v.max()), rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("opt_kind", ["adamw-foreach", "adamw-fused", "adamw-single", "sgd-momentum"])
def test_16_bit_parameters_record_the_applied_update(dtype, opt_kind):
    """bfloat16/float16 parameters: update is w_after − w_before of the
    stored weights exactly (not the step's formula, which the dtype's
    rounding leaves undone for most small updates); update.base is w_before;
    zero_frac of update is the fraction of weights the step left unchanged.
    adam_ratio is still recomputed (count = numel)."""
    model = make_model(3).to(dtype)
    family, impl = opt_kind.split("-")
    if family == "adamw":
        kw = {"foreach": impl == "foreach", "fused": impl == "fused"} if impl != "single" else {"foreach": False}
        eps = 1e-4 if dtype == torch.float16 else 1e-8  # 1e-8 is 0 in float16: the step would divide by 0
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, eps=eps, **kw)
        capture = ("update", "adam_ratio")
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, weight_decay=0.01)
        capture = ("update",)
    mon = Monitor(model, capture=capture, optimizer=opt).attach()
    g = torch.Generator().manual_seed(1)
    deltas, unchanged = [], 0.0
    for s in range(3):
        x = torch.randn(8, 7, generator=g).to(dtype)
        model(x).float().pow(2).mean().backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        deltas.append({n: (p.detach().double() - before[n].double(), before[n]) for n, p in model.named_parameters()})
        opt.zero_grad()
    mon.detach()
    h = mon.history()
    from conftest import assert_recorded

    for s, per_param in enumerate(deltas):
        for name, (delta, w0) in per_param.items():
            assert_recorded(h, s, f"{name}/update", [delta])
            assert_recorded(h, s, f"{name}/update.base", [w0])
            unchanged = float((delta == 0).double().mean())
            assert h["zero_frac"][s, h.column(f"{name}/update")] == unchanged
            if "adam_ratio" in capture:
                assert h["count"][s, h.column(f"{name}/adam_ratio")] == delta.numel()
    # the step's rounding leaves many weights unchanged in 16 bits: the case this exists for
    assert max(float((d == 0).double().mean()) for d, _ in deltas[-1].values()) > 0.05


def test_adafactor_factored_moments_are_left_out_whatever_their_shape():
    """Adafactor's col_var of a 1 x 32 weight has the weight's shape: still a
    factored moment, not recorded (a 1-D parameter's variance is)."""
    torch.manual_seed(0)
    w, b = nn.Parameter(torch.randn(1, 32)), nn.Parameter(torch.randn(32))
    model = nn.Module()
    model.w, model.b = w, b
    opt = torch.optim.Adafactor([w, b], lr=1e-2)
    with Monitor(model, capture="optim_state", optimizer=opt) as mon:
        for _ in range(2):
            (w.sum() + b.pow(2).sum()).backward()
            opt.step()
            opt.zero_grad()
    names = mon.history().names
    assert "b/state.variance" in names
    assert not [n for n in names if "row_var" in n or "col_var" in n], names


class DuckSGD:
    """An optimizer that is not a torch.optim.Optimizer (no step hooks)."""

    def __init__(self, params, lr=0.1):
        self.params = list(params)
        self.param_groups = [{"params": self.params, "lr": lr}]
        self.state = {}

    def step(self):
        with torch.no_grad():
            for p in self.params:
                p -= self.param_groups[0]["lr"] * p.grad

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def test_a_duck_typed_optimizer_with_update_snapshot_records_its_updates():
    """Its step is wrapped for the copy before and the record after; both
    wrappers come off at detach()."""
    model = make_model(4)
    opt = DuckSGD(model.parameters())
    mon = Monitor(model, capture="update", optimizer=opt, update_snapshot=True).attach()
    deltas = []
    for s in range(2):
        model(torch.randn(5, 7)).pow(2).mean().backward()
        before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
        opt.step()
        deltas.append({n: p.detach().double() - before[n] for n, p in model.named_parameters()})
        opt.zero_grad()
    mon.detach()
    assert "step" not in vars(opt) and not [k for k in vars(opt) if "hookcap" in k]
    h = mon.history()
    from conftest import assert_recorded

    for s, per_param in enumerate(deltas):
        for name, delta in per_param.items():
            assert_recorded(h, s, f"{name}/update", [delta])


def test_float_arithmetic_falls_back_to_double_outside_floats_range():
    """A float32 parameter's values are computed in float where every input
    and result of its block stays a normal float, else in double: a Δw below
    float's normal range (a tiny first moment) keeps its digits, and a ratio
    beyond float's largest value (a huge gradient over a zero second moment)
    stays finite, both as float64 computes them; ordinary blocks agree with
    float64 to float's rounding."""
    from hookcap import _layout
    from hookcap.histogram import NO_HIST_ARGS

    ops = torch.ops.hookcap
    lr, wd, b1, b2, eps, t = 1e-3, 0.1, 0.9, 0.999, 1e-8, 3
    hyper = [lr, wd, 0, b1, b2, eps, 4, t]  # AdamW (decoupled), step 3
    gen = torch.Generator().manual_seed(0)
    n = 3 * 2048 + 5

    def case(tiny_block, huge_ratio):
        w = torch.randn(n, generator=gen) * 0.02
        g = torch.randn(n, generator=gen) * 1e-3
        a = torch.randn(n, generator=gen) * 1e-4
        b = torch.rand(n, generator=gen) * 1e-6
        if tiny_block:  # every Δw of the first block ~1e-40: float subnormals
            a[:2048], b[:2048], w[:2048] = 1e-35, 1.0, 0.0
        if huge_ratio:
            g[3000], b[3000] = 1e31, 0.0  # ratio 1e39: beyond float
        return w, g, a, b

    def reference(w, g, a, b):
        w, g, a, b = (x.double() for x in (w, g, a, b))
        inv = 1 / (b.sqrt() / (1 - b2 ** t) ** 0.5 + eps)
        adam = -lr / (1 - b1 ** t) * a * inv
        w0 = (w - adam) / (1 - lr * wd)
        return adam - lr * wd * w0, g * inv

    for tiny, huge in ((False, False), (True, False), (False, True)):
        w, g, a, b = case(tiny, huge)
        ring = torch.full((1, 2, _layout.HEADER), -7, dtype=torch.int64)
        ops.reset_slot(ring, torch.tensor([0, 1, 0]))
        ops.accumulate_update(w, g, a, b, None, hyper, 1, ring, torch.tensor([0, 1, 0]), [0, -1, 1, -1, -1],
                              *NO_HIST_ARGS)
        want_dw, want_ratio = reference(w, g, a, b)
        for row, want in ((0, want_dw), (1, want_ratio)):
            got = {k: float(v) for k, v in _layout.decode(ring[0, row].numpy()).items()}
            assert got["count"] == n and got["finite"] == n, (tiny, huge, row)
            np.testing.assert_allclose(got["l2norm"], float(want.norm()), rtol=1e-6)
            np.testing.assert_allclose([got["min"], got["max"]], [float(want.min()), float(want.max())], rtol=1e-6)
        if tiny:  # the first block alone, all in double
            ring = torch.full((1, 1, _layout.HEADER), -7, dtype=torch.int64)
            ops.reset_slot(ring, torch.tensor([0, 1, 0]))
            ops.accumulate_update(w[:2048], None, a[:2048], b[:2048], None, hyper, 1, ring, torch.tensor([0, 1, 0]),
                                  [0, -1, -1, -1, -1], *NO_HIST_ARGS)
            got = {k: float(v) for k, v in _layout.decode(ring[0, 0].numpy()).items()}
            assert 0 < abs(got["max"]) < 1e-38
            np.testing.assert_allclose([got["l2norm"], got["sum"]], [float(want_dw[:2048].norm()),
                                                                     float(want_dw[:2048].sum())], rtol=1e-12)
        if huge:
            assert np.isfinite(got["max"]) and got["max"] > 9.9e38
            np.testing.assert_allclose(got["max"], float(want_ratio.max()), rtol=1e-12)
