"""The report's tables as GitHub markdown (no figures), for CI job summaries."""

from __future__ import annotations

import pandas as pd

from mla_verify.reports.document import Report
from mla_verify.reports.drift import GROUP_KEYS, group_label
from mla_verify.reports.fmt import cells
from mla_verify.reports.words import WORSE

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
    """Drift first (the verdict, the groups that drifted, the case that drifted most and the
    command that replays it), then the run's verdict and every section's table, as in the HTML."""
    c = report.counts
    out = [f"## {report.title}", ""]
    if report.drift is not None:
        d = report.drift
        out.append(f"**Baseline: {d.verdict}**\n")
        out += [f"- note: {_escape(n)}" for n in report.notes]
        for _, g in d.flagged.iterrows():
            out.append(f"- **{_escape(g['finding'])}** {_escape(group_label(*(g[k] for k in GROUP_KEYS)))}: "
                       f"{_escape(d.explain(g))}")
        for _, g in d.word(WORSE).iterrows():
            out.append(f"- **worse** {_escape(group_label(*(g[k] for k in GROUP_KEYS)))}: {_escape(d.headline(g))}")
        if d.worst is not None:
            worst = _escape(d.worst_line())
            out.append(f"\n{worst[0].upper()}{worst[1:]}"
                       + (f"; replay it with\n\n```\n{report.replay}\n```" if report.replay else ""))
        out += ["", *(f"- {_escape(line)}" for line in d.context_lines()), ""]
    out.append(f"**{c.line()}**")
    if c.deviation_rows:
        out.append(f"({c.deviation_rows} rows under documented deviations)")
    if report.bias is not None:
        out += [f"- {_escape(line)}" for line in report.bias.lines()]
    for s in report.sections:
        limit = min(s.limit, _MARKDOWN_LIMIT) if s.limit else None
        out += ["", f"### {s.title}", "", s.intro, "", table_markdown(s.table, limit)]
    return "\n".join(out) + "\n"
