"""The report's tables as GitHub markdown (no figures), for CI job summaries."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd

from mla_verify.reports.fmt import cells

if TYPE_CHECKING:
    from mla_verify.reports.report import Report

# GitHub caps a job summary at 1 MiB: a long failure list stops here and points at rows.csv.
_MARKDOWN_LIMIT = 50


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def table_markdown(frame: pd.DataFrame, limit: int | None = None) -> str:
    shown = frame.head(limit) if limit is not None else frame
    headers, rows = cells(shown)
    lines = ["| " + " | ".join(_escape(h) or " " for h in headers) + " |",
             "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(_escape(t) for t in r) + " |" for r in rows]
    if len(shown) < len(frame):
        lines.append(f"\n_{len(frame) - len(shown)} more rows not shown (see rows.csv)._")
    return "\n".join(lines)


def render_markdown(report: Report) -> str:
    """Verdict, drift verdict, then every section's table, as in the HTML report."""
    c = report.counts
    out = [f"## mla-verify report: {report.run_id}", "", f"**{c.line()}**"]
    if c.deviation_rows:
        out.append(f"({c.deviation_rows} rows under documented deviations)")
    if report.drift is not None:
        out.append(f"\n**Baseline: {report.drift.verdict}**\n")
        out += [f"- {_escape(line.strip())}" for line in report.drift.lines()[1:]]
    for s in report.sections:
        limit = min(s.limit, _MARKDOWN_LIMIT) if s.limit else None
        out += ["", f"### {s.title}", "", s.intro, "", table_markdown(s.table, limit)]
    return "\n".join(out) + "\n"
