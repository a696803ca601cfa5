"""Ctrl-C (SIGINT) or SIGTERM (a CI runner cancelling the job, `kill`) during a run: the first lets
the current case finish and the run be written (the CLI then exits 130); the second stops at once
(the journal keeps the rows, and the case it stopped in: `mla_verify.runs.rundir`)."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupt:
    """The first SIGINT or SIGTERM asks the run to stop after the current case; the second stops it now."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        self.requested = True
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        print(f"\ninterrupted ({signal.Signals(signum).name}): finishing the current case and writing the run "
              "(again to stop at once)", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def installed(self) -> Iterator["Interrupt"]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        try:
            yield self
        finally:
            for sig, previous in self._previous.items():
                if signal.getsignal(sig) == self._handle:
                    signal.signal(sig, previous)
