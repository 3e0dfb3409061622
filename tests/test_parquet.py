"""The Parquet sink: a dataset directory of complete part files, read back by
hookcap.load, pandas, polars and DuckDB, checked against the Monitor's own
History (bit for bit) and independent float64 statistics; crash safety with a
SIGKILLed child process; the report from the directory."""

import json
import math
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import torch.nn as nn

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

import hookcap  # noqa: E402
from conftest import assert_recorded, mlp, train_steps  # noqa: E402
from hookcap import Histogram, Monitor, STAT_NAMES, sinks  # noqa: E402
from hookcap._rows.config import metric_name  # noqa: E402
from hookcap.sinks.parquet import module_of, part_files  # noqa: E402

NAN = float("nan")
COUNTS = ("count", "nan", "posinf", "neginf", "inf", "zeros", "finite")
CAPTURE = ("output", "grad_output", "param", "param_grad")
SPEC = Histogram.log2(-40, 10)


def train(mon, steps=7, bad_at=None, keep=None):
    """Forward + backward per step. At step ``bad_at`` layer 2's output gets a
    NaN, +Inf and -Inf. ``keep``: dict filled with (step, name) -> a float64
    copy of every layer output, for the independent reference."""
    model = mon.model
    state = {"step": -1}

    def hook(mod, args, out):
        if state["step"] == bad_at and mod is model[2]:
            out = out.clone()
            out[0, 0], out[0, 1], out[1, 0] = NAN, math.inf, -math.inf
        if keep is not None:
            keep[(state["step"], f"{idx[mod]}/output")] = out.detach().double().clone()
        return out

    idx = {m: str(i) for i, m in enumerate(model)}
    handles = [m.register_forward_hook(hook) for m in model]
    try:
        train_steps(mon, steps, state)
    finally:
        for h in handles:
            h.remove()
    return mon.history()


def same_array(a, b) -> bool:
    """Bit-for-bit equality of float arrays (NaN == NaN, -0.0 != 0.0)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    na, nb = np.isnan(a), np.isnan(b)
    return a.shape == b.shape and np.array_equal(na, nb) and np.array_equal(a[~na].view(np.int64),
                                                                            b[~nb].view(np.int64))


def assert_same_history(got, h):
    assert got == h and h == got  # History.__eq__ both ways (the Parquet one decides)
    assert got.names == h.names and got.steps.tolist() == h.steps.tolist() and len(got) == len(h)
    assert got.stat_names == h.stat_names
    for stat in h.stat_names:
        assert same_array(got[stat], h[stat]), stat
    for name in h.names:
        assert got.meta(name) == h.meta(name)
        if h.histogram_spec is not None:
            np.testing.assert_array_equal(got.histogram(name), h.histogram(name))
    for step in h.steps.tolist():
        assert got.order(step) == h.order(step)


# --------------------------------------------------------------------------- round trip


def test_round_trip_equals_history_and_float64_reference(tmp_path):
    path = tmp_path / "run.parquet"
    keep = {}
    sink = sinks.Parquet(path, row_group_steps=3)
    h = train(Monitor(mlp(), capture=CAPTURE, histogram=SPEC, sinks=[sink]), steps=7, keep=keep)
    # 7 steps in groups of 3: two full parts while training, the last one at detach() (close).
    assert [os.path.basename(f) for _, f in part_files(str(path))] == \
        ["part-000000.parquet", "part-000001.parquet", "part-000002.parquet"]
    assert sorted(os.listdir(path)) == ["part-000000.parquet", "part-000001.parquet", "part-000002.parquet"]
    assert [pq.ParquetFile(f).metadata.num_row_groups for _, f in part_files(str(path))] == [1, 1, 1]
    got = hookcap.load(path)
    assert_same_history(got, h)
    assert hookcap.load(str(path) + "/") == h
    # The loaded values against float64 statistics of the captured tensors.
    for (step, name), x in keep.items():
        assert_recorded(got, step, name, [x])
    # The rest of the History view.
    assert got.last(2) == h.last(2) and len(got.last(0)) == 0 and got.last(0).names == h.names
    assert got.last(100) == h.last(100) == h
    assert got.last(2).histogram("0/output").shape == (2, SPEC.nbins)
    pd = pytest.importorskip("pandas")
    pd.testing.assert_frame_equal(got.to_pandas(), h.to_pandas(), check_dtype=False)
    np.testing.assert_array_equal(got.bin_edges, h.bin_edges)
    with pytest.raises(KeyError, match="step 99"):
        got.order(99)
    with pytest.raises(ValueError, match="loaded from Parquet"):
        got.save(tmp_path / "x.npz")


def test_histogram_band_matches_per_metric_histograms():
    got = []
    train(Monitor(mlp(), capture=CAPTURE, histogram=SPEC, sinks=[sinks.Callback(got.append)]), steps=2)
    for d in got:
        off, counts = d.histogram_band()
        assert counts.dtype == np.int64 and counts.shape[0] == len(d.names)
        for i, name in enumerate(d.names):
            full = d.histogram(name)
            np.testing.assert_array_equal(full[off:off + counts.shape[1]], counts[i])
            assert full.sum() == counts[i].sum()
    with pytest.raises(ValueError, match="histogram=None"):
        d2 = []
        train(Monitor(mlp(), histogram=None, sinks=[sinks.Callback(d2.append)]), steps=1)
        d2[0].histogram_band()


# --------------------------------------------------------------------------- other readers


def test_schema_and_readers_pandas_polars_duckdb(tmp_path):
    pd = pytest.importorskip("pandas")
    pl = pytest.importorskip("polars")
    duckdb = pytest.importorskip("duckdb")
    path = tmp_path / "run.parquet"
    h = train(Monitor(mlp(), capture=CAPTURE, histogram=SPEC, sinks=[sinks.Parquet(path, row_group_steps=4)]),
              steps=6, bad_at=2)
    files = [f for _, f in part_files(str(path))]
    schema = pq.read_schema(files[0])
    want = [("step", pa.int64()), ("rank", pa.int32()), ("name", pa.string()), ("module", pa.string()),
            ("kind", pa.string())] + [(s, pa.int64() if s in COUNTS else pa.float64()) for s in STAT_NAMES] + \
        [("hist_offset", pa.int32()), ("hist", pa.list_(pa.int64()))]
    assert [(f.name, f.type) for f in schema] == want
    for f in files:
        md = pq.ParquetFile(f).metadata
        kv = {k.decode(): v.decode() for k, v in md.metadata.items()}
        assert kv["hookcap.format"] == "hookcap-parquet" and kv["hookcap.version"] == "1"
        assert json.loads(kv["hookcap.histogram"]) == {"kind": "log2", "lo": -40, "hi": 10}
        metas = json.loads(kv["hookcap.metas"])
        assert list(metas) == h.names  # every metric is in every part, in the Monitor's order
        assert all(metas[n] == {**h.meta(n), "shape": list(h.meta(n)["shape"])} for n in h.names)
        for c in ("name", "module", "kind"):  # dictionary-encoded on disk
            chunk = md.row_group(0).column(schema.get_field_index(c))
            assert chunk.has_dictionary_page and "RLE_DICTIONARY" in chunk.encodings

    df = pd.read_parquet(path)
    cells = [(int(step), name) for step in h.steps for name in h.order(int(step))]
    assert list(zip(df["step"].tolist(), df["name"].tolist())) == cells  # rows in execution order
    assert df["rank"].isna().all()  # single process
    for row in df.itertuples(index=False):
        s, c = int(np.flatnonzero(h.steps == row.step)[0]), h.column(row.name)
        assert row.kind == h.meta(row.name)["kind"]
        assert metric_name(row.module, row.kind) == row.name
        for stat in STAT_NAMES:
            assert same_array(getattr(row, stat), h[stat][s, c]), (row.name, stat)
        full = h.histogram(row.name)[s]
        band = np.zeros_like(full)
        band[row.hist_offset:row.hist_offset + len(row.hist)] = row.hist
        np.testing.assert_array_equal(band, full)
        nz = np.flatnonzero(full)
        assert len(row.hist) == (nz[-1] + 1 - nz[0] if nz.size else 0)
        assert row.hist_offset == (nz[0] if nz.size else 0)
    assert (df["nan"] > 0).any() and (df["posinf"] > 0).any() and (df["neginf"] > 0).any()

    # polars and DuckDB read the same rows and values.
    cols = ["step", "name", "module", "kind", *STAT_NAMES, "hist_offset"]
    ref = [tuple(r) for r in df[cols].itertuples(index=False)]
    plf = pl.read_parquet(f"{path}/*.parquet")
    assert plf.columns == df.columns.tolist()
    assert plf["rank"].null_count() == len(plf)
    assert all(a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))
               for x, y in zip(plf.select(cols).rows(), ref) for a, b in zip(x, y))
    assert plf["hist"].to_list() == [list(v) for v in df["hist"]]
    assert pl.read_parquet(path).equals(plf)  # polars also takes the directory
    rows = duckdb.sql(f"select {', '.join(cols)}, hist from read_parquet('{path}/*.parquet')").fetchall()
    assert len(rows) == len(ref)
    assert all(a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))
               for x, y in zip(rows, ref) for a, b in zip(x[:-1], y))
    assert [list(r[-1]) for r in rows] == [list(v) for v in df["hist"]]
    n_bad = duckdb.sql(f"select count(*) from read_parquet('{path}/*.parquet') where nan > 0").fetchall()[0][0]
    assert n_bad == int((df["nan"] > 0).sum()) > 0


def test_module_of_inverts_metric_name():
    for module, kind, sub in [("fc", "output", ""), ("blocks.0.mlp", "grad_output", ""), (".", "output", ""),
                              ("eval/fc", "output", ""), ("eval/output", "output", ""), ("fc", "output", "0.a"),
                              ("0.weight", "param", ""), ("enc.output", "output", "x/y"),
                              ("attn", "input", "1")]:
        assert module_of(metric_name(module, kind, sub), kind) == module, (module, kind, sub)


# --------------------------------------------------------------------------- crash safety


def test_sigkill_mid_group_keeps_every_completed_group(tmp_path):
    n, k = 23, 5
    path = tmp_path / "run.parquet"
    code = textwrap.dedent(f"""
        import os, signal, torch, torch.nn as nn, hookcap
        torch.set_num_threads(1)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))
        seen = []
        mon = hookcap.Monitor(model, capture=("output", "grad_output"), sinks=[
            hookcap.sinks.Parquet({str(path)!r}, row_group_steps={k}),
            hookcap.sinks.Callback(lambda d: seen.append(d.step))]).attach()
        g = torch.Generator().manual_seed(1)
        for i in range({n}):
            model(torch.randn(4, 6, generator=g)).sum().backward()
            mon.step()
        assert seen == list(range({n})), seen  # every step reached the sinks before the kill
        print("killing", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert "killing" in p.stdout
    done = n // k * k
    assert sorted(os.listdir(path)) == [f"part-{i:06d}.parquet" for i in range(n // k)]  # no temp file left
    got = hookcap.load(path)
    assert got.steps.tolist() == list(range(done))
    names = ["0/output", "1/output", "2/output", "2/grad_output", "1/grad_output", "0/grad_output"]
    assert sorted(got.names) == sorted(names)
    assert got["count"].shape == (done, 6) and not np.isnan(got["count"]).any()  # all metrics, every step
    # The same training in this process: the surviving steps are exactly its first `done` steps.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 3))
    g = torch.Generator().manual_seed(1)
    with Monitor(model, capture=("output", "grad_output")) as mon:
        for _ in range(done):
            model(torch.randn(4, 6, generator=g)).sum().backward()
            mon.step()
    assert_same_history(got, mon.history())
    pd = pytest.importorskip("pandas")
    assert len(pd.read_parquet(path)) == done * 6


# --------------------------------------------------------------------------- options


def test_every_stats_subset_and_no_histogram(tmp_path):
    a = sinks.Parquet(tmp_path / "a.parquet", every=2, stats=("l2norm", "nan", "mean"), row_group_steps=2)
    b = sinks.Parquet(tmp_path / "b.parquet", histogram=False)
    h = train(Monitor(mlp(), histogram=SPEC, sinks=[a, b]), steps=7, bad_at=4)
    ga = hookcap.load(tmp_path / "a.parquet")
    assert ga.steps.tolist() == [0, 2, 4, 6]
    assert ga.stat_names == ("nan", "mean", "l2norm")  # STAT_NAMES order
    assert pq.read_schema(part_files(str(tmp_path / "a.parquet"))[0][1]).names == [
        "step", "rank", "name", "module", "kind", "l2norm", "nan", "mean", "hist_offset", "hist"]
    rows = [s for s in range(len(h)) if h.steps[s] % 2 == 0]
    for stat in ga.stat_names:
        assert same_array(ga[stat], h[stat][rows]), stat
    for name in h.names:
        np.testing.assert_array_equal(ga.histogram(name), h.histogram(name)[rows])
    with pytest.raises(KeyError, match="'std' was not written.*available: nan, mean, l2norm"):
        ga["std"]
    with pytest.raises(KeyError, match="unknown stat"):
        ga["l3norm"]
    with pytest.raises(KeyError, match="'fwd_ms' was not written.*timing"):
        ga["fwd_ms"]
    assert "std" not in ga and "mean" in ga
    gb = hookcap.load(tmp_path / "b.parquet")
    assert "hist" not in pq.read_schema(part_files(str(tmp_path / "b.parquet"))[0][1]).names
    assert gb.histogram_spec is None and gb.bin_edges is None
    with pytest.raises(ValueError, match="histogram=None"):
        gb.histogram("0/output")
    for stat in STAT_NAMES:
        assert same_array(gb[stat], h[stat]), stat
    assert [gb.order(s) for s in range(7)] == [h.order(s) for s in range(7)]


def test_nan_and_inf_round_trip(tmp_path):
    path = tmp_path / "run.parquet"
    h = train(Monitor(mlp(), histogram=SPEC, sinks=[sinks.Parquet(path)], on_anomaly=None), steps=4, bad_at=1)
    got = hookcap.load(path)
    assert_same_history(got, h)
    c = h.column("2/output")
    assert (got["nan"][1, c], got["posinf"][1, c], got["neginf"][1, c], got["inf"][1, c]) == (1, 1, 1, 2)
    assert got["finite"][1, c] == got["count"][1, c] - 3
    d = h.column("3/output")  # tanh of a NaN: NaN downstream
    assert got["nan"][1, d] >= 1
    # A metric with no finite value (stats NaN, empty histogram) beside ones with values.
    x = torch.full((3, 4), NAN)
    x[0, 0] = math.inf
    y = torch.tensor([0.0, 1e-3, -2.0, 5.0])

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Identity(), nn.Identity(), nn.Identity()

        def forward(self, x, y):
            return self.a(y), self.b(x), self.c(y * 1e6 + 1e7)

    two = Two()
    with Monitor(two, capture="output", histogram=SPEC, sinks=[sinks.Parquet(tmp_path / "nan.parquet")],
                 on_anomaly=None) as mon:
        for _ in range(2):
            two(x, y)
            mon.step()
    g2 = hookcap.load(tmp_path / "nan.parquet")
    assert_same_history(g2, mon.history())
    assert g2.names == ["a/output", "b/output", "c/output"]
    assert np.isnan(g2["mean"][0, 1]) and np.isnan(g2["min"][0, 1]) and g2["posinf"][0, 1] == 1
    assert_recorded(g2, 1, "a/output", [y])
    assert_recorded(g2, 1, "c/output", [y * 1e6 + 1e7])
    import pandas as pd

    df = pd.read_parquet(tmp_path / "nan.parquet")
    row = df.iloc[1]
    assert row["name"] == "b/output" and row["nan"] == 11 and math.isnan(row["std"])
    assert row["hist_offset"] == 0 and len(row["hist"]) == 0
    assert [len(v) for v in df["hist"]] == [len(df.iloc[0]["hist"]), 0, len(df.iloc[2]["hist"])] * 2
    assert df.iloc[0]["hist_offset"] == 0 and df.iloc[2]["hist_offset"] > 0  # a has a 0: its band starts at bin 0


def test_bad_arguments_and_used_directories(tmp_path, monkeypatch):
    for bad in (0, -1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="row_group_steps"):
            sinks.Parquet(tmp_path / "r.parquet", row_group_steps=bad)
    with pytest.raises(ValueError, match="unknown stat.*l3norm"):
        sinks.Parquet(tmp_path / "r.parquet", stats=["l3norm"])
    with pytest.raises(ValueError, match="every"):
        sinks.Parquet(tmp_path / "r.parquet", every=0)
    (tmp_path / "file.parquet").write_text("x")
    with pytest.raises(FileExistsError, match="not a directory"):
        sinks.Parquet(tmp_path / "file.parquet")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        hookcap.load(tmp_path / "none.parquet")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no part"):
        hookcap.load(tmp_path / "empty")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if pyarrow were not installed
    with pytest.raises(ImportError, match=r"pip install 'hookcap\[parquet\]'"):
        sinks.Parquet(tmp_path / "r.parquet")


def test_flush_close_append_and_refusal(tmp_path):
    got = []
    train(Monitor(mlp(), histogram=SPEC, sinks=[sinks.Callback(got.append)]), steps=6)
    path = tmp_path / "deep" / "er" / "run.parquet"  # parent folders are created
    s = sinks.Parquet(path, row_group_steps=4)
    assert not path.exists()  # opened lazily
    s.write(got[0])
    assert sorted(os.listdir(path)) == []  # the open group is in memory only
    s.flush()  # writes the open group as a shorter part
    s.write(got[1])
    s.close()
    s.close()  # nothing open: no empty part
    s.write(got[2])  # after close(): continues with the next part
    s.close()
    assert sorted(os.listdir(path)) == ["part-000000.parquet", "part-000001.parquet", "part-000002.parquet"]
    assert hookcap.load(path).steps.tolist() == [0, 1, 2]
    with pytest.raises(FileExistsError, match="append=True"):
        sinks.Parquet(path)  # never mixes runs or deletes parts by default
    (path / ".tmp-part-000009.parquet").write_bytes(b"half a file of a killed writer")
    s2 = sinks.Parquet(path, append=True)
    for d in got[3:]:
        s2.write(d)
    s2.close()
    assert sorted(os.listdir(path))[-1] == "part-000003.parquet" and len(os.listdir(path)) == 4
    loaded = hookcap.load(path)
    assert loaded.steps.tolist() == [0, 1, 2, 3, 4, 5]
    one = hookcap.load(path / "part-000003.parquet")  # a single part file reads too
    assert one.steps.tolist() == [3, 4, 5]
    s3 = sinks.Parquet(tmp_path / "x.parquet")
    s3.close()  # never written: nothing created
    assert not (tmp_path / "x.parquet").exists()
    # Two sinks on one directory: the second never overwrites the first's part.
    s4, s5 = sinks.Parquet(tmp_path / "y.parquet"), sinks.Parquet(tmp_path / "y.parquet")
    s4.write(got[0])
    s5.write(got[1])
    s4.close()
    with pytest.raises(FileExistsError, match="another sink or process"):
        s5.close()
    assert hookcap.load(tmp_path / "y.parquet").steps.tolist() == [0]


# --------------------------------------------------------------------------- report


def test_report_from_directory_equals_report_from_dump(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from hookcap.__main__ import main
    from hookcap.report import load_run

    path = tmp_path / "run.parquet"
    mon = Monitor(mlp(), histogram=SPEC, sinks=[sinks.Parquet(path, row_group_steps=3)], on_anomaly=None)
    train(mon, steps=8, bad_at=3)
    dump = mon.dump(tmp_path / "dump.npz")
    a, b = load_run(path), load_run(dump)
    assert a.names == b.names and a.steps.tolist() == b.steps.tolist() and a.orders == b.orders
    assert a.stats.keys() == b.stats.keys()
    for stat in b.stats:
        assert same_array(a.stats[stat], b.stats[stat]), stat
    for name in b.names:
        np.testing.assert_array_equal(a.histogram(name), b.histogram(name))
    assert main(["report", str(path) + "/", "--stat", "absmax"]) == 0
    assert main(["report", str(dump), "--stat", "absmax", "--out", str(tmp_path / "dump-rep")]) == 0
    out = tmp_path / "run-report"  # beside the dataset, never inside it
    assert sorted(os.listdir(path)) == [f"part-{i:06d}.parquet" for i in range(3)]
    for k in ("heatmap.png", "nonfinite.png", "histogram.png"):  # the same plots, pixel for pixel
        assert (out / k).read_bytes() == (tmp_path / "dump-rep" / k).read_bytes(), k
    page = (out / "index.html").read_text()
    assert "8 recorded steps" in page and "<code>2/output</code>" in page
    # A stats= subset: the report says which stats there are.
    sub = tmp_path / "sub.parquet"
    train(Monitor(mlp(), sinks=[sinks.Parquet(sub, stats=["l2norm"])]), steps=2)
    capsys.readouterr()
    assert main(["report", str(sub), "--stat", "mean"]) == 1
    assert "available: l2norm" in capsys.readouterr().err


def test_timing_stats_round_trip(tmp_path):
    path = tmp_path / "t.parquet"
    sink = sinks.Parquet(path, stats=STAT_NAMES + ("fwd_ms", "bwd_ms"), row_group_steps=2)
    h = train(Monitor(mlp(), histogram=SPEC, timing=True, sinks=[sink]), steps=3)
    got = hookcap.load(path)
    assert got.stat_names == h.stat_names == STAT_NAMES + ("fwd_ms", "bwd_ms")
    assert_same_history(got, h)
    assert pq.read_schema(part_files(str(path))[0][1]).field("fwd_ms").type == pa.float64()
    assert np.isfinite(got["fwd_ms"]).any()
