"""Baseline drift: did a kernel move away from the exact answer since the baseline run?

Per group (op, path, tensor, impl, deviation) present in both runs, compare the p99 and max of
the kind's key error metric and the mean |bias| (mean of |mean_err|: a systematic offset in
either direction). A group drifts when

    current p99    > factor * max(baseline p99,    error floor of its kind)   or
    current |bias| > factor * max(baseline |bias|, bias floor of its kind)    or
    it fails now and did not in the baseline (or is new and fails).

The floors (`reports.kinds.NOISE_FLOOR`, reasons there) keep ratios of rounding residue from
flagging: lse at 1e-6 doubling is an fp32 ulp, not a regression. The same test with current and
baseline swapped reports improvements, which never fail the run. The max is shown, not tested:
one case decides it, and a fuzz run with another seed draws other cases. Groups that appear or
disappear are listed; the deviation is part of the key, so a deviation that was newly documented
shows as one group gone and one new.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pandas as pd

from mla_verify.reports.fmt import number
from mla_verify.reports.kinds import NOISE_FLOOR, annotate
from mla_verify.reports.stats import GROUP_KEYS, summarize

DEFAULT_FACTOR = 2.0

DRIFT_COLUMNS: tuple[str, ...] = (
    *GROUP_KEYS, "kind", "metric", "status",
    "base_rows", "cur_rows", "base_failed", "cur_failed",
    "base_p99", "cur_p99", "p99_ratio", "base_max", "cur_max", "max_ratio",
    "base_bias", "cur_bias", "bias_ratio", "drift", "improved",
)


def group_label(op: str, path: str, tensor: str, impl: str, deviation: str = "") -> str:
    """"forward_mqa/fp8_mixed out [pipeline]" (plus the deviation where there is one)."""
    where = op if op == path else f"{op}/{path}"
    dev = f" (deviation: {deviation})" if deviation else ""
    return f"{where} {tensor} [{impl}]{dev}"


def _ratio(current: pd.Series, baseline: pd.Series) -> pd.Series:
    with np.errstate(divide="ignore", invalid="ignore"):
        return current.astype("float64") / baseline.astype("float64")


def _grown(current: pd.Series, baseline: pd.Series, floor: pd.Series, factor: float) -> pd.Series:
    """current > factor * max(baseline, floor); NaN on either side never counts."""
    return current > factor * np.fmax(baseline, floor)


def _side(frame: pd.DataFrame, prefix: str) -> pd.DataFrame:
    # kind follows from (tensor, exact): as a key it never splits a group, and it names the floors
    stats = summarize(annotate(frame), (*GROUP_KEYS, "kind"))
    kept = {"rows": "rows", "failed": "failed", "p99": "p99", "max": "max", "bias_absmean": "bias"}
    return stats[[*GROUP_KEYS, "kind", "metric", *kept]].rename(
        columns={k: f"{prefix}_{v}" for k, v in kept.items()})


def _reasons(masks: Mapping[str, pd.Series], index: pd.Index) -> pd.Series:
    """Per row, the names of the masks that hold there, comma-separated ("" for none)."""
    flags = np.column_stack([m.to_numpy(dtype=bool) for m in masks.values()])
    return pd.Series([", ".join(n for n, f in zip(masks, row, strict=True) if f) for row in flags],
                     index=index, dtype="string")


@dataclass(frozen=True)
class Drift:
    """The drift table (DRIFT_COLUMNS, one row per group of either run) and its verdict."""

    table: pd.DataFrame
    factor: float

    @property
    def flagged(self) -> pd.DataFrame:
        return self.table[self.table["drift"] != ""]

    @property
    def improvements(self) -> pd.DataFrame:
        return self.table[self.table["improved"] != ""]

    @property
    def appeared(self) -> pd.DataFrame:
        return self.table[self.table["status"] == "new"]

    @property
    def disappeared(self) -> pd.DataFrame:
        return self.table[self.table["status"] == "gone"]

    @property
    def drifted(self) -> bool:
        return not self.flagged.empty

    @property
    def exit_code(self) -> int:
        """0: no drift, 1: drift."""
        return int(self.drifted)

    @property
    def verdict(self) -> str:
        compared = int((self.table["status"] == "both").sum())
        if self.drifted:
            return (f"DRIFT in {len(self.flagged)} of {len(self.table)} groups "
                    f"(factor {self.factor:g})")
        return f"no drift in {compared} groups compared (factor {self.factor:g})"

    def lines(self) -> list[str]:
        """The verdict, then one line per drifted / improved group and the appeared/gone lists."""
        out = [f"baseline drift: {self.verdict}"]
        for tag, rows, column in (("DRIFT", self.flagged, "drift"),
                                  ("improved", self.improvements, "improved")):
            for _, r in rows.iterrows():
                out.append(f"  {tag} {group_label(*(r[k] for k in GROUP_KEYS))}: "
                           f"{self._explain(r, r[column])}")
        for tag, rows in (("appeared", self.appeared), ("disappeared", self.disappeared)):
            if not rows.empty:
                names = (group_label(*(r[k] for k in GROUP_KEYS)) for _, r in rows.iterrows())
                out.append(f"  {tag}: {', '.join(names)}")
        return out

    @staticmethod
    def _explain(r: pd.Series, reasons: str) -> str:
        parts = []
        for reason in reasons.split(", "):
            if reason == "p99":
                parts.append(f"p99 {r['metric']} {number(r['base_p99'])} -> {number(r['cur_p99'])}"
                              f" (x{number(r['p99_ratio'])})")
            elif reason == "|bias|":
                parts.append(f"mean |bias| {number(r['base_bias'])} -> {number(r['cur_bias'])}"
                              f" (x{number(r['bias_ratio'])})")
            else:
                n = int(r["cur_failed"])
                parts.append(f"{reason} ({n} failed row{'' if n == 1 else 's'})")
        return "; ".join(parts)


def compare(current: pd.DataFrame, baseline: pd.DataFrame, factor: float = DEFAULT_FACTOR,
            floors: Mapping[str, tuple[float, float]] = NOISE_FLOOR) -> Drift:
    """Drift of `current` against `baseline` (stored rows, as `load_run` returns them)."""
    if not factor > 1.0:
        raise ValueError(f"drift factor must be > 1, got {factor}")
    keys = [*GROUP_KEYS, "kind", "metric"]
    table = _side(current, "cur").merge(_side(baseline, "base"), on=keys, how="outer",
                                        indicator=True, sort=True)
    table["status"] = table.pop("_merge").map(
        {"both": "both", "left_only": "new", "right_only": "gone"}).astype("string")
    for col in ("base_rows", "cur_rows", "base_failed", "cur_failed"):
        table[col] = table[col].fillna(0).astype("int64")
    for stat in ("p99", "max", "bias"):
        table[f"{stat}_ratio"] = _ratio(table[f"cur_{stat}"], table[f"base_{stat}"])

    kinds = table["kind"].astype(str)
    error_floor = kinds.map(lambda k: floors[k][0]).astype("float64")
    bias_floor = kinds.map(lambda k: floors[k][1]).astype("float64")
    both = table["status"] == "both"
    checks = {
        "p99": (table["cur_p99"], table["base_p99"], error_floor),
        "|bias|": (table["cur_bias"], table["base_bias"], bias_floor),
    }
    grown = {name: both & _grown(c, b, f, factor) for name, (c, b, f) in checks.items()}
    shrunk = {name: both & _grown(b, c, f, factor) for name, (c, b, f) in checks.items()}
    grown["new failures"] = ((table["cur_failed"] > 0) & (table["base_failed"] == 0)
                             & (table["status"] != "gone"))
    table["drift"] = _reasons(grown, table.index)
    table["improved"] = _reasons(shrunk, table.index)
    # what needs a look first: drifted, improved, new or gone, then the rest in group order
    rank = np.select([(table[c] != v).to_numpy(dtype=bool)
                      for c, v in (("drift", ""), ("improved", ""), ("status", "both"))],
                     [0, 1, 2], default=3)
    table = table.assign(_rank=rank).sort_values(["_rank", *GROUP_KEYS], kind="stable")
    return Drift(table=table[list(DRIFT_COLUMNS)].reset_index(drop=True), factor=factor)
