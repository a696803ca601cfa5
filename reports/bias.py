"""Bias: does an implementation err the same way, case after case?

Each compared tensor of a case carries signed statistics against the exact reference
(`equivalence.judge.metrics`: `gain`, the least-squares <a - r, r> / <r, r>, with its standard error,
and `bias_units`, the mean signed error in the tensor's rounding units). Rounding leaves them
noise around 0; a scale folded in wrongly, a truncation or a biased exp does not, case after case.

Per group (op, path, tensor, implementation, deviation) and bias metric, the cases are the
samples (`equivalence.judge.policy` "bias" says why): their mean with a t interval at the confidence
(`reports.significance.mean_interval`). A group is biased when the whole interval lies beyond
the metric's floor: significant, and larger than the floor at that confidence. Alone that is a warning, never a failure: the exact answer is
the reference, but a kernel may be known to lean (a declared deviation); against a baseline the
shift of the mean is judged instead (`reports.drift`), and that fails the run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from mla_verify.equivalence.judge.policy import DRIFT_CONFIDENCE, bias_metrics
from mla_verify.reports.fmt import number
from mla_verify.reports.kinds import annotate
from mla_verify.reports.significance import mean_interval
from mla_verify.reports.stats import grouped

GROUP_KEYS: tuple[str, ...] = ("op", "path", "tensor", "impl", "deviation", "kind")
BIASED = "biased"
BIAS_COLUMNS: tuple[str, ...] = (*GROUP_KEYS, "metric", "cases", "mean", "ci", "p_value", "floor", "finding")


def label(op: str, path: str, tensor: str, impl: str, deviation: str = "", *_: object) -> str:
    """"forward_mqa/fp8_mixed out [pipeline]" (plus the deviation)."""
    where = op if op == path else f"{op}/{path}"
    return f"{where} {tensor} [{impl}]" + (f" (deviation: {deviation})" if deviation else "")


def signed(value: float) -> str:
    return number(value) if not np.isfinite(value) or value < 0 else "+" + number(value)


@dataclass(frozen=True)
class Bias:
    """A run's bias per group and metric (BIAS_COLUMNS), judged at `confidence`."""

    table: pd.DataFrame
    confidence: float

    @property
    def warnings(self) -> pd.DataFrame:
        return self.table[self.table["finding"] == BIASED]

    def lines(self) -> list[str]:
        """One warning line per biased group and metric (none when nothing leans)."""
        return [f"warning: BIAS {label(*(w[k] for k in GROUP_KEYS))}: {describe(w, self.confidence)}"
                for _, w in self.warnings.iterrows()]


def describe(w: pd.Series, confidence: float) -> str:
    """"gain +9.1e-04 ± 8.0e-05 (t interval at 0.99) over 60 cases, floor 2.4e-04"."""
    return (f"{w['metric']} {signed(w['mean'])} ± {number(w['ci'])} (t interval at {confidence:g}) over "
            f"{int(w['cases'])} cases, floor {number(w['floor'])}")


def judge(mean: float, ci: float, floor: float) -> bool:
    """The whole t interval beyond the floor: significant, and larger than the floor at the
    confidence (a one-sided test of |mean| > floor). A group of few noisy cases whose mean lands
    past the floor by chance is not enough: its interval reaches back inside."""
    return bool(np.isfinite(ci) and abs(mean) - ci > floor)


def bias_of(rows: pd.DataFrame, confidence: float = DRIFT_CONFIDENCE) -> Bias:
    """The bias of every group of `rows` (stored rows, as `load_run` returns them) that has a bias metric."""
    frame = annotate(rows)
    records = []
    for key, g in grouped(frame, GROUP_KEYS):
        g = g.drop_duplicates("case_id")
        for m in bias_metrics(key[-1]):
            values = g[m.name].to_numpy(dtype="float64")
            if not np.isfinite(values).any():
                continue                       # rows stored before the metric existed
            mean, ci, p = mean_interval(values, confidence)
            floor = m.floors[key[-1]]
            records.append({**dict(zip(GROUP_KEYS, key, strict=True)), "metric": m.name,
                            "cases": int(np.isfinite(values).sum()), "mean": mean, "ci": ci, "p_value": p,
                            "floor": floor, "finding": BIASED if judge(mean, ci, floor) else ""})
    table = pd.DataFrame.from_records(records, columns=list(BIAS_COLUMNS))
    order = np.argsort(-(table["finding"] == BIASED).to_numpy(dtype=int), kind="stable")
    return Bias(table.iloc[order].reset_index(drop=True), confidence)
