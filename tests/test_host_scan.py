"""The host's pass over a finished slot (csrc/host_pack.cpp): the band of each
row found from the bin-count rule equals a full scan, the column statistics
equal numpy's, and the reset after reading leaves every row exactly as the
kernels' reset does, so advance() may leave those rows alone."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hookcap
from hookcap import Histogram, _C, _layout, _ops
from hookcap.functional import new_state

H = _layout.HEADER
HISTS = [Histogram.log2(), Histogram.log2(-4, 3), Histogram.linear(-2.0, 3.0, 7), Histogram.linear(0.0, 1e-3, 1)]
SPECIAL = [0.0, -0.0, float("nan"), float("inf"), float("-inf"), 1e-45, -3e-39, 3e38, 2.0 ** -70, 2.0 ** 70]


def _values(data, n):
    """float64 values: normal, tiny, huge, zeros and non-finite mixed."""
    base = np.asarray(data.draw(st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=64), min_size=n, max_size=n)))
    picks = data.draw(st.lists(st.sampled_from(SPECIAL), max_size=6))
    scale = data.draw(st.sampled_from([1.0, 1e-30, 1e-3, 1e20]))
    return np.concatenate([base * scale, picks])


def _kernel_slot(data, hist, rows=6):
    """A slot written by the CPU kernel: each row gets 0..3 writes of random
    tensors in several dtypes (row 0 is never written)."""
    width = H + hist.nbins
    ring = torch.empty((1, rows, width), dtype=torch.int64)
    st_ = new_state("cpu")
    _ops.reset_slot(ring, st_)
    for r in range(1, rows):
        for _ in range(data.draw(st.integers(0, 3))):
            v = _values(data, data.draw(st.integers(0, 40)))
            dtype = data.draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]))
            with np.errstate(over="ignore"):
                _ops.accumulate(torch.from_numpy(v).to(dtype), ring, st_, r, hist)
    return ring


def _scan(rows, zero_bin, hist_args):
    k = rows.shape[0]
    head, first, lens = np.empty((H, k), np.int64), np.empty(k, np.int64), np.empty(k, np.int64)
    colstat = np.empty((H, 3), np.int64)
    out = _C._rows_scan(rows, zero_bin, *hist_args, head, first, lens, colstat)
    return out, head, first, lens, colstat


def _full_band(rows, skip0):
    """Reference: first and last non-empty bin of each row, by numpy."""
    bins = rows[:, H:]
    lo = 1 if skip0 else 0
    first, lens = [], []
    for b in bins:
        nz = np.flatnonzero(b[lo:]) + lo
        first.append(nz[0] if len(nz) else 0)
        lens.append(nz[-1] - nz[0] + 1 if len(nz) else 0)
    return np.array(first), np.array(lens)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), hi=st.integers(0, len(HISTS) - 1))
def test_band_from_counts_equals_full_scan(data, hi):
    hist = HISTS[hi]
    rows = _kernel_slot(data, hist)[0].numpy()
    zero_bin = hist.kind == "log2"
    fast = _scan(rows, zero_bin, hist.op_args())
    full = _scan(rows, zero_bin, (-1, 0.0, 0.0, 0))
    assert fast[0][:4] == full[0][:4]
    for a, b in zip(fast[1:], full[1:]):
        assert np.array_equal(a, b)
    (skip0, total, cmax, cmin, whole), head, first, lens, colstat = fast
    assert whole == 0  # every kernel row's band was found from its counts

    assert skip0 == zero_bin  # the kernels' zero bin always equals the zeros count
    ref_first, ref_lens = _full_band(rows, skip0)
    assert np.array_equal(first, ref_first) and np.array_equal(lens, ref_lens)
    assert total == ref_lens.sum()
    assert np.array_equal(head, rows[:, :H].T)
    assert np.array_equal(colstat[:, 0], rows[:, :H].min(axis=0))
    assert np.array_equal(colstat[:, 1], rows[:, :H].max(axis=0))


def test_band_rule_broken_falls_back_to_full_scan():
    """A row whose bins do not sum to its binned count (not a kernel row) is
    scanned whole: the band is still exact."""
    hist = Histogram.log2()
    rows = np.zeros((3, H + hist.nbins), np.int64)
    rows[:, _layout.COUNT] = 5
    rows[0, H + 100] = 5  # above the bin of its (reset, -inf) abs-max: start is the top
    rows[1, H + 3], rows[1, H + 120] = 2, 9  # sums to 11, not 5
    rows[2, H + 40] = 2  # sums to 2, not 5
    (_, total, _, _, whole), _, first, lens, _ = _scan(rows, False, hist.op_args())
    assert first.tolist() == [100, 3, 40] and lens.tolist() == [1, 118, 1] and total == 120
    assert whole == 3


def test_column_flags():
    rows = np.zeros((4, H), np.int64)
    rows[:, _layout.S1] = np.array([1.5, 2.25, -3.0, 0.0]).view(np.int64)
    rows[:, _layout.S2] = np.array([1.5, 0.1, 0.0, 0.0]).view(np.int64)  # 0.1 is no float32
    mn, mx = np.array([-1.0, 0.5, -4.0, 0.0]), np.array([2.0, 0.5, 3.0, 0.0])
    rows[:, _layout.MIN] = _layout.order_key(mn)
    rows[:, _layout.MAX] = _layout.order_key(mx)
    rows[:, _layout.ABSMAX] = _layout.order_key(np.maximum(-mn, mx))
    _, _, _, _, colstat = _scan(rows, False, (-1, 0.0, 0.0, 0))
    flags = colstat[:, 2]
    assert flags[_layout.S1] == 1 and flags[_layout.S2] == 0
    assert flags[_layout.MIN] == 2 and flags[_layout.MAX] == 2 and flags[_layout.ABSMAX] == 2 | 4
    rows[1, _layout.ABSMAX] = _layout.order_key(np.array([0.75]))[0]
    _, _, _, _, colstat = _scan(rows, False, (-1, 0.0, 0.0, 0))
    assert colstat[_layout.ABSMAX, 2] == 2


def _reset_reference(width, rows, tag):
    ring = torch.empty((1, rows, width), dtype=torch.int64)
    st_ = new_state("cpu")
    st_[0] = tag
    _ops.reset_slot(ring, st_)
    return ring[0].numpy()


@settings(max_examples=40, deadline=None)
@given(data=st.data(), hi=st.integers(0, len(HISTS) - 1), tag=st.integers(0, 10 ** 12))
def test_rows_reset_equals_kernel_reset(data, hi, tag):
    hist = HISTS[hi]
    rows = _kernel_slot(data, hist)[0].numpy()
    # A timing-style row: header values that follow no histogram rule.
    rows[0, :H] = np.arange(H) * 12345 - 7
    _C._rows_reset(rows, *hist.op_args(), tag)
    assert np.array_equal(rows, _reset_reference(rows.shape[1], rows.shape[0], tag))


def test_rows_reset_without_histogram():
    rows = np.arange(5 * H, dtype=np.int64).reshape(5, H)
    _C._rows_reset(rows, 0, 0.0, 0.0, 0, 42)
    assert np.array_equal(rows, _reset_reference(H, 5, 42))


def test_cpu_advance_skips_rows_already_reset_for_its_step():
    hist = Histogram.log2()
    ring = torch.empty((2, 3, H + hist.nbins), dtype=torch.int64)
    st_ = new_state("cpu")
    _ops.reset_slot(ring, st_)  # step 0, slot 0
    ring[1] = 99  # slot 1: dirty
    ring[1, 1, _layout.STEP_TAG] = 1  # ...but row 1 claims to be reset for step 1
    _ops.advance(ring, st_, 1)  # opens step 1 in slot 1
    ref = _reset_reference(ring.shape[2], 3, 1)
    assert np.array_equal(ring[1, 0].numpy(), ref[0]) and np.array_equal(ring[1, 2].numpy(), ref[2])
    assert (ring[1, 1, H:] == 99).all()  # left alone: only a reset writes the tag


def test_ring_opens_a_slot_the_host_reset_without_visiting_it():
    """DeviceRing.reset_read marks the slot reset for its next step; advance()
    then only moves the state (as the op would), and a grown ring forgets it."""
    from hookcap._rows.ring import DeviceRing
    hist = Histogram.log2()
    args = hist.op_args()
    ring = DeviceRing(torch.device("cpu"), slots=2, width=H + hist.nbins, rows=4)
    ring.ring[1] = 7  # slot 1 written (step 1 will be read from it)
    ring.advance(True, 1)  # step 1, slot 1
    assert ring.state.tolist() == [1, 1, 1]
    ring.ring[1] = 7
    ring.reset_read(ring._host_view[1], args, 3)  # read step 1: slot 1 next holds step 3
    assert np.array_equal(ring.ring[1].numpy(), _reset_reference(H + hist.nbins, 4, 3))
    ring.advance(True, 0)  # step 2, slot 0 (the op resets it)
    ring.ring[1, 2, H + 5] = 99  # a planted value no reset would leave
    ring.advance(True, 1)  # step 3, slot 1: opened without visiting its rows
    assert ring.state.tolist() == [3, 1, 1]
    assert ring.ring[1, 2, H + 5] == 99
    ring.reset_read(ring._host_view[1], args, 5)
    for _ in range(4):
        ring.add_row(0)
    ring.add_row(0)  # grows the ring: its new rows are unknown
    ring.advance(True, 0)
    ring.ring[1, 10, H + 5] = 99  # a new row (unknown content)
    ring.advance(True, 1)  # step 5, slot 1: reset by the op
    assert ring.state.tolist() == [5, 1, 1]
    assert ring.ring[1, 10, H + 5] == 0


@pytest.mark.parametrize("every", [1, 3])
@pytest.mark.parametrize("resume_after", [1, 2, 9])
def test_monitor_values_through_host_reset_growth_and_resume(every, resume_after):
    """Steps recorded through slots the host reset (and opened without visiting
    their rows), a ring that grows mid-run (70 layers first run at step 9,
    past the ring's 64 rows) and a step counter moved back (load_state_dict
    ``resume_after`` steps after the save) all give the float64 statistics of
    the captured outputs."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 6),
                                 "b": torch.nn.Sequential(*[torch.nn.Linear(6, 6) for _ in range(70)])})
    mon = hookcap.Monitor(model, capture=("output",), every=every).attach()
    refs = []  # (step, {metric: float64 output}) in recording order

    def run(steps):
        for i in steps:
            x = torch.randn(5, 4) * (1 + i % 4)
            y = model["a"](x)
            out = {"a/output": y.detach().double()}
            if i >= 9:
                for j, layer in enumerate(model["b"]):
                    y = layer(y)
                    out[f"b.{j}/output"] = y.detach().double()
            if i % every == 0:
                refs.append((i, out))
            mon.step()

    run(range(0, 21))
    state = mon.state_dict()
    run(range(21, 21 + resume_after))
    mon.load_state_dict(state)  # back to step 21: steps 21.. are recorded again
    run(range(21, 40))
    h = mon.history()
    assert h.steps.tolist() == [i for i, _ in refs]  # steps 21.. twice: before and after the resume
    assert len(h.names) == 71
    for row, (_, out) in enumerate(refs):
        for col, name in enumerate(h.names):
            ref = out.get(name)
            if ref is None:
                assert np.isnan(h["max"][row, col])
                continue
            assert h["max"][row, col] == ref.max().item()
            assert h["min"][row, col] == ref.min().item()
            # float32 sums: error relative to the mean magnitude (means cancel)
            assert np.isclose(h["mean"][row, col], ref.mean().item(), rtol=0, atol=1e-6 * ref.abs().mean().item())
            assert h["count"][row, col] == ref.numel()
    mon.detach()
