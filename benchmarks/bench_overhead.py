"""End-to-end training-step overhead of hookcap and of the tools people use today.

All configurations run in ONE process, interleaved round by round (each round
runs a few steps of every configuration in turn, in a new random order, with
gc.collect() before each), and the table reports the
median step time after warm-up, its ratio to the no-telemetry baseline and the
overhead in %. Machines here are noisy: compare ratios, not absolute times.
The ratio is paired by round: the median over rounds of (the configuration's
median step in that round / the baseline's median step in that round), so a
machine whose speed drifts during the run (seen here: a 45 ms baseline step
becoming 60 ms within a minute) shifts both sides of each ratio alike.

Workloads (random init, synthetic data):
  gpt2: transformers GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=2048,
        n_positions=256), batch 8 x 128 tokens, SGD, full step.
  cnn:  torchvision resnet18(weights=None) on 8x3x64x64 (built-in TinyResNet if
        torchvision is missing), SGD, full step.

--compile: every configuration trains its own instance of the model (same
seed, same weights), compiled with torch.compile (default mode) with its
Monitor attached for the whole run, so each keeps its own graphs: no
telemetry and the accumulate op (histogram=None, and log2). Each op row also
gives the bytes per step the op reads (the captured tensors', each read once).

Usage:
  python benchmarks/bench_overhead.py [--workloads gpt2,cnn] [--rounds 16] [--threads 2]
                                      [--steps-per-round 6] [--configs every=10,hookcap]
                                      [--device cpu|cuda] [--compile]
                                      [--gpt2-tokens 128] [--json benchmarks/results/overhead.json]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn as nn

import hookcap
from bench_kernel import machine_info

# -- workloads -----------------------------------------------------------------


GPT2_TOKENS = 128  # sequence length (--gpt2-tokens)


def gpt2_workload(device, use_cache=True):
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=2048,
                                  n_positions=max(256, GPT2_TOKENS), bos_token_id=0, eos_token_id=0,
                                  use_cache=use_cache)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).to(device)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(2048, (8, GPT2_TOKENS), generator=g).to(device)

    def loss_fn():
        return model(x, labels=x).loss

    return model, loss_fn


def cnn_workload(device, batch=8, size=64, channels_last=False, num_classes=1000):
    """(model, loss_fn): torchvision's resnet18 (weights=None,
    ``num_classes`` outputs), else the built-in TinyResNet, on one
    fixed random batch of ``batch`` float32 images of ``size`` pixels square
    (labels below 10), channels-last (model and batch) with
    ``channels_last``. ``loss_fn.model_name`` names the model."""
    torch.manual_seed(0)
    try:
        from torchvision.models import resnet18

        model, name = resnet18(weights=None, num_classes=num_classes), "resnet18"
    except ImportError:
        from hookcap.models import TinyResNet

        model, name = TinyResNet(), "TinyResNet (torchvision missing)"
    model = model.to(device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, size, size, generator=g).to(device)
    y = torch.randint(10, (batch,), generator=g).to(device)
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)

    def loss_fn():
        return nn.functional.cross_entropy(model(x), y)

    loss_fn.model_name = name
    return model, loss_fn


WORKLOADS = {"gpt2": gpt2_workload, "cnn": cnn_workload}


def compiled_workload(workload, device):
    """``workload`` as the compiled benchmarks build it: GPT-2 without its
    key/value cache (training never reads it, and the cache object its
    blocks return breaks graphs under module hooks:
    docs/compile-and-distributed.md) and with its loss named (unnamed,
    transformers logs a warning inside forward that dynamo cannot trace: a
    graph break between the logits and the loss, watched or not)."""
    if workload == "gpt2":
        model, loss_fn = gpt2_workload(device, use_cache=False)
        model.loss_type = "ForCausalLM"
        return model, loss_fn
    return WORKLOADS[workload](device)

# -- telemetry configurations ----------------------------------------------------


class Config:
    """attach(model) before a config's steps, detach() after; after_step()
    is called at the end of each training step; wrap() around forward+backward."""

    note = ""
    optimizer = None  # the loop's optimizer (configs(optimizer=...))

    def __init__(self, name):
        self.name = name

    def attach(self, model):
        pass

    def detach(self):
        pass

    def after_step(self):
        pass

    def wrap(self):
        return contextlib.nullcontext()


class Baseline(Config):
    pass


class Hookcap(Config):
    def __init__(self, name, block_merge=None, capture=("output", "grad_output"), with_optimizer=False, **kw):
        """block_merge: hookcap._ops.block_merge's kind while attached (CUDA), else the default.
        with_optimizer: Monitor(optimizer=) the loop's optimizer (``optimizer``, set by
        configs()); its steps close the Monitor's."""
        super().__init__(name)
        self.kw = kw
        self.capture = capture
        self.mon = None
        self.block_merge, self.merge_before = block_merge, None
        self.with_optimizer = with_optimizer

    def attach(self, model):
        if self.mon is None:
            opt = {"optimizer": self.optimizer} if self.with_optimizer else {}
            self.mon = hookcap.Monitor(model, capture=self.capture, **self.kw, **opt)
        if self.block_merge:
            self.merge_before = hookcap._ops.block_merge(self.block_merge)
        self.mon.attach()

    def detach(self):
        self.mon.detach()
        if self.merge_before:
            hookcap._ops.block_merge(self.merge_before)

    def after_step(self):
        if not self.with_optimizer:
            self.mon.step()


# Production cadence: the step-level signals every step (gradients, whose
# sum of squares gives the global norm, and the optimizer's update), the
# per-layer activations and their gradients every 10th step.
CADENCE = {"output": 10, "grad_output": 10, "param_grad": 1, "update": 1}


class HFDebug(Config):
    note = "transformers.debug_utils.DebugUnderflowOverflow"

    def attach(self, model):
        from transformers.debug_utils import DebugUnderflowOverflow

        self.model = model
        self.dbg = DebugUnderflowOverflow(model)

    def detach(self):
        # It keeps no handles: remove the forward hooks bound to it.
        for m in self.model.modules():
            for k, h in list(m._forward_hooks.items()):
                if getattr(h, "__self__", None) is self.dbg:
                    del m._forward_hooks[k]


class DetectAnomaly(Config):
    note = "torch.autograd.detect_anomaly() around forward+backward"

    def wrap(self):
        return torch.autograd.detect_anomaly(check_nan=True)


class WandbWatch(Config):
    note = "wandb.watch(model, log='all', log_freq=1), offline"

    def attach(self, model):
        import wandb

        if wandb.run is None:
            os.environ.setdefault("WANDB_SILENT", "true")
            wandb.init(mode="offline", dir=os.environ.get("TMPDIR", "/tmp"), project="hookcap-bench")
        self.model = model
        wandb.watch(model, log="all", log_freq=1)

    def detach(self):
        import wandb

        wandb.unwatch(self.model)

    def after_step(self):
        import wandb

        wandb.log({})


class ItemStats(Config):
    """Re-implements the approach of Composer's ActivationMonitor-style
    callbacks: one torch op per statistic and .item() on each (not the package)."""

    note = "re-implementation: torch op + .item() per stat (Composer ActivationMonitor style)"

    def attach(self, model):
        self.handles = []
        self.log = {}

        def record(name, t):
            t = t.detach().float()
            self.log[name] = (t.mean().item(), t.std().item() if t.numel() > 1 else 0.0, t.max().item(),
                              t.min().item(), t.norm().item(), t.isnan().any().item())

        def fwd(name):
            def hook(mod, args, out):
                if isinstance(out, torch.Tensor) and out.is_floating_point():
                    record(name + "/out", out)
                    if out.requires_grad:
                        out.register_hook(lambda g: record(name + "/grad", g))
            return hook

        for name, mod in model.named_modules():
            if next(mod.children(), None) is None:
                self.handles.append(mod.register_forward_hook(fwd(name)))

    def detach(self):
        for h in self.handles:
            h.remove()


def configs(skip, only=None, optimizer=None):
    """The configurations to measure; ``only``: names containing one of
    these substrings (the baseline is always kept); ``optimizer``: the
    loop's, for the configurations whose Monitor is given it."""
    out = [
        Baseline("no telemetry"),
        Hookcap("hookcap every=1 log2 hist"),
        Hookcap("hookcap every=10", every=10),
        *([Hookcap("hookcap every=1 log2 hist, tree merge", block_merge="tree"),
           Hookcap("hookcap every=1 log2 hist, side stream", stream="side")]
          if torch.cuda.is_available() else []),
        Hookcap("hookcap histogram=None", histogram=None),
        Hookcap("hookcap every=1 log2 + timing", timing=True),
        Hookcap("hookcap every=1 + attention", capture=("output", "grad_output", "attention")),
        Hookcap("hookcap cadence: grads+updates every step, activations every 10", with_optimizer=True,
                capture=tuple(CADENCE), every=CADENCE),
        HFDebug("HF DebugUnderflowOverflow"),
        DetectAnomaly("detect_anomaly"),
        WandbWatch("wandb.watch(log=all)"),
        ItemStats("torch-op stats + .item()"),
    ]
    if only:
        out = [c for c in out if isinstance(c, Baseline) or any(k in c.name for k in only)]
    avail = []
    for c in out:
        try:
            if isinstance(c, HFDebug):
                import transformers.debug_utils  # noqa: F401
            if isinstance(c, WandbWatch):
                import wandb  # noqa: F401
        except ImportError as e:
            skip[c.name] = f"not installed ({e.name})"
            continue
        c.optimizer = optimizer
        avail.append(c)
    return avail


# -- measurement -----------------------------------------------------------------


def timer(device):
    if device.type == "cuda":
        def run(fn):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        return run

    def run(fn):
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    return run


def measure(workload, device, rounds, steps_per_round, warm_rounds, only=None):
    model, loss_fn = WORKLOADS[workload](device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    skip = {}
    cfgs = configs(skip, only, optimizer=opt)
    times = {c.name: [] for c in cfgs}
    by_round = {c.name: [] for c in cfgs}  # per measured round: the median of its samples
    clock = timer(device)
    order = random.Random(0)
    for r in range(rounds + warm_rounds):
        # A new order every round, and a collected heap before each
        # configuration: a rotation keeps each configuration behind the same
        # one, and a peer's garbage (or its allocator and cache footprint)
        # then lands in one configuration's steps every round (seen here:
        # hookcap every=10 read -1.5 % on both workloads, run after run).
        for c in order.sample(cfgs, len(cfgs)):
            gc.collect()
            c.attach(model)

            def step():
                with c.wrap():
                    loss_fn().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                c.after_step()

            samples = []
            for s in range(steps_per_round):
                t = clock(step)
                if r >= warm_rounds and s > 0:  # first step after attach is warm-up
                    samples.append(t)
            c.detach()
            if samples:
                times[c.name].extend(samples)
                by_round[c.name].append(statistics.median(samples))
    base_mean = statistics.fmean(times["no telemetry"])
    rows = []
    for c in cfgs:
        med = statistics.median(times[c.name])
        mean = statistics.fmean(times[c.name])
        ratio = statistics.median(x / b for x, b in zip(by_round[c.name], by_round["no telemetry"]))
        rows.append({"config": c.name, "median_ms": med * 1e3, "ratio": ratio,
                     "overhead_pct": 100 * (ratio - 1), "mean_ms": mean * 1e3,
                     "mean_overhead_pct": 100 * (mean / base_mean - 1),
                     "samples": len(times[c.name]), "note": c.note})
    for name, why in skip.items():
        rows.append({"config": name, "skipped": why})
    extra = {"model": getattr(loss_fn, "model_name", workload)}
    if device.type == "cuda":
        extra["sync_check"] = sync_check(model, loss_fn, opt)
    return rows, extra


def interleaved(steps: dict, clock, rounds: int, steps_per_round: int, warm_rounds: int, stop=None):
    """Time each named step function ``steps_per_round`` times per round, the
    first of each round not kept, in a new random order every round with a
    collected heap before each, over ``warm_rounds`` + ``rounds`` rounds;
    ``stop(measured_rounds)`` after a measured round may end the run early.
    Returns (times, by_round): per name every kept sample, and each measured
    round's median (seconds)."""
    times = {name: [] for name in steps}
    by_round = {name: [] for name in steps}
    order = random.Random(0)
    for r in range(rounds + warm_rounds):
        for name in order.sample(list(steps), len(steps)):
            gc.collect()
            samples = [clock(steps[name]) for _ in range(steps_per_round)][1:]
            if r >= warm_rounds:
                times[name].extend(samples)
                by_round[name].append(statistics.median(samples))
        if r >= warm_rounds and stop is not None and stop(r - warm_rounds + 1):
            break
    return times, by_round


def paired_row(name: str, times: dict, by_round: dict, base: str = "no telemetry") -> dict:
    """A configuration's median step and its overhead over ``base``, paired by round."""
    ratio = statistics.median(x / b for x, b in zip(by_round[name], by_round[base]))
    return {"config": name, "median_ms": statistics.median(times[name]) * 1e3, "ratio": ratio,
            "overhead_pct": 100 * (ratio - 1), "samples": len(times[name])}


COMPILED_CONFIGS = (
    ("no telemetry", None),
    ("op histogram=None", {"histogram": None}),
    ("op log2 hist", {}),
)


def measure_compiled(workload, device, rounds, steps_per_round, warm_rounds):
    """--compile: one compiled model instance per configuration, interleaved
    round by round as in :func:`measure`; returns (rows, extra)."""
    torch._dynamo.config.skip_nnmodule_hook_guards = False  # each instance its own graphs
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    runs = {}
    for name, kw in COMPILED_CONFIGS:
        model, loss_fn = compiled_workload(workload, device)
        mon = None if kw is None else hookcap.Monitor(model, capture=("output", "grad_output"), **kw).attach()
        model.compile()
        runs[name] = (model, loss_fn, torch.optim.SGD(model.parameters(), lr=1e-3), mon)

    def train_step(loss_fn, opt, mon):
        def step():
            loss_fn().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if mon is not None:
                mon.step()
        return step

    steps = {name: train_step(loss_fn, opt, mon) for name, (_, loss_fn, opt, mon) in runs.items()}
    times, by_round = interleaved(steps, timer(device), rounds, steps_per_round, warm_rounds)
    rows = []
    for name, (_, _, _, mon) in runs.items():
        row = paired_row(name, times, by_round)
        if mon is not None:
            row["captured_bytes"] = captured_bytes(mon.history())  # what the op reads per step
            mon.detach()
        rows.append(row)
    return rows, {"model": getattr(runs["no telemetry"][1], "model_name", workload)}


def captured_bytes(h) -> int:
    """Bytes of float32 values a Monitor's last recorded step captured (what
    the op reads once): its columns' counts, times 4."""
    return int(sum(h["count"][-1][~np.isnan(h["count"][-1])]) * 4)


def compiled_table(rows, title):
    lines = [title, f"{'config':28s} {'median ms':>10s} {'ratio':>7s} {'overhead':>9s} {'op reads/step':>21s}",
             "-" * 80]
    for r in rows:
        mb = f"{r['captured_bytes'] / 1e6:10.2f} MB" if "captured_bytes" in r else ""
        lines.append(f"{r['config']:28s} {r['median_ms']:10.1f} {r['ratio']:7.3f} {r['overhead_pct']:+8.1f}% {mb:>21s}")
    return "\n".join(lines)


def sync_check(model, loss_fn, opt):
    """One hookcap step under set_sync_debug_mode('error'): raises on any host sync."""
    mon = hookcap.Monitor(model, capture=("output", "grad_output")).attach()
    for _ in range(3):  # discover metrics, grow the ring, fill the drain
        loss_fn().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mon.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss_fn().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mon.step()
        result = "no host sync in a steady-state hookcap step"
    except RuntimeError as e:
        result = f"SYNC DETECTED: {e}"
    finally:
        torch.cuda.set_sync_debug_mode(0)
        mon.detach()
    return result


def per_hook_cost(device, n_modules=200, reps=40):
    """Host µs per hook on a tiny tensor: a chain of identity modules with and
    without a Monitor recording outputs, in steady state (``step()`` between
    timed forward passes, as in training: without it every pass would be a new
    call of each module and register a new row). Two numbers per histogram
    setting: ``added`` is everything the Monitor adds per module call,
    PyTorch's hook dispatch included; ``hook`` is the hook itself, call to
    return: ``added`` minus what a no-op forward hook adds (the dispatch any
    hook-based tool pays)."""

    class Id(nn.Module):
        def forward(self, x):
            return x * 1.0

    model = nn.Sequential(*[Id() for _ in range(n_modules)]).to(device)
    x = torch.randn(4, device=device)

    def fwd():
        model(x)
        if device.type == "cuda":
            torch.cuda.synchronize()

    def timed():
        t = time.perf_counter()
        fwd()
        return time.perf_counter() - t

    def noop_pass():
        handles = [m.register_forward_hook(lambda mod, args, out: None) for m in model]
        t = timed()
        for h in handles:
            h.remove()
        return t

    def monitor_pass(mon):
        def run():
            mon.attach()
            fwd()  # a first call of each module after attach: the general path
            mon.step()
            t = timed()
            mon.step()
            mon.detach()
            return t
        return run

    mons = {label: hookcap.Monitor(model, capture="output", **kw)
            for label, kw in (("log2 hist", {}), ("no hist", {"histogram": None}))}
    passes = {"base": timed, "noop": noop_pass, **{label: monitor_pass(mon) for label, mon in mons.items()}}
    # Round-robin, one forward pass of each configuration per round in a
    # rotating order, each paired with its own round's bare pass: drift on a
    # busy machine hits the pairs alike.
    names = list(passes)
    diffs = {name: [] for name in names[1:]}
    for r in range(3 * reps):
        k = r % len(names)
        t = {name: passes[name]() for name in names[k:] + names[:k]}
        for name in diffs:
            diffs[name].append((t[name] - t["base"]) / n_modules * 1e6)
    dispatch = statistics.median(diffs["noop"])
    out = {"no-op hook (PyTorch dispatch)": dispatch}
    for label, mon in mons.items():
        added = statistics.median(diffs[label])
        out[f"{label}: added"] = added
        out[f"{label}: hook"] = added - dispatch
        direct = direct_hook_cost(model, x, mon, reps)
        out[f"{label}: hook, called directly"] = direct["C"]
        out[f"{label}: its Python hook, called directly"] = direct["Python"]
    out.update(tap_off_cost(x, model))
    return out


def direct_hook_cost(model, x, mon, reps):
    """µs per call of the Monitor's forward hook, called directly on each
    module's own output in module order, one call per module and step (as a
    forward pass calls it), less the same loop calling a no-op: the hook
    alone, without the module calls around it whose noise the ``hook`` row
    (a difference of two forward passes) carries on a busy machine.
    ``{"C": the registered hook, "Python": the Python hook it stands for}``
    (which eval-mode calls and dynamo take), measured round-robin."""
    outs = [m(x) for m in model]  # before attach: these calls record nothing
    mon.attach()
    model(x)
    mon.step()
    registered = [next(iter(m._forward_hooks.values())) for m in model]
    loops = {"C": [(m, h, out) for m, h, out in zip(model, registered, outs)],
             "Python": [(m, h.args[0][3], out) for m, h, out in zip(model, registered, outs)],
             "no-op": [(m, lambda mod, args, out: None, out) for m, out in zip(model, outs)]}

    def loop(calls):
        t = time.perf_counter()
        for m, h, out in calls:
            h(m, (x,), out)
        return (time.perf_counter() - t) / len(calls) * 1e6

    us = {name: [] for name in loops}
    for _ in range(reps):
        for name, calls in loops.items():
            us[name].append(loop(calls))
            if name != "no-op":
                mon.step()
    mon.detach()
    empty = statistics.median(us["no-op"])
    return {name: statistics.median(us[name]) - empty for name in ("C", "Python")}


def tap_off_cost(x, model, calls=100_000):
    """µs per ``hookcap.tap`` call that records nothing (no Monitor; an
    off-step of ``every=2``), less an empty Python call's time."""
    def per_call(fn):
        t = time.perf_counter()
        for _ in range(calls):
            fn(x, "t")
        return (time.perf_counter() - t) / calls * 1e6

    empty = min(per_call(lambda a, b: None) for _ in range(3))
    out = {"tap, no Monitor": min(per_call(hookcap.tap) for _ in range(3)) - empty}
    mon = hookcap.Monitor(model, capture="output", every=2).attach()
    mon.step()  # step 1: an off-step
    out["tap, off-step"] = min(per_call(hookcap.tap) for _ in range(3)) - empty
    mon.detach()
    return out


def table(rows, title):
    # ratio/overhead: paired by round (see the module docstring); mean ovh:
    # mean step over the baseline's mean step (outliers included).
    lines = [title, f"{'config':30s} {'median ms':>10s} {'ratio':>7s} {'overhead':>9s} "
                    f"{'mean ovh':>9s}  note", "-" * 110]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['config']:30s} {'skipped: ' + r['skipped']}")
            continue
        lines.append(f"{r['config']:30s} {r['median_ms']:10.1f} {r['ratio']:7.3f} "
                     f"{r['overhead_pct']:+8.1f}% {r['mean_overhead_pct']:+8.1f}%  {r['note']}")
    return "\n".join(lines)


def write_json(path, result):
    """``result`` to ``path`` (if given), its folder made if missing."""
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {path}")


def main(argv=None):
    global GPT2_TOKENS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="gpt2,cnn")
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--steps-per-round", type=int, default=6)
    p.add_argument("--warm-rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None)
    p.add_argument("--compile", action="store_true",
                   help="compiled models: no telemetry and the op (see the module docstring)")
    p.add_argument("--hooks-only", action="store_true", help="only the per-hook host cost table")
    p.add_argument("--gpt2-tokens", type=int, default=GPT2_TOKENS, help="GPT-2 sequence length (batch 8)")
    p.add_argument("--configs", default=None,
                   help="comma-separated substrings: measure only the configurations whose name "
                        "contains one (the baseline always runs), e.g. 'every=10'")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device is available")
    torch.set_num_threads(args.threads)
    cpu = machine_info(args.device)["cpu"]
    result = {"machine": {"cpu": cpu, "threads": args.threads, "torch": torch.__version__,
                          "device": str(device), "build": hookcap.build_info()}, "workloads": {}}
    print(f"# {cpu}, {args.threads} threads, torch {torch.__version__}, device {device}")
    GPT2_TOKENS = result["gpt2_tokens"] = args.gpt2_tokens
    if args.compile:
        result["compiled"] = True
        for w in args.workloads.split(","):
            rows, extra = measure_compiled(w, device, args.rounds, args.steps_per_round, args.warm_rounds)
            result["workloads"][w] = {"rows": rows, **extra}
            print(compiled_table(rows, f"\n## {w} ({extra['model']}), compiled"))
        write_json(args.json, result)
        return
    for w in [] if args.hooks_only else args.workloads.split(","):
        rows, extra = measure(w, device, args.rounds, args.steps_per_round, args.warm_rounds,
                              [k for k in args.configs.split(",") if k] if args.configs else None)
        result["workloads"][w] = {"rows": rows, **extra}
        print(table(rows, f"\n## {w} ({extra['model']})"))
        if "sync_check" in extra:
            print(f"sync check: {extra['sync_check']}")
    if not args.hooks_only and (not args.configs or "groups" in args.configs):
        import bench_groups

        print("\n## grouped op vs the ungrouped op on the same tensor (target: <= 1.3 x; bench_groups.py)")
        result["groups_op"] = bench_groups.measure(device, 8 * 1024, 7)
    hooks = per_hook_cost(device)
    result["per_hook_us"] = hooks
    print("\n## per-hook host cost (tiny tensor, steady state; target: hook <= 0.5 µs)")
    print("  added = all the Monitor adds per module call, PyTorch's hook dispatch included;")
    print("  hook  = hook call to return (added minus a no-op forward hook);")
    print("  called directly = the hook called on each module's output in turn, less a no-op's call;")
    print("  its Python hook = what the registered C hook stands for (eval mode, dynamo), interleaved")
    for k, v in hooks.items():
        print(f"{k:30s} {v:6.2f} µs")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
