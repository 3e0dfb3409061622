"""Host cost of Monitor.step() with multi-rank sinks: 2 gloo processes on the
CPU, a 20-layer MLP (40 metrics: output + grad_output), no sinks vs
rank_sinks="all" vs rank_sinks="merged" (rank 0 writes records merged across
ranks every hookcap.monitor.RANK_MERGE_EVERY steps).

  PYTHONPATH=. python benchmarks/bench_rank_sinks.py
"""

import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS, WARM = 48, 8


def worker(rank, world, store, q):
    import hookcap
    from hookcap.sinks import Callback

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(20)])
    x = torch.randn(32, 64)
    res = {}
    for mode in ("no sinks", "rank_sinks=all", "rank_sinks=merged"):
        got = []
        sinks = [] if mode == "no sinks" else [Callback(got.append)]
        mon = hookcap.Monitor(model, sinks=sinks,
                              rank_sinks="merged" if mode.endswith("merged") else "all").attach()
        ts = []
        for _ in range(STEPS):
            model(x).sum().backward()
            dist.barrier()  # time step() alone, not the ranks waiting for each other
            t = time.perf_counter()
            mon.step()
            ts.append(time.perf_counter() - t)
        mon.detach()
        ts = ts[WARM:]
        res[mode] = (statistics.median(ts) * 1e3, statistics.fmean(ts) * 1e3, max(ts) * 1e3, len(got))
    if rank == 0:
        q.put(res)
    dist.barrier()
    dist.destroy_process_group()


def main():
    store = tempfile.mktemp()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, 2, store, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = q.get(timeout=600)
    for p in procs:
        p.join()
    print(f"step() host time, rank 0 of 2 gloo processes, 40 metrics, {STEPS - WARM} steps")
    print(f"{'config':20s} {'median ms':>10s} {'mean ms':>8s} {'max ms':>8s} {'records at rank 0':>18s}")
    for k, (med, mean, mx, n) in res.items():
        print(f"{k:20s} {med:10.2f} {mean:8.2f} {mx:8.2f} {n:18d}")


if __name__ == "__main__":
    main()
