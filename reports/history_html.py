"""The history page: one self-contained HTML file (as `reports.html`) of many runs of one kernel
line: the runs in order, the steps the two-run judge marks drifted or worse with the case that
moved most (linked to its case file), then per line a figure and its trend table."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from html import escape
from os.path import relpath
from pathlib import Path

import pandas as pd

from mla_verify.reports.history import LINE_KEYS, History, worst_case
from mla_verify.reports.history_plots import key_metric, line_figure
from mla_verify.reports.html import _CSS, _figure_html, table_html
from mla_verify.reports.words import DRIFTED

SaveCase = Callable[..., "str | None"]   # api.save_worst_case(worst, directory, deviations, conventions)


def _where(s: pd.Series) -> str:
    op = s["op"] if s["op"] == s["path"] else f"{s['op']}/{s['path']}"
    return f"{op} {s['tensor']} [{s['line']}]" + (f" (deviation: {s['deviation']})" if s["deviation"] else "")


def _marked_html(h: History, links: Mapping[int, tuple[str, str]]) -> str:
    """The marked steps as a table whose worst case links to its case file (and names its replay)."""
    head = "".join(f"<th>{c}</th>" for c in ("word", "at run", "after", "what moved", "line", "worst case"))
    body = []
    for i, s in h.marked.iterrows():
        href, command = links.get(i, ("", ""))
        case = (f'<a href="{escape(href)}" title="{escape(command)}">{escape(s["worst_case"])}</a>' if href
                else escape(str(s["worst_case"])))
        css = "bad" if s["word"] == DRIFTED else "worse"
        body.append(f'<tr class="{css}"><td>{escape(s["word"])}</td><td>{escape(h.label(s["run"]))}</td>'
                    f'<td>{escape(h.label(s["before"]))}</td><td class="long">{escape(s["headline"])}</td>'
                    f'<td class="long">{escape(_where(s))}</td><td>{case}</td></tr>')
    if not body:
        return '<p class="note">No step between neighbouring runs reads drifted or worse.</p>'
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'


def _line_table(h: History, trend: pd.DataFrame, steps: pd.DataFrame) -> str:
    """The trend of one line: a narrow table (the key metric, |bias|, the bias mean and interval, bound
    use, the step's word) and every column behind it."""
    kind = trend["kind"].iloc[0]
    metric = key_metric(kind) or "abs_bias"
    bias = "gain" if kind in ("out", "other") else "bias_units"
    word = steps.set_index("run")["word"]
    full = trend.drop(columns=[*LINE_KEYS]).assign(run=[h.label(r) for r in trend["run"]])
    full.insert(1, "step", [word.get(r, "") for r in trend["run"]])
    narrow = full[["run", "step", "cases", "failed", f"{metric} p50", f"{metric} p99", "abs_bias p99",
                   bias, f"{bias} ci", "bound use"]]
    return (f"{table_html(narrow, bars=('bound use',))}<details><summary>All {len(full.columns)} columns"
            f"</summary>{table_html(full)}</details>")


def render_history(h: History, links: Mapping[int, tuple[str, str]] | None = None) -> str:
    """The page; `links`: per marked step (its index in `h.steps`) the case file's href and replay command."""
    lines = []
    for n, (key, trend) in enumerate(h.trend.groupby(list(LINE_KEYS), observed=True, sort=True)):
        steps = h.steps[(h.steps[list(LINE_KEYS)] == pd.Series(key, index=list(LINE_KEYS))).all(axis=1)]
        title = _where(pd.Series(dict(zip(LINE_KEYS, key, strict=True))))
        plot = line_figure(f"line-{n}", title, trend, steps, list(h.runs["label"]))
        lines.append(f'<section id="line-{n}"><h2>{escape(title)}</h2>{_line_table(h, trend, steps)}'
                     f"{_figure_html(plot) if plot is not None else ''}</section>")
    summary = h.lines()
    css = "fail" if h.exit_code else "warn" if len(h.marked) else "pass"
    items = "".join(f"<li>{escape(line.strip())}</li>" for line in summary[1:])
    title = f"mla-verify history: {len(h.runs)} runs"
    runs = table_html(h.runs.assign(run=range(len(h.runs)))[["run", "label", "run_id", "when", "revision", "rows"]])
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f"<style>{_CSS}</style></head><body><header><h1>{escape(title)}</h1></header>"
            f'<div class="banner {css}">{escape(summary[0])}{f"<ul>{items}</ul>" if items else ""}</div>'
            f'<section id="marked"><h2>Steps marked drifted or worse</h2><p class="intro">Each step between '
            "neighbouring runs of a line is judged as <code>mla-verify report NEW --baseline OLD</code> judges it "
            f"(factor {h.factor:g}, confidence {h.confidence:g}); the worst case links to its case file (hover: "
            f"the command that replays it).</p>{_marked_html(h, links or {})}</section>"
            f'<section id="runs"><h2>Runs, in order</h2>{runs}</section>{"".join(lines)}</body></html>\n')


def write_history(h: History, html: str | Path, save_case: SaveCase | None = None) -> Path:
    """Write the page to `html`; with `save_case`, each marked step's worst case first, under
    HTML_STEM-cases/step-N/ beside it, linked from the page."""
    html = Path(html)
    links: dict[int, tuple[str, str]] = {}
    for i, step in (h.marked.iterrows() if save_case is not None else ()):
        found = worst_case(h, step)
        if found is None:
            continue
        worst, meta = found
        directory = html.parent / f"{html.stem}-cases" / f"step-{i}"
        command = save_case(worst, directory, meta.get("deviations") or (), meta.get("conventions") or ())
        saved: Sequence[Path] = sorted(directory.glob("*.json")) if command else []
        if saved:
            links[i] = (relpath(saved[0], html.parent), command)
    html.write_text(render_history(h, links), encoding="utf-8")
    return html
