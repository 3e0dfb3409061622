"""CUDA kernels against the CPU op on the same inputs. Needs a GPU: every test
here is skipped, visibly, when none is visible (the kernels are still compiled
in CI and their source is executed by tests/test_cuda_emu.py)."""

import numpy as np
import pytest
import torch
from conftest import abs_sum, assert_stats_match

import hookcap
from hookcap import Histogram, _layout, _ops
from hookcap.functional import new_state

HAVE_GPU = torch.cuda.is_available() and hookcap.build_info()["cuda"]
pytestmark = pytest.mark.skipif(
    not HAVE_GPU,
    reason="no CUDA device visible (or CUDA kernels not built): CUDA-vs-CPU comparison not run",
)

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def specials(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 3
    idx = torch.randperm(n, generator=g)
    k = max(n // 40, 1)
    x[idx[:k]] = float("nan")
    x[idx[k:2 * k]] = float("inf")
    x[idx[2 * k:3 * k]] = float("-inf")
    x[idx[3 * k:4 * k]] = -0.0
    x[idx[4 * k:5 * k]] = torch.finfo(dtype).tiny / 4
    return x.to(dtype)


def compare(x_cpu, h):
    got = hookcap.tensor_stats(x_cpu.cuda(), h)
    cpu = hookcap.tensor_stats(x_cpu, h)
    ref = hookcap.reference.tensor_stats(x_cpu, h)
    assert_stats_match(got, ref, abs_sum=abs_sum(x_cpu))
    if h is not None:
        np.testing.assert_array_equal(got["hist"], cpu["hist"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [Histogram.log2(), Histogram.linear(-2, 3, 11), Histogram.linear(-2, 3, 5000),
                               None])
@pytest.mark.parametrize("n", [1, 5, 1023, 1_000_003])
def test_cuda_matches_cpu(dtype, h, n):
    compare(specials(n, dtype, n), h)


def test_cuda_strided_and_misaligned():
    x = specials(300 * 70, torch.float32, 1).reshape(300, 70)
    compare(x.t()[3:, ::2].contiguous().t(), Histogram.log2())  # permuted dense
    for view in (x[::3, 5:41], x.t()[7:, ::2], x[:, 1], x.reshape(-1)[3:], x[:1].expand(50, 70)):
        got = hookcap.tensor_stats(x.cuda().as_strided(view.size(), view.stride(), view.storage_offset()))
        ref = hookcap.reference.tensor_stats(view)
        assert_stats_match(got, ref, abs_sum=abs_sum(view))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [Histogram.log2(), Histogram.linear(-2, 3, 11), None])
def test_cuda_rows_of_whole_vectors(dtype, h):
    # Column slices and a split of a fused last dimension: read as 16-byte vectors.
    x = specials(1000 * 96, dtype, 2).reshape(1000, 96)
    for view in (x[:, 16:80], x.split(32, dim=1)[1], x[:, 1:65]):
        g = x.cuda().as_strided(view.size(), view.stride(), view.storage_offset())
        got, cpu = hookcap.tensor_stats(g, h), hookcap.tensor_stats(view, h)
        assert_stats_match(got, hookcap.reference.tensor_stats(view, h), abs_sum=abs_sum(view))
        if h is not None:
            np.testing.assert_array_equal(got["hist"], cpu["hist"])


def test_cuda_ring_merge_slots_and_advance():
    h = Histogram.log2()
    width = _layout.HEADER + h.nbins
    ring = torch.zeros((3, 2, width), dtype=torch.int64, device="cuda")
    st = new_state("cuda")
    _ops.reset_slot(ring, st)
    parts = [torch.randn(5000) + 100, torch.randn(77, 3).t(), torch.tensor([float("nan"), 0.0])]
    for p in parts:
        _ops.accumulate(p.cuda(), ring, st, 1, h)
    _ops.advance(ring, st, 1)
    _ops.accumulate(torch.ones(10, device="cuda"), ring, st, 0, h)
    raw = ring.cpu().numpy()
    assert st.cpu().tolist() == [1, 1, 1]
    flat = torch.cat([p.reshape(-1).double() for p in parts])
    ref = hookcap.reference.stats_from_values(flat.numpy(), h)
    got = {k: float(v) for k, v in _layout.decode(raw[0, 1]).items()}
    got["hist"], got["bin_edges"] = raw[0, 1, _layout.HEADER:], h.bin_edges
    assert_stats_match(got, ref, abs_sum=abs_sum(flat))
    assert _layout.decode(raw[1, 0])["count"] == 10


def test_cuda_ops_do_not_sync_or_allocate():
    h = Histogram.log2()
    x = torch.randn(1 << 20, device="cuda")
    ring = torch.zeros((2, 1, _layout.HEADER + h.nbins), dtype=torch.int64, device="cuda")
    st = new_state("cuda")
    _ops.reset_slot(ring, st)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            _ops.accumulate(x, ring, st, 0, h)
            _ops.accumulate(x.t() if x.dim() > 1 else x[1:], ring, st, 0, h)
            _ops.advance(ring, st, 1)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before


def test_cuda_graph_replay_uses_device_slot():
    h = Histogram.log2()
    ring = torch.zeros((4, 1, _layout.HEADER + h.nbins), dtype=torch.int64, device="cuda")
    st = new_state("cuda")
    _ops.reset_slot(ring, st)
    x = torch.randn(4096, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _ops.accumulate(x, ring, st, 0, h)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(s)
    _ops.reset_slot(ring, st)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _ops.accumulate(x, ring, st, 0, h)
        _ops.advance(ring, st, 1)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    counts = [_layout.decode(ring[i, 0].cpu().numpy())["count"] for i in range(4)]
    # Capture itself does not run the kernels; three replays fill slots 0, 1, 2.
    assert counts[:3] == [4096.0] * 3 and st.cpu().tolist()[0] == 3


def _graph_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).cuda()


def _assert_steps_equal(h, steps, ref_step, names=None):
    """Every step in ``steps`` holds the same stats as step ``ref_step``."""
    r = list(h.steps).index(ref_step)
    for s in steps:
        i = list(h.steps).index(s)
        for name in h.names if names is None else names:
            c = h.column(name)
            assert h["count"][i, c] == h["count"][r, c] > 0, (s, name)
            np.testing.assert_allclose(h["sum"][i, c], h["sum"][r, c], rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(h.histogram(name)[i], h.histogram(name)[r])


def _capture_after_warmup(model, x, mon):
    """Three eager steps on a side stream (rows registered), then a captured
    forward + backward: the graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model(x).sum().backward()
            model.zero_grad(set_to_none=True)
            mon.step()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        model(x).sum().backward()
    return g


def test_monitor_records_every_cuda_graph_replay():
    # Rows are registered in eager warm-up steps; the captured step's kernels
    # read the slot from the device state, so each replay + step() fills a
    # new slot and the drain reads it (no host value is baked into the graph).
    model = _graph_model()
    x = torch.randn(8, 16, device="cuda")
    mon = hookcap.Monitor(model, capture=("output", "grad_output")).attach()
    g = _capture_after_warmup(model, x, mon)
    first = mon.current_step
    for _ in range(4):
        g.replay()
        mon.step()
    h = mon.history()
    assert list(h.steps)[-4:] == list(range(first, first + 4))
    assert {n.split("/")[1] for n in h.names} == {"output", "grad_output"}
    _assert_steps_equal(h, range(first, first + 4), ref_step=2)  # eager step 2: same input
    mon.detach()


def test_monitor_with_compile_reduce_overhead():
    model = _graph_model()
    x = torch.randn(8, 16, device="cuda")
    mon = hookcap.Monitor(model, capture=("output", "grad_output")).attach()
    cm = torch.compile(model, mode="reduce-overhead")
    for _ in range(8):  # warm-up, recording and replays
        cm(x).sum().backward()
        model.zero_grad(set_to_none=True)
        mon.step()
    h = mon.history()
    assert list(h.steps) == list(range(8))
    assert {n.split("/")[1] for n in h.names} == {"output", "grad_output"}
    _assert_steps_equal(h, range(8), ref_step=0)
    mon.detach()


def test_cuda_timing_is_stream_ordered_and_matches_events():
    # %globaltimer marks around each Linear: no host sync in steady state, and
    # the forward time of a module agrees with CUDA events around the same work.
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(3)]).cuda()
    x = torch.randn(8192, 2048, device="cuda")
    mon = hookcap.Monitor(model, capture=("output", "grad_output"), timing=True).attach()
    for _ in range(2):  # warm-up: rows registered, kernels loaded
        model(x).sum().backward()
        mon.step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        start.record()
        y = model(x)
        end.record()
        y.sum().backward()
        mon.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    h = mon.history()
    s = list(h.steps).index(2)
    fwd = [h["fwd_ms"][s, h.column(f"{i}/output")] for i in range(3)]
    bwd = [h["bwd_ms"][s, h.column(f"{i}/output")] for i in range(3)]
    assert all(f > 0 for f in fwd) and np.isnan(bwd[0]) and all(b > 0 for b in bwd[1:])
    # The three forwards lie inside the event pair (plus hookcap's own kernels).
    assert sum(fwd) <= start.elapsed_time(end) * 1.05 + 0.05
    assert sum(fwd) >= 0.5 * start.elapsed_time(end)
    mon.detach()


def _mapped_cudart(ctypes):
    """The CUDA runtime this process already mapped (torch's, which hookcap's
    extension shares by soname): another copy loaded by name would keep its own
    last error, and the test would test nothing."""
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "/libcudart" in line}
    if len(paths) != 1:
        pytest.skip(f"expected one mapped libcudart, found {sorted(paths)} (statically linked runtime?)")
    return ctypes.CDLL(paths.pop())


def test_a_pending_error_of_another_library_survives_hookcap_launches():
    """Launches go through cudaLaunchKernel, which returns their own error:
    an error another library left pending (here: cudaSetDevice on a device
    that does not exist) is neither cleared nor reported as hookcap's."""
    import ctypes

    ring = torch.zeros((1, 1, _layout.HEADER), dtype=torch.int64, device="cuda")
    rt = _mapped_cudart(ctypes)  # after CUDA is initialised: the runtime is mapped
    state = new_state("cuda")
    x = torch.ones(1000, device="cuda")  # before the planted error: torch's own launch check would raise it
    torch.cuda.synchronize()
    assert rt.cudaSetDevice(ctypes.c_int(10_000)) != 0
    pending = rt.cudaPeekAtLastError()
    assert pending != 0
    _ops.accumulate(x, ring, state, 0, None)
    _ops.advance(ring, state, 1)
    assert rt.cudaPeekAtLastError() == pending  # still there, for its owner
    assert rt.cudaGetLastError() == pending
    torch.cuda.synchronize()


def _train_recorded(device, steps=3):
    """A seeded MLP with LayerNorm trained ``steps`` SGD steps on ``device``
    under a default Monitor, beside plain hooks that keep float64 CPU copies of
    every leaf module's output and output gradient: (History, {(step, name): copies})."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 16, generator=g) for _ in range(steps)]
    values, step = {}, [0]

    def keep(key):
        def hook(t):
            values.setdefault((step[0], key), []).append(t.detach().double().cpu().reshape(-1))
        return hook

    def fwd(name):
        def hook(mod, args, out):
            keep(f"{name}/output")(out)
            out.register_hook(keep(f"{name}/grad_output"))
        return hook

    handles = [m.register_forward_hook(fwd(n)) for n, m in model.named_children()]
    with hookcap.Monitor(model) as mon:
        for i, x in enumerate(batches):
            step[0] = i
            model(x.to(device)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            mon.step()
    for h in handles:
        h.remove()
    return mon.history(), values


def test_monitor_on_cuda_matches_cpu_and_the_captured_tensors():
    # Matmuls round differently on the two devices, so the devices must agree
    # on what is recorded (names, steps, element counts), and each CUDA
    # statistic must match the float64 reference of the very tensor it saw.
    h_cpu, _ = _train_recorded("cpu")
    h, values = _train_recorded("cuda")
    assert h.names == h_cpu.names and len(h.names) == 8  # 4 outputs and their gradients
    assert list(h.steps) == list(h_cpu.steps) == [0, 1, 2]
    np.testing.assert_array_equal(h["count"], h_cpu["count"])
    assert set(values) == {(s, n) for s in h.steps for n in h.names}
    for (step, name), chunks in values.items():
        vals = torch.cat(chunks).numpy()
        s, m = list(h.steps).index(step), h.column(name)
        got = {k: h[k][s, m] for k in hookcap.STAT_NAMES}
        got["hist"], got["bin_edges"] = h.histogram(name)[s], h.bin_edges
        want = hookcap.reference.stats_from_values(vals, h.histogram_spec)
        assert_stats_match(got, want, abs_sum=float(np.abs(vals).sum()))


def test_drain_waits_for_ops_on_another_stream():
    """A hook's op launched on a side stream, still queued behind a long kernel
    there when the drain runs, lands in the slot before it is copied."""
    ring = torch.zeros((1, 1, _layout.HEADER), dtype=torch.int64, device="cuda")
    state = new_state("cuda")
    _ops.reset_slot(ring, state)
    hookcap._C._join_write_streams(0)  # forget earlier writers
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # tens of ms at GPU clocks
        _ops.accumulate(torch.ones(1000, device="cuda"), ring, state, 0, None)
    assert hookcap._C._join_write_streams(0) == 1
    host = ring.cpu()  # ordered on the current stream only
    assert host[0, 0, _layout.COUNT] == 1000 and host[0, 0, _layout.CALLS] == 1
    torch.cuda.synchronize()


def test_monitor_records_outputs_computed_on_a_side_stream():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda()
    x = torch.randn(32, 64, device="cuda")
    mon = hookcap.Monitor(model, capture=("output",)).attach()
    side = torch.cuda.Stream()
    for _ in range(3):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)
            out = model(x)
        mon.step()  # on the default stream, while the side stream still runs
        torch.cuda.current_stream().wait_stream(side)
        ref = [model[0](x), model[1](model[0](x)), out]
    mon.detach()
    h = mon.history()
    assert h.names == ["0/output", "1/output", "2/output"] and list(h.steps) == [0, 1, 2]
    for c, t in enumerate(ref):
        assert h["count"][-1, c] == t.numel()
        assert h["max"][-1, c] == t.max().item()


def test_graph_captured_before_the_ring_grows_still_records(caplog):
    """The graph keeps the ring address it captured: when 80 new metrics grow
    the ring, the old buffer is kept (not freed under the graph) and folded
    into every step, so replays are still recorded in full."""
    model = _graph_model()
    extra = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(80)]).cuda()
    x, y = torch.randn(8, 16, device="cuda"), torch.randn(2, 4, device="cuda")
    mon = hookcap.Monitor(torch.nn.ModuleDict({"m": model, "extra": extra}),
                          capture=("output", "grad_output")).attach()
    g = _capture_after_warmup(model, x, mon)
    first = mon.current_step
    for i in range(4):
        g.replay()
        if i == 1:
            with torch.no_grad():
                extra(y)  # 80 new rows: the ring grows
        mon.step()
    names = [n for n in mon.history().names if n.startswith("m.")]
    assert len(names) == 6 and "grew after a CUDA graph captured" in caplog.text
    _assert_steps_equal(mon.history(), range(first, first + 4), ref_step=2, names=names)
    mon.detach()
