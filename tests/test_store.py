"""The host history store: lossless compact encoding (hookcap._host.pack), the
capacity in steps or bytes, and the streamed history file."""

import json
import os

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import hookcap
import hookcap._host.drain
from hookcap import Monitor, _layout
from hookcap._host.pack import CONST, F32, KEY32, RAW, U8, U16, pack
from hookcap.reference import tensor_stats

L = _layout
H = L.HEADER


def _key(v):
    return L.order_key(np.asarray(v, dtype=np.float64))


def _rows(draw, k: int, nb: int) -> np.ndarray:
    """Random raw rows: each header column drawn from one of the shapes the
    encoder distinguishes (constant, small or huge ints, float32-exact or
    arbitrary doubles, NaN payloads, +-0, infinities), histograms sparse."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows = np.zeros((k, H + nb), dtype=np.int64)
    for c in range(H):
        shape = draw(st.sampled_from(["const", "small", "wide", "huge", "neg", "f32", "f64", "special"]))
        if shape == "const":
            v = np.full(k, rng.integers(-2**62, 2**62))
        elif shape == "small":
            v = 1000 + rng.integers(0, 200, k)
        elif shape == "wide":
            v = rng.integers(0, 2**31, k)
        elif shape == "huge":
            v = rng.integers(-2**63, 2**63 - 1, k, dtype=np.int64)
        elif shape == "neg":
            v = -rng.integers(0, 70000, k)
        elif shape == "f32":
            v = rng.standard_normal(k).astype(np.float32).astype(np.float64).view(np.int64)
        elif shape == "f64":
            v = rng.standard_normal(k).view(np.int64)
        else:
            pool = np.array([0.0, -0.0, np.inf, -np.inf, 1e300, 5e-324, 1.5], dtype=np.float64).view(np.int64)
            v = np.concatenate([pool, [L.SHIFT_UNSET]])[rng.integers(0, 8, k)]
        if c in (L.MIN, L.MAX, L.ABSMAX) and shape in ("f32", "f64", "special"):
            v = _key(v.view(np.float64))
        rows[:, c] = v
    if draw(st.booleans()):  # a consistent abs-max, as the kernels write it
        mn, mx = L._unkey(rows[:, L.MIN]), L._unkey(rows[:, L.MAX])
        rows[:, L.ABSMAX] = _key(np.where(-mn > mx, -mn, mx))
    if nb:
        dense = rng.random((k, nb)) < draw(st.sampled_from([0.0, 0.05, 0.5]))
        counts = rng.integers(1, draw(st.sampled_from([2, 300, 70000, 2**40])), (k, nb))
        rows[:, H:] = np.where(dense, counts, 0)
        if draw(st.booleans()):
            rows[:, H] = rows[:, L.ZEROS]  # log2: bin 0 counts the zeros
    return rows


@given(data=st.data(), k=st.integers(0, 40), nb=st.sampled_from([0, 1, 5, 131, 300]),
       zero_bin=st.booleans(), timed=st.booleans())
def test_pack_round_trips_bit_for_bit(data, k, nb, zero_bin, timed):
    rows = _rows(data.draw, k, nb)
    rng = np.random.default_rng(k)
    metrics = rng.permutation(k).astype(np.int64)
    calls = np.concatenate([metrics, metrics[: k // 2]])
    bad = rng.random(len(calls)) < data.draw(st.sampled_from([0.0, 0.3]))
    time_ns = rng.standard_normal((k, 2)) if timed else None
    p = pack(7, metrics, rows, metrics, calls, bad, time_ns, zero_bin)
    np.testing.assert_array_equal(p.header(), rows[:, :H])
    lo, band = p.histogram()
    full = np.zeros((k, nb), dtype=np.int64)
    full[:, lo:lo + band.shape[1]] = band
    np.testing.assert_array_equal(full, rows[:, H:])
    np.testing.assert_array_equal(p.calls_nonfinite(), bad)
    assert p.any_nonfinite() == bool(bad.any() or rows[:, [L.NAN, L.POSINF, L.NEGINF]].any())
    if timed:
        np.testing.assert_array_equal(p.time_ns(), time_ns)
    else:
        assert p.time_ns() is None
    assert p.step == 7 and np.array_equal(p.metrics, metrics) and np.array_equal(p.calls, calls)


def test_pack_chooses_narrow_encodings():
    k = 50
    rows = np.zeros((k, H + 10), dtype=np.int64)
    rows[:, L.COUNT] = 4096
    rows[:, L.ZEROS] = np.arange(k)  # < 256: one byte
    rows[:, L.S1] = np.linspace(0, 1, k).view(np.int64)  # doubles: kept whole
    rows[:, L.SUM] = np.float32(np.linspace(0, 1, k)).astype(np.float64).view(np.int64)
    vals = np.float32(np.linspace(-3, -1, k)).astype(np.float64)
    rows[:, L.MIN], rows[:, L.MAX] = _key(vals), _key(-vals / 2)
    rows[:, L.ABSMAX] = _key(-vals)  # = max(-min, max): left out
    rows[:, L.SHIFT] = np.linspace(0, 1, k).view(np.int64)
    rows[:, H + 3] = 70000  # counts need 4 bytes
    p = pack(0, np.arange(k), rows, np.arange(k), np.arange(k), np.zeros(k, bool), None, False)
    codes = p.desc[1]
    assert codes[L.COUNT] == CONST and codes[L.ZEROS] == U8 and codes[L.S1] == RAW
    assert codes[L.SUM] == F32 and codes[L.MIN] == KEY32 and codes[L.MAX] == KEY32
    assert codes[L.ABSMAX] == 7  # derived
    # consts (8 B per header column) + ZEROS 1 B + S1, SHIFT 8 B + SUM, MIN, MAX 4 B per row
    # (8-aligned), band first/len 1 B + one u32 count per row.
    assert p.nbytes == 8 * H + 56 + 400 + 400 + 200 + 200 + 200 + 56 + 56 + 200
    rows[:, H + 3] = 300
    assert pack(0, np.arange(k), rows, np.arange(k), np.arange(k), np.zeros(k, bool), None,
                False).desc[2][-1] == U16


def _capture_raw(monkeypatch):
    """Record the raw rows of every step as the drain hands them over."""
    raw = {}
    real = hookcap._host.drain.make_record

    def spy(step, metrics, rows, *a, **kw):
        raw[step] = (np.array(metrics), np.array(rows))
        return real(step, metrics, rows, *a, **kw)

    monkeypatch.setattr(hookcap._host.drain, "make_record", spy)
    return raw


def _assert_history_matches_raw(h, raw):
    """Every stat and histogram of ``h`` equals the decoding of the raw rows, bit for bit."""
    for s, step in enumerate(h.steps):
        metrics, rows = raw[int(step)]
        dec = L.decode(rows[:, :H])
        for stat in L.STAT_NAMES:
            np.testing.assert_array_equal(h[stat][s, metrics], dec[stat], err_msg=stat)
        for j, m in enumerate(metrics):
            np.testing.assert_array_equal(h.histogram(h.names[m])[s], rows[j, H:])


def _gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=12, n_embd=32, n_head=2, vocab_size=128, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def test_gpt2_like_run_stores_under_250_bytes_per_metric_step_and_decodes_exactly(monkeypatch, tmp_path):
    raw = _capture_raw(monkeypatch)
    model = _gpt2()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randint(0, 128, (2, 32))
    with Monitor(model, capture=hookcap.CAPTURE_KINDS, optimizer=opt) as mon:
        for _ in range(4):
            model(x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
    store = mon._consumers.store
    cells = sum(len(p.metrics) for p in store.steps)
    h = mon.history()
    n_params = len(list(model.parameters()))
    # every capture kind: 744 metrics, SGD's update of each parameter (update, update.base), and
    # per layer attn.logit, attn.lse and attn.entropy, each whole and per head (2)
    assert len(h.names) == 744 + 2 * n_params + 12 * 3 * (1 + 2) and len(h) == 4
    assert store.nbytes / cells <= 250
    _assert_history_matches_raw(h, raw)
    # The stats are also right, not only preserved: one metric against float64.
    w = model.transformer.wte.weight.detach()
    ref = tensor_stats(w, mon.histogram)
    s = h.column("transformer.wte.weight/param")
    for stat in ("count", "min", "max", "absmax", "zeros"):
        assert h[stat][-1, s] == ref[stat]
    np.testing.assert_array_equal(h.histogram("transformer.wte.weight/param")[-1], ref["hist"])
    # The file holds the same history, and is about the size of the store.
    path = mon.dump(tmp_path / "sub" / "run")
    assert hookcap.load(path) == h
    assert os.path.getsize(path) < 1.5 * store.nbytes + 200_000


def test_byte_capacity_bounds_the_store_and_counts_evictions(tmp_path):
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(10)])
    x = torch.randn(4, 16)
    with Monitor(model, capture=("output", "grad_output"), capacity="40kB") as mon:
        for i in range(60):
            model(x * (1 + i % 3)).sum().backward()
            mon.step()
            assert mon.history_bytes <= 40_000
    h = mon.history()
    assert mon.evicted_steps == 60 - len(h) > 0
    assert h.steps.tolist() == list(range(60 - len(h), 60))  # the newest, contiguous
    assert mon.capacity == "40kB"
    extra = hookcap.load(mon.dump(tmp_path / "r.npz")).extra
    assert extra["evicted_steps"] == mon.evicted_steps


@pytest.mark.parametrize("capacity,steps,nbytes", [(7, 7, None), ("1.5MiB", None, 3 * 2**19),
                                                   ("2GB", None, 2 * 10**9), ("512", None, 512)])
def test_capacity_forms(capacity, steps, nbytes):
    mon = Monitor(nn.Linear(2, 2), capacity=capacity)
    assert (mon._consumers.store.max_steps, mon._consumers.store.max_bytes) == (steps, nbytes)


@pytest.mark.parametrize("bad", [0, -3, "0MB", "12 parsecs", "MB", 1.5, True, None])
def test_bad_capacity_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="capacity"):
        Monitor(nn.Linear(2, 2), capacity=bad)


def test_default_capacity_is_bounded_in_bytes():
    assert Monitor(nn.Linear(2, 2))._consumers.store.max_bytes == 256 * 2**20


def test_version_1_files_still_load(tmp_path, monkeypatch):
    raw = _capture_raw(monkeypatch)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with Monitor(model, capture=("output", "grad_output")) as mon:
        for _ in range(3):
            model(torch.randn(3, 4)).sum().backward()
            mon.step()
    h = mon.history()
    recs = [r for r in mon._consumers.store.records()]
    # A version-1 file as hookcap wrote it before the compact encoding.
    header = {"format": "hookcap-history", "version": 1, "layout_header": H, "names": h.names,
              "metas": {n: {**h.meta(n), "shape": list(h.meta(n)["shape"])} for n in h.names},
              "histogram": {"kind": "log2", "lo": -64, "hi": 64, "bins": 0}, "extra": {}}
    cat = np.concatenate
    path = tmp_path / "v1.npz"
    np.savez_compressed(
        path, meta_json=np.frombuffer(json.dumps(header).encode(), dtype=np.uint8),
        steps=h.steps, n_metrics=np.array([len(r.metrics) for r in recs]), metrics=cat([r.metrics for r in recs]),
        rows=cat([r.header for r in recs]), hist_lo=np.array([r.hist_lo for r in recs]),
        hist_width=np.array([r.hist.shape[1] for r in recs]), hist=cat([r.hist.reshape(-1) for r in recs]),
        n_order=np.array([len(r.order) for r in recs]), order=cat([r.order for r in recs]),
        n_calls=np.array([len(r.calls) for r in recs]), calls=cat([r.calls for r in recs]),
        calls_nonfinite=cat([r.calls_nonfinite.astype(np.int64) for r in recs]))
    back = hookcap.load(path)
    assert back == h
    _assert_history_matches_raw(back, raw)


def _off_step_calls(layers: int) -> int:
    """Python-level calls made by one ordinary off-step ``step()``."""
    import sys

    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)])
    x = torch.randn(2, 4)
    mon = Monitor(model, capture=("output", "grad_output"), every=10).attach()
    counts = []
    for i in range(25):
        model(x).sum().backward()
        n = [0]

        def prof(frame, event, arg):
            if event in ("call", "c_call"):
                n[0] += 1

        if i % 10 in (3, 4, 5):  # neither a recorded step nor the one before it
            sys.setprofile(prof)
        mon.step()
        sys.setprofile(None)
        if i % 10 in (3, 4, 5):
            counts.append(n[0])
    mon.detach()
    assert len(mon.history()) == 3
    return max(counts)


def test_off_step_work_does_not_grow_with_the_number_of_metrics():
    assert _off_step_calls(400) == _off_step_calls(10)
