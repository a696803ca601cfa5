"""Progress lines for long runs, on stderr, at most every few seconds: cases done of the total,
the failing ones, the time so far and an estimate of the time left (at the rate so far). A
`Progress` is also the sink of a campaign that only counts its cases (`fuzz.campaign.Sink`)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, label: str, total: int, every_s: float = 5.0, stream=None):
        # stderr as it is now, not as it was at import (pytest's capture replaces it per test)
        self.label, self.total, self.every_s, self.stream = label, total, every_s, stream or sys.stderr
        self.start = self.last = time.monotonic()
        self.done = self.failed = 0

    def step(self, failed: bool = False, now_at: str = "") -> None:
        """One case done (`failed`: it failed); `now_at` names what runs next."""
        self.done += 1
        self.failed += failed
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            self.stream.write(self.line(now) + (f"; {now_at}" if now_at else "") + "\n")
            self.stream.flush()

    def started(self, case, source: str) -> None:
        pass

    def finished(self, case) -> None:
        pass

    def judged(self, rows, source: str) -> None:
        if source in ("corpus", "fuzz"):
            self.step(any(not r.passed for r in rows))

    def stop_reason(self) -> None:
        return None

    def line(self, now: float) -> str:
        elapsed = now - self.start
        total = max(self.total, self.done)  # a covering set larger than its campaign's budget runs whole
        left = elapsed / self.done * (total - self.done) if self.done else float("nan")
        return (f"  [{self.label}] {self.done}/{total} cases, {self.failed} failing, {elapsed:.0f} s elapsed, "
                f"~{left:.0f} s left")

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start
