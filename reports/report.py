"""A run's report: `build_report` makes its tables (and, given a baseline, its drift) once, as a
`reports.document.Report` rendered three ways (terminal, HTML, markdown); `run_report` is the
entry point behind `mla-verify report`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from mla_verify.equivalence.judge.policy import WORSE_TAIL
from mla_verify.reports import causes
from mla_verify.reports.bias import bias_of
from mla_verify.reports.document import Report, Section
from mla_verify.reports.drift import DriftSettings, Worst
from mla_verify.reports.drift_tables import group_view, metric_view
from mla_verify.reports.pairing import NothingComparable
from mla_verify.reports.fmt import MISSING, header, number
from mla_verify.reports.glance import at_a_glance
from mla_verify.reports.html import render_html
from mla_verify.reports.kinds import KEY_METRIC, annotate
from mla_verify.reports.markdown import render_markdown
from mla_verify.reports.meta import describe, impls_differ, judged_where
from mla_verify.reports.stats import Counts, by_group, by_knob, counts, deviation_groups, failures, run_ids
from mla_verify.equivalence.errors import UsageError
from mla_verify.reports.store import load_run, run_file

_KNOB_TITLES = {"topk": "topk", "heads": "query heads", "value_regime": "value regime",
                "seq_bucket": "context length (seq_len bucket)", "dcp_size": "DCP world size"}

_METRICS = ", ".join(f"{kind} {metric}" for kind, metric in KEY_METRIC.items())
_COLUMNS_NOTE = (
    f"p50/p99/max: the key error metric of each kind ({_METRICS}; exact must be 0). "
    "bf16u: ||impl - ref|| in units of one bf16 rounding of the reference. bias: mean of mean_err, "
    "the signed mean error relative to rms(ref), which rounding leaves near 0 and a bug does not. "
    "min headroom: least bound/value (below 1 fails)."
)


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
                 baseline: tuple[pd.DataFrame, Mapping[str, Any]] | None = None, *,
                 drift: DriftSettings = DriftSettings()) -> Report:
    """The report of stored rows (as `load_run` returns them), optionally against a baseline run
    (`reports.drift.compare` with the `drift` settings; NothingComparable when nothing pairs)."""
    frame = annotate(rows)
    report = Report(rows=frame, meta=dict(meta), counts=counts(frame, bool(meta.get("incomplete")), judged_where(meta)))
    later = _against(report, rows, meta, baseline, drift) if baseline is not None else []  # after the run's own tables
    report.sections += _own_sections(report, frame, baseline is not None)
    report.bias = bias_of(rows, drift.confidence)
    warned = len(report.bias.warnings)
    report.sections.append(Section(
        "bias", "Bias per path",
        f"{warned or 'No'} group{'s' * (warned != 1)} biased against the exact reference (a warning, not a failure). "
        "Per group and bias metric the mean over its cases, each case one sample: gain = <impl - ref, ref> / "
        "<ref, ref> (outputs), bias_units = the mean signed error in rounding units (bf16 ulps for outputs, fp32 "
        f"steps of the logit scale for LSEs); ci: the half-width of the t interval at {drift.confidence:g}. Biased: the "
        "whole interval lies beyond the floor (equivalence.judge.policy.BIAS_METRICS).",
        report.bias.table))
    report.sections += later[:2]
    for knob, table in by_knob(frame).items():
        if not table.empty:
            report.sections.append(Section(
                f"knob-{knob}", f"Error by {_KNOB_TITLES[knob]}",
                f"Per {header(knob)} value and tensor kind, rows without a deviation (rows whose "
                f"op has no {header(knob)} are left out).", table))
    report.sections += later[2:]
    return report


def _against(report: Report, rows: pd.DataFrame, meta: Mapping[str, Any],
             baseline: tuple[pd.DataFrame, Mapping[str, Any]], settings: DriftSettings) -> list[Section]:
    """The baseline's part of the report: its meta and counts, the drift, and its sections (drift,
    drift per metric, the runs side by side)."""
    base_rows, base_meta = baseline
    report.baseline_meta = dict(base_meta)
    report.baseline_counts = counts(annotate(base_rows))
    report.notes = [note] if (note := impls_differ(meta, base_meta)) else []
    try:
        drift = report.drift = settings.compare(rows, base_rows)
    except NothingComparable as exc:  # say why, where the runs gated different kernels
        raise NothingComparable("; ".join([str(exc), *report.notes])) from None
    factor, confidence, min_cases = settings.factor, settings.confidence, settings.min_cases
    judged = drift.metrics[drift.metrics["mode"] != "too few cases to judge"]
    return [Section(
        "drift", "Drift against the baseline",
        f"{drift.verdict}. {drift.pairing_line()}. Paired groups (cases the baseline ran too) are "
        f"judged on the median per-case ratio new / old of each drift metric, unpaired ones by a "
        f"one-sided rank test of new > x{factor:g} old at confidence {confidence:g} (at least "
        f"{min_cases} cases a side, else too few cases to judge); values are raised to each metric's "
        "floor first, so rounding residue makes no ratio. Bias metrics (gain, bias_units) are judged on the "
        f"shift of their mean over the cases instead: drift when its t interval at {confidence:g} lies wholly "
        "beyond the metric's floor. A metric that was 0 (bitwise) and is not is "
        "'no longer bitwise'. ratio / worst ratio: of the metric named; max_abs p99 is shown, never "
        "judged. Improvements never fail the run. Within the factor a group reads worse (or better) when the "
        f"median or the upper-tail test of a metric is significant at {confidence:g} (reports.words): the word "
        "column says drifted, worse, unchanged or better. Every column is one click below the table.",
        drift.groups, limit=300, shown=group_view(drift)), Section(
        "drift-metrics", "Drift per metric",
        "Every drift metric of every compared group (equivalence.judge.policy.DRIFT_METRICS: bf16_units and "
        "elem_bf16_units for outputs, lse_fp32_units for LSEs, abs_bias = |mean_err|, bound_use = "
        "1 / headroom). Paired: ratio is the median per-case ratio; unpaired: the p99 ratio, with the "
        "rank test's p-value. Bias metrics (equivalence.judge.policy.BIAS_METRICS): the means, their shift (paired: "
        "the mean per-case difference; unpaired: Welch), the t interval's half-width shift_ci, its p-value "
        "and the floor. p90 ×: the p90 of the per-case ratios (unpaired: the ratio of the p90s); up / down: the "
        f"cases that moved by {WORSE_TAIL:g}x or more each way (paired only); p: the test behind the finding.", judged,
        limit=600, shown=metric_view(judged)), Section(
        "side-by-side", "Runs side by side", "What ran, where, and how it ended.",
        _side_by_side(report, base_rows))]


def _own_sections(report: Report, frame: pd.DataFrame, against_baseline: bool) -> list[Section]:
    """The run's own tables: at a glance, failures, findings by cause, error per path, documented
    deviations."""
    sections = [Section(
        "glance", "At a glance",
        "Each op (path), tensor and implementation: failing first, then"
        + (" those that changed against the baseline, then" if against_baseline else "")
        + " by the share of its bound the worst row uses (bound use = value / bound of the gated metric closest "
        "to its bound; 1 fails).", at_a_glance(frame, report.drift), bars=("bound use",))]
    fails = failures(frame)
    if not fails.empty:
        sections.append(Section(
            "failures", "Failures",
            "Rows that failed their bound, least headroom first. Replay a case by its case_id "
            "and seed.", fails, limit=200))
    groups = causes.of_frame(frame)
    if sum(len(g.findings) for g in groups) > 1:  # several findings: by cause
        sections.append(Section(
            "causes", "Findings by cause",
            f"{len(groups)} group{'s' * (len(groups) != 1)} of the run's findings (its case files under failures/), "
            "put down to the kernel the harness knows differs: a pipeline's first stage whose output differs "
            "from the reference's on the same inputs, an op's own kernel, the one kernel a property's case ran "
            "(or the one of them the other findings name); else the op (path) or property and implementation.",
            causes.table(groups), limit=200))
    sections.append(Section(
        "groups", "Error per path",
        "Per op, path, tensor and implementation; rows held to a documented deviation are in "
        "their own table below. " + _COLUMNS_NOTE, by_group(frame)))
    deviations = deviation_groups(frame)
    if not deviations.empty:
        sections.append(Section(
            "deviations", "Documented deviations",
            "Rows held to the wider bound of an implementation's documented deviation: expected, "
            "not regressions (as long as they pass).", deviations))
    return sections


def run_report(run_dir: str | Path, baseline: str | Path | None = None,
               html: str | Path | None = None, markdown: str | Path | None = None, *,
               drift: DriftSettings = DriftSettings(),
               save_case: Callable[[Worst, Path, Sequence[str], Sequence[str]], str | None] | None = None) -> int:
    """Load a run (and a baseline run), print the terminal summary and drift verdict (`drift`: how
    the baseline is compared), write the
    HTML report (default run_dir/report.html) and, if asked, a markdown one. `save_case(worst,
    directory, deviations, conventions)` saves the case that drifted most under run_dir/drift/, with
    what the run declared (its meta.json), and returns the command that
    replays it, which the report prints (`mla_verify.api.save_worst_case`; None: nothing saved).
    Returns the exit code: 1 when the run has failures or drift is flagged, else 0
    (NothingComparable is raised; UsageError when `html` or `markdown` names a file of a run)."""
    for target in (html, markdown):
        if target is not None and (why := run_file(target)):
            raise UsageError(why)
    rows, meta = load_run(run_dir)
    report = build_report(rows, meta, load_run(baseline) if baseline is not None else None, drift=drift)
    report.name = Path(run_dir).resolve().name
    if save_case is not None and report.drift is not None and report.drift.worst is not None:
        report.replay = save_case(report.drift.worst, Path(run_dir) / "drift", meta.get("deviations") or (),
                                  meta.get("conventions") or ())
    print(report.summary())
    html_path = Path(html) if html is not None else Path(run_dir) / "report.html"
    html_path.write_text(render_html(report), encoding="utf-8")
    print(f"html report: {html_path}")
    if markdown is not None:
        Path(markdown).write_text(render_markdown(report), encoding="utf-8")
        print(f"markdown report: {markdown}")
    return report.exit_code
