"""Webhook: post each kind of anomaly to a URL (Slack-style incoming
webhooks, an alert manager, a pager bridge), once per kind with back-off,
from a background thread behind a bounded queue: a slow or failing endpoint
never reaches the training loop."""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import urllib.request

log = logging.getLogger("hookcap")


class Webhook:
    """A sink that writes nothing per step and posts anomalies.

    Each anomaly kind (``"nonfinite"``, ``"spike"``, ...) is posted the first
    time it occurs; later anomalies of that kind wait out a back-off that
    starts at ``backoff_s`` and doubles after each post of the kind (up to
    ``max_backoff_s``); those inside it are counted in :attr:`suppressed`.

    The body is JSON: ``step``, ``metric``, ``kind``, ``message``, ``stats``
    (the metric's finite stats there), ``first_movers`` (up to ``movers`` of
    :func:`hookcap.explain` at that step: ``name``, ``stat``, ``step``,
    ``lead``, ``z``; computed in the background thread), ``dump`` (the
    ``dump_on_anomaly`` file of that kind, or null), ``text`` (one line, for
    chat webhooks) and ``rank``.

    Posts go out from one daemon thread through a queue of ``queue`` posts:
    a full queue drops the post (:attr:`dropped`); a post that fails (an
    error or an HTTP status >= 400 after ``timeout_s``) counts in
    :attr:`failed` and is logged once. :meth:`close` (the Monitor's
    ``detach()``) waits up to ``timeout_s`` for posts in flight."""

    def __init__(self, url: str, *, kinds=None, backoff_s: float = 300.0, max_backoff_s: float = 6 * 3600.0,
                 timeout_s: float = 5.0, queue_size: int = 16, movers: int = 5, headers: dict | None = None):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"Webhook: url must be an http(s) URL, got {url!r}")
        for arg, v in (("backoff_s", backoff_s), ("max_backoff_s", max_backoff_s), ("timeout_s", timeout_s)):
            if not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"Webhook: {arg} must be a number >= 0, got {v!r}")
        if not isinstance(queue_size, int) or queue_size < 1 or not isinstance(movers, int) or movers < 0:
            raise ValueError("Webhook: queue_size must be an int >= 1 and movers an int >= 0")
        self.url, self.timeout_s, self.movers = url, float(timeout_s), movers
        self.kinds = None if kinds is None else frozenset((kinds,) if isinstance(kinds, str) else kinds)
        self.backoff_s, self.max_backoff_s = float(backoff_s), float(max_backoff_s)
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.rank: int | None = None
        self.sent = self.failed = self.dropped = self.suppressed = 0
        self._next: dict[str, tuple[float, float]] = {}  # kind -> (earliest next post, back-off after it)
        self._queue: queue.Queue = queue.Queue(queue_size)
        self._thread: threading.Thread | None = None
        self._warned = False

    # -- the sink protocol ---------------------------------------------------------
    def write(self, step) -> None:
        """Nothing per step: this sink reacts to anomalies (:meth:`alert`)."""

    def bind_rank(self, rank: int | None) -> None:
        self.rank = rank

    def close(self) -> None:
        if self._thread is None:
            return
        deadline = time.monotonic() + self.timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        self._thread = None

    # -- alerts ----------------------------------------------------------------------
    def alert(self, anomaly, dump: str | None, history) -> None:
        """An anomaly the Monitor reported (``history()``: the Monitor's
        history now, called only when this anomaly is posted)."""
        if self.kinds is not None and anomaly.kind not in self.kinds:
            return
        now = time.monotonic()
        earliest, wait = self._next.get(anomaly.kind, (0.0, self.backoff_s))
        if now < earliest:
            self.suppressed += 1
            return
        self._next[anomaly.kind] = (now + wait, min(max(wait, 1e-9) * 2, self.max_backoff_s))
        try:
            self._queue.put_nowait((anomaly, dump, history() if self.movers else None))
        except queue.Full:
            self.dropped += 1
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hookcap-webhook", daemon=True)
            self._thread.start()

    def payload(self, anomaly, dump, history) -> dict:
        """The JSON body posted for ``anomaly`` (see the class docstring)."""
        movers, why = [], None
        if history is not None:
            try:
                from ..movers import explain

                movers = [{"name": m.name, "stat": m.stat, "step": m.step, "lead": m.lead,
                           "z": m.z if abs(m.z) < float("inf") else str(m.z)}
                          for m in explain(history, anomaly.step, top=self.movers)]
            except Exception as e:  # an explanation is a bonus: the alert goes out anyway
                why = f"{type(e).__name__}: {e}"
        first = f"; first moved: {movers[0]['name']} ({movers[0]['stat']}, {movers[0]['lead']} steps before)" \
            if movers else ""
        stats = {k: v for k, v in (anomaly.stats or {}).items()
                 if isinstance(v, (int, float)) and abs(v) < float("inf")}
        return {"text": f"hookcap {anomaly.kind} at step {anomaly.step}: {anomaly.message}{first}",
                "step": anomaly.step, "metric": anomaly.name, "kind": anomaly.kind, "message": anomaly.message,
                "stats": stats, "first_movers": movers, "first_movers_error": why, "dump": dump,
                "rank": self.rank}

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                body = json.dumps(self.payload(*item), allow_nan=False).encode()
                req = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    ok = resp.status < 400
                self.sent += ok
                self.failed += not ok
            except Exception as e:  # never raised into training: counted, logged once
                self.failed += 1
                if not self._warned:
                    self._warned = True
                    log.warning("hookcap: Webhook post to %s failed: %s: %s (counted in .failed; logged once)",
                                self.url, type(e).__name__, e)
            finally:
                self._queue.task_done()
