"""hookcap.explain: eight planted causes on a small real model (attention
with per-head queries, a top-1 router over four experts, an MLP head),
trained with AdamW and a steady data stream; the cause is planted at one
step and explain() at the anomaly must rank it first, with its lead."""

import time

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hookcap
from hookcap import Monitor

D, HEADS, EXPERTS, STEPS, CAUSE, ANOMALY = 16, 4, 4, 100, 90, 95


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, HEADS, D // HEADS).transpose(1, 2) for m in (self.q, self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, D))


class Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, EXPERTS)

    def forward(self, x):
        logits = self.gate(F.layer_norm(x.reshape(-1, D), (D,)))
        w, idx = torch.topk(torch.softmax(logits, -1), 1, dim=-1)
        return logits, w, idx


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, D)
        self.attn = Attn()
        self.router = Router()
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(EXPERTS))
        self.mlp = nn.Sequential(nn.Linear(D, 32), nn.GELU(), nn.Linear(32, D))
        self.head = nn.Linear(D, 1)
        with torch.no_grad():  # centre the router's logits on typical tokens: every expert gets some
            x0 = torch.randn(64, 6, 8, generator=torch.Generator().manual_seed(2))
            h0 = self.inp(x0)
            self.router.gate.bias.sub_(self.router(h0 + self.attn(h0))[0].mean(0))

    def forward(self, x):
        h = self.inp(x)
        h = h + self.attn(h)
        _, w, idx = self.router(h)
        flat = h.reshape(-1, D)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            tok = torch.where(idx[:, 0] == e)[0]
            out[tok] = w[tok] * expert(flat[tok])
        h = h + out.view_as(h)
        return self.head(h + self.mlp(h)).squeeze(-1)


def run(plant, clip=None):
    """Train STEPS steps; ``plant(i, model, opt, x)`` may change anything at
    step i (and returns the batch). Returns the History."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW([{"params": model.inp.parameters()},
                             {"params": [p for n, p in model.named_parameters() if not n.startswith("inp.")]}],
                            lr=1e-4, fused=True)
    mon = Monitor(model, capture=("output", "param_grad", "update", "attention", "router"), optimizer=opt,
                  on_anomaly=None).attach()
    g = torch.Generator().manual_seed(1)
    w_true = torch.randn(8, generator=g)
    for i in range(STEPS):
        x = torch.randn(16, 6, 8, generator=g)
        x = plant(i, model, opt, x)
        loss = (model(x) - x @ w_true).pow(2).mean()
        hookcap.tap(loss, "loss")
        loss.backward()
        if clip is not None and not (clip == "off" and i >= CAUSE):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        opt.step()
        opt.zero_grad()
    mon.detach()
    return mon.history()


def at_cause(fn):
    def plant(i, model, opt, x):
        if i == CAUSE:
            with torch.no_grad():
                fn(model, opt, x)
        return x
    return plant


def nan_into_mlp(model, opt, x):
    def pre(mod, args):
        t = args[0].clone()
        t[0, 0, 0] = float("nan")
        return (t,)
    model.mlp[2].register_forward_pre_hook(pre)  # from the cause on


SCENARIOS = {
    # name: (plant, clip, step explained, predicate on the first mover's name)
    "lr x100 on one param group": (
        at_cause(lambda m, o, x: o.param_groups[0].update(lr=o.param_groups[0]["lr"] * 100)), None, ANOMALY,
        lambda n: n.startswith("inp.") and "/update" in n),
    "one layer's weights scaled": (at_cause(lambda m, o, x: m.mlp[0].weight.mul_(10)), None, ANOMALY,
                                   lambda n: n.startswith("mlp.0")),
    "a corrupted batch": (lambda i, m, o, x: x * 50 if i == CAUSE else x, None, CAUSE,
                          lambda n: n.startswith("inp/")),
    "second moment collapse in one layer": (
        at_cause(lambda m, o, x: [o.state[p]["exp_avg_sq"].zero_() for p in m.mlp[2].parameters()]), None,
        ANOMALY, lambda n: n.startswith("mlp.2.") and "/update" in n),
    "one head's query scaled": (at_cause(lambda m, o, x: m.attn.q.weight[8:12].mul_(30)), None, ANOMALY,
                                lambda n: n.startswith("attn")),
    "a dead expert": (at_cause(lambda m, o, x: m.router.gate.bias[2].fill_(-1e4)), None, ANOMALY,
                      lambda n: n.startswith("router")),
    "a NaN in one layer's input": (at_cause(nan_into_mlp), None, ANOMALY, lambda n: n.startswith("mlp.2/")),
    "gradient clipping turned off": (lambda i, m, o, x: x, "off", ANOMALY, lambda n: "/update" in n),
}


@pytest.fixture(scope="module")
def results():
    out = {}
    for name, (plant, clip, step, ok) in SCENARIOS.items():
        h = run(plant, clip)
        ex = hookcap.explain(h, step)
        out[name] = (ex, ok, step)
    return out


def test_the_planted_cause_ranks_first_in_at_least_7_of_8(results):
    hits = []
    for name, (ex, ok, step) in results.items():
        first = ex[0] if len(ex) else None
        hit = first is not None and ok(first.name) and first.step == (CAUSE if step == ANOMALY else step)
        hits.append(hit)
        print(f"{name}: {'ok' if hit else 'MISSED'}\n{ex.table(4)}")
    assert sum(hits) >= 7, hits


def test_the_lead_is_steps_before_the_anomaly(results):
    ex, _, _ = results["lr x100 on one param group"]
    assert ex.step == ANOMALY and ex[0].step == CAUSE and ex[0].lead == ANOMALY - CAUSE
    assert abs(ex[0].z) > 6 and ex[0].value != ex[0].baseline


def test_explain_a_saved_dump_and_defaults(results, tmp_path):
    h = run(SCENARIOS["one layer's weights scaled"][0])
    path = h.save(tmp_path / "run.hookcap")
    loaded = hookcap.load(path)
    a, b = hookcap.explain(h, ANOMALY), hookcap.explain(loaded, ANOMALY)
    assert [(m.name, m.stat, m.step) for m in a] == [(m.name, m.stat, m.step) for m in b]
    assert "what moved first" in str(a) and a[0].name in str(a)
    assert len(hookcap.explain(h, ANOMALY, top=3)) == 3
    assert len(hookcap.explain(h, 10)) == 0  # too few steps before it for a baseline
    with pytest.raises(ValueError):
        hookcap.explain(h, window=1)


def test_two_thousand_metrics_by_1024_steps_in_under_a_second():
    """Speed on synthetic data (a History with 2,000 metrics x 1,024 steps):
    one planted shift is found, nothing else."""
    rng = np.random.default_rng(0)
    stats = {s: rng.normal(1.0, 0.01, (1024, 2000)) for s in hookcap.movers.STATS}
    stats["rms"][1000:, 7] *= 5

    class Synthetic:
        steps = np.arange(1024)
        names = [f"m{i}" for i in range(2000)]
        anomalies = []
        __contains__ = stats.__contains__
        __getitem__ = stats.__getitem__

        def order(self, step):
            return self.names

    t0 = time.perf_counter()
    ex = hookcap.explain(Synthetic(), 1010)
    took = time.perf_counter() - t0
    assert [(m.name, m.stat, m.step, m.lead) for m in ex] == [("m7", "rms", 1000, 10)]
    assert took < 1.0, took


def test_the_report_draws_what_moved_first(tmp_path):
    """A dump with an anomaly (the planted NaN, found by NonFinite) gets a
    moved.png page naming the layer whose input was poisoned first."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    mon = Monitor(model, capture=("output",), optimizer=opt, detectors=[hookcap.NonFinite()],
                  on_anomaly=None).attach()
    g = torch.Generator().manual_seed(1)
    plant = at_cause(nan_into_mlp)
    for i in range(STEPS):
        x = plant(i, model, opt, torch.randn(16, 6, 8, generator=g))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    mon.detach()
    from hookcap.report import load_run, report
    from hookcap.report_moved import plot_moved

    dump = mon.dump(tmp_path / "run.hookcap")
    files = report(dump, tmp_path / "rep")
    assert files["moved"] and open(files["index"]).read().count("moved.png") == 1
    _, ex = plot_moved(load_run(dump), str(tmp_path / "m.png"))
    assert ex[0].step == CAUSE and ex[0].name == "mlp.2/output" and ex[0].stat == "nan"
