"""Build metadata, the torch-version guard and registered dispatch keys."""

from pathlib import Path

import pytest
import torch

import hookcap
from hookcap import _build
from hookcap._ops import DEVICE_OPS

ROOT = Path(__file__).resolve().parent.parent


def test_build_info_keys():
    info = hookcap.build_info()
    for k in ("torch_version", "torch_cuda", "cuda", "arch_list", "cxx_flags", "nvcc_flags", "cpu_isa"):
        assert k in info
    assert info["torch_version"] == torch.__version__
    assert isinstance(info["cuda"], bool)


def test_import_against_other_torch_names_both_versions(monkeypatch):
    monkeypatch.setattr(_build, "_read_meta", lambda: {"torch_version": "1.0.0"})
    with pytest.raises(ImportError, match=r"built for torch 1\.0\.0 but torch .* is installed") as e:
        _build.check_and_load()
    assert torch.__version__ in str(e.value)


def test_missing_build_is_a_clear_import_error(monkeypatch, tmp_path):
    monkeypatch.setattr(_build, "_META_PATH", str(tmp_path / "nope.json"))
    with pytest.raises(ImportError, match="not built"):
        _build.check_and_load()


@pytest.mark.parametrize("op", DEVICE_OPS)
def test_dispatch_keys_registered(op):
    dump = torch._C._dispatch_dump(f"hookcap::{op}")
    assert "CPU:" in dump and "Meta:" in dump
    if hookcap.build_info()["cuda"]:
        assert "CUDA:" in dump


def test_cuda_launches_go_through_the_checked_launcher():
    """Every kernel launch in stats_launch.cu uses launch() (cudaLaunchKernel
    and its own error), never <<<>>> followed by cudaGetLastError, which would
    clear or claim another library's pending error."""
    src = (ROOT / "csrc" / "cuda" / "stats_launch.cu").read_text()
    code = "\n".join(line.split("//")[0] for line in src.splitlines())
    assert "<<<" not in code
    assert "C10_CUDA_KERNEL_LAUNCH_CHECK" not in code
    # only right after a failed call of ours: a launch, a side stream's event record, the
    # join's wait, the join's records on the previous step's stream and on hookcap's side stream
    assert code.count("cudaGetLastError") == 5
    # accumulate, accumulate_many, accumulate_update, accumulate_bins and attention_qk (with their
    # dynamic shared memory), reset_rows, advance (reset, then state), time_mark, attention_rows
    assert code.count("launch(\"hookcap.") + code.count("launch_smem(\"hookcap.") == 10
