"""hookcap.tap: a tensor no module returns (the loss, scores inside a forward)
recorded as a metric of its own, against the float64 reference of the
values tapped; quiet when nothing records; compiled without graph breaks or
recompiles."""

import logging

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import hookcap
from conftest import assert_recorded
from hookcap import Monitor


class Scores(nn.Module):
    """Taps its attention-like scores inside forward (no module returns them)."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.k = nn.Linear(8, 8)

    def forward(self, x):
        s = self.q(x) @ self.k(x).transpose(-1, -2)
        hookcap.tap(s, "scores")
        return s.softmax(-1).sum(-1)


def batches(n=4):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 5, 8, generator=g) for _ in range(n)]


def test_taps_record_the_values_tapped_and_merge_calls():
    torch.manual_seed(0)
    model = Scores()
    tapped = []
    with Monitor(model) as mon:
        for x in batches():
            out = model(x)
            loss = out.pow(2).mean()
            hookcap.tap(loss, "loss")
            hookcap.tap(loss * 3, "loss")  # a second call of one name merges
            half = out.to(torch.bfloat16).t()[1:]  # a view, another dtype
            hookcap.tap(half, "half")
            s = model.q(x) @ model.k(x).transpose(-1, -2)
            tapped.append((s.detach(), [loss.detach(), 3 * loss.detach()], half))
            mon.step()
    h = mon.history()
    assert {"scores", "loss", "half"} <= set(h.names)
    assert h.meta("loss")["kind"] == "tap" and h.meta("loss")["shape"] == ()
    for step, (s, losses, half) in enumerate(tapped):
        assert_recorded(h, step, "scores", [s])
        assert_recorded(h, step, "loss", losses)
        assert_recorded(h, step, "half", [half.float()])


def test_quiet_when_nothing_records():
    x = torch.randn(3, requires_grad=True)
    assert hookcap.tap(x, "x") is None  # no Monitor at all
    model = nn.Linear(3, 2)
    mon = Monitor(model, every=2).attach()
    for step in range(4):
        model(x)
        hookcap.tap(x * 2, "x")
        if step == 2:
            with mon.paused():
                hookcap.tap(x, "paused")
        mon.step()
    mon.detach()
    hookcap.tap(x, "after")  # detached: nothing
    h = mon.history()
    assert h.steps.tolist() == [0, 2]
    assert "paused" not in h.names and "after" not in h.names
    np.testing.assert_array_equal(h["count"][:, h.column("x")], [3, 3])


def test_every_recording_monitor_gets_the_tap_and_gradients_are_unchanged():
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    x = torch.randn(6, 4)
    ref = nn.Linear(4, 4)
    ref.load_state_dict(a.state_dict())
    ref(x).sum().backward()
    with Monitor(a) as ma, Monitor(b) as mb:
        y = a(x)
        hookcap.tap(y, "y")
        y.sum().backward()
        ma.step()
        mb.step()
    assert torch.equal(a.weight.grad, ref.weight.grad)
    for h in (ma.history(), mb.history()):
        assert_recorded(h, 0, "y", [y.detach()])


def test_bad_input():
    model = nn.Linear(2, 2)
    with Monitor(model):
        with pytest.raises(TypeError, match="torch.Tensor"):
            hookcap.tap([1.0], "x")
        with pytest.raises(TypeError, match="non-empty str"):
            hookcap.tap(torch.ones(2), "")


def test_unreadable_tensor_is_skipped_with_one_warning(caplog):
    model = nn.Linear(2, 2)
    with caplog.at_level(logging.WARNING, logger="hookcap"):
        with Monitor(model) as mon:
            for _ in range(2):
                model(torch.ones(1, 2))
                hookcap.tap(torch.arange(4), "ints")
                mon.step()
    assert "ints" not in mon.history().names
    assert sum("ints" in r.getMessage() for r in caplog.records) == 1


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_taps_match_eager_without_breaks_or_recompiles(fresh_dynamo):
    torch.manual_seed(0)
    model = Scores()
    xs = batches(6)

    def run(compiled):
        mon = Monitor(model, every=2).attach()
        fn = torch.compile(model, fullgraph=True, backend="aot_eager") if compiled else model
        start = counters["stats"]["unique_graphs"]
        for x in xs:
            fn(x)
            mon.step()
        mon.detach()
        return mon.history(), counters["stats"]["unique_graphs"] - start

    eager, _ = run(False)
    torch._dynamo.reset()
    comp, graphs = run(True)
    assert graphs == 1  # one graph for on- and off-steps
    assert comp.steps.tolist() == eager.steps.tolist() == [0, 2, 4]
    e, c = eager.column("scores"), comp.column("scores")
    np.testing.assert_array_equal(comp["count"][:, c], eager["count"][:, e])
    for stat in ("mean", "std", "absmax", "l2norm"):
        np.testing.assert_allclose(comp[stat][:, c], eager[stat][:, e], rtol=1e-5, err_msg=stat)
    # The same graph count as the model without taps.
    torch._dynamo.reset()
    explain = torch._dynamo.explain(model)(xs[0])
    assert explain.graph_break_count == 0 and explain.graph_count == 1


def test_spike_on_a_tapped_loss_is_one_line():
    """A loss blow-up found from the tapped loss alone (Spike(metrics="loss")),
    at the step it happened; the layers' metrics are not watched."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    found = []
    spike = hookcap.Spike("max", metrics="loss", window=20, warmup=5)
    with Monitor(model, detectors=[spike], on_anomaly=found.append) as mon:
        for step in range(12):
            x = torch.randn(8, 4) * (100.0 if step == 9 else 1.0)
            loss = model(x).pow(2).mean()
            hookcap.tap(loss, "loss")
            mon.step()
    assert [(a.step, a.name, a.kind) for a in found] == [(9, "loss", "spike")]
    with pytest.raises(ValueError, match="metrics"):
        hookcap.Spike(metrics=3)


class Checkpointed(nn.Module):
    """A tap inside an activation-checkpointed block."""

    def __init__(self, reentrant):
        super().__init__()
        self.inner = Scores()
        self.reentrant = reentrant

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=self.reentrant).sum()


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_tap_recomputed_under_checkpointing_counts_once(reentrant):
    """The recomputation in the backward does not tap again: the scores of
    the forward, once (count 2 x 5 x 5, not twice that)."""
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    x = batches(1)[0].requires_grad_(reentrant)
    with Monitor(model, capture="output") as mon:
        model(x).backward()
        mon.step()
    with torch.no_grad():
        s = model.inner.q(x) @ model.inner.k(x).transpose(-1, -2)
    assert_recorded(mon.history(), 0, "scores", [s])


def test_a_tap_in_an_eval_forward_goes_to_eval_like_module_outputs():
    """eval_forwards="separate" (default): an eval-mode forward's tap is
    eval/scores, the training forward's stays scores; "skip" drops it;
    "merge" merges it."""
    torch.manual_seed(0)
    model = Scores()
    xt, xe = batches(2)
    for mode in ("separate", "skip", "merge"):
        with Monitor(model, capture="output", eval_forwards=mode) as mon:
            model.train()
            model(xt)
            model.eval()
            model(xe * 10)
            model.train()
            mon.step()
        h = mon.history()
        with torch.no_grad():
            st, se = (model.q(x) @ model.k(x).transpose(-1, -2) for x in (xt, xe * 10))
        if mode == "merge":
            assert_recorded(h, 0, "scores", [st, se])
            assert "eval/scores" not in h.names
        else:
            assert_recorded(h, 0, "scores", [st])
            if mode == "separate":
                assert_recorded(h, 0, "eval/scores", [se])
            else:
                assert "eval/scores" not in h.names
