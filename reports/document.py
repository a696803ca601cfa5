"""A report as data: a run's annotated rows, its verdict counts, its drift against a baseline and
the sections (tables) that `reports.report.build_report` fills and the renderers (terminal,
`reports.html`, `reports.markdown`) read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from mla_verify.reports.bias import Bias
from mla_verify.reports.drift import Drift
from mla_verify.reports.stats import Counts, run_ids
from mla_verify.reports.terminal import terminal_summary


@dataclass(frozen=True)
class Section:
    key: str
    title: str
    intro: str
    table: pd.DataFrame
    limit: int | None = None   # rows shown at most (the rest are in rows.csv)
    bars: tuple[str, ...] = ()  # columns holding a share of a bound, drawn as bars where a renderer can
    shown: pd.DataFrame | None = None  # a narrower view shown first; the whole table behind it (HTML: <details>)


@dataclass
class Report:
    rows: pd.DataFrame                      # annotated (reports.kinds.annotate)
    meta: dict[str, Any]
    counts: Counts
    baseline_meta: dict[str, Any] | None = None
    baseline_counts: Counts | None = None
    drift: Drift | None = None
    bias: Bias | None = None                # the run's own bias against the reference (warnings only)
    replay: str | None = None               # the command that replays the case that drifted most
    notes: list[str] = field(default_factory=list)  # what a comparison with the baseline must say first
    sections: list[Section] = field(default_factory=list)
    name: str = ""                          # the run directory's name (--out): what the report is titled

    @property
    def exit_code(self) -> int:
        """1 when a row failed, the run never finished, or drift is flagged (or, with fail_on="worse", a
        group is worse), else 0."""
        return int(not self.counts.passed or (self.drift is not None and self.drift.failed))

    @property
    def run_id(self) -> str:
        return run_ids(self.rows)

    @property
    def title(self) -> str:
        """"mla-verify report: NAME", NAME being the run directory's (`--out shard-0`: shard-0), else
        the run id the rows carry."""
        return f"mla-verify report: {self.name or self.run_id}"

    def summary(self) -> str:
        text = terminal_summary(self.rows, self.meta, self.name)
        warnings = self.bias.lines() if self.bias is not None else []
        drift = self.drift.lines(self.replay) if self.drift is not None else []
        return "\n".join([text, *warnings, *(f"note: {n}" for n in self.notes), *drift])
