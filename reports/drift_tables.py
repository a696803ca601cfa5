"""The drift sections' narrow views (issue 39): the columns a 1400 px window shows whole; the full
tables (`Drift.groups`, `Drift.metrics`) stay one click away behind them."""

from __future__ import annotations

import pandas as pd

from mla_verify.reports.drift import GROUP_KEYS, PAIRED, Drift, group_label


def _labels(frame: pd.DataFrame) -> list[str]:
    return [group_label(*key) for key in frame[list(GROUP_KEYS)].itertuples(index=False, name=None)]


def _cases(frame: pd.DataFrame) -> list[str]:
    return [str(int(r.paired_cases)) if r.mode == PAIRED else f"{int(r.base_cases)} vs {int(r.cur_cases)}"
            for r in frame.itertuples()]


def group_view(drift: Drift) -> pd.DataFrame:
    """Per group: its word, what it is, how it was compared and on how many cases, and the metric that
    speaks for it (its ratio, its p90 ratio, its worst case)."""
    g = drift.groups
    speaking = g[[*GROUP_KEYS, "metric"]].merge(drift.metrics[[*GROUP_KEYS, "metric", "p90_ratio"]],
                                                on=[*GROUP_KEYS, "metric"], how="left")
    return pd.DataFrame({"word": g["word"], "group": _labels(g), "mode": g["mode"], "cases": _cases(g),
                         "metric": g["metric"], "ratio": g["ratio"], "p90 ×": speaking["p90_ratio"].to_numpy(),
                         "worst ×": g["worst_ratio"], "worst case": g["worst_case"]})


def metric_view(metrics: pd.DataFrame) -> pd.DataFrame:
    """Per group and metric: the p99s, the ratio, the tail, the cases that moved and the test behind the finding."""
    m = metrics.reset_index(drop=True)
    p = m["p_value"].where(m["p_value"].notna(), m["p_moved"])
    return pd.DataFrame({"group": _labels(m), "metric": m["metric"], "mode": m["mode"], "cases": _cases(m),
                         "base p99": m["base_p99"], "cur p99": m["cur_p99"], "ratio": m["ratio"],
                         "p90 ×": m["p90_ratio"], "up": m["moved_up"], "down": m["moved_down"],
                         "shift": m["shift"], "p": p, "finding": m["finding"]})
