"""Build hookcap._C: CPU kernels always; CUDA kernels when torch is a CUDA build
and a matching nvcc is found. A visible GPU is NOT needed to build them.

Environment:
  HOOKCAP_FORCE_CPU=1    never build CUDA kernels
  HOOKCAP_FORCE_CUDA=1   fail the build instead of falling back to CPU-only
  CUDA_HOME / CUDA_PATH  toolkit folder (holds bin/nvcc and lib64/libcudart.so)
  HOOKCAP_CUDA_ARCHS     which GPUs to compile for: "native" (default: the visible GPUs;
                         8.0+PTX when none is visible), "all" (8.0;9.0+PTX: native code for
                         A100/Ada and H100/H200, PTX for newer GPUs), or a list ("8.0;9.0")
  TORCH_CUDA_ARCH_LIST   torch's own switch, used when HOOKCAP_CUDA_ARCHS is not set
"""

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time
import warnings

from setuptools import setup

import torch
import torch.utils.cpp_extension as cpp_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
ALL_ARCHS = "8.0;9.0+PTX"
# No GPU visible: one real arch proves the kernels compile and runs on every 8.x GPU; its PTX is
# compiled by the driver at first use on newer ones. Each arch listed adds a full device compile.
NO_GPU_ARCHS = "8.0+PTX"


def _env_flag(name):
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _is_toolkit(path):
    return bool(path) and os.path.isfile(os.path.join(path, "bin", "nvcc")) and os.path.isfile(
        os.path.join(path, "include", "cuda_runtime.h")
    )


def _toolkits_named_by_wrapper(nvcc):
    """An `nvcc` on PATH may be a shell wrapper around the real toolkit's nvcc
    (as on this project's machines); read the paths it names."""
    try:
        with open(nvcc, "rb") as f:
            head = f.read(4096)
    except OSError:
        return []
    if not head.startswith(b"#!"):
        return []
    found = re.findall(rb"(/[^\s\"']+)/bin/nvcc", head)
    return [p.decode() for p in found]


def find_cuda_home():
    cands = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = os.path.realpath(nvcc)
        cands += _toolkits_named_by_wrapper(real)
        cands.append(os.path.dirname(os.path.dirname(real)))
    cands.append(cpp_ext.CUDA_HOME)
    cands += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for c in cands:
        if c and _is_toolkit(c):
            return c
    return None


def nvcc_version(cuda_home):
    out = subprocess.run(
        [os.path.join(cuda_home, "bin", "nvcc"), "--version"], capture_output=True, text=True
    ).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def loud(msg):
    bar = "!" * 78
    print(f"\n{bar}\nhookcap setup: {msg}\n{bar}\n", file=sys.stderr)
    warnings.warn(f"hookcap: {msg}")


def decide_cuda():
    """Returns (build_cuda, cuda_home, reason)."""
    if _env_flag("HOOKCAP_FORCE_CPU"):
        return False, None, "HOOKCAP_FORCE_CPU=1"
    force = _env_flag("HOOKCAP_FORCE_CUDA")
    if torch.version.cuda is None:
        reason = f"torch {torch.__version__} is not a CUDA build"
    else:
        home = find_cuda_home()
        if home is None:
            reason = "no CUDA toolkit (nvcc + headers) found; set CUDA_HOME"
        else:
            ver = nvcc_version(home)
            torch_major = int(torch.version.cuda.split(".")[0])
            if ver is None:
                reason = f"could not read nvcc's version in {home}"
            elif ver[0] != torch_major:
                reason = (
                    f"nvcc {ver[0]}.{ver[1]} in {home} does not match torch's CUDA "
                    f"{torch.version.cuda}"
                )
            else:
                return True, home, f"nvcc {ver[0]}.{ver[1]} in {home}"
    if force:
        raise RuntimeError(f"HOOKCAP_FORCE_CUDA=1 but CUDA kernels cannot be built: {reason}")
    return False, None, reason


BUILD_CUDA, CUDA_HOME, CUDA_REASON = decide_cuda()

# -fno-trapping-math lets GCC if-convert (and so vectorise) the branch-free
# per-element update; we never rely on FP exceptions. -fopenmp makes
# at::parallel_for actually parallel (torch's own libgomp is reused).
# No FMA contraction on either side: histogram edges (lo + i * width) must
# round the same on the CPU, the GPU and in the float64 reference.
# -g0: Python's own CFLAGS ask for debug info, which made the template-heavy CPU loops take
# 45 % longer to compile and the extension ten times larger.
cxx_flags = [
    "-O3", "-g0", "-std=c++20", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-fopenmp",
]
# --split-compile=0: the device compiler's passes (cicc, ptxas) of the one
# kernel file run on every core: same SASS, a third to a half of the time.
nvcc_flags = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo", "--fmad=false", "--split-compile=0"]
define_macros = []
sources = ["csrc/ops.cpp", "csrc/grad_hooks.cpp", "csrc/host_pack.cpp", "csrc/cpu/stats_cpu.cpp",
           *(f"csrc/cpu/accumulate_{t}.cpp" for t in ("f64", "f32", "f16", "bf16", "e4m3", "e5m2")),
           "csrc/cpu/update_cpu.cpp", "csrc/cpu/groups_cpu.cpp", "csrc/cpu/bins_cpu.cpp",
           "csrc/cpu/attention_cpu.cpp"]

if BUILD_CUDA:
    # torch guessed CUDA_HOME at import; point it at the toolkit we chose.
    cpp_ext.CUDA_HOME = CUDA_HOME
    os.environ["CUDA_HOME"] = CUDA_HOME
    archs = os.environ.get("HOOKCAP_CUDA_ARCHS", "").strip()
    if archs.lower() == "all":
        os.environ["TORCH_CUDA_ARCH_LIST"] = ALL_ARCHS
    elif archs and archs.lower() != "native":
        os.environ["TORCH_CUDA_ARCH_LIST"] = archs
    elif archs.lower() == "native" or not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        visible = False
        try:
            visible = torch.cuda.is_available()
        except Exception:
            pass
        if visible:  # torch's own choice: each visible GPU's arch, PTX for the last
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = NO_GPU_ARCHS
    sources.append("csrc/cuda/stats_launch.cu")
    define_macros.append(("HOOKCAP_WITH_CUDA", "1"))
    Extension = cpp_ext.CUDAExtension
    ext_kwargs = {"extra_compile_args": {"cxx": cxx_flags, "nvcc": nvcc_flags}}
else:
    loud(f"building CPU-ONLY kernels: {CUDA_REASON}")
    Extension = cpp_ext.CppExtension
    ext_kwargs = {"extra_compile_args": {"cxx": cxx_flags}}

ext = Extension(
    name="hookcap._C",
    sources=sources,
    include_dirs=[os.path.join(ROOT, "csrc")],
    define_macros=define_macros,
    extra_link_args=["-fopenmp"],
    py_limited_api=False,
    **ext_kwargs,
)


def _visible_archs():
    """The archs torch compiles for when TORCH_CUDA_ARCH_LIST is unset (the visible GPUs')."""
    caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    return ";".join(f"{a}.{b}" for a, b in caps) + "+PTX" if caps else None


class BuildExt(cpp_ext.BuildExtension):
    """Records what was built next to the package (read by hookcap.build_info()
    and checked at import against the running torch)."""

    def run(self):
        start = time.monotonic()
        super().run()
        meta = {
            "build_seconds": round(time.monotonic() - start, 1),
            "build_jobs": int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1),
            "torch_version": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "cuda": BUILD_CUDA,
            "cuda_reason": CUDA_REASON,
            "cuda_home": CUDA_HOME,
            "arch_list": (os.environ.get("TORCH_CUDA_ARCH_LIST") or _visible_archs()) if BUILD_CUDA else None,
            "cxx_flags": cxx_flags,
            "nvcc_flags": nvcc_flags if BUILD_CUDA else None,
            "cxx_abi": int(torch._C._GLIBCXX_USE_CXX11_ABI),
        }
        targets = {os.path.join(ROOT, "hookcap")}
        if not self.inplace and self.build_lib:
            targets.add(os.path.join(self.build_lib, "hookcap"))
        for d in targets:
            if os.path.isdir(d):
                with open(os.path.join(d, "_build_meta.json"), "w") as f:
                    json.dump(meta, f, indent=2)


setup(
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExt.with_options(use_ninja=True)},
)
