"""torch.compile: a Monitor attached before compile(fullgraph=True) traces
without graph breaks, records the eager stats, and its cadence causes no
recompiles (the kernels read the device-side enabled flag)."""

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import hookcap
from hookcap import Monitor
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


def test_param_grad_recorded_with_compiled_model_grad_output_not():
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    mon = Monitor(model, capture=("output", "grad_output", "param_grad")).attach()
    cm = torch.compile(model, fullgraph=True)
    for _ in range(3):
        cm(torch.randn(5, 4)).sum().backward()
        model.zero_grad()
        mon.step()
    h = mon.history()
    assert "0.weight/param_grad" in h.names and "2/output" in h.names
    assert not any(n.endswith("/grad_output") for n in h.names)  # documented limitation
    assert (h["count"][:, h.column("0.weight/param_grad")] == 32).all()
    mon.detach()


def test_opcheck_still_passes_after_compile_use():
    from hookcap import _layout
    from hookcap.functional import new_state

    h = hookcap.Histogram.log2()
    ring = torch.zeros((2, 2, _layout.HEADER + h.nbins), dtype=torch.int64)
    torch.library.opcheck(torch.ops.hookcap.accumulate.default,
                          (torch.randn(9), ring, new_state("cpu"), 1, *h.op_args()))
