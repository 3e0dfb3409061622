"""Reading the C++ kernels TorchInductor generates for the CPU: the loop nests
of each kernel, which buffers they load and store, and what a nest that only
reduces (stores nothing but reduction results) reads from memory.

That last number is what telemetry costs in memory traffic beyond the
model's own kernels: a statistic fused into the loop that produces or
consumes a tensor adds no nest of its own; one that could not be fused reads
the tensor again in a nest whose only outputs are reduction results.

Used by bench_overhead.py --compile and tests/test_fused.py. Only the
generated code is read (``torch._inductor.utils.run_and_get_code``); the
patterns are those of Inductor's C++ backend (torch 2.x): ``in_ptrN`` /
``out_ptrN`` / ``in_out_ptrN`` arguments, ``for(int64_t xK=...; xK<...(N L);``
loops, ``tmp_accK`` reduction accumulators.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_KERNEL = re.compile(r"^(cpp_fused_\w+) = async_compile\.cpp_pybinding\(\[(.*?)\], r'''(.*?)'''\)", re.M | re.S)
_FOR = re.compile(r"for\(int64_t (x\d+)=static_cast<int64_t>\(\d+L\); \1<static_cast<int64_t>\((\d+)L\)")
_PTR = r"(in_ptr\d+|out_ptr\d+|in_out_ptr\d+)"
_ITEMSIZE = {"float": 4, "double": 8, "int64_t": 8, "int32_t": 4, "bool": 1, "at::BFloat16": 2,
             "at::Half": 2, "bfloat16": 2, "half": 2, "uint8_t": 1, "int8_t": 1}


@dataclass
class Nest:
    """One top-level loop nest of a kernel. ``elements``: iterations of the
    nest (product of its loop variables' bounds); ``loads`` / ``stores``:
    buffers read / written at an index that depends on the loop (scalar
    reads and the results written after the loop are not counted);
    ``reductions``: reduction accumulator updates inside the nest."""

    kernel: str
    elements: int
    loads: set = field(default_factory=set)
    stores: set = field(default_factory=set)
    reductions: int = 0

    @property
    def reduce_only(self) -> bool:
        """Reads data and writes only reduction results (what a statistic
        that is not fused into a model loop looks like)."""
        return self.reductions > 0 and not self.stores


def cpp_kernels(code: str):
    """``(name, {pointer: element bytes}, body)`` of every C++ kernel in a
    module Inductor generated."""
    for m in _KERNEL.finditer(code):
        types = [t.strip().strip("'") for t in m.group(2).split(",")]
        body = m.group(3)
        sig = re.search(r"kernel\((.*?)\)\s*\{", body, re.S)
        names = re.findall(_PTR, sig.group(1)) if sig else []
        sizes = {}
        for name, t in zip(names, types):
            base = t.replace("const", "").replace("*", "").strip()
            sizes[name] = _ITEMSIZE.get(base, 4)
        yield m.group(1), sizes, body


def loop_nests(name: str, body: str) -> list[Nest]:
    """The top-level loop nests of one kernel body."""
    out, cur, depth, start = [], None, 0, 0
    for line in body.splitlines():
        if cur is None and _FOR.search(line):
            cur, start = [], depth
        if cur is not None:
            cur.append(line)
        depth += line.count("{") - line.count("}")
        if cur is not None and len(cur) > 1 and depth <= start:
            out.append(_nest(name, "\n".join(cur)))
            cur = None
    return out


def _nest(kernel: str, text: str) -> Nest:
    bounds: dict[str, int] = {}
    for var, n in _FOR.findall(text):
        bounds[var] = max(bounds.get(var, 0), int(n))
    elements = 1
    for n in bounds.values():
        elements *= n
    looped = r"\s*(?:\+|\[)\s*static_cast<int64_t>\(([^;]*?)\)"
    loads, stores = set(), set()
    for ptr, idx in re.findall(_PTR + looped, text):
        if re.search(r"\bx\d+\b", idx):
            loads.add(ptr)
    for ptr, idx in re.findall(r"\.store\(" + _PTR + r"\s*\+\s*static_cast<int64_t>\(([^;]*?)\)", text):
        if re.search(r"\bx\d+\b", idx):
            stores.add(ptr)
    for ptr, idx in re.findall(_PTR + r"\[static_cast<int64_t>\(([^\]]*?)\)\]\s*=[^=]", text):
        if re.search(r"\bx\d+\b", idx):
            stores.add(ptr)
    reductions = len(re.findall(r"\btmp_acc\d+(?:_vec)?(?:_local)?\s*=", text))
    return Nest(kernel, elements, loads - stores, stores, reductions)


def nests(codes) -> list[Nest]:
    """Every loop nest of every C++ kernel in ``codes`` (run_and_get_code's list)."""
    out = []
    for code in codes:
        for name, _, body in cpp_kernels(code):
            out.extend(loop_nests(name, body))
    return out


def reduce_only_bytes(codes, min_elements: int = 1) -> int:
    """Bytes that reduce-only nests of at least ``min_elements`` iterations
    load: iterations times the element size of each buffer they read."""
    total = 0
    for code in codes:
        for name, sizes, body in cpp_kernels(code):
            for n in loop_nests(name, body):
                if n.reduce_only and n.elements >= min_elements:
                    total += n.elements * sum(sizes.get(p, 4) for p in n.loads)
    return total


# -- Triton ----------------------------------------------------------------------
#
# The Triton source Inductor would launch on a GPU, generated on the CPU: with
# ``cpu_backend = "triton"`` Inductor schedules and fuses with the same Triton
# scheduler it uses for CUDA (fusion by element count), and writes the same
# kernel source; only device properties (SM count, hence split sizes) differ,
# and the lowering of ``cat``, installed here as a GPU's (_gpu_cat_lowering).
# The kernels are not compiled or run (no GPU, no Triton CPU backend here):
# launches are no-ops, so the values computed are garbage, which codegen of
# the next graph (the backward) does not read.

_TRITON_ITEMSIZE = {"fp32": 4, "fp64": 8, "fp16": 2, "bf16": 2, "i64": 8, "i32": 4, "i1": 1, "i8": 1, "u8": 1}


@dataclass
class TritonKernel:
    """One generated Triton kernel. ``elements``: xnumel times r0_numel
    (-1 when dynamic); ``loads``: pointers read at a looped index and their
    element bytes; ``big_stores``: pointers written inside the reduction loop
    or by a pointwise kernel (model-sized outputs) and their element bytes;
    ``reductions``: reduction calls."""

    source: str
    elements: int
    loads: dict
    big_stores: dict
    reductions: int

    @property
    def name(self) -> str:
        m = re.search(r"def (\w+)\(", self.source)
        return m.group(1) if m else ""

    @property
    def reduce_only(self) -> bool:
        """Reads data and writes only reduction results."""
        return self.reductions > 0 and not self.big_stores

    @property
    def traffic(self) -> int:
        """Bytes the kernel moves: its iterations times the element bytes of
        every pointer it reads or writes at a looped index (a broadcast
        operand counts in full: an upper bound, the same in every step
        compared)."""
        return max(self.elements, 0) * (sum(self.loads.values()) + sum(self.big_stores.values()))


def triton_kernel(source: str) -> TritonKernel:
    body = source[source.index("@triton.jit"):]
    xn = re.search(r"\bxnumel = (\d+)", body)
    yn = re.search(r"\bynumel = (\d+)", body)  # a pointwise kernel tiled in two dimensions
    rn = re.search(r"\br0_numel = (\d+)", body)
    reduces = re.search(r"\br0_numel\b", body) is not None
    tiled = yn is not None or re.search(r"\bynumel\b", body) is None
    elements = (int(xn.group(1)) * (int(yn.group(1)) if yn else 1) * (int(rn.group(1)) if rn else 1)
                if xn and tiled and (rn or not reduces) else -1)
    sig = dict(re.findall(r"'(\w+_ptr\d+)': '\*(\w+)'", source))
    loads = {p: _TRITON_ITEMSIZE.get(sig.get(p, ""), 4)
             for p, idx in re.findall(r"tl\.load\((\w+_ptr\d+) \+ \(([^)]*)\)", body) if re.search(r"[xyr]\w*\d", idx)}
    reductions = len(re.findall(r"\btl\.sum\(|triton_helpers\.(?:min2|max2|prod)\(|\btl\.reduce\(", body))
    big = {}
    for p, idx in re.findall(r"tl\.store\((\w+_ptr\d+) \+ \(([^)]*)\)", body):
        if re.search(r"\br0_\d+\b|\br\d+\b", idx) or (reductions == 0 and re.search(r"\b[xy]\d+\b", idx)):
            big[p] = _TRITON_ITEMSIZE.get(sig.get(p, ""), 4)
    return TritonKernel(source, elements, loads, big, reductions)


def triton_reduce_only_bytes(kernels, min_elements: int = 1) -> int:
    """Bytes that reduce-only Triton kernels of at least ``min_elements``
    iterations load (as :func:`reduce_only_bytes` for C++)."""
    return sum(k.elements * sum(k.loads.values()) for k in kernels
               if k.reduce_only and k.elements >= min_elements)


def triton_traffic_bytes(kernels) -> int:
    """Bytes all ``kernels`` move (:attr:`TritonKernel.traffic`): compared
    between a watched and an unwatched step, what telemetry adds to memory
    traffic in the model's kernels and its own, extra stores included."""
    return sum(k.traffic for k in kernels)


class triton_codegen:
    """Context: Inductor compiles CPU code with its Triton scheduler, writing
    the Triton kernels a GPU would run. By default they are not compiled or
    run: :meth:`run` runs a step and keeps the generated modules, and values
    computed inside are garbage. With ``interpret=True`` Triton's interpreter
    runs them on the CPU (NumPy, one program instance at a time: slow, for
    small models), so the values are those of the GPU's kernels up to
    summation order; the process must have been started with
    ``TRITON_INTERPRET=1`` (Triton reads it as it defines its own functions),
    and ``libdevice`` calls run as :func:`_interpreted_libdevice`'s (the
    interpreter has no external library).
    The CPU's device properties are those of a GPU with ``sms`` streaming
    multiprocessors (132: an H100 or H200; 2,048 threads and 65,536
    registers each): Inductor splits a reduction with few outputs into two
    kernels by the SM count, so the CPU's (its cores) would write other
    kernels than a GPU's. Restores every setting it changed on exit."""

    def __init__(self, interpret: bool = False, sms: int = 132):
        self.interpret = interpret
        self.sms = sms

    def __enter__(self):
        import os

        import torch
        import torch._inductor.config as icfg
        import torch.utils._triton as ut
        from torch._inductor.lowering import lowerings
        from torch._inductor.runtime import triton_heuristics as th
        from torch._inductor.runtime.hints import DeviceProperties

        self.codes = []
        self._undo = [
            (icfg, "cpu_backend", "triton"), (icfg, "compile_threads", 1), (icfg, "fx_graph_cache", False),
            (ut, "triton_hash_with_backend", lambda: "codegen-only"), (ut, "triton_backend", lambda: None),
            (th.CachingAutotuner, "precompile", lambda self, *a, **k: None),
            # oneDNN (CPU only) makes Inductor lay out every convolution's
            # tensors channels-last; off, the layout follows CUDA's rules.
            (torch.backends.mkldnn, "enabled", False),
            (DeviceProperties, "create", _gpu_properties(DeviceProperties.create, self.sms)),
        ]
        self._lowerings = _gpu_cat_lowering()  # concatenation as on a GPU
        if self.interpret:
            if os.environ.get("TRITON_INTERPRET") != "1":
                raise RuntimeError("triton_codegen(interpret=True) needs TRITON_INTERPRET=1 set before "
                                   "the process imports triton")
            from torch._inductor.runtime import triton_helpers

            self._undo.append((triton_helpers, "libdevice", _interpreted_libdevice()))
        else:
            self._undo.append((th.CachingAutotuner, "run", lambda self, *a, **k: None))
            # The Triton kernels do not run, so the values are garbage anyway:
            # the extern matmuls that write into a buffer do not run either
            # (on the CPU they are most of a large step's time).
            from torch._inductor.select_algorithm import extern_kernels as ek

            for name in ("mm", "addmm", "bmm", "baddbmm", "bias_addmm"):
                if hasattr(ek, name):
                    self._undo.append((ek, name, _skip_into_out(getattr(ek, name))))
            # Buffers the Triton kernels would have written hold garbage;
            # zeroed, an index read from one (max pooling's backward scatters
            # by such indices on the CPU) stays in range.
            guards = torch._C._dynamo.guards
            self._undo.append((guards, "_empty_strided_cpu", _zeroed(guards._empty_strided_cpu)))
            # The CPU's aten kernels may return another layout than the one
            # Inductor planned for a GPU (a channels-last convolution's
            # backward): no check of sizes and strides at run time.
            self._undo.append((icfg, "size_asserts", False))
        # A class's own attribute as it is stored (a classmethod, not bound).
        self._undo = [(obj, name, vars(obj)[name] if isinstance(obj, type) and name in vars(obj) else getattr(obj, name),
                       new) for obj, name, new in self._undo]
        for obj, name, _, new in self._undo:
            setattr(obj, name, new)
        self._lowerings_undo = {op: lowerings[op] for op in self._lowerings}
        lowerings.update(self._lowerings)
        torch._dynamo.reset()
        return self

    def run(self, fn):
        """Call ``fn`` (one step), keeping the modules Inductor generates."""
        from torch._inductor.utils import run_and_get_code

        result, codes = run_and_get_code(fn)
        self.codes.extend(codes)
        return result

    def __exit__(self, *exc):
        import torch
        from torch._inductor.lowering import lowerings

        for obj, name, old, _ in reversed(self._undo):
            setattr(obj, name, old)
        lowerings.update(self._lowerings_undo)
        torch._dynamo.reset()
        return False

    def kernels(self) -> list[TritonKernel]:
        return triton_launches(self.codes)


def _gpu_properties(create, sms: int):
    """``DeviceProperties.create`` answering for a CPU device as for a GPU of
    ``sms`` SMs (see :class:`triton_codegen`); other devices as ``create``."""
    def gpu_like(device):
        props = create(device)
        if device.type != "cpu":
            return props
        return props._replace(multi_processor_count=sms, max_threads_per_multi_processor=2048,
                              regs_per_multiprocessor=65536, warp_size=32)
    return staticmethod(gpu_like)


def _skip_into_out(fn):
    """``fn`` (an extern kernel) as a no-op where it writes into ``out=``."""
    def skipped(*args, out=None, **kwargs):
        return out if out is not None else fn(*args, **kwargs)
    return skipped


def _zeroed(empty):
    """``empty`` (an allocator of uninitialised tensors) returning zeros."""
    def zeroed(*args, **kwargs):
        return empty(*args, **kwargs).zero_()
    return zeroed


def _gpu_cat_lowering() -> dict:
    """Inductor's lowering of ``aten.cat`` as it decides on a GPU, to install
    in its lowering table: {op: lowering}. For CPU tensors Inductor always
    concatenates into one buffer (a kernel per input writing its slice); on a
    GPU it may compute the result as one pointwise kernel, which changes what
    a statistic of the result can fuse with (e.g. the gradient of GPT-2's
    ``c_attn``, the concatenation of the query, key and value gradients).
    The same source with its CPU test answered for a GPU. Empty where this
    torch's source does not have the test (left as it is)."""
    import inspect

    import torch
    import torch._inductor.lowering as lowering

    cpu_test = 'cpu_device = inputs[0].get_device().type == "cpu"'
    try:
        src = inspect.getsource(lowering.cat)
    except (OSError, TypeError):
        return {}
    if src.count(cpu_test) != 1 or not src.startswith("@register_lowering(aten.cat)\n"):
        return {}
    namespace = dict(vars(lowering))
    exec(src.removeprefix("@register_lowering(aten.cat)\n").replace(cpu_test, "cpu_device = False"), namespace)
    aten = torch.ops.aten
    table: dict = {}
    lowering.register_lowering(aten.cat, lowering_dict=table)(namespace["cat"])
    return {op: table[aten.cat] for op in (aten.cat, aten.cat.default)}


def _interpreted_libdevice():
    """What Inductor's kernels call as ``libdevice`` under Triton's
    interpreter: ``triton.language.math`` (erf, exp, rsqrt, ...), plus tanh
    (GPT-2's GELU) written with exp. Defined when called: ``triton.jit`` makes
    an interpreted function only once TRITON_INTERPRET is set."""
    import triton
    import triton.language as tl

    globals()["tl"] = tl  # the interpreter looks for triton.language in a kernel's globals

    @triton.jit
    def tanh(x):
        e = tl.math.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0, -t, t)

    class Libdevice:
        def __getattr__(self, name):
            return getattr(tl.math, name)

    lib = Libdevice()
    lib.tanh = tanh
    return lib


def merge_partials_bytes(codes) -> int:
    """Bytes of the partials that ``hookcap::merge_partials`` and
    ``merge_partials_list`` calls read in ``codes`` (the fused kernels write
    them): PARTIALS float64 values per block, from each ``(PARTIALS,
    blocks)`` matrix the call's line passes; one whose shape is not written
    literally counts as 0."""
    total = 0
    for code in codes:
        for line in re.findall(r"^.*hookcap\.merge_partials(?:_list)?\.default\(.*$", code, re.M):
            for rows, cols in re.findall(r"reinterpret_tensor\(\w+, \((\d+), (\d+)\)", line):
                total += int(rows) * int(cols) * 8
    return total


def hookcap_calls(codes) -> dict:
    """How many times the generated ``codes`` call each hookcap op: merges
    and shifts, one capture's (a launch each on a GPU) or a run's gathered
    (a launch per 32 merges or 256 shifts), and the op's records."""
    names = ("merge_partials", "merge_partials_list", "fused_shift", "fused_shifts", "record", "accumulate")
    return {n: sum(len(re.findall(rf"hookcap\.{n}\.default\(", c)) for c in codes) for n in names}


def merged_captures(codes) -> int:
    """How many captures the merges in ``codes`` merge: one per
    ``hookcap::merge_partials`` call, and the row ids a gathered
    ``merge_partials_list`` call lists (``hookcap._capture.fused_batch``)."""
    total = 0
    for code in codes:
        total += len(re.findall(r"hookcap\.merge_partials\.default\(", code))
        for rids in re.findall(r"hookcap\.merge_partials_list\.default\(.*, \[([\d, ]+)\]\)\s*$", code, re.M):
            total += len(rids.split(","))
    return total


def triton_launches(codes) -> list[TritonKernel]:
    """Every Triton kernel launch, in order, of the modules Inductor generated
    for a GPU (``run_and_get_code``'s strings): a kernel launched twice is
    listed twice."""
    out = []
    for code in codes:
        defs = {name: triton_kernel(src) for name, src in
                re.findall(r"^(\w+) = async_compile\.triton\('\w+', '''(.*?)'''", code, re.M | re.S)}
        out.extend(defs[name] for name in re.findall(r"^\s*(\w+)\.run\(", code, re.M) if name in defs)
    return out
