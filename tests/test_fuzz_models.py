"""Hypothesis over random nn.Sequential stacks with injected NaN/Inf/zeros:
recorded stats equal the float64 reference, the first non-finite metric is the
injected layer's output, and outputs are bitwise identical to an unmonitored run."""

import math

import numpy as np
import torch
import torch.nn as nn
from conftest import assert_stats_match
from hypothesis import given, settings
from hypothesis import strategies as st

import hookcap
from hookcap import Monitor
from hookcap._capture.tree import tensor_leaves

LAYERS = ["linear", "tanh", "relu", "relu_inplace", "dropout", "layernorm", "gelu", "conv"]


def build(kinds, dtype, seed):
    torch.manual_seed(seed)
    dim = 6
    mods = []
    for k in kinds:
        mods.append({
            "linear": lambda: nn.Linear(dim, dim),
            "tanh": nn.Tanh,
            "relu": nn.ReLU,
            "relu_inplace": lambda: nn.ReLU(inplace=True),
            "dropout": lambda: nn.Dropout(0.2),
            "layernorm": lambda: nn.LayerNorm(dim),
            "gelu": nn.GELU,
            "conv": lambda: nn.Conv1d(dim, dim, 1),
        }[k]())
    return nn.Sequential(*mods).to(dtype)


class Inject:
    """Forward hook replacing one output element at one step (registered before the Monitor)."""

    def __init__(self, step, value):
        self.step, self.value, self.now = step, value, 0

    def __call__(self, mod, args, out):
        if self.now == self.step:
            out = out.clone()
            out.view(-1)[1] = self.value
            return out
        return None


def run(model, xs, monitored, inject_at=None, inj=None, timing=False):
    torch.manual_seed(123)
    handle = model[inject_at].register_forward_hook(inj) if inj is not None else None
    mon = (Monitor(model, capture=("output", "grad_output"), on_anomaly=None, timing=timing).attach()
           if monitored else None)
    ref_values = {}
    ref_handles = []
    if monitored:
        for i, m in enumerate(model):
            def keep(mod, args, out, i=i):
                for _, t in tensor_leaves(out):
                    ref_values.setdefault((cur[0], f"{i}/output"), []).append(
                        t.detach().double().reshape(-1).numpy().copy())
            ref_handles.append(m.register_forward_hook(keep))
    cur = [0]
    outs = []
    for s, x in enumerate(xs):
        cur[0] = s
        if inj is not None:
            inj.now = s
        y = model(x)
        y.float().sum().backward()
        outs.append(y.detach().clone())
        if mon:
            mon.step()
    for h in ref_handles:
        h.remove()
    if handle:
        handle.remove()
    if mon:
        mon.detach()
    return outs, mon, ref_values


@settings(max_examples=int(__import__("os").environ.get("HOOKCAP_FUZZ_EXAMPLES", "40")), deadline=None)
@given(
    kinds=st.lists(st.sampled_from(LAYERS), min_size=1, max_size=6),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 10_000),
    timing=st.booleans(),
    inject=st.one_of(st.none(), st.tuples(st.integers(0, 5), st.integers(0, 2),
                                          st.sampled_from([math.nan, math.inf, -math.inf, 0.0]))),
)
def test_random_stacks(kinds, dtype, seed, timing, inject):
    g = torch.Generator().manual_seed(seed)
    kinds = ["linear"] + kinds  # something with parameters, so backward has work to do
    xs = [torch.randn(3, 6, generator=g, dtype=dtype) for _ in range(3)]
    if "conv" in kinds:  # Conv1d wants (N, C, L)
        xs = [x.unsqueeze(-1) for x in xs]
        kinds = ["conv" if k == "linear" else ("tanh" if k == "layernorm" else k) for k in kinds]
    # In-place ReLU is only valid where the previous op did not save its output.
    kinds = [k if k != "relu_inplace" or kinds[i - 1] in ("linear", "conv") else "relu"
             for i, k in enumerate(kinds)]
    layer, step, value = (None, None, None) if inject is None else (inject[0] % len(kinds), *inject[1:])
    plain = build(kinds, dtype, seed)
    watched = build(kinds, dtype, seed)
    mk = (lambda: Inject(step, value)) if inject is not None else (lambda: None)
    a, _, _ = run(plain, xs, False, layer, mk())
    b, mon, ref_values = run(watched, xs, True, layer, mk(), timing)
    for ya, yb in zip(a, b):  # telemetry never changes outputs
        assert torch.equal(ya, yb) or (torch.isnan(ya).any() and torch.equal(ya.nan_to_num(), yb.nan_to_num()))
    h = mon.history()
    for (s, name), chunks in ref_values.items():
        vals = np.concatenate(chunks)
        want = hookcap.reference.stats_from_values(vals, h.histogram_spec)
        got = {k: h[k][s, h.column(name)] for k in hookcap.STAT_NAMES}
        got["hist"], got["bin_edges"] = h.histogram(name)[s], h.bin_edges
        fin = vals[np.isfinite(vals)]
        assert_stats_match(got, want, abs_sum=float(np.abs(fin).sum()))
        if timing:  # each module ran once per step; only layer 0's input needs no grad
            assert h["fwd_ms"][s, h.column(name)] >= 0
            bwd = h["bwd_ms"][s, h.column(name)]
            assert math.isnan(bwd) if name == "0/output" else bwd >= 0
    if inject is not None and not (value == 0.0):
        first = [a for a in mon.anomalies if a.kind == "nonfinite"]
        assert first and first[0].step == step and first[0].name == f"{layer}/output"
