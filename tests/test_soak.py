"""Soak: many recorded steps of hundreds of metrics with a byte capacity and
the Parquet sink. The host history stays within its bytes, RSS stays flat,
and the Parquet dataset holds every step of every metric."""

import os
import sys

import pytest

pytest.importorskip("pyarrow")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from bench_soak import soak  # noqa: E402

# RSS may move by allocator noise and pyarrow's buffers; a leak of one
# encoded step per step (~40 kB here) would add ~70 MB over the run.
RSS_BOUND_MB = 24


def test_soak_bounded_memory_and_every_step_on_disk(tmp_path):
    r = soak(steps=2000, metrics=300, capacity="2MB", row_group_steps=128, folder=str(tmp_path))
    assert r["metrics"] == 300
    assert r["history_mb"] * 2**20 <= 2_000_000
    assert r["evicted_steps"] == 2000 - r["kept_steps"] > 0
    # RSS is measured from the first tenth of the run (everything allocated
    # once by then) to the end.
    assert r["rss_growth_mb"] <= RSS_BOUND_MB, r["rss_mb"]
    assert r["file_steps"] == 2000 and r["every_step_complete"]
    assert r["last_steps_equal_history"]
