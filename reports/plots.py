"""The report's figures, as PNG bytes (matplotlib, Agg canvas; no pyplot, so no global state).

Each figure draws the rows a table summarises, grouped the same way and in the same order, and
its boxes are the tables' numbers: the median line is the table's p50 and the upper whisker its
p99 (`reports.stats.quantile`, an observed value), dots above the whisker are the cases beyond
p99, the highest being the table's max. The box spans p25..p75.

Log axes cannot show zeros or infinities: zeros (and values more than `DECADES` below the largest,
so one exact zero or one 1e-20 never stretches an axis over 18 decades) are drawn on a floor line
one decade below the smallest positive value shown, and +inf on a ceiling line a decade above the
largest finite one (each figure's caption counts them); NaN is not drawn and is counted too.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatter, LogLocator

from mla_verify.reports.stats import expected, grouped, quantile

_NORMAL = "#3b6ea8"
_DEVIATION = "#d98c1f"
_FAILED = "#c0392b"
# Horizontal boxes: matplotlib 3.10 renamed bxp's `vert=False` to `orientation` (and deprecates vert).
_HORIZONTAL = ({"orientation": "horizontal"} if tuple(int(x) for x in matplotlib.__version__.split(".")[:2]) >= (3, 10)
               else {"vert": False})
DECADES = 6    # a log axis spans at most this many decades below its largest value, plus the floor's
HISTOGRAM_MIN = 30  # values a group needs for a histogram row; fewer are drawn one dot each
_PALETTE = ("#3b6ea8", "#d98c1f", "#2e8b57", "#c0392b", "#7b5ea7", "#8c564b", "#d45fa0",
            "#7f7f7f", "#9aa629", "#17a2b8")


@dataclass(frozen=True)
class Plot:
    key: str        # html anchor
    section: str    # key of the report section whose table it draws
    title: str
    caption: str
    png: bytes


@dataclass(frozen=True)
class Category:
    """One group's values; `failed` marks (aligned) the rows that failed their bound."""

    label: str
    values: np.ndarray
    failed: np.ndarray
    color: str = _NORMAL

    @classmethod
    def of(cls, label: str, rows: pd.DataFrame, column: str = "error",
           color: str = _NORMAL) -> Category:
        return cls(label, rows[column].to_numpy(dtype="float64"),
                   (~rows["passed"]).to_numpy(dtype=bool), color)

    def drawable(self, scale: LogAxis) -> tuple[np.ndarray, np.ndarray]:
        """(values placed on the log axis, failed mask), NaN left out."""
        keep = ~np.isnan(self.values)
        return scale.clip(self.values[keep]), self.failed[keep]


@dataclass(frozen=True)
class LogAxis:
    """Where zeros and +inf are drawn on a log axis, and how many of each (and of NaN) there
    were."""

    floor: float
    ceiling: float
    zeros: int
    infs: int
    nans: int

    @classmethod
    def of(cls, arrays: Sequence[np.ndarray]) -> LogAxis:
        v = np.concatenate([np.asarray(a, dtype="float64") for a in arrays] or [np.zeros(0)])
        finite = v[np.isfinite(v)]
        positive = finite[finite > 0]
        top = math.ceil(math.log10(positive.max())) if positive.size else -11
        low = max(math.floor(math.log10(positive.min())), top - DECADES) - 1 if positive.size else -12
        floor = 10.0**low
        return cls(floor=floor, ceiling=10.0 ** (top + 1), zeros=int((finite <= floor).sum()),
                   infs=int(np.isinf(v).sum()), nans=int(np.isnan(v).sum()))

    def clip(self, values: np.ndarray) -> np.ndarray:
        v = np.asarray(values, dtype="float64")
        v = v[~np.isnan(v)]
        return np.clip(np.where(np.isposinf(v), self.ceiling, v), self.floor, self.ceiling)

    def mark(self, ax) -> None:
        """Label the floor and ceiling lines of a log y axis where something was drawn on them."""
        for used, y, text in self._lines():
            if used:
                ax.axhline(y, color="0.6", linestyle=":", linewidth=0.8)
                ax.annotate(text, (0, y), xycoords=("axes fraction", "data"), fontsize=7,
                            color="0.4", xytext=(2, 2), textcoords="offset points")

    def mark_x(self, ax) -> None:
        """The same for a log x axis."""
        for used, x, text in self._lines():
            if used:
                ax.axvline(x, color="0.6", linestyle=":", linewidth=0.8)
                ax.annotate(text, (x, 1), xycoords=("data", "axes fraction"), fontsize=7,
                            color="0.4", xytext=(2, -10), textcoords="offset points")

    def _lines(self) -> tuple[tuple[int, float, str], ...]:
        return ((self.zeros, self.floor, f"<= {self.floor:.0e}, 0 included (clipped)"),
                (self.infs, self.ceiling, "inf (clipped)"))

    def note(self, what: str) -> str:
        parts = []
        if self.zeros:
            parts.append(f"{self.zeros} zero values (or below {self.floor:.0e}) drawn at the floor {self.floor:.0e}")
        if self.infs:
            parts.append(f"{self.infs} inf drawn at the ceiling {self.ceiling:.0e}")
        if self.nans:
            parts.append(f"{self.nans} NaN not drawn")
        return f" {what}: {'; '.join(parts)}." if parts else ""


def _plain_log(axis) -> None:
    """Tick labels like 2e-03 on a log axis: no mathtext, whose parsing dominated render time;
    at most ~7 labelled decades, so wide ranges do not print labels over each other."""
    axis.set_major_locator(LogLocator(base=10, numticks=7))
    axis.set_major_formatter(LogFormatter(labelOnlyBase=False))
    axis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.4)))


def _figure(panels: int, width: float, height: float = 3.8, rows: int = 1) -> tuple[Figure, list]:
    """A figure of `rows` x `panels` axes, listed row by row."""
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, panels, squeeze=False).ravel()
    return fig, list(axes)


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


def _boxes(ax, categories: Sequence[Category], label: str, rng: np.random.Generator,
           empty: str = "no finite values", horizontal: bool = False) -> LogAxis:
    """Boxes (p25..p75, p50 line, whiskers min..p99, dots beyond p99) over a jittered strip of
    every value (failed rows red), on a log value axis; `empty` marks a category with nothing
    to draw. `horizontal`: one row per category, first on top (for many categories: the labels
    stay readable at any count)."""
    scale = LogAxis.of([c.values for c in categories])
    n = len(categories)
    slot = (lambda i: n - 1 - i) if horizontal else (lambda i: i)
    stats, positions, colors = [], [], []
    for i, c in enumerate(categories):
        v, failed = c.drawable(scale)
        if not v.size:
            at = ((0.03, slot(i)), ("axes fraction", "data")) if horizontal else ((slot(i), 0.03), ("data", "axes fraction"))
            ax.annotate(empty, at[0], xycoords=at[1], fontsize=7, color="0.4",
                        ha="left" if horizontal else "center", va="center" if horizontal else "bottom",
                        rotation=0 if horizontal else 90)
            continue
        p99 = quantile(v, 0.99)
        stats.append({"med": quantile(v, 0.5), "q1": quantile(v, 0.25), "q3": quantile(v, 0.75),
                      "whislo": float(v.min()), "whishi": p99, "fliers": v[v > p99]})
        positions.append(slot(i))
        colors.append(c.color)
        jitter = slot(i) + rng.uniform(-0.2, 0.2, v.size)
        xy = (lambda a, b: (b, a)) if horizontal else (lambda a, b: (a, b))
        ax.scatter(*xy(jitter[~failed], v[~failed]), s=8, color=c.color, alpha=0.45, linewidths=0, zorder=1)
        ax.scatter(*xy(jitter[failed], v[failed]), s=22, color=_FAILED, zorder=3,
                   label="failed" if failed.any() else None)
    if stats:
        drawn = ax.bxp(stats, positions=positions, widths=0.55, patch_artist=True,
                       manage_ticks=False, medianprops={"color": "black", "linewidth": 1.6},
                       flierprops={"marker": "o", "markersize": 3, "markerfacecolor": "black"},
                       zorder=2, **(_HORIZONTAL if horizontal else {}))
        for box, color in zip(drawn["boxes"], colors, strict=True):
            box.set_edgecolor(color)
            box.set_facecolor((*to_rgb(color), 0.12))
            box.set_linewidth(1.4)
    labels = [c.label for c in categories]
    if horizontal:
        ax.set_xscale("log")
        _plain_log(ax.xaxis)
        ax.set_yticks(range(n))
        ax.set_yticklabels(labels[::-1], fontsize=7)
        ax.set_ylim(-0.6, n - 0.4)
        ax.set_xlabel(label)
        ax.grid(axis="x", which="major", alpha=0.3)
        scale.mark_x(ax)
        return scale
    ax.set_yscale("log")
    _plain_log(ax.yaxis)
    ax.set_xticks(range(n))
    tilt = n > 3
    ax.set_xticklabels(labels, rotation=35 if tilt else 0, ha="right" if tilt else "center", fontsize=8)
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_ylabel(label)
    ax.grid(axis="y", which="major", alpha=0.3)
    scale.mark(ax)
    return scale


def _legend(ax, **kwargs) -> None:
    """A legend with one entry per label (every category with failures labels its red dots)."""
    entries = dict(zip(*reversed(ax.get_legend_handles_labels())))
    if "failed" in entries:                # last, after the categories
        entries["failed"] = entries.pop("failed")
    if entries:
        ax.legend(entries.values(), entries.keys(), fontsize=7, loc="best", **kwargs)


def _path_categories(frame: pd.DataFrame) -> list[Category]:
    """One category per (op, path, impl, deviation): the tables' groups for one tensor kind."""
    out = []
    for (op, path, impl, deviation), g in grouped(frame, ("op", "path", "impl", "deviation")):
        label = f"{op if op == path else path} · {impl}" + (" †" if deviation else "")
        out.append(Category.of(label, g, color=_DEVIATION if deviation else _NORMAL))
    return out


def _knob_categories(frame: pd.DataFrame, knob: str) -> list[Category]:
    return [Category.of(str(value), g) for (value,), g in grouped(frame, (knob,))]


def _panels(frame: pd.DataFrame, kinds: Sequence[str]) -> list[tuple[str, str, pd.DataFrame]]:
    """(kind, axis label, rows) for each kind that has rows."""
    return [(k, f"{k} {frame.loc[frame['kind'] == k, 'metric'].iloc[0]}", frame[frame["kind"] == k])
            for k in kinds if (frame["kind"] == k).any()]


_BOX_NOTE = "Box p25..p75, black line p50, whisker top p99, dots above it beyond p99; red: failed."


def error_by_path(frame: pd.DataFrame) -> Plot | None:
    panels = _panels(frame, ("out", "lse"))
    if not panels:
        return None
    cats = [_path_categories(rows) for _, _, rows in panels]
    fig, axes = _figure(len(panels), 6.5 * len(panels), 0.3 * max(map(len, cats)) + 1.4)
    rng = np.random.default_rng(0)
    notes = ""
    for ax, c, (kind, label, _) in zip(axes, cats, panels, strict=True):
        notes += _boxes(ax, c, label, rng, horizontal=True).note(label)
        ax.set_title(f"{kind}: per path · impl")
        _legend(ax)
    caption = ("Key error per path and implementation: the groups of the path and deviation "
               "tables. Blue: held to the default bound; orange †: held to a documented "
               f"deviation's wider bound (expected). {_BOX_NOTE}" + notes)
    return Plot("plot-path", "groups", "Error per path", caption, _png(fig))


def error_vs_knob(frame: pd.DataFrame, knob: str, title: str) -> Plot | None:
    main = frame[~expected(frame) & frame[knob].notna()]
    panels = _panels(main, ("out", "lse"))
    if not panels:
        return None
    fig, axes = _figure(len(panels), max(7.0, 4.0 * len(panels)))
    rng = np.random.default_rng(0)
    notes = ""
    for ax, (kind, label, rows) in zip(axes, panels, strict=True):
        notes += _boxes(ax, _knob_categories(rows, knob), label, rng).note(label)
        ax.set_title(f"{kind} by {knob}")
        ax.set_xlabel(knob)
        _legend(ax)
    caption = (f"Key error by {knob}: the {knob} table's out and lse rows (no deviations; ops "
               f"without a {knob} left out). {_BOX_NOTE}" + notes)
    return Plot(f"plot-{knob}", f"knob-{knob}", title, caption, _png(fig))


def error_vs_magnitude(frame: pd.DataFrame) -> Plot | None:
    """Left: out rel_l2 against the reference's rms, colored by value regime. Right: the same
    rows per value regime (the value_regime table's out rows)."""
    rows = frame[~expected(frame) & (frame["kind"] == "out")]
    if rows.empty:
        return None
    fig, (left, right) = _figure(2, 12.0)
    regimes = [(str(r), g) for (r,), g in grouped(rows, ("value_regime",))]
    if rows["value_regime"].isna().any():
        regimes.append(("(none)", rows[rows["value_regime"].isna()]))
    cats = [Category.of(r, g, color=_PALETTE[i % len(_PALETTE)])
            for i, (r, g) in enumerate(regimes)]
    rms = LogAxis.of([rows["ref_rms"].to_numpy(dtype="float64")])
    err = LogAxis.of([c.values for c in cats])
    for c, (_, g) in zip(cats, regimes, strict=True):
        keep = ~(np.isnan(c.values) | g["ref_rms"].isna().to_numpy())
        x, y = rms.clip(g["ref_rms"].to_numpy(dtype="float64")[keep]), err.clip(c.values[keep])
        left.scatter(x, y, s=9, alpha=0.6, color=c.color, label=c.label, linewidths=0)
        failed = c.failed[keep]
        left.scatter(x[failed], y[failed], s=40, facecolors="none", edgecolors=_FAILED,
                     label="failed" if failed.any() else None)
    left.set_xscale("log")
    left.set_yscale("log")
    _plain_log(left.xaxis)
    _plain_log(left.yaxis)
    left.set_xlabel("ref_rms (magnitude of the reference)")
    left.set_ylabel("out rel_l2")
    left.set_title("out error against value magnitude")
    left.grid(alpha=0.3)
    _legend(left, title="value_regime", title_fontsize=7)
    err.mark(left)
    box_scale = _boxes(right, cats, "out rel_l2", np.random.default_rng(0))
    right.set_title("out by value_regime")
    _legend(right)
    caption = ("out rel_l2 against the magnitude of the reference (ref_rms), and per value regime: "
               f"the value_regime table's out rows (no deviations). {_BOX_NOTE}"
               + rms.note("ref_rms") + box_scale.note("out rel_l2"))
    return Plot("plot-magnitude", "knob-value_regime", "Error against value magnitude", caption,
                _png(fig))


def stat_histograms(frame: pd.DataFrame) -> Plot | None:
    """lse and max_logits max_abs: one histogram row per (path, impl, deviation) group on a
    shared log axis, each row scaled to its own peak; failed rows red; a tick at the p99."""
    panels = _panels(frame, ("lse", "max_logits"))
    if not panels:
        return None
    cats = [_path_categories(rows) for _, _, rows in panels]
    fig, axes = _figure(len(panels), 6.5 * len(panels), 0.42 * max(map(len, cats)) + 1.4)
    notes = ""
    rng = np.random.default_rng(0)
    for ax, group, (kind, label, _) in zip(axes, cats, panels, strict=True):
        scale = LogAxis.of([c.values for c in group])
        drawn = np.concatenate([c.drawable(scale)[0] for c in group])
        lo, hi = ((math.log10(drawn.min()), math.log10(drawn.max())) if drawn.size
                  else (math.log10(scale.floor), math.log10(scale.ceiling)))
        bins = np.logspace(lo - 0.05, hi + 0.05, 31)
        for row, c in enumerate(group):
            y = len(group) - 1 - row          # first group on top, as in the tables
            v, failed = c.drawable(scale)
            if v.size >= HISTOGRAM_MIN:
                every, _ = np.histogram(v, bins)
                bad, _ = np.histogram(v[failed], bins)
                height = 0.85 / max(int(every.max(initial=0)), 1)
                ax.stairs(y + every * height, bins, baseline=y, fill=True, color=c.color, alpha=0.85)
                if bad.any():
                    ax.stairs(y + bad * height, bins, baseline=y, fill=True, color=_FAILED)
            else:  # a histogram of a few values is a few full-height bars: one dot each instead
                jitter = y + 0.2 + rng.uniform(0, 0.5, v.size)
                ax.scatter(v[~failed], jitter[~failed], s=14, color=c.color, alpha=0.8, linewidths=0)
                ax.scatter(v[failed], jitter[failed], s=24, color=_FAILED, linewidths=0)
            if v.size:
                ax.vlines(quantile(v, 0.99), y, y + 0.9, color="black", linestyle="--",
                          linewidth=1.0)
        ax.set_yticks(np.arange(len(group)) + 0.4)
        ax.set_yticklabels([f"{c.label} (n={int((~np.isnan(c.values)).sum())})"
                            for c in reversed(group)], fontsize=7)
        ax.set_ylim(-0.1, len(group))
        ax.set_xscale("log")
        _plain_log(ax.xaxis)
        ax.set_xlabel(label)
        ax.grid(axis="x", alpha=0.3)
        ax.set_title(f"{kind} error per path · impl")
        scale.mark_x(ax)
        notes += scale.note(label)
    caption = ("Max |error| of the softmax statistics over finite positions, one histogram per "
               "path · impl (the groups of the path and deviation tables; orange †: a documented "
               f"deviation), each scaled to its own peak; a group of fewer than {HISTOGRAM_MIN} rows, one dot "
               "per row; dashed: the group's p99 as in the tables; red: failed rows." + notes)
    return Plot("plot-lse", "groups", "LSE error histograms", caption, _png(fig))


def headroom_by_path(frame: pd.DataFrame) -> Plot | None:
    """bound / value per path over every gated row; the red line is the bound (headroom 1).
    Rows with value 0 (infinite headroom: exact matches) are counted in the labels, not drawn."""
    gated = frame[frame["headroom"].notna()]
    if gated.empty:
        return None
    cats = []
    for (path,), g in grouped(gated, ("path",)):
        infinite = np.isinf(g["headroom"]).to_numpy()
        label = f"{path} (∞ ×{infinite.sum()})" if infinite.any() else str(path)
        cats.append(Category.of(label, g[~infinite], "headroom"))
    fig, (ax,) = _figure(1, 8.0, 0.3 * len(cats) + 1.4)
    scale = _boxes(ax, cats, "headroom = bound / value", np.random.default_rng(0),
                   empty="all exact: ∞", horizontal=True)
    ax.axvline(1.0, color=_FAILED, linestyle="--", linewidth=1.2, label="bound (headroom 1)")
    _legend(ax)
    ax.set_title("headroom per path (left of the red line fails)")
    caption = ("Headroom of the gated metric closest to its bound, per path, all tensors and "
               "implementations together (the terminal summary's grouping). "
               f"{_BOX_NOTE} A row whose value is 0 (an exact match) has infinite headroom: "
               "counted as ∞ ×n in its label, not drawn." + scale.note("headroom"))
    return Plot("plot-headroom", "groups", "Headroom per path", caption, _png(fig))


def figures(frame: pd.DataFrame) -> list[Plot]:
    """Every figure that has rows to draw, in report order (frame from `kinds.annotate`)."""
    made = (
        error_by_path(frame),
        stat_histograms(frame),
        headroom_by_path(frame),
        error_vs_knob(frame, "topk", "Error against topk"),
        error_vs_magnitude(frame),
    )
    return [p for p in made if p is not None]
