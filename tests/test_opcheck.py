"""Dispatcher contract: schemas, Meta/fake kernels and torch.library.opcheck."""

import pytest
import torch

import hookcap  # noqa: F401  (registers torch.ops.hookcap)
from hookcap import Histogram, _layout
from hookcap.functional import new_state

H = Histogram.log2()


def ring_for(h, slots=2, rows=3):
    width = _layout.HEADER + (h.nbins if h else 0)
    ring = torch.zeros((slots, rows, width), dtype=torch.int64)
    torch.ops.hookcap.reset_slot(ring, new_state("cpu"))
    return ring


CASES = [
    (torch.randn(100), H),
    (torch.randn(10, requires_grad=True), H),
    (torch.randn(7, 9).t(), Histogram.linear(-1, 1, 5)),
    (torch.randn(4, 4, dtype=torch.float64)[:, 1], None),
    (torch.randn(33).to(torch.bfloat16), H),
    (torch.randn(300), Histogram.log2(-20, 8, sub=4, signed=True)),
    (torch.empty(0), H),
]


@pytest.mark.parametrize("x,h", CASES)
def test_opcheck_accumulate(x, h):
    ring = ring_for(h)
    args = (x, ring, new_state("cpu"), 1) + (h.op_args() if h else (0, 0.0, 0.0, 0))
    torch.library.opcheck(torch.ops.hookcap.accumulate.default, args)


def test_opcheck_reset_and_advance():
    ring = ring_for(H)
    torch.library.opcheck(torch.ops.hookcap.reset_slot.default, (ring, new_state("cpu")))
    torch.library.opcheck(torch.ops.hookcap.reset_rows.default, (ring, new_state("cpu"), 1, 3))
    torch.library.opcheck(torch.ops.hookcap.advance.default, (ring, new_state("cpu"), 3))


def test_schemas_declare_mutation():
    assert "Tensor(a!) ring" in str(torch.ops.hookcap.accumulate.default._schema)
    assert "Tensor(b!) state" in str(torch.ops.hookcap.advance.default._schema)


def test_meta_kernel_checks_arguments_without_data():
    x = torch.empty(10, device="meta")
    ring = torch.empty((1, 1, _layout.HEADER), dtype=torch.int64, device="meta")
    state = torch.empty(3, dtype=torch.int64, device="meta")
    torch.ops.hookcap.accumulate(x, ring, state, 0, 0, 0.0, 0.0, 0)
    with pytest.raises(RuntimeError, match="supported dtypes are float16"):
        torch.ops.hookcap.accumulate(x.int(), ring, state, 0, 0, 0.0, 0.0, 0)


def test_fake_tensor_mode_runs_ops():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.randn(10)
        ring = torch.zeros((2, 1, _layout.HEADER + H.nbins), dtype=torch.int64)
        st = torch.zeros(3, dtype=torch.int64)
        torch.ops.hookcap.accumulate(x, ring, st, 0, *H.op_args())
        torch.ops.hookcap.advance(ring, st, 1)


def test_opcheck_record_and_its_effect():
    from torch import nn

    model = nn.Linear(3, 3)
    mon = hookcap.Monitor(model, capture="output").attach()
    model(torch.randn(2, 3))
    rec = mon._recorder
    rid = next(iter(rec.rows.values()))
    torch.library.opcheck(torch.ops.hookcap.record.default, (torch.randn(2, 3), rec.fast.id, rid))
    assert hookcap._ops.RECORD_IS_EFFECTFUL  # compiled graphs keep it
    with pytest.raises(RuntimeError, match="no ring"):
        torch.ops.hookcap.record(torch.randn(2), rec.fast.id, 5 << 32)
    mon.detach()


def test_opcheck_update_ops():
    """accumulate_update and its list form (every rule's inputs and output
    sets; a CPU step tensor)."""
    w = torch.randn(6, 5)
    m, v, g = torch.randn(6, 5) * 0.1, torch.rand(6, 5) * 1e-3, torch.randn(6, 5)
    adam = [1e-3, 0.01, 0.0, 0.9, 0.999, 1e-8, 4.0, 0.0]
    sgd = [0.1, 0.01, 0.9, 0.0, 0.0, 0.0, 9.0, 0.0]
    op, ops = torch.ops.hookcap.accumulate_update.default, torch.ops.hookcap.accumulate_updates.default
    for h in (H, None):
        hist = h.op_args() if h else (0, 0.0, 0.0, 0)
        torch.library.opcheck(op, (w, None, m, v, torch.tensor(3.0), adam, 1, ring_for(h), new_state("cpu"),
                                   [0, 1, -1, -1, -1]) + hist)
        torch.library.opcheck(op, (w, g, m, v, torch.tensor(3.0), adam, 1, ring_for(h), new_state("cpu"),
                                   [-1, -1, 2, 0, 1]) + hist)
        torch.library.opcheck(ops, ([w, w[:2]], [g, g[:2]], [m, m[:2]], [None, None], [None, None], sgd, 0,
                                    ring_for(h), new_state("cpu"), [0, 2, -1, 1, -1, 1, -1, -1, -1, -1]) + hist)
    with pytest.raises(RuntimeError, match="one entry per parameter"):
        ops([w], [g, g], [m], [None], [None], sgd, 0, ring_for(None), new_state("cpu"), [0, 2, -1, -1, -1],
            0, 0.0, 0.0, 0)

def test_opcheck_accumulate_many():
    """accumulate_many: opcheck, each row as accumulate of its tensor alone,
    rows of -1 untouched, and a bad tensor fails the call before any write."""
    xs = [x.detach() for x, _ in CASES[:5]] + [torch.empty(0)]
    rows = [0, 1, -1, 3, 4, 5]
    args = (xs, ring_for(H, rows=6), new_state("cpu"), rows) + H.op_args()
    torch.library.opcheck(torch.ops.hookcap.accumulate_many.default, args)
    got, want = ring_for(H, rows=6), ring_for(H, rows=6)
    torch.ops.hookcap.accumulate_many(xs, got, new_state("cpu"), rows, *H.op_args())
    for x, r in zip(xs, rows):
        if r >= 0:
            torch.ops.hookcap.accumulate(x, want, new_state("cpu"), r, *H.op_args())
    assert torch.equal(got, want)
    before = got.clone()
    with pytest.raises(RuntimeError, match="supported dtypes"):
        torch.ops.hookcap.accumulate_many([xs[0], xs[1].int()], got, new_state("cpu"), [0, 1], *H.op_args())
    with pytest.raises(RuntimeError, match="2 tensors but 1 rows"):
        torch.ops.hookcap.accumulate_many(xs[:2], got, new_state("cpu"), [0], *H.op_args())
    assert torch.equal(got, before)
