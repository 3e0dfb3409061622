"""Grouped statistics: ``Monitor(groups={metric glob: Groups(dim, size)})``
splits each matching captured tensor along ``dim`` into groups of ``size``
consecutive slices (a projection's heads, stacked experts) and records each
group as metric ``f"{metric}[{g}]"`` from one op call over the tensor; the
metric itself is the merge of its groups' rows (no second read).
``History.groups(metric, stat)`` returns them side by side. ``Channels(dim,
top)`` in the same dict summarises many channels instead (outliers)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch


def _check_ints(who: str, dim, **counts) -> None:
    """``ValueError`` unless ``dim`` and every count are ints, the counts >= 1."""
    for field, value in (("dim", dim), *counts.items()):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{who}: {field} must be an int, got {value!r}")
    for field, value in counts.items():
        if value < 1:
            raise ValueError(f"{who}: {field} must be >= 1, got {value}")


@dataclass(frozen=True)
class Groups:
    """Groups of ``size`` consecutive slices along dimension ``dim`` (negative
    counts from the end): ``Groups(dim=-1, size=head_dim)`` gives one group
    per attention head of a ``[batch, tokens, heads * head_dim]`` projection.
    ``size`` must divide the tensor's extent along ``dim``."""

    dim: int = -1
    size: int = 1

    def __post_init__(self) -> None:
        _check_ints("Groups", dim=self.dim, size=self.size)

    def count(self, shape) -> int:
        """How many groups a tensor of ``shape`` splits into; ``ValueError``
        saying why where it does not (too few dimensions, an extent ``size``
        does not divide)."""
        if not -len(shape) <= self.dim < len(shape):
            raise ValueError(f"dim {self.dim} out of range for a tensor of shape {tuple(shape)}")
        extent = shape[self.dim]
        if extent % self.size:
            raise ValueError(f"size {self.size} does not divide dimension {self.dim} ({extent}) of shape "
                             f"{tuple(shape)}")
        return extent // self.size


@dataclass(frozen=True)
class Channels:
    """Outlier channels ("massive activations"): the channels along ``dim``
    (hidden units of ``[batch, tokens, hidden]``) summarised per step, for
    thousands of them, without a row each. With ``Monitor(groups={glob:
    Channels(dim=-1, top=8)})`` each matching capture ``m`` (recorded whole as
    usual) also gets, on recorded steps:

    - ``f"{m}.channel_absmax"``: the per-channel max ``|x|`` (one value per
      channel: ``max`` is the largest channel's, the histogram their spread);
    - ``f"{m}.channel_rms"``: the per-channel root mean square;
    - ``f"{m}.top_channels"``: group ``r`` holds the id of the channel ranked
      ``r`` by absmax (``History.groups(name, "max")``: ``[steps, top]`` ids);
    - ``f"{m}.top_absmax"``: group ``r`` its absmax;
    - ``f"{m}.top_over_median"``: the largest channel absmax over the median
      channel's (the lower middle one for an even count; +Inf where it is 0).

    Computed on the tensor's device with no host sync: two reductions over
    the tensor (max ``|x|`` and sum of squares per channel) and a top-k."""

    dim: int = -1
    top: int = 8

    def __post_init__(self) -> None:
        _check_ints("Channels", dim=self.dim, top=self.top)

    def summarize(self, x: torch.Tensor) -> list[tuple[str, torch.Tensor, bool]]:
        """``(suffix, tensor, by_rank)`` to record for capture ``x``:
        ``by_rank`` tensors are recorded one group per element (rank r).
        ``ValueError`` where ``dim`` is out of range."""
        if not -x.dim() <= self.dim < x.dim():
            raise ValueError(f"dim {self.dim} out of range for a tensor of shape {tuple(x.shape)}")
        d = self.dim % x.dim()
        other = [i for i in range(x.dim()) if i != d]
        per = max(1, x.numel() // max(1, x.shape[d]))  # values per channel
        absmax = torch.linalg.vector_norm(x, ord=math.inf, dim=other, dtype=torch.float32)
        rms = torch.linalg.vector_norm(x, ord=2, dim=other, dtype=torch.float32).div_(math.sqrt(per))
        top, ids = torch.topk(absmax, min(self.top, absmax.numel()))
        ratio = top[:1] / absmax.median()
        return [("channel_absmax", absmax, False), ("channel_rms", rms, False),
                ("top_channels", ids.to(torch.float32), True), ("top_absmax", top, True),
                ("top_over_median", ratio, False)]


def group_metric(metric: str, g: int) -> str:
    """The name of group ``g`` of ``metric``: ``f"{metric}[{g}]"``."""
    return f"{metric}[{g}]"


_GROUP_NAME = re.compile(r"(.*)\[(\d+)\]")


def split_group(name: str) -> tuple[str, int | None]:
    """:func:`group_metric` undone: ``(metric, g)`` for a group's name, ``(name, None)`` for any other."""
    m = _GROUP_NAME.fullmatch(name)
    return (m.group(1), int(m.group(2))) if m else (name, None)


def check_groups(groups) -> tuple[tuple[str, Groups], ...]:
    """``Monitor(groups={metric glob: Groups or Channels})`` as (glob, spec) pairs,
    first match wins; ``ValueError`` naming what is wrong."""
    if groups is None:
        return ()
    if not isinstance(groups, dict):
        raise ValueError(f"groups: expected a dict {{metric glob: hookcap.Groups(dim, size)}}, "
                         f"got {type(groups).__name__}")
    for glob, spec in groups.items():
        if not isinstance(glob, str) or not glob:
            raise ValueError(f"groups: keys are globs over metric names (non-empty str), got {glob!r}")
        if not isinstance(spec, (Groups, Channels)):
            raise ValueError(f"groups[{glob!r}]: expected hookcap.Groups(dim, size) or hookcap.Channels(dim, top), "
                             f"got {type(spec).__name__}")
    return tuple(groups.items())
