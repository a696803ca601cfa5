"""Summary statistics of a run's rows: per group, per knob, the failures and the verdict counts.

Every function takes the frame from `reports.kinds.annotate` (stored columns plus kind, metric,
error, seq_bucket). Rows under a documented deviation are summarised apart from the rest: their
wider errors are expected and would otherwise read as regressions in the path and knob tables.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from mla_verify.reports.fmt import MISSING
from mla_verify.reports.kinds import KNOB_TABLES

GROUP_KEYS: tuple[str, ...] = ("op", "path", "tensor", "impl", "deviation")

# rows: rows in the group; cases: distinct case_id; failed: rows that failed their bound;
# p50/p99/max: the key error metric; units_*: bf16_units; bias: mean of mean_err (signed);
# bias_absmean / bias_absmax: mean and max of |mean_err|; headroom_min: least bound/value.
STAT_COLUMNS: tuple[str, ...] = (
    "rows", "cases", "failed", "metric", "p50", "p99", "max", "units_p50", "units_p99",
    "bias", "bias_absmean", "bias_absmax", "headroom_min",
)


def quantile(values: np.ndarray | pd.Series, q: float) -> float:
    """The order statistic at fraction q (numpy method "higher"), NaN ignored; NaN if none left.

    An observed value rather than an interpolation: the plots draw the same numbers the tables
    print, and an inf in the tail never interpolates into NaN (inf - x times 0)."""
    v = np.asarray(values, dtype="float64")
    v = v[~np.isnan(v)]
    return float(np.quantile(v, q, method="higher")) if v.size else float("nan")


def quantiles(values: np.ndarray, qs: Sequence[float]) -> list[float]:
    """`quantile` at each of `qs`, with one sort (NaN ignored): the history judges thousands of groups."""
    v = np.sort(np.asarray(values, dtype="float64"))
    v = v[: v.size - int(np.isnan(v).sum())]          # NaN sorts last
    return [float(v[min(v.size - 1, math.ceil(q * (v.size - 1) - 1e-12))]) if v.size else math.nan for q in qs]


def _reduce(values: pd.Series, how: str) -> float:
    v = values.to_numpy(dtype="float64")
    v = v[~np.isnan(v)]
    return float(getattr(np, how)(v)) if v.size else float("nan")


def group_stats(group: pd.DataFrame) -> dict[str, object]:
    """STAT_COLUMNS of one group of annotated rows."""
    bias = group["mean_err"]
    return {
        "rows": len(group),
        "cases": group["case_id"].nunique(),
        "failed": int((~group["passed"]).sum()),
        "metric": "/".join(sorted(set(group["metric"]))),
        "p50": quantile(group["error"], 0.50),
        "p99": quantile(group["error"], 0.99),
        "max": _reduce(group["error"], "max"),
        "units_p50": quantile(group["bf16_units"], 0.50),
        "units_p99": quantile(group["bf16_units"], 0.99),
        "bias": _reduce(bias, "mean"),
        "bias_absmean": _reduce(bias.abs(), "mean"),
        "bias_absmax": _reduce(bias.abs(), "max"),
        "headroom_min": _reduce(group["headroom"], "min"),
    }


def grouped(frame: pd.DataFrame, keys: Sequence[str]):
    """(key tuple, rows) in the order every table and plot lists groups (sorted, categories in
    their declared order, missing keys dropped)."""
    return frame.groupby(list(keys), sort=True, observed=True, dropna=True)


def summarize(frame: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """One row per group of `keys`: the keys, then STAT_COLUMNS."""
    records = [
        {**dict(zip(keys, key, strict=True)), **group_stats(rows)}
        for key, rows in grouped(frame, keys)
    ]
    return pd.DataFrame.from_records(records, columns=[*keys, *STAT_COLUMNS])


def expected(frame: pd.DataFrame) -> pd.Series:
    """Mask of rows held to a documented deviation's bound."""
    return frame["deviation"] != ""


def by_group(frame: pd.DataFrame) -> pd.DataFrame:
    """Per (op, path, tensor, impl), rows without a documented deviation."""
    return summarize(frame[~expected(frame)], GROUP_KEYS[:-1])


def deviation_groups(frame: pd.DataFrame) -> pd.DataFrame:
    """Per (op, path, tensor, impl, deviation), rows held to a documented deviation's bound."""
    return summarize(frame[expected(frame)], GROUP_KEYS)


def by_knob(frame: pd.DataFrame, knobs: Sequence[str] = KNOB_TABLES) -> dict[str, pd.DataFrame]:
    """knob -> per (knob value, tensor kind) table over rows without a deviation; rows where the
    op has no such knob (missing value) are left out of that knob's table."""
    main = frame[~expected(frame)]
    return {knob: summarize(main, (knob, "kind")) for knob in knobs}


FAILURE_COLUMNS = ("case_id", "op/path", "tensor", "impl", "metric", "value", "bound",
                   "headroom", "reason", "seed")


def where(frame: pd.DataFrame) -> pd.Series:
    """"op/path" for forward_mqa paths, the op alone where the path is the op."""
    return pd.Series(
        [op if op == path else f"{op}/{path}" for op, path in zip(frame["op"], frame["path"])],
        index=frame.index, dtype="string",
    )


def failures(frame: pd.DataFrame) -> pd.DataFrame:
    """Failed rows, least headroom first."""
    failed = frame[~frame["passed"]].sort_values("headroom", na_position="last", kind="stable")
    table = pd.DataFrame({
        "case_id": failed["case_id"],
        "op/path": where(failed),
        "tensor": failed["tensor"],
        "impl": failed["impl"],
        "metric": failed["gate_metric"],
        "value": failed["value"],
        "bound": failed["bound"],
        "headroom": failed["headroom"],
        "reason": failed["reason"],
        "seed": failed["seed"],
    })
    return table.reset_index(drop=True)


def run_ids(frame: pd.DataFrame) -> str:
    """The run ids among the rows ("a,b" for rows pooled from several runs)."""
    return ",".join(sorted(set(frame["run_id"]))) or MISSING


def _s(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


@dataclass(frozen=True)
class Counts:
    """A run's verdict counts. A finding is a saved case file (the rows of its case name it:
    `Row.finding`); the run's other failing cases (a covering case besides the draw a campaign shrank,
    the case a finding was minimized from) are evidence, counted as failing cases."""

    rows: int
    failed_rows: int
    cases: int
    failed_cases: int
    deviation_rows: int
    incomplete: bool = False   # the run never finished: what it did not reach has no verdict
    judged: str = ""           # why a PASS is qualified (reports.meta.judged_where): '' judged out of the kernel's reach
    minimized_cases: int = 0   # failing cases that are a finding's minimized case (rows of source "shrink")
    findings: int | None = None  # distinct case files the rows name; None: failing rows that name none (a run
    #                              written before rows named their finding)
    reached: str = ""          # the heads, top-k and block sizes the cases reached (`reached`)

    @property
    def passed(self) -> bool:
        return self.failed_rows == 0 and not self.incomplete

    def line(self) -> str:
        unfinished = " (the run did not finish)" if self.incomplete else ""
        if self.failed_rows:
            shrunk = f" ({self.minimized_cases} of them a finding's minimized case)" if self.minimized_cases else ""
            failed = (f"{self.failed_rows} of {self.rows} rows failed in {_s(self.failed_cases, 'failing case')} of "
                      f"{self.cases}{shrunk}")
            if self.findings is None:
                return f"FAIL: {failed} (rows written before they named their finding){unfinished}"
            return f"FAIL: {_s(self.findings, 'finding')} in failures/: {failed}{unfinished}"
        if self.incomplete:
            return (f"INCOMPLETE: the run did not finish: {self.rows} rows in {self.cases} cases, none failed, "
                    "and the cases it never reached have no verdict")
        return (f"PASS{f' ({self.judged})' if self.judged else ''}: {self.rows} rows in {self.cases} cases, none failed"
                + (f"; reached {self.reached}" if self.reached else ""))


REACHED = (("heads", "heads"), ("topk", "top-k"), ("block_size", "block sizes"))


def reached(frame: pd.DataFrame) -> str:
    """The head counts, top-k widths and block sizes the rows' cases reached ("" where none says):
    what a PASS covered of the sizes serving uses (64 and 128 heads, top-k 2048, pages of 64)."""
    found = []
    for column, word in REACHED:
        values = sorted({int(v) for v in frame[column].dropna()}) if column in frame else []
        if values:
            found.append(f"{word} {', '.join(map(str, values))}")
    return "; ".join(found)


def counts(frame: pd.DataFrame, incomplete: bool = False, judged: str = "") -> Counts:
    """The verdict counts of `frame`; `incomplete`: rows of a run that never finished (never a pass);
    `judged`: why a pass is qualified (`Counts.judged`)."""
    failed = frame[~frame["passed"]]
    named = frame.loc[frame["finding"] != "", "finding"].nunique() if "finding" in frame else 0
    return Counts(
        rows=len(frame),
        failed_rows=len(failed),
        cases=frame["case_id"].nunique(),
        failed_cases=failed["case_id"].nunique(),
        minimized_cases=failed.loc[failed["source"] == "shrink", "case_id"].nunique() if "source" in failed else 0,
        deviation_rows=int(expected(frame).sum()),
        incomplete=bool(incomplete),
        judged=judged,
        findings=named if named or failed.empty else None,
        reached=reached(frame),
    )
