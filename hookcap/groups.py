"""Grouped statistics: ``Monitor(groups={metric glob: Groups(dim, size)})``
splits each matching captured tensor along ``dim`` into groups of ``size``
consecutive slices (a projection's heads, stacked experts) and records each
group as metric ``f"{metric}[{g}]"`` from one op call over the tensor; the
metric itself is the merge of its groups' rows (no second read).
``History.groups(metric, stat)`` returns them side by side."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Groups:
    """Groups of ``size`` consecutive slices along dimension ``dim`` (negative
    counts from the end): ``Groups(dim=-1, size=head_dim)`` gives one group
    per attention head of a ``[batch, tokens, heads * head_dim]`` projection.
    ``size`` must divide the tensor's extent along ``dim``."""

    dim: int = -1
    size: int = 1

    def __post_init__(self) -> None:
        for field, value in (("dim", self.dim), ("size", self.size)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"Groups: {field} must be an int, got {value!r}")
        if self.size < 1:
            raise ValueError(f"Groups: size must be >= 1, got {self.size}")

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


def group_metric(metric: str, g: int) -> str:
    """The name of group ``g`` of ``metric``: ``f"{metric}[{g}]"``."""
    return f"{metric}[{g}]"


def check_groups(groups) -> tuple[tuple[str, Groups], ...]:
    """``Monitor(groups={metric glob: Groups})`` as (glob, Groups) pairs,
    first match wins; ``ValueError`` naming what is wrong."""
    if groups is None:
        return ()
    if not isinstance(groups, dict):
        raise ValueError(f"groups: expected a dict {{metric glob: hookcap.Groups(dim, size)}}, "
                         f"got {type(groups).__name__}")
    for glob, spec in groups.items():
        if not isinstance(glob, str) or not glob:
            raise ValueError(f"groups: keys are globs over metric names (non-empty str), got {glob!r}")
        if not isinstance(spec, Groups):
            raise ValueError(f"groups[{glob!r}]: expected hookcap.Groups(dim, size), got {type(spec).__name__}")
    return tuple(groups.items())
