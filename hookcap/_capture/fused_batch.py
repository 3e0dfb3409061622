"""Monitor(fused=True): one launch for a compiled graph's merges and one for
its shifts, instead of one of each per capture.

Each fused capture traces two small ops of its own (``hookcap::fused_shift``
before its statistics, ``hookcap::merge_partials`` after them): on a GPU two
launches of a few microseconds per capture, which on a CNN (a hundred
captures a step, each a few megabytes) cost more than the op's whole read of
the tensors. This pass, run on Inductor's post-grad graph after
``_fused.hand_reduce_only_to_the_op``, gathers them:

- the shifts of one sink and ring become one ``hookcap::fused_shifts`` where
  the first was (a float64 vector; each capture reads its element). A shift
  then reads the ring before any merge of this graph, where it read it after
  the merges traced before it: where both name one row (a module called
  twice), both read the same value (the row's shift this step, else its last
  recorded mean), and a merge about another shift than the row's is rebased
  exactly as any (``stats_math.h`` ``row_merge_partials``);
- each run of merges into one sink and ring that follow each other in the
  graph's effect order (no other effectful op between them, such as a record
  the hand-over made) becomes one ``hookcap::merge_partials_list`` where the
  last was: the writes, and their log (the step's execution order), keep
  their order. The partials of a run stay alive until it (nine float64
  values per block).
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch

from .._rows.fastpath import ring_index_of

# The traced calls the fused path makes (also read by hookcap._capture.fused).
SHIFT = torch.ops.hookcap.fused_shift.default
_SHIFTS = torch.ops.hookcap.fused_shifts.default
MERGE = torch.ops.hookcap.merge_partials.default
_MERGE_LIST = torch.ops.hookcap.merge_partials_list.default
WITH_EFFECTS = getattr(torch.ops.higher_order, "with_effects", None)


def is_merge(n) -> bool:
    """A traced ``merge_partials`` (through ``with_effects``): what the
    hand-over and the gathering both look for."""
    return n.op == "call_function" and n.target is WITH_EFFECTS and len(n.args) == 6 and n.args[1] is MERGE


def _batchable(n) -> bool:
    """A merge whose row id is known and whose token only the next effectful
    op reads (so the run can drop it)."""
    return is_merge(n) and isinstance(n.args[5], int) and len(n.users) == len(_token_out(n)) == 1


def _device(n):
    v = n.meta.get("val")
    return v.device if isinstance(v, torch.Tensor) else None


def batch_shifts(graph: torch.fx.Graph) -> int:
    """Each sink and ring's ``fused_shift`` calls (two or more, on one
    device) become one ``fused_shifts`` where the first was. Returns how
    many calls were gathered."""
    groups = defaultdict(list)
    for n in graph.nodes:
        if n.op == "call_function" and n.target is SHIFT and isinstance(n.args[2], int):
            like, sink, rid = n.args
            groups[(sink, ring_index_of(rid), _device(like))].append(n)
    gathered = 0
    for (sink, _, _), nodes in groups.items():
        if len(nodes) < 2 or not isinstance(nodes[0].meta.get("val"), torch.Tensor):
            continue
        first = nodes[0]
        with graph.inserting_before(first):
            batch = graph.call_function(_SHIFTS, (first.args[0], sink, [n.args[2] for n in nodes]))
        batch.meta["val"] = first.meta["val"].new_empty((len(nodes),))
        for i, n in enumerate(nodes):
            with graph.inserting_after(batch):
                one = graph.call_function(torch.ops.aten.select.int, (batch, 0, i))
            one.meta["val"] = batch.meta["val"][i]
            n.replace_all_uses_with(one)
            graph.erase_node(n)
        gathered += len(nodes)
    return gathered


def _runs(graph: torch.fx.Graph):
    """Runs of two or more merges into one sink and ring that follow each
    other in the graph's effect order (every ``with_effects`` node, in graph
    order: the token chain orders them)."""
    run, key = [], None
    for n in graph.nodes:
        if not (n.op == "call_function" and n.target is WITH_EFFECTS):
            continue
        k = (n.args[4], ring_index_of(n.args[5]), _device(n.args[2])) if _batchable(n) else None
        if k is not None and k == key:
            run.append(n)
            continue
        if len(run) > 1:
            yield run
        run, key = ([n], k) if k is not None else ([], None)
    if len(run) > 1:
        yield run


def _token_out(n):
    """The ``getitem(n, 0)`` nodes: the token ``n`` passes on."""
    return [u for u in n.users if u.target is operator.getitem and u.args[1] == 0]


def batch_merges(graph: torch.fx.Graph) -> int:
    """Each run of merges (:func:`_runs`) becomes one
    ``merge_partials_list`` where its last merge was. Returns how many
    merges were gathered."""
    gathered = 0
    for run in list(_runs(graph)):
        tokens = [_token_out(m)[0] for m in run]
        if not all(t.users.keys() == {m} and m.args[0] is t for t, m in zip(tokens, run[1:])):
            continue  # a token read beyond the next merge of the run
        last, sink = run[-1], run[-1].args[4]
        args = (run[0].args[0], _MERGE_LIST, [m.args[2] for m in run], [m.args[3] for m in run], sink,
                [m.args[5] for m in run])
        with graph.inserting_before(last):
            merged = graph.call_function(WITH_EFFECTS, args)
            token = graph.call_function(operator.getitem, (merged, 0))
        merged.meta.update(last.meta)
        token.meta.update(tokens[-1].meta)
        tokens[-1].replace_all_uses_with(token)
        for t, m in zip(reversed(tokens), reversed(run)):  # each token was read only by the next merge
            graph.erase_node(t)
            graph.erase_node(m)
        gathered += len(run)
    return gathered


def batch(graph: torch.fx.Graph) -> None:
    """:func:`batch_shifts` and :func:`batch_merges`; dynamo's counters keep
    the totals (``counters["hookcap"]``: ``shifts_batched``,
    ``merges_batched``)."""
    from torch._dynamo.utils import counters

    counters["hookcap"]["shifts_batched"] += batch_shifts(graph)
    counters["hookcap"]["merges_batched"] += batch_merges(graph)
