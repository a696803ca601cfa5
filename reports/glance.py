"""The report's first table, what an engineer asks first: which paths fail or sit closest to their
bound, and what changed against the baseline. One row per (op/path, tensor, implementation):
failing first, then by the share of its bound the worst row uses; narrow enough to read whole."""

from __future__ import annotations

import math

import pandas as pd

from mla_verify.reports.drift import Drift
from mla_verify.reports.stats import grouped, where

KEYS = ("op", "path", "tensor", "impl")
COLUMNS = ("status", "op/path", "tensor", "impl", "cases", "closest to its bound", "bound use", "vs baseline")


def at_a_glance(frame: pd.DataFrame, drift: Drift | None = None) -> pd.DataFrame:
    """The table over annotated rows (`reports.kinds.annotate`); `drift` fills "vs baseline" with
    each group's finding (drift, no longer bitwise, new failures, improved; blank: unchanged)."""
    findings = _findings(drift)
    records = []
    for key, g in grouped(frame, KEYS):
        failed = int((~g["passed"]).sum())
        gated = g[g["headroom"].notna()]
        worst = gated.loc[gated["headroom"].idxmin()] if len(gated) else None
        # headroom = bound / value: inf for an exact pass, 0 for a crashed or raised row (no value)
        h = math.inf if worst is None else float(worst["headroom"])
        use = 0.0 if math.isinf(h) else math.inf if h == 0 else 1.0 / h
        closest = "" if worst is None else f"{worst['gate_metric']} = {worst['value']:.3g} of {worst['bound']:.3g}"
        records.append({
            "status": f"FAIL {failed} of {len(g)} rows" if failed else "ok",
            "op/path": where(g.head(1)).iloc[0], "tensor": key[2], "impl": key[3],
            "cases": g["case_id"].nunique(), "closest to its bound": closest, "bound use": use,
            "vs baseline": findings.get(key, "" if drift is None else "unchanged"),
            "failed": failed,
        })
    table = pd.DataFrame.from_records(records, columns=[*COLUMNS, "failed"])
    flagged = table["vs baseline"].isin(("", "unchanged", "improved"))
    return (table.assign(_flagged=~flagged)
            .sort_values(["failed", "_flagged", "bound use"], ascending=False, kind="stable")
            .drop(columns=["_flagged", "failed"]).reset_index(drop=True))


def _findings(drift: Drift | None) -> dict[tuple, str]:
    if drift is None:
        return {}
    out: dict[tuple, str] = {}
    for _, g in drift.groups.iterrows():
        key = tuple(g[k] for k in KEYS)
        text = g["finding"] or ("unchanged" if g["mode"] not in ("new", "gone") else g["mode"])
        if g["finding"] and isinstance(g["ratio"], float) and not math.isnan(g["ratio"]):
            text += f" ({g['metric']} x{g['ratio']:.3g})"
        out[key] = text if key not in out or not out[key] or out[key] == "unchanged" else out[key]
    return out
