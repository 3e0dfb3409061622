"""Cost of capture kind "attention" (--kind attention: HF GPT-2, sdpa) or
"router" (--kind router: HF OLMoE, top-2 of 8 experts): training steps with
the Monitor recording outputs and gradients every step, with and without the
kind, and with no Monitor, timed round-robin in one process. Prints ms per
step and what the kind adds. With --kind attention, also the split of one
recorded tile [batch, heads, tokens, tokens] (non-causal, log2 histogram)
between its ops, timed round-robin: attention_rows alone, accumulate_groups
over the tile, and accumulate_attention (both in one call); and the host
time each tile adds to a recorded attention call (tiny tensors, so that the
tile's work is negligible: one call in 16 tiles against the same call in
one, round-robin). With --kind
router, also each token's logsumexp and entropy of router logits
[batch x tokens, E] (E = 8 and 64) as the router capture computes them
(attention_rows on a float32 copy) against PyTorch's own ops for the same
values (logsumexp, softmax, special.entr), timed round-robin.

  PYTHONPATH=. python benchmarks/bench_inside.py [--kind attention|router] [--device cuda] [--layers 2]
      [--embd 256] [--batch 4] [--tokens 256] [--rounds 9] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import transformers
from _machine import machine
from bench_groups import round_robin

import hookcap
from hookcap import Histogram, _layout, _ops
from hookcap.functional import new_state


def tile_split(dev, batch: int, heads: int, tokens: int, rounds: int) -> dict:
    """Median ms per call of each op on one tile of logits (see the module
    docstring), timed round-robin (bench_groups.round_robin)."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    x = torch.randn(batch, heads, tokens, tokens, device=dev) * 3
    h = Histogram.log2()
    ring = torch.zeros(1, 3 * heads, _layout.HEADER + h.nbins, dtype=torch.int64, device=dev)
    state = new_state(dev)
    rows = [list(range(m * heads, (m + 1) * heads)) for m in range(3)]
    fns = {"attention_rows": lambda: _ops.attention_rows(x, -1),
           "accumulate_groups": lambda: _ops.accumulate_groups(x, ring, state, rows[0], 1, 1, h),
           "accumulate_attention": lambda: _ops.accumulate_attention(x, -1, ring, state, *rows, h)}
    return round_robin(fns, rounds, sync)


def tile_host_us(dev, rounds: int) -> float:
    """µs each extra tile adds to a recorded attention call of tiny tensors
    ([1, 2, 64, 8], non-causal): 16 tiles of 4 query rows against one tile,
    median ms per call (round_robin), difference over 15."""
    import hookcap._capture.attention as att

    class Attn(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    model = Attn()
    q, k, v = (torch.randn(1, 2, 64, 8, device=dev) for _ in range(3))
    mon = hookcap.Monitor(model, capture=("attention",), detectors=[]).attach()
    saved = att.TILE_VALUES, att.CUDA_TILE_VALUES

    def call(tile_values):
        def fn():
            att.TILE_VALUES = att.CUDA_TILE_VALUES = tile_values
            model(q, k, v)  # no step() between: the same rows take every call
        return fn

    try:
        ms = round_robin({"16 tiles": call(2 * 64 * 4), "1 tile": call(1 << 30)}, rounds, sync)
    finally:
        att.TILE_VALUES, att.CUDA_TILE_VALUES = saved
        mon.detach()
    return (ms["16 tiles"] - ms["1 tile"]) / 15 * 1e3


def router_rows(dev, tokens: int, rounds: int) -> dict:
    """Median ms per call of the router's per-token z and entropy (see the
    module docstring) for ``tokens`` tokens, and torch's ops over hookcap's."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out = {}
    for experts in (8, 64):
        logits = torch.randn(tokens, experts, device=dev) * 3

        def hookcap_rows():
            lse, entropy = _ops.attention_rows(logits.to(torch.float32, copy=True))
            return lse.square_(), entropy

        def torch_ops():
            return torch.logsumexp(logits, -1).square_(), torch.special.entr(torch.softmax(logits, -1)).sum(-1)

        ms = round_robin({"hookcap": hookcap_rows, "torch": torch_ops}, rounds, sync)
        out[f"E={experts}"] = {**ms, "torch / hookcap": ms["torch"] / ms["hookcap"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", choices=("attention", "router"), default="attention")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    if args.kind == "attention":
        cfg = transformers.GPT2Config(n_layer=args.layers, n_embd=args.embd, n_head=args.heads, vocab_size=1000,
                                      n_positions=args.tokens, attn_implementation="sdpa")
        model, what = transformers.GPT2LMHeadModel(cfg).to(dev), "GPT-2"
    else:
        cfg = transformers.OlmoeConfig(vocab_size=1000, hidden_size=args.embd, intermediate_size=args.embd,
                                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                       num_key_value_heads=args.heads, num_experts=8, num_experts_per_tok=2,
                                       max_position_embeddings=args.tokens)
        model, what = transformers.OlmoeForCausalLM(cfg).to(dev), "OLMoE (8 experts, top-2)"
    ids = torch.randint(0, 1000, (args.batch, args.tokens), device=dev)
    kind = f"+ {args.kind}"
    monitors = {"no Monitor": None,
                "output, grad_output": hookcap.Monitor(model, capture=("output", "grad_output"), detectors=[]),
                kind: hookcap.Monitor(model, capture=("output", "grad_output", args.kind), detectors=[])}
    times = {k: [] for k in monitors}
    for rnd in range(args.rounds + 2):
        for name, mon in monitors.items():
            if mon is not None:
                mon.attach()
            sync()
            t0 = time.perf_counter()
            for _ in range(3):
                model(ids, labels=ids).loss.backward()
                model.zero_grad(set_to_none=True)
                if mon is not None:
                    mon.step()
            sync()
            if mon is not None:
                mon.detach()
            if rnd >= 2:
                times[name].append((time.perf_counter() - t0) / 3 * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["no Monitor"]
    print(f"{what} {args.layers} layers x {args.embd}, {args.heads} heads, batch {args.batch} x {args.tokens} tokens, "
          f"{dev.type} ({machine(dev)}), torch {torch.__version__}, {args.rounds} rounds x 3 steps")
    print("| config | ms per step | vs no Monitor |")
    print("|---|---:|---:|")
    for k, v in med.items():
        print(f"| {k} | {v:.1f} | {'-' if k == 'no Monitor' else f'{(v / base - 1) * 100:+.1f} %'} |")
    added = med[kind] - med["output, grad_output"]
    print(f"{args.kind} adds {added:.1f} ms per step ({added / base * 100:.1f} % of the step)")
    out = {"machine": machine(dev), "device": dev.type, "torch": torch.__version__, "args": vars(args),
           "median_ms": med, f"{args.kind}_added_ms": added}
    if args.kind == "attention":
        split = out["tile_ms"] = tile_split(dev, args.batch, args.heads, args.tokens, args.rounds)
        print(f"one tile [{args.batch}, {args.heads}, {args.tokens}, {args.tokens}], median ms per call: "
              + ", ".join(f"{k} {v:.2f}" for k, v in split.items()))
        per_tile = out["tile_host_us"] = tile_host_us(dev, max(args.rounds, 21))
        print(f"host time per extra tile of a recorded attention call (tiny tensors): {per_tile:.1f} us")
    else:
        rr = out["router_rows_ms"] = router_rows(dev, args.batch * args.tokens, args.rounds)
        print(f"router z and entropy of {args.batch * args.tokens} tokens, median ms per call: "
              + "; ".join(f"{e}: hookcap {v['hookcap']:.3f}, torch ops {v['torch']:.3f} "
                          f"({v['torch / hookcap']:.1f} x)" for e, v in rr.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
