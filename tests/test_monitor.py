"""Monitor on real models against an independent float64 recording made with
plain PyTorch hooks; naming, merging, cadence, capacity, non-invasiveness."""

import gc
import math
import logging
import weakref
from collections import defaultdict

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import assert_stats_match, stall_reader
from torch.utils.checkpoint import checkpoint

import hookcap
from hookcap import Histogram, Monitor
from hookcap._capture.tree import tensor_leaves
from hookcap.models import TinyResNet, TinyTransformer

transformers = pytest.importorskip("transformers")


def gpt2(n_layer=2, dropout=0.0):
    cfg = transformers.GPT2Config(n_layer=n_layer, n_embd=32, n_head=2, vocab_size=97, n_positions=32,
                                  resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


class RefRecorder:
    """Plain forward hooks + tensor hooks keeping float64 copies of every
    output and output-gradient of the leaf modules, per step."""

    def __init__(self, model):
        self.values = defaultdict(list)
        self.step = 0
        self.handles = []
        for qual, mod in model.named_modules():
            if next(mod.children(), None) is None:
                self.handles.append(mod.register_forward_hook(self._hook(qual or ".")))

    def _hook(self, name):
        def hook(mod, args, out):
            if torch._C._current_graph_task_id() != -1:
                return
            for path, t in tensor_leaves(out):
                key = f"{name}/output" + (f".{path}" if path else "")
                self.values[(self.step, key)].append(t.detach().double().reshape(-1).numpy().copy())
                if t.requires_grad:
                    gkey = key.replace("/output", "/grad_output")
                    t.register_hook(lambda g, k=gkey, s=self.step: self.values[(s, k)].append(
                        g.double().reshape(-1).numpy().copy()))
        return hook

    def close(self):
        for h in self.handles:
            h.remove()


def compare_history(h, ref: RefRecorder, steps):
    checked = 0
    for (step, name), chunks in ref.values.items():
        assert name in h.names, name
        s = list(h.steps).index(step)
        m = h.column(name)
        vals = np.concatenate(chunks)
        want = hookcap.reference.stats_from_values(vals, h.histogram_spec)
        got = {k: h[k][s, m] for k in hookcap.STAT_NAMES}
        got["hist"], got["bin_edges"] = h.histogram(name)[s], h.bin_edges
        assert_stats_match(got, want, abs_sum=float(np.abs(vals[np.isfinite(vals)]).sum()))
        checked += 1
    assert checked > 0 and set(h.steps.tolist()) == set(steps)
    return checked


def train_steps(model, mon, batches, ref=None, opt=None):
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.05)
    for i, (x, y) in enumerate(batches):
        if ref:
            ref.step = i
        out = model(x)
        logits = out.logits if hasattr(out, "logits") else out
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if mon:
            mon.step()


def lm_batches(n, vocab=97, b=4, t=16):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(vocab, (b, t), generator=g), torch.randint(vocab, (b, t), generator=g)) for _ in range(n)]


def img_batches(n, b=4):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(b, 3, 16, 16, generator=g), torch.randint(10, (b,), generator=g)) for _ in range(n)]


@pytest.mark.parametrize("make,batches", [(gpt2, lm_batches), (TinyResNet, img_batches)])
def test_stats_match_plain_hook_reference(make, batches):
    model = make()
    ref = RefRecorder(model)
    with Monitor(model) as mon:
        train_steps(model, mon, batches(3), ref)
    ref.close()
    n = compare_history(mon.history(), ref, range(3))
    assert n > 20


def test_nested_output_names_gpt2():
    model = gpt2()
    with Monitor(model, modules=[".", "transformer.h.0.attn", "transformer.h.0"]) as mon:
        train_steps(model, mon, lm_batches(1))
    names = set(mon.history().names)
    assert "./output.logits" in names
    assert "transformer.h.0.attn/output.0" in names
    assert any(n.startswith("transformer.h.0/output") for n in names)
    assert "./grad_output.logits" in names
    assert not any("past_key_values" in n and "None" in n for n in names)


def test_nested_containers_and_non_tensors():
    class Odd(nn.Module):
        def forward(self, x):
            return {"a": (x * 2, None, "s"), "b": [x.long(), x + 1], "c": 3}

    model = nn.Sequential(Odd())
    with Monitor(model, capture="output") as mon:
        model(torch.randn(5))
        mon.step()
    h = mon.history()
    assert h.names == ["0/output.a.0", "0/output.b.1"]


def test_input_prehook_sees_values_before_inplace_relu():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True))
    with Monitor(model, capture=("input", "output")) as mon:
        model(torch.randn(64, 4))
        mon.step()
    h = mon.history()
    assert h["min"][0, h.column("1/input")] < 0  # recorded before ReLU ran in place
    assert h["min"][0, h.column("1/output")] >= 0


def test_grad_accumulation_and_module_reuse_merge():
    lin = nn.Linear(6, 6)
    model = nn.Sequential(lin, nn.Tanh())
    xs = [torch.randn(3, 6) for _ in range(3)]
    with Monitor(model, capture=("output", "grad_output", "param_grad")) as mon:
        for x in xs:  # 3 micro-batches, each calling lin twice
            model(lin(x)).sum().backward()
        mon.step()
    h = mon.history()
    assert h["count"][0, h.column("0/output")] == 3 * 2 * 18  # 3 micro-batches x 2 calls
    assert h["count"][0, h.column("0/grad_output")] == 3 * 2 * 18
    # param_grad: the final accumulated gradient, once (not a sum of partials).
    c = h.column("0.weight/param_grad")
    assert h["count"][0, c] == 36
    ref = hookcap.reference.tensor_stats(lin.weight.grad)
    assert h["sum"][0, c] == pytest.approx(ref["sum"], rel=1e-6)
    assert h["absmax"][0, c] == ref["absmax"]


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_recompute_not_double_counted(reentrant):
    inner = nn.Sequential(nn.Linear(5, 5), nn.Tanh())
    outer = nn.Linear(5, 1)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.outer = inner, outer

        def forward(self, x):
            return self.outer(checkpoint(self.inner, x, use_reentrant=reentrant))

    model = M()
    x = torch.randn(7, 5, requires_grad=True)
    with Monitor(model, capture=("output", "grad_output")) as mon:
        model(x).sum().backward()
        mon.step()
    h = mon.history()
    assert h["count"][0, h.column("inner.0/output")] == 35
    assert h["count"][0, h.column("inner.1/grad_output")] == 35


def test_every_records_only_cadence_steps():
    model = nn.Sequential(nn.Linear(3, 3))
    with Monitor(model, every=3, capture="output") as mon:
        for _ in range(8):
            model(torch.randn(2, 3))
            mon.step()
    assert mon.history().steps.tolist() == [0, 3, 6]


def test_capacity_keeps_newest():
    model = nn.Sequential(nn.Linear(3, 3))
    with Monitor(model, capacity=5, capture="output") as mon:
        for _ in range(12):
            model(torch.randn(2, 3))
            mon.step()
    h = mon.history()
    assert h.steps.tolist() == list(range(7, 12)) and h.last(2).steps.tolist() == [10, 11]


def test_dropped_steps_counted_when_reader_stalls(caplog):
    model = nn.Sequential(nn.Linear(3, 3))
    mon = Monitor(model, capture="output").attach()
    unstall = stall_reader(mon)
    for _ in range(10):
        model(torch.randn(2, 3))
        mon.step()
    # 4 ring slots, one of them holding the open step 10: steps 0..6 were
    # overwritten unread, 7..9 are still in the ring.
    assert mon.dropped_steps == 7
    unstall()
    assert mon.history().steps.tolist() == [7, 8, 9]
    assert sum("dropped" in r.message for r in caplog.records) == 1
    mon.detach()


def test_new_metric_later_and_ring_growth():
    layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(100)])

    class Grow(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = layers
            self.k = 1

        def forward(self, x):
            for layer in self.layers[: self.k]:
                x = layer(x)
            return x

    model = Grow()
    with Monitor(model, capture="output") as mon:
        for k in (1, 100, 3):
            model.k = k
            model(torch.randn(4, 2))
            mon.step()
    h = mon.history()
    assert len(h.names) == 100
    counts = h["count"]
    assert np.isnan(counts[0, 50]) and counts[1, 99] == 8 and np.isnan(counts[2, 99]) and counts[2, 2] == 8


def _run(model_fn, batches, monitored, seed=0):
    torch.manual_seed(seed)
    model = model_fn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    outs, grads = [], []
    mon = Monitor(model, capture=hookcap.CAPTURE_KINDS).attach() if monitored else None
    for x, y in batches:
        out = model(x)
        logits = out.logits if hasattr(out, "logits") else out
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        outs.append(loss.detach().clone())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        if mon:
            mon.step()
    if mon:
        mon.detach()  # an attached Monitor stays reachable and would record later tests' taps
    return outs, grads, model.state_dict()


@pytest.mark.parametrize("make,batches", [(lambda: gpt2(dropout=0.1), lm_batches), (TinyResNet, img_batches),
                                          (TinyTransformer, lambda n: lm_batches(n, vocab=256))])
def test_outputs_and_gradients_bitwise_identical(make, batches):
    data = batches(3)
    a = _run(make, data, False)
    b = _run(make, data, True)
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)
    for ga, gb in zip(a[1], b[1]):
        for x, y in zip(ga, gb):
            assert torch.equal(x, y)
    for k in a[2]:
        assert torch.equal(a[2][k], b[2][k])


def test_detach_removes_every_hook_and_keeps_state_dict():
    model = TinyResNet()

    def hook_dicts(m):
        return [(len(x._forward_hooks), len(x._forward_pre_hooks), len(x._backward_hooks),
                 len(x._backward_pre_hooks)) for x in m.modules()]

    before = hook_dicts(model)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    mon = Monitor(model, capture=hookcap.CAPTURE_KINDS).attach()
    assert hook_dicts(model) != before
    assert model.state_dict().keys() == sd.keys()
    mon.detach()
    assert hook_dicts(model) == before
    assert all(p._post_accumulate_grad_hooks in (None, {}) or len(p._post_accumulate_grad_hooks) == 0
               for p in model.parameters())
    for _ in range(50):
        Monitor(model, capture=hookcap.CAPTURE_KINDS).attach().detach()
    assert hook_dicts(model) == before


def test_no_reference_to_activations_after_hooks():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    with Monitor(model, capture=("input", "output", "grad_output")) as mon:
        x = torch.randn(3, 4, requires_grad=True)
        out = model(x)
        ref = weakref.ref(out)
        out.sum().backward()
        del out
        gc.collect()
        assert ref() is None
        mon.step()


def test_eval_no_grad_inference_mode_autocast():
    model = TinyTransformer()
    model.eval()
    idx = torch.randint(256, (2, 8))
    with Monitor(model, capture=("input", "output", "grad_output"), eval_forwards="merge") as mon:  # inference
        with torch.no_grad():
            model(idx)
        mon.step()
        with torch.inference_mode():
            model(idx)
        mon.step()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(idx)
        mon.step()
    h = mon.history()
    assert h.steps.tolist() == [0, 1, 2]
    assert not any("grad" in n for n in h.names)
    c = h.column("head/output")
    assert (h["count"][:, c] == 2 * 8 * 256).all()
    assert h.meta("head/output")["dtype"] == "torch.float32"
    assert mon.history()["finite"][2, c] == 2 * 8 * 256


def test_everything_global_capture_names():
    named = nn.Sequential(nn.Linear(3, 3))
    other = nn.Sequential(nn.Linear(3, 2), nn.ReLU())
    mon = Monitor.everything(named, capture="output")
    with mon:
        named(torch.randn(2, 3))
        other(torch.randn(2, 3))
        mon.step()
    names = mon.history().names
    assert "0/output" in names and "./output" in names
    assert "Sequential#0/output" in names and "Linear#0/output" in names and "ReLU#0/output" in names
    other(torch.randn(2, 3))  # detached: nothing recorded
    assert len(mon.names) == len(names)


def test_optimizer_argument_steps_automatically():
    model = nn.Sequential(nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(model, capture=("output", "param"), optimizer=opt) as mon:
        for _ in range(3):
            model(torch.randn(4, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
    h = mon.history()
    assert h.steps.tolist() == [0, 1, 2]
    assert "0.weight/param" in h.names


@pytest.mark.parametrize("kwargs,match", [
    ({"capture": ("output", "weights")}, "capture"),
    ({"capacity": 0}, "capacity"),
    ({"every": 0}, "every"),
    ({"histogram": "log2"}, "histogram"),
    ({"modules": 3}, "modules"),
    ({"stream": "low"}, "stream"),
    ({"stream": None}, "stream"),
])
def test_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Monitor(nn.Linear(2, 2), **kwargs)


def test_linear_histogram_and_none():
    model = nn.Sequential(nn.Linear(3, 3))
    for hist in (Histogram.linear(-1, 1, 8), None):
        with Monitor(model, histogram=hist, capture="output") as mon:
            model(torch.randn(5, 3))
            mon.step()
        h = mon.history()
        if hist is None:
            with pytest.raises(ValueError):
                h.histogram("0/output")
        else:
            assert h.histogram("0/output").sum() == 15 and len(h.bin_edges) == 11


def test_to_pandas_long_format():
    pd = pytest.importorskip("pandas")
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    with Monitor(model, capture="output") as mon:
        for _ in range(2):
            model(torch.randn(5, 3))
            mon.step()
    df = mon.history().to_pandas()
    assert isinstance(df, pd.DataFrame) and len(df) == 4 and set(df["step"]) == {0, 1}


def test_grad_input_equals_full_backward_hook_and_survives_inplace():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    seen = {}
    handle = model[2].register_full_backward_hook(
        lambda m, gi, go: seen.update(gi=gi[0].double().numpy().copy()))
    x = torch.randn(5, 4)
    with Monitor(model, capture="grad_input") as mon:
        model(x).pow(2).sum().backward()
        mon.step()
    handle.remove()
    h = mon.history()
    ref = hookcap.reference.stats_from_values(seen["gi"])
    c = h.column("2/grad_input")
    assert h["count"][0, c] == 30 and h["sumsq"][0, c] == pytest.approx(ref["sumsq"], rel=1e-6)
    assert "0/grad_input" not in h.names  # the model input does not require grad
    # In-place ReLU after a hooked module: full backward hooks would raise here.
    cnn = TinyResNet()
    with Monitor(cnn, capture=hookcap.CAPTURE_KINDS) as mon:
        train_steps(cnn, mon, img_batches(1))
    assert any(n.endswith("/grad_input") for n in mon.history().names)


class _ScaleInPlace(nn.Module):
    def __init__(self, inplace=True):
        super().__init__()
        self.inplace = inplace

    def forward(self, x):
        return x.mul_(3.0) if self.inplace else x * 3.0


class _SliceThenScale(nn.Module):
    """Linear, then scales columns 1:4 of its output (a view) by 3."""

    def __init__(self, inplace=True):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.scale = _ScaleInPlace(inplace)

    def forward(self, x):
        h = self.lin(x)
        y = self.scale(h[:, 1:4])
        return h if self.scale.inplace else torch.cat([h[:, :1], y, h[:, 4:]], 1)


@pytest.mark.parametrize("kind", ["relu", "slice"])
def test_grad_input_of_a_module_that_modifies_its_input_in_place(kind):
    # The alias's tensor hook dies with the in-place op; the gradient comes
    # from the CopySlices node instead. Reference: the same model without the
    # in-place op, where a tensor hook on the module's input works.
    torch.manual_seed(0)
    x = torch.randn(5, 4)

    def make(inplace):
        torch.manual_seed(1)
        if kind == "relu":
            return nn.Sequential(nn.Linear(4, 6), nn.ReLU(inplace=inplace), nn.Linear(6, 2))
        return _SliceThenScale(inplace)

    name = "1/grad_input" if kind == "relu" else "scale/grad_input"
    plain = make(False)
    seen = {}
    inner = plain[1] if kind == "relu" else plain.scale
    inner.register_forward_pre_hook(
        lambda m, a: a[0].register_hook(lambda g: seen.update(g=g.double().numpy().copy())) and None)
    plain(x).pow(2).sum().backward()
    model = make(True)
    with Monitor(model, capture="grad_input") as mon:
        model(x).pow(2).sum().backward()
        mon.step()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).pow(2).sum().backward()  # without the Monitor: the same gradients
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))
    h = mon.history()
    ref = hookcap.reference.stats_from_values(seen["g"])
    c = h.column(name)
    assert h["count"][0, c] == seen["g"].size
    assert h["sum"][0, c] == pytest.approx(ref["sum"], rel=1e-5, abs=1e-6)
    assert h["sumsq"][0, c] == pytest.approx(ref["sumsq"], rel=1e-5)
    assert h["absmax"][0, c] == pytest.approx(ref["absmax"], rel=1e-6)


def test_a_step_closed_before_any_forward_stays_in_the_history_all_nan():
    """As the docs say of empty steps: a step() before the first forward (no
    ring exists yet) is recorded too, NaN for every metric."""
    m = torch.nn.Sequential(torch.nn.Linear(3, 2))
    x = torch.randn(2, 3, dtype=torch.float64)
    m = m.double()
    with hookcap.Monitor(m, capture=("output",)) as mon:
        mon.step()
        m(x)
        mon.step()
        mon.step()
    h = mon.history()
    assert h.steps.tolist() == [0, 1, 2]
    l2 = h["l2norm"][:, h.names.index("0/output")]
    assert np.isnan(l2[0]) and np.isnan(l2[2])
    assert l2[1] == pytest.approx(float(torch.linalg.vector_norm(m(x))), rel=1e-12)


@pytest.mark.parametrize("transform", ["grad", "vjp", "jacrev", "vmap_grad", "functional_call"])
def test_torch_func_transforms_never_raise_and_plain_calls_stay_exact(transform, caplog):
    """Cold (first forward inside the transform) and warm: the user's code
    runs as without hookcap, the transform's tensors are skipped with one
    warning per metric and reason, and plain forwards are recorded exactly."""
    from torch.func import functional_call, grad, jacrev, vjp, vmap

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1)).double()
    params = {k: v.detach() for k, v in m.named_parameters()}
    x = torch.randn(5, 3, dtype=torch.float64)

    def loss(p, x):
        return functional_call(m, p, (x,)).sum()

    run = {
        "grad": lambda: grad(loss)(params, x),
        "vjp": lambda: vjp(lambda p: loss(p, x), params)[1](torch.tensor(1.0, dtype=torch.float64)),
        "jacrev": lambda: jacrev(loss)(params, x),
        "vmap_grad": lambda: vmap(grad(loss), in_dims=(None, 0))(params, x),
        "functional_call": lambda: loss(params, x),
    }[transform]
    want = run()
    with caplog.at_level(logging.WARNING, logger="hookcap"), hookcap.Monitor(m, capture="output") as mon:
        for _ in range(2):  # cold, then warm
            got = run()
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            out = m(x)  # a plain forward in the same step
            mon.step()
    h = mon.history()
    c = h.column("2/output")
    # functional_call alone runs plain tensors: its call (the same values) is recorded too.
    calls = 2 if transform == "functional_call" else 1
    want_l2 = math.sqrt(calls) * float(torch.linalg.vector_norm(out))
    assert h["l2norm"][1, c] == pytest.approx(want_l2, rel=1e-12)
    assert h["count"][1, c] == calls * out.numel()
    if transform != "functional_call":
        msgs = [r.getMessage() for r in caplog.records if "torch.func" in r.getMessage()]
        assert msgs and len(msgs) == len(set(msgs))


def test_detach_closes_an_open_step_that_holds_records():
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    mon = hookcap.Monitor(m, capture="output").attach()
    m(torch.randn(4, 3))
    mon.step()
    x = torch.randn(5, 3)
    out = m(x)  # an evaluation after the last step(), say
    mon.detach()
    h = mon.history()
    assert h.steps.tolist() == [0, 1] and mon.current_step == 2
    assert h["count"][1, 0] == out.numel() and h["max"][1, 0] == out.max().item()
    mon.attach()  # an open step with nothing in it stays open
    mon.detach()
    assert mon.current_step == 2 and mon.history().steps.tolist() == [0, 1]


def test_the_retired_fused_argument_is_refused_with_its_reason():
    """``Monitor(fused=True)`` (statistics inside compiled kernels) is retired:
    a ValueError that says why; ``fused=False`` is still accepted."""
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="retired.*slower than the op"):
        hookcap.Monitor(model, fused=True)
    mon = hookcap.Monitor(model, fused=False).attach()
    model(torch.randn(3, 2))
    mon.step()
    mon.detach()
    assert mon.history().names  # recorded as usual
