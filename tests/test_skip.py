"""SkipStep: a planted spike step (a batch scaled x1e3, an inf gradient, a
learning-rate jump) is skipped, decided on the device, and parameters and
optimizer state afterwards equal, bitwise, a run that never saw that batch;
fused optimizers through found_inf, others through the host fallback; with
GradScaler; nothing tripping leaves training bitwise unchanged."""

import copy
import logging

import pytest
import torch
import torch.nn as nn

import hookcap
from hookcap import Monitor, SkipStep

STEPS, SPIKE = 24, 18
OPTIMIZERS = {
    "adamw fused": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    "adamw foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=True),
    "sgd fused": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, fused=True),
    "sgd": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, foreach=False),
}


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)) for _ in range(STEPS)]


def planted(kind, data):
    x, y = (t.clone() for t in data[SPIKE])
    if kind == "scaled":
        x *= 1e3
    elif kind == "inf":
        x[0, 0] = float("inf")
    return x, y


def train(make_opt, kind=None, guard=None, drop_spike=False, scaler=None):
    """(model, optimizer, monitor) after STEPS steps, the batch at SPIKE
    planted (``kind``) or left out (``drop_spike``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = make_opt(model.parameters())
    mon = Monitor(model, capture=("output",), optimizer=opt, skip=guard, grad_scaler=scaler).attach() \
        if guard is not None else None
    data = batches()
    for i, (x, y) in enumerate(data):
        if i == SPIKE:
            if drop_spike:
                continue
            if kind in ("scaled", "inf"):
                x, y = planted(kind, data)
        lr_jump = kind == "lr" and i == SPIKE
        if lr_jump:
            for gr in opt.param_groups:
                gr["lr"] *= 100
        loss = nn.functional.mse_loss(model(x), y)
        hookcap.tap(loss, "loss")
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad()
        if lr_jump:
            for gr in opt.param_groups:
                gr["lr"] /= 100
    if mon is not None:
        mon.detach()
    return model, opt, mon


def assert_same_training(a, b):
    (ma, oa), (mb, ob) = a, b
    for (n, pa), pb in zip(ma.state_dict().items(), mb.state_dict().values()):
        assert torch.equal(pa, pb), n
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        for key, v in sa[k].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(sb[k][key])), (k, key)


@pytest.mark.parametrize("kind", ["scaled", "inf", "lr"])
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_a_planted_spike_is_skipped_as_if_never_seen(opt, kind, caplog):
    guard = SkipStep(window=16, warmup=8)
    with caplog.at_level(logging.WARNING, logger="hookcap"):
        model, o, mon = train(OPTIMIZERS[opt], kind, guard)
    assert ("read on the host" in caplog.text) == ("fused" not in opt)  # the fallback says so
    assert guard.count == 1 and guard.steps() == [SPIKE]
    h = mon.history()
    assert h.skipped.tolist() == [i == SPIKE for i in range(STEPS)]
    never = train(OPTIMIZERS[opt], drop_spike=True)
    assert_same_training((model, o), never[:2])


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_nothing_trips_training_is_bitwise_unchanged(opt):
    guard = SkipStep(window=16, warmup=8)
    with_guard = train(OPTIMIZERS[opt], guard=guard)
    assert guard.count == 0
    assert_same_training(with_guard[:2], train(OPTIMIZERS[opt])[:2])
    assert not with_guard[2].history().skipped.any()


def test_composes_with_grad_scaler_on_a_fused_optimizer():
    """GradScaler hands the fused step its own found_inf: the guard's flag
    joins it for that step only (the scaler's scale is untouched)."""
    make = OPTIMIZERS["adamw fused"]
    guard = SkipStep(window=16, warmup=8)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=10_000)
    model, o, _ = train(make, "scaled", guard, scaler=scaler)
    assert guard.steps() == [SPIKE]
    assert scaler.get_scale() == 2.0 ** 8
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=10_000)
    never = train(make, drop_spike=True, guard=SkipStep(window=16, warmup=8), scaler=ref_scaler)
    assert_same_training((model, o), never[:2])


def test_a_lasting_level_is_a_new_regime_after_patience():
    """A learning rate raised for good: skipped `patience` times, then applied
    (its values join the window) -- the guard never stalls training."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    guard = SkipStep(window=8, warmup=4, signals=("lr",), patience=3)
    mon = Monitor(model, capture=("output",), optimizer=opt, skip=guard).attach()
    for i in range(16):
        if i == 10:
            opt.param_groups[0]["lr"] = 1.0
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    mon.detach()
    assert guard.steps() == [10, 11, 12]


def test_signals_only_count_steps_where_they_are_seen():
    """A tap missing in a step (or called under no_grad: an evaluation) does
    not count; a signal never seen never skips."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = SkipStep(window=8, warmup=4, signals=("loss",))
    mon = Monitor(model, capture=("output",), optimizer=opt, skip=guard).attach()
    x = torch.randn(64, 4)  # one batch: the loss falls smoothly
    for i in range(12):
        loss = model(x).pow(2).mean()
        with torch.no_grad():
            hookcap.tap(loss * 1e6, "loss")  # an evaluation's: ignored
        if i % 2:
            hookcap.tap(loss, "loss")
        loss.backward()
        opt.step()
        opt.zero_grad()
    mon.detach()
    assert guard.count == 0
    assert int(guard._dev["n"]) == 6


def test_bad_arguments():
    for kw in ({"z": 0}, {"z": float("nan")}, {"window": 0}, {"warmup": 9, "window": 8}, {"signals": ()},
               {"signals": ("loss", "loss")}, {"patience": 0}, {"window": 2.5}):
        with pytest.raises(ValueError):
            SkipStep(**kw)
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="optimizer="):
        Monitor(model, skip=SkipStep())
    with pytest.raises(ValueError, match="SkipStep"):
        Monitor(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), skip="yes")
    guard = SkipStep()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    mon = Monitor(model, optimizer=opt, skip=guard).attach()
    with pytest.raises(ValueError, match="already attached"):
        Monitor(model, optimizer=opt, skip=guard).attach()
    mon.detach()
    assert not hookcap._capture.signals.WATCHERS
    copy.deepcopy(guard)  # detached guards are plain data


def _ddp_skip_worker(rank, world, store, out):
    import pickle

    from test_distributed import _finish, _init

    _init(rank, world, store)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, fused=True)
    guard = SkipStep(window=8, warmup=4, signals=("loss",))
    mon = Monitor(model, capture=("output",), optimizer=opt, skip=guard).attach()
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(rank))
    for i in range(14):
        xi = x * 1e3 if (i == 10 and rank == 0) else x  # only rank 0's batch spikes
        loss = ddp(xi).pow(2).mean()
        hookcap.tap(loss, "loss")
        loss.backward()
        opt.step()
        opt.zero_grad()
    mon.detach()
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump((guard.steps(), [p.detach().clone() for p in model.parameters()]), f)
    _finish()


def test_ranks_skip_the_same_steps(tmp_path):
    """A spike in one rank's loss skips the step on every rank (the flag is
    all-reduced): the replicas stay identical."""
    from test_distributed import spawn_all

    (steps0, params0), (steps1, params1) = spawn_all(_ddp_skip_worker, tmp_path)
    assert steps0 == steps1 == [10]
    for a, b in zip(params0, params1):
        assert torch.equal(a, b)


def test_the_report_counts_skipped_steps(tmp_path):
    guard = SkipStep(window=16, warmup=8)
    _, _, mon = train(OPTIMIZERS["adamw fused"], "scaled", guard)
    from hookcap.report import report

    files = report(mon.dump(tmp_path / "run.hookcap"), tmp_path / "rep")
    page = open(files["index"]).read()
    assert f"<b>skipped optimizer steps</b>: 1 (steps {SPIKE})" in page
