"""``hookcap.tap``: statistics of a tensor no module returns (attention
scores, router logits, a residual stream, the loss) as a metric of its own,
written into the same rows, drain and history as the hooks' metrics."""

from __future__ import annotations

import torch

from ._capture import compile as _compile
from ._capture import signals as _signals
from ._rows.config import check_placement
from ._rows.recorder import RECORDING

_is_compiling = torch.compiler.is_compiling


def tap(x: torch.Tensor, name: str, placement: str | None = None, *, bins: int | None = None,
        weights: torch.Tensor | None = None) -> None:
    """Record the statistics of ``x`` as metric ``name`` (kind ``"tap"``) in
    every Monitor that records this step, on ``x``'s device: the same
    statistics and histogram as a module output, with no host sync.

    - Returns at once when no Monitor records (none attached, an off-step of
      ``every``, ``paused()``).
    - Calls with one name in one step merge into one value, as a module's
      calls do; a forward recomputed by activation checkpointing (a call
      inside the backward with grad mode on) is not counted again, and a call
      while the Monitor's model is in eval mode is recorded as
      ``eval/{name}`` (or skipped, or merged: ``Monitor(eval_forwards=...)``),
      as module outputs are; any shape (a 0-d loss too), view or dtype the statistics op
      takes. A tensor it cannot read (integer, sparse, inside a
      ``torch.func`` transform) is skipped with one warning.
    - Never changes ``x`` and returns nothing; gradients flow as before.
    - Under ``torch.compile`` it is traced into the graph (no graph break; the
      kernel reads ``every`` from the device, so no recompile), writing into
      the Monitors attached when the graph was traced: attach before the
      first compiled call.
    - ``placement`` (multi-rank runs, for merged histories): ``"replicated"``
      (ranks holding identical copies count once: the loss, activations after
      a tensor-parallel all-reduce), ``"sharded"`` or ``"per_rank"`` (summed);
      default: ``Monitor(placements=...)``, else ``"per_rank"``. A DTensor
      follows its own placements. Fixed by the first call that records the name.
    - ``bins`` (an integer ``x``: a router's top-k expert choices): one
      group per bin, ``f"{name}[{b}]"``, holding the elements equal to ``b``:
      ``History.groups(name, "count")`` is ``torch.bincount(x, minlength=bins)``
      exactly; with ``weights`` (a floating tensor of ``x``'s number of
      elements: the routing weights) each group's other statistics are those
      of its elements' weights (``mean``: the mean routing weight), else of
      1.0 per element. Elements outside ``[0, bins)`` (a capacity router's
      dropped-token marker) are in no group. The metric ``name`` itself is the
      merge of its groups. Under ``torch.compile`` the call runs eagerly (a
      graph break).
    """
    if bins is not None:
        _check_bins(x, name, bins, weights)
        if _is_compiling():
            _tap_bins_eager(x, name, placement, bins, weights)
            return
    elif weights is not None:
        raise TypeError("hookcap.tap: weights= goes with bins=")
    if placement is not None:
        check_placement(placement)
    if _is_compiling():
        _compile.write_tap(x, name, placement)
        return
    if not (RECORDING or _signals.WATCHERS):
        return
    if _compile.in_backward() and torch.is_grad_enabled():
        return  # a forward recomputed by activation checkpointing: recorded in the forward
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"hookcap.tap: x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(name, str) or not name:
        raise TypeError(f"hookcap.tap: name must be a non-empty str, got {name!r}")
    if _signals.WATCHERS and bins is None:
        _signals.saw_tap(name, x)
    w = None if weights is None else weights.detach()
    for ref in list(RECORDING.values()):
        rec = ref()
        if rec is not None and rec.records("tap"):
            metric = rec.tap_name(name)
            if metric is None:
                continue
            ci = rec.call_index(metric, "tap")
            if bins is None:
                rec.write(metric, "tap", "", x.detach(), "tap", ci, placement=placement)
            else:
                rec.write_bins(metric, "tap", "", x.detach(), w, bins, "tap", ci, placement=placement)


def _check_bins(x, name, bins, weights) -> None:
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(f"hookcap.tap({name!r}): bins must be an int >= 1, got {bins!r}")
    if not isinstance(x, torch.Tensor) or x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise TypeError(f"hookcap.tap({name!r}, bins=...): x must be an integer tensor (expert indices), got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if weights is not None and not (isinstance(weights, torch.Tensor) and weights.is_floating_point()
                                    and weights.numel() == x.numel() and weights.device == x.device):
        raise TypeError(f"hookcap.tap({name!r}, bins=...): weights must be a floating tensor with x's "
                        f"{x.numel()} elements on {x.device}")


@torch.compiler.disable
def _tap_bins_eager(x, name, placement, bins, weights) -> None:
    tap(x, name, placement, bins=bins, weights=weights)
