"""The report's attention, expert and channel plots: written from a run
that has those metrics, and left out (no file, no section) otherwise."""

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hookcap
from hookcap import Monitor
from hookcap.report import from_history, report
from hookcap.report_inside import grouped

pytest.importorskip("matplotlib")


class Block(nn.Module):
    def __init__(self, d=16, heads=4, experts=4):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.heads = heads
        self.gate = nn.Linear(d, experts)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        logits = self.gate(a)
        w, idx = torch.topk(logits.softmax(-1), 2, dim=-1)
        hookcap.tap(idx, "block.router/router.tokens", bins=4, weights=w)
        return self.out(a)


def test_report_draws_attention_experts_and_channels(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    mon = Monitor(model, capture=("output", "attention"), groups={"*.out/output": hookcap.Channels(top=3)}).attach()
    for _ in range(3):
        model(torch.randn(2, 6, 16)).sum().backward()
        mon.step()
    mon.detach()
    h = mon.history()
    run = from_history(h)
    assert list(grouped(run, r".*/attn\.logit")) == ["0/attn.logit", "1/attn.logit"]
    assert [len(c) for c in grouped(run, r".*/attn\.logit").values()] == [4, 4]
    files = report(h, out=str(tmp_path / "r"))
    for key in ("attention", "experts", "channels"):
        assert files[key] and os.path.getsize(files[key]) > 10_000, key
    page = open(files["index"]).read()
    assert "attention.png" in page and "experts.png" in page and "channels.png" in page

    plain = Monitor(nn.Linear(4, 4)).attach()
    plain.model(torch.randn(2, 4))
    plain.step()
    plain.detach()
    files = report(plain.history(), out=str(tmp_path / "p"))
    assert files["attention"] is None and files["experts"] is None and files["channels"] is None
    assert "attention.png" not in open(files["index"]).read()
