"""Training and evaluation phases, pausing, resuming, robust capture and the
Monitor's defaults, each against a float64 reference recorded with plain
PyTorch hooks."""

import collections
import json
import logging

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import assert_recorded

import hookcap
from hookcap import Monitor


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 3))


def capture_outputs(module, store, tag):
    """A plain forward hook keeping float64 copies of ``module``'s outputs
    under ``(tag(), module.training)``."""
    def hook(m, args, out):
        if not out.is_nested:
            store[(tag(), m.training)].append(out.detach().double().clone())

    return module.register_forward_hook(hook)


@pytest.mark.parametrize("mode", ["separate", "skip", "merge"])
def test_eval_forwards_never_merge_into_training_rows(mode):
    model = mlp()
    seen = collections.defaultdict(list)
    step = [0]
    h0 = capture_outputs(model[0], seen, lambda: step[0])
    h1 = capture_outputs(model[1], seen, lambda: step[0])
    g = torch.Generator().manual_seed(1)
    mon = Monitor(model, capture="output", eval_forwards=mode, histogram=hookcap.Histogram.log2()).attach()
    for s in range(3):
        model.train()
        model(torch.randn(5, 6, generator=g)).sum().backward()
        model.eval()  # a validation pass inside the training step
        with torch.no_grad():
            model(torch.randn(7, 6, generator=g))
        mon.step()
        step[0] += 1
    mon.detach()
    h0.remove(), h1.remove()
    h = mon.history()
    for s in range(3):
        for name, mod in (("0/output", 0), ("1/output", 1)):
            train = seen[(s, True)][mod::2]
            evals = seen[(s, False)][mod::2]
            if mode == "merge":
                assert_recorded(h, s, name, train + evals)
            else:
                assert_recorded(h, s, name, train)  # Dropout's zero_frac is the training one
            if mode == "separate":
                assert_recorded(h, s, "eval/" + name, evals)
    assert any(n.startswith("eval/") for n in h.names) == (mode == "separate")
    if mode == "separate":
        assert h.meta("eval/0/output")["kind"] == "output"


@pytest.mark.parametrize("mode", ["separate", "merge"])
def test_eval_series_do_not_feed_training_spike_windows(mode):
    # A fixed training batch gives a flat training series; a validation pass
    # every 4th step would look like a spike if it entered that series.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    x_train, x_eval = torch.randn(4, 6), torch.randn(32, 6)
    spike = hookcap.Spike("l2norm", z=4.0, window=20, warmup=3)
    with Monitor(model, capture="output", detectors=[spike], on_anomaly=None, eval_forwards=mode) as mon:
        for s in range(12):
            model.train()
            model(x_train).sum().backward()
            if s % 4 == 3:
                model.eval()
                with torch.no_grad():
                    model(x_eval)
            mon.step()
    if mode == "merge":  # the contrast: merged, the validation passes read as spikes
        assert {a.step for a in mon.anomalies} == {3, 7, 11}
        return
    assert mon.anomalies == []
    assert len(spike.state_dict()["window"]["0/output"]) == 12
    assert len(spike.state_dict()["window"]["eval/0/output"]) == 3


def test_paused_records_nothing_and_parks_the_hooks():
    model = mlp()
    seen = collections.defaultdict(list)
    step = [0]
    ref = capture_outputs(model[0], seen, lambda: step[0])
    mon = Monitor(model, capture=("output", "grad_output")).attach()
    g = torch.Generator().manual_seed(2)
    for s in range(2):
        model(torch.randn(4, 6, generator=g)).sum().backward()
        with mon.paused():
            assert not model[0]._forward_hooks or list(model[0]._forward_hooks) == [ref.id]
            model(torch.randn(9, 6, generator=g)).sum().backward()  # a teacher, generate(), ...
        mon.step()
        step[0] += 1
    mon.detach()
    h = mon.history()
    for s in range(2):
        assert_recorded(h, s, "0/output", seen[(s, True)][:1])
        assert h["count"][s, h.column("3/grad_output")] == 4 * 3


def test_start_step_and_state_dict_resume_numbering_and_detector_windows(tmp_path):
    model = mlp()
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(4, 6, generator=g) for _ in range(6)]
    mon = Monitor(model, capture="output", detectors=[hookcap.NonFinite(), hookcap.Spike(warmup=2)]).attach()
    for x in xs[:3]:
        model(x).sum().backward()
        mon.step()
    state = json.loads(json.dumps(mon.state_dict()))  # JSON-able
    mon.detach()
    assert state["step"] == 3
    resumed = Monitor(model, capture="output", detectors=[hookcap.NonFinite(), hookcap.Spike(warmup=2)],
                      start_step=3)
    resumed.load_state_dict(state)
    resumed.attach()
    for x in xs[3:]:
        model(x).sum().backward()
        resumed.step()
    resumed.detach()
    assert resumed.history().steps.tolist() == [3, 4, 5]
    assert len(resumed.detectors[1].state_dict()["window"]["0/output"]) == 6
    with pytest.raises(ValueError, match="state"):
        resumed.load_state_dict({"step": 1})
    with pytest.raises(ValueError, match="start_step"):
        Monitor(model, start_step=-1)


def test_every_with_start_step_keeps_the_cadence():
    model = mlp()
    mon = Monitor(model, capture="output", every=3, start_step=4).attach()
    for _ in range(6):
        model(torch.randn(2, 6)).sum().backward()
        mon.step()
    mon.detach()
    assert mon.history().steps.tolist() == [6, 9]


@pytest.mark.parametrize("eval_first", [False, True])
def test_padded_transformer_encoder_eval_keeps_every_layer_metric(caplog, eval_first):
    # nn.TransformerEncoder turns a padded eval batch into nested tensors: that
    # call is skipped with one warning per metric and reason, never the metric.
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)
    enc = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True)
    x = torch.randn(3, 5, 8)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[0, 3:] = True
    seen = collections.defaultdict(list)
    step = [0]
    hooks = [capture_outputs(enc.layers[i], seen, lambda: step[0]) for i in range(2)]
    with caplog.at_level(logging.WARNING, logger="hookcap"):
        mon = Monitor(enc, modules="layers.*", capture="output", eval_forwards="merge").attach()
        for s in range(3):
            is_eval = s == (0 if eval_first else 1)  # padded eval first, or between two training steps
            enc.train(not is_eval)
            if is_eval:
                with torch.no_grad():
                    enc(x, src_key_padding_mask=pad)
                    enc(x, src_key_padding_mask=pad)
            else:
                enc(x, src_key_padding_mask=pad).sum().backward()
            mon.step()
            step[0] += 1
        mon.detach()
    for hk in hooks:
        hk.remove()
    h = mon.history()
    for s in ((1, 2) if eval_first else (0, 2)):
        for i in range(2):
            assert_recorded(h, s, f"layers.{i}/output", seen[(s, True)][i::2])
    skips = [r.getMessage() for r in caplog.records if "not recorded" in r.getMessage()]
    assert skips and all("\n" not in m for m in skips)
    assert len(skips) == len(set(skips))  # once per metric and reason, not per call
    assert any(m.startswith("hookcap: layers.1/output: a call was not recorded: nested") for m in skips)


def test_root_is_apart_from_a_child_named_model():
    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Sequential(nn.Linear(4, 4))

        def forward(self, x):
            return self.model(x) * 2

    torch.manual_seed(0)
    w = Wrapper()
    x = torch.randn(3, 4)
    with Monitor(w, modules=lambda n, m: True, capture="output") as mon:
        w(x)
        mon.step()
    h = mon.history()
    assert {"./output", "model/output", "model.0/output"} <= set(h.names)
    inner = w.model(x)
    assert_recorded(h, 0, "model/output", [inner])
    assert_recorded(h, 0, "./output", [inner * 2])
    rows = hookcap.summary(w, x, print_table=False)
    by_name = {r["name"]: r for r in rows}
    assert by_name["."]["mean"] == pytest.approx(2 * by_name["model"]["mean"], rel=1e-6)


def test_default_modules_cover_attention_and_parametrized_linears():
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.proj = nn.utils.parametrizations.weight_norm(nn.Linear(8, 8))
            self.sn = nn.utils.parametrizations.spectral_norm(nn.Linear(8, 8, bias=False))

        def forward(self, x):
            a, _ = self.attn(x, x, x)
            return self.sn(self.proj(a))

    net = Net()
    x = torch.randn(2, 3, 8)
    with Monitor(net, capture="output") as mon:
        net(x).sum().backward()
        mon.step()
    h = mon.history()
    assert {"attn/output.0", "proj/output", "sn/output"} <= set(h.names)
    assert not any("parametrizations" in n for n in h.names), h.names
    # Recomputed as recorded, with grad enabled: under no_grad MultiheadAttention
    # takes its fused inference path, whose last bits differ on some CPUs.
    a, w = net.attn(x, x, x)
    assert_recorded(h, 0, "attn/output.0", [a.detach()])
    assert_recorded(h, 0, "proj/output", [net.proj(a).detach()])


def test_a_bare_module_type_works_like_a_one_tuple():
    model = mlp()
    with Monitor(model, modules=nn.Linear, capture="output") as mon:
        model(torch.randn(2, 6))
        mon.step()
    assert sorted(mon.names) == ["0/output", "3/output"]


def test_dump_creates_folders_and_load_takes_the_path_given_to_dump(tmp_path):
    model = mlp()
    with Monitor(model, capture="output") as mon:
        model(torch.randn(2, 6))
        mon.step()
    given = tmp_path / "a" / "b" / "run"
    written = mon.dump(given)
    assert written == str(given) + ".npz"
    assert hookcap.load(given) == hookcap.load(written) == mon.history()


def test_unattached_step_and_a_monitor_that_hooked_nothing_warn_once(caplog):
    model = mlp()
    with caplog.at_level(logging.WARNING, logger="hookcap"):
        mon = Monitor(model, capture="param_grad", modules=None)
        mon.step()
        mon.step()
        for p in model.parameters():
            p.requires_grad_(False)
        Monitor(model, capture="param_grad", modules="0").attach().detach()
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("not attached" in m for m in msgs) == 1
    assert sum("hooked nothing" in m for m in msgs) == 1


def test_nested_with_keeps_the_outer_block_attached():
    model = mlp()
    mon = Monitor(model, capture="output")
    with mon:
        with mon:
            model(torch.randn(2, 6))
        model(torch.randn(3, 6))  # still recorded: the inner block did not detach
        mon.step()
    assert mon.history()["count"][0, mon.history().column("0/output")] == (2 + 3) * 8
    assert not model[0]._forward_hooks


def test_nonfinite_reports_a_metric_once_then_counts():
    model = mlp()
    nf = hookcap.NonFinite()
    with Monitor(model, capture="output", detectors=[nf], on_anomaly=None) as mon:
        for s in range(4):
            x = torch.randn(2, 6)
            if s >= 1:
                x[0, 0] = float("nan")  # diverged from step 1 on
            model(x)
            mon.step()
    assert [(a.step, a.name) for a in mon.anomalies] == [(1, "0/output")]
    assert nf.counts["0/output"] == 3 and nf.counts["3/output"] == 3


def test_namedtuple_outputs_are_named_by_field():
    Out = collections.namedtuple("Out", ["logits", "hidden"])

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            return Out(y, y * 2)

    net = Net()
    x = torch.randn(2, 4)
    with Monitor(net, modules=lambda n, m: n == ".", capture="output") as mon:
        net(x)
        mon.step()
    h = mon.history()
    assert h.names == ["./output.logits", "./output.hidden"]
    with torch.no_grad():
        assert_recorded(h, 0, "./output.hidden", [net.lin(x) * 2])


def test_report_draws_steps_without_finite_values_in_a_colour_of_their_own(tmp_path):
    pytest.importorskip("matplotlib")
    from hookcap.report import from_history, no_finite_cells

    model = mlp()
    with Monitor(model, capture="output", on_anomaly=None) as mon:
        for s in range(3):
            x = torch.randn(2, 6)
            if s == 1:
                x[:] = float("nan")
            model(x)
            mon.step()
    run = from_history(mon.history())
    dead = no_finite_cells(run)
    assert dead[1].all() and not dead[0].any() and not dead[2].any()
    files = hookcap.report.report(mon.history(), out=str(tmp_path / "rep"), metric="0/output")
    import matplotlib.pyplot as plt

    magenta = np.array([0xE7, 0x29, 0x8A]) / 255
    for f in ("heatmap", "histogram"):
        img = plt.imread(files[f])[..., :3]
        assert (np.abs(img - magenta).sum(axis=-1) < 0.03).any(), f
    clean = Monitor(model, capture="output")
    with clean:
        model(torch.randn(2, 6))
        clean.step()
    img = plt.imread(hookcap.report.report(clean.history(), out=str(tmp_path / "clean"))["heatmap"])[..., :3]
    assert not (np.abs(img - magenta).sum(axis=-1) < 0.03).any()


def test_wrapped_optimizers_drive_step_and_attach_is_all_or_nothing():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    class Wrapped:  # the shape of accelerate's / Lightning's wrappers
        def __init__(self, optimizer):
            self.optimizer = optimizer

        def step(self):
            self.optimizer.step()

    mon = Monitor(model, capture="output", optimizer=Wrapped(opt)).attach()
    for _ in range(3):
        model(torch.randn(2, 6)).sum().backward()
        opt.step()
    mon.detach()
    assert mon.history().steps.tolist() == [0, 1, 2]
    before = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]
    bad = Monitor(model, capture="output", modules="nomatch*")
    with pytest.raises(ValueError, match="modules"):
        bad.attach()
    assert [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()] == before
    with pytest.raises(ValueError, match="optimizer"):
        Monitor(model, optimizer=object())
    with pytest.raises(ValueError, match="eval_forwards"):
        Monitor(model, eval_forwards="drop")


def test_a_recorded_step_that_recorded_nothing_warns_once(caplog):
    model = mlp()
    with caplog.at_level(logging.WARNING, logger="hookcap"):
        with Monitor(model, capture="output") as mon:
            mon.step()  # nothing ran yet
            model(torch.randn(2, 6))
            mon.step()
            mon.step()  # nothing ran in this one either
            mon.step()
    msgs = [r.getMessage() for r in caplog.records if "recorded nothing" in r.getMessage()]
    assert len(msgs) == 1 and "step 0" in msgs[0]
    assert mon.history().steps.tolist() == [0, 1, 2, 3]  # steps 0, 2 and 3 are kept, empty


def test_an_optimizer_without_step_hooks_gets_its_step_wrapped_until_detach():
    model = mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)

    class Bare:  # no register_step_post_hook, wraps nothing
        def __init__(self):
            self.steps = 0

        def step(self):
            sgd.step()
            self.steps += 1

    opt = Bare()
    mon = Monitor(model, capture="output", optimizer=opt).attach()
    for _ in range(2):
        model(torch.randn(2, 6)).sum().backward()
        opt.step()
    mon.detach()
    opt.step()  # restored: no Monitor step any more
    assert opt.steps == 3 and "step" not in vars(opt)
    assert mon.history().steps.tolist() == [0, 1] and mon.current_step == 2
