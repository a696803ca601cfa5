"""Progress lines for long runs, on stderr, at most every few seconds."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, label: str, total: int, every_s: float = 5.0, stream=None):
        # stderr as it is now, not as it was at import (pytest's capture replaces it per test)
        self.label, self.total, self.every_s, self.stream = label, total, every_s, stream or sys.stderr
        self.start = self.last = time.monotonic()
        self.done = self.failed = 0

    def step(self, failed: bool = False) -> None:
        self.done += 1
        self.failed += failed
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            self.stream.write(f"  [{self.label}] {self.done}/{self.total} cases, {self.failed} failing, "
                              f"{self.done / (now - self.start):.1f} cases/s\n")
            self.stream.flush()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start
