"""Registers of the Triton kernels a GPU would run for a compiled GPT-2 step, without a GPU.

  PYTHONPATH=. python benchmarks/triton_registers.py [--layers 4] [--tokens 1024] [--batch 1] [--json FILE]

Inductor writes the step's Triton kernels on the CPU (`_fusion.triton_codegen`; GPT-2 of
benchmarks/_gpt2.py at full width, bf16 autocast, outputs and output gradients of the default
modules) with no telemetry, the op (histogram=None) and fused=True (histogram=None); each
kernel is compiled for sm_90 with every config Inductor would autotune among (Triton, then its bundled ptxas -v: registers and spill bytes). A kernel's
best config is the one with the fewest spills, then registers (autotuning picks by time, which
needs a GPU). Per configuration it prints the kernels, the warps an SM can hold by the registers
of each (of 64), and the elements-weighted mean of that occupancy; nothing is run on a GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

import torch

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]

H100 = ("DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, "
        "regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, "
        "warp_size=32)")


def _load(source: str, tmp: str, i: int):
    """(jit function, triton_meta, configs, inductor_meta) of one generated
    kernel module, its configs chosen for an sm_90 device."""
    from torch._inductor.runtime import triton_heuristics as th

    # the module selects its driver as it loads (a dump from a GPU: the GPU's); none here
    src = source.replace("triton_helpers.set_driver_to_cpu()", "").replace("triton_helpers.set_driver_to_gpu()", "")
    src = re.sub(r"DeviceProperties\(type='cpu'[^)]*\)", H100, src)
    path = os.path.join(tmp, f"k{i}.py")
    with open(path, "w") as f:
        f.write(src)
    got, real = {}, th.cached_autotune

    def capture(size_hints, configs, triton_meta, heuristic_type, filename=None, inductor_meta=None, **kw):
        def deco(fn):
            got.update(fn=fn, meta=triton_meta, configs=configs, inductor_meta=inductor_meta or {})
            return fn
        return deco

    th.cached_autotune = capture
    try:
        spec = importlib.util.spec_from_file_location(f"hookcap_regs_k{i}", path)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    finally:
        th.cached_autotune = real
    return got["fn"], got["meta"], got["configs"], got["inductor_meta"]


def compile_sm90(fn, meta, cfg):
    """``fn`` (a generated kernel, its ``triton_meta``) compiled by Triton for
    sm_90 under the autotuning config ``cfg``; no GPU needed."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = {**meta.get("constants", {}), **cfg.kwargs}
    sig = {**meta["signature"], **{k: "constexpr" for k in constexprs}}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=(meta.get("configs") or [{}])[0])
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


def _registers(fn, meta, cfg, tmp: str) -> tuple[int, int]:
    """(registers per thread, spill store bytes) of ``fn`` under ``cfg`` on sm_90."""
    import triton

    compiled = compile_sm90(fn, meta, cfg)
    ptx = os.path.join(tmp, "k.ptx")
    with open(ptx, "w") as f:
        f.write(compiled.asm["ptx"])
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    err = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", ptx, "-o", os.devnull],
                         capture_output=True, text=True, check=True).stderr
    return (int(re.search(r"Used (\d+) registers", err).group(1)),
            int(re.search(r"(\d+) bytes spill stores", err).group(1)))


def warps_per_sm(regs: int, warps_per_block: int) -> int:
    """Warps an sm_90 SM holds by registers (65,536 per SM, allocated per
    warp in units of 256), whole blocks only, at most 64 warps and 32 blocks."""
    per_warp = -(-regs * 32 // 256) * 256
    blocks = min(65536 // per_warp // warps_per_block, 32)
    return min(blocks * warps_per_block, 64)


def kernel_rows(kernels) -> list[dict]:
    rows, seen = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, k in enumerate(kernels):
            if k.source not in seen:  # each layer launches the same kernels
                fn, meta, configs, imeta = _load(k.source, tmp, i)
                seen[k.source] = (min(((*_registers(fn, meta, c, tmp), c) for c in configs),
                                      key=lambda t: (t[1], t[0])), imeta, configs)
            best, imeta, configs = seen[k.source]
            regs, spill, cfg = best
            rows.append({"kernel": k.name, "elements": k.elements, "reductions": imeta.get("num_reduction", 0),
                         "configs": len(configs), "regs": regs, "spill_bytes": spill, "num_warps": cfg.num_warps,
                         "block": dict(cfg.kwargs), "warps_per_sm": warps_per_sm(regs, cfg.num_warps)})
    return rows


def step_kernels(layers: int, tokens: int, kw, batch: int = 1) -> list:
    """The Triton kernel launches of one GPT-2 training step (``batch``
    sequences of ``tokens``), generated on the CPU."""
    return step_codegen(layers, tokens, kw, batch).kernels()


def step_codegen(layers: int, tokens: int, kw, batch: int = 1):
    """:func:`step_kernels`' ``_fusion.triton_codegen`` (its ``codes``, its
    ``kernels()``)."""
    import hookcap
    import hookcap._capture.fused
    from _fusion import triton_codegen
    from gpu_check import gpt2_shape, gpt2_workload

    hookcap._capture.fused.DEVICE_TYPES.add("cpu")
    shape = {**gpt2_shape("cuda", False), "n_layer": layers, "batch": batch, "seq": tokens}
    torch.manual_seed(0)
    with triton_codegen() as tc:
        model, loss_fn, _ = gpt2_workload(shape, torch.device("cpu"), use_transformers=False)
        mon = None if kw is None else hookcap.Monitor(model, capture=("output", "grad_output"), detectors=[],
                                                      **kw).attach()
        model.compile()

        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn()
            loss.backward()

        tc.run(step)
        if mon is not None:
            mon.detach()
    return tc


def counts_only(args, configs, out) -> int:
    from _fusion import hookcap_calls, merged_captures, triton_reduce_only_bytes, triton_traffic_bytes
    from bench_overhead import write_json
    from torch._dynamo.utils import counters

    for name, kw in configs.items():
        counters["hookcap"].clear()
        tc = step_codegen(args.layers, args.tokens, kw, args.batch)
        ks = tc.kernels()
        c = out["configs"][name] = {
            "launches": len(ks), "reduce_only_bytes": triton_reduce_only_bytes(ks, 4097),
            "traffic_bytes": triton_traffic_bytes(ks), "handed_to_op": counters["hookcap"]["reduce_only_to_op"],
            "handed_to_op_bytes": counters["hookcap"]["reduce_only_to_op_bytes"],
            "hookcap_calls": hookcap_calls(tc.codes), "merged_captures": merged_captures(tc.codes)}
        print(f"== {name}: {c['launches']} launches, reduce-only kernels read {c['reduce_only_bytes'] / 1e6:.1f} MB, "
              f"all move {c['traffic_bytes'] / 1e6:.1f} MB; captures handed to the op {c['handed_to_op']} "
              f"({c['handed_to_op_bytes'] / 1e6:.1f} MB); hookcap's calls {c['hookcap_calls']} "
              f"({c['merged_captures']} captures merged)", flush=True)
    write_json(args.json, out)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1, help="sequences per step")
    p.add_argument("--json", default=None)
    p.add_argument("--counts-only", action="store_true",
                   help="no registers: per configuration the Triton launches, the bytes reduce-only kernels read "
                        "and all kernels move, and the captures fused=True hands to the op")
    args = p.parse_args(argv)
    from bench_overhead import write_json

    configs = {"none": None, "op": {"histogram": None}, "fused": {"histogram": None, "fused": True}}
    out = {"layers": args.layers, "tokens": args.tokens, "batch": args.batch, "configs": {}}
    if args.counts_only:
        return counts_only(args, configs, out)
    for name, kw in configs.items():
        rows = kernel_rows(step_kernels(args.layers, args.tokens, kw, args.batch))
        weight = sum(max(r["elements"], 0) for r in rows) or 1
        mean = sum(max(r["elements"], 0) * r["warps_per_sm"] for r in rows) / weight
        out["configs"][name] = {"kernels": rows, "mean_warps_per_sm": mean,
                                "max_regs": max(r["regs"] for r in rows),
                                "kernels_under_16_warps": sum(r["warps_per_sm"] < 16 for r in rows)}
        print(f"== {name}: {len(rows)} kernels, elements-weighted warps per SM {mean:.1f} of 64, "
              f"max {out['configs'][name]['max_regs']} registers, "
              f"{out['configs'][name]['kernels_under_16_warps']} kernels under 16 warps per SM", flush=True)
        for r in sorted(rows, key=lambda r: -r["regs"])[:8]:
            print(f"   {r['kernel'][:64]:64s} red {r['reductions']:2d} regs {r['regs']:3d} spill {r['spill_bytes']} "
                  f"warps/SM {r['warps_per_sm']:2d} ({r['num_warps']} per block) elements {r['elements']}")
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
