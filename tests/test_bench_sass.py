"""benchmarks/bench_sass.py's reading of a SASS loop, on hand-written
listings (no toolkit needed): loops, the loads in flight at the peak and on
average, and the steady-state loop chosen by the source marker."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_sass  # noqa: E402

# Two 16-byte loads issued together; the first is read 2 instructions later,
# the second 4 later, in a loop of 6.
TOGETHER = [
    "LDG.E.128 R4, desc[UR4][R2.64]",
    "LDG.E.128 R8, desc[UR4][R2.64+0x10]",
    "FADD R12, R5, R6",  # R4..R7: the first load's
    "FADD R13, R12, R1",
    "FADD R14, R10, R13",
    "BRA 0x0",
]
# One load issued at the loop's end and read next time round.
ACROSS = [
    "FADD R11, R1, R1",
    "FADD R12, R4, R5",
    "FADD R13, R12, R1",
    "IADD3 R2, P0, R2, 0x10, RZ",
    "@P0 LDG.E.128 R4, desc[UR4][R2.64]",
    "BRA 0x0",
]


def test_peak_counts_the_loads_issued_before_a_reader():
    assert bench_sass.in_flight_loads(TOGETHER) == 32
    assert bench_sass.in_flight_loads(ACROSS) == 16  # read only next time round


def test_average_counts_each_load_to_its_first_reader_round_the_loop():
    assert bench_sass.average_in_flight(TOGETHER) == (16 * 2 + 16 * 3) / 6
    assert bench_sass.average_in_flight(ACROSS) == 16 * 3 / 6  # through the back edge
    unread = ["LDG.E.64 R4, desc[UR4][R2.64]", "FADD R6, R7, R7", "BRA 0x0"]
    assert bench_sass.average_in_flight(unread) == 8  # never read: in flight the whole loop


def test_analyse_takes_the_marked_innermost_loop():
    marker = 100
    # (offset, text, source line): an outer loop (its own load, unmarked code)
    # holding the marked inner loop.
    code = [(0, "LDG.E R20, desc[UR4][R30.64]", 90), (16, "FADD R21, R20, R20", 90)]
    code += [(32 + 16 * i, t, marker) for i, t in enumerate(TOGETHER[:-1])]
    code += [(112, "BRA 0x20", marker), (128, "BRA 0x0", 90), (144, "EXIT", 91)]
    loop = bench_sass.analyse(code, 4, True, {marker})
    assert loop["loop_insns"] == 6 and loop["elems_per_iter"] == 8  # 32 bytes of float
    assert loop["insns_per_elem"] == 6 / 8 and loop["branches"] == 0
    assert loop["in_flight_bytes_per_thread"] == 32
    assert loop["avg_in_flight_bytes_per_thread"] == (16 * 2 + 16 * 3) / 6
    assert loop["local_per_iter"] == 0


def test_analyse_counts_spill_traffic_inside_the_loop_only():
    marker = 100
    code = [(0, "STL [R1], R20", 90)]  # a spill before the loop
    body = TOGETHER[:2] + ["STL [R1+0x4], R4", "@P0 LDL R13, [R1+0x8]"] + TOGETHER[2:-1]
    code += [(16 + 16 * i, t, marker) for i, t in enumerate(body)]
    code += [(16 + 16 * len(body), "BRA 0x10", marker), (400, "EXIT", 91)]
    assert bench_sass.analyse(code, 4, True, {marker})["local_per_iter"] == 2


def test_parse_name_reads_mode_and_read_kind_by_position():
    name = "void hookcap::kernels::accumulate_kernel<c10::BFloat16, 1, 1>(const c10::BFloat16 *, long)"
    assert bench_sass.parse_name(name) == ("c10::BFloat16", "bf16 log2exp rows")
    assert bench_sass.parse_name("void hookcap::kernels::accumulate_kernel<float, 0, 2>(const float *)") == (
        "float", "f32 - strided")
    assert bench_sass.parse_name("void hookcap::kernels::accumulate_kernel<double, 2, 0>(const double *)") == (
        "double", "f64 log2 dense")
    assert bench_sass.parse_name("void hookcap::kernels::accumulate_kernel<float, 6, 0, false>(const float *)") == (
        "float", "f32 log2key dense")
    assert bench_sass.parse_name("void hookcap::kernels::accumulate_kernel<c10::Half, 1, 2, true>(const c10::Half *)") == (
        "c10::Half", "f16 log2exp+m4 strided")
    assert bench_sass.parse_name(
        "void hookcap::kernels::accumulate_kernel<float, 1, 0, false, true>(const float *)") == (
        "float", "f32 log2exp dense-many")  # a many-tensor launch's kernel
    assert bench_sass.parse_name("void hookcap::kernels::advance_kernel(long *)") is None
