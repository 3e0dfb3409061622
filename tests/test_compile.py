"""torch.compile: a Monitor attached before compile(fullgraph=True) traces
without graph breaks, records the eager stats, and its cadence causes no
recompiles (the kernels read the device-side enabled flag)."""

import gc

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import hookcap
from conftest import assert_recorded
from hookcap import Monitor
from hookcap._capture import compile as _compile
from hookcap.models import TinyResNet, TinyTransformer


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def run(model, x, capture, every, compiled, steps=7):
    torch.manual_seed(0)
    mon = Monitor(model, capture=capture, every=every).attach()
    fn = torch.compile(model, fullgraph=True) if compiled else model
    start = counters["stats"]["unique_graphs"]
    graphs = []
    for _ in range(steps):
        fn(x)
        mon.step()
        graphs.append(counters["stats"]["unique_graphs"] - start)
    mon.detach()
    return mon.history(), graphs


@pytest.mark.parametrize("make,x", [
    (TinyTransformer, torch.randint(256, (2, 16))),
    (lambda: TinyResNet().eval(), torch.randn(2, 3, 16, 16)),
])
def test_fullgraph_no_breaks_same_stats_no_recompiles(make, x):
    torch.manual_seed(0)
    model = make()
    mon = Monitor(model, capture=("input", "output")).attach()
    explain = torch._dynamo.explain(model)(x)
    assert explain.graph_break_count == 0
    mon.detach()
    torch._dynamo.reset()
    eager, _ = run(model, x, ("input", "output"), 3, False)
    torch._dynamo.reset()
    comp, graphs = run(model, x, ("input", "output"), 3, True)
    assert graphs[0] == graphs[-1] == 1  # one graph, no recompile across on/off steps
    assert comp.steps.tolist() == eager.steps.tolist() == [0, 3, 6]
    assert sorted(comp.names) == sorted(eager.names)
    for name in eager.names:
        e, c = eager.column(name), comp.column(name)
        for stat in ("count", "nan", "zeros"):
            np.testing.assert_array_equal(comp[stat][:, c], eager[stat][:, e], err_msg=f"{name} {stat}")
        for stat in ("mean", "std", "absmax", "l2norm"):
            np.testing.assert_allclose(comp[stat][:, c], eager[stat][:, e], rtol=1e-4, atol=1e-6,
                                       err_msg=f"{name} {stat}")


def train_run(model, xs, compiled, every=1, compiled_autograd=False, **kw):
    """Forward + backward per step; returns (History, unique graphs so far per step)."""
    mon = Monitor(model, capture=("output", "grad_output", "grad_input", "param_grad"),
                  every=every, **kw).attach()
    fn = torch.compile(model, fullgraph=True) if compiled else model
    start = counters["stats"]["unique_graphs"]
    graphs = []
    for x in xs:
        if compiled_autograd:
            with torch._dynamo.compiled_autograd._enable(torch.compile(fullgraph=False)):
                fn(x).pow(2).sum().backward()
        else:
            fn(x).pow(2).sum().backward()
        model.zero_grad()
        mon.step()
        graphs.append(counters["stats"]["unique_graphs"] - start)
    mon.detach()
    return mon.history(), graphs


@pytest.mark.parametrize("compiled_autograd", [False, True])
def test_gradient_kinds_under_compile_match_eager(compiled_autograd):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    xs = [torch.randn(5, 4) for _ in range(5)]
    eager, _ = train_run(model, xs, compiled=False, every=2)
    torch._dynamo.reset()
    comp, graphs = train_run(model, xs, compiled=True, every=2, compiled_autograd=compiled_autograd)
    if not compiled_autograd:
        assert graphs[0] == graphs[-1]  # cadence: no recompiles across on/off steps
    assert comp.steps.tolist() == eager.steps.tolist() == [0, 2, 4]
    kinds = {n.split("/")[1].split(".")[0] for n in comp.names}
    assert {"output", "grad_output", "grad_input", "param_grad"} <= kinds
    assert sorted(comp.names) == sorted(eager.names)
    for name in eager.names:
        e, c = eager.column(name), comp.column(name)
        for stat in ("count", "nan", "zeros"):
            np.testing.assert_array_equal(comp[stat][:, c], eager[stat][:, e], err_msg=f"{name} {stat}")
        for stat in ("mean", "std", "min", "max", "l2norm"):
            np.testing.assert_allclose(comp[stat][:, c], eager[stat][:, e], rtol=1e-4, atol=1e-6,
                                       err_msg=f"{name} {stat}")
        np.testing.assert_array_equal(comp.histogram(name), eager.histogram(name), err_msg=name)


def test_gradient_kinds_under_compile_equal_float64_reference():
    # Independent of the eager hooks: the grad_output of the last layer is
    # d(sum(y^2))/dy = 2y, and grad_input of the first layer is the gradient
    # w.r.t. the model input.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(6, 4, requires_grad=True)
    mon = Monitor(model, capture=("grad_output", "grad_input")).attach()
    y = torch.compile(model, fullgraph=True)(x)
    y.pow(2).sum().backward()
    mon.step()
    h = mon.history()
    ref_out = (2 * y.detach()).double()
    ref_in = x.grad.double()
    for name, ref in (("2/grad_output", ref_out), ("0/grad_input", ref_in)):
        col = h.column(name)
        assert h["count"][0, col] == ref.numel()
        np.testing.assert_allclose(h["sum"][0, col], ref.sum().item(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(h["l2norm"][0, col], ref.norm().item(), rtol=1e-5)
        np.testing.assert_allclose(h["max"][0, col], ref.max().item(), rtol=1e-6)
    mon.detach()


def test_opcheck_still_passes_after_compile_use():
    from hookcap import _layout
    from hookcap.functional import new_state

    h = hookcap.Histogram.log2()
    ring = torch.zeros((2, 2, _layout.HEADER + h.nbins), dtype=torch.int64)
    torch.library.opcheck(torch.ops.hookcap.accumulate.default,
                          (torch.randn(9), ring, new_state("cpu"), 1, *h.op_args()))


def test_timing_under_compile_no_breaks_times_only_eager():
    # Inside compiled code module boundaries are not kernels of their own
    # (inductor fuses and reorders across them): timing records nothing there
    # (NaN), adds no graph break, and eager calls are still timed.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    mon = Monitor(model, capture=("output", "grad_output"), timing=True).attach()
    assert torch._dynamo.explain(model)(x).graph_break_count == 0
    cm = torch.compile(model, fullgraph=True)
    cm(x).sum().backward()
    mon.step()
    model(x).sum().backward()
    mon.step()
    h = mon.history()
    c = h.column("2/output")
    assert np.isnan(h["fwd_ms"][0, c]) and np.isnan(h["bwd_ms"][0, c])
    assert h["fwd_ms"][1, c] >= 0 and h["bwd_ms"][1, c] >= 0
    mon.detach()


def test_timing_under_compiled_autograd_times_forward_only():
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    mon = Monitor(model, capture=("output", "grad_output"), timing=True).attach()
    for _ in range(2):
        with torch._dynamo.compiled_autograd._enable(torch.compile(fullgraph=False)):
            model(x).sum().backward()
        mon.step()
    model(x).sum().backward()  # eager again: timed
    mon.step()
    h = mon.history()
    c = h.column("2/output")
    assert np.all(h["fwd_ms"][:, c] >= 0)
    assert np.all(np.isnan(h["bwd_ms"][:2, c])) and h["bwd_ms"][2, c] >= 0
    mon.detach()


class Breaky(nn.Module):
    """Two compiled regions split by a graph break of the given kind."""

    def __init__(self, brk):
        super().__init__()
        self.brk = brk
        self.a = nn.Linear(4, 8)
        self.act = nn.Tanh()
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        h = self.act(self.a(x))
        if self.brk == "graph_break":
            torch._dynamo.graph_break()
        elif self.brk == "item":
            h = h * (1.0 + 0.0 * float(h.sum().item()))
        elif self.brk == "print":
            print(end="")
        return self.b(h)


def break_run(model, xs, compiled, capture, every=1, **kw):
    """Train steps; returns (History, outputs, gradients, unique graphs per step)."""
    mon = Monitor(model, capture=capture, every=every, **kw).attach() if capture else None
    fn = torch.compile(model) if compiled else model
    start = counters["stats"]["unique_graphs"]
    outs, grads, graphs = [], [], []
    for x in xs:
        y = fn(x)
        y.pow(2).sum().backward()
        outs.append(y.detach().clone())
        grads.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad()
        if mon is not None:
            mon.step()
        graphs.append(counters["stats"]["unique_graphs"] - start)
    if mon is not None:
        mon.detach()
    return (mon.history() if mon else None), outs, grads, graphs


def assert_same_history(comp, eager):
    assert comp.steps.tolist() == eager.steps.tolist()
    assert sorted(comp.names) == sorted(eager.names)
    for name in eager.names:
        e, c = eager.column(name), comp.column(name)
        for stat in ("count", "nan", "zeros", "finite"):
            np.testing.assert_array_equal(comp[stat][:, c], eager[stat][:, e], err_msg=f"{name} {stat}")
        for stat in ("mean", "std", "min", "max", "l2norm"):
            np.testing.assert_allclose(comp[stat][:, c], eager[stat][:, e], rtol=1e-6, atol=1e-7,
                                       err_msg=f"{name} {stat}")
        if eager.histogram_spec is not None:
            np.testing.assert_array_equal(comp.histogram(name), eager.histogram(name), err_msg=name)


@pytest.mark.parametrize("brk", ["graph_break", "item", "print"])
@pytest.mark.parametrize("capture", [("output", "grad_output"), hookcap.CAPTURE_KINDS])
def test_graph_breaks_train_and_equal_eager(brk, capture):
    torch.manual_seed(0)
    model = Breaky(brk)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(5, 4, generator=g) for _ in range(4)]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    eager, *_ = break_run(model, xs, False, capture, every=2)
    torch._dynamo.reset()
    model.load_state_dict(state)
    comp, outs, grads, graphs = break_run(model, xs, True, capture, every=2)
    assert_same_history(comp, eager)
    # Telemetry changes nothing: a compiled twin without a Monitor, bit for
    # bit. It has a no-op forward hook on every module: with any forward hook
    # in the graph after an `.item()` break, dynamo specializes on the float
    # and recompiles per value, hookcap or not. `every` adds no recompile.
    torch._dynamo.reset()
    model.load_state_dict(state)
    noop = [m.register_forward_hook(lambda *a: None) for m in model.children()]
    _, outs0, grads0, graphs0 = break_run(model, xs, True, None)
    for h in noop:
        h.remove()
    assert graphs == graphs0
    for a, b in zip(outs, outs0):
        assert torch.equal(a, b)
    for ga, gb in zip(grads, grads0):
        assert all(torch.equal(x, y) for x, y in zip(ga, gb))


def test_hf_gpt2_with_cache_compiled_trains_and_equals_eager():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=True)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(2)
    xs = [torch.randint(97, (2, 12), generator=g) for _ in range(2)]

    def steps(compiled):
        mon = Monitor(model).attach()
        fn = torch.compile(model) if compiled else model
        logits = []
        for x in xs:
            out = fn(input_ids=x, labels=x)
            out.loss.backward()
            logits.append(out.logits.detach())
            model.zero_grad()
            mon.step()
        mon.detach()
        return mon.history(), logits

    eager, _ = steps(False)
    torch._dynamo.reset()
    comp, logits = steps(True)
    assert len(eager.names) > 20 and sorted(comp.names) == sorted(eager.names)
    # Compiled kernels round differently from eager ones: counts agree exactly,
    # moments closely; the compiled values themselves are matched exactly below.
    for name in eager.names:
        e, c = eager.column(name), comp.column(name)
        for stat in ("count", "nan", "inf"):
            np.testing.assert_array_equal(comp[stat][:, c], eager[stat][:, e], err_msg=f"{name} {stat}")
        np.testing.assert_allclose(comp["l2norm"][:, c], eager["l2norm"][:, e], rtol=1e-3, err_msg=name)
    for step, lg in enumerate(logits):
        assert_recorded(comp, step, "lm_head/output", [lg])


def test_eager_writes_around_a_compiled_region_are_kept():
    # The compiled body's backward runs after the eager head's gradient was
    # recorded, and its forward before the head's output: neither may be
    # overwritten by the compiled graphs (they never hold the ring).
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
    head = nn.Linear(8, 2)
    model = nn.Sequential(body, head)
    mon = Monitor(model, capture=("output", "grad_output")).attach()
    cbody = torch.compile(body, fullgraph=True)
    xs = [torch.randn(5, 4), torch.randn(3, 4)]
    ys = []
    for x in xs:  # two micro-batches: gradient accumulation
        y = head(cbody(x))
        y.pow(2).sum().backward()
        ys.append(y.detach())
    mon.step()
    mon.detach()
    h = mon.history()
    with torch.no_grad():
        a = [body[0](x) for x in xs]
    assert_recorded(h, 0, "1/output", ys)
    assert_recorded(h, 0, "1/grad_output", [2 * y for y in ys])
    assert_recorded(h, 0, "0.0/output", a)
    assert_recorded(h, 0, "0.1/output", [torch.tanh(t) for t in a])


def test_a_graph_compiled_for_a_gone_monitor_writes_nowhere():
    # The record op names its Monitor by sink id; ids are never reused, so the
    # write of a cached graph whose Monitor is gone lands nowhere, not in the
    # rows of a Monitor created since.
    import gc

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(5, 4)
    old = Monitor(model, modules=["2"], capture="output").attach()
    model(x)
    stale = (old._recorder.fast.id, next(iter(old._recorder.rows.values())))
    old.detach()
    del old
    gc.collect()
    new = Monitor(model, modules=["2"], capture="output").attach()
    y = model(x)
    assert new._recorder.fast.id != stale[0]
    torch.ops.hookcap.record(torch.full((5, 3), 7.0), *stale)  # what a stale graph would run
    new.step()
    new.detach()
    h = new.history()
    assert h.names == ["2/output"]
    assert_recorded(h, 0, "2/output", [y])


def test_hf_gpt2_without_its_kv_cache_compiles_as_one_graph_with_a_monitor():
    """As docs/compile-and-distributed.md says: with use_cache=False a watched
    GPT-2 gets no graph break from hookcap."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 97, (2, 16))
    torch._dynamo.reset()
    with Monitor(model):
        explain = torch._dynamo.explain(lambda i: model(i, use_cache=False).logits)(ids)
    torch._dynamo.reset()
    assert explain.graph_break_count == 0 and explain.graph_count == 1


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def test_compiled_instances_of_one_class_record_their_own_calls():
    """Instances of one class share compiled code unless dynamo guards on their
    hooks: two watched by different Monitors and one unwatched, compiled and run
    in turn, each Monitor records exactly its own instance's calls at every step."""
    torch.manual_seed(0)
    gc.collect()  # Monitors other tests dropped without detach() give their hold back
    held = _compile._hook_guard_holders
    nets = [_Net(), _Net(), _Net()]
    mons = [Monitor(nets[0], capture=("output",)).attach(), Monitor(nets[1], capture=("output",)).attach()]
    assert torch._dynamo.config.skip_nnmodule_hook_guards is False
    compiled = [torch.compile(n) for n in nets]
    xs = [torch.randn(4, 8) + i for i in range(3)]
    graphs = counters["stats"]["unique_graphs"]
    seen = {0: [], 1: []}
    for step in range(3):
        for i in (2, 0, 1) if step % 2 else (0, 2, 1):  # the unwatched one first, or between
            compiled[i](xs[i])
        for i, mon in enumerate(mons):
            with mon.paused():
                seen[i].append(nets[i].b(torch.tanh(nets[i].a(xs[i]))))
            mon.step()
    for i, mon in enumerate(mons):
        h = mon.history()
        assert h.names == ["a/output", "b/output"] and h.steps.tolist() == [0, 1, 2]
        for step in range(3):
            assert_recorded(h, step, "b/output", [seen[i][step]])
    assert counters["stats"]["unique_graphs"] - graphs <= 3  # one graph per set of hooks
    for mon in mons:
        mon.detach()
    assert _compile._hook_guard_holders == held
    if held == 0:
        assert torch._dynamo.config.skip_nnmodule_hook_guards is True  # the default, restored
    mon = Monitor(_Net(), capture=("output",)).attach()
    del mon  # dropped while attached: collected, it gives its hold back
    gc.collect()
    assert _compile._hook_guard_holders == held
