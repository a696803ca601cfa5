"""Who hears of a run's cases: one `Sink` where there were five callbacks (started, journal, stop
reason, lost, progress). The run directory journals each case as its implementation is called and
its rows as they come (`runs.rundir`); the progress line counts the cases; Ctrl-C (`Interrupt`) and
a CUDA context lost to the implementation's CUDA error stop the run after the current case. The
campaign (`fuzz.campaign.Sink`) and the driver tell it; nothing it holds climbs back into them.
"""

from __future__ import annotations

import math
from typing import Callable

from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.judge.rows import Row, RowContext
from mla_verify.fuzz.campaign import Stop
from mla_verify.runs.progress import Progress

from .interrupt import Interrupt
from .rundir import RunDir
from .units import Unit

COUNTED = ("kept", "corpus", "fuzz")  # the sources the progress line counts (not re-runs or shrink steps)


class Sink:
    """Every case of one run: `rows` keeps their rows in the order they came."""

    def __init__(self, run_dir: RunDir | None, run_id: str, device: str, interrupt: Interrupt | None = None):
        self.run_dir, self.run_id, self.device = run_dir, run_id, device
        self.interrupt = interrupt or Interrupt()
        self.rows: list[Row] = []
        self.progress = Progress("", 0, every_s=math.inf)  # silent until `counting`
        self.lost: Stop | None = None  # why the device cannot run another case
        self.unit: Unit | None = None
        self.name_units = False  # the progress line says which unit runs next (the gate's)
        self._open: dict[str, Callable[[], None]] = {}

    def counting(self, progress: Progress, name_units: bool = False) -> None:
        """Count the cases on `progress` from now on (`name_units`: with the unit that runs)."""
        self.progress, self.name_units = progress, name_units

    def judging(self, unit: Unit) -> None:
        """The cases that follow are `unit`'s (the journal names its implementation)."""
        self.unit = unit

    def started(self, case: Case, source: str) -> None:
        if self.run_dir is not None:
            unit = self.unit
            self._open[case.case_id] = self.run_dir.case_started(
                case, RowContext(self.run_id, source, unit.label, self.device), unit.specs, unit.deviations)

    def finished(self, case: Case) -> None:
        done = self._open.pop(case.case_id, None)
        if done is not None:
            done()

    def judged(self, rows: list[Row], source: str) -> None:
        self.rows.extend(rows)
        if self.run_dir is not None:
            self.run_dir.append(rows)
        if source in COUNTED:
            where = f"{self.unit.op} / {self.unit.label}" if self.name_units else ""
            self.progress.step(any(not r.passed for r in rows), now_at=where)

    def found(self, rows: list[Row], name: str) -> None:
        """The case of `rows`, journaled already, is now the finding saved as `name` ("": no longer):
        the run's findings store tells it (`fuzz.findings.Journal`)."""
        if self.run_dir is not None and rows:
            self.run_dir.found(rows[0], name)

    def lose(self, why: Stop) -> None:
        """The device cannot run another case (the first reason is kept)."""
        self.lost = self.lost or why

    def stop_reason(self) -> Stop | None:
        return Stop.INTERRUPTED if self.interrupt.requested else self.lost
