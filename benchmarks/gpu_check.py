"""One command for a machine with a CUDA GPU: build hookcap, test it, benchmark it.

  python benchmarks/gpu_check.py OUTDIR [--skip-build] [--quick] [--budget S] [--device cuda|cpu]

Steps, each recorded in OUTDIR/gpu_check.json as {name, ok, seconds, details | error};
a failing step does not stop the later ones:
  environment  torch, CUDA, GPU (name, capability, SMs, memory, driver), python, git, CPUs.
               --device cuda without a usable GPU: the JSON says so and the exit code is 2.
  build        python setup.py build_ext --inplace for the visible GPU's architecture
               (OUTDIR/build.log), then hookcap.build_info() in a fresh process: CUDA kernels?
  tests        pytest tests/test_cuda.py (CUDA vs CPU kernels, Monitor on cuda):
               OUTDIR/tests.log, OUTDIR/tests.xml; a skipped module counts as a failure.
  compiled     GPT-2 (benchmarks/_gpt2.py) with 4 of GPT-2-124M's 12 layers, full width,
               B=8, T=1024, bf16 autocast, compiled with torch.compile, one instance per
               configuration: no telemetry and the accumulate op (histogram=None), interleaved
               round by round; compile seconds per instance; each configuration's device time
               per step by kernel (benchmarks/_profile_steps.py); Inductor's code of each
               configuration's first step in OUTDIR/code_<config>.txt (OUTDIR/compiled.log).
  kernel       GB/s of hookcap._ops.accumulate against a device-to-device copy (2x bytes),
               float32/bfloat16/float8_e4m3fn x 1e4..1e9 elements x every histogram path of
               the kernel, plus strided views; each dtype's results checked at 1e6 elements
               against the CPU op and the float64 reference (OUTDIR/kernel.log).
  overhead     GPT-2 124M (B=8, T=1024, AdamW, bf16 autocast) training step: no telemetry vs
               hookcap every=1, every=10 and every=1 with capture "attention", interleaved round by
               round, the grouped op against the ungrouped one (bench_groups), and one layer's attention
               observation by the GPU's logit tile size; the steady-state steps
               run under torch.cuda.set_sync_debug_mode("error") (OUTDIR/overhead.log); then
               no telemetry and every=1 profiled, device time per step by kernel.
               transformers' GPT2LMHeadModel if importable and sync-free on its own, else the
               same model built in benchmarks/_gpt2.py; the JSON says which ran.
Then OUTDIR/gpu_check.json and OUTDIR/summary.md (also printed). Exit code 0 if every step
passed, 1 if not. At most about 10 minutes: each step has a time limit, cut to what is left
of the run's budget.

--quick: kernel sizes up to 1e7, a 2-layer GPT-2 at T=256, fewer rounds.
--device cpu: only exercises this script's code paths without a GPU (no build, no tests,
tiny kernel sizes timed with perf_counter, a tiny GPT-2 without autocast or sync checks).

This process never imports hookcap: the build replaces the extension under it. build_info,
the compiled, kernel and overhead steps each run in a fresh child process of this script
(--stage NAME), which also keeps a crashed CUDA context from taking later steps with it.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gc
import importlib.util
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import types
import xml.etree.ElementTree as ET

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TOTAL_BUDGET_S = 580  # the whole run; each step's limit is cut to what is left of it
STEP_LIMIT_S = {"build": 300, "build_info": 120, "tests": 240, "kernel": 180, "overhead": 200, "compiled": 300}
# tests/test_cuda.py's module-level skip reason: seen on a GPU machine, the kernels were not found.
MODULE_SKIP = "no CUDA device visible"
KERNEL_HEADER = "| dtype | elements | layout | op | µs/call | GB/s | × copy |"


def log(msg: str) -> None:
    print(f"[gpu_check] {msg}", flush=True)


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class StepFailed(Exception):
    """A step that ran but did not pass; ``details`` are recorded all the same."""

    def __init__(self, message: str, details: dict | None = None):
        super().__init__(message)
        self.details = details or {}


def sci(n: int) -> str:
    """10**k -> "1ek" (every size here is a power of ten)."""
    return f"1e{round(math.log10(n))}"


def run_step(name: str, fn, announce: bool = True) -> dict:
    """Run ``fn() -> details``; never raises: failures become {ok: False, error}.
    ``announce``: print the start and end lines (a child's parent prints them)."""
    if announce:
        log(f"step {name} ...")
    t0 = time.perf_counter()
    rec = {"name": name, "ok": True}
    try:
        rec["details"] = fn()
    except StepFailed as e:
        rec.update(ok=False, error=str(e), details=e.details)
    except Exception:
        rec.update(ok=False, error=traceback.format_exc())
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    if announce:
        last = rec.get("error", "").strip().splitlines()[-1:] or [""]
        log(f"step {name}: {'ok' if rec['ok'] else 'FAILED: ' + last[0]} ({rec['seconds']:.1f} s)")
    return rec


class Runner:
    """Runs child commands in the repository root with hookcap on the path,
    each under its step's time limit and within the run's total budget."""

    def __init__(self, args):
        self.args = args
        self.deadline = time.monotonic() + args.budget
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))

    def limit(self, step: str) -> float:
        return max(10.0, min(STEP_LIMIT_S[step], self.deadline - time.monotonic()))

    def run(self, cmd: list, log_name: str, step: str, echo: bool, env: dict | None = None):
        """(exit code or None on timeout, last lines of output); all output in OUTDIR/log_name."""
        limit = self.limit(step)
        tail = collections.deque(maxlen=60)
        with open(os.path.join(self.args.outdir, log_name), "w") as logf:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env or self.env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, errors="replace",
                                    start_new_session=True)

            def pump():
                for line in proc.stdout:
                    logf.write(line)
                    tail.append(line)
                    if echo:
                        print(line, end="", flush=True)

            reader = threading.Thread(target=pump, daemon=True)
            reader.start()
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the child and its compilers
                proc.wait()
                rc = None
            reader.join(10)
            if rc is None:
                note = f"\n[gpu_check] killed after its time limit of {limit:.0f} s\n"
                logf.write(note)
                tail.append(note)
        return rc, "".join(tail)

    def stage(self, name: str) -> dict:
        """Run ``--stage name`` in a child; its details, or StepFailed."""
        out = os.path.join(self.args.outdir, f"{name}.stage.json")
        if os.path.exists(out):
            os.remove(out)
        # The child is told when it will be stopped (wall clock), so it can leave out extras.
        deadline = time.time() + self.limit(name) - 10
        cmd = [sys.executable, os.path.abspath(__file__), self.args.outdir, "--stage", name,
               "--device", self.args.device, "--stage-deadline", f"{deadline:.0f}"] + (
                   ["--quick"] if self.args.quick else [])
        rc, tail = self.run(cmd, f"{name}.log", name, echo=name != "build_info")
        if not os.path.exists(out):
            why = "timed out" if rc is None else f"exited with code {rc} before writing its result"
            raise StepFailed(f"{name} stage {why}; see {name}.log", {"log_tail": tail})
        with open(out) as f:
            res = json.load(f)
        os.remove(out)
        if not res["ok"]:
            raise StepFailed(res["error"], res.get("details"))
        return res["details"]


# -- environment --------------------------------------------------------------------------------


def command_output(cmd: list) -> str | None:
    """stdout of cmd (stripped), or None when the program is missing or fails."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment() -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform(), "cpu": cpu_model(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "git": command_output(["git", "describe", "--always", "--dirty"]),
            "cuda_available": torch.cuda.is_available()}
    if info["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        info.update(device_count=torch.cuda.device_count(), gpu=p.name, capability=[p.major, p.minor],
                    sm_count=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                    driver=command_output(["nvidia-smi", "--query-gpu=driver_version",
                                           "--format=csv,noheader", "--id=0"]))
    return info


# -- build --------------------------------------------------------------------------------------


def build(runner: Runner, env_info: dict) -> dict:
    args = runner.args
    details = {}
    if args.device == "cpu" or args.skip_build:
        details["build"] = f"skipped ({'--device cpu' if args.device == 'cpu' else '--skip-build'})"
    else:
        arch = "{}.{}".format(*env_info["capability"])
        # FORCE_CUDA: a toolkit problem fails here, not as a CPU-only build found later.
        env = dict(runner.env, TORCH_CUDA_ARCH_LIST=arch, MAX_JOBS=str(os.cpu_count() or 1),
                   HOOKCAP_FORCE_CUDA="1")
        log(f"building for sm {arch} with {env['MAX_JOBS']} jobs (log: build.log)")
        t0 = time.perf_counter()
        rc, tail = runner.run([sys.executable, "setup.py", "build_ext", "--inplace"], "build.log", "build",
                              echo=False, env=env)
        details.update(build=f"python setup.py build_ext --inplace, TORCH_CUDA_ARCH_LIST={arch}",
                       build_seconds=round(time.perf_counter() - t0, 1))
        if rc != 0:
            why = "timed out" if rc is None else f"failed (exit code {rc})"
            raise StepFailed(f"build {why}; see build.log", {**details, "log_tail": tail})
    try:
        details["build_info"] = runner.stage("build_info")
    except StepFailed as e:
        raise StepFailed(f"import hookcap / build_info() failed: {e}", {**details, **e.details}) from None
    info = details["build_info"]
    if args.device == "cuda" and not info.get("cuda"):
        raise StepFailed(f"hookcap.build_info() says CUDA kernels were not compiled: {info.get('cuda_reason')}",
                         details)
    return details


# -- tests --------------------------------------------------------------------------------------


def junit_counts(path: str) -> dict:
    suites = ET.parse(path).getroot()
    suites = [suites] if suites.tag == "testsuite" else suites.findall("testsuite")
    c = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    c["passed"] = c["tests"] - c["failures"] - c["errors"] - c["skipped"]
    c["failed_tests"], reasons = [], collections.Counter()
    for case in (case for s in suites for case in s.iter("testcase")):
        if case.find("failure") is not None or case.find("error") is not None:
            c["failed_tests"].append(f"{case.get('classname')}::{case.get('name')}")
        skip = case.find("skipped")
        if skip is not None:
            reasons[skip.get("message", "")] += 1
    c["skip_reasons"] = dict(reasons)  # reason -> number of tests
    return c


def tests(runner: Runner) -> dict:
    if runner.args.device == "cpu":
        return {"not_run": "--device cpu: tests/test_cuda.py needs a GPU"}
    if importlib.util.find_spec("pytest") is None:
        raise StepFailed(f"pytest is not importable by {sys.executable}: pip install pytest hypothesis")
    xml = os.path.join(runner.args.outdir, "tests.xml")
    if os.path.exists(xml):  # an earlier run's report must not pass for this one's
        os.remove(xml)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", f"--junitxml={xml}",
           "tests/test_cuda.py"]
    rc, tail = runner.run(cmd, "tests.log", "tests", echo=False)
    if not os.path.exists(xml):
        raise StepFailed(f"pytest {'timed out' if rc is None else f'exited with code {rc}'} without a report; "
                         "see tests.log", {"log_tail": tail})
    c = junit_counts(xml)
    c["command"] = " ".join(cmd[1:])
    log(f"tests: {c['passed']} passed, {c['failures'] + c['errors']} failed, {c['skipped']} skipped")
    if any(MODULE_SKIP in r for r in c["skip_reasons"]):
        raise StepFailed("tests/test_cuda.py was skipped on a GPU machine: the CUDA kernels were not found", c)
    if rc != 0 or c["passed"] == 0:
        raise StepFailed(f"pytest exit code {rc}: {len(c['failed_tests'])} failed: "
                         + ", ".join(c["failed_tests"][:10]), {**c, "log_tail": tail})
    return c


# -- kernel stage (child process) ---------------------------------------------------------------


def hist_kinds(Histogram) -> dict:
    """label -> (Histogram or None, the kernel path it takes on an H100: hist_plan in
    csrc/cuda/stats_kernel.cuh, moments: 2 or 4). Data is randn, so a linear range
    of +-4 is realistic."""
    return {
        "none": (None, "no histogram", 2),
        "log2": (Histogram.log2(), "log2, exponent byte counted per warp (lo >= -126)", 2),
        "log2 lo=-140": (Histogram.log2(-140, 64), "log2 in shared memory (bins below float normals)", 2),
        "linear 100": (Histogram.linear(-4, 4, 100), "linear in shared memory, float thresholds", 2),
        "linear 4096": (Histogram.linear(-4, 4, 4096), "linear in shared memory (dynamic, 32.8 KB)", 2),
        "linear 6800": (Histogram.linear(-4, 4, 6800), "linear in shared memory (dynamic, 54.4 KB: > 48 KB opt-in)",
                        2),
        "linear 10000": (Histogram.linear(-4, 4, 10000), "wide: counts by warp-aggregated atomics", 2),
        "linear 20000": (Histogram.linear(-4, 4, 20000), "wide-exact: bins in double", 2),
        "log2 moments=4": (Histogram.log2(), "log2 with m3, m4, skew, kurtosis (the kM4 specialisation)", 4),
    }


def check_input(n: int, dtype: torch.dtype) -> torch.Tensor:
    """randn * 3 with 1/40 each of NaN, +inf, -inf and -0.0 (fp8 e4m3fn turns inf into NaN)."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * 3
    idx = torch.randperm(n, generator=g)
    k = n // 40
    for i, v in enumerate((float("nan"), float("inf"), float("-inf"), -0.0)):
        x[idx[i * k:(i + 1) * k]] = v
    return x.to(dtype)


def stats_mismatches(got: dict, want: dict, abs_sum: float) -> list:
    """Counts, extrema and histogram bins exact; sum to 1e-5 of sum|x|, sumsq to 1e-5;
    with moments=4, m4 and kurtosis to 5e-6 (docs/statistics.md)."""
    import numpy as np

    bad = []
    for k in ("count", "nan", "posinf", "neginf", "zeros", "min", "max", "absmax"):
        if not (got[k] == want[k] or (np.isnan(got[k]) and np.isnan(want[k]))):
            bad.append(f"{k}: {got[k]!r} != {want[k]!r}")
    for k, tol in (("sum", 1e-5 * abs_sum), ("sumsq", 1e-5 * want["sumsq"])):
        if not abs(got[k] - want[k]) <= tol:
            bad.append(f"{k}: {got[k]!r} vs {want[k]!r} (tol {tol:g})")
    for k in ("m4", "kurtosis"):
        if k in want and np.isfinite(want[k]) and not abs(got[k] - want[k]) <= 5e-6 * abs(want[k]):
            bad.append(f"{k}: {got[k]!r} vs {want[k]!r} (rtol 5e-6)")
    if "hist" in want and not np.array_equal(got["hist"], want["hist"]):
        bad.append(f"hist: {int(np.abs(got['hist'] - want['hist']).sum())} counts differ")
    return bad


def correctness(device: str, dtypes: dict, kinds: dict, n: int = 10**6) -> list:
    """The op on ``device`` against the CPU op (when device is cuda) and the float64 reference."""
    import hookcap

    out = []
    for dname, dtype in dtypes.items():
        x = check_input(n, dtype)
        a = x.double()
        abs_sum = float(a[a.isfinite()].abs().sum())
        for label, (h, _, m) in kinds.items():
            got = hookcap.tensor_stats(x.to(device), h, moments=m)
            refs = {"float64 reference": hookcap.reference.tensor_stats(x, h, moments=m)}
            if device != "cpu":
                refs["cpu op"] = hookcap.tensor_stats(x, h, moments=m)
            for against, want in refs.items():
                bad = stats_mismatches(got, want, abs_sum)
                out.append({"dtype": dname, "elements": n, "hist": label, "against": against, "ok": not bad,
                            "count": got["count"], "nan": got["nan"], "min": got["min"], "max": got["max"],
                            "sum": got["sum"], "mismatches": bad})
        log(f"  correctness {dname} at {sci(n)}: "
            + ("ok" if all(r["ok"] for r in out if r["dtype"] == dname) else "MISMATCH"))
    return out


def kernel_stage(args) -> dict:
    import bench_kernel
    import hookcap

    cuda = args.device == "cuda"
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    details = {"timer": "CUDA events" if cuda else "perf_counter", "skipped_points": [],
               "torch_threads": torch.get_num_threads()}
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is None:
        details["skipped_points"].append({"dtype": "float8_e4m3fn", "reason": f"torch {torch.__version__} has none"})
    else:
        try:  # the op and the copy both take fp8 on this device?
            probe = torch.zeros(8, device=args.device).to(fp8)
            hookcap.tensor_stats(probe)
            torch.empty_like(probe).copy_(probe)
            dtypes["float8_e4m3fn"] = fp8
        except RuntimeError as e:
            details["skipped_points"].append({"dtype": "float8_e4m3fn", "reason": str(e).splitlines()[0]})
    kinds = hist_kinds(hookcap.Histogram)
    details["hist_kinds"] = {label: path for label, (_, path, _) in kinds.items()}

    details["correctness"] = correctness(args.device, dtypes, kinds)

    if cuda:
        sizes = [10**k for k in range(4, 8 if args.quick else 10)]
        sample, budget, min_rounds = bench_kernel.sample_cuda, 0.2, 3
    else:
        sizes = [10**4, 10**5]
        sample, budget, min_rounds = bench_kernel.sample_cpu, 0.02, 1
    details.update(sizes=sizes, budget_s_per_config=budget, min_rounds=min_rounds)
    rows = []
    copy_gbps = {}
    # Inputs under 4x the L2 are read (partly) from cache or are launch-bound:
    # their "x copy" says nothing of memory speed (the table leaves it out).
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size if cuda else 0
    details["l2_bytes"] = l2_bytes

    def fits(n: int, dtype: torch.dtype) -> bool:
        """Input, copy target and a float32 temporary (fp8 is made from one) twice over in free memory."""
        if not cuda:
            return True
        torch.cuda.empty_cache()
        need = n * (2 * dtype.itemsize + 4)
        if 2 * need <= torch.cuda.mem_get_info()[0]:
            return True
        details["skipped_points"].append({"dtype": str(dtype).split(".")[1], "elements": n,
                                   "reason": f"needs 2 x {need / 2**30:.1f} GiB free"})
        return False

    def time_point(dname: str, x: torch.Tensor, layout: str, labels: list, copy: bool,
                   ref: int | None = None) -> None:
        """ref: the contiguous size whose copy GB/s a view is compared against
        (default its own element count)."""
        nbytes = x.numel() * x.element_size()
        fns = {label: (bench_kernel.op_call(x, kinds[label][0], kinds[label][2]), nbytes) for label in labels}
        if copy:
            y = torch.empty_like(x)
            fns["copy"] = (lambda: y.copy_(x), 2 * nbytes)
        timed = bench_kernel.measure({k: fn for k, (fn, _) in fns.items()}, sample, budget, min_rounds)
        n = x.numel()
        if copy:
            copy_gbps[dname, n] = fns["copy"][1] / timed["copy"][0] / 1e9
        for label, (med, samples, _) in timed.items():
            gbps = fns[label][1] / med / 1e9
            rows.append({"dtype": dname, "elements": n, "layout": layout,
                         "op": "copy" if label == "copy" else "hookcap",
                         "hist": None if label == "copy" else label, "us_per_call": med * 1e6, "gbps": gbps,
                         "copy_fraction": gbps / copy_gbps[dname, ref or n], "copy_elements": ref or n,
                         "cache_resident": nbytes < 4 * l2_bytes,
                         "samples": samples})
        log(f"  {dname:>13} {sci(n):>3} {layout:<10}" + "".join(
            f" | {r['hist'] or 'copy'} {r['gbps']:.0f}" for r in rows[-len(timed):]) + " GB/s")

    for dname, dtype in dtypes.items():
        for n in sizes:
            if not fits(n, dtype):
                continue
            x = torch.randn(n, device=args.device, dtype=torch.float32 if dtype.itemsize == 1 else dtype).to(dtype)
            time_point(dname, x, "contiguous", list(kinds), copy=True)
            del x

    details["merge"] = merge_rows(args, dtypes, kinds, sample, budget, min_rounds)

    # Strided: a transposed view is dense and read straight from storage (element
    # order does not matter to the statistics); a column slice whose rows are
    # whole aligned 16-byte vectors is read as vectors; one whose rows are not
    # takes the element-by-element index path; padded rows (a vocabulary's row
    # padded to whole vectors, as compiled code lays out logits) are read as
    # vectors plus one pass over each row's last elements. All against the
    # contiguous copy.
    for dname in ("float32", "bfloat16"):
        n = max((m for d, m in copy_gbps if d == dname and m <= 10**8), default=None)
        if n is None:
            continue
        r = 10 ** (round(math.log10(n)) // 2)
        c = n // r
        c64 = max(64, c // 64 * 64)
        base = torch.randn(r * (max(c, c64) + 64), device=args.device, dtype=dtypes[dname])
        time_point(dname, base[:n].view(r, c).t(), "transposed", ["none", "log2"], copy=False)
        time_point(dname, base[:r * (c64 + 64)].view(r, c64 + 64)[:, :c64], "rows", ["none", "log2"],
                   copy=False, ref=n)
        time_point(dname, base[:r * (c + 1)].view(r, c + 1)[:, :c], "sliced", ["none", "log2"], copy=False)
        rp = max(2, n // PADDED_LD)
        base = base if base.numel() >= rp * PADDED_LD else torch.randn(rp * PADDED_LD, device=args.device,
                                                                       dtype=dtypes[dname])
        time_point(dname, base[:rp * PADDED_LD].view(rp, PADDED_LD)[:, :PADDED_COLS], "padded", ["none", "log2"],
                   copy=False, ref=n)
        del base
    details["strided_layouts"] = {
        "transposed": "x.view(R, C).t(): dense, read straight from storage",
        "rows": "x.view(R, C + 64)[:, :C], C a multiple of 64: rows of whole 16-byte vectors",
        "sliced": "x.view(R, C + 1)[:, :C]: not dense, element by element",
        "padded": f"x.view(R, {PADDED_LD})[:, :{PADDED_COLS}]: a compiled model's logits (rows padded to whole "
                  "vectors), vectors plus the rows' last elements"}
    details["rows"] = rows
    bad = [c for c in details["correctness"] if not c["ok"]]
    if bad:
        raise StepFailed(f"{len(bad)} correctness checks failed, first: {bad[0]['dtype']} {bad[0]['hist']} "
                         f"vs {bad[0]['against']}: {bad[0]['mismatches'][:3]}", details)
    return details


def merge_rows(args, dtypes: dict, kinds: dict, sample, budget: float, min_rounds: int) -> list:
    """The two ways a launch's blocks merge their partials (hookcap._ops.block_merge),
    timed side by side (interleaved) on the sizes a model's activations have; the
    setting is restored to what it was."""
    import bench_kernel
    from hookcap import _ops

    sizes = [10**5, 10**6, 10**7] + ([10**8] if args.device == "cuda" and not args.quick else [])
    if args.device != "cuda":
        sizes = [10**4, 10**5]
    before = _ops.block_merge()
    out = []
    try:
        for dname in ("float32", "bfloat16"):
            for n in sizes:
                x = torch.randn(n, device=args.device, dtype=dtypes[dname])
                fns = {}
                for label in ("none", "log2"):
                    call = bench_kernel.op_call(x, kinds[label][0])
                    for merge in ("direct", "tree"):
                        fns[label, merge] = (lambda call=call, merge=merge: (_ops.block_merge(merge), call()))
                timed = bench_kernel.measure(fns, sample, budget / 2, min_rounds)
                for (label, merge), (med, samples, _) in timed.items():
                    out.append({"dtype": dname, "elements": n, "hist": label, "merge": merge,
                                "us_per_call": med * 1e6, "samples": samples})
                log(f"  merge {dname:>9} {sci(n):>3}" + "".join(
                    f" | {r['hist']} {r['merge']} {r['us_per_call']:.1f}" for r in out[-len(timed):]) + " µs")
                del x
    finally:
        _ops.block_merge(before)
    return out


# -- overhead stage (child process) -------------------------------------------------------------


def gpt2_shape(device: str, quick: bool) -> dict:
    if device == "cpu":
        return dict(n_layer=1, n_embd=64, n_head=2, vocab_size=256, n_positions=32, batch=2, seq=32)
    return dict(n_layer=2 if quick else 12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024,
                batch=8, seq=256 if quick else 1024)


def gpt2_workload(shape: dict, device, use_transformers: bool | None = None):
    """(model, loss_fn, description): transformers' GPT2LMHeadModel when importable
    (or ``use_transformers``), else the built-in one in benchmarks/_gpt2.py. Random
    init, dropout off, one fixed random batch of token ids."""
    why = ""
    if use_transformers is None:
        use_transformers = importlib.util.find_spec("transformers") is not None
        why = "" if use_transformers else " (transformers not importable)"
    dims = {k: shape[k] for k in ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions")}
    torch.manual_seed(0)
    if use_transformers:
        import transformers

        transformers.logging.set_verbosity_error()
        cfg = transformers.GPT2Config(**dims, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                      bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg).to(device)
        # Named, the loss is traced into the model's graph; unnamed, transformers logs a
        # warning there that dynamo cannot trace (a graph break between logits and loss).
        model.loss_type = "ForCausalLM"
        desc = f"transformers {transformers.__version__} GPT2LMHeadModel"
    else:
        import _gpt2

        model = _gpt2.GPT2LMHeadModel(_gpt2.GPT2Config(**dims)).to(device)
        desc = "built-in GPT-2 of benchmarks/_gpt2.py" + why
    g = torch.Generator().manual_seed(0)
    x = torch.randint(shape["vocab_size"], (shape["batch"], shape["seq"]), generator=g).to(device)
    if use_transformers:
        def loss_fn():
            return model(x, labels=x).loss
    else:
        def loss_fn():
            return _gpt2.lm_loss(model(x), x)
    return model, loss_fn, desc


def strict(fn):
    """fn under torch.cuda.set_sync_debug_mode("error"): a host sync raises instead of waiting."""
    def run():
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return run


def is_sync_error(e: RuntimeError) -> bool:
    return "synchroniz" in str(e)  # "called a synchronizing CUDA operation"


def forward_backward(autocast, loss_fn) -> None:
    with autocast:
        loss = loss_fn()
    loss.backward()


def train_step(autocast, loss_fn, opt, cfg) -> None:
    """One training step of the workload under configuration ``cfg`` (its step() last)."""
    forward_backward(autocast, loss_fn)
    opt.step()
    opt.zero_grad(set_to_none=True)
    cfg.after_step()


def workload_sync(model, loss_fn, autocast) -> str | None:
    """The traceback of a host sync in one forward + backward of the bare workload
    (after two unchecked ones: lazy initialisation may sync), or None."""
    def fwd_bwd():
        forward_backward(autocast, loss_fn)

    try:
        fwd_bwd()
        fwd_bwd()
        strict(fwd_bwd)()
    except RuntimeError as e:
        if not is_sync_error(e):
            raise
        return traceback.format_exc()
    finally:
        model.zero_grad(set_to_none=True)
    return None


def overhead_stage(args) -> dict:
    import bench_overhead

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    shape = gpt2_shape(args.device, args.quick)
    rounds = 3 if not cuda else (4 if args.quick else 8)
    steps_per_round, warm_rounds = (3 if not cuda else 5), 1
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda)
    model, loss_fn, desc = gpt2_workload(shape, device)
    details = {}
    if cuda and "transformers" in desc and (tb := workload_sync(model, loss_fn, autocast)):
        # Recent transformers read a device value on the host in every forward
        # (e.g. the packed-sequence check of create_causal_mask): such a step
        # cannot show whether hookcap syncs, so the built-in GPT-2 runs instead.
        details["transformers_syncs"] = tb.strip().splitlines()[-12:]
        log(f"  {desc} syncs the host in its own step (see transformers_syncs); using the built-in GPT-2")
        del model, loss_fn
        gc.collect()
        torch.cuda.empty_cache()
        model, loss_fn, desc = gpt2_workload(shape, device, use_transformers=False)
        desc += " (transformers' GPT-2 syncs the host in its own step)"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    skip = {}
    cfgs = bench_overhead.configs(skip, only=["every=1 log2 hist", "every=10", "attention", "cadence"],
                                  optimizer=opt)
    clock = bench_overhead.timer(device)
    times = {c.name: [] for c in cfgs}
    by_round = {c.name: [] for c in cfgs}
    sync_errors, strict_steps = {}, collections.Counter()
    log(f"  {desc}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, "
        f"B={shape['batch']} T={shape['seq']}, {rounds} rounds x {steps_per_round} steps")

    order = random.Random(0)
    for r in range(rounds + warm_rounds):
        # As bench_overhead.measure: a new order every round and a collected heap
        # before each configuration, so none always runs behind the same one.
        for c in order.sample(cfgs, len(cfgs)):
            gc.collect()
            c.attach(model)

            def step():
                train_step(autocast, loss_fn, opt, c)

            samples = []
            for s in range(steps_per_round):
                steady = r >= warm_rounds and s > 0  # the first step after attach is warm-up
                check = cuda and steady and c.name not in sync_errors
                try:
                    t = clock(strict(step) if check else step)
                except RuntimeError as e:
                    if not (check and is_sync_error(e)):
                        raise
                    sync_errors[c.name] = traceback.format_exc()
                    opt.zero_grad(set_to_none=True)
                    continue
                strict_steps[c.name] += check
                if steady:
                    samples.append(t)
            c.detach()
            if samples:
                times[c.name].extend(samples)
                by_round[c.name].append(statistics.median(samples))
        if r >= warm_rounds:
            log(f"  round {r - warm_rounds + 1}/{rounds}: " + ", ".join(
                f"{name} {by_round[name][-1] * 1e3:.1f} ms" for name in by_round if by_round[name]))

    base = by_round["no telemetry"]
    rows = []
    for c in cfgs:
        t = times[c.name]
        ratio = statistics.median(x / b for x, b in zip(by_round[c.name], base)) if t else float("nan")
        rows.append({"config": c.name, "median_ms": statistics.median(t) * 1e3 if t else None, "ratio": ratio,
                     "overhead_pct": 100 * (ratio - 1), "mean_ms": statistics.fmean(t) * 1e3 if t else None,
                     "samples": len(t), "sync_checked_steps": strict_steps[c.name],
                     "sync_error": sync_errors.get(c.name)})
    details.update(model=desc, shape=shape, optimizer="AdamW(lr=1e-4)", autocast="bfloat16" if cuda else None,
                   torch_threads=torch.get_num_threads(), rounds=rounds, steps_per_round=steps_per_round,
                   warm_rounds=warm_rounds, rows=rows, skipped_configs=skip,
                   sync_debug_mode="error on every steady-state step" if cuda else "not available on cpu")
    if cuda:
        details["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    # Extras of their own: a failure here is recorded, never loses the rows above.
    for key, fn in (("read_floor", lambda: read_floor(model, cfgs, autocast, loss_fn, opt, clock, cuda)),
                    ("pipelined", lambda: pipelined(model, cfgs, autocast, loss_fn, opt, clock, rounds=2)),
                    ("profile", lambda: profile_configs(cfgs[:2], model, autocast, loss_fn, opt, device)),
                    ("groups_op", lambda: groups_op(device, args.quick)),
                    ("attention_tiles", lambda: attention_tiles(shape, device)),
                    ("many_op", lambda: many_op(model, device, 3 if args.quick else 7))):
        try:
            details[key] = fn()
        except Exception:
            details[key] = {"error": traceback.format_exc()[-2000:]}
    if sync_errors:
        who = ", ".join(sync_errors)
        hint = " (the baseline too: the workload itself syncs)" if "no telemetry" in sync_errors else ""
        first = "\n".join(next(iter(sync_errors.values())).strip().splitlines()[-15:])
        raise StepFailed(f"host sync under set_sync_debug_mode('error') in: {who}{hint}\n{first}", details)
    return details


def attention_tiles(shape: dict, device, sizes=(1 << 22, 1 << 23, 1 << 25), reps: int = 6) -> dict:
    """ms of one layer's attention observation (the workload's B, T, heads of
    64; 16-bit on a GPU, causal) beyond the attention itself, round-robin:
    the on-chip kernel (``hookcap::attention_qk``, the default there) and the
    tiles by size (``CUDA_TILE_VALUES``, in logits), whether tiles small
    enough to stay in the L2 between their passes beat fewer, larger ones
    (design.md "Attention internals: the floor")."""
    import hookcap
    from hookcap._capture import attention as A

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    heads, dtype = shape["n_embd"] // 64, torch.bfloat16 if cuda else torch.float32
    q, k = (torch.randn(shape["batch"], heads, shape["seq"], 64, device=device, dtype=dtype) for _ in range(2))

    class Attn(torch.nn.Module):
        def forward(self, q, k):
            return torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True)

    model = torch.nn.ModuleDict({"attn": Attn()})
    mon = hookcap.Monitor(model, capture="attention", detectors=[])
    saved, times = (A.CUDA_TILE_VALUES, A.TILE_VALUES, A.ON_CHIP), {n: [] for n in ("none", "on chip", *sizes)}
    try:
        for r in range(reps + 1):
            for n in times:
                if n != "none":
                    A.ON_CHIP = n == "on chip"  # hookcap::attention_qk, else tiles of n logits
                    if n != "on chip":
                        A.CUDA_TILE_VALUES = A.TILE_VALUES = n
                    mon.attach()
                sync()
                t0 = time.perf_counter()
                model["attn"](q, k)
                sync()
                if r:
                    times[n].append((time.perf_counter() - t0) * 1e3)
                if n != "none":
                    mon.step()
                    mon.detach()
    finally:
        A.CUDA_TILE_VALUES, A.TILE_VALUES, A.ON_CHIP = saved
    base = statistics.median(times.pop("none"))
    return {"shape": [shape["batch"], heads, shape["seq"], 64], "dtype": str(dtype), "attention_ms": base,
            "observe_ms": {str(n): statistics.median(v) - base for n, v in times.items()}}


def groups_op(device, quick: bool) -> list:
    """bench_groups: accumulate_groups against accumulate on the same tensor (target <= 1.3 x)."""
    import bench_groups

    return bench_groups.measure(device, 8 * 1024, 3 if quick else 7, say=lambda line: log("  " + line))


def many_op(model, device, rounds: int) -> dict:
    """The statistics of every parameter of the workload (param, param_grad):
    one accumulate_many call against one accumulate per parameter, log2
    histogram, timed round-robin (bench_groups.round_robin); on a GPU also
    the kernel launches of one call of each (torch.profiler)."""
    from hookcap import Histogram, _layout, _ops
    from hookcap.functional import new_state

    params = [p.detach() for p in model.parameters()]
    h = Histogram.log2()
    ring = torch.zeros(1, len(params), _layout.HEADER + h.nbins, dtype=torch.int64, device=device)
    state, rows = new_state(device), list(range(len(params)))
    fns = {"one per tensor": lambda: [_ops.accumulate(p, ring, state, r, h) for p, r in zip(params, rows)],
           "accumulate_many": lambda: _ops.accumulate_many(params, ring, state, rows, h)}
    import bench_groups

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = {"tensors": len(params), "elements": sum(p.numel() for p in params),
           "ms": bench_groups.round_robin(fns, rounds, sync), "launches": None}
    if cuda:
        out["launches"] = {}
        for k, fn in fns.items():
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                fn()
                sync()
            out["launches"][k] = sum(1 for e in prof.events() if "accumulate_kernel" in e.name)
    log(f"  parameter statistics, {out['tensors']} tensors: " + ", ".join(
        f"{k} {v:.3f} ms" for k, v in out["ms"].items()) + (f"; launches {out['launches']}" if cuda else ""))
    return out


def profile_configs(cfgs, model, autocast, loss_fn, opt, device) -> dict:
    """Device time per step by kernel (benchmarks/_profile_steps.py) of each
    configuration, its Monitor attached: where every-step recording's time
    goes beyond the read floor (e.g. a capture read by element)."""
    import _profile_steps

    out = {}
    for c in cfgs:
        c.attach(model)
        try:
            out.update(_profile_steps.profile_steps({c.name: lambda: train_step(autocast, loss_fn, opt, c)}, device,
                                                    top=40))
        finally:
            c.detach()
    for line in _profile_steps.summary_lines(out):
        log("  " + line)
    return out


def device_copy_gbps(clock, nbytes: int = 2 << 30) -> float:
    """Bytes moved (read + written) per second by a copy of ``nbytes`` on the CUDA device."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    clock(lambda: y.copy_(x))
    t = statistics.median(clock(lambda: y.copy_(x)) for _ in range(10))
    del x, y
    return 2 * nbytes / t / 1e9


def read_floor(model, cfgs, autocast, loss_fn, opt, clock, cuda: bool) -> dict:
    """What hookcap every=1 reads per step, and that read's time at copy bandwidth.

    The recorded metrics are taken from the every=1 Monitor's history; one
    step with plain hooks on the same modules sums the bytes of each recorded
    output (and of its gradient, the same dtype, when grad_output is recorded)."""
    import numpy as np

    mon = next(c.mon for c in cfgs if c.name.startswith("hookcap every=1"))
    h = mon.history()
    kinds = collections.defaultdict(set)
    for name in h.names:
        path, kind = name.rsplit("/", 1)
        kinds[path].add(kind)
    mods = dict(model.named_modules())
    acc = {"bytes": 0, "elements": 0}

    def hook(path):
        def f(mod, args, out):
            outs = out if isinstance(out, (tuple, list)) else [out]
            for t in outs:
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    k = ("output" in kinds[path]) + ("grad_output" in kinds[path] and t.requires_grad)
                    acc["bytes"] += k * t.numel() * t.element_size()
                    acc["elements"] += k * t.numel()
        return f

    handles = [mods[p].register_forward_hook(hook(p)) for p in kinds if p in mods]
    try:
        forward_backward(autocast, loss_fn)
        opt.zero_grad(set_to_none=True)
    finally:
        for hd in handles:
            hd.remove()
    recorded = float(np.nansum(h["count"][-1])) if len(h.steps) else float("nan")
    bw = device_copy_gbps(clock) if cuda else float("nan")
    # The cadence configuration's read per step: every gradient (param_grad), the
    # update's parameter, gradient and optimizer state, and a tenth of the activations.
    pbytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    sbytes = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
                 if isinstance(t, torch.Tensor) and t.dim() > 0)
    cadence = 3 * pbytes + sbytes + acc["bytes"] / 10
    return {"metrics": len(h.names), "modules_not_found": sorted(p for p in kinds if p not in mods),
            "captured_bytes": acc["bytes"], "captured_elements_by_hooks": acc["elements"],
            "recorded_elements_last_step": recorded, "copy_gbps": bw,
            "floor_ms": acc["bytes"] / (bw * 1e9) * 1e3 if bw == bw else None,
            "cadence_bytes": cadence, "cadence_floor_ms": cadence / (bw * 1e9) * 1e3 if bw == bw else None}


def pipelined(model, cfgs, autocast, loss_fn, opt, clock, rounds: int, steps: int = 10) -> dict:
    """ms per step over ``steps`` back-to-back steps with no host sync between
    them (one event pair around all), configurations interleaved, ``rounds``
    rounds after one warm-up round: host work overlaps the GPU as in a real loop."""
    out = {c.name: [] for c in cfgs}
    for r in range(rounds + 1):
        for c in cfgs:
            c.attach(model)

            def many():
                for _ in range(steps):
                    train_step(autocast, loss_fn, opt, c)

            if r == 0:
                many()
            else:
                out[c.name].append(clock(many) / steps * 1e3)
            c.detach()
    base = statistics.median(out["no telemetry"])
    return {"steps": steps, "rounds": rounds,
            "rows": [{"config": k, "ms_per_step": statistics.median(v),
                      "overhead_pct": 100 * (statistics.median(v) / base - 1)} for k, v in out.items()]}


PADDED_COLS, PADDED_LD = 50257, 50304  # GPT-2's vocabulary; its row stride as Inductor pads it (128 bytes)
COMPILED_LAYERS = 4
COMPILED_CONFIGS = (("no telemetry", None), ("op histogram=None", {"histogram": None}))


def compiled_stage(args) -> dict:
    """GPT-2 compiled: one instance per configuration, each Monitor attached
    for the whole run (its own graphs), interleaved rounds."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    # 4 of GPT-2-124M's 12 layers, full width: compiles of all 12 did not fit the step on an
    # H200; every layer runs the same kernels.
    shape, autocast = compiled_gpt2_setup(device, args.quick, COMPILED_LAYERS)
    rounds, steps_per_round = (3, 4) if cuda else (2, 2)

    def left() -> float:
        return math.inf if args.stage_deadline is None else args.stage_deadline - time.time()

    import bench_overhead
    from torch._dynamo.utils import counters

    runs, compile_s, compiles = {}, {}, {}
    for name, kw in COMPILED_CONFIGS:
        first = first_compiled_step(shape, device, autocast, kw)
        desc, compile_s[name] = first.desc, first.seconds
        compiles[name] = compiled_code(first.codes, first.graphs, name, args.outdir)
        runs[name] = (first.loss_fn, first.opt, first.cfg, first.mon)
        log(f"  {name}: first step (compile) {compile_s[name]} s, {compiles[name]}")
    graphs_after_first_steps = counters["stats"]["unique_graphs"]
    def stop(measured: int) -> bool:  # three compiles of a 12-layer model can take most of the step
        if left() >= 60:
            return False
        log(f"  {left():.0f} s left: stopping after {measured} measured rounds")
        return True

    steps = {name: (lambda loss_fn=loss_fn, opt=opt, cfg=cfg: train_step(autocast, loss_fn, opt, cfg))
             for name, (loss_fn, opt, cfg, _) in runs.items()}
    times, by_round = bench_overhead.interleaved(steps, bench_overhead.timer(device), rounds, steps_per_round, 1,
                                                 stop)
    rows = [{**bench_overhead.paired_row(name, times, by_round), "compile_s": compile_s[name]} for name in runs]
    import _profile_steps  # 3 steps per configuration, the Monitors still attached

    for r in rows:  # in the log at once: a later part that fails or runs out of time keeps these
        log(f"  {r['config']}: {r['median_ms']:.1f} ms per step, {r['overhead_pct']:+.1f}%")
    profile = (_profile_steps.profile_steps(steps, device, top=500) if left() > 15  # all: which kernels grew
               else {"skipped": f"{left():.0f} s left"})
    if "skipped" not in profile:
        for line in _profile_steps.summary_lines(profile):
            log("  " + line)
    op = runs["op histogram=None"][3].history()
    for _, _, _, mon in runs.values():
        if mon is not None:
            mon.detach()
    # Graphs compiled after each configuration's first step (recompiles), any configuration.
    return {"profile": profile, "compiles": compiles,
            "graphs_compiled_after_first_steps": counters["stats"]["unique_graphs"] - graphs_after_first_steps,
            "model": desc, "shape": shape, "autocast": "bfloat16" if cuda else None, "rounds": rounds,
            "steps_per_round": steps_per_round, "rows": rows, "metrics": len(op.names)}


def compiled_gpt2_setup(device: torch.device, quick: bool, layers: int) -> tuple:
    """(shape, autocast) of the compiled GPT-2 step (gpt2_shape, at most
    ``layers`` layers; bf16 autocast on CUDA), dynamo set for several watched
    instances of one class (each its own graphs)."""
    torch._dynamo.config.skip_nnmodule_hook_guards = False
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    shape = {**gpt2_shape(device.type, quick)}
    shape["n_layer"] = min(shape["n_layer"], layers)
    return shape, torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def cnn_workload(shape: dict, device):
    """(model, loss_fn, description): bench_overhead's CNN workload (resnet18,
    weights=None, 10 classes; TinyResNet without torchvision), float32, on
    ``shape["batch"]`` images of ``shape["size"]`` pixels square,
    channels-last with ``shape["channels_last"]``, else NCHW."""
    import bench_overhead

    cl = bool(shape.get("channels_last"))
    model, loss_fn = bench_overhead.cnn_workload(device, shape["batch"], shape["size"], cl, num_classes=10)
    layout = "channels-last" if cl else "NCHW"
    return model, loss_fn, (f"{loss_fn.model_name}, float32, {layout}, "
                            f"{shape['batch']} x 3 x {shape['size']} x {shape['size']}")


def first_compiled_step(shape: dict, device: torch.device, autocast, kw, tracing=None, workload=None):
    """A fresh compiled GPT-2 instance (or of ``workload(shape, device)``,
    which returns model, loss_fn and a description; Monitor kwargs ``kw``,
    None: unwatched) and its first training step, which traces and compiles (under
    the context ``tracing`` if given). Returns a namespace: loss_fn, opt, cfg
    (its step hook), mon, desc, seconds (the first step), codes (Inductor's
    modules, as run_and_get_code keeps them, without its reset of the
    instances compiled before) and graphs (compiled by that step)."""
    import contextlib
    from unittest import mock

    import hookcap
    from torch._dynamo.utils import counters
    from torch._inductor.graph import GraphLowering

    if workload is None:
        model, loss_fn, desc = gpt2_workload(shape, device, use_transformers=False)
    else:
        model, loss_fn, desc = workload(shape, device)
    mon = None if kw is None else hookcap.Monitor(model, capture=("output", "grad_output"), **kw).attach()
    model.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cfg = types.SimpleNamespace(after_step=mon.step if mon else (lambda: None))
    graphs0, codes = counters["stats"]["unique_graphs"], []
    t0 = time.perf_counter()
    with tracing or contextlib.nullcontext(), mock.patch.object(GraphLowering, "save_output_code", codes.append):
        train_step(autocast, loss_fn, opt, cfg)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return types.SimpleNamespace(loss_fn=loss_fn, opt=opt, cfg=cfg, mon=mon, desc=desc,
                                 seconds=round(time.perf_counter() - t0, 1), codes=codes,
                                 graphs=counters["stats"]["unique_graphs"] - graphs0)


def write_codes(path: str, codes: list) -> None:
    """Inductor's modules ``codes`` into one text file, each under a header."""
    with open(path, "w") as f:
        for i, code in enumerate(codes):
            f.write(f"# ===== module {i} =====\n{code}\n")


def compiled_code(codes: list, graphs: int, config: str, outdir: str) -> dict:
    """What one configuration's first step compiled: its graphs and Triton
    kernels (defined in the generated code, to hold against the profile's
    launches), the code itself written to OUTDIR/code_<config>.txt."""
    path = os.path.join(outdir, "code_" + re.sub(r"\W+", "_", config).strip("_") + ".txt")
    write_codes(path, codes)
    return {"graphs": graphs, "modules": len(codes), "triton_kernels": sum(len(re.findall(r"^@triton\.jit", c, re.M)) for c in codes),
            "file": os.path.basename(path)}


def build_info_stage(args) -> dict:
    import hookcap

    return hookcap.build_info()


STAGES = {"build_info": build_info_stage, "kernel": kernel_stage, "overhead": overhead_stage,
          "compiled": compiled_stage}


def run_stage(args) -> int:
    """Child side of Runner.stage: run one step, write {ok, details, error} for the parent."""
    sys.path[:0] = [p for p in (ROOT, HERE) if p not in sys.path]
    if args.device == "cpu":
        torch.set_num_threads(1)  # steadier on a small shared machine; the cpu mode only exercises code
    rec = run_step(args.stage, lambda: STAGES[args.stage](args), announce=False)
    path = os.path.join(args.outdir, f"{args.stage}.stage.json")
    with open(path + ".tmp", "w") as f:
        json.dump(rec, f, default=str)
    os.replace(path + ".tmp", path)
    return 0 if rec["ok"] else 1


# -- summary ------------------------------------------------------------------------------------


def step_note(s: dict) -> str:
    d = s.get("details") or {}
    if not s["ok"]:
        return ((s.get("error") or "").strip().splitlines() or [""])[-1][:160].replace("|", "/")
    if "not_run" in d:
        return d["not_run"]
    if s["name"] == "environment":
        return f"{d.get('gpu', 'no GPU')}, torch {d['torch']}, CUDA {d['torch_cuda']}"
    if s["name"] == "build":
        info = d.get("build_info", {})
        return f"{d['build']}; CUDA kernels: {info.get('cuda')}, arch {info.get('arch_list')}"
    if s["name"] == "tests":
        return f"{d['passed']} passed, {d['failures'] + d['errors']} failed, {d['skipped']} skipped"
    if s["name"] == "kernel":
        c = d["correctness"]
        return f"{len(d['rows'])} rows; correctness {sum(r['ok'] for r in c)}/{len(c)}"
    if s["name"] in ("overhead", "compiled"):
        return ", ".join(f"{r['config']} {r['overhead_pct']:+.1f}%" for r in d["rows"][1:])
    return ""


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def target_lines(by_name: dict) -> list[str]:
    """The speed targets this run measures, each with its figure (or why it
    has none): docs/performance.md's GPU table comes from these lines."""
    rows = []
    k = by_name.get("kernel", {})
    bf16 = [r for r in k.get("rows", []) if r["dtype"] == "bfloat16" and r["elements"] == 10**9
            and r["layout"] == "contiguous" and r["hist"] == "log2"]
    frac = bf16[0]["copy_fraction"] if bf16 else None
    rows.append(("bfloat16 default log2 at 1e9 elements", "≥ 0.95 × copy",
                 None if frac is None else f"{frac:.2f} × copy", frac is not None and frac >= 0.95))
    o = by_name.get("overhead", {})
    pl = {r["config"]: r for r in o.get("pipelined", {}).get("rows", [])}
    floor = o.get("read_floor", {}).get("floor_ms")
    base, every1 = pl.get("no telemetry"), pl.get("hookcap every=1 log2 hist")
    if base and every1 and floor is not None and math.isfinite(floor):
        extra = every1["ms_per_step"] - base["ms_per_step"]
        rows.append(("every-step recording, no host sync", "≤ 1.25 × the read floor",
                     f"{extra / floor:.2f} × ({extra:.2f} ms over {floor:.2f} ms)", extra / floor <= 1.25))
    else:
        rows.append(("every-step recording, no host sync", "≤ 1.25 × the read floor", None, False))
    side = pl.get("hookcap every=1 log2 hist, side stream")
    if base and every1 and side:
        rows.append(("every-step recording on the side stream, no host sync", "beats the current stream",
                     f"{side['overhead_pct']:+.2f} % (current stream: {every1['overhead_pct']:+.2f} %)",
                     side["ms_per_step"] < every1["ms_per_step"]))
    else:
        rows.append(("every-step recording on the side stream, no host sync", "beats the current stream", None, False))
    cad = next((r for name, r in pl.items() if name.startswith("hookcap cadence")), None)
    cfloor = o.get("read_floor", {}).get("cadence_floor_ms")
    floor_pct = (f" (its read floor: {100 * cfloor / base['ms_per_step']:.2f} %)"
                 if cad and base and cfloor is not None and math.isfinite(cfloor) else "")
    rows.append(("grads + updates every step, activations every 10, no host sync", "≤ 1 % of the step",
                 f"{cad['overhead_pct']:+.2f} %{floor_pct}" if cad else None,
                 cad is not None and cad["overhead_pct"] <= 1.0))
    attn = pl.get("hookcap every=1 + attention")
    if base and every1 and attn:
        extra = attn["overhead_pct"] - every1["overhead_pct"]
        rows.append(("attention internals every step, beyond outputs and gradients (on chip: "
                     "hookcap::attention_qk, estimated 2.1–2.8 % by its work)", "≤ 2 % of the step",
                     f"{extra:+.2f} % (with outputs and gradients: {attn['overhead_pct']:+.2f} %)", extra <= 2.0))
    else:
        rows.append(("attention internals every step, beyond outputs and gradients", "≤ 2 % of the step", None,
                     False))
    grouped = [r for r in o.get("groups_op", []) if not r["case"].startswith("channels")]
    if grouped:  # heads and experts; one-channel groups are Channels' (docs/attention-moe.md)
        worst = max(grouped, key=lambda r: r["ratio"])
        rows.append(("grouped op (heads, experts) against the ungrouped op on the same tensor", "≤ 1.3 ×",
                     f"{worst['ratio']:.2f} × at worst ({worst['case']}, {worst['dtype'].replace('torch.', '')}, "
                     f"{worst['histogram']})", worst["ratio"] <= 1.3))
    else:
        rows.append(("grouped op (heads, experts) against the ungrouped op on the same tensor", "≤ 1.3 ×", None,
                     False))
    many = o.get("many_op", {})
    if many.get("launches"):
        one, batched = many["launches"]["one per tensor"], many["launches"]["accumulate_many"]
        rows.append((f"launches for the statistics of {many['tensors']} parameters", "≥ 3 × fewer",
                     f"{batched} (one per parameter: {one}); {many['ms']['accumulate_many']:.3f} ms vs "
                     f"{many['ms']['one per tensor']:.3f} ms", 3 * batched <= one))
    else:
        rows.append(("launches for the statistics of the parameters", "≥ 3 × fewer", None, False))
    out = ["", "## Targets", "", "| line | target | measured | met |", "|---|---|---|---|"]
    out += [f"| {a} | {t} | {m or 'not measured'} | {('yes' if ok else 'no') if m else '-'} |" for a, t, m, ok in rows]
    return out


def summary_md(report: dict) -> str:
    m = report["machine"]
    gpu = (f"{m['gpu']} (sm {m['capability'][0]}.{m['capability'][1]}, {m['sm_count']} SMs, "
           f"{m['memory_gib']} GiB, driver {m.get('driver') or 'unknown'})" if m.get("gpu") else "no GPU")
    steps = report["steps"]
    failed = [s["name"] for s in steps if not s["ok"]]
    out = [f"# hookcap gpu_check ({report['started']})", "",
           f"- device: {report['device']}{' (quick)' if report['quick'] else ''}; {gpu}",
           f"- torch {m.get('torch')} (CUDA {m.get('torch_cuda')}), python {m.get('python')}, git {m.get('git')}, "
           f"{m.get('cpu_count')} CPUs ({m.get('cpu')})",
           f"- result: {'all steps ok' if not failed else 'FAILED: ' + ', '.join(failed)}, "
           f"{report['seconds']:.0f} s", "", "## Steps", "", "| step | ok | seconds | note |", "|---|---|---:|---|"]
    out += [f"| {s['name']} | {'ok' if s['ok'] else '**FAILED**'} | {s['seconds']:.1f} | {step_note(s)} |"
            for s in steps]
    by_name = {s["name"]: s.get("details") or {} for s in steps}
    out += target_lines(by_name)
    k = by_name.get("kernel", {})
    if k.get("rows"):
        out += ["", f"## Kernel: hookcap._ops.accumulate vs copy ({k['timer']}, median per call)", "",
                "GB/s: input bytes per second (the copy counts read + write); × copy: the fraction of the "
                "copy's GB/s for the same dtype and size, given only for inputs of at least 4× the L2 "
                f"({k.get('l2_bytes', 0) / 2**20:.0f} MiB): smaller ones are cache-resident or launch-bound.",
                "", KERNEL_HEADER, "|---|---:|---|---|---:|---:|---:|"]
        out += [f"| {r['dtype']} | {sci(r['elements'])} | {r['layout']} | "
                f"{'copy' if r['op'] == 'copy' else 'hookcap ' + r['hist']} | {r['us_per_call']:.1f} | "
                f"{r['gbps']:.1f} | {'-' if r.get('cache_resident') else format(r['copy_fraction'], '.2f')} |"
                for r in k["rows"]]
        out += ["", "Histogram paths: " + "; ".join(f"{a}: {b}" for a, b in k["hist_kinds"].items()) + "."]
        c = k["correctness"]
        out += [f"Correctness at 1e6 elements: {sum(r['ok'] for r in c)}/{len(c)} checks match "
                f"({', '.join(sorted({r['against'] for r in c}))})."]
        out += [f"Skipped: {s}" for s in k["skipped_points"]]
        if k.get("merge"):
            out += ["", "### Block merge: each block's atomics (direct) vs the tree (µs per call, interleaved)", "",
                    "| dtype | elements | histogram | direct | tree | tree / direct |", "|---|---:|---|---:|---:|---:|"]
            t = {(r["dtype"], r["elements"], r["hist"], r["merge"]): r["us_per_call"] for r in k["merge"]}
            for (dname, n, h, merge), us in t.items():
                if merge == "direct" and (dname, n, h, "tree") in t:
                    tree = t[dname, n, h, "tree"]
                    out.append(f"| {dname} | {sci(n)} | {h} | {us:.1f} | {tree:.1f} | {tree / us:.2f} |")
    o = by_name.get("overhead", {})
    if o.get("rows"):
        sh = o["shape"]
        out += ["", f"## Overhead: {o['model']}", "",
                f"{sh['n_layer']} layers, n_embd {sh['n_embd']}, vocab {sh['vocab_size']}, B={sh['batch']}, "
                f"T={sh['seq']}, {o['optimizer']}, autocast {o['autocast']}; {o['rounds']} rounds x "
                f"{o['steps_per_round']} steps; overhead paired by round; sync debug mode: {o['sync_debug_mode']}.",
                "", "| config | median ms | overhead | mean ms | samples | steps under sync check | sync |",
                "|---|---:|---:|---:|---:|---:|---|"]
        for r in o["rows"]:
            out.append(f"| {r['config']} | {ms(r['median_ms'])} | {r['overhead_pct']:+.1f}% | {ms(r['mean_ms'])} "
                       f"| {r['samples']} | {r['sync_checked_steps']} | {'SYNC' if r['sync_error'] else 'none'} |")
        pl, fl = o.get("pipelined", {}), o.get("read_floor", {})
        if pl.get("rows"):
            out += ["", f"No host sync between steps ({pl['steps']} steps per event pair, {pl['rounds']} rounds):", "",
                    "| config | ms per step | overhead |", "|---|---:|---:|"]
            out += [f"| {r['config']} | {r['ms_per_step']:.2f} | {r['overhead_pct']:+.1f}% |" for r in pl["rows"]]
        if fl.get("floor_ms") is not None:
            out += ["", f"Read floor of every=1: {fl['captured_bytes'] / 1e9:.2f} GB captured per step "
                        f"({fl['metrics']} metrics) / copy {fl['copy_gbps']:.0f} GB/s = {fl['floor_ms']:.2f} ms."]
        if isinstance(o.get("profile"), dict) and o["profile"] and "error" not in o["profile"]:
            import _profile_steps

            out += ["", "Device time per step by kernel category (torch.profiler, 2 steps; ms, launches in "
                        "brackets):", ""] + _profile_steps.summary_lines(o["profile"])
        at = o.get("attention_tiles", {})
        if at.get("observe_ms"):
            out += ["", f"Attention observed per layer {tuple(at['shape'])} ({at['dtype'].replace('torch.', '')}, "
                        f"causal; the attention itself {at['attention_ms']:.2f} ms), ms beyond it on chip or by "
                        "tile size: " + ", ".join(f"{n if not n.isdigit() else f'{int(n) >> 20} M logits'} {v:.2f}"
                                                 for n, v in at["observe_ms"].items()) + "."]
        for key in ("pipelined", "read_floor", "profile", "attention_tiles"):
            if "error" in o.get(key, {}):
                out += ["", f"{key} failed:", "```", o[key]["error"].strip()[-800:], "```"]
    c = by_name.get("compiled", {})
    if c.get("rows"):
        sh = c["shape"]
        out += ["", f"## Compiled (torch.compile): {c['model']}", "",
                f"{sh['n_layer']} layers, n_embd {sh['n_embd']}, B={sh['batch']}, T={sh['seq']}, autocast "
                f"{c['autocast']}; one compiled instance per configuration; {c['rounds']} rounds x "
                f"{c['steps_per_round']} steps; {c['metrics']} metrics.", "",
                "| config | median ms | overhead | first step (compile) s |", "|---|---:|---:|---:|"]
        out += [f"| {r['config']} | {r['median_ms']:.1f} | {r['overhead_pct']:+.1f}% | {r['compile_s']} |"
                for r in c["rows"]]
        if isinstance(c.get("profile"), dict) and "skipped" not in c["profile"]:
            import _profile_steps

            out += ["", "Device time per step by kernel category (torch.profiler, 2 steps; ms, launches in "
                        "brackets):", ""] + _profile_steps.summary_lines(c["profile"])
    errors = [s for s in steps if not s["ok"]]
    if errors:
        out += ["", "## Errors"]
        for s in errors:
            out += ["", f"### {s['name']}", "", "```", s["error"].strip(), "```"]
    return "\n".join(out) + "\n"


def write_outputs(report: dict) -> None:
    path = os.path.join(report["outdir"], "gpu_check.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(path + ".tmp", path)
    md = summary_md(report)
    with open(os.path.join(report["outdir"], "summary.md"), "w") as f:
        f.write(md)
    print("\n" + md, flush=True)
    log(f"wrote {path} and summary.md")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("outdir", help="folder for gpu_check.json, summary.md and the logs")
    p.add_argument("--skip-build", action="store_true", help="use the extension already built in place")
    p.add_argument("--quick", action="store_true", help="kernel sizes up to 1e7, a small GPT-2, fewer rounds")
    p.add_argument("--budget", type=float, default=TOTAL_BUDGET_S,
                   help=f"seconds for the whole run (default {TOTAL_BUDGET_S}); each step's limit is cut to what is left")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: exercise the code paths on a machine without a GPU")
    p.add_argument("--stage", choices=list(STAGES), help=argparse.SUPPRESS)  # a child's step
    p.add_argument("--stage-deadline", type=float, default=None, help=argparse.SUPPRESS)  # its stop, epoch s
    args = p.parse_args(argv)
    args.outdir = os.path.abspath(args.outdir)
    os.makedirs(args.outdir, exist_ok=True)
    if args.stage:
        return run_stage(args)

    t0 = time.perf_counter()
    report = {"tool": "benchmarks/gpu_check.py", "command": [sys.executable] + sys.argv, "outdir": args.outdir,
              "device": args.device, "quick": args.quick, "skip_build": args.skip_build,
              "started": now_iso(), "steps": []}
    runner = Runner(args)
    env_step = run_step("environment", environment)
    report["steps"].append(env_step)
    report["machine"] = env_step.get("details") or {}
    if args.device == "cuda" and not report["machine"].get("cuda_available"):
        env_step.update(ok=False, error="--device cuda but torch.cuda.is_available() is False "
                                        "(no GPU, no driver, or a CPU-only torch); nothing else was run")
        log(env_step["error"])
        code = 2
    else:
        for name, fn in (("build", lambda: build(runner, report["machine"])), ("tests", lambda: tests(runner)),
                         ("compiled", lambda: runner.stage("compiled")), ("kernel", lambda: runner.stage("kernel")),
                         ("overhead", lambda: runner.stage("overhead"))):
            report["steps"].append(run_step(name, fn))
        code = 0 if all(s["ok"] for s in report["steps"]) else 1
    report.update(finished=now_iso(), seconds=round(time.perf_counter() - t0, 1),
                  ok=code == 0, exit_code=code)
    write_outputs(report)
    return code


if __name__ == "__main__":
    sys.exit(main())
