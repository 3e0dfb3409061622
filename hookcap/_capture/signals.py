"""Who sees every :func:`hookcap.tap` call, recorded steps or not: guards
that decide each step from its values (``hookcap.SkipStep``)."""

from __future__ import annotations

WATCHERS: list = []  # objects with saw_tap(name, tensor)


def saw_tap(name: str, x) -> None:
    for w in list(WATCHERS):
        w.saw_tap(name, x)
