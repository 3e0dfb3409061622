"""Monitor(fused=True) with the Triton kernels a GPU would run, executed on
the CPU by Triton's interpreter (``_fusion.triton_codegen(interpret=True)``):
the statistics computed inside Inductor's Triton kernels equal the accumulate
op's on the same compiled values. The interpreter must be switched on before
Triton is imported, so each test runs in a process of its own started with
``TRITON_INTERPRET=1`` by :func:`test_in_the_interpreter`."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

try:  # a kernel's globals must hold triton.language for the interpreter
    import triton
    import triton.language as tl
except ImportError:  # the tests skip
    triton = tl = None

import hookcap._capture.fused
from conftest import assert_fused_matches_op
from test_fused import Amplified, Block, block_inputs, compiled_steps, op_and_fused, op_and_fused_in_one_run
from test_fused_triton import DYNAMIC_GRADS, ConvBlock

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _fusion  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETING, reason="run by test_in_the_interpreter, with TRITON_INTERPRET=1")
CASES = ("test_block_with_nonfinite_values", "test_block_with_a_dynamic_batch_size",
         "test_channels_last_conv_block", "test_half_precision_statistics_are_of_the_stored_values[bf16]",
         "test_half_precision_statistics_are_of_the_stored_values[fp16]", "test_hf_gpt2")


@pytest.mark.skipif(INTERPRETING, reason="the runner itself")
@pytest.mark.parametrize("case", CASES)
def test_in_the_interpreter(case):
    """Runs ``case`` in a fresh process with TRITON_INTERPRET=1 (skipped
    where the interpreter cannot run Inductor's kernels: see
    :func:`interpreter_cannot_run`)."""
    pytest.importorskip("triton")
    here = Path(__file__).resolve()
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
                        "-W", "ignore::UserWarning", f"{here}::{case}"],
                       cwd=here.parents[1], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    if " passed" not in r.stdout:
        skips = [line for line in r.stdout.splitlines() if line.startswith("SKIPPED")]
        assert skips, r.stdout[-2000:]
        pytest.skip(skips[0])


def interpreter_cannot_run() -> str | None:
    """Why Triton's interpreter cannot run Inductor's looped reductions in
    this environment (None: it can). Triton 3.6's interpreter turns a loop
    bound into a one-element array that NumPy 2 refuses to convert to an int."""

    @triton.jit
    def looped_sum(x_ptr, n, BLOCK: tl.constexpr):
        acc = tl.zeros([BLOCK], tl.float32)
        for off in tl.range(0, n, BLOCK):
            acc += tl.load(x_ptr + off + tl.arange(0, BLOCK))
        tl.store(x_ptr + tl.arange(0, BLOCK), acc)

    x = torch.ones(8)
    try:
        looped_sum[(1,)](x, 8, BLOCK=4)
    except Exception as e:  # noqa: BLE001 - any failure of the interpreter itself
        return f"Triton {triton.__version__}'s interpreter cannot run a loop here: {e!r}"
    return None if torch.equal(x[:4], torch.full((4,), 2.0)) else "Triton's interpreter summed wrongly"


@pytest.fixture
def interpreter(monkeypatch):
    pytest.importorskip("triton")
    if reason := interpreter_cannot_run():
        pytest.skip(reason)
    monkeypatch.setattr(hookcap._capture.fused, "DEVICE_TYPES", {"cuda", "cpu"})
    with _fusion.triton_codegen(interpret=True):
        yield


@interpreted
def test_block_with_nonfinite_values(interpreter):
    """Linear -> GELU -> Linear -> LayerNorm, outputs and both gradients, a
    NaN and an Inf in the inputs: the blocks and LayerNorm's rows, computed in
    the model's kernels, give the op's counts and extrema exactly."""
    torch.manual_seed(0)
    xs = block_inputs((16, 16, 16))
    xs[1][3, 5] = float("nan")
    xs[2][0, 0] = float("inf")
    op, fused, *_ = op_and_fused(Block(), xs, capture=("output", "grad_output", "grad_input"))
    assert fused["nan"].sum() > 0 and fused["posinf"].sum() + fused["neginf"].sum() > 0
    assert_fused_matches_op(op, fused)


@interpreted
def test_block_with_a_dynamic_batch_size(interpreter):
    """Batch sizes 16, 12, 20: the second compiles with a symbolic size (runs
    of rows instead of blocks); one graph more than static, as for the op."""
    torch.manual_seed(0)
    capture = ("output", "grad_output", "grad_input") if DYNAMIC_GRADS else "output"
    op, fused, graphs_op, graphs_fused = op_and_fused(Block(), block_inputs((16, 12, 20)), capture=capture)
    assert graphs_fused == graphs_op
    assert_fused_matches_op(op, fused)


@interpreted
def test_channels_last_conv_block(interpreter):
    """BatchNorm and ReLU outputs of a channels-last conv block are split in
    memory order; their output gradients in logical order."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = ConvBlock(8).to(memory_format=torch.channels_last)
    xs = [torch.randn(2, 8, 8, 8, generator=g).contiguous(memory_format=torch.channels_last) for _ in range(2)]
    op, fused, *_ = op_and_fused(model, xs, modules=["bn", "act"], capture=("output", "grad_output"))
    assert_fused_matches_op(op, fused)


# bfloat16 inputs keep clear of subnormals, which Triton's interpreter
# converts wrongly (it also truncates where a GPU rounds to nearest, in
# stores and explicit conversions alike, so the stored tensor and the
# statistics still see the same values).
@pytest.mark.parametrize("dtype,scale", [(torch.bfloat16, 1.0), (torch.float16, 100.0)], ids=["bf16", "fp16"])
@interpreted
def test_half_precision_statistics_are_of_the_stored_values(dtype, scale, monkeypatch, interpreter):
    """Inductor computes half-precision values in float32 and rounds them as
    it stores them: the statistics fused into those kernels are of the stored
    (rounded) tensor, float16 overflow to infinity included. Planted: widening
    with ``x.float()`` reads the unrounded float32 values, and the statistics
    differ from the op's."""
    torch.manual_seed(0)
    model = Amplified().to(dtype)
    xs = block_inputs((16, 16), dtype, scale)
    capture = ("output", "grad_output", "grad_input")
    op, fused, *_ = op_and_fused(model, xs, modules=["amp", "ln"], capture=capture)
    if dtype == torch.float16:
        assert fused["posinf"][:, fused.column("amp/output")].sum() > 0
    assert_fused_matches_op(op, fused)
    monkeypatch.setattr(hookcap._capture.fused, "_stored_float", lambda x: x.float())
    torch._dynamo.reset()
    planted, _ = compiled_steps(model, xs, modules=["amp", "ln"], capture=capture, fused=True)
    with pytest.raises(AssertionError):
        assert_fused_matches_op(op, planted)


@interpreted
def test_hf_gpt2(interpreter):
    """transformers' GPT-2 (one layer, no dropout, one graph each way) under
    bfloat16 autocast as gpu_check trains it (bfloat16 and float32 tensors),
    every default module's output and output gradient; the op and fused=True
    on the same compiled model (two Monitors: the same values)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=97, n_positions=32, use_cache=False,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"
    x = torch.randint(97, (2, 8), generator=torch.Generator().manual_seed(0))
    model.compile()

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, labels=x).loss
        loss.backward()

    op, fused = op_and_fused_in_one_run(model, [step], capture=("output", "grad_output"))
    assert len(op.names) > 25 and {str(op.meta(n)["dtype"]) for n in op.names} == {"torch.bfloat16", "torch.float32"}
    assert_fused_matches_op(op, fused)
