"""The HTML report: one self-contained file (inline CSS, figures as data: URIs, no scripts, no
external references) that opens from disk or from a CI artifact alone."""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping
from html import escape
from typing import Any

import pandas as pd

from mla_verify.reports.document import Report, Section
from mla_verify.reports.drift import FLAGS, GONE, IMPROVED, NEW, TOO_FEW
from mla_verify.reports.words import BETTER, DRIFTED, WORSE
from mla_verify.reports.bias_plots import bias_figure
from mla_verify.reports.drift_plots import drift_figure
from mla_verify.reports.fmt import cells
from mla_verify.reports.meta import describe
from mla_verify.reports.plots import Plot, figures

_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 1em 1.5em;
       color: #1d1d1f; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; }
h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; padding-bottom: 0.2em; }
p.intro, figcaption, .note { color: #555; max-width: 75em; }
table { border-collapse: collapse; font-size: 12px; }
th, td { padding: 2px 5px; border-bottom: 1px solid #eee; text-align: left; white-space: nowrap; }
th { background: #f4f4f6; position: sticky; top: 0; white-space: normal; vertical-align: bottom;
     min-width: 3.5em; }
td.long { white-space: normal; min-width: 24em; max-width: 48em; }
td.bar { min-width: 9em; }
.bar span { display: inline-block; height: 0.7em; margin-right: 0.4em; background: #3b6ea8;
            vertical-align: middle; }
tr.bad .bar span { background: #c0392b; }
p.run { color: #555; margin: 0 0 0.5em; }
td.num { text-align: right; font-variant-numeric: tabular-nums; font-size: 11px;
         font-family: ui-monospace, monospace; }
tr.bad td { background: #fde8e6; }
tr.good td { background: #e6f5ea; }
tr.worse td { background: #fdf0d8; }
tr.note td { background: #fff7e0; }
.scroll { overflow-x: auto; max-height: 40em; }
.banner { padding: 0.6em 1em; margin: 0.6em 0; border-radius: 4px; font-weight: 600; }
.banner.pass { background: #e6f5ea; border: 1px solid #2e8b57; }
.banner.fail { background: #fde8e6; border: 1px solid #c0392b; }
.banner.warn { background: #fff7e0; border: 1px solid #d98c1f; }
.banner ul { font-weight: normal; margin: 0.3em 0 0; }
table.meta td { border: none; padding: 1px 10px 1px 0; white-space: normal; }
table.meta td:first-child { color: #555; }
nav a { margin-right: 1em; }
figure { margin: 1em 0; }
figure img { max-width: 100%; border: 1px solid #eee; }
"""


_LONG = 60  # characters past which a cell's text wraps (reasons, commands) instead of widening the table


def _row_class(record: Mapping[str, Any]) -> str:
    finding = str(record.get("finding") or "")
    word = str(record.get("word") or record.get("vs baseline") or "").partition(":")[0]
    if (record.get("failed", 0) or str(record.get("status", "")).startswith("FAIL")
            or any(flag in finding for flag in FLAGS) or word == DRIFTED):
        return "bad"
    if word == WORSE:
        return "worse"
    if IMPROVED in finding or word == BETTER:
        return "good"
    return "note" if record.get("mode") in (NEW, GONE, TOO_FEW) else ""


def _cell(text: str, numeric: bool, share: float | None) -> str:
    """One td: numbers right-aligned, long text wrapped, a share of a bound (0..1) as a bar."""
    if share is not None:
        width = 0.0 if math.isnan(share) else min(max(share, 0.0), 1.0) * 6
        shown = text if math.isnan(share) else f"{100 * share:.3g}%"
        return f'<td class="num bar"><span style="width: {width:.2f}em"></span>{escape(shown)}</td>'
    if numeric:
        return f'<td class="num">{escape(text)}</td>'
    return f'<td class="long">{escape(text)}</td>' if len(text) > _LONG else f"<td>{escape(text)}</td>"


def table_html(frame: pd.DataFrame, limit: int | None = None, bars: tuple[str, ...] = ()) -> str:
    """`bars`: columns holding a share of a bound (value / bound), drawn as a bar beside the number."""
    shown = frame if limit is None else frame.head(limit)
    headers, rows = cells(shown)
    numeric = [pd.api.types.is_numeric_dtype(frame[c]) and not pd.api.types.is_bool_dtype(frame[c])
               for c in frame.columns]
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = []
    for record, texts in zip(shown.to_dict("records"), rows, strict=True):
        tds = "".join(_cell(t, num, float(record[c]) if c in bars else None)
                      for t, num, c in zip(texts, numeric, frame.columns, strict=True))
        css = _row_class(record)
        body.append(f'<tr class="{css}">{tds}</tr>' if css else f"<tr>{tds}</tr>")
    more = (f'<p class="note">{len(frame) - len(shown)} more rows not shown (see rows.csv).</p>'
            if len(shown) < len(frame) else "")
    return (f'<div class="scroll"><table><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table></div>{more}")


def _figure_html(plot: Plot) -> str:
    data = base64.b64encode(plot.png).decode("ascii")
    return (f'<figure id="{plot.key}"><img alt="{escape(plot.title)}" '
            f'src="data:image/png;base64,{data}"><figcaption><b>{escape(plot.title)}.</b> '
            f"{escape(plot.caption)}</figcaption></figure>")


def _section_html(section: Section, plots: list[Plot]) -> str:
    table = table_html(section.table, section.limit, section.bars)
    if section.shown is not None:   # narrow by default, every column one click away
        table = (f"{table_html(section.shown, section.limit, section.bars)}<details><summary>All "
                 f"{len(section.table.columns)} columns</summary>{table}</details>")
    return (f'<section id="{section.key}"><h2>{escape(section.title)}</h2>'
            f'<p class="intro">{escape(section.intro)}</p>{table}'
            f"{''.join(_figure_html(p) for p in plots)}</section>")


def _banners(report: Report) -> str:
    c = report.counts
    dev = f"; {c.deviation_rows} rows under documented deviations" if c.deviation_rows else ""
    out = [f'<div class="banner {"pass" if c.passed else "fail"}">{escape(c.line() + dev)}</div>']
    warnings = report.bias.lines() if report.bias is not None else []
    if warnings:
        items = "".join(f"<li>{escape(line.removeprefix('warning: '))}</li>" for line in warnings)
        out.append(f'<div class="banner warn">Bias (a warning, not a failure): {len(warnings)} '
                   f"group metric{'s' * (len(warnings) != 1)} lean beyond the floor<ul>{items}</ul></div>")
    if report.drift is not None:
        css = "fail" if report.drift.failed else "warn" if not report.drift.word(WORSE).empty else "pass"
        items = "".join(f"<li>{escape(line.strip())}</li>"
                        for line in [*(f"note: {n}" for n in report.notes), *report.drift.lines(report.replay)[1:]])
        out.append(f'<div class="banner {css}">Baseline: {escape(report.drift.verdict)}'
                   f"{f'<ul>{items}</ul>' if items else ''}</div>")
    return "".join(out)


def render_html(report: Report) -> str:
    """The whole report as one HTML document."""
    plots = figures(report.rows) + [p for p in (drift_figure(report.drift), bias_figure(report)) if p is not None]
    by_section: dict[str, list[Plot]] = {}
    for p in plots:
        by_section.setdefault(p.section, []).append(p)
    facts = {"run": report.run_id, **describe(report.meta)}
    meta = "".join(f"<tr><td>{escape(k)}</td><td>{escape(v)}</td></tr>" for k, v in facts.items())
    # What was run, in one line up top; every fact of the run at the end, below the tables.
    run = " · ".join(escape(f"{k} {facts[k]}") for k in ("device", "profile", "seeds", "git", "finished") if k in facts)
    nav = "".join(f'<a href="#{s.key}">{escape(s.title)}</a>' for s in report.sections) + '<a href="#run">Run</a>'
    sections = "".join(_section_html(s, by_section.get(s.key, [])) for s in report.sections)
    title = report.title
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>"
        f'<header><h1>{escape(title)}</h1><p class="run">{run}</p></header>'
        f"{_banners(report)}<nav>{nav}</nav>{sections}"
        f'<section id="run"><h2>Run</h2><table class="meta">{meta}</table></section></body></html>\n'
    )
