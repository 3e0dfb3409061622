"""DTensor placements per mesh dimension (4 gloo ranks on the CPU, one
process group for the whole file): HSDP, tensor parallel (colwise, rowwise,
sequence parallel) and FSDP2 x TP. Every merged value is checked against
float64 of the full tensor (``full_tensor()``), every rank's own history
against its local part."""

import logging
import os
import pickle
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from conftest import WarningLog, assert_recorded
from hookcap import Monitor

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")

WORLD = 4
PARAM_KINDS = ("param", "param_grad", "update", "adam_ratio", "optim_state")


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def _full(t):
    return t.full_tensor().detach().double().clone() if hasattr(t, "full_tensor") else t.detach().double().clone()


def _local(t):
    return t.to_local().detach().double().clone() if hasattr(t, "to_local") else t.detach().double().clone()


def _train(model, mon_kwargs, inputs, log, steps=2):
    """AdamW steps of ``model`` with a Monitor; per step the float64 full and
    local tensors of each parameter kind (gradients just before opt.step())."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    mon = Monitor(model, optimizer=opt, **mon_kwargs).attach()
    full, local = [], []
    for step in range(steps):
        model(inputs(step)).pow(2).mean().backward()
        f = {n: {"param_grad": _full(p.grad)} for n, p in model.named_parameters()}
        lo = {n: {"param_grad": _local(p.grad)} for n, p in model.named_parameters()}
        before = {n: (_full(p), _local(p)) for n, p in model.named_parameters()}
        opt.step()  # the Monitor's step() follows it
        for n, p in model.named_parameters():
            f[n]["param"], lo[n]["param"] = _full(p), _local(p)
            f[n]["update"], lo[n]["update"] = f[n]["param"] - before[n][0], lo[n]["param"] - before[n][1]
            st = opt.state[p]["exp_avg_sq"]
            f[n]["state.exp_avg_sq"], lo[n]["state.exp_avg_sq"] = _full(st), _local(st)
        full.append(f)
        local.append(lo)
        opt.zero_grad()
    return {"local": mon.history(), "merged": mon.history(all_ranks=True), "full": full, "own": local,
            "log": list(log.messages)}


def _hsdp(rank, log):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _mlp()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    g = torch.Generator().manual_seed(100 + rank)
    return _train(model, {"capture": PARAM_KINDS}, lambda s: torch.randn(4, 8, generator=g) * 2, log)


def _tp(rank, log):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (WORLD,))
    model = _mlp(1)
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    g = torch.Generator().manual_seed(7)  # the same batch on every rank: tensor parallel
    return _train(model, {"capture": PARAM_KINDS}, lambda s: torch.randn(4, 8, generator=g), log)


def _fsdp_tp(rank, log):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _mlp(2)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    g = torch.Generator().manual_seed(200 + mesh.get_coordinate()[0])  # one batch per dp group
    return _train(model, {"capture": PARAM_KINDS}, lambda s: torch.randn(4, 8, generator=g), log)


class _NormMLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(self.norm(x))))


def _sequence_parallel(rank, log):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    mesh = init_device_mesh("cpu", (WORLD,))
    model = _NormMLP()
    parallelize_module(model, mesh, {"norm": SequenceParallel(),
                                     "up": ColwiseParallel(input_layouts=Shard(1)),
                                     "down": RowwiseParallel(output_layouts=Shard(1))})
    g = torch.Generator().manual_seed(11)
    # [batch 2, sequence 8 (2 per rank), 8]: each rank its part of the sequence.
    return _train(model, {"capture": PARAM_KINDS},
                  lambda s: torch.randn(2, 8, 8, generator=g)[:, rank * 2:(rank + 1) * 2], log)


def _activations(rank, log, order="after", local_output=True):
    """TP only (no FSDP) on dp 2 x tp 2: each dp group its own batch. The
    Monitor captures outputs, their gradients and the loss as a replicated
    tap; the same steps of an unparallelized copy give the float64
    references, one per dp group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import hookcap

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _mlp(4)
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel(use_local_output=local_output)}
    if order == "before":
        mon = Monitor(model, capture=("output", "grad_output")).attach()
    parallelize_module(model, mesh["tp"], plan)
    if order == "after":
        mon = Monitor(model, capture=("output", "grad_output")).attach()
    batch = lambda d, s: torch.randn(4, 8, generator=torch.Generator().manual_seed(300 + 10 * d + s))
    for s in range(2):
        out = model(batch(mesh.get_coordinate()[0], s))
        loss = (out.to_local() if hasattr(out, "to_local") else out).pow(2).mean()
        hookcap.tap(loss, "loss", placement="replicated")
        loss.backward()
        mon.step()
    ref, want = _mlp(4), []
    for s in range(2):
        per_kind = {}
        for d in range(2):
            acts = []
            x = batch(d, s)
            for layer in ref:
                x = layer(x)
                x.retain_grad()
                acts.append(x)
            loss = x.pow(2).mean()
            loss.backward()
            for i, a in enumerate(acts):
                per_kind.setdefault(f"{i}/output", []).append(a.detach().double())
                per_kind.setdefault(f"{i}/grad_output", []).append(a.grad.double())
            per_kind.setdefault("loss", []).append(loss.detach().double().reshape(1))
        want.append(per_kind)
    return {"local": mon.history(), "merged": mon.history(all_ranks=True), "want": want,
            "log": list(log.messages)}


def _ddp_loops(rank, log, early):
    """DDP loops as people write them, each checked against .grad right
    after the backward (DDP's reduced gradient):
    - ``early``: a Monitor attached before init_process_group;
    - ``zeroed``: zero_grad(set_to_none=False) before mon.step(), no optimizer=;
    - ``no_sync``: two micro-batches, the first under no_sync();
    - ``optimizer=`` plus a manual mon.step(): one step per optimizer step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    x = lambda s, k=0: torch.randn(4, 8, generator=torch.Generator().manual_seed(500 + 10 * rank + s + 100 * k))
    out = {}
    early_model, early_mon = early
    for case in ("early", "zeroed", "no_sync", "optimizer"):
        log.messages.clear()
        model = early_model if case == "early" else _mlp(5)
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        if case == "early":
            mon = early_mon
        else:
            mon = Monitor(model, capture=("param_grad",), optimizer=opt if case == "optimizer" else None).attach()
        want = []
        for s in range(3):
            if case == "no_sync":
                with ddp.no_sync():
                    ddp(x(s, 1)).pow(2).mean().backward()
            ddp(x(s)).pow(2).mean().backward()
            want.append({n: p.grad.detach().double().clone() for n, p in model.named_parameters()})
            opt.step()
            if case == "zeroed":
                opt.zero_grad(set_to_none=False)
                mon.step()
            elif case == "optimizer":
                mon.step()  # does nothing: the optimizer's hook stepped the Monitor
                opt.zero_grad()
            else:
                mon.step()
                opt.zero_grad()
        out[case] = {"local": mon.history(), "merged": mon.history(all_ranks=True), "want": want,
                     "log": list(log.messages)}
        mon.detach()
    return out


def _per_rank_params(rank, log):
    """Parameters that differ per rank under one name (pipeline stages or
    experts with local names): declared per_rank they are summed, each
    rank's copy counted; undeclared they count once with a warning."""
    torch.manual_seed(40 + rank)
    model = nn.Linear(4, 3)
    declared = Monitor(model, capture="param", placements={"*": "per_rank"}).attach()
    default = Monitor(model, capture="param").attach()
    declared.step()
    default.step()
    declared.detach()
    default.detach()
    values = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    # The optimizer kinds follow the declaration too: each rank's own update.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    updates = Monitor(model, capture="update", optimizer=opt, placements={"*": "per_rank"}).attach()
    model(torch.randn(5, 4)).square().sum().backward()
    opt.step()
    updates.detach()
    return {"declared": declared.history(all_ranks=True), "default": default.history(all_ranks=True),
            "updates": updates.history(all_ranks=True), "values": values,
            # SGD's step recomputed from the gradient (float32 parameters: the intended Δw)
            "deltas": {n: -0.1 * p.grad.double() for n, p in model.named_parameters()},
            "log": list(log.messages)}


SCENARIOS = {"per_rank_params": _per_rank_params, "hsdp": _hsdp, "tp": _tp, "fsdp_tp": _fsdp_tp, "sequence_parallel": _sequence_parallel,
             "tp_acts_after": _activations,
             "tp_acts_before": lambda rank, log: _activations(rank, log, order="before"),
             "tp_acts_dtensor": lambda rank, log: _activations(rank, log, local_output=False)}


def _worker(rank, world, store, out):
    # Attached before the process group exists (the DDP loops scenario).
    early_model = _mlp(5)
    early = (early_model, Monitor(early_model, capture=("param_grad",)).attach())
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    log = WarningLog()
    logging.getLogger("hookcap").addHandler(log)
    res = {}
    for name, fn in SCENARIOS.items():
        log.messages.clear()
        try:
            res[name] = fn(rank, log)
        except Exception as e:  # reported by the scenario's test
            import traceback

            res[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        dist.barrier()
    log.messages.clear()
    try:
        res["ddp_loops"] = _ddp_loops(rank, log, early)
    except Exception as e:
        import traceback

        res["ddp_loops"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip teardown of the gloo/FSDP background threads


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("placements")
    mp.start_processes(_worker, args=(WORLD, str(tmp / "store"), str(tmp / "out")), nprocs=WORLD, join=True,
                       start_method="spawn")
    res = []
    for r in range(WORLD):
        with open(tmp / f"out.{r}", "rb") as f:
            res.append(pickle.load(f))
    return res


def _scenario(results, name):
    got = [r[name] for r in results]
    for g in got:
        assert not isinstance(g, str), g
    return got


def _metric(param, kind):
    return f"{param}/{kind}" if not kind.startswith("state.") else f"{param}/{kind}"


def _check(results, name, skipped=()):
    """Merged histories (every rank's) against the full tensors; each rank's
    own history against its local part; no divergence warning."""
    got = _scenario(results, name)
    full = got[0]["full"]
    checked = 0
    for rank, g in enumerate(got):
        for s, per_param in enumerate(full):
            for pname, kinds in per_param.items():
                for kind, ref in kinds.items():
                    metric = f"{pname}/{kind}"
                    if (pname, kind) in skipped:
                        assert metric not in g["merged"].names and metric not in g["local"].names
                        continue
                    for h, want in ((g["merged"], ref), (g["local"], g["own"][s][pname][kind])):
                        if kind == "update":  # the optimizer's Δw, as the op recomputes it: float32 rounding
                            w = per_param[pname]["param"]
                            c = h.column(metric)
                            assert h["count"][s, c] == want.numel()
                            tol = 4 * 2.0 ** -24 * float(w.abs().max()) * want.numel() ** 0.5
                            assert abs(h["l2norm"][s, c] - float(want.norm())) <= tol + 1e-6 * float(want.norm())
                        else:
                            assert_recorded(h, s, metric, [want])
                    checked += 1
        assert not [m for m in g["log"] if "differ" in m], g["log"]
    return got, checked


def test_hsdp_counts_the_replicate_dimension_once(results):
    """HSDP (replicate 2 x shard 2): params, gradients, updates and Adam state
    merge to the whole tensor once, not twice."""
    got, checked = _check(results, "hsdp")
    assert checked == WORLD * 2 * 4 * 4
    h = got[0]["merged"]
    assert h.meta("0.weight/param")["placement"] == "sharded"
    assert h.meta("0.weight/param")["mesh"] == "(Replicate(), Shard(dim=0))"
    assert h["count"][0, h.column("0.weight/adam_ratio")] == 16 * 8
    # The ranks at replicate coordinate 1 hold replicas: their meta says so.
    assert [g["local"].meta("0.weight/param")["counted"] for g in got] == [True, True, False, False]


def test_tensor_parallel_rowwise_bias_counts_once(results):
    """Colwise/Rowwise on a 4-rank mesh: the colwise weight and bias and the
    rowwise weight are sharded; the rowwise bias is a Replicate DTensor
    (and so is its gradient): counted once, not four times."""
    got, checked = _check(results, "tp")
    assert checked == WORLD * 2 * 4 * 4
    h = got[0]["merged"]
    assert h.meta("2.bias/param")["placement"] == "replicated"
    assert h["count"][0, h.column("2.bias/param_grad")] == 8
    assert [g["local"].meta("2.bias/param")["counted"] for g in got] == [True, False, False, False]


def test_fsdp2_x_tp(results):
    """FSDP2 x TP on dp 2 x tp 2: 2-D placements (the rowwise bias is
    (Shard(0), Replicate())): merged to the whole tensors."""
    got, checked = _check(results, "fsdp_tp")
    assert checked == WORLD * 2 * 4 * 4
    h = got[0]["merged"]
    assert h.meta("2.bias/param")["mesh"] == "(Shard(dim=0), Replicate())"
    assert [g["local"].meta("2.bias/param")["counted"] for g in got] == [True, False, True, False]


def test_sequence_parallel_partial_gradient_is_skipped_with_one_warning(results):
    """A sequence-parallel LayerNorm's gradient is Partial(sum) on each rank:
    not recorded (its partial sums are not the gradient), one warning naming
    the metric; its parameter, update and state (Replicate) count once."""
    skipped = {("norm.weight", "param_grad"), ("norm.bias", "param_grad")}
    got, checked = _check(results, "sequence_parallel", skipped)
    assert checked == WORLD * 2 * (4 * 4 + 2 * 3)
    for g in got:
        for p in ("norm.weight", "norm.bias"):
            said = [m for m in g["log"] if f"{p}/param_grad" in m]
            assert len(said) == 1 and "Partial(sum)" in said[0], g["log"]


def _assert_close(h, s, metric, values):
    """Counts exact; values within float32 rounding of the reference (tensor
    parallel sums its partial products in another order than one process)."""
    v = torch.cat([x.reshape(-1) for x in values])
    c = h.column(metric)
    assert h["count"][s, c] == v.numel(), metric
    assert h["zeros"][s, c] == int((v == 0).sum()), metric
    for stat, want in (("sum", float(v.sum())), ("sumsq", float(v.pow(2).sum())), ("min", float(v.min())),
                       ("max", float(v.max())), ("absmax", float(v.abs().max()))):
        assert h[stat][s, c] == pytest.approx(want, rel=1e-5, abs=1e-6 * float(v.abs().sum())), (metric, stat)
    assert h.histogram(metric)[s].sum() == v.numel()


@pytest.mark.parametrize("case", ["tp_acts_after", "tp_acts_before", "tp_acts_dtensor"])
def test_tensor_parallel_activations_count_each_dp_group_once(results, case):
    """Colwise output (each rank its columns), the ReLU on them, the Rowwise
    output (after its all-reduce: an AsyncCollectiveTensor, or a Replicate
    DTensor with use_local_output=False) and every gradient: merged equal
    the float64 outputs of both dp groups' batches, each counted once;
    the Monitor attached before parallelize_module records the same from
    its second step (its first sees the output before the all-reduce: not
    recorded, one warning)."""
    got = _scenario(results, case)
    for g in got:
        h = g["merged"]
        for s, per_kind in enumerate(g["want"]):
            for metric, values in per_kind.items():
                if case == "tp_acts_before" and s == 0 and metric[:2] in ("0/", "2/"):
                    assert np.isnan(h["count"][s, h.column(metric)])
                    continue
                _assert_close(h, s, metric, values)
        assert not [m for m in g["log"] if "differ" in m or "not supported" in m], g["log"]
    if case == "tp_acts_before":
        assert any("parallelize_module" in m for m in got[0]["log"]), got[0]["log"]


@pytest.mark.parametrize("case", ["early", "zeroed", "no_sync", "optimizer"])
def test_ddp_param_grad_is_the_reduced_gradient_in_every_loop(results, case):
    """param_grad under DDP is the reduced gradient (counted once when
    merged) however the loop is written; no false warning; one step per
    optimizer step with optimizer= and a manual step()."""
    got = _scenario(results, "ddp_loops")
    for rank, g in enumerate(got):
        r = g[case]
        assert r["local"].steps.tolist() == [0, 1, 2]
        for h in (r["local"], r["merged"]):
            for s, per_param in enumerate(r["want"]):
                for pname, grad in per_param.items():
                    assert h.meta(f"{pname}/param_grad")["placement"] == "replicated"
                    assert_recorded(h, s, f"{pname}/param_grad", [grad])
        assert not [m for m in r["log"] if "hooked nothing" in m or "differ" in m or "zero_grad" in m], r["log"]
        if case == "optimizer":
            assert [m for m in r["log"] if "step() calls do nothing" in m], r["log"]
    # the reduced gradient is the same on every rank
    for pname, grad in got[0][case]["want"][0].items():
        torch.testing.assert_close(grad, got[1][case]["want"][0][pname])


def test_per_rank_parameters_declared_per_rank_are_summed(results):
    got = _scenario(results, "per_rank_params")
    for name in ("weight", "bias"):
        values = [g["values"][name] for g in got]
        for g in got:
            assert g["declared"].meta(f"{name}/param")["placement"] == "per_rank"
            assert_recorded(g["declared"], 0, f"{name}/param", values)  # every rank's copy
            assert_recorded(g["default"], 0, f"{name}/param", values[:1])  # a replica: rank 0's
            assert g["updates"].meta(f"{name}/update")["placement"] == "per_rank"
            assert_recorded(g["updates"], 0, f"{name}/update", [r["deltas"][name] for r in got])
    assert [m for m in got[0]["log"] if "differ" in m]  # ... and said so
