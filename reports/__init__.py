"""Numerical-drift reports: a run's rows on disk, their tables and figures, and drift against a
baseline run.

    write_run(run_dir, rows, meta) / load_run(run_dir)      store.py
    collect_meta(...) / finish_meta(meta)                    meta.py
    terminal_summary(rows, meta)                             terminal.py
    by_cause(rows) -> [Group]: findings grouped by cause      causes.py
    bias_of(rows, confidence) -> Bias                        bias.py (significance.py)
    compare(current, baseline, *, factor, confidence,
            min_cases, pairs) -> Drift; DriftSettings         drift.py (pairing.py, significance.py)
      each group's word: drifted, worse, unchanged, better  words.py (judge.py)
    history(run_dirs, order=...) -> History                 history.py (history_html.py, history_plots.py)
    build_report(...) -> Report / run_report(run_dir, ...)  report.py (document.py)
    render_html(report) / render_markdown(report)            html.py, markdown.py (drift_plots.py)
"""

from mla_verify.reports.bias import Bias, bias_of
from mla_verify.reports.drift import Drift, DriftSettings, compare
from mla_verify.reports.pairing import NothingComparable
from mla_verify.reports.html import render_html
from mla_verify.reports.markdown import render_markdown
from mla_verify.reports.meta import collect_meta, finish_meta
from mla_verify.reports.document import Report
from mla_verify.reports.report import build_report, run_report
from mla_verify.reports.store import load_run, rows_frame, write_run
from mla_verify.reports.terminal import terminal_summary

__all__ = [
    "Bias", "Drift", "DriftSettings", "NothingComparable", "Report", "bias_of", "build_report", "collect_meta", "compare",
    "finish_meta", "load_run", "render_html", "render_markdown", "rows_frame", "run_report", "terminal_summary", "write_run",
]
