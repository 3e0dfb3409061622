"""Telemetry must never hurt the run it watches: bad input, faults, exits,
concurrency and attach/detach churn."""

import gc
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch
import torch.nn as nn

import hookcap
from conftest import stall_reader
from hookcap import Monitor


class Emit(nn.Module):
    """Returns whatever ``make(x)`` builds: used to feed odd outputs to hooks."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def forward(self, x=None, **kw):
        return self.make(x if x is not None else kw)


def run_one(make, x=torch.randn(3, 4), capture=("input", "output", "grad_output"), **call_kw):
    model = nn.Sequential(Emit(make))
    with Monitor(model, capture=capture) as mon:
        model(x, **call_kw) if not call_kw else model[0](**call_kw)
        mon.step()
    return mon.history()


@pytest.mark.parametrize("make,expect", [
    (lambda x: x.to(torch.int32), []),
    (lambda x: x > 0, []),
    (lambda x: torch.complex(x, x), []),
    (lambda x: None, []),
    (lambda x: "text", []),
    (lambda x: (i for i in range(3)), []),
    (lambda x: {"a": [x, (None, x.long())], "b": "s"}, ["0/output.a.0"]),
    (lambda x: x.new_zeros(0, 4), ["0/output"]),
    (lambda x: x.sum(), ["0/output"]),
    (lambda x: x[:1].expand(5, 4), ["0/output"]),
])
def test_odd_outputs_are_recorded_or_skipped(make, expect):
    h = run_one(make)
    assert [n for n in h.names if "/output" in n] == expect


@pytest.mark.parametrize("make,why", [
    (lambda x: x.to_sparse(), "layout"),
    (lambda x: x.to_sparse_csr(), "layout"),
    (lambda x: torch.quantize_per_tensor(x, 0.1, 0, torch.quint8), "quantized"),
    (lambda x: torch.nested.nested_tensor([x[0], x[1, :2]]), "nested"),
    (lambda x: torch.empty(3, device="meta"), "meta"),
])
def test_unsupported_kinds_skipped_with_one_warning(make, why, caplog):
    model = nn.Sequential(Emit(make))
    with caplog.at_level(logging.WARNING, logger="hookcap"):
        with Monitor(model, capture="output") as mon:
            for _ in range(3):
                model(torch.randn(3, 4))
                mon.step()
    assert mon.history().names == []
    msgs = [r.message for r in caplog.records if "a call was not recorded" in r.message]
    assert len(msgs) == 1 and why in msgs[0]


def test_forward_that_raises_leaves_monitor_consistent():
    class Boom(nn.Module):
        def forward(self, x):
            if x.abs().max() > 1e6:
                raise ValueError("boom")
            return x * 2

    model = nn.Sequential(nn.Linear(4, 4), Boom(), nn.Linear(4, 1))
    with Monitor(model, capture=("output", "grad_output")) as mon:
        model(torch.randn(2, 4)).sum().backward()
        mon.step()
        with pytest.raises(ValueError, match="boom"):
            model(torch.full((2, 4), 1e9))
        mon.step()  # the failed step closes normally
        model(torch.randn(2, 4)).sum().backward()
        mon.step()
    h = mon.history()
    assert h.steps.tolist() == [0, 1, 2]
    c = h.column("2/output")
    assert h["count"][0, c] == 2 and np.isnan(h["count"][1, c]) and h["count"][2, c] == 2
    # Step 1 recorded what did run (layer 0) and nothing of the layers after the error.
    assert h["count"][1, h.column("0/output")] == 8


def test_kwargs_only_call_and_input_capture():
    model = nn.Sequential(Emit(lambda kw: kw["a"] * kw["b"]))
    with Monitor(model, capture=("input", "output")) as mon:
        model[0](a=torch.ones(3), b=torch.full((3,), 2.0))
        mon.step()
    h = mon.history()
    assert set(h.names) == {"0/input.a", "0/input.b", "0/output"}
    assert h["sum"][0, h.column("0/output")] == 6.0


def test_model_cast_after_attach_keeps_recording():
    model = nn.Sequential(nn.Linear(3, 3))
    with Monitor(model, capture="output") as mon:
        model(torch.randn(2, 3))
        mon.step()
        model.to(torch.float64)
        model(torch.randn(2, 3, dtype=torch.float64))
        mon.step()
    h = mon.history()
    assert h["count"][:, 0].tolist() == [6, 6]
    assert h.meta("0/output")["dtype"] == "torch.float32"  # as first seen


def test_two_monitors_on_one_model_and_detach_inside_hook():
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    a = Monitor(model, capture="output").attach()
    b = Monitor(model, capture=("output", "grad_output")).attach()
    model[1].register_forward_hook(lambda m, i, o: a.detach() if a._attached else None)
    model(torch.randn(2, 3)).sum().backward()
    a.step()
    b.step()
    model(torch.randn(2, 3)).sum().backward()
    b.step()
    assert a.history().names == ["0/output", "1/output"] and len(a.history()) == 1
    assert len(b.history()) == 2 and "1/grad_output" in b.history().names
    b.detach()


def test_monitors_on_two_models_in_two_threads():
    results = {}

    def work(k):
        torch.manual_seed(k)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        with Monitor(model, capture=("output", "grad_output", "param_grad")) as mon:
            for _ in range(30):
                model(torch.randn(5, 4)).sum().backward()
                model.zero_grad()
                mon.step()
        results[k] = mon.history()

    ts = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for k in range(2):
        h = results[k]
        assert h.steps.tolist() == list(range(30))
        assert (h["count"][:, h.column("0/output")] == 40).all()


def test_attach_detach_churn_leaves_no_hooks_or_memory():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    before = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]
    x = torch.randn(2, 4)
    gc.collect()
    base = len(gc.get_objects())
    for _ in range(1000):
        with Monitor(model, capture=hookcap.CAPTURE_KINDS) as mon:
            model(x).sum().backward()
            mon.step()
    del mon
    gc.collect()
    assert [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()] == before
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    assert len(gc.get_objects()) - base < 500  # no per-Monitor leftovers


def test_invalid_glob_is_a_clear_error():
    with pytest.raises(ValueError, match="matched no module"):
        Monitor(nn.Sequential(nn.Linear(2, 2)), modules="encoder.*").attach()


_EXIT_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time, torch, torch.nn as nn, hookcap
    model = nn.Sequential(nn.Linear(3, 3))
    mon = hookcap.Monitor(model, capture="output", dump_on_exit=sys.argv[1]).attach()
    for _ in range(5):
        model(torch.randn(2, 3)); mon.step()
    mode = sys.argv[2]
    if mode == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM); time.sleep(5)
    elif mode == "interrupt":
        raise KeyboardInterrupt
    print("normal exit")
""")


@pytest.mark.parametrize("mode,rc", [("normal", 0), ("sigterm", -signal.SIGTERM), ("interrupt", -signal.SIGINT)])
def test_dump_on_exit(tmp_path, mode, rc):
    path = tmp_path / "exit.npz"
    out = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(path), mode], capture_output=True,
                         text=True, timeout=120, env={**os.environ})
    assert out.returncode == rc, out.stderr
    h = hookcap.load(path)
    assert h.steps.tolist() == [0, 1, 2, 3, 4]


def test_chained_signal_handler_still_runs(tmp_path):
    script = textwrap.dedent("""
        import os, signal, sys, torch, torch.nn as nn, hookcap
        hit = []
        signal.signal(signal.SIGTERM, lambda s, f: hit.append(s))
        model = nn.Sequential(nn.Linear(3, 3))
        mon = hookcap.Monitor(model, capture="output", dump_on_exit=sys.argv[1]).attach()
        model(torch.randn(2, 3)); mon.step()
        os.kill(os.getpid(), signal.SIGTERM)
        print("handler ran" if hit else "handler lost")
    """)
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "d.npz")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "handler ran" in out.stdout
    assert hookcap.load(tmp_path / "d.npz").steps.tolist() == [0]


@pytest.mark.slow
def test_soak_10k_steps_bounded_memory():
    import resource

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8)
    with Monitor(model, capture=hookcap.CAPTURE_KINDS, capacity=256) as mon:
        rss = []
        for i in range(10_000):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
            if i in (1000, 9999):
                rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
        unstall = stall_reader(mon)
        for _ in range(10):
            model(x).sum().backward()
            mon.step()
        unstall()
    h = mon.history()
    assert len(h) == 256 and h.steps[-1] == 10_009
    assert mon.dropped_steps == 7  # 10 stalled steps, 3 still in the ring
    assert rss[1] - rss[0] < 64 * 1024  # KiB: < 64 MiB growth over 9,000 steps


@pytest.mark.slow
def test_more_than_2_31_elements():
    n = 2**31 + 17
    x = torch.ones(n, dtype=torch.bfloat16)
    x[-1] = -3.0
    s = hookcap.tensor_stats(x)
    assert s["count"] == n and s["min"] == -3.0 and s["sum"] == n - 1 - 3.0
    assert s["hist"].sum() == n
    e = torch.tensor([1.5]).expand(3 * 2**30)  # stride 0: tiny memory
    s = hookcap.tensor_stats(e, None)
    assert s["count"] == 3 * 2**30 and s["sum"] == 1.5 * 3 * 2**30
