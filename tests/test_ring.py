"""Ring semantics of the ops: merging repeated writes, device-side slot
selection, the enabled flag, reset and advance; thread-count determinism."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import abs_sum, assert_stats_match

import hookcap
from hookcap import Histogram, _layout, _ops
from hookcap.functional import new_state

H = Histogram.log2()


def make_ring(slots, rows, histogram=H):
    width = _layout.HEADER + (histogram.nbins if histogram else 0)
    ring = torch.full((slots, rows, width), -7, dtype=torch.int64)  # garbage until reset
    return ring


def row_stats(ring, slot, row, histogram=H):
    raw = ring[slot, row].numpy()
    out = {k: float(v) for k, v in _layout.decode(raw).items()}
    if histogram is not None:
        out["hist"] = raw[_layout.HEADER:].copy()
        out["bin_edges"] = histogram.bin_edges
    return out


def test_repeated_writes_merge_like_concatenation():
    ring = make_ring(1, 2)
    st = new_state("cpu")
    _ops.reset_slot(ring, st)
    parts = [torch.randn(1000) * 3 + 1, torch.randn(17, 5).t(), torch.tensor([float("nan"), 0.0, -1e-3]),
             torch.randn(40000, dtype=torch.float64).to(torch.bfloat16)]
    for p in parts:
        _ops.accumulate(p, ring, st, 1, H)
    flat = torch.cat([p.reshape(-1).double() for p in parts])
    ref = hookcap.reference.stats_from_values(flat.numpy(), H)
    assert_stats_match(row_stats(ring, 0, 1), ref, abs_sum=abs_sum(flat))
    assert ring[0, 1, _layout.CALLS] == len(parts)
    # Row 0 untouched: still empty.
    assert row_stats(ring, 0, 0)["count"] == 0


def test_merge_keeps_std_when_means_differ_between_writes():
    ring = make_ring(1, 1, None)
    st = new_state("cpu")
    _ops.reset_slot(ring, st)
    a = torch.randn(100_000) + 1000.0
    b = torch.randn(100_000) * 2 - 500.0
    _ops.accumulate(a, ring, st, 0, None)
    _ops.accumulate(b, ring, st, 0, None)
    flat = torch.cat([a, b]).double()
    ref = hookcap.reference.stats_from_values(flat.numpy(), None)
    assert_stats_match(row_stats(ring, 0, 0, None), ref, rtol_std=1e-7)


def test_slot_comes_from_device_state():
    ring = make_ring(4, 1)
    for slot in range(4):
        _ops.reset_slot(ring, torch.tensor([0, 1, slot]))
    st = torch.tensor([5, 1, 2])
    _ops.accumulate(torch.ones(10), ring, st, 0, H)
    counts = [row_stats(ring, s, 0)["count"] for s in range(4)]
    assert counts == [0, 0, 10, 0]


def test_disabled_state_writes_nothing():
    ring = make_ring(1, 1)
    st = new_state("cpu")
    _ops.reset_slot(ring, st)
    before = ring.clone()
    st[1] = 0
    _ops.accumulate(torch.randn(100), ring, st, 0, H)
    assert torch.equal(ring, before)


def test_reset_initialises_every_cell():
    ring = make_ring(3, 2)
    st = torch.tensor([9, 1, 1])
    _ops.reset_slot(ring, st)
    assert (ring[0] == -7).all() and (ring[2] == -7).all()
    s = row_stats(ring, 1, 0)
    assert s["count"] == 0 and s["hist"].sum() == 0
    assert ring[1, 0, _layout.STEP_TAG] == 9 and ring[1, 1, _layout.SHIFT] == _layout.SHIFT_UNSET


@pytest.mark.parametrize("every", [1, 3])
def test_advance_cadence_and_slots(every):
    slots = 4
    ring = make_ring(slots, 1)
    st = new_state("cpu")
    _ops.reset_slot(ring, st)
    recorded = []
    for step in range(13):
        assert int(st[0]) == step
        enabled = bool(st[1])
        assert enabled == (step % every == 0)
        _ops.accumulate(torch.full((step + 1,), float(step)), ring, st, 0, H)
        if enabled:
            recorded.append(step)
            slot = int(st[2])
            assert slot == (len(recorded) - 1) % slots
            s = row_stats(ring, slot, 0)
            assert s["count"] == step + 1 and s["max"] == step
            assert ring[slot, 0, _layout.STEP_TAG] == step
        _ops.advance(ring, st, every)
    assert recorded == [s for s in range(13) if s % every == 0]


def test_advance_rejects_bad_every():
    ring = make_ring(2, 1)
    with pytest.raises(RuntimeError, match="every must be >= 1"):
        _ops.advance(ring, new_state("cpu"), 0)


_DETERMINISM = """
import sys, torch, hookcap
torch.set_num_threads(int(sys.argv[1]))
g = torch.Generator().manual_seed(3)
x = torch.randn(3_000_001, generator=g) * 5 + 2
s = hookcap.tensor_stats(x)
print(repr((s["sum"], s["sumsq"], s["std"], s["hist"].tolist())))
"""


def test_results_bitwise_identical_for_any_thread_count():
    outs = [
        subprocess.run([sys.executable, "-c", _DETERMINISM, str(t)], capture_output=True, text=True,
                       check=True).stdout
        for t in (1, 2)
    ]
    assert outs[0] == outs[1] and outs[0]


_BASELINE = """
import torch, hookcap, numpy as np, json
g = torch.Generator().manual_seed(4)
x = torch.randn(200_003, generator=g, dtype=torch.float64)
x[::97] = float("nan"); x[::101] = 0.0
for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
    y = x.to(dt)
    for h in (hookcap.Histogram.log2(), hookcap.Histogram.linear(-2, 2, 9)):
        got, ref = hookcap.tensor_stats(y, h), hookcap.reference.tensor_stats(y, h)
        assert (got["hist"] == ref["hist"]).all()
        for k in ("count", "nan", "zeros", "min", "max", "absmax"):
            assert got[k] == ref[k], (k, got[k], ref[k])
        for k in ("sumsq", "std"):
            assert abs(got[k] / ref[k] - 1) < 1e-5, (k, got[k], ref[k])
print(hookcap.build_info()["cpu_isa"])
"""


def test_baseline_isa_path_matches_reference():
    """The non-AVX2 build of the CPU loop (chosen on old CPUs) is correct too."""
    env = dict(__import__("os").environ, HOOKCAP_CPU_ISA="baseline")
    out = subprocess.run([sys.executable, "-c", _BASELINE], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "baseline"


def test_tensor_stats_row_matches_ring_decode():
    x = torch.randn(999)
    s = hookcap.tensor_stats(x)
    ring = make_ring(1, 1)
    st = new_state("cpu")
    _ops.reset_slot(ring, st)
    _ops.accumulate(x, ring, st, 0, H)
    r = row_stats(ring, 0, 0)
    for k in _layout.STAT_NAMES:
        assert s[k] == r[k] or (np.isnan(s[k]) and np.isnan(r[k])), k


def test_reset_rows_replaces_one_row_only():
    ring = make_ring(2, 3)
    st = new_state("cpu")
    _ops.reset_slot(ring, st)
    for r in range(3):
        _ops.accumulate(torch.full((r + 2,), 1.0), ring, st, r, H)
    _ops.reset_rows(ring, st, 1, 2)
    _ops.accumulate(torch.full((7,), -1.0), ring, st, 1, H)
    counts = [row_stats(ring, 0, r)["count"] for r in range(3)]
    assert counts == [2, 7, 4] and row_stats(ring, 0, 1)["max"] == -1.0
    with pytest.raises(RuntimeError, match="out of range"):
        _ops.reset_rows(ring, st, 0, 4)


def test_cuda_advance_waits_only_for_the_copy_of_the_slot_it_resets():
    """advance() on a CUDA ring makes the training stream wait for an
    in-flight host copy only when that copy's slot is the one it resets."""
    from hookcap._rows.ring import _Pending, copies_to_wait

    pending = [_Pending(step=s, slot=s % 4, nrows=1, host=None, event=object()) for s in (5, 6, 7)]
    assert [p.step for p in copies_to_wait(pending, True, 1)] == [5]
    assert copies_to_wait(pending, True, 0) == []  # nothing in flight for slot 0
    assert copies_to_wait(pending, False, 1) == []  # an off-step resets nothing
    done = _Pending(step=9, slot=1, nrows=1, host=None)  # a CPU entry: no copy
    assert copies_to_wait([done], True, 1) == []


@pytest.mark.parametrize("histogram", [H, None])
def test_retired_ring_rows_fold_into_the_slot_as_one_row(histogram):
    """A CUDA graph captured before the ring grew keeps writing the old ring:
    fold_retired merges those rows into the new ring's (same row index) as
    if every write had gone into one row, rows the old ring lacks untouched."""
    from hookcap._rows.ring import fold_retired

    st = new_state("cpu")
    new, old, one = make_ring(1, 3, histogram), make_ring(1, 2, histogram), make_ring(1, 3, histogram)
    for r in (new, old, one):
        _ops.reset_slot(r, st)
    g = torch.Generator().manual_seed(3)
    writes = [(new, 0, torch.randn(500, generator=g) + 40), (old, 0, torch.randn(300, generator=g) * 1e3),
              (old, 1, torch.tensor([float("nan"), 0.0, 2.5])), (new, 2, torch.randn(64, generator=g)),
              (old, 0, torch.randn(7, 9, generator=g).t())]
    for ring, row, x in writes:
        _ops.accumulate(x, ring, st, row, histogram)
        _ops.accumulate(x, one, st, row, histogram)
    folded = fold_retired(new[0].numpy().copy(), [old[0].numpy().copy()])
    for row in range(3):
        values = torch.cat([x.reshape(-1).double() for _, r, x in writes if r == row] or [torch.empty(0)])
        want = one[0, row].numpy()
        exact = [c for c in range(folded.shape[1]) if c not in (_layout.SUM, _layout.SUMSQ, _layout.S1, _layout.S2, _layout.SHIFT)]
        np.testing.assert_array_equal(folded[row, exact], want[exact])
        got = {k: float(v) for k, v in _layout.decode(folded[row]).items()}
        if histogram is not None:
            got["hist"], got["bin_edges"] = folded[row, _layout.HEADER:], histogram.bin_edges
        ref = hookcap.reference.stats_from_values(values.numpy(), histogram)
        assert_stats_match(got, ref, abs_sum=abs_sum(values))
    rows = new[0].numpy()
    assert fold_retired(rows, []) is rows  # nothing retired: the rows as they are


def test_growth_beside_a_kept_ring_counts_each_write_once():
    """A ring a CUDA graph captured is kept (and folded into each drained
    slot) when it grows: the new buffer starts with its rows reset, so the
    step's writes before the growth are counted once, from the old buffer.
    Without a kept ring, the rows are copied and the new ones reset."""
    from hookcap._rows.ring import fold_retired, grow_ring

    st = new_state("cpu")
    st[2] = 1  # the current slot is 1 of 2
    old = make_ring(2, 2)
    _ops.reset_slot(old, st)
    g = torch.Generator().manual_seed(5)
    before = [torch.randn(300, generator=g) * 2, torch.randn(40, generator=g) + 7]
    after = torch.randn(100, generator=g)
    for row, x in enumerate(before):
        _ops.accumulate(x, old, st, row, H)

    kept = grow_ring(old, st, 5, keep_old=True)
    assert kept.shape == (2, 5, old.shape[2])
    _ops.accumulate(after, kept, st, 0, H)  # eager writes go to the new buffer
    folded = fold_retired(kept[1].numpy().copy(), [old[1].numpy().copy()])
    for row, values in enumerate([torch.cat([before[0], after]), before[1]]):
        got = {k: float(v) for k, v in _layout.decode(folded[row]).items()}
        got["hist"], got["bin_edges"] = folded[row, _layout.HEADER:], H.bin_edges
        ref = hookcap.reference.stats_from_values(values.double().numpy(), H)
        assert_stats_match(got, ref, abs_sum=abs_sum(values))
    assert (folded[2:, _layout.COUNT] == 0).all()

    copied = grow_ring(old, st, 5, keep_old=False)
    np.testing.assert_array_equal(copied[:, :2].numpy(), old.numpy())
    assert (copied[1, 2:, _layout.COUNT] == 0).all()  # new rows of the current slot: reset


def test_state_is_made_and_set_on_the_device_without_a_host_copy():
    """No copy from host memory (a sync, and not allowed in a CUDA graph
    capture): the state is made and set by device factories and fills."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hookcap._rows.ring import fill_state

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        st = new_state("meta")
        fill_state(st, 5, True, 2)
    copies = [n for n in ops.names if n.split(".")[0] in ("lift_fresh", "lift_fresh_copy", "_to_copy", "copy_")]
    assert ops.names and not copies, ops.names
    st = new_state("cpu")
    assert st.tolist() == [0, 1, 0]
    fill_state(st, 5, False, 2)
    assert st.tolist() == [5, 0, 2]


def test_released_captured_buffers_are_parked_for_the_process():
    """A buffer a CUDA graph captured (the registry's predicate) is kept when
    its ring is released, so the graph's replays never write into memory
    another tensor reuses; the others are let go."""
    from hookcap._rows import ring as _ring

    bufs = [torch.zeros(3, dtype=torch.int64) for _ in range(3)]
    captured = {bufs[0].data_ptr(), bufs[2].data_ptr()}
    before = len(_ring._PARKED)
    assert _ring.park_captured(bufs, lambda p: p in captured) == 2
    parked = _ring._PARKED[before:]
    assert len(parked) == 2 and parked[0] is bufs[0] and parked[1] is bufs[2]
    del _ring._PARKED[before:]
    assert _ring.park_captured(bufs, lambda p: False) == 0 and len(_ring._PARKED) == before
