"""Detectors, first-NaN localisation, on_anomaly modes and the flight recorder."""

import logging
import math

import numpy as np
import pytest
import torch
import torch.nn as nn

import hookcap
from hookcap import AnomalyError, Dead, Histogram, Monitor, Spike, Underflow
from hookcap.drained import DrainedStep
from hookcap._host.record import make_record
from hookcap.models import TinyResNet

transformers = pytest.importorskip("transformers")


def gpt2():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def inject_output(module, value, at_step, state):
    """A forward hook that returns a modified output (the seeds' way to inject)."""
    def hook(mod, args, out):
        if state["step"] == at_step:
            t = out[0] if isinstance(out, tuple) else out
            t = t.clone()
            t.view(-1)[3] = value
            return (t,) + tuple(out[1:]) if isinstance(out, tuple) else t
        return None
    return module.register_forward_hook(hook)


def inject_grad(module, value, at_step, state):
    """Corrupts the gradient flowing back into a module's output."""
    def hook(mod, args, out):
        if state["step"] == at_step and out.requires_grad:
            def g(grad):
                grad = grad.clone()
                grad.view(-1)[0] = value
                return grad
            out.register_hook(g)
    return module.register_forward_hook(hook)


def run(model, batch_fn, mon, steps, state):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(steps):
        state["step"] = i
        x, y = batch_fn(i)
        out = model(x)
        logits = out.logits if hasattr(out, "logits") else out
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.zero_grad()  # keep weights finite: we test localisation, not recovery
        mon.step()


def lm(i):
    g = torch.Generator().manual_seed(i)
    return torch.randint(97, (2, 8), generator=g), torch.randint(97, (2, 8), generator=g)


def img(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(2, 3, 16, 16, generator=g), torch.randint(10, (2,), generator=g)


CASES = [
    (gpt2, lm, "transformer.h.1.mlp.c_fc"),
    (gpt2, lm, "transformer.h.0.attn.c_attn"),
    (TinyResNet, img, "layer1.conv2"),
    (TinyResNet, img, "layer2.bn1"),
]


@pytest.mark.parametrize("make,batch,layer", CASES)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_first_nonfinite_is_the_injected_layer_output(make, batch, layer, value):
    model = make()
    state = {"step": 0}
    handle = inject_output(model.get_submodule(layer), value, 3, state)  # before the Monitor's hooks
    mon = Monitor(model, on_anomaly="raise").attach()
    with pytest.raises(AnomalyError) as e:
        run(model, batch, mon, 6, state)
    assert state["step"] == 3  # raised by the step() that closed step 3
    a = e.value.anomaly
    assert (a.step, a.name, a.kind) == (3, f"{layer}/output", "nonfinite")
    key = "nan" if math.isnan(value) else "posinf"
    assert a.stats[key] >= 1 and mon.anomalies[0] is a
    mon.detach()
    handle.remove()


@pytest.mark.parametrize("make,batch,layer", [(gpt2, lm, "transformer.h.0.mlp.c_proj"),
                                              (TinyResNet, img, "layer1.bn2")])
def test_grad_only_injection_localised_in_backward_order(make, batch, layer):
    model = make()
    state = {"step": 0}
    handle = inject_grad(model.get_submodule(layer), float("nan"), 2, state)
    mon = Monitor(model, on_anomaly="raise").attach()
    with pytest.raises(AnomalyError) as e:
        run(model, batch, mon, 5, state)
    a = e.value.anomaly
    assert (a.step, a.name) == (2, f"{layer}/grad_output")
    mon.detach()
    handle.remove()


def test_warn_once_per_metric_and_kind(caplog):
    model = nn.Sequential(nn.Linear(3, 3))
    every_step = lambda s: hookcap.Anomaly(s.step, "0/output", "custom", "again")  # noqa: E731
    with Monitor(model, capture="output", detectors=[every_step]) as mon:
        with caplog.at_level(logging.WARNING, logger="hookcap"):
            for _ in range(4):
                model(torch.full((2, 3), float("nan")))
                mon.step()
    assert len(mon.anomalies) == 4
    assert sum("anomaly" in r.message for r in caplog.records) == 1


def test_callable_and_none_and_custom_detector():
    seen = []

    def big_mean(step: DrainedStep):
        return [hookcap.Anomaly(step.step, n, "bigmean", "mean > 10", step.stats_of(n))
                for n in step.names if step.stats_of(n)["mean"] > 10]

    model = nn.Sequential(nn.Linear(1, 1))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[0].bias.fill_(0.0)
    with Monitor(model, capture="output", detectors=[big_mean], on_anomaly=seen.append) as mon:
        for v in (1.0, 20.0, 2.0):
            model(torch.full((4, 1), v))
            mon.step()
    assert [(a.step, a.kind) for a in seen] == [(1, "bigmean")]
    with Monitor(model, capture="output", on_anomaly=None) as mon:
        model(torch.full((4, 1), float("nan")))
        mon.step()
    assert len(mon.anomalies) == 1


def drained(step, names, stats, hist=None):
    """A DrainedStep built from given stats (through a real ring row encoding)."""
    from hookcap import _layout
    rows = np.zeros((len(names), _layout.HEADER + (hist.shape[1] if hist is not None else 0)), np.int64)
    for i, st in enumerate(stats):
        rows[i, _layout.COUNT] = st.get("count", 100)
        rows[i, _layout.ZEROS] = st.get("zeros", 0)
        rows[i, _layout.CALLS] = 1
        rows[i, [_layout.SUM, _layout.SUMSQ]] = np.array([0.0, st.get("sumsq", 1.0)]).view(np.int64)
        if hist is not None:
            rows[i, _layout.HEADER:] = hist[i]
    rec = make_record(step, np.arange(len(names)), rows, np.arange(len(names)))
    spec = Histogram.log2() if hist is not None else None
    return DrainedStep(rec, names, {}, spec)


def test_spike_fires_on_jump_not_on_smooth_run():
    rng = np.random.default_rng(0)
    sp = Spike(stat="l2norm", z=6.0, window=100, warmup=20)
    fired = []
    for s in range(1000):  # smooth: slow drift plus 1% noise
        v = (1 + 0.001 * s) * (1 + 0.01 * rng.standard_normal())
        fired += sp(drained(s, ["a"], [{"sumsq": v * v}]))
    assert fired == []
    out = sp(drained(1000, ["a"], [{"sumsq": (50 * 2.0) ** 2}]))
    assert len(out) == 1 and out[0].kind == "spike" and out[0].step == 1000


def test_underflow_from_log2_histogram():
    h = Histogram.log2()
    counts = np.zeros((2, h.nbins), np.int64)
    e = lambda k: 2 + (k + 64)  # noqa: E731  bin of 2**k
    counts[0, e(-20)] = 70  # below 2**-14
    counts[0, e(0)] = 30
    counts[1, e(-20)] = 10
    counts[1, e(0)] = 90
    det = Underflow(frac=0.5, below=2.0**-14)
    out = det(drained(0, ["g1", "g2"], [{"count": 100}, {"count": 100}], counts))
    assert [a.name for a in out] == ["g1"]
    with pytest.raises(ValueError, match="log2"):
        Monitor(nn.Linear(1, 1), histogram=None, detectors=[Underflow()])


def test_dead_after_consecutive_steps():
    det = Dead(zero_frac=0.99, steps=5)
    fired = []
    for s in range(12):
        z = 100 if s < 8 else 10
        fired += det(drained(s, ["relu"], [{"count": 100, "zeros": z}]))
    assert [a.step for a in fired] == [4]


def test_dump_load_round_trip_and_dump_on_anomaly(tmp_path):
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    with Monitor(model, capture=("output", "grad_output"), dump_on_anomaly=str(tmp_path) + "/") as mon:
        for i in range(5):
            x = torch.randn(2, 3)
            if i == 3:
                x[0, 0] = float("nan")
            model(x).sum().backward()
            mon.step()
    files = list(tmp_path.glob("hookcap-anomaly-step3.npz"))
    assert len(files) == 1
    auto = hookcap.load(files[0])
    assert auto.steps.tolist() == [0, 1, 2, 3] and auto.anomalies[0].name == "0/output"
    path = mon.dump(tmp_path / "full.npz")
    back = hookcap.load(path)
    assert back == mon.history()
    assert [a.to_dict() for a in back.anomalies] == [a.to_dict() for a in mon.anomalies]
    assert back.order(3)[0] == "0/output"


def test_dump_on_anomaly_keeps_the_first_dump_of_each_kind(tmp_path):
    """A spike first, a NaN later: both are dumped (the NaN step is not lost
    behind the spike's dump); a file path gets ``-{kind}`` for later kinds."""
    for target in (str(tmp_path / "d") + "/", str(tmp_path / "crash.npz")):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
        with Monitor(model, capture=("output",), detectors=[Spike(z=6, window=8, warmup=4), hookcap.NonFinite()],
                     on_anomaly=None, dump_on_anomaly=target) as mon:
            for i in range(10):
                x = torch.randn(2, 3) * (1e4 if i == 6 else 1.0)
                if i == 8:
                    x[0, 0] = float("nan")
                model(x)
                mon.step()
        kinds = {}
        for a in mon.anomalies:
            kinds.setdefault(a.kind, a.step)
        assert kinds.get("spike") == 6 and 8 in [a.step for a in mon.anomalies if a.kind != "spike"], kinds
        nan_kind = next(a.kind for a in mon.anomalies if a.step == 8 and a.kind != "spike")
        if target.endswith("/"):
            first, later = tmp_path / "d" / "hookcap-anomaly-step6.npz", tmp_path / "d" / f"hookcap-anomaly-step8-{nan_kind}.npz"
        else:
            first, later = tmp_path / "crash.npz", tmp_path / f"crash-{nan_kind}.npz"
        assert hookcap.load(first).steps.tolist()[-1] == 6
        assert hookcap.load(later).steps.tolist()[-1] == 8


def test_one_detector_or_sink_is_taken_as_a_list_and_bad_arguments_are_named(tmp_path):
    from hookcap import sinks

    model = nn.Sequential(nn.Linear(3, 2))
    with Monitor(model, detectors=hookcap.NonFinite(), sinks=sinks.JSONL(tmp_path / "m.jsonl")) as mon:
        model(torch.randn(2, 3))
        mon.step()
    assert len(mon.detectors) == 1 and isinstance(mon.detectors[0], hookcap.NonFinite)
    assert (tmp_path / "m.jsonl").read_text().strip()
    with pytest.raises(TypeError, match="detectors"):
        Monitor(model, detectors=3)
    with pytest.raises(TypeError, match="sinks"):
        Monitor(model, sinks=3)
    for bad in (True, False, 2.0, 0):
        with pytest.raises(ValueError, match="every"):
            Monitor(model, every=bad)
