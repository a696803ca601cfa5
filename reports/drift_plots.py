"""The drift section's figure: per group, the baseline's values of its drift metric beside the
new ones. A paired group is a scatter of new against old, one dot per case, with the y = x line
(unchanged) and the y = factor * x line (the drift threshold); an unpaired one is the two
distributions side by side, with the new run's threshold (factor x the baseline's p99). Values
are raised to the metric's floor first, as the drift test sees them.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib.ticker import FuncFormatter, NullFormatter

from mla_verify.equivalence.judge.policy import DRIFT_METRICS
from mla_verify.reports.drift import GROUP_KEYS, PAIRED, UNPAIRED, Drift, group_label
from mla_verify.reports.plots import _FAILED, _NORMAL, Plot, _figure, _plain_log, _png
from mla_verify.reports.stats import quantile
from mla_verify.reports.words import DRIFTED

PANELS = 12          # groups drawn at most: the flagged ones first, then one per op and path
_COLUMNS = 4
_BASE = "#7f7f7f"
_FLOORS = {m.name: m.floors for m in DRIFT_METRICS}


def _values(rows: pd.DataFrame, key: tuple, metric: str, floor: float) -> pd.Series:
    """case_id -> the group's metric, raised to the floor (NaN dropped)."""
    mask = np.logical_and.reduce([(rows[k] == v).to_numpy(dtype=bool) for k, v in zip(GROUP_KEYS, key, strict=True)])
    g = rows[mask].drop_duplicates("case_id")
    v = g.set_index("case_id")[metric].astype("float64").dropna()
    return np.maximum(v, floor)


def _chosen(drift: Drift) -> pd.DataFrame:
    g = drift.groups
    # a group spoken for by a bias metric (a signed shift, no ratio) is drawn in the bias figure; one
    # with no ratio at all (whole-case failures, tensor "*": no metric was measured) is not drawn
    drawable = (g["mode"].isin([PAIRED, UNPAIRED]) & (g["kind"] != "exact") & g["metric"].isin(list(_FLOORS))
                & g["ratio"].notna())
    flagged = g["word"] == DRIFTED
    rest = g[drawable & ~flagged]             # groups come sorted: improved first, then by worst ratio
    # one group per op and path (its output, where it has one) before a second one of any: a
    # quiet run shows its breadth
    outputs_first = rest.iloc[np.argsort((rest["kind"] != "out").to_numpy(), kind="stable")]
    chosen = pd.concat([g[drawable & flagged], outputs_first.drop_duplicates(["op", "path"]).sort_index(), rest])
    return chosen[~chosen.index.duplicated()].head(PANELS)


def _paired(ax, old: pd.Series, new: pd.Series, factor: float, worst: str) -> None:
    both = pd.concat([old.rename("old"), new.rename("new")], axis=1, join="inner")
    lo = float(min(both.min().min(), both.max().max() / 10))
    hi = float(max(both.max().max(), lo * 10)) * 1.5
    line = np.array([lo / 1.5, hi])
    ax.plot(line, line, color="0.5", linewidth=1, label="y = x")
    ax.plot(line, factor * line, color=_FAILED, linestyle="--", linewidth=1, label=f"y = {factor:g}x")
    ax.scatter(both["old"], both["new"], s=14, color=_NORMAL, alpha=0.7, linewidths=0, zorder=3)
    if worst in both.index:
        ax.scatter([both.loc[worst, "old"]], [both.loc[worst, "new"]], s=60, facecolors="none",
                   edgecolors=_FAILED, linewidths=1.2, zorder=4, label="worst case")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo / 1.5, hi)
    ax.set_ylim(lo / 1.5, hi * factor)
    ax.set_xlabel("baseline", fontsize=7)
    ax.set_ylabel("new", fontsize=7)


def _unpaired(ax, old: pd.Series, new: pd.Series, factor: float, rng: np.random.Generator) -> None:
    for x, values, color, name in ((0, old, _BASE, "baseline"), (1, new, _NORMAL, "new")):
        v = values.to_numpy()
        ax.scatter(x + rng.uniform(-0.15, 0.15, v.size), v, s=12, color=color, alpha=0.7, linewidths=0, zorder=3)
        if v.size:
            ax.hlines(quantile(v, 0.5), x - 0.3, x + 0.3, color="black", linewidth=1.4)
    if old.size:
        ax.axhline(factor * quantile(old.to_numpy(), 0.99), color=_FAILED, linestyle="--", linewidth=1,
                   label=f"{factor:g} x baseline p99")
    ax.set_yscale("log")
    ax.set_xticks([0, 1])
    ax.set_xticklabels([f"baseline (n={old.size})", f"new (n={new.size})"], fontsize=7)
    ax.set_xlim(-0.6, 1.6)


def drift_figure(drift: Drift | None) -> Plot | None:
    if drift is None:
        return None
    chosen = _chosen(drift)
    if chosen.empty:
        return None
    rows = math.ceil(len(chosen) / _COLUMNS)
    cols = min(_COLUMNS, len(chosen))
    fig, axes = _figure(cols, 3.6 * cols, 3.1 * rows, rows=rows)
    rng = np.random.default_rng(0)
    for ax, (_, g) in zip(axes, chosen.iterrows()):
        key = tuple(g[k] for k in GROUP_KEYS)
        floor = _FLOORS[g["metric"]][g["kind"]]
        old = _values(drift.base_rows, key, g["metric"], floor)
        new = _values(drift.cur_rows, key, g["metric"], floor)
        if g["mode"] == PAIRED:
            _paired(ax, old, new, drift.factor, g["worst_case"])
        else:
            _unpaired(ax, old, new, drift.factor, rng)
        for axis, limits in ((ax.yaxis, ax.get_ylim()), (ax.xaxis, ax.get_xlim()))[:2 if g["mode"] == PAIRED else 1]:
            _plain_log(axis)
            if limits[1] > 12 * limits[0]:   # over a decade in a small panel: decade labels only
                axis.set_minor_formatter(NullFormatter())
            else:                            # within one: two digits, so that labels differ
                axis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:.2g}"))
        ax.tick_params(labelsize=7, which="both")
        ax.grid(alpha=0.3, which="major")
        label, finding = group_label(*key, sep="\n"), g["finding"].upper() or "ok"
        ax.set_title(f"{label}\n{g['metric']} · {g['mode']} · {finding}", fontsize=7,
                     color=_FAILED if g["word"] == DRIFTED else "black")
        ax.legend(fontsize=6, loc="upper left")
    for ax in axes[len(chosen):]:
        ax.set_visible(False)
    caption = (f"Per group (the flagged ones first, then one per op and path by ratio; {PANELS} at most), the metric that "
               "speaks for it, raised to its floor. Paired: one dot per case, new against baseline; on the grey "
               f"y = x line nothing changed, above the red y = {drift.factor:g}x line the case grew beyond the "
               "factor; the worst case is circled. Unpaired: the two runs' cases side by side (black: median), "
               f"red: {drift.factor:g} x the baseline's p99.")
    return Plot("plot-drift", "drift", "Drift: baseline against new", caption, _png(fig))
