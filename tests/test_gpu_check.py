"""benchmarks/gpu_check.py end to end in its --device cpu mode (the GPU machine
runs the same code with CUDA sizes and timers), and the built-in GPT-2 of
benchmarks/_gpt2.py against transformers' GPT2LMHeadModel with the same weights."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _gpt2  # noqa: E402
import gpu_check  # noqa: E402

STEPS = ["environment", "build", "tests", "compiled", "kernel", "overhead"]


def run_gpu_check(outdir, *args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), str(outdir), *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def test_cpu_quick_run_records_every_step(tmp_path):
    out = run_gpu_check(tmp_path, "--device", "cpu", "--quick")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [s["name"] for s in report["steps"]] == STEPS
    assert all(s["ok"] for s in report["steps"]), [s.get("error") for s in report["steps"]]
    assert report["exit_code"] == 0 and report["machine"]["torch"] == torch.__version__
    steps = {s["name"]: s["details"] for s in report["steps"]}

    kernel = steps["kernel"]
    rows = kernel["rows"]
    assert rows and all(r["gbps"] > 0 and r["us_per_call"] > 0 for r in rows)
    hists = {r["hist"] for r in rows if r["op"] == "hookcap"}
    assert hists == set(kernel["hist_kinds"]) and len(hists) == 9
    assert {r["layout"] for r in rows} == {"contiguous", "transposed", "rows", "sliced", "padded"}
    dtypes = {r["dtype"] for r in rows} | {s["dtype"] for s in kernel["skipped_points"]}
    assert dtypes == {"float32", "bfloat16", "float8_e4m3fn"}
    for r in rows:  # the copy of the same dtype and size (a view: of its contiguous size) is the yardstick
        copy = next(c for c in rows if c["op"] == "copy" and (c["dtype"], c["elements"]) ==
                    (r["dtype"], r["copy_elements"]))
        assert r["copy_fraction"] == pytest.approx(r["gbps"] / copy["gbps"])
    checks = kernel["correctness"]
    assert checks and all(c["ok"] for c in checks)
    assert all(c["count"] == c["elements"] == 10**6 for c in checks)
    assert all(0 < c["nan"] < c["count"] and c["min"] < 0 < c["max"] for c in checks)

    overhead = steps["overhead"]
    cadence = "hookcap cadence: grads+updates every step, activations every 10"
    assert [r["config"] for r in overhead["rows"]] == ["no telemetry", "hookcap every=1 log2 hist",
                                                       "hookcap every=10", "hookcap every=1 + attention", cadence]
    groups_op = overhead["groups_op"]  # the grouped op against the ungrouped one, each case
    assert {r["case"] for r in groups_op} == {"heads 12 x 64", "experts 8", "channels 768 x 1"}
    assert all(r["ratio"] > 0 for r in groups_op)
    tiles = overhead["attention_tiles"]  # one layer's attention observed: on chip, and by the GPU's tile size
    assert "error" not in tiles
    assert set(tiles["observe_ms"]) == {"on chip", str(1 << 22), str(1 << 23), str(1 << 25)}
    assert tiles["attention_ms"] > 0
    many = overhead["many_op"]  # every parameter's statistics: one call against one per parameter
    assert many["tensors"] > 3 and all(v > 0 for v in many["ms"].values()) and many["launches"] is None
    assert all(r["median_ms"] > 0 and r["samples"] > 0 for r in overhead["rows"])
    pipelined = overhead["pipelined"]
    assert [r["config"] for r in pipelined["rows"]] == [r["config"] for r in overhead["rows"]]
    assert all(r["ms_per_step"] > 0 for r in pipelined["rows"])
    floor = overhead["read_floor"]  # the bytes the every=1 Monitor read, counted by plain hooks
    assert floor["modules_not_found"] == [] and floor["metrics"] > 0
    assert floor["captured_elements_by_hooks"] == floor["recorded_elements_last_step"] > 0
    assert floor["captured_bytes"] == 4 * floor["captured_elements_by_hooks"]  # float32 on the CPU
    prof = overhead["profile"]  # hookcap's ops only with the Monitor attached, one or more per metric
    assert list(prof) == ["no telemetry", "hookcap every=1 log2 hist"]
    assert "hookcap" not in prof["no telemetry"]["by_category"]
    assert prof["hookcap every=1 log2 hist"]["by_category"]["hookcap"]["calls"] >= floor["metrics"]
    assert steps["build"]["build_info"]["torch_version"] == torch.__version__
    compiled = steps["compiled"]  # the op under torch.compile, against the same model unwatched
    assert [r["config"] for r in compiled["rows"]] == [c for c, _ in gpu_check.COMPILED_CONFIGS]
    assert all(r["median_ms"] > 0 and r["compile_s"] > 0 for r in compiled["rows"])
    assert compiled["metrics"] > 0
    # Each configuration profiled with its Monitor still attached: hookcap's op runs
    # at least once per captured metric with the Monitor, never unwatched.
    prof = compiled["profile"]
    assert list(prof) == [c for c, _ in gpu_check.COMPILED_CONFIGS] and all(p["ms_per_step"] > 0 for p in prof.values())
    calls = [p["by_category"].get("hookcap", {}).get("calls", 0) for p in prof.values()]
    assert calls[0] == 0 and compiled["metrics"] <= calls[1]
    # Each configuration's first step compiled its graphs (code kept for reading offline), and
    # the timed steps compiled none: no recompiles, watched or not.
    comp = compiled["compiles"]
    assert list(comp) == [c for c, _ in gpu_check.COMPILED_CONFIGS]
    assert all(c["graphs"] >= 1 and c["modules"] >= 2 for c in comp.values())  # forward and backward
    assert compiled["graphs_compiled_after_first_steps"] == 0
    assert "hookcap.record" in (tmp_path / comp["op histogram=None"]["file"]).read_text()
    assert "hookcap" not in (tmp_path / comp["no telemetry"]["file"]).read_text()

    summary = (tmp_path / "summary.md").read_text()
    assert gpu_check.KERNEL_HEADER in summary and "## Overhead" in summary and "## Compiled" in summary
    assert "Device time per step by kernel category" in summary
    # The targets: each line with its figure where this run measures one (the CPU: the cadence line).
    targets = summary.split("## Targets", 1)[1].split("\n## ", 1)[0]
    cad = next(r for r in pipelined["rows"] if r["config"] == cadence)
    assert f"| {cad['overhead_pct']:+.2f} % |" in targets  # no floor on the CPU (no copy bandwidth measured)
    assert floor["cadence_bytes"] > floor["captured_bytes"] / 10
    assert "| bfloat16 default log2 at 1e9 elements | ≥ 0.95 × copy | not measured | - |" in targets
    assert "| launches for the statistics of the parameters | ≥ 3 × fewer | not measured | - |" in targets
    assert ("| every-step recording on the side stream, no host sync | beats the current stream | not measured | - |"
            in targets)  # a CUDA configuration only
    every1, attn = (next(r for r in pipelined["rows"] if r["config"] == c)
                    for c in ("hookcap every=1 log2 hist", "hookcap every=1 + attention"))
    assert f"| {attn['overhead_pct'] - every1['overhead_pct']:+.2f} % (with outputs and gradients: " in targets
    worst = max((r for r in groups_op if r["case"] != "channels 768 x 1"), key=lambda r: r["ratio"])
    assert f"| ≤ 1.3 × | {worst['ratio']:.2f} × at worst ({worst['case']}, " in targets
    assert summary.strip() in out.stdout
    assert {"build_info.log", "kernel.log", "overhead.log", "compiled.log"} <= set(os.listdir(tmp_path))


def test_a_stage_short_of_time_leaves_out_its_profile(tmp_path):
    # The parent tells each child when it will be stopped; the compiled step then
    # keeps its table and leaves out the profile.
    import time

    out = run_gpu_check(tmp_path, "--stage", "compiled", "--device", "cpu", "--quick",
                        "--stage-deadline", str(time.time() + 5))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rec = json.loads((tmp_path / "compiled.stage.json").read_text())
    d = rec["details"]
    assert rec["ok"] and d["rows"] and "skipped" in d["profile"]


def test_no_gpu_for_device_cuda_exits_2_with_the_reason(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    out = run_gpu_check(tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [(s["name"], s["ok"]) for s in report["steps"]] == [("environment", False)]
    assert "torch.cuda.is_available() is False" in report["steps"][0]["error"]


def test_a_failing_step_is_recorded_and_the_next_still_runs():
    def boom():
        raise ValueError("planted")

    recs = [gpu_check.run_step("a", boom), gpu_check.run_step("b", lambda: {"x": 1})]
    assert not recs[0]["ok"] and "ValueError: planted" in recs[0]["error"]
    assert recs[1] == {"name": "b", "ok": True, "details": {"x": 1}, "seconds": recs[1]["seconds"]}
    failed = gpu_check.run_step("c", lambda: (_ for _ in ()).throw(gpu_check.StepFailed("why", {"k": 2})))
    assert (failed["ok"], failed["error"], failed["details"]) == (False, "why", {"k": 2})


def test_builtin_gpt2_workload_trains():
    shape = gpu_check.gpt2_shape("cpu", quick=True)
    model, loss_fn, desc = gpu_check.gpt2_workload(shape, "cpu", use_transformers=False)
    assert "built-in" in desc
    loss = loss_fn()
    loss.backward()
    # Random init over a 256-token vocabulary: the loss starts near log(256).
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5
    assert model.lm_head.weight.grad is not None


def test_builtin_gpt2_matches_transformers_with_the_same_weights():
    transformers = pytest.importorskip("transformers")
    dims = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=16)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        **dims, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)).eval()
    with torch.no_grad():  # weights larger than GPT-2's init, so every layer moves the logits
        for name, p in hf.named_parameters():
            p.normal_(1.0 if ".ln_" in name and name.endswith("weight") else 0.0, 0.2)
    ours = _gpt2.GPT2LMHeadModel(_gpt2.GPT2Config(**dims)).eval()
    # transformers' Conv1D keeps its weight as [in, out]: nn.Linear's transpose.
    sd = {k: (v.t() if k.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")) else v)
          for k, v in hf.state_dict().items()}
    ours.load_state_dict({k: sd[k] for k in ours.state_dict()})
    assert set(ours.state_dict()) <= set(sd)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    x = torch.randint(128, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(x).logits
        got = ours(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert _gpt2.lm_loss(got, x).item() == pytest.approx(hf(x, labels=x).loss.item(), abs=1e-5)
