"""Ctrl-C during a run: the first SIGINT lets the current case finish and the run be written (the
CLI then exits 130); the second stops at once (the journal keeps the rows)."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Iterator


class Interrupt:
    """The first SIGINT asks the run to stop after the current case; the second stops it now."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        self.requested = True
        signal.signal(signal.SIGINT, self._previous)
        print("\ninterrupted: finishing the current case and writing the run (Ctrl-C again to stop at once)",
              file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def installed(self) -> Iterator["Interrupt"]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        self._previous = signal.signal(signal.SIGINT, self._handle)
        try:
            yield self
        finally:
            if signal.getsignal(signal.SIGINT) == self._handle:
                signal.signal(signal.SIGINT, self._previous)
