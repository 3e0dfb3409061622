"""``Monitor(dump_on_exit=path)``: a dump at interpreter exit (atexit) and on
SIGTERM/SIGINT. The previous signal handler is chained, so the program's own
handling (e.g. KeyboardInterrupt) still happens. Process-global: the
handlers stay installed for the life of the process; each does nothing once
its Monitor is gone or has dumped."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import weakref
from collections.abc import Callable

log = logging.getLogger("hookcap")


class ExitDump:
    """Calls ``dump(path)`` once, at the first of exit, SIGTERM or SIGINT,
    after :meth:`install` (``path`` None: never). ``dump`` is held weakly when
    it is a bound method, so the handlers keep no Monitor alive."""

    def __init__(self, path, dump: Callable[[str], object]):
        self.path = path
        self._dump = weakref.WeakMethod(dump) if hasattr(dump, "__self__") else (lambda: dump)
        self._installed = False
        self.done = False

    def install(self) -> None:
        """Register the handlers (once)."""
        if self._installed:
            return
        self._installed = True
        atexit.register(self.dump_now)
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in (signal.SIGTERM, signal.SIGINT):
            prev = signal.getsignal(sig)
            ref = weakref.ref(self)

            def handler(signum, frame, prev=prev, ref=ref):
                me = ref()
                if me is not None:
                    me.dump_now()
                if callable(prev):
                    return prev(signum, frame)
                if prev == signal.SIG_DFL:
                    signal.signal(signum, signal.SIG_DFL)
                    os.kill(os.getpid(), signum)
                return None

            signal.signal(sig, handler)

    def dump_now(self) -> None:
        if self.done or self.path is None:
            return
        dump = self._dump()
        if dump is None:
            return
        self.done = True
        try:
            dump(self.path)
        except Exception as e:
            log.error("hookcap: dump_on_exit failed: %s: %s", type(e).__name__, e)
