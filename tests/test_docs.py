"""The documentation's runnable snippets run as written."""

import os
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"


def snippets(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), flags=re.S)


@pytest.mark.parametrize("i", range(len(snippets("integrations.md"))))
def test_integrations_page_snippets_run(i, tmp_path, monkeypatch):
    for mod in ("transformers", "accelerate", "lightning"):
        pytest.importorskip(mod)
    monkeypatch.chdir(tmp_path)  # snippets write their outputs to the working directory
    code = snippets("integrations.md")[i]
    exec(compile(code, f"docs/integrations.md snippet {i}", "exec"), {"__name__": "__docs__"})
    assert os.getcwd() == str(tmp_path)


def test_loss_spike_page_example_finds_the_spike(tmp_path, monkeypatch, capsys):
    """docs/loss-spikes.md's example runs as written, and what its text says
    it shows holds."""
    import numpy as np

    code = snippets("loss-spikes.md")[0]
    monkeypatch.chdir(tmp_path)
    ns = {"__name__": "__docs__"}
    exec(compile(code, "docs/loss-spikes.md snippet", "exec"), ns)
    h = ns["h"]
    spikes = {(a.step, a.name) for a in h.anomalies if a.kind == "spike"}
    assert (31, "loss") in spikes and (30, "0.weight/update") in spikes
    assert not any(n == "loss" for s, n in spikes if s <= 30)  # the update came first
    ratio = h.update_ratio("0.weight")
    assert ratio[30] > 20 * ratio[29] and h["max"][30, h.column("loss")] < 2 * h["max"][29, h.column("loss")]
    adam = h["rms"][:, h.column("0.weight/adam_ratio")]
    assert adam[31] > 1.8 * adam[30]
    assert (tmp_path / "loss-spike-report" / "index.html").exists()
    # The report's signals plot draws exactly the History's derived values.
    from hookcap.report import from_history, spike_signals

    sig = spike_signals(from_history(h))
    params = [n for n, _ in ns["model"].named_parameters()]
    assert sorted(sig["update_ratio"]) == sorted(params) == sorted(sig["adam_ratio"])
    for p in params:
        np.testing.assert_array_equal(sig["update_ratio"][p], h.update_ratio(p))
        np.testing.assert_array_equal(sig["adam_ratio"][p], h["rms"][:, h.column(f"{p}/adam_ratio")])
    np.testing.assert_array_equal(sig["loss"]["loss"], h["max"][:, h.column("loss")])  # a 0-d tap: mean == max
    page = (tmp_path / "loss-spike-report" / "index.html").read_text()
    assert 'src="signals.png"' in page and (tmp_path / "loss-spike-report" / "signals.png").stat().st_size > 1024


def test_loss_spike_page_grad_scaler_snippet(capsys):
    """docs/loss-spikes.md's GradScaler snippet runs as written and shows
    what its comments say: the skipped iteration, an update of 0 there."""
    import numpy as np

    code = snippets("loss-spikes.md")[1]
    ns = {"__name__": "__docs__"}
    exec(compile(code, "docs/loss-spikes.md snippet 1", "exec"), ns)
    h = ns["h"]
    assert h.skipped.tolist() == [False, False, True, False]
    upd = h["l2norm"][:, h.column("weight/update")]
    assert upd[2] == 0 and np.all(upd[[0, 1, 3]] > 0)
    assert np.isnan(h["count"][2, h.column("weight/adam_ratio")])
    ns["mon"].detach()


def test_attention_moe_page_example_names_the_grown_head(capsys):
    """docs/attention-moe.md's example runs as written and shows what its
    comments say: head 1 has the largest absmax, and the whole tensor's
    absmax is the largest of its heads'."""
    import numpy as np

    ns = {"__name__": "__docs__"}
    exec(compile(snippets("attention-moe.md")[0], "docs/attention-moe.md snippet", "exec"), ns)
    absmax = ns["absmax"]
    assert absmax.shape == (5, 4) and int(np.argmax(absmax[-1])) == 1
    assert capsys.readouterr().out.strip().endswith("True")


def test_attention_moe_page_router_example_names_the_dead_expert(capsys):
    """docs/attention-moe.md's router example runs as written: expert 5 gets
    no token, and Threshold names its group."""
    ns = {"__name__": "__docs__"}
    code = next(s for s in snippets("attention-moe.md") if "TopKRouter" in s)
    exec(compile(code, "docs/attention-moe.md router snippet", "exec"), ns)
    h = ns["h"]
    counts = h.groups("./router.tokens", "count")
    assert counts.shape == (4, 8) and (counts[:, 5] == 0).all() and (counts.sum(1) == 128).all()
    assert [a.name for a in h.anomalies] == ["./router.tokens[5]"]
    assert "['./router.tokens[5]']" in capsys.readouterr().out
