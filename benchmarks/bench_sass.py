"""Static cost of hookcap's CUDA accumulate kernels, read from their SASS.

Builds ``csrc/cuda/stats_launch.cu`` (the shipped launcher, so exactly the
shipped specialisations) to a cubin for each architecture with the toolkit,
nvcc flags and C++ ABI of hookcap's own build (``hookcap/_build_meta.json``),
then for every accumulate specialisation:

- finds its steady-state loop (the innermost of the loops holding code of the
  source line marked ``// the steady-state loop`` in
  ``csrc/cuda/stats_kernel.cuh``), and counts per element: SASS instructions,
  FP64-pipe instructions (D*, and F2F/I2F/F2I to or from 64-bit floats) and
  global loads; the body is divided by the elements its loads bring in. ``br``
  counts branches inside the body: with none the body is the executed path,
  with some every path is counted (an upper bound). The stubs BRA.DIV jumps to
  (a warp-synchronous instruction redone for a diverged warp) are not loops;
- reports registers, spills (ptxas's bytes for the whole kernel, and ``inlp``:
  local-memory loads and stores inside the steady loop), static shared memory, the most dynamic
  shared memory the launcher gives the mode (``dyn``: its budget, which keeps
  4 blocks per SM; log2 at most 4,405 bins, log2key at most 8,192 keys), resident blocks of
  256 threads per SM (static + dyn), bytes of global loads in flight per SM at
  the peak (the loads issued before the first instruction that reads one of
  their results, times the resident threads) and on average (each load from
  its issue to its first reader, round the loop, over the loop's length), and
  the static issue-rate bound as a fraction of an
  H100's HBM bandwidth.

Assumptions of the bound (printed): H100 SXM, 132 SMs at 1.755 GHz, four
schedulers each issuing one warp instruction per clock (128 thread
instructions per SM per clock), FP64 pipe 64 lanes per SM per clock, HBM3
3.35 TB/s. The bound is ``min(issue, FP64 pipe)`` elements per second times
the element size; it ignores memory latency, shared-memory atomic conflicts and
the per-launch start-up, which the GPU benchmark measures.

Then the registers, spill bytes and static shared memory ptxas gives the
launcher's other kernels (attention, updates, bins, ring upkeep).

Then the fixed cost of a launch's epilogue, which SASS alone cannot count
(it depends on the grid and the branches taken): the global atomics one
launch sends, counted by executing the kernels' source in the CPU emulation
harness (``tests/cuda_emu``) for a 16 M-element bfloat16 tensor of normal
values with the default log2 histogram on the launcher's H100 grid (528
blocks; the count depends on blocks, not threads: 32 per block there), with
the tree merge of block partials and with every block merging into the ring.

Usage: ``python benchmarks/bench_sass.py [--arch 80,89,90] [--json out.json] [--no-atomics]``
(no GPU needed; needs hookcap built with CUDA and, for the SASS, nvdisasm from
the toolkit or from triton's ``backends/nvidia/bin``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THREADS = 256  # threads per block of every accumulate launch (stats_launch.cu kThreads)

# Per-SM limits: registers, shared memory usable by blocks (bytes), threads, blocks.
SM_LIMITS = {
    80: dict(regs=65536, smem=167936, threads=2048, blocks=32, optin=166912),
    86: dict(regs=65536, smem=102400, threads=1536, blocks=16, optin=101376),
    89: dict(regs=65536, smem=102400, threads=1536, blocks=24, optin=101376),
    90: dict(regs=65536, smem=233472, threads=2048, blocks=32, optin=232448),
}
SMEM_RESERVED = 1024  # per block, sm_80 and later
MIN_BLOCKS = 4  # launch_plan.cuh kMinBlocks: the launcher's dynamic shared-memory budget keeps 4 blocks per SM
LOG2_MAX_DYN = 4 * (4405 + 1)  # log2 counts in dynamic shared memory: at most 4,405 bins (+1)
LOG2KEY_MAX_DYN = 4 * 2**13  # log2 keys (sign, exponent, 4 mantissa bits) within the budget
H100 = dict(sms=132, clock_hz=1.755e9, issue_per_sm_clk=128, fp64_per_sm_clk=64, hbm_bytes_s=3.35e12)

ELEM_BYTES = {"double": 8, "float": 4, "c10::Half": 2, "c10::BFloat16": 2,
              "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1}
SHORT = {"double": "f64", "float": "f32", "c10::Half": "f16", "c10::BFloat16": "bf16",
         "c10::Float8_e4m3fn": "e4m3", "c10::Float8_e5m2": "e5m2"}

FP64_OPS = ("DADD", "DMUL", "DFMA", "DSETP", "DMNMX", "DSET", "DMMA")
FP64_CONV = re.compile(r"^(F2F|I2F|F2I|F2IP|I2FP)\.[^ ]*(F64)")


def build_meta() -> dict:
    """The build's choices (toolkit, nvcc flags, C++ ABI) from hookcap/_build_meta.json."""
    path = os.path.join(ROOT, "hookcap", "_build_meta.json")
    if not os.path.isfile(path):
        raise SystemExit("bench_sass: build hookcap first (python setup.py build_ext --inplace)")
    with open(path) as f:
        meta = json.load(f)
    if not meta.get("cuda") or not meta.get("cuda_home"):
        raise SystemExit(f"bench_sass: hookcap was built without CUDA ({meta.get('cuda_reason')})")
    return meta


def find_tool(name: str, cuda_home: str) -> str:
    cands = [os.path.join(cuda_home, "bin", name)]
    try:
        import triton

        cands.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name))
    except ImportError:
        pass
    for c in cands:
        if os.path.isfile(c):
            return c
    raise SystemExit(f"bench_sass: {name} not found (looked in {cands})")


def build_cubin(arch: int, meta: dict, out_dir: str) -> tuple[str, str]:
    """Compile stats_launch.cu for sm_<arch> as the build did; returns (cubin path, ptxas -v log)."""
    cuda_home = meta["cuda_home"]
    os.environ.setdefault("CUDA_HOME", cuda_home)
    from torch.utils import cpp_extension

    incs = [os.path.join(ROOT, "csrc")] + cpp_extension.include_paths(device_type="cuda")
    cubin = os.path.join(out_dir, f"stats_sm{arch}.cubin")
    # torch's BuildExtension adds COMMON_NVCC_FLAGS (the __CUDA_NO_HALF/BFLOAT16 macros) to every
    # nvcc command of the build: without them the 16-bit code compiles to other instructions.
    cmd = [os.path.join(cuda_home, "bin", "nvcc"), "-cubin", f"-arch=sm_{arch}",
           *cpp_extension.COMMON_NVCC_FLAGS, *meta["nvcc_flags"],
           "-Xptxas", "-v", "-DHOOKCAP_WITH_CUDA=1", f"-D_GLIBCXX_USE_CXX11_ABI={meta['cxx_abi']}",
           "-DTORCH_EXTENSION_NAME=_C", *[f"-I{i}" for i in incs],
           os.path.join(ROOT, "csrc", "cuda", "stats_launch.cu"), "-o", cubin]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench_sass: nvcc failed for sm_{arch}:\n{r.stderr[-4000:]}")
    return cubin, r.stderr


def demangle(names: list[str]) -> dict[str, str]:
    tool = shutil.which("c++filt")
    if not tool or not names:
        return {n: n for n in names}
    r = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True)
    return dict(zip(names, r.stdout.splitlines()))


def ptxas_info(log: str) -> dict[str, dict]:
    """registers, spill bytes, static shared memory per mangled kernel name."""
    info, cur = {}, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            cur = info.setdefault(m.group(1), dict(regs=0, spill_st=0, spill_ld=0, smem=0))
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            cur["spill_st"], cur["spill_ld"] = int(m.group(1)), int(m.group(2))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["regs"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            cur["smem"] = int(s.group(1)) if s else 0
    return info


_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
# The source line that marks the steady-state loop of the accumulate kernels.
MARKER = "// the steady-state loop"


def marker_lines() -> set[int]:
    """The source lines marked as a steady-state loop (one per loop form)."""
    path = os.path.join(ROOT, "csrc", "cuda", "stats_kernel.cuh")
    with open(path) as f:
        return {i for i, line in enumerate(f, 1) if MARKER in line}


def sass_functions(nvdisasm: str, cubin: str) -> dict[str, list[tuple[int, str, int]]]:
    """mangled name -> [(address, instruction text, stats_kernel.cuh line or 0)]
    from nvdisasm with line info; branch targets are rewritten as addresses."""
    out = subprocess.run([nvdisasm, "--print-line-info", cubin], capture_output=True, text=True,
                         check=True).stdout
    funcs, labels, cur, line_no = {}, {}, None, 0
    pending_labels: list[str] = []
    for line in out.splitlines():
        m = re.match(r"^\.text\.(\S+):$", line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = re.match(r"^(\.L_x_\d+):$", line)
        if m:
            pending_labels.append(m.group(1))
            continue
        m = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if m:
            line_no = int(m.group(2)) if m.group(1).endswith("stats_kernel.cuh") else 0
            continue
        m = _INSN.search(line)
        if m and cur is not None:
            addr = int(m.group(1), 16)
            for lab in pending_labels:
                labels[lab] = addr
            pending_labels = []
            cur.append((addr, m.group(2).strip(), line_no))
    for insns in funcs.values():  # `(.L_x_12) -> 0x...
        for i, (addr, text, ln) in enumerate(insns):
            m = re.search(r"`\((\.L_x_\d+)\)", text)
            if m and m.group(1) in labels:
                insns[i] = (addr, text.replace(m.group(0), hex(labels[m.group(1)])), ln)
    return funcs


def opcode(text: str) -> str:
    t = re.sub(r"^@!?U?P[T0-9]+\s+", "", text)  # predicate guard
    return t.split()[0] if t else ""


def is_global_load(op: str) -> bool:
    return op.startswith("LDG") or op.startswith("LD.E")


def load_bytes(op: str) -> int:
    for suffix, b in ((".128", 16), (".64", 8), (".U16", 2), (".S16", 2), (".U8", 1), (".S8", 1)):
        if suffix in op:
            return b
    return 4


def is_fp64(text: str) -> bool:
    op = opcode(text)
    return op.split(".")[0] in FP64_OPS or bool(FP64_CONV.match(op))


def stub_returns(insns: list[tuple[int, str, int]]) -> set[int]:
    """Indices of the branches that end the stubs BRA.DIV jumps to (a warp-synchronous
    instruction redone for a diverged warp, e.g. MATCH under WARPSYNC.COLLECTIVE), which
    jump back to just after the instruction: returns, not loops."""
    index = {a: i for i, (a, _, _) in enumerate(insns)}
    out = set()
    for _, text, _ in insns:
        op = opcode(text)
        if op.startswith("BRA.DIV"):
            m = re.search(r"0x([0-9a-f]+)\s*$", text)
            i = index.get(int(m.group(1), 16)) if m else None
            while i is not None and i < len(insns):
                t = insns[i][1]
                if opcode(t) == "BRA" and not t.startswith("@"):
                    out.add(i)
                    break
                i += 1
    return out


def loops(insns: list[tuple[int, str, int]]) -> list[tuple[int, int]]:
    """(first index, last index) of every backward branch's body (not stub returns)."""
    index = {a: i for i, (a, _, _) in enumerate(insns)}
    returns = stub_returns(insns)
    found = []
    for i, (addr, text, _) in enumerate(insns):
        op = opcode(text)
        if op.startswith("BRA") and i not in returns:
            m = re.search(r"0x([0-9a-f]+)", text.split(op, 1)[1])
            if m:
                target = int(m.group(1), 16)
                if target <= addr and target in index:
                    found.append((index[target], i))
    return found


def regs_of(operand_text: str) -> set[int]:
    return {int(r) for r in re.findall(r"\bR(\d+)\b", operand_text)}


def in_flight_loads(body: list[str]) -> int:
    """Global-load bytes issued before the first instruction that reads a register one of them wrote
    (a load whose address depends on an earlier load included)."""
    written: set[int] = set()
    issued = 0
    for text in body:
        if reads(text) & written:
            break
        if is_global_load(opcode(text)):
            written |= dest_regs(text)
            issued += load_bytes(opcode(text))
    return issued


def dest_regs(text: str) -> set[int]:
    """Registers a global load writes."""
    t = re.sub(r"^@!?U?P[T0-9]+\s+", "", text)
    dst = re.match(r"\S+\s+R(\d+)", t)
    if not dst:
        return set()
    base = int(dst.group(1))
    return set(range(base, base + max(1, load_bytes(t.split()[0]) // 4)))


def reads(text: str) -> set[int]:
    """Registers an instruction reads (its sources; a store's every operand)."""
    t = re.sub(r"^@!?U?P[T0-9]+\s+", "", text)
    op = t.split()[0]
    operands = t[len(op):]
    parts = operands.split(",", 1)
    return regs_of(operands if op.startswith("ST") else (parts[1] if len(parts) > 1 else ""))


def average_in_flight(body: list[str]) -> float:
    """Global-load bytes in flight per thread on average over the loop (Little's
    law in issue order): each load counts from its issue to the first
    instruction that reads its result, going round the loop, as a share of the
    loop's length. A loop that issues its loads together and then waits on the
    first one at once has a high peak (in_flight_loads) but a low average."""
    total = 0
    n = len(body)
    for i, text in enumerate(body):
        if not is_global_load(opcode(text)):
            continue
        regs = dest_regs(text)
        dist = next((k for k in range(1, n + 1) if reads(body[(i + k) % n]) & regs), n)
        total += load_bytes(opcode(text)) * dist
    return total / n


def analyse(insns: list[tuple[int, str, int]], elem_bytes: int, dense: bool, marker: set[int]) -> dict | None:
    """The steady-state loop of one accumulate kernel: of the loops holding
    code of the marked source line, one with no other such loop inside (the
    longest if several: the fast path, not a redo loop the compiler also
    tagged, which may load more per iteration than a fast path unrolled
    less); without a marked loop, the innermost loop with the most loads."""
    best = None
    found = loops(insns)
    marked = [(a, b) for a, b in found if any(ln in marker for _, _, ln in insns[a:b + 1])]
    if marked:
        pool = [(a, b) for a, b in marked if not any((c, d) != (a, b) and a <= c and d <= b for c, d in marked)]
    else:
        pool = [(a, b) for a, b in found if not any((c, d) != (a, b) and a <= c and d <= b for c, d in found)]
    for a, b in pool:
        body = [t for _, t, _ in insns[a:b + 1]]
        loads = [opcode(t) for t in body if is_global_load(opcode(t))]
        if not loads:
            continue
        vec = [op for op in loads if load_bytes(op) == 16]
        if dense and not vec:
            continue
        nbytes = sum(load_bytes(op) for op in (vec if dense else loads))
        key = (-len(body),) if marked else (-len(vec if dense else loads), len(body))
        if best is None or key < best[3]:
            best = (body, nbytes, len(loads), key)
    if best is None:
        return None
    body, nbytes, nloads, _ = best
    elems = max(1, nbytes // elem_bytes)
    n = len(body)
    fp64 = sum(is_fp64(t) for t in body)
    # Branches inside the body (besides the back edge): with none, the body is the executed path;
    # with some, it counts every path and so overstates one element's cost.
    branches = sum(opcode(t).startswith("BRA") for t in body[:-1])
    # Spill traffic inside the loop (ptxas's spill bytes also count stores made once outside it).
    local = sum(opcode(t).startswith(("LDL", "STL")) for t in body)
    return dict(loop_insns=n, branches=branches, local_per_iter=local, elems_per_iter=elems, insns_per_elem=n / elems, fp64_per_elem=fp64 / elems,
                loads_per_elem=nloads / elems, in_flight_bytes_per_thread=in_flight_loads(body),
                avg_in_flight_bytes_per_thread=average_in_flight(body))


def max_dynamic_smem(arch: int, mode: str, dtype: str, static: int) -> int:
    """The most dynamic shared memory the launcher gives a kernel of this mode on sm_<arch>
    (kernels::hist_plan with kernels::smem_budget): log2 its largest histogram, linear (and
    wide on float, its thresholds) up to the budget."""
    lim = SM_LIMITS.get(arch, SM_LIMITS[80])
    budget = min(lim["smem"] // MIN_BLOCKS - SMEM_RESERVED, lim["optin"]) - static
    if mode in ("log2", "log2fine"):
        return LOG2_MAX_DYN
    if mode == "log2key":
        return min(LOG2KEY_MAX_DYN, budget)
    if mode == "linear" or (mode == "wide" and dtype != "double"):
        return budget
    return 0


def blocks_per_sm(arch: int, regs: int, smem: int) -> int:
    lim = SM_LIMITS.get(arch, SM_LIMITS[80])
    warps = THREADS // 32
    regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = lim["regs"] // (regs_per_warp * warps)
    by_smem = lim["smem"] // (smem + SMEM_RESERVED)
    by_threads = lim["threads"] // THREADS
    return max(0, min(by_regs, by_smem, by_threads, lim["blocks"]))


def bound_fraction(insns_per_elem: float, fp64_per_elem: float, elem_bytes: int) -> float:
    clk = H100["sms"] * H100["clock_hz"]
    rate = clk * H100["issue_per_sm_clk"] / insns_per_elem
    if fp64_per_elem > 0:
        rate = min(rate, clk * H100["fp64_per_sm_clk"] / fp64_per_elem)
    return rate * elem_bytes / H100["hbm_bytes_s"]


def parse_name(demangled: str) -> tuple[str, str] | None:
    """(element type, label) of an accumulate kernel's demangled name."""
    m = re.search(r"accumulate_kernel<([^>]*(?:<[^>]*>[^>]*)*)>", demangled)
    if not m:
        return None
    args = [a.strip() for a in m.group(1).split(",")]
    if len(args) not in (3, 4, 5):
        return None
    modes = {"0": "-", "1": "log2exp", "2": "log2", "3": "linear", "4": "wide", "5": "wide-exact",
             "6": "log2key", "7": "log2fine"}
    reads = {"0": "dense", "1": "rows", "2": "strided"}  # strided.h ReadKind: flat, vectors, elements
    mode = modes.get(args[1], args[1])
    if len(args) >= 4 and args[3] in ("true", "1"):  # kM4: moments=4
        mode += "+m4"
    read = reads.get(args[2], args[2])
    if len(args) == 5 and args[4] in ("true", "1"):  # kMany: a many-tensor launch's kernel
        read += "-many"
    return args[0], " ".join([SHORT.get(args[0], args[0]), mode, read])


def launch_atomics(n: int = 16 * 2**20, grid: int = 528) -> dict:
    """Global atomics of one accumulate launch (see the module docstring),
    with the tree merge and without; plus the histogram bins the data hit."""
    import sys

    import torch

    sys.path.insert(0, os.path.join(ROOT, "tests", "cuda_emu"))
    import emu_build

    sys.path.insert(0, ROOT)
    from hookcap import Histogram, _layout

    emu = emu_build.load()
    h = Histogram.log2()
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out = dict(elements=n, grid=grid, dtype="bfloat16", histogram="log2(-64, 64)")
    for tree in (True, False):
        ring = torch.zeros(1, 1, _layout.HEADER + h.nbins, dtype=torch.int64)
        state = torch.tensor([0, 1, 0])
        torch.ops.hookcap.reset_slot(ring, state)
        before = emu.stats()["device_atomics"]
        emu.accumulate(x, ring, state, 0, *h.op_args(), grid, 32, tree=tree)
        out["tree" if tree else "direct"] = emu.stats()["device_atomics"] - before
        out["bins_hit"] = int((ring[0, 0, _layout.HEADER:] != 0).sum())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="80,89,90")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-atomics", action="store_true", help="skip the emulated count of a launch's atomics")
    args = ap.parse_args()
    meta = build_meta()
    cuda_home = meta["cuda_home"]
    nvdisasm = find_tool("nvdisasm", cuda_home)
    marker = marker_lines()
    print(f"# toolkit {cuda_home}; bound: H100 SXM {H100['sms']} SMs x {H100['clock_hz'] / 1e9:.3f} GHz, "
          f"{H100['issue_per_sm_clk']} thread-instructions/SM/clk, FP64 {H100['fp64_per_sm_clk']}/SM/clk, "
          f"HBM {H100['hbm_bytes_s'] / 1e12:.2f} TB/s; {THREADS} threads per block")
    results, others = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in (int(a) for a in args.arch.split(",")):
            cubin, log = build_cubin(arch, meta, tmp)
            info = ptxas_info(log)
            funcs = sass_functions(nvdisasm, cubin)
            names = demangle(list(funcs))
            for mangled, insns in sorted(funcs.items(), key=lambda kv: names[kv[0]]):
                parsed = parse_name(names[mangled])
                if parsed is None:
                    continue
                dtype, label = parsed
                elem = ELEM_BYTES.get(dtype, 4)
                dense = label.split()[-1] in ("dense", "rows")  # 16-byte vector loads
                loop = analyse(insns, elem, dense, marker)
                pi = info.get(mangled, dict(regs=0, spill_st=0, spill_ld=0, smem=0))
                dyn = max_dynamic_smem(arch, label.split()[1].split("+")[0], dtype, pi["smem"])
                bps = blocks_per_sm(arch, pi["regs"], pi["smem"] + dyn)
                row = dict(arch=arch, kernel=label, dtype=SHORT.get(dtype, dtype), regs=pi["regs"],
                           spill_bytes=pi["spill_st"] + pi["spill_ld"], smem=pi["smem"], dyn_smem=dyn,
                           blocks_per_sm=bps, total_insns=len(insns))
                if loop:
                    row.update(loop)
                    row["in_flight_kb_per_sm"] = loop["in_flight_bytes_per_thread"] * THREADS * bps / 1024
                    row["avg_in_flight_kb_per_sm"] = loop["avg_in_flight_bytes_per_thread"] * THREADS * bps / 1024
                    row["bound_of_hbm"] = bound_fraction(loop["insns_per_elem"], loop["fp64_per_elem"], elem)
                results.append(row)
            for mangled, pi in sorted(info.items(), key=lambda kv: names.get(kv[0], kv[0])):
                name = names.get(mangled, mangled)
                if mangled in funcs and parse_name(name) is not None:
                    continue
                others.append(dict(arch=arch, kernel=name.split("(")[0].replace("hookcap::kernels::", ""),
                                   regs=pi["regs"], spill_bytes=pi["spill_st"] + pi["spill_ld"], smem=pi["smem"]))
    print(f"{'sm':>3} {'kernel':<34} {'insn/el':>7} {'fp64/el':>7} {'ld/el':>6} {'br':>3} {'regs':>4} "
          f"{'spill':>5} {'inlp':>4} {'smem':>6} {'dyn':>6} {'blk/SM':>6} {'KB fly/SM':>9} {'KB avg':>6} {'bound':>6}")
    for r in results:
        if "insns_per_elem" in r:
            print(f"{r['arch']:>3} {r['kernel']:<34} {r['insns_per_elem']:>7.1f} {r['fp64_per_elem']:>7.2f} "
                  f"{r['loads_per_elem']:>6.3f} {r['branches']:>3} {r['regs']:>4} {r['spill_bytes']:>5} {r['local_per_iter']:>4} {r['smem']:>6} "
                  f"{r['dyn_smem']:>6} {r['blocks_per_sm']:>6} {r['in_flight_kb_per_sm']:>9.1f} "
                  f"{r['avg_in_flight_kb_per_sm']:>6.1f} {r['bound_of_hbm']:>6.0%}")
        else:
            print(f"{r['arch']:>3} {r['kernel']:<34} {'(no loop found)':>27} {r['regs']:>4} {r['spill_bytes']:>5} {'':>4} "
                  f"{r['smem']:>6} {r['dyn_smem']:>6} {r['blocks_per_sm']:>6}")
    print(f"\n# the launcher's other kernels (ptxas): registers, spill bytes, static shared memory")
    for r in others:
        print(f"{r['arch']:>3} {r['kernel']:<64} {r['regs']:>4} {r['spill_bytes']:>5} {r['smem']:>6}")
    atomics = None
    if not args.no_atomics:
        atomics = launch_atomics()
        print(f"\n# epilogue: global atomics per launch, {atomics['elements'] / 2**20:.0f} M {atomics['dtype']} "
              f"values, {atomics['histogram']} ({atomics['bins_hit']} bins hit), {atomics['grid']} blocks "
              f"(emulated)")
        print(f"tree merge (a ticket per block and per group, one merge): {atomics['tree']}")
        print(f"every block merging into the ring:                      {atomics['direct']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(assumptions=H100, threads=THREADS, results=results, other_kernels=others,
                           launch_atomics=atomics), f, indent=1)


if __name__ == "__main__":
    main()
