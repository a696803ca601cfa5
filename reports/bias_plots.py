"""The bias section's figure: per path, each case's output gain with its interval, the baseline's
beside the new run's. The gain and its standard error are the row's (`equivalence.judge.metrics`); a
case's interval (at the report's confidence, normal) says how well the case alone pins its gain,
and the cases' spread is what the group's t interval is made of (`reports.bias`). Drawn sorted by
gain (paired: by the baseline's, both sides at the same place), with 0, the floor either side,
and each side's mean.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pandas as pd

from mla_verify.equivalence.judge.policy import BIAS_METRICS
from mla_verify.reports.bias import BIASED, label
from mla_verify.reports.document import Report
from mla_verify.reports.drift import FLAGS, PAIRED, UNPAIRED
from mla_verify.reports.plots import _FAILED, _NORMAL, Plot, _figure, _png
from mla_verify.reports.stats import grouped

PANELS = 12
_COLUMNS = 3
_BASE = "#7f7f7f"
_KEYS = ("op", "path", "tensor", "impl", "deviation")
_FLOOR = next(m for m in BIAS_METRICS if m.name == "gain").floors["out"]


def _cases(rows: pd.DataFrame) -> pd.DataFrame:
    return rows.drop_duplicates("case_id").set_index("case_id")[["gain", "gain_se"]].astype("float64").dropna(subset=["gain"])


def _panels(report: Report) -> list[tuple[str, pd.DataFrame, pd.DataFrame | None, bool, bool]]:
    """(title, new cases, baseline cases or None, paired, flagged) per output group, flagged first."""
    out = []
    if report.drift is not None:
        d = report.drift
        groups = d.groups[(d.groups["kind"] == "out") & d.groups["mode"].isin([PAIRED, UNPAIRED])]
        for _, g in groups.iterrows():
            def side(rows: pd.DataFrame) -> pd.DataFrame:
                mask = np.logical_and.reduce([(rows[k] == g[k]).to_numpy(dtype=bool)
                                              for k in ("op", "path", "tensor", "impl", "base_impl", "deviation")])
                return _cases(rows[mask])
            gain = d.metrics[(d.metrics["metric"] == "gain")
                             & np.logical_and.reduce([(d.metrics[k] == g[k]).to_numpy(dtype=bool) for k in _KEYS])]
            flagged = bool(len(gain)) and gain["finding"].iloc[0] in FLAGS
            who = g["impl"] if g["impl"] == g["base_impl"] else f"{g['impl']} vs {g['base_impl']}"
            out.append((label(g["op"], g["path"], g["tensor"], who, g["deviation"]), side(d.cur_rows),
                        side(d.base_rows), g["mode"] == PAIRED, flagged))
    else:
        table = report.bias.table if report.bias is not None else pd.DataFrame(columns=[*_KEYS, "metric", "finding"])
        warned = {tuple(r[k] for k in _KEYS) for _, r in table[(table["finding"] == BIASED) & (table["metric"] == "gain")].iterrows()}
        for key, g in grouped(report.rows[report.rows["kind"] == "out"], _KEYS):
            out.append((label(*key), _cases(g), None, False, key in warned))
    out = [p for p in out if len(p[1])]
    return sorted(out, key=lambda p: not p[4])[:PANELS]


def _draw(ax, cases: pd.DataFrame, x: np.ndarray, z: float, color: str, name: str, shift: float) -> None:
    err = np.nan_to_num(z * cases["gain_se"].to_numpy(), nan=0.0)
    ax.errorbar(x + shift, cases["gain"], yerr=err, fmt="o", markersize=2.5, color=color, ecolor=color,
                elinewidth=0.8, alpha=0.8, label=f"{name} (n={len(cases)})")
    ax.axhline(float(cases["gain"].mean()), color=color, linewidth=1.0, linestyle=":")


def bias_figure(report: Report) -> Plot | None:
    panels = _panels(report)
    if not panels:
        return None
    confidence = report.bias.confidence if report.bias is not None else report.drift.confidence
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    rows = math.ceil(len(panels) / _COLUMNS)
    cols = min(_COLUMNS, len(panels))
    fig, axes = _figure(cols, 4.4 * cols, 3.0 * rows, rows=rows)
    for ax, (title, new, base, paired, flagged) in zip(axes, panels):
        if base is not None and paired:
            base = base.loc[base.index.intersection(new.index)].sort_values("gain")
            new = new.loc[base.index]
            _draw(ax, base, np.arange(len(base)), z, _BASE, "baseline", -0.2)
            _draw(ax, new, np.arange(len(new)), z, _NORMAL, "new", 0.2)
        else:
            if base is not None:
                base = base.sort_values("gain")
                _draw(ax, base, np.arange(len(base)), z, _BASE, "baseline", -0.2)
            new = new.sort_values("gain")
            _draw(ax, new, np.arange(len(new)), z, _NORMAL, "new" if base is not None else "cases", 0.2)
        ax.axhline(0.0, color="black", linewidth=0.8)
        for sign in (-1, 1):
            ax.axhline(sign * _FLOOR, color=_FAILED, linestyle="--", linewidth=0.8,
                       label="floor" if sign > 0 else None)
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        ax.tick_params(labelsize=7)
        ax.set_xlabel("cases, by gain" + (" (baseline's)" if paired else ""), fontsize=7)
        ax.set_ylabel("gain", fontsize=7)
        ax.grid(alpha=0.3)
        ax.set_title(title + ("\nBIASED" if flagged and base is None else "\nDRIFT" if flagged else ""),
                     fontsize=7, color=_FAILED if flagged else "black")
        ax.legend(fontsize=6, loc="upper left")
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    caption = (f"Per path's output (the biased or drifted ones first; {PANELS} at most), each case's gain "
               "<impl - ref, ref> / <ref, ref> with its interval at the report's confidence (rows as clusters), "
               "sorted by gain" + ("; baseline grey, new blue (paired: each case at its baseline's place)"
                                   if report.drift is not None else "")
               + f". Dotted: each side's mean over its cases; red dashed: the floor (±{_FLOOR:.3g}). A correct "
               "kernel's cases straddle 0; a biased one's sit on one side.")
    return Plot("plot-bias", "bias", "Bias: per-case output gain", caption, _png(fig))
