"""A history line's figure: its key error metric's median and p99 per run, its bias with the t
interval, and the largest share of a bound used; the runs the two-run judge marks drifted (red)
or worse (amber) are shaded, and those it could not compare with the run before hatched grey: the
figure shows what the verdict says."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.ticker import FuncFormatter, NullFormatter

from mla_verify.equivalence.judge.policy import BIAS_METRICS
from mla_verify.reports.plots import _DEVIATION, _FAILED, _NORMAL, Plot, _figure, _plain_log, _png
from mla_verify.reports.words import DRIFTED, NOT_COMPARABLE, WORSE

_KEY = {"out": "bf16_units", "other": "bf16_units", "lse": "lse_fp32_units", "max_logits": "lse_fp32_units"}
_BIAS = {"out": "gain", "other": "gain", "lse": "bias_units", "max_logits": "bias_units"}
_MARK = {DRIFTED: _FAILED, WORSE: _DEVIATION}
_FLOORS = {m.name: m.floors for m in BIAS_METRICS}


def key_metric(kind: str) -> str | None:
    """The drift metric a line's trend leads with (None for exact contracts: their mismatch counts)."""
    return _KEY.get(kind)


def marks(steps: pd.DataFrame) -> dict[int, str]:
    """Run -> the word the figure marks it with (drifted, worse, not comparable): the trend table's step
    column reads the same words from the same steps."""
    shown = steps[steps["word"].isin([*_MARK, NOT_COMPARABLE])]
    return dict(zip(shown["run"].astype(int), shown["word"], strict=True))


def line_figure(key: str, title: str, trend: pd.DataFrame, steps: pd.DataFrame, labels: list[str]) -> Plot | None:
    """`trend` and `steps`: one line's rows of `History.trend` and `History.steps`."""
    kind = trend["kind"].iloc[0]
    metric, bias = _KEY.get(kind), _BIAS.get(kind)
    if metric is None:
        return None
    fig, axes = _figure(3, 13.0, 2.6)
    x = trend["run"].to_numpy()
    for ax in axes:
        for run, word in marks(steps).items():
            if word == NOT_COMPARABLE:
                ax.axvspan(run - 0.45, run + 0.45, facecolor="none", edgecolor="0.6", hatch="//", linewidth=0)
            else:
                ax.axvspan(run - 0.45, run + 0.45, color=_MARK[word], alpha=0.18, linewidth=0)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    err, lean, use = axes
    err.plot(x, trend[f"{metric} p50"], "o-", color=_NORMAL, markersize=3, label="median")
    err.plot(x, trend[f"{metric} p99"], "s--", color="black", markersize=3, label="p99")
    err.set_yscale("log")
    _plain_log(err.yaxis)
    low, high = err.get_ylim()   # over a decade: decade labels only (text extents dominate drawing); within one: two digits
    err.yaxis.set_minor_formatter(NullFormatter() if high > 12 * low else FuncFormatter(lambda v, _: f"{v:.2g}"))
    err.set_title(f"{metric} per run", fontsize=8)
    err.legend(fontsize=6, loc="upper left")
    if bias in trend and trend[bias].notna().any():
        lean.errorbar(x, trend[bias], yerr=trend[f"{bias} ci"].fillna(0), fmt="o", color=_NORMAL, markersize=3,
                      capsize=2)
        floor = _FLOORS[bias][kind]
        lean.axhspan(-floor, floor, color="0.85", alpha=0.5, label=f"floor ±{floor:.2g}")
        lean.axhline(0, color="0.5", linewidth=0.8)
        lean.legend(fontsize=6, loc="upper left")
    lean.set_title(f"{bias} mean with its t interval", fontsize=8)
    use.plot(x, trend["bound use"].replace(np.inf, np.nan), "o-", color=_NORMAL, markersize=3)
    use.axhline(1.0, color=_FAILED, linestyle="--", linewidth=1)
    use.set_ylim(bottom=0)
    use.set_title("largest share of a bound used", fontsize=8)
    step = max(1, len(labels) // 12)   # at most about a dozen run labels under each panel
    for ax in axes:
        ax.set_xticks(range(0, len(labels), step))
        ax.set_xticklabels(labels[::step], rotation=35, ha="right", fontsize=6)
        ax.set_xlim(-0.6, len(labels) - 0.4)
    caption = (f"{title}: per run, {metric}'s median and p99 over the run's cases, {bias}'s mean over its cases "
               "with the t interval (grey: the bias floor), and the largest share of a bound any case used (red "
               "line: the bound). Shaded: the runs the two-run judge reads drifted (red) or worse (amber) against "
               "the run before; hatched: the runs it could not compare with the run before (their cases mostly "
               "unshared and too few to compare tails).")
    return Plot(key, key, title, caption, _png(fig))
