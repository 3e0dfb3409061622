"""Multi-rank merge with torch.distributed (gloo, 2 processes on the CPU):
merged stats equal those of the global batch computed in one process."""

import json
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

import hookcap
from conftest import WarningLog, assert_wide_match, stall_reader
from hookcap.sinks.jsonl import full_histogram
from hookcap import Monitor

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def batches(steps=3, n=8):
    g = torch.Generator().manual_seed(5)
    return [torch.randn(n, 8, generator=g) * 3 + 1 for _ in range(steps)]


def _init(rank, world, store):
    # A short timeout: a rank stuck in a collective fails the test instead of hanging it.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))


def _finish():
    """Leave together, then skip interpreter teardown. Under load, a worker of
    the FSDP2 test was once seen to abort (SIGABRT); teardown of the gloo/FSDP
    background threads after the results are written is one such cause, and
    exiting here takes it out of play."""
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


class Wide(nn.Module):
    """Float64 outputs beyond squaring range, different on each rank."""

    def forward(self, step, rank):
        return wide_values(step, rank)


def wide_values(step, rank):
    return torch.tensor([1e250, -3e249, 1e-250, 2.0, 5e-300, 7e-310], dtype=torch.float64) * (1 + rank + step)


def _ddp_worker(rank, world, store, out):
    _init(rank, world, store)
    torch.set_num_threads(1)
    wide = Wide()
    wmon = Monitor(wide, capture="output").attach()
    for step in range(2):
        wide(step, rank)
        wmon.step()
    wide_merged = wmon.history(all_ranks=True)
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    # Rank 1 also records a metric rank 0 never sees.
    extra = nn.Linear(2, 2) if rank == 1 else None
    mon = Monitor(model, capture="output", moments=4).attach()
    # A Monitor on one rank only: rank_sinks="all" (no cross-rank handshake to wait for).
    emon = Monitor(extra, capture="output", rank_sinks="all").attach() if extra is not None else None
    for x in batches():
        local = x[rank * 4:(rank + 1) * 4]
        ddp(local).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        mon.step()
    if emon is not None:
        extra(torch.randn(1, 2))
        emon.step()
    merged = mon.history(all_ranks=True)
    # A rank that lacks a metric: merge two Monitors with different names.
    other = (emon or mon).history(all_ranks=True)
    if rank == 0:
        with open(out, "wb") as f:
            pickle.dump((merged, other, wide_merged), f)
    _finish()


def spawn(fn, tmp_path, world=2):
    store, out = tmp_path / "store", tmp_path / "out.pkl"
    # join=True: a worker that raises terminates the others and raises here.
    mp.start_processes(fn, args=(world, str(store), str(out)), nprocs=world, join=True,
                       start_method="spawn")
    with open(out, "rb") as f:
        return pickle.load(f)


def spawn_all(fn, tmp_path, *args, world=2):
    """Run ``fn(rank, world, store, out, *args)``; each rank pickles its result
    to ``f"{out}.{rank}"``. Returns the results of all ranks."""
    store, out = tmp_path / "store", tmp_path / "out.pkl"
    mp.start_processes(fn, args=(world, str(store), str(out), *args), nprocs=world, join=True,
                       start_method="spawn")
    res = []
    for r in range(world):
        with open(f"{out}.{r}", "rb") as f:
            res.append(pickle.load(f))
    return res


def test_ddp_activation_stats_merge_to_global_batch(tmp_path):
    merged, other, wide = spawn(_ddp_worker, tmp_path)
    # Float64 values beyond squaring range: each bucket merges across ranks.
    for s in range(2):
        got = {k: wide[k][s, wide.column("./output")] for k in hookcap.STAT_NAMES}
        assert_wide_match(got, torch.cat([wide_values(s, r) for r in range(2)]).numpy(), rtol=1e-12)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(model, capture="output", moments=4) as mon:
        for x in batches():
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    ref = mon.history()
    assert merged.names == ref.names and merged.steps.tolist() == ref.steps.tolist()
    # Third and fourth moments: each rank's about its own shift, moved to a common one.
    for stat in hookcap.MOMENT_NAMES:
        np.testing.assert_allclose(merged[stat], ref[stat], rtol=1e-5, atol=1e-6, err_msg=stat)
    for stat in ("count", "nan", "zeros", "finite"):
        np.testing.assert_array_equal(merged[stat], ref[stat])
    # Step 0 sees identical weights on both sides: extrema are bit-exact.
    for stat in ("min", "max", "absmax"):
        np.testing.assert_array_equal(merged[stat][0], ref[stat][0])
    for stat in ("sum", "sumsq", "mean", "std", "l2norm", "min", "max"):
        np.testing.assert_allclose(merged[stat], ref[stat], rtol=1e-5, atol=1e-6, err_msg=stat)
    for n in ref.names:
        np.testing.assert_array_equal(merged.histogram(n)[0], ref.histogram(n)[0])
    # Rank 0 merged its model Monitor with rank 1's Monitor of another module:
    # every metric gets a row, holding only the data of the rank that had it.
    assert other.names == ["0/output", "1/output", "2/output", "./output"]
    assert other["count"][0, other.column("./output")] == 2
    assert other["count"][0, other.column("0/output")] == 4 * 16
    assert np.isnan(other["count"][1, other.column("./output")])


def _ddp_setup(rank, world, store, **monitor_kw):
    """(model, its DDP wrapper, SGD over it, an attached Monitor stepped by the optimizer)."""
    _init(rank, world, store)
    torch.set_num_threads(1)
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    return model, ddp, opt, Monitor(model, optimizer=opt, **monitor_kw).attach()


def _ddp_grad_worker(rank, world, store, out):
    model, ddp, opt, mon = _ddp_setup(rank, world, store, capture=("param", "param_grad"))
    grads, params = [], []
    for x in batches():
        ddp(x[rank * 4:(rank + 1) * 4] * (1 + rank)).pow(2).mean().backward()
        grads.append({n: p.grad.double().clone() for n, p in model.named_parameters()})
        opt.step()  # the Monitor's step() runs after it
        params.append({n: p.detach().double().clone() for n, p in model.named_parameters()})
        opt.zero_grad()
    local, merged = mon.history(), mon.history(all_ranks=True)
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump((local, merged, grads, params), f)
    _finish()


def test_ddp_param_grad_is_the_reduced_gradient_and_replicas_count_once(tmp_path):
    """Under DDP, param_grad is the gradient the optimizer steps with (after the
    all-reduce; each rank's local gradient differs: rank 1's batch is scaled),
    on every rank and in the merged history, where a replicated parameter and
    its gradient count once (count = numel)."""
    res = spawn_all(_ddp_grad_worker, tmp_path)
    for local, merged, grads, params in res:
        for h in (local, merged):
            assert h.meta("0.weight/param_grad")["placement"] == "replicated"
            for s, (g, p) in enumerate(zip(grads, params)):
                for name in g:
                    for kind, ref_t in (("param_grad", g[name]), ("param", p[name])):
                        ref = hookcap.reference.tensor_stats(ref_t)
                        c = h.column(f"{name}/{kind}")
                        assert h["count"][s, c] == ref_t.numel()
                        for stat in ("sum", "sumsq", "min", "max"):
                            assert h[stat][s, c] == pytest.approx(ref[stat], rel=1e-6, abs=1e-9), (name, kind, stat)
    # Both ranks' .grad hold the same reduced gradient.
    for name in res[0][2][0]:
        torch.testing.assert_close(res[0][2][0][name], res[1][2][0][name])


def _fsdp_worker(rank, world, store, out):
    _init(rank, world, store)
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    model = make_model()
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    mon = Monitor(model, capture="param_grad").attach()
    x = batches(1)[0]
    model(x[rank * 4:(rank + 1) * 4]).pow(2).mean().backward()
    mon.step()
    merged = mon.history(all_ranks=True)
    if rank == 0:
        with open(out, "wb") as f:
            pickle.dump((merged, None), f)
    _finish()


def test_fsdp2_param_grad_shards_merge_to_full_gradient(tmp_path):
    try:
        merged, _ = spawn(_fsdp_worker, tmp_path)
    except Exception as e:  # FSDP2 on CPU/gloo may be unsupported by a torch build
        pytest.skip(f"FSDP2 (fully_shard) did not run on CPU/gloo here: {type(e).__name__}: {e}")
    model = make_model()
    x = batches(1)[0]
    # Full gradient: DDP-style mean over ranks of per-rank losses.
    loss = sum(model(x[r * 4:(r + 1) * 4]).pow(2).mean() for r in range(2)) / 2
    loss.backward()
    for name, p in model.named_parameters():
        ref = hookcap.reference.tensor_stats(p.grad)
        c = merged.column(f"{name}/param_grad")
        assert merged["count"][0, c] == ref["count"]
        for stat in ("sum", "sumsq", "min", "max"):
            assert merged[stat][0, c] == pytest.approx(ref[stat], rel=1e-5, abs=1e-7), (name, stat)


def _update_worker(rank, world, store, out, fsdp):
    _init(rank, world, store)
    torch.set_num_threads(1)
    model = make_model()
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped = model
    else:
        wrapped = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2, weight_decay=0.1)
    mon = Monitor(model, capture=("update", "adam_ratio", "optim_state"), optimizer=opt).attach()
    deltas = []
    full = (lambda p: p.full_tensor()) if fsdp else (lambda p: p)
    for x in batches():
        before = {n: full(p.detach()).double().clone() for n, p in model.named_parameters()}
        wrapped(x[rank * 4:(rank + 1) * 4]).pow(2).mean().backward()
        opt.step()  # the Monitor's step() runs after it
        deltas.append({n: (full(p.detach()).double() - before[n], before[n]) for n, p in model.named_parameters()})
        opt.zero_grad()
    local, merged = mon.history(), mon.history(all_ranks=True)
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump((local, merged, deltas), f)
    _finish()


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_updates_of_replicated_and_sharded_parameters(tmp_path, fsdp):
    """capture="update"/"adam_ratio"/"optim_state" under DDP (replicated: counted once in the
    merged history, each rank's own equal) and FSDP2 (each rank's shard; merged:
    the whole parameter): norms and counts of Δw against w_after − w_before of
    the whole parameter in float64."""
    try:
        res = spawn_all(_update_worker, tmp_path, fsdp)
    except Exception as e:
        if not fsdp:
            raise
        pytest.skip(f"FSDP2 (fully_shard) did not run on CPU/gloo here: {type(e).__name__}: {e}")
    for rank, (local, merged, deltas) in enumerate(res):
        want_placement = "sharded" if fsdp else "replicated"
        assert merged.meta("0.weight/update")["placement"] == want_placement
        for h in ((merged,) if fsdp else (local, merged)):
            for s, per_param in enumerate(deltas):
                for name, (delta, w0) in per_param.items():
                    c = h.column(f"{name}/update")
                    assert h["count"][s, c] == delta.numel()
                    tol = 4 * 2.0 ** -24 * float(w0.abs().max()) * delta.numel() ** 0.5
                    assert abs(h["l2norm"][s, c] - float(delta.norm())) <= tol + 1e-6 * float(delta.norm())
                    np.testing.assert_allclose(h.update_ratio(name)[s], float(delta.norm() / w0.norm()), rtol=1e-3)
                    assert h["count"][s, h.column(f"{name}/adam_ratio")] == delta.numel()
                    assert h["count"][s, h.column(f"{name}/state.exp_avg_sq")] == delta.numel()


# --------------------------------------------------------------------------- rank_sinks

class Net(nn.Module):
    """The model of make_model() plus a head only rank 1 runs (a metric one rank lacks)."""

    def __init__(self, use_extra=False):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.act, self.fc2 = nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)
        self.extra = nn.Linear(4, 4)
        self.use_extra = use_extra

    def forward(self, x):
        y = self.fc2(self.act(self.fc1(x)))
        return self.extra(y) if self.use_extra else y


def _plain(d):
    """A DrainedStep as plain data: (step, rank, {name: (stats, histogram)})."""
    return d.step, d.rank, {n: (d.stats_of(n), d.histogram(n).tolist()) for n in d.names}


def _cells(h):
    """A History as {step: {name: (stats, histogram)}} of its recorded cells."""
    out = {}
    for s, step in enumerate(h.steps.tolist()):
        out[step] = {n: ({k: float(h[k][s, h.column(n)]) for k in h.stat_names},
                         h.histogram(n)[s].tolist())
                     for n in h.names if not np.isnan(h["count"][s, h.column(n)])}
    return out


def _merged_worker(rank, world, store, out, pq_path):
    import hookcap.monitor

    _init(rank, world, store)
    torch.set_num_threads(1)
    hookcap.monitor.RANK_MERGE_EVERY = 2  # merges at the 2nd step(), then at detach()
    model = Net(use_extra=rank == 1)
    got_a, got_b = [], []
    # The usual pattern: sinks on rank 0 only.
    mon_a = Monitor(model, capture="output",
                    sinks=[hookcap.sinks.Callback(lambda d: got_a.append(_plain(d)))] if rank == 0 else [])
    # Sinks on every rank (rank 1's get nothing); rank 1's drain is held back, so
    # no step is complete on every rank before detach() flushes them.
    # A Parquet sink on every rank with one path: only rank 0 writes (merged records).
    mon_b = Monitor(model, capture="output",
                    sinks=[hookcap.sinks.Callback(lambda d: got_b.append(_plain(d))),
                           hookcap.sinks.Parquet(pq_path, row_group_steps=2)])
    mon_a.attach()
    mon_b.attach()
    if rank == 1:
        stall_reader(mon_b)
    for x in batches(3):
        with torch.no_grad():
            model(x[rank * 4:(rank + 1) * 4])
        mon_a.step()
        mon_b.step()
    a_before_detach, b_before_detach = len(got_a), len(got_b)
    mon_a.detach()
    mon_b.detach()
    ha, hb = mon_a.history(all_ranks=True), mon_b.history(all_ranks=True)
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump({"got_a": got_a, "got_b": got_b, "ha": _cells(ha), "hb": _cells(hb),
                     "a_before_detach": a_before_detach, "b_before_detach": b_before_detach}, f)
    _finish()


def test_rank_sinks_merged_rank0_writes_merged_records(tmp_path):
    pq_path = tmp_path / "merged.parquet"
    r0, r1 = spawn_all(_merged_worker, tmp_path, str(pq_path))
    # Reference: the global batch in one process (and rank 1's half through the extra head).
    model = Net()
    with Monitor(model, capture="output") as ref_mon:
        for x in batches(3):
            with torch.no_grad():
                model(x)
            ref_mon.step()
    ref = _cells(ref_mon.history())
    model.use_extra = True
    with Monitor(model.extra, capture="output") as extra_mon:
        for x in batches(3):
            with torch.no_grad():
                model(x[4:8])
            extra_mon.step()
    ref_extra = _cells(extra_mon.history())
    assert r1["got_a"] == [] and r1["got_b"] == []  # only rank 0's sinks write
    assert r0["a_before_detach"] == 2  # steps 0 and 1 merged at the 2nd step(); step 2 at detach()
    assert r0["b_before_detach"] == 0  # held back until every rank had the steps complete
    for got, merged in ((r0["got_a"], r0["ha"]), (r0["got_b"], r0["hb"])):
        assert [s for s, _, _ in got] == sorted(merged) == [0, 1, 2]
        for step, rank, cells in got:
            assert rank is None
            assert set(cells) == set(merged[step]) == {"fc1/output", "act/output", "fc2/output",
                                                       "extra/output"}
            for name, (stats, hist) in cells.items():
                mstats, mhist = merged[step][name]
                for k in ("count", "sum", "min", "max", "sumsq", "nan"):
                    assert stats[k] == mstats[k], (step, name, k)
                assert hist == mhist, (step, name)
                want = ref_extra[step]["./output"] if name == "extra/output" else ref[step][name]
                assert stats["count"] == want[0]["count"], (step, name)
                assert sum(hist) == want[0]["count"]
                # Batches of 4 and of 8 round the float32 matmuls differently.
                scale = want[0]["count"] * want[0]["absmax"]
                assert stats["sum"] == pytest.approx(want[0]["sum"], rel=1e-5, abs=1e-6 * scale)
                assert (stats["min"], stats["max"]) == pytest.approx((want[0]["min"], want[0]["max"]),
                                                                     rel=1e-5, abs=1e-6)
    # The Parquet sink holds exactly rank 0's merged records (rank null), bit for bit.
    pd = pytest.importorskip("pandas")
    assert sorted(os.listdir(pq_path)) == ["part-000000.parquet", "part-000001.parquet"]
    df = pd.read_parquet(pq_path)
    assert df["rank"].isna().all()
    assert [(s, n) for s, n in zip(df["step"], df["name"])] == [(s, n) for s, _, c in r0["got_b"] for n in c]
    loaded = _cells(hookcap.load(pq_path))
    assert sorted(loaded) == [0, 1, 2]
    for step, _, cells in r0["got_b"]:
        assert set(loaded[step]) == set(cells)
        for name, (stats, hist) in cells.items():
            lstats, lhist = loaded[step][name]
            assert lhist == hist
            assert all(np.array_equal(lstats[k], stats[k], equal_nan=True) for k in hookcap.STAT_NAMES), name


def _all_worker(rank, world, store, out, path, pq_path):
    _init(rank, world, store)
    torch.set_num_threads(1)
    model = Net(use_extra=rank == 1)
    sink = hookcap.sinks.JSONL(path, histogram=True)  # the same path argument on every rank
    pq_sink = hookcap.sinks.Parquet(pq_path, row_group_steps=2)
    with Monitor(model, capture="output", sinks=[sink, pq_sink], rank_sinks="all") as mon:
        for x in batches(3):
            with torch.no_grad():
                model(x[rank * 4:(rank + 1) * 4])
            mon.step()
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump({"h": _cells(mon.history()), "path": sink.path, "rank": sink.rank,
                     "pq_path": pq_sink.path}, f)
    _finish()


def test_rank_sinks_all_one_file_per_rank(tmp_path):
    path = tmp_path / "logs" / "stats.jsonl"
    pq_path = tmp_path / "logs" / "stats.parquet"
    res = spawn_all(_all_worker, tmp_path, str(path), str(pq_path))
    assert not path.exists() and not pq_path.exists()
    for rank, r in enumerate(res):
        assert r["rank"] == rank and r["path"] == str(tmp_path / "logs" / f"stats.rank{rank}.jsonl")
        with open(r["path"]) as f:
            lines = [json.loads(line) for line in f]
        assert {d["rank"] for d in lines} == {rank}
        assert sorted({d["step"] for d in lines}) == sorted(r["h"]) == [0, 1, 2]
        assert len(lines) == sum(len(c) for c in r["h"].values())
        assert any(d["name"] == "extra/output" for d in lines) == (rank == 1)
        for d in lines:
            stats, hist = r["h"][d["step"]][d["name"]]
            for k in ("count", "sum", "min", "max", "sumsq", "mean"):
                assert d[k] == stats[k], (rank, d["step"], d["name"], k)
            assert full_histogram(d, len(hist)).tolist() == hist
        # One Parquet dataset per rank, rank column = that rank, the same rows and values.
        pd = pytest.importorskip("pandas")
        assert r["pq_path"] == str(tmp_path / "logs" / f"stats.rank{rank}.parquet")
        df = pd.read_parquet(r["pq_path"])
        assert (df["rank"] == rank).all() and str(df["rank"].dtype) == "int32"
        assert list(zip(df["step"], df["name"])) == [(d["step"], d["name"]) for d in lines]
        assert _cells(hookcap.load(r["pq_path"])) == r["h"]


def _timeout_worker(rank, world, store, out):
    _init(rank, world, store)
    torch.set_num_threads(1)
    import hookcap.monitor

    hookcap.monitor.RANK_HANDSHAKE_TIMEOUT_S = 2.0
    warnings = WarningLog()
    logging.getLogger("hookcap").addHandler(warnings)
    res = {}
    if rank == 0:  # only rank 0 creates a Monitor (with the default rank_sinks="merged")
        model = Net()
        got = []
        with Monitor(model, capture="output", sinks=[hookcap.sinks.Callback(
                lambda d: got.append(_plain(d)))]) as mon:
            for x in batches(3):
                with torch.no_grad():
                    model(x[:4])
                mon.step()
        res = {"got": got, "h": _cells(mon.history()), "warnings": warnings.messages}
    dist.barrier()  # rank 1 waits here: no collective of the Monitor may run
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump(res, f)
    _finish()


def test_rank_sinks_handshake_timeout_falls_back_to_local_records(tmp_path):
    r0, _ = spawn_all(_timeout_worker, tmp_path)
    assert len(r0["warnings"]) == 1, r0["warnings"]
    assert "[1] did not answer" in r0["warnings"][0] and "rank_sinks='all'" in r0["warnings"][0]
    assert [s for s, _, _ in r0["got"]] == sorted(r0["h"]) == [0, 1, 2]
    for step, rank, cells in r0["got"]:
        assert rank == 0
        assert set(cells) == set(r0["h"][step])
        for name, (stats, hist) in cells.items():
            want, whist = r0["h"][step][name]
            assert {k: stats[k] for k in ("count", "sum", "min", "max")} == \
                {k: want[k] for k in ("count", "sum", "min", "max")}
            assert hist == whist


def test_rank_sinks_single_process_unchanged(tmp_path):
    with pytest.raises(ValueError, match="rank_sinks"):
        Monitor(make_model(), rank_sinks="bogus")
    assert not dist.is_initialized()
    for mode in ("merged", "all"):
        model = make_model()
        sink = hookcap.sinks.JSONL(tmp_path / f"{mode}.jsonl")
        got = []
        with Monitor(model, capture="output", rank_sinks=mode,
                     sinks=[sink, hookcap.sinks.Callback(got.append)]) as mon:
            for x in batches(2):
                model(x)
                mon.step()
        assert sink.rank is None and sink.path == str(tmp_path / f"{mode}.jsonl")
        assert [d.rank for d in got] == [None, None] and not mon._ranks.merging
        with open(sink.path) as f:
            lines = [json.loads(line) for line in f]
        h = mon.history()
        assert len(lines) == len(h) * len(h.names) and all("rank" not in d for d in lines)


def test_bind_rank_names_per_rank_outputs(tmp_path):
    from hookcap.sinks.jsonl import rank_path

    assert rank_path("a/stats.jsonl", None) == "a/stats.jsonl"
    assert rank_path("a/stats.jsonl", 3) == "a/stats.rank3.jsonl"
    assert rank_path("a.d/stats", 1) == "a.d/stats.rank1"
    assert rank_path("a/r{rank}/s.csv", 2) == "a/r2/s.csv"
    c = hookcap.sinks.CSV(tmp_path / "x{rank}.csv")
    c.bind_rank(5)
    assert c.path == str(tmp_path / "x5.csv") and c.rank == 5
    c.bind_rank(None)
    assert c.path == str(tmp_path / "x{rank}.csv")
    try:
        tb = hookcap.sinks.TensorBoard(tmp_path / "tb")
    except ImportError:
        tb = None
    if tb is not None:
        tb.bind_rank(1)
        tb.bind_rank(1)
        assert tb.log_dir == str(tmp_path / "tb" / "rank1")
    try:
        wb = hookcap.sinks.WandB(run=object(), stats=["count"], histograms=False)
    except ImportError:
        wb = None
    if wb is not None:
        model = make_model()
        got = []
        with Monitor(model, capture="output", sinks=[hookcap.sinks.Callback(got.append)]) as mon:
            model(batches(1)[0])
            mon.step()
        d = got[0]
        assert set(wb.payload(d)) == {f"{n}/count" for n in d.names}
        d.rank = 1
        assert wb.payload(d) == {f"rank1/{n}/count": d.stats["count"][i] for i, n in enumerate(d.names)}


def test_hf_trainer_under_torchrun_records_the_reduced_gradient(tmp_path):
    """HF Trainer under torchrun (2 gloo ranks): param_grad on every rank and in the
    merged history is the gradient the optimizer steps with, counted once."""
    import subprocess
    import sys

    pytest.importorskip("transformers")
    script = os.path.join(os.path.dirname(__file__), "hf_ddp_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        script, str(tmp_path)], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    merged = hookcap.load(tmp_path / "merged.npz")
    refs = [torch.load(tmp_path / f"ref{r}.pt") for r in (0, 1)]
    for n, g in refs[0][1].items():  # the optimizer's gradient is the reduced one: equal on both ranks
        torch.testing.assert_close(g, refs[1][1][n], rtol=1e-12, atol=1e-15)
    for rank, suffix in ((0, ""), (1, ".rank1")):
        h = hookcap.load(tmp_path / f"hookcap{suffix}.npz")
        ref = torch.load(tmp_path / f"ref{rank}.pt")
        assert h.steps.tolist() == sorted(ref) == [1, 2]
        names = [n for n in h.names if n.endswith("/param_grad")]
        assert len(names) == len(ref[1]) > 5
        for s, step in enumerate(h.steps):
            for name in names:
                g = ref[int(step)][name[:-len("/param_grad")]].reshape(-1).numpy()
                for hist in (h, merged):
                    c = hist.column(name)
                    assert hist["count"][s, c] == g.size  # replicated: once, also merged
                    assert abs(hist["sum"][s, c] - g.sum()) <= 1e-5 * np.abs(g).sum() + 1e-30
                    np.testing.assert_allclose(hist["l2norm"][s, c], np.sqrt((g * g).sum()), rtol=1e-5)


def _ddp_cadence_worker(rank, world, store, out):
    model, ddp, opt, mon = _ddp_setup(rank, world, store, capture=("output", "param_grad"),
                                      every={"output": 2, "param_grad": 1})
    outs, grads = [], []
    for x in batches(steps=4):
        y = ddp(x[rank * 4:(rank + 1) * 4] * (1 + rank))
        outs.append(y.detach().double().clone())
        y.pow(2).mean().backward()
        grads.append(model[2].weight.grad.double().clone())
        opt.step()
        opt.zero_grad()
    merged = mon.history(all_ranks=True)
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump((merged, outs, grads), f)
    _finish()


def test_ddp_per_kind_cadence_merges_each_kind_at_its_steps(tmp_path):
    """every={"output": 2, "param_grad": 1} under DDP: the merged history has
    every step; outputs (each rank's batch, summed) only at even steps, the
    reduced gradient (replicated: counted once) at every step."""
    res = spawn_all(_ddp_cadence_worker, tmp_path)
    (merged, outs0, grads0), (_, outs1, _) = res
    assert merged.steps.tolist() == [0, 1, 2, 3]
    out, grad = merged.column("2/output"), merged.column("2.weight/param_grad")
    for s in range(4):
        if s % 2:
            assert np.isnan(merged["count"][s, out])
        else:
            both = torch.cat([outs0[s], outs1[s]])
            assert merged["count"][s, out] == both.numel()
            assert merged["sum"][s, out] == pytest.approx(both.sum().item(), rel=1e-6, abs=1e-9)
            assert merged["max"][s, out] == pytest.approx(both.max().item(), rel=1e-7)
        assert merged["count"][s, grad] == grads0[s].numel()
        assert merged["sumsq"][s, grad] == pytest.approx(grads0[s].square().sum().item(), rel=1e-6)
