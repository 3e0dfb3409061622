"""The device path of hookcap, run on every device there is.

Each test takes ``dev``: "cpu" always runs (so a wrong call, signature or
helper here fails in CI, not on the first GPU found), "cuda" runs where a GPU
and the CUDA kernels are, and is skipped visibly elsewhere. On the CPU the
same calls run with the CPU kernels; what only a GPU has (streams, graphs,
events, sync checks, allocator statistics) is asserted on CUDA alone. Tests
with nothing to run on a CPU are CUDA-only; a CUDA-only test whose question
the CPU op answers too (the merge of partials, tiny squares, wide float64,
writers at once) has a CPU twin beside it.

The statistics op's tests also run "cpu-baseline": the CPU op's loop is
compiled twice, for AVX2+FMA+F16C and for the baseline ISA, and picked once
per process (csrc/cpu/stats_loop.h ``use_avx2``), so the other loop runs in a
worker process started with ``HOOKCAP_CPU_ISA=baseline``, against the same
float64 reference."""

import collections
import contextlib
import ctypes
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from conftest import (abs_sum, assert_moments, assert_recorded, assert_stats_match, assert_wide_match,
                      attention_reference, attention_rows_ref, attention_tile, draw)

import hookcap
from hookcap import Histogram, _layout, _ops
from hookcap.functional import new_state

HAVE_GPU = torch.cuda.is_available() and hookcap.build_info()["cuda"]
# gpu_check.py reads this reason: seen on a GPU machine, the kernels were not found.
NO_GPU = "no CUDA device visible (or CUDA kernels not built): the CUDA half of this test did not run"
cuda_only = pytest.mark.skipif(not HAVE_GPU, reason=NO_GPU)
DEVICES = ["cpu", pytest.param("cuda", marks=cuda_only)]
# The statistics op on each of its kernels: both CPU loops, and CUDA.
CPU_ISA = hookcap.build_info()["cpu_isa"]
other_cpu_loop = pytest.mark.skipif(
    CPU_ISA == "baseline", reason="this process's CPU op runs the baseline loop already: the 'cpu' case tested it")
CPU_LOOPS = [pytest.param("cpu", id="cpu"), pytest.param("cpu-baseline", id="cpu-baseline", marks=other_cpu_loop)]
OP_DEVICES = CPU_LOOPS + DEVICES[1:]

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def device_of(dev):
    """The torch device a case's tensors live on ("cpu-baseline": the CPU)."""
    return "cuda" if dev == "cuda" else "cpu"


def stats(dev, x, *args, **kwargs):
    """``hookcap.tensor_stats(x, *args, **kwargs)`` by ``dev``'s kernels; ``x`` on ``device_of(dev)``."""
    if dev == "cpu-baseline":
        return baseline_cpu().tensor_stats(x, *args, **kwargs)
    return hookcap.tensor_stats(x, *args, **kwargs)


# -- the CPU op's baseline loop, in a worker process -------------------------------------------

_BASELINE_WORKER = r"""
import os, pickle, sys, traceback
sys.path.insert(0, sys.argv[1])
replies = os.fdopen(os.dup(1), "wb")
os.dup2(2, 1)  # anything else printed goes to stderr, not into the replies
import hookcap
pickle.dump(hookcap.build_info()["cpu_isa"], replies)
replies.flush()
while True:
    try:
        x, args, kwargs = pickle.load(sys.stdin.buffer)
    except EOFError:
        break
    try:
        reply = ("ok", hookcap.tensor_stats(x, *args, **kwargs))
    except Exception:
        reply = ("error", traceback.format_exc())
    pickle.dump(reply, replies)
    replies.flush()
"""


class BaselineCPU:
    """A Python process whose CPU op runs the baseline-ISA loop (``HOOKCAP_CPU_ISA=baseline``,
    read once per process), with this process's hookcap: ``tensor_stats`` of the tensors sent
    to it. A view travels as itself (pickle keeps its storage, sizes, strides and offset)."""

    def __init__(self):
        root = os.path.dirname(os.path.dirname(os.path.abspath(hookcap.__file__)))
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-c", _BASELINE_WORKER, root], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log,
                                     env=dict(os.environ, HOOKCAP_CPU_ISA="baseline"))
        isa = self._reply()
        assert isa == "baseline", f"the worker's CPU loop is {isa!r}"

    def _reply(self):
        try:
            return pickle.load(self.proc.stdout)
        except EOFError:
            self.proc.wait()
            self.log.seek(0)
            err = self.log.read()[-4000:].decode(errors="replace")
            raise RuntimeError(f"the baseline-loop worker exited with {self.proc.returncode}:\n{err}") from None

    def tensor_stats(self, x, *args, **kwargs):
        try:
            pickle.dump((x, args, kwargs), self.proc.stdin)
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it exited: the reply says why
        status, value = self._reply()
        if status != "ok":
            raise RuntimeError(f"tensor_stats raised in the baseline-loop worker:\n{value}")
        return value

    def close(self):
        self.proc.stdin.close()
        self.proc.kill()  # nothing to finish: no need to wait for its interpreter's shutdown
        self.proc.wait()
        self.log.close()


_baseline = []  # the worker, started by the first case that needs it


def baseline_cpu():
    if not _baseline or _baseline[0].proc.poll() is not None:
        _baseline[:] = [BaselineCPU()]
    return _baseline[0]


@pytest.fixture(scope="module", autouse=True)
def _stop_baseline_worker():
    yield
    if _baseline:
        _baseline.pop().close()


_MEMO = collections.OrderedDict()


def memo(make, *args):
    """``make(*args)``, built once for the device cases of one test: they run one after
    another (the device varies fastest in the ids), so an input and its float64
    reference are not built again for each. The last few are kept; nothing may
    modify what it returns."""
    key = (make, *args)
    if key not in _MEMO:
        _MEMO[key] = make(*args)
        if len(_MEMO) > 4:
            _MEMO.popitem(last=False)
    return _MEMO[key]


# -- device helpers: on the CPU, streams are the one stream and work is done when issued --


def side_stream(dev):
    return torch.cuda.Stream() if dev == "cuda" else None


def on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def wait(a, b):
    """Stream ``a`` waits for the work queued on ``b`` (no-op on the CPU)."""
    if a is not None and b is not None:
        a.wait_stream(b)


def current(dev):
    return torch.cuda.current_stream() if dev == "cuda" else None


def busy(dev, cycles):
    """Keep the current stream busy for a while before what follows (CUDA only)."""
    if dev == "cuda":
        torch.cuda._sleep(cycles)


@contextlib.contextmanager
def no_sync(dev):
    """On CUDA, a host sync inside raises."""
    if dev != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def synchronize(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


# -- the op --------------------------------------------------------------------------------


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


def reference_of(x_cpu, h, **kwargs):
    """The float64 reference of ``x_cpu`` and sum |x| over its finite values (the scale of sum's rounding)."""
    return hookcap.reference.tensor_stats(x_cpu, h, **kwargs), abs_sum(x_cpu)


def specials_and_reference(n, dtype, seed, h):
    x = specials(n, dtype, seed)
    return x, reference_of(x, h)


def compare(x_cpu, h, dev, ref=None):
    """``x_cpu``'s statistics by ``dev``'s kernels equal the float64 reference
    (``ref``: ``reference_of(x_cpu, h)`` where built already); CUDA's histogram
    equals the CPU op's bin for bin."""
    got = stats(dev, x_cpu.to(device_of(dev)), h)
    cpu = hookcap.tensor_stats(x_cpu, h) if dev == "cuda" else got
    want, scale = reference_of(x_cpu, h) if ref is None else ref
    assert_stats_match(got, want, abs_sum=scale)
    if h is not None:
        np.testing.assert_array_equal(got["hist"], cpu["hist"])


@pytest.mark.parametrize("dev", OP_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [Histogram.log2(), Histogram.linear(-2, 3, 11), Histogram.linear(-2, 3, 5000),
                               # bins per octave and signed (CUDA: keys counted per block; float64: per element)
                               Histogram.log2(sub=4), Histogram.log2(-30, 12, sub=2, signed=True), None])
@pytest.mark.parametrize("n", [1, 5, 1023, 1_000_003])
def test_matches_cpu_and_reference(dev, dtype, h, n):
    x, ref = memo(specials_and_reference, n, dtype, n, h)
    compare(x, h, dev, ref)


@pytest.mark.parametrize("dev", OP_DEVICES)
def test_strided_and_misaligned(dev):
    x = specials(300 * 70, torch.float32, 1).reshape(300, 70)
    compare(x.t()[3:, ::2].contiguous().t(), Histogram.log2(), dev)  # permuted dense
    for view in (x[::3, 5:41], x.t()[7:, ::2], x[:, 1], x.reshape(-1)[3:], x[:1].expand(50, 70)):
        got = stats(dev, x.to(device_of(dev)).as_strided(view.size(), view.stride(), view.storage_offset()))
        ref = hookcap.reference.tensor_stats(view)
        assert_stats_match(got, ref, abs_sum=abs_sum(view))


def rows_and_references(dtype, h):
    """The [1000, 96] input of test_rows_of_whole_vectors; per view: the view, its CPU op
    statistics and its float64 reference."""
    x = specials(1000 * 96, dtype, 2).reshape(1000, 96)
    views = (x[:, 16:80], x.split(32, dim=1)[1], x[:, 1:65], x[:, :83], x[:, 16:95], x[:, :1])
    return x, [(v, hookcap.tensor_stats(v, h), reference_of(v, h)) for v in views]


@pytest.mark.parametrize("dev", OP_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [Histogram.log2(), Histogram.linear(-2, 3, 11), None])
def test_rows_of_whole_vectors(dev, dtype, h):
    # Column slices and a split of a fused last dimension: read as 16-byte vectors on CUDA; rows that
    # end in part of a vector (padded rows, as compiled code's logits) as vectors plus the rows' tails.
    x, views = memo(rows_and_references, dtype, h)
    for view, cpu, (ref, scale) in views:
        g = x.to(device_of(dev)).as_strided(view.size(), view.stride(), view.storage_offset())
        got = stats(dev, g, h)
        assert_stats_match(got, ref, abs_sum=scale)
        if h is not None:
            np.testing.assert_array_equal(got["hist"], cpu["hist"])


@pytest.mark.parametrize("dev", DEVICES)
def test_ring_merge_slots_and_advance(dev):
    h = Histogram.log2()
    width = _layout.HEADER + h.nbins
    ring = torch.zeros((3, 2, width), dtype=torch.int64, device=dev)
    st = new_state(dev)
    _ops.reset_slot(ring, st)
    parts = [torch.randn(5000) + 100, torch.randn(77, 3).t(), torch.tensor([float("nan"), 0.0])]
    for p in parts:
        _ops.accumulate(p.to(dev), ring, st, 1, h)
    _ops.advance(ring, st, 1)
    _ops.accumulate(torch.ones(10, device=dev), ring, st, 0, h)
    raw = ring.cpu().numpy()
    assert st.cpu().tolist() == [1, 1, 1]
    flat = torch.cat([p.reshape(-1).double() for p in parts])
    ref = hookcap.reference.stats_from_values(flat.numpy(), h)
    got = {k: float(v) for k, v in _layout.decode(raw[0, 1]).items()}
    got["hist"], got["bin_edges"] = raw[0, 1, _layout.HEADER:], h.bin_edges
    assert_stats_match(got, ref, abs_sum=abs_sum(flat))
    assert _layout.decode(raw[1, 0])["count"] == 10


@pytest.mark.parametrize("dev", DEVICES)
def test_ops_do_not_sync_or_allocate(dev):
    h = Histogram.log2()
    n = 1 << 20
    x = torch.randn(n, device=dev)
    ring = torch.zeros((2, 1, _layout.HEADER + h.nbins), dtype=torch.int64, device=dev)
    st = new_state(dev)
    _ops.reset_slot(ring, st)
    # A stream's first launch of several blocks by the tree creates its merge scratch, once.
    warm = torch.zeros_like(ring)
    _ops.accumulate(x, warm, st, 0, h)
    synchronize(dev)
    before = torch.cuda.memory_stats()["allocation.all.allocated"] if dev == "cuda" else None
    with no_sync(dev):
        for i in range(3):
            _ops.accumulate(x, ring, st, 0, h)
            _ops.accumulate(x[1:], ring, st, 0, h)
            if i < 2:
                _ops.advance(ring, st, 1)
    if dev == "cuda":
        assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    # Step 2 sits in slot 0 (slots 0, 1, 0) and holds both writes of that step only.
    assert st.cpu().tolist() == [2, 1, 0]
    row = ring[0, 0].cpu()
    assert row[_layout.COUNT] == 2 * n - 1 and row[_layout.CALLS] == 2


# A launch reads 16,384 elements per block up to a few blocks per SM; with the
# tree, 2 to 1,024 blocks merge their partials in two levels (groups of 32).
BLOCK_ELEMS = 256 * 64


# The CPU op reads a tensor in up to 64 chunks of at least 16,384 elements
# (csrc/cpu/stats_loop.h kMinChunk, kMaxChunks), spread over its threads; the
# chunks' partials merge in chunk order, each thread's local histogram once.
CPU_CHUNK = 16_384


@pytest.fixture(params=["direct", "tree"])
def merge(request):
    """Each way a launch's blocks merge, restored after the test (None: a CPU case, nothing to set)."""
    if request.param is None:
        yield None
        return
    old = _ops.block_merge(request.param)
    yield request.param
    _ops.block_merge(old)


# (dev, merge) for the merge fixture: each CPU loop once, CUDA with each way its blocks merge.
CUDA_MERGES = [pytest.param("cuda", m, id=f"cuda-{m}", marks=cuda_only) for m in ("direct", "tree")]
DEV_MERGES = [pytest.param(p.values[0], None, id=p.id, marks=p.marks) for p in CPU_LOOPS] + CUDA_MERGES


def test_block_merge_setting():
    old = _ops.block_merge()
    assert old in ("direct", "tree")
    with pytest.raises(ValueError, match="must be one of"):
        _ops.block_merge("fast")
    assert _ops.block_merge("tree") == old
    try:
        # Without CUDA kernels the setting has nothing to change and reads "direct".
        assert _ops.block_merge() == ("tree" if hookcap.build_info()["cuda"] else "direct")
    finally:
        _ops.block_merge(old)
    assert _ops.block_merge() == old


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h", [Histogram.log2(), Histogram.linear(-2, 3, 300), Histogram.linear(-2, 3, 5000), None])
@pytest.mark.parametrize("blocks", [2, 33, 97, 100_000])  # the last: as many as the GPU allows
def test_block_partials_merge(dtype, h, blocks, merge):
    n = min(blocks * BLOCK_ELEMS - 7, 9_000_011)
    compare(specials(n, dtype, blocks), h, "cuda")


@pytest.mark.parametrize("dev", CPU_LOOPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h", [Histogram.log2(), Histogram.linear(-2, 3, 300), Histogram.linear(-2, 3, 5000), None])
@pytest.mark.parametrize("chunks", [2, 33, 64, 65])  # 65 x 16,384: as many as the CPU allows, 64 grown ones
def test_chunk_partials_merge(dev, dtype, h, chunks):
    """test_block_partials_merge's CPU twin: a tensor of 2, 33 or 64 chunks, the
    last one short (linear 5,000: bins counted straight into the row, by every thread)."""
    n = chunks * CPU_CHUNK - 7
    x, ref = memo(specials_and_reference, n, dtype, chunks, h)
    compare(x, h, dev, ref)


def tiny_cases(dtype, scale):
    """test_tiny_values_keep_their_squares' inputs: (values, histogram, reference_of them)."""
    g = torch.Generator().manual_seed(7)
    cases = []
    for n in (1000, 40 * BLOCK_ELEMS + 3):
        x = (torch.randn(n, generator=g, dtype=torch.float64) * scale).to(dtype)
        offset = x + torch.tensor(3 * scale, dtype=torch.float64).to(dtype)
        for v, h in ((x, Histogram.log2(lo=-140)),
                     (x, Histogram.log2(lo=-140, sub=2, signed=True)),  # per-element fine bins
                     (offset, None)):
            cases.append((v, h, reference_of(v, h)))
    return cases


@pytest.mark.parametrize("dev", OP_DEVICES)
@pytest.mark.parametrize("dtype, scale", [(d, s) for d in (torch.float32, torch.bfloat16) for s in (1e-25, 1e-38, 1e-6)]
                         + [(torch.float16, 1e-6)])  # float16: tiny in its own range
def test_tiny_values_keep_their_squares(dev, dtype, scale):
    # Squares of float32/bf16 values under ~1e-19 underflow in float, which the
    # CUDA kernel and the CPU loops square in: they sum such runs again, scaled
    # by a power of two (stats_math.h tiny_run_exp).
    for x, h, ref in memo(tiny_cases, dtype, scale):
        compare(x, h, dev, ref)


@pytest.mark.parametrize("dev, merge", DEV_MERGES, indirect=["merge"])
@pytest.mark.parametrize("n", [1000, 40 * BLOCK_ELEMS + 3])
def test_wide_float64_values_keep_finite_moments(dev, merge, n):
    """Float64 values over all of double's range: huge ones (and tiny runs)
    take the row's buckets; mean, std, rms and l2norm equal the reference."""
    g = np.random.default_rng(n)
    x = np.ldexp(g.uniform(1, 2, n) * g.choice([-1.0, 1.0], n), g.integers(-1074, 1024, n))
    x[: n // 3] = g.standard_normal(n // 3)
    x[n // 3: n // 2] = 1e250 * (1 + 1e-6 * g.standard_normal(n // 2 - n // 3))
    h = Histogram.log2(-1074, 1023)
    got = stats(dev, torch.from_numpy(x).to(device_of(dev)), h)
    assert_wide_match(got, x, h, rtol=1e-9)


@pytest.mark.parametrize("dev, merge", [pytest.param("cpu", None, id="cpu")] + CUDA_MERGES, indirect=["merge"])
def test_concurrent_writers_merge_into_one_row(dev, merge):
    """Four writers at once on the same row: on CUDA four streams (each with
    its own merge scratch for the tree); on the CPU four threads (the op runs
    without the GIL; its writes reach the row by atomics, the first one's
    shift for all), each of several chunks."""
    h = Histogram.log2()
    ring = torch.zeros((1, 1, _layout.HEADER + h.nbins), dtype=torch.int64, device=dev)
    st = new_state(dev)
    _ops.reset_slot(ring, st)
    size = 30 * BLOCK_ELEMS if dev == "cuda" else 3 * CPU_CHUNK
    parts = [specials(size + i, torch.float32, 50 + i) for i in range(4)]
    if dev == "cuda":
        streams = [torch.cuda.Stream() for _ in parts]
        dev_parts = [p.cuda() for p in parts]
        torch.cuda.synchronize()
        for _ in range(3):
            for s, p in zip(streams, dev_parts):
                with torch.cuda.stream(s):
                    _ops.accumulate(p, ring, st, 0, h)
        torch.cuda.synchronize()
    else:
        start = threading.Barrier(len(parts), timeout=60)

        def write(p):
            start.wait()
            for _ in range(3):
                _ops.accumulate(p, ring, st, 0, h)

        with ThreadPoolExecutor(len(parts)) as pool:
            for f in [pool.submit(write, p) for p in parts]:
                f.result()
    flat = torch.cat([p.double() for p in parts] * 3)
    ref = hookcap.reference.stats_from_values(flat.numpy(), h)
    raw = ring.cpu().numpy()
    got = {k: float(v) for k, v in _layout.decode(raw[0, 0]).items()}
    got["hist"], got["bin_edges"] = raw[0, 0, _layout.HEADER:], h.bin_edges
    assert_stats_match(got, ref, abs_sum=abs_sum(flat))
    assert raw[0, 0, _layout.CALLS] == 12


@cuda_only
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


# -- the Monitor on a device ----------------------------------------------------------------


def _graph_model(dev):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(dev)


def _assert_steps_equal(h, steps, ref_step, names=None):
    """Every step in ``steps`` holds the same stats as step ``ref_step``."""
    r = list(h.steps).index(ref_step)
    for s in steps:
        i = list(h.steps).index(s)
        for name in h.names if names is None else names:
            c = h.column(name)
            assert h["count"][i, c] == h["count"][r, c] > 0, (s, name)
            np.testing.assert_allclose(h["sum"][i, c], h["sum"][r, c], rtol=1e-5, atol=1e-6)
            if h.histogram_spec is not None:
                np.testing.assert_array_equal(h.histogram(name)[i], h.histogram(name)[r])


def _capture_after_warmup(model, x, mon, dev):
    """Three eager steps on a side stream (rows registered), then the step's
    forward + backward as a replayable function: a captured CUDA graph's
    replay on CUDA, the same eager step on the CPU."""
    side = side_stream(dev)
    wait(side, current(dev))
    with on(side):
        for _ in range(3):
            model(x).sum().backward()
            model.zero_grad(set_to_none=True)
            mon.step()
    wait(current(dev), side)
    if dev != "cuda":
        return lambda: model(x).sum().backward()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        model(x).sum().backward()
    return g.replay


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("stream", ["current", "side"])
def test_monitor_records_every_graph_replay(dev, stream):
    # Rows are registered in eager warm-up steps; the captured step's kernels
    # read the slot from the device state, so each replay + step() fills a
    # new slot and the drain reads it (no host value is baked into the graph).
    # stream="side": inside the capture the statistics stay on the capturing stream.
    model = _graph_model(dev)
    x = torch.randn(8, 16, device=dev)
    mon = hookcap.Monitor(model, capture=("output", "grad_output"), stream=stream).attach()
    replay = _capture_after_warmup(model, x, mon, dev)
    first = mon.current_step
    for _ in range(4):
        replay()
        mon.step()
    h = mon.history()
    assert list(h.steps)[-4:] == list(range(first, first + 4))
    assert {n.split("/")[1] for n in h.names} == {"output", "grad_output"}
    _assert_steps_equal(h, range(first, first + 4), ref_step=2)  # eager step 2: same input
    mon.detach()


@pytest.mark.parametrize("dev", DEVICES)
def test_monitor_with_compile(dev):
    # CUDA: CUDA graphs under compile (reduce-overhead); CPU: the same hooks traced by dynamo.
    model = _graph_model(dev)
    x = torch.randn(8, 16, device=dev)
    mon = hookcap.Monitor(model, capture=("output", "grad_output")).attach()
    cm = (torch.compile(model, mode="reduce-overhead") if dev == "cuda"
          else torch.compile(model, backend="aot_eager"))
    for _ in range(8):  # warm-up, recording and replays
        cm(x).sum().backward()
        model.zero_grad(set_to_none=True)
        mon.step()
    h = mon.history()
    assert list(h.steps) == list(range(8))
    assert {n.split("/")[1] for n in h.names} == {"output", "grad_output"}
    _assert_steps_equal(h, range(8), ref_step=0)
    mon.detach()
    torch._dynamo.reset()


@pytest.mark.parametrize("dev", DEVICES)
def test_timing_is_stream_ordered_and_matches_a_clock(dev):
    # CUDA: %globaltimer marks around each Linear, no host sync in steady state,
    # checked against CUDA events; CPU: host clock marks against perf_counter.
    torch.manual_seed(0)
    d, rows = (2048, 8192) if dev == "cuda" else (512, 2048)
    model = torch.nn.Sequential(*[torch.nn.Linear(d, d) for _ in range(3)]).to(dev)
    x = torch.randn(rows, d, device=dev)
    mon = hookcap.Monitor(model, capture=("output", "grad_output"), timing=True).attach()
    for _ in range(2):  # warm-up: rows registered, kernels loaded
        model(x).sum().backward()
        mon.step()
    synchronize(dev)
    if dev == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with no_sync(dev):
        t0 = time.perf_counter()
        if dev == "cuda":
            start.record()
        y = model(x)
        if dev == "cuda":
            end.record()
        elapsed_ms = (time.perf_counter() - t0) * 1e3
        y.sum().backward()
        mon.step()
    synchronize(dev)
    if dev == "cuda":
        elapsed_ms = start.elapsed_time(end)
    h = mon.history()
    s = list(h.steps).index(2)
    fwd = [h["fwd_ms"][s, h.column(f"{i}/output")] for i in range(3)]
    bwd = [h["bwd_ms"][s, h.column(f"{i}/output")] for i in range(3)]
    assert all(f > 0 for f in fwd) and np.isnan(bwd[0]) and all(b > 0 for b in bwd[1:])
    # The three forwards lie inside the clock's pair (plus hookcap's own work).
    assert sum(fwd) <= elapsed_ms * 1.05 + 0.05
    assert sum(fwd) >= 0.5 * elapsed_ms
    mon.detach()


def _mapped_cudart():
    """The CUDA runtime this process already mapped (torch's, which hookcap's
    extension shares by soname): another copy loaded by name would keep its own
    last error, and the test would test nothing. None if none is mapped."""
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "/libcudart" in line}
    assert len(paths) <= 1, f"several CUDA runtimes mapped: {sorted(paths)}"
    return ctypes.CDLL(paths.pop()) if paths else None


@pytest.mark.parametrize("dev", DEVICES)
def test_a_pending_error_of_another_library_survives_hookcap_ops(dev):
    """Launches go through cudaLaunchKernel, which returns their own error:
    an error another library left pending (here: cudaSetDevice on a device
    that does not exist) is neither cleared nor reported as hookcap's.
    On the CPU (with a CUDA build of torch) the same runtime is asked, and
    hookcap's CPU ops leave it alone."""
    ring = torch.zeros((2, 1, _layout.HEADER), dtype=torch.int64, device=dev)
    state = new_state(dev)
    _ops.reset_slot(ring, state)
    x = torch.ones(1000, device=dev)  # before the planted error: torch's own launch check would raise it
    synchronize(dev)
    rt = _mapped_cudart()  # after CUDA is initialised (on CUDA): the runtime is mapped
    if rt is None:
        assert dev == "cpu" and torch.version.cuda is None, "a CUDA torch maps its runtime at import"
        pytest.skip("CPU-only torch: no CUDA runtime to plant an error in")
    assert rt.cudaSetDevice(ctypes.c_int(10_000)) != 0
    pending = rt.cudaPeekAtLastError()
    assert pending != 0
    _ops.accumulate(x, ring, state, 0, None)
    _ops.advance(ring, state, 1)
    assert rt.cudaPeekAtLastError() == pending  # still there, for its owner
    assert rt.cudaGetLastError() == pending
    synchronize(dev)
    assert ring[0, 0, _layout.COUNT].item() == 1000 and state.cpu().tolist() == [1, 1, 1]


def _train_recorded(device, steps=3, **monitor_kw):
    """A seeded MLP with LayerNorm trained ``steps`` SGD steps on ``device``
    under a Monitor (default, or ``monitor_kw``), beside plain hooks that keep
    float64 CPU copies of every leaf module's output and output gradient:
    (History, {(step, name): copies})."""
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
    with hookcap.Monitor(model, **monitor_kw) as mon:
        for i, x in enumerate(batches):
            step[0] = i
            model(x.to(device)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            mon.step()
    for h in handles:
        h.remove()
    return mon.history(), values


@pytest.mark.parametrize("dev", DEVICES)
def test_monitor_matches_the_captured_tensors(dev):
    # Matmuls round differently on the two devices, so the devices must agree
    # on what is recorded (names, steps, element counts), and each statistic
    # must match the float64 reference of the very tensor it saw.
    h_cpu, _ = _train_recorded("cpu")
    h, values = _train_recorded(dev)
    assert h.names == h_cpu.names and len(h.names) == 8  # 4 outputs and their gradients
    assert list(h.steps) == list(h_cpu.steps) == [0, 1, 2]
    np.testing.assert_array_equal(h["count"], h_cpu["count"])
    _assert_matches_captured(h, values)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "autocast"])
def test_steady_state_hook_writes_go_straight_to_the_kernel(dev, autocast):
    """From a module's second step on, the C++ hooks write its plain output
    and output gradient in one C call (no Python write), straight to the kernel, not through the dispatcher
    (FastPath.op_writes stays put; under autocast too, whose key every
    tensor carries), and those writes equal float64 of the tensors; under a
    profiler every write goes through the dispatcher, where it sees them."""
    model = _graph_model(dev)
    x = torch.randn(8, 16, device=dev)
    seen = {}

    def keep(name):
        def hook(mod, args, out):
            seen[name] = out.detach().double().cpu().reshape(-1)
        return hook

    for n, m in model.named_children():
        m.register_forward_hook(keep(f"{n}/output"))
    mon = hookcap.Monitor(model, capture=("output", "grad_output")).attach()
    rec = mon._recorder
    fast = rec.fast
    general = []  # the hooks' Python path: first calls only
    for attr in ("write", "capture_grad"):
        orig = getattr(rec, attr)
        setattr(rec, attr, lambda *a, _orig=orig, **k: (general.append(a[0]), _orig(*a, **k))[1])
    writes, python_writes = [], []
    for step in range(4):
        before = fast.op_writes()
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if step == 3 else None
        with profiler or contextlib.nullcontext(), \
                torch.autocast(dev, dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            model(x).float().sum().backward()
        synchronize(dev)
        writes.append(fast.op_writes() - before)
        python_writes.append(len(general))
        general.clear()
        mon.step()
    h = mon.history()
    mon.detach()
    assert writes[1:] == [0, 0, 6]  # 3 outputs and 3 gradients a step
    assert python_writes == [6, 0, 0, 0]  # after the first step: one C call per module call
    for name, vals in seen.items():  # the last step's outputs
        got = {k: h[k][3, h.column(name)] for k in hookcap.STAT_NAMES}
        got["hist"], got["bin_edges"] = h.histogram(name)[3], h.bin_edges
        want = hookcap.reference.stats_from_values(vals.numpy(), h.histogram_spec)
        assert_stats_match(got, want, abs_sum=float(vals.abs().sum()))


def _assert_matches_captured(h, values):
    """Each statistic of ``h`` equals the float64 reference of the tensor it saw."""
    assert set(values) == {(s, n) for s in h.steps for n in h.names}
    for (step, name), chunks in values.items():
        vals = torch.cat(chunks).numpy()
        s, m = list(h.steps).index(step), h.column(name)
        got = {k: h[k][s, m] for k in hookcap.STAT_NAMES}
        got["hist"], got["bin_edges"] = h.histogram(name)[s], h.bin_edges
        want = hookcap.reference.stats_from_values(vals, h.histogram_spec)
        assert_stats_match(got, want, abs_sum=float(np.abs(vals).sum()))


@pytest.mark.parametrize("dev", DEVICES)
def test_drain_waits_for_ops_on_another_stream(dev):
    """A hook's op launched on a side stream, still queued behind a long kernel
    there when the drain runs, lands in the slot before it is copied."""
    ring = torch.zeros((1, 1, _layout.HEADER), dtype=torch.int64, device=dev)
    state = new_state(dev)
    _ops.reset_slot(ring, state)
    if dev == "cuda":
        hookcap._C._join_write_streams(0)  # forget earlier writers
    side = side_stream(dev)
    wait(side, current(dev))
    with on(side):
        busy(dev, 100_000_000)  # tens of ms at GPU clocks
        _ops.accumulate(torch.ones(1000, device=dev), ring, state, 0, None)
    if dev == "cuda":
        assert hookcap._C._join_write_streams(0) == 1
    host = ring.cpu()  # ordered on the current stream only
    assert host[0, 0, _layout.COUNT] == 1000 and host[0, 0, _layout.CALLS] == 1
    synchronize(dev)


@pytest.mark.parametrize("dev", DEVICES)
def test_monitor_records_outputs_computed_on_a_side_stream(dev):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(dev)
    x = torch.randn(32, 64, device=dev)
    mon = hookcap.Monitor(model, capture=("output",)).attach()
    side = side_stream(dev)
    for _ in range(3):
        wait(side, current(dev))
        with on(side):
            busy(dev, 50_000_000)
            out = model(x)
        mon.step()  # on the default stream, while the side stream still runs
        wait(current(dev), side)
        with mon.paused():  # the reference's own calls are not part of the next step
            ref = [model[0](x), model[1](model[0](x)), out]
    mon.detach()
    h = mon.history()
    assert h.names == ["0/output", "1/output", "2/output"] and list(h.steps) == [0, 1, 2]
    for c, t in enumerate(ref):
        assert h["count"][-1, c] == t.numel()
        assert h["max"][-1, c] == t.max().item()


@pytest.mark.parametrize("dev", DEVICES)
def test_side_stream_records_what_it_captured_without_a_sync(dev):
    """Monitor(stream="side"): every statistic equals the float64 reference of
    the tensor it saw, with no host sync in the steady steps (on the CPU the
    argument changes nothing)."""
    h, values = _train_recorded(dev, stream="side")
    assert len(h.names) == 8 and list(h.steps) == [0, 1, 2]
    _assert_matches_captured(h, values)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()).to(dev)
    x = torch.randn(4, 16, device=dev)
    with hookcap.Monitor(model, stream="side") as mon:
        model(x).sum().backward()
        mon.step()
        with no_sync(dev):
            for _ in range(3):
                model(x).sum().backward()
                mon.step()
    assert list(mon.history().steps) == [0, 1, 2, 3]


@cuda_only
def test_side_stream_leaves_the_model_stream_free_and_keeps_inputs_alive():
    """The statistics wait on hookcap's side stream (kept busy here), not on
    the model's stream; a captured tensor freed at once keeps its memory until
    they have read it (record_stream), and step() orders the drain after them."""
    side = torch.cuda.ExternalStream(hookcap._C._side_stream(0))
    model = torch.nn.Sequential(torch.nn.Linear(256, 256)).cuda()
    x = torch.randn(64, 256, device="cuda")
    with hookcap.Monitor(model, capture="output", stream="side") as mon:
        model(x)
        mon.step()
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # the side stream: busy for a good fraction of a second
        out = model(x)
        want = out.detach().double().cpu()
        ptr = out.data_ptr()
        del out
        done = torch.cuda.Event()
        done.record()
        other = torch.full((64, 256), -7.0, device="cuda")  # its size: would reuse out's block
        assert other.data_ptr() != ptr
        t0 = time.perf_counter()
        while not done.query() and time.perf_counter() - t0 < 5:
            time.sleep(0.001)
        assert done.query() and not side.query()  # the model's stream ran on; the statistics wait
        mon.step()
    h = mon.history()
    got = {k: h[k][-1, 0] for k in hookcap.STAT_NAMES}
    got["hist"], got["bin_edges"] = h.histogram("0/output")[-1], h.bin_edges
    ref = hookcap.reference.stats_from_values(want.numpy().reshape(-1), h.histogram_spec)
    assert_stats_match(got, ref, abs_sum=float(want.abs().sum()))


@pytest.mark.parametrize("dev", DEVICES)
def test_ring_growth_after_capture_still_records_each_step_once(dev, caplog):
    """CUDA: the graph keeps the ring address it captured: when 80 new metrics
    grow the ring, the old buffer is kept (not freed under the graph) and
    folded into every step, and its rows are not also copied into the new one
    (which would count the step's earlier writes twice). CPU: the same steps,
    eager, with the ring grown and copied."""
    model = _graph_model(dev)
    extra = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(80)]).to(dev)
    x, y = torch.randn(8, 16, device=dev), torch.randn(2, 4, device=dev)
    mon = hookcap.Monitor(torch.nn.ModuleDict({"m": model, "extra": extra}),
                          capture=("output", "grad_output")).attach()
    replay = _capture_after_warmup(model, x, mon, dev)
    first = mon.current_step
    for i in range(4):
        replay()
        if i == 1:
            with torch.no_grad():
                extra(y)  # 80 new rows: the ring grows
        mon.step()
    h = mon.history()
    names = [n for n in h.names if n.startswith("m.")]
    assert len(names) == 6
    assert ("grew after a CUDA graph captured" in caplog.text) == (dev == "cuda")
    _assert_steps_equal(h, range(first, first + 4), ref_step=2, names=names)
    s = list(h.steps).index(first + 1)
    for i in range(80):
        assert h["count"][s, h.column(f"extra.{i}/output")] == 8
    mon.detach()


# -- CUDA graph capture: no sync, no blocking copy, no event query, nothing raised ------------


@cuda_only
def test_a_cold_monitor_inside_a_capture_skips_with_a_warning(caplog):
    """Rows first seen while capturing are skipped (their ring would be made
    inside the capture), with one warning per metric; the capture succeeds
    and later eager steps record them."""
    model = _graph_model("cuda")
    x = torch.randn(8, 16, device="cuda")
    mon = hookcap.Monitor(model, capture=("output", "grad_output")).attach()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm torch's own kernels, with hookcap paused
        with mon.paused():
            model(x).sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        model(x).sum().backward()
        mon.step()  # refused inside the capture: a warning, nothing else
    g.replay()
    assert "first seen while a CUDA graph was being captured" in caplog.text
    assert "step() while a CUDA graph is being captured" in caplog.text
    model(x).sum().backward()
    mon.step()
    h = mon.history()
    assert len(h.names) == 6 and (h["count"][-1] > 0).all()
    mon.detach()


@cuda_only
def test_first_ring_on_a_device_is_made_without_a_host_sync():
    model = _graph_model("cuda")
    x = torch.randn(8, 16, device="cuda")
    model(x).sum().backward()  # torch's own lazy initialisation
    torch.cuda.synchronize()
    mon = hookcap.Monitor(model, capture=("output", "grad_output")).attach()
    with no_sync("cuda"):
        model(x).sum().backward()
    mon.step()
    h = mon.history()
    assert len(h.names) == 6 and (h["count"][-1] > 0).all()
    mon.detach()


def test_capture_guards_skip_new_rows_and_refuse_step(monkeypatch, caplog):
    """The guards' logic on the CPU (capture itself needs CUDA): while a
    capture is reported, rows first seen are skipped with one warning per
    metric, nothing is raised, and step() does nothing; afterwards the same
    calls are recorded."""
    import hookcap._rows.recorder as recorder

    capturing = [True]
    monkeypatch.setattr(recorder, "capturing", lambda device: capturing[0])
    monkeypatch.setattr(recorder.Recorder, "capturing", lambda self: capturing[0])
    model = _graph_model("cpu")
    x = torch.randn(8, 16)
    mon = hookcap.Monitor(model, capture=("output", "grad_output"), timing=True).attach()
    for _ in range(2):
        model(x).sum().backward()
        mon.step()
    assert mon.current_step == 0 and not mon._recorder.rows
    assert caplog.text.count("first seen while a CUDA graph was being captured") == 3 + 3 + 3  # outputs, gradients, timers
    assert caplog.text.count("step() while a CUDA graph is being captured") == 1
    capturing[0] = False
    model(x).sum().backward()
    mon.step()
    h = mon.history()
    assert mon.current_step == 1 and len(h.names) == 6 and (h["count"][-1] > 0).all()
    mon.detach()


@pytest.mark.parametrize("dev", DEVICES)
def test_taps_and_optimizer_state_on_the_device(dev):
    """The loss tapped inside a step and Adam's state (fused on CUDA, foreach on
    the CPU) recorded with no host sync, equal to float64 copies of what was
    tapped and of the optimizer's own state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, **({"fused": True} if dev == "cuda" else {"foreach": True}))
    xs = [torch.randn(8, 16, device=dev) for _ in range(4)]
    kept = []
    mon = hookcap.Monitor(model, capture=("output", "optim_state"), optimizer=opt).attach()
    for i, x in enumerate(xs):
        with no_sync(dev) if i >= 2 else contextlib.nullcontext():  # steady state: rows exist
            loss = model(x).pow(2).mean()
            hookcap.tap(loss, "loss")
            loss.backward()
            opt.step()
            opt.zero_grad()
        kept.append((loss.detach().double().cpu(),
                     {n: opt.state[p]["exp_avg_sq"].double().cpu() for n, p in model.named_parameters()}))
    mon.detach()
    h = mon.history()
    assert h.meta("loss")["kind"] == "tap"
    for step, (loss, sq) in enumerate(kept):
        assert_recorded(h, step, "loss", [loss])
        for n, v in sq.items():
            assert_recorded(h, step, f"{n}/state.exp_avg_sq", [v])


OPTIMIZER_STEPS = {  # each records "update" (and "adam_ratio" for Adam) with no host sync
    "adam-fused": (lambda ps, dev: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01,
                                                    **({"fused": True} if dev == "cuda" else {}))),
    "adamw-capturable-amsgrad": (lambda ps, dev: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True,
                                                                   capturable=dev == "cuda")),
    "sgd-nesterov-default": (lambda ps, dev: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True)),
}


@pytest.mark.parametrize("which", list(OPTIMIZER_STEPS))
@pytest.mark.parametrize("dev", DEVICES)
def test_optimizer_updates_on_the_device(dev, which):
    """capture="update"/"adam_ratio" against Δw measured as w_after − w_before
    in float64 (norms to float32 rounding of the parameters), the step count
    of capturable/fused Adam read on the device, no host sync. On CUDA, torch's
    fused and capturable Adam compute their bias corrections in float32
    (1 − 0.999f is 1.3e-5 off 1e-3), so the update they apply differs from the
    step's formula, which hookcap recomputes (update_math.h), by up to ~7e-6 relative."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4)).to(dev)
    opt = OPTIMIZER_STEPS[which](model.parameters(), dev)
    kinds = ("update", "adam_ratio") if which.startswith("adam") else ("update",)
    mon = hookcap.Monitor(model, capture=kinds, optimizer=opt).attach()
    kept = []
    for i in range(4):
        x = torch.randn(8, 16, device=dev)
        before = {n: p.detach().double().cpu() for n, p in model.named_parameters()}
        with no_sync(dev) if i >= 2 else contextlib.nullcontext():
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        kept.append({n: (p.detach().double().cpu() - before[n], before[n]) for n, p in model.named_parameters()})
    mon.detach()
    h = mon.history()
    assert h.steps.tolist() == [0, 1, 2, 3]
    for step, per_param in enumerate(kept):
        for n, (delta, w0) in per_param.items():
            s, m = step, h.column(f"{n}/update")
            # w_after − w_before in float64 is the applied update to the parameters' rounding
            tol = 4 * 2.0 ** -24 * float(w0.abs().max()) * delta.numel() ** 0.5
            rtol = 2e-5 if dev == "cuda" and which.startswith("adam") else 1e-6
            assert abs(h["l2norm"][s, m] - float(delta.norm())) <= tol + rtol * float(delta.norm())
            assert h["count"][s, m] == delta.numel()
            np.testing.assert_allclose(h.update_ratio(n)[s], float(delta.norm() / w0.norm()), rtol=1e-3)
            if "adam_ratio" in kinds:
                r = h["rms"][s, h.column(f"{n}/adam_ratio")]
                assert np.isfinite(r) and r > 0


def moments4_cases(kind, dtype):
    """test_moments4_match_reference's inputs: (values, their moments=4 reference, as float64)."""
    x = draw(kind, 1_000_003, 7)
    x = (x.clamp(-6e4, 6e4) if dtype == torch.float16 else x).to(dtype)
    return [(v, hookcap.reference.tensor_stats(v, Histogram.log2(), moments=4), v.double().numpy())
            for v in (x, x[3:].reshape(1000, -1)[:, ::3])]


@pytest.mark.parametrize("dev", OP_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("kind", ["normal", "t3", "offset", "two_sd", "tiny", "halves"])
def test_moments4_match_reference(dev, dtype, kind):
    """moments=4 on a million values (many blocks: the tree merge; on the CPU,
    chunks) and on a strided view of them (CUDA: copied dense; CPU: read
    through its strides), against the float64 reference of the same values."""
    for v, ref, values in memo(moments4_cases, kind, dtype):
        got = stats(dev, v.to(device_of(dev)), Histogram.log2(), moments=4)
        assert_moments(got, ref, values)


GROUP_CASES = {  # x (made on the CPU), dim, size
    "heads": (lambda dt: (torch.randn(3000, 96) * 3).to(dt), -1, 8),
    "experts": (lambda dt: torch.randn(4, 500, 16).to(dt), 0, 1),
    "strided": (lambda dt: torch.randn(96, 300).to(dt).t(), 1, 12),
}


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(GROUP_CASES))
def test_groups_on_the_device(dev, dtype, case):
    """accumulate_groups on the tensor's device: each group's row holds the
    CPU op's counts, extrema and bins exactly (the CPU's view of the group
    with the statistics op on the CPU case) and float64's sums."""
    make, dim, size = GROUP_CASES[case]
    h = Histogram.log2()
    x = make(dtype)
    groups = x.shape[dim] // size
    width = _layout.HEADER + h.nbins
    ring = torch.zeros(1, groups, width, dtype=torch.int64, device=device_of(dev))
    _ops.reset_slot(ring, new_state(device_of(dev)))
    _ops.accumulate_groups(x.to(device_of(dev)), ring, new_state(device_of(dev)), list(range(groups)), dim, size, h)
    got = ring.cpu().numpy()
    exact = [getattr(_layout, c) for c in ("COUNT", "NAN", "POSINF", "NEGINF", "ZEROS", "MIN", "MAX", "ABSMAX")]
    for g in range(groups):
        part = x.narrow(dim, g * size, size)
        one = torch.zeros(1, 1, width, dtype=torch.int64)
        _ops.reset_slot(one, new_state("cpu"))
        _ops.accumulate(part, one, new_state("cpu"), 0, h)
        np.testing.assert_array_equal(got[0, g, exact], one[0, 0, exact].numpy())
        np.testing.assert_array_equal(got[0, g, _layout.HEADER:], one[0, 0, _layout.HEADER:].numpy())
        dec = {k: float(v) for k, v in _layout.decode(got[0, g]).items()}
        dec["hist"], dec["bin_edges"] = got[0, g, _layout.HEADER:], h.bin_edges
        assert_stats_match(dec, hookcap.reference.tensor_stats(part, h), abs_sum=abs_sum(part))


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("bins", [6, 300])  # 300: two launches of the CUDA kernel (256 bins each)
def test_bins_on_the_device(dev, weighted, bins):
    """accumulate_bins on the device, with no host sync: each bin's row has
    the CPU op's counts (torch.bincount), extrema and bins exactly, and its
    sums to double rounding; choices outside [0, bins) are in no bin."""
    g = torch.Generator().manual_seed(bins)
    index = torch.randint(-1, bins + 1, (20_000,), generator=g)
    weight = torch.rand(20_000, generator=g).to(torch.bfloat16) if weighted else None
    h = Histogram.log2()
    width = _layout.HEADER + h.nbins
    rows = list(range(bins))
    got = torch.zeros(1, bins, width, dtype=torch.int64, device=device_of(dev))
    want = torch.zeros(1, bins, width, dtype=torch.int64)
    _ops.reset_slot(got, new_state(device_of(dev)))
    _ops.reset_slot(want, new_state("cpu"))
    w = None if weight is None else weight.to(device_of(dev))
    with no_sync(dev):
        _ops.accumulate_bins(index.to(device_of(dev)), w, got, new_state(device_of(dev)), rows, h)
    _ops.accumulate_bins(index, weight, want, new_state("cpu"), rows, h)
    got, want = got.cpu().numpy(), want.numpy()
    exact = [getattr(_layout, c) for c in ("COUNT", "NAN", "ZEROS", "MIN", "MAX", "ABSMAX", "CALLS")]
    np.testing.assert_array_equal(got[0, :, exact].T, want[0, :, exact].T)
    np.testing.assert_array_equal(got[0, :, _layout.COUNT],
                                  torch.bincount(index[(index >= 0) & (index < bins)], minlength=bins).numpy())
    np.testing.assert_array_equal(got[0, :, _layout.HEADER:], want[0, :, _layout.HEADER:])
    for b in range(0, bins, 37):
        gs, ws = (_layout.decode(r[0, b]) for r in (got, want))
        np.testing.assert_allclose(float(gs["sum"]), float(ws["sum"]), rtol=1e-9)


@pytest.mark.parametrize("dev", DEVICES)
def test_attention_rows_on_the_device_match_float64(dev):
    """attention_rows on the device (a warp per row on CUDA): the causal mask
    written in place, logsumexp and entropy within 1e-5 of float64 (peaked,
    tied, masked and empty rows; 12 heads of 1,100 keys), with no host sync."""
    x = attention_tile(5, (2, 12, 24, 1100), peaked=True)
    ref = attention_rows_ref(x, 1000)
    got = x.to(device_of(dev))
    with no_sync(dev):
        lse, ent = _ops.attention_rows(got, 1000)
    np.testing.assert_array_equal(torch.isneginf(got).cpu().numpy(), torch.isneginf(ref[0]).numpy())
    for g, want in ((lse, ref[1]), (ent, ref[2])):
        np.testing.assert_allclose(g.cpu().double().numpy(), want.numpy(), rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("dev", DEVICES)
def test_accumulate_attention_on_the_device_matches_the_cpu_op(dev):
    """accumulate_attention on the device (on CUDA: attention_rows and the
    grouped statistics op, four launches from one call) writes the causal
    mask as the CPU does, and per head the rows the CPU op writes: counts,
    extrema and bins exactly, sums within float32 rounding; no host sync."""
    x = attention_tile(6, (2, 6, 40, 700), peaked=True)
    hist = Histogram.log2()
    width = _layout.HEADER + hist.nbins
    rows = [list(range(m * 6, m * 6 + 6)) for m in range(3)]
    rows[2][4] = -1
    want = torch.zeros(1, 18, width, dtype=torch.int64)
    want_x = x.clone()
    _ops.reset_slot(want, new_state("cpu"))
    _ops.accumulate_attention(want_x, 600, want, new_state("cpu"), *rows, hist)
    d = device_of(dev)
    got, got_x, state = want.new_zeros(want.shape).to(d), x.to(d), new_state(d)
    _ops.reset_slot(got, state)
    with no_sync(dev):
        _ops.accumulate_attention(got_x, 600, got, state, *rows, hist)
    np.testing.assert_array_equal(torch.isneginf(got_x).cpu().numpy(), torch.isneginf(want_x).numpy())
    got = got.cpu()
    exact = [getattr(_layout, c) for c in ("COUNT", "NAN", "POSINF", "NEGINF", "ZEROS", "MIN", "MAX", "ABSMAX",
                                           "CALLS")]
    np.testing.assert_array_equal(got[0][:, exact].numpy(), want[0][:, exact].numpy())
    np.testing.assert_array_equal(got[0][:, _layout.HEADER:].numpy(), want[0][:, _layout.HEADER:].numpy())
    for r in range(18):
        gs, ws = (_layout.decode(t[0, r].numpy()) for t in (got, want))
        scale = float(ws["count"]) * float(ws["absmax"])  # a bound of the sum of |x|
        np.testing.assert_allclose(float(gs["sum"]), float(ws["sum"]), rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 48])  # scale 1/8 (exact in 16 bits) and 1/sqrt(48) (applied in float32)
@pytest.mark.parametrize("mask", [False, True], ids=["is_causal", "padding_mask"])
def test_attention_of_16_bit_queries_matches_float64(dev, dtype, head_dim, mask, monkeypatch):
    """16-bit q and k (on a GPU: the tensor-core product with float32
    output, the scale on the queries where it is a power of two), causal
    with grouped heads, through is_causal or an additive mask that also
    pads the second sequence, in tiles of 40 query rows: per head, the max
    and min logit, logsumexp range and entropy equal float64 of the same
    16-bit values within 1e-5, and every logit is counted once."""
    import torch.nn.functional as F

    import hookcap._capture.attention as att

    for name in ("TILE_VALUES", "CUDA_TILE_VALUES"):
        monkeypatch.setattr(att, name, 2 * 8 * 300 * 40)
    torch.manual_seed(0)
    q = (torch.randn(2, 8, 300, head_dim) * 2).to(dtype)
    k = (torch.randn(2, 2, 300, head_dim) * 2).to(dtype)
    add = None
    if mask:
        add = torch.ones(300, 300).tril().log().expand(2, 1, 300, 300).clone()  # causal, as -inf
        add[1, ..., -50:] = torch.finfo(torch.float32).min  # the second sequence padded

    class Attn(torch.nn.Module):
        def forward(self, q, k, v):
            if add is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=add.to(q.device, q.dtype), enable_gqa=True)

    model = torch.nn.ModuleDict({"0": Attn()})
    mon = hookcap.Monitor(model, capture=("attention",)).attach()
    qd, kd = q.to(device_of(dev)), k.to(device_of(dev))
    with no_sync(dev):
        model["0"](qd, kd, kd)
    mon.step()
    mon.detach()
    h = mon.history()
    ref = attention_reference(q, k, None if add is None else add.to(dtype), add is None)
    got = lambda m, s: h.groups(f"0/attn.{m}", s)[0]  # noqa: E731
    np.testing.assert_allclose(got("logit", "max"), ref["max"].numpy(), rtol=1e-5)
    np.testing.assert_allclose(got("logit", "min"), ref["min"].numpy(), rtol=1e-5)
    np.testing.assert_allclose(got("lse", "max"), ref["lse_max"].numpy(), rtol=1e-5)
    np.testing.assert_allclose(got("lse", "min"), ref["lse_min"].numpy(), rtol=1e-5)
    np.testing.assert_allclose(got("entropy", "mean"), ref["ent_mean"].numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got("logit", "finite"), ref["finite"].numpy())
    np.testing.assert_array_equal(got("logit", "neginf"), ref["neginf"].numpy())  # hidden keys too
    np.testing.assert_array_equal(got("logit", "count"), ref["count"].numpy())


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["causal_gqa", "cross", "hf_layout", "more_queries"])
def test_attention_on_chip_equals_the_tiles_and_float64(dtype, case):
    """16-bit q and k with no mask or a causal one take hookcap::attention_qk
    (one call, no tiles, no host sync): on inputs whose logits are exact in
    float32 every head's logit row equals the tiles' (counts, extrema and
    bins exactly, sums to rounding) and float64's, and logsumexp and
    entropy equal float64 within 1e-5."""
    import torch.nn.functional as F

    import hookcap._capture.attention as att
    from conftest import CountOps

    b, h, hk, tq, tk, d, causal = {"causal_gqa": (2, 8, 2, 300, 300, 64, True),
                                   "cross": (2, 4, 4, 33, 517, 128, False),
                                   "hf_layout": (2, 12, 12, 200, 200, 64, True),
                                   "more_queries": (1, 2, 1, 150, 70, 32, True)}[case]
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-4, 5, (b, tq, h, d), generator=g).float().div(4).to(dtype)
    q = q.transpose(1, 2) if case == "hf_layout" else q.transpose(1, 2).contiguous()
    k = torch.randint(-4, 5, (b, hk, tk, d), generator=g).float().div(4).to(dtype)

    class Attn(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hk != h)

    def run(on_chip):
        att.ON_CHIP = on_chip
        model = torch.nn.ModuleDict({"0": Attn()})
        mon = hookcap.Monitor(model, capture=("attention",), histogram=Histogram.log2()).attach()
        qd, kd = q.cuda(), k.cuda()
        try:
            with CountOps() as ops, no_sync("cuda"):
                model["0"](qd, kd, kd)
        finally:
            att.ON_CHIP = True
        mon.step()
        mon.detach()
        return mon.history(), ops.calls

    h_chip, calls = run(True)
    assert calls["attention_qk"] == 1 and calls["accumulate_attention"] == 0
    h_tiles, _ = run(False)
    ref = attention_reference(q, k, None, causal)
    for i in range(h):
        name = f"0/attn.logit[{i}]"
        for stat in ("count", "finite", "neginf", "max", "min", "zeros"):
            assert h_chip[stat][0, h_chip.column(name)] == h_tiles[stat][0, h_tiles.column(name)], (name, stat)
        for stat in ("sum", "std"):
            np.testing.assert_allclose(h_chip[stat][0, h_chip.column(name)], h_tiles[stat][0, h_tiles.column(name)],
                                       rtol=1e-9, atol=1e-9)
        np.testing.assert_array_equal(h_chip.histogram(name)[0], h_tiles.histogram(name)[0])
    got = lambda m, s: h_chip.groups(f"0/attn.{m}", s)[0]  # noqa: E731
    np.testing.assert_allclose(got("logit", "max"), ref["max"].numpy(), rtol=1e-6)  # scale rounded in float32
    np.testing.assert_array_equal(got("logit", "count"), ref["count"].numpy())
    np.testing.assert_allclose(got("lse", "max"), ref["lse_max"].numpy(), rtol=1e-5)
    np.testing.assert_allclose(got("lse", "min"), ref["lse_min"].numpy(), rtol=1e-5)
    np.testing.assert_allclose(got("entropy", "mean"), ref["ent_mean"].numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got("entropy", "min"), ref["ent_min"].numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dev", DEVICES)
def test_attention_router_and_channels_record_without_a_sync(dev):
    """A step with capture "attention" and "router", Channels and a bins tap
    runs its forward and backward with no host sync on CUDA, and records
    what the CPU records for the same model and input."""
    torch.manual_seed(0)

    class Router(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(32, 4)

        def forward(self, a):
            logits = self.gate(a.reshape(-1, 32))
            w, idx = torch.topk(logits.softmax(-1), 2, dim=-1)
            hookcap.tap(idx, "choice", bins=4, weights=w)
            return logits, w, idx

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(32, 96)
            self.router = Router()
            self.out = torch.nn.Linear(32, 32)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, 4, 8).permute(2, 0, 3, 1, 4)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            a = a.transpose(1, 2).reshape(b, t, 32)
            return self.out(a), self.router(a)

    def run(device):
        torch.manual_seed(0)
        model = Block().to(device)
        mon = hookcap.Monitor(model, capture=("output", "attention", "router"),
                              groups={"out/output": hookcap.Channels(top=2)}).attach()
        x = torch.randn(2, 16, 32, device=device)
        for _ in range(2):  # the second step is steady state: its rows exist
            with no_sync(device if device == "cuda" else "cpu"):
                out, _ = model(x)
                out.sum().backward()
            mon.step()
        mon.detach()
        return mon.history()

    h = run(device_of(dev))
    ref = run("cpu")
    assert sorted(h.names) == sorted(ref.names)
    for name in ("./attn.logit", "router/router.z", "router/router.entropy", "router/router.load",
                 "out/output.top_over_median", "choice"):
        for stat in ("count", "max", "mean"):
            np.testing.assert_allclose(h[stat][:, h.column(name)], ref[stat][:, ref.column(name)], rtol=1e-4,
                                       err_msg=f"{name} {stat}")
    np.testing.assert_array_equal(h.groups("choice", "count"), ref.groups("choice", "count"))


@pytest.mark.parametrize("dev", DEVICES)
def test_skip_step_decides_and_skips_without_a_sync(dev):
    """SkipStep with a fused AdamW: the steady-state steps (decision, window,
    found_inf, the skip record) run with no host sync on CUDA, and a planted
    spike is skipped as on the CPU."""

    def run(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        guard = hookcap.SkipStep(window=8, warmup=4)
        mon = hookcap.Monitor(model, capture=("output",), optimizer=opt, skip=guard).attach()
        g = torch.Generator().manual_seed(1)
        xs = [torch.randn(64, 8, generator=g) for _ in range(12)]
        xs[10] = xs[10] * 1e3
        for i, x in enumerate(xs):
            with no_sync(device if (device == "cuda" and i >= 2) else "cpu"):  # step 0 makes the state
                loss = model(x.to(device)).pow(2).mean()
                hookcap.tap(loss, "loss")
                loss.backward()
                opt.step()
                opt.zero_grad()
        mon.detach()
        return guard.steps(), [p.detach().cpu() for p in model.parameters()]

    steps, params = run(device_of(dev))
    ref_steps, ref_params = run("cpu")
    assert steps == ref_steps == [10]
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("moments", [2, 4])
def test_many_tensors_on_the_device(dev, moments):
    """accumulate_many on the tensors' device (on a GPU: several many-tensor
    launches, tensors of four dtypes and sizes across grid buckets, a
    transposed and a float8 one alone): each row holds the CPU op's
    accumulate of that tensor alone (counts, extrema, bins exactly) and
    float64's sums; rows given as -1 are not written."""
    g = torch.Generator().manual_seed(3)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
    xs = [(torch.randn(n, generator=g) * 4).to(dtypes[i % 4]) for i, n in enumerate(
        [0, 1, 7, 300, 4099, 70_000, 1_000_003, 3_000_000] + [int(k) * 37 for k in range(1, 41)])]
    xs[5][17] = float("nan")
    xs[6][5] = float("-inf")
    xs += [torch.randn(300, 70, generator=g).t(), torch.randn(1000, generator=g).to(torch.float8_e4m3fn)]
    rows = [i if i % 9 != 4 else -1 for i in range(len(xs))]
    h = Histogram.log2()
    width = _layout.HEADER + h.nbins
    ring = torch.zeros(1, len(xs), width, dtype=torch.int64, device=device_of(dev))
    _ops.reset_slot(ring, new_state(device_of(dev)))
    _ops.accumulate_many([x.to(device_of(dev)) for x in xs], ring, new_state(device_of(dev)), rows, h, moments)
    got = ring.cpu().numpy()
    exact = [getattr(_layout, c) for c in ("COUNT", "NAN", "POSINF", "NEGINF", "ZEROS", "MIN", "MAX", "ABSMAX",
                                           "CALLS")]
    for i, (x, r) in enumerate(zip(xs, rows)):
        if r < 0:
            assert got[0, i, _layout.CALLS] == 0
            continue
        one = torch.zeros(1, 1, width, dtype=torch.int64)
        _ops.reset_slot(one, new_state("cpu"))
        _ops.accumulate(x, one, new_state("cpu"), 0, h, moments)
        np.testing.assert_array_equal(got[0, i, exact], one[0, 0, exact].numpy(), err_msg=str(i))
        np.testing.assert_array_equal(got[0, i, _layout.HEADER:], one[0, 0, _layout.HEADER:].numpy())
        dec = {k: float(v) for k, v in _layout.decode(got[0, i]).items()}
        dec["hist"], dec["bin_edges"] = got[0, i, _layout.HEADER:], h.bin_edges
        assert_stats_match(dec, hookcap.reference.tensor_stats(x, h), abs_sum=abs_sum(x))
