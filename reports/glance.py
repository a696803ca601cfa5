"""The report's first table, what an engineer asks first: which paths fail or sit closest to their
bound, and what changed against the baseline. One row per (op/path, tensor, implementation):
failing first, then by the share of its bound the worst row uses; narrow enough to read whole."""

from __future__ import annotations

import math

import pandas as pd

from mla_verify.reports.drift import Drift
from mla_verify.reports.stats import grouped, where
from mla_verify.reports.words import BETTER, DRIFTED, NOT_COMPARABLE, UNCHANGED, WORSE

KEYS = ("op", "path", "tensor", "impl")
_ORDER = (DRIFTED, WORSE, BETTER, NOT_COMPARABLE, UNCHANGED)   # what was not compared is never read as unchanged
COLUMNS = ("status", "op/path", "tensor", "impl", "cases", "closest to its bound", "bound use", "vs baseline")


def at_a_glance(frame: pd.DataFrame, drift: Drift | None = None) -> pd.DataFrame:
    """The table over annotated rows (`reports.kinds.annotate`); `drift` fills "vs baseline" with
    each group's word (drifted, worse, unchanged, better; `reports.words`) and the numbers behind it:
    "worse: out bf16_units p99 1 -> 1.94 (x1.94), median x1.07, abs_bias x4.26"."""
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
        word, says = findings.get(key, ("", "" if drift is None else "unchanged"))
        records.append({
            "status": f"FAIL {failed} of {len(g)} rows" if failed else "ok",
            "op/path": where(g.head(1)).iloc[0], "tensor": key[2], "impl": key[3],
            "cases": g["case_id"].nunique(), "closest to its bound": closest, "bound use": use,
            "vs baseline": says, "failed": failed, "_flagged": word in (DRIFTED, WORSE),
        })
    table = pd.DataFrame.from_records(records, columns=[*COLUMNS, "failed", "_flagged"])
    return (table.sort_values(["failed", "_flagged", "bound use"], ascending=False, kind="stable")
            .drop(columns=["_flagged", "failed"]).reset_index(drop=True))


def _findings(drift: Drift | None) -> dict[tuple, tuple[str, str]]:
    """Each tensor's (word, what "vs baseline" says)."""
    if drift is None:
        return {}
    out: dict[tuple, tuple[int, str, str]] = {}
    for _, g in drift.groups.iterrows():   # a tensor's groups of other deviations: the first word in _ORDER speaks
        key = tuple(g[k] for k in KEYS)
        rank = _ORDER.index(g["word"]) if g["word"] in _ORDER else len(_ORDER)
        text = f"{g['word']}: {drift.headline(g)}" if g["word"] in (DRIFTED, WORSE, BETTER) else g["word"]
        if key not in out or rank < out[key][0]:
            out[key] = (rank, g["word"], text)
    return {key: (word, text) for key, (_, word, text) in out.items()}
