"""A report: a run's tables (and, given a baseline, its drift), built once and rendered three ways
(terminal, HTML, markdown), and `run_report`, the entry point behind `mla-verify report`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from mla_verify.reports.drift import DEFAULT_FACTOR, Drift, compare
from mla_verify.reports.fmt import MISSING, header, number
from mla_verify.reports.html import render_html
from mla_verify.reports.kinds import KEY_METRIC, annotate
from mla_verify.reports.markdown import render_markdown
from mla_verify.reports.meta import describe
from mla_verify.reports.stats import Counts, by_group, by_knob, counts, deviation_groups, failures, run_ids
from mla_verify.reports.store import load_run
from mla_verify.reports.terminal import terminal_summary

_KNOB_TITLES = {"topk": "topk", "heads": "query heads", "value_regime": "value regime",
                "seq_bucket": "context length (seq_len bucket)", "dcp_size": "DCP world size"}

_METRICS = ", ".join(f"{kind} {metric}" for kind, metric in KEY_METRIC.items())
_COLUMNS_NOTE = (
    f"p50/p99/max: the key error metric of each kind ({_METRICS}; exact must be 0). "
    "bf16u: ||impl - ref|| in units of one bf16 rounding of the reference. bias: mean of mean_err, "
    "the signed mean error relative to rms(ref), which rounding leaves near 0 and a bug does not. "
    "min headroom: least bound/value (below 1 fails)."
)


@dataclass(frozen=True)
class Section:
    key: str
    title: str
    intro: str
    table: pd.DataFrame
    limit: int | None = None   # rows shown at most (the rest are in rows.csv)


@dataclass
class Report:
    rows: pd.DataFrame                      # annotated (reports.kinds.annotate)
    meta: dict[str, Any]
    counts: Counts
    baseline_meta: dict[str, Any] | None = None
    baseline_counts: Counts | None = None
    drift: Drift | None = None
    sections: list[Section] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """1 when a row failed or drift is flagged, else 0."""
        return int(not self.counts.passed or (self.drift is not None and self.drift.drifted))

    @property
    def run_id(self) -> str:
        return run_ids(self.rows)

    def summary(self) -> str:
        text = terminal_summary(self.rows, self.meta)
        return text + ("\n" + "\n".join(self.drift.lines()) if self.drift is not None else "")


def _side_by_side(report: Report, baseline_rows: pd.DataFrame) -> pd.DataFrame:
    def facts(meta: Mapping[str, Any], rows: pd.DataFrame, c: Counts) -> dict[str, str]:
        return {"run": run_ids(rows), **describe(meta), "rows": number(c.rows),
                "cases": number(c.cases), "failed rows": number(c.failed_rows),
                "deviation rows": number(c.deviation_rows)}

    base = facts(report.baseline_meta or {}, baseline_rows, report.baseline_counts)
    cur = facts(report.meta, report.rows, report.counts)
    names = list(dict.fromkeys([*base, *cur]))
    return pd.DataFrame({"": names, "baseline": [base.get(n, MISSING) for n in names],
                         "current": [cur.get(n, MISSING) for n in names]})


def build_report(rows: pd.DataFrame, meta: Mapping[str, Any],
                 baseline: tuple[pd.DataFrame, Mapping[str, Any]] | None = None,
                 factor: float = DEFAULT_FACTOR) -> Report:
    """The report of stored rows (as `load_run` returns them), optionally against a baseline run."""
    frame = annotate(rows)
    report = Report(rows=frame, meta=dict(meta), counts=counts(frame))
    fails = failures(frame)
    if not fails.empty:
        report.sections.append(Section(
            "failures", "Failures",
            "Rows that failed their bound, least headroom first. Replay a case by its case_id "
            "and seed.", fails, limit=200))
    if baseline is not None:
        base_rows, base_meta = baseline
        report.baseline_meta = dict(base_meta)
        report.baseline_counts = counts(annotate(base_rows))
        report.drift = compare(rows, base_rows, factor=factor)
        report.sections.append(Section(
            "drift", "Drift against the baseline",
            f"{report.drift.verdict}. A group drifts when its p99 error or mean |bias| grows "
            f"beyond x{factor:g} of the baseline's (or of the kind's noise floor, if larger: "
            "ratios of rounding residue are not regressions), or when it fails and did not. "
            "Improvements (below 1/factor) are listed and never fail the run.",
            report.drift.table))
        report.sections.append(Section(
            "side-by-side", "Runs side by side", "What ran, where, and how it ended.",
            _side_by_side(report, base_rows)))
    report.sections.append(Section(
        "groups", "Error per path",
        "Per op, path, tensor and implementation; rows held to a documented deviation are in "
        "their own table below. " + _COLUMNS_NOTE, by_group(frame)))
    deviations = deviation_groups(frame)
    if not deviations.empty:
        report.sections.append(Section(
            "deviations", "Documented deviations",
            "Rows held to the wider bound of an implementation's documented deviation: expected, "
            "not regressions (as long as they pass).", deviations))
    for knob, table in by_knob(frame).items():
        if not table.empty:
            report.sections.append(Section(
                f"knob-{knob}", f"Error by {_KNOB_TITLES[knob]}",
                f"Per {header(knob)} value and tensor kind, rows without a deviation (rows whose "
                f"op has no {header(knob)} are left out).", table))
    return report


def run_report(run_dir: str | Path, baseline: str | Path | None = None,
               html: str | Path | None = None, markdown: str | Path | None = None,
               factor: float = DEFAULT_FACTOR) -> int:
    """Load a run (and a baseline run), print the terminal summary and drift verdict, write the
    HTML report (default run_dir/report.html) and, if asked, a markdown one. Returns the exit
    code: 1 when the run has failures or drift is flagged, else 0."""
    rows, meta = load_run(run_dir)
    report = build_report(rows, meta, load_run(baseline) if baseline is not None else None,
                          factor=factor)
    print(report.summary())
    html_path = Path(html) if html is not None else Path(run_dir) / "report.html"
    html_path.write_text(render_html(report), encoding="utf-8")
    print(f"html report: {html_path}")
    if markdown is not None:
        Path(markdown).write_text(render_markdown(report), encoding="utf-8")
        print(f"markdown report: {markdown}")
    return report.exit_code
