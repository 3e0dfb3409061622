"""History save/load round trip and the demo command."""

import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn

import hookcap
from hookcap import Histogram, Monitor


@pytest.mark.parametrize("hist", [Histogram.log2(-30, 10), Histogram.linear(-2, 2, 7), None])
def test_save_load_round_trip(tmp_path, hist):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with Monitor(model, histogram=hist, capture=("output", "grad_output", "param")) as mon:
        for i in range(4):
            x = torch.randn(3, 4)
            if i == 2:
                x[0, 0] = float("nan")
            model(x).sum().backward()
            mon.step()
    h = mon.history()
    path = h.save(tmp_path / "h", extra={"run": "t"})
    back = hookcap.load(path)
    assert back == h and back.extra == {"run": "t"}
    assert back.order(2) == h.order(2) and back.meta("0/output") == h.meta("0/output")
    c = back.column("0/output")
    assert back["nan"][2, c] == 8 and back["finite"][2, c] == 16  # one NaN input row -> 8 NaN outputs


def test_load_rejects_other_files(tmp_path):
    p = tmp_path / "x.npz"
    np.savez(p, a=np.zeros(2))
    with pytest.raises(ValueError, match="not a hookcap history"):
        hookcap.load(p)


def test_demo_runs_and_writes_history(tmp_path):
    out = subprocess.run([sys.executable, "-m", "hookcap", "demo", "--steps", "30", "--every", "2",
                          "--out", str(tmp_path / "d")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "head/output" in out.stdout and "nan/inf" in out.stdout
    h = hookcap.load(tmp_path / "d" / "history.npz")
    assert h.steps.tolist() == list(range(0, 30, 2))
