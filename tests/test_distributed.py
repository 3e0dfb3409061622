"""Multi-rank merge with torch.distributed (gloo, 2 processes on the CPU):
merged stats equal those of the global batch computed in one process."""

import pickle

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import hookcap
from hookcap import Monitor

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def batches(steps=3, n=8):
    g = torch.Generator().manual_seed(5)
    return [torch.randn(n, 8, generator=g) * 3 + 1 for _ in range(steps)]


def _init(rank, world, store):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def _ddp_worker(rank, world, store, out):
    _init(rank, world, store)
    torch.set_num_threads(1)
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    # Rank 1 also records a metric rank 0 never sees.
    extra = nn.Linear(2, 2) if rank == 1 else None
    mon = Monitor(model, capture="output").attach()
    emon = Monitor(extra, capture="output").attach() if extra is not None else None
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
            pickle.dump((merged, other), f)
    dist.destroy_process_group()


def spawn(fn, tmp_path, world=2):
    store, out = tmp_path / "store", tmp_path / "out.pkl"
    mp.start_processes(fn, args=(world, str(store), str(out)), nprocs=world, join=True,
                       start_method="spawn")
    with open(out, "rb") as f:
        return pickle.load(f)


def test_ddp_activation_stats_merge_to_global_batch(tmp_path):
    merged, other = spawn(_ddp_worker, tmp_path)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Monitor(model, capture="output") as mon:
        for x in batches():
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            mon.step()
    ref = mon.history()
    assert merged.names == ref.names and merged.steps.tolist() == ref.steps.tolist()
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
    assert other.names == ["0/output", "1/output", "2/output", "model/output"]
    assert other["count"][0, other.column("model/output")] == 2
    assert other["count"][0, other.column("0/output")] == 4 * 16
    assert np.isnan(other["count"][1, other.column("model/output")])


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
    dist.destroy_process_group()


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
