"""Baseline drift: did a kernel, or a new version of it, move away from the exact answer?

Rows of the two runs meet in groups (op, path, tensor, paired implementations, deviation; see
`reports.pairing`), and each group is judged on the drift metrics of its tensor kind
(`equivalence.judge.policy.DRIFT_METRICS`: error in rounding units, |bias|, share of the bound used),
every value first raised to the metric's floor so that rounding residue never makes a ratio:

  paired     (the group shares cases with the baseline: a run that re-drew the baseline's seed,
             or the regression corpus) per shared case, ratio = new / old; drift when the median
             ratio exceeds the factor. The worst ratio and its case are reported. Sampling noise
             cancels: each case meets itself. The cases of one run only, where each run has
             `min_cases` of them (a reseeded run meets the baseline on a few cases), are judged
             unpaired besides, and each metric keeps the louder finding (`louder`).
  unpaired   (no shared case, at least `min_cases` on each side) a one-sided rank test
             (`reports.significance.exceeds`) of new > factor x old at the confidence level; the
             p99 ratio is shown.
  too few cases to judge   unpaired with fewer cases on a side: not judged, counted.

A group whose cases mostly went uncompared (unshared, and too few for the tail test of
`reports.words` to compare their tails) and that found nothing reads `not comparable`, with the
reason (`uncompared`), never `unchanged`.

Within the factor, each metric is judged worse or better too (`reports.words`: the median and
the upper tail of the ratios, each by a test at the confidence), and each group gets one word:
drifted, worse, unchanged or better. Only drifted fails the run, unless asked (fail_on="worse").

A value that was 0 in the baseline (bitwise equal) and is not any more is its own finding, "no
longer bitwise" (paired: any such case; unpaired: Fisher's exact test). A group that fails now
and did not is "new failures". The reverse tests report improvements, which never fail the run.
Raw max_abs is shown (its p99 on each side) and never judged: it tracks the cases' scales.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pandas as pd

from mla_verify.equivalence.judge.policy import (
    DRIFT_CONFIDENCE,
    DRIFT_FACTOR,
    DRIFT_MIN_CASES,
    WORSE_TAIL,
    BiasMetric,
    DriftMetric,
    bias_metrics,
    drift_metrics,
)
from mla_verify.equivalence.sandbox.device import device_type
from mla_verify.reports import judge
from mla_verify.reports.bias import signed
from mla_verify.reports.fmt import number
from mla_verify.reports.kinds import annotate
from mla_verify.reports.pairing import (NothingComparable, pair_implementations, unpaired_implementations,
                                        with_partner)
from mla_verify.reports.stats import grouped, quantile
from mla_verify.reports.judge import DRIFT, IMPROVED, NOT_BITWISE
from mla_verify.reports.words import (BETTER, DRIFTED, NOT_COMPARABLE, UNCHANGED, WORSE, group_word, tail_cases,
                                      tails_compared)

GROUP_KEYS: tuple[str, ...] = ("op", "path", "tensor", "impl", "base_impl", "deviation", "kind")
NEW_FAILURES = "new failures"
FLAGS = (DRIFT, NOT_BITWISE, NEW_FAILURES)        # findings that fail the run
PAIRED, UNPAIRED, TOO_FEW, NEW, GONE = "paired", "unpaired", "too few cases to judge", "new", "gone"

METRIC_COLUMNS: tuple[str, ...] = (
    *GROUP_KEYS, "metric", "mode", "base_cases", "cur_cases", "paired_cases",
    "base_p50", "cur_p50", "base_p99", "cur_p99", "ratio", "worst_ratio", "worst_case", "p_value",
    "bitwise_lost", "base_mean", "cur_mean", "shift", "shift_ci", "floor", "finding",
    "p90_ratio", "moved_up", "moved_down", "p_moved", "moved_by",
)
GROUP_COLUMNS: tuple[str, ...] = (
    *GROUP_KEYS, "word", "mode", "base_cases", "cur_cases", "paired_cases", "base_failed", "cur_failed",
    "finding", "metric", "ratio", "worst_ratio", "worst_case", "shift", "base_max_abs_p99", "cur_max_abs_p99",
    "uncompared",
)


def group_label(op: str, path: str, tensor: str, impl: str, base_impl: str | None = None,
                deviation: str = "", *_: object, sep: str = " ") -> str:
    """"forward_mqa/fp8_mixed out [pipeline]" ("[v2 vs v1]" across names; plus the deviation); `sep`
    before the implementation (a figure's title breaks the line there)."""
    where = op if op == path else f"{op}/{path}"
    who = impl if base_impl in (None, impl) else f"{impl} vs {base_impl}"
    dev = f" (deviation: {deviation})" if deviation else ""
    return f"{where} {tensor}{sep}[{who}]{dev}"


@dataclass(frozen=True)
class DriftSettings:
    """How a run is held against its baseline (`compare`'s keywords; the CLI's --factor,
    --confidence, --min-cases, --pair and --fail-on); defaults from equivalence.judge.policy."""

    factor: float = DRIFT_FACTOR
    confidence: float = DRIFT_CONFIDENCE
    min_cases: int = DRIFT_MIN_CASES
    pairs: Mapping[str, str] | None = None
    fail_on: str = DRIFTED

    def compare(self, current: pd.DataFrame, baseline: pd.DataFrame) -> Drift:
        """`compare` with these settings."""
        return compare(current, baseline, factor=self.factor, confidence=self.confidence, min_cases=self.min_cases,
                       pairs=self.pairs, fail_on=self.fail_on)


def measured(rows: pd.DataFrame) -> pd.DataFrame:
    """Annotated rows plus the drift metrics that are not stored columns: abs_bias = |mean_err|,
    bound_use = value / bound of the least-headroom metric (1 / headroom; 0 for an exact match)."""
    out = annotate(rows)
    out["abs_bias"] = out["mean_err"].abs()
    with np.errstate(divide="ignore"):
        out["bound_use"] = 1.0 / out["headroom"].to_numpy(dtype="float64")
    return out


@dataclass(frozen=True)
class Worst:
    """The case that drifted most: what to print and what replays it."""

    label: str
    metric: str
    ratio: float
    case_id: str
    case: str               # the Case as JSON ("" for runs stored before rows carried it)
    impl_specs: tuple[str, ...]
    device: str
    shift: float = np.nan   # a bias metric's: the group's shift of the mean (its ratio is NaN)

    def what(self) -> str:
        """"abs_bias x8.89", or for a bias metric "gain shift +5.3e-04"."""
        return f"{self.metric} x{number(self.ratio)}" if np.isfinite(self.ratio) else f"{self.metric} shift {signed(self.shift)}"


def _aligned(cur: pd.DataFrame, base: pd.DataFrame, name: str) -> tuple[np.ndarray, np.ndarray, pd.Series]:
    """(new, old, case_id) of the cases both runs measured `name` on."""
    both = cur[["case_id", name]].merge(base[["case_id", name]], on="case_id", suffixes=("", "_base")).dropna()
    return (both[name].to_numpy(dtype="float64"), both[f"{name}_base"].to_numpy(dtype="float64"),
            both["case_id"])


def _judge(m: DriftMetric | BiasMetric, floor: float, cur: pd.DataFrame, base: pd.DataFrame, mode: str,
           factor: float, confidence: float, tail_tests: int) -> dict:
    """`reports.judge` of one metric of a group's two sides; the case that moved most by its id."""
    if mode == PAIRED:
        new, old, cases = _aligned(cur, base, m.name)
    else:
        kept = cur[m.name].notna()
        new, old = cur.loc[kept, m.name].to_numpy(dtype="float64"), base[m.name].dropna().to_numpy(dtype="float64")
        cases = cur.loc[kept, "case_id"]
    rec = judge.metric(new, old, floor, is_signed=isinstance(m, BiasMetric), is_paired=mode == PAIRED,
                       judged=mode in (PAIRED, UNPAIRED), factor=factor, confidence=confidence, tail_tests=tail_tests)
    at = rec.pop("worst_at")
    rec["worst_case"] = cases.iloc[at] if at is not None else ""
    return rec


def judged_parts(shared: int, cur: int, base: int, min_cases: int) -> tuple[str, bool]:
    """A group's mode (PAIRED where the runs share cases, else UNPAIRED with at least `min_cases` a
    side, else TOO_FEW), and whether the cases of one run only, besides the shared ones, are judged
    unpaired too (at least `min_cases` a side): a reseeded run meets the baseline on a few cases only."""
    rest = shared > 0 and min(cur - shared, base - shared) >= min_cases
    return (PAIRED if shared else UNPAIRED if min(cur, base) >= min_cases else TOO_FEW), rest


def uncompared(shared: int, cur: int, base: int, mode: str, rest: bool, tail_alpha: float) -> str:
    """Why a group's cases were mostly not compared, or "": the shared cases, and the unshared ones
    where the tail test can compare their tails (`words.tails_compared`), are at least half the run's."""
    own_cur, own_base = cur - shared, base - shared
    tails = (mode == UNPAIRED or rest) and tails_compared(own_cur, own_base, tail_alpha)
    if mode == TOO_FEW or 2 * (shared + (own_cur if tails else 0)) >= cur:
        return ""
    return (f"seeds differ: {shared} of {cur} cases shared, the other {own_cur} + {own_base} too few to compare "
            f"their tails (the tail test needs {tail_cases(tail_alpha)} a side); re-draw the earlier run's cases "
            "(--baseline) to pair them")


_LOUDNESS = {DRIFT: 0, NOT_BITWISE: 0, WORSE: 1, IMPROVED: 2, BETTER: 2}


def louder(records: list[dict]) -> dict:
    """Of one metric's judgements (the shared cases', the unshared ones'), the one whose finding says
    most (drift first, then worse, then an improvement); the first where none found anything."""
    return min(records, key=lambda r: _LOUDNESS.get(r["finding"], 3))


def _group_metrics(key: tuple, cur: pd.DataFrame, base: pd.DataFrame, min_cases: int, factor: float,
                   confidence: float) -> tuple[list[dict], str, int, str]:
    """The metric records of a group both runs hold (METRIC_COLUMNS): judged on the shared cases, and
    on the cases of one run only where there are enough (`judged_parts`), the louder kept; with the
    group's mode, shared cases and `uncompared`."""
    kind = key[GROUP_KEYS.index("kind")]
    shared = int(cur["case_id"].isin(base["case_id"]).sum())
    mode, rest = judged_parts(shared, len(cur), len(base), min_cases)
    sides = [(mode, cur, base, shared)]
    if rest:
        sides.append((UNPAIRED, cur[~cur["case_id"].isin(base["case_id"])], base[~base["case_id"].isin(cur["case_id"])], 0))
    tail_tests = len(drift_metrics(kind))
    records = []
    for m in (*drift_metrics(kind), *bias_metrics(kind)):
        if isinstance(m, BiasMetric) and not (cur[m.name].notna().any() and base[m.name].notna().any()):
            continue   # rows stored before the metric existed lack it
        records.append(louder([{**dict(zip(GROUP_KEYS, key, strict=True)), "metric": m.name, "mode": part,
                                "base_cases": len(b), "cur_cases": len(c), "paired_cases": n, "floor": m.floors[kind],
                                **_judge(m, m.floors[kind], c, b, part, factor, confidence, tail_tests)}
                               for part, c, b, n in sides]))
    why = uncompared(shared, len(cur), len(base), mode, rest, (1.0 - confidence) / tail_tests)
    return records, mode, shared, why


def _group_record(key: tuple, cur: pd.DataFrame | None, base: pd.DataFrame | None, metrics: list[dict],
                  mode: str, shared: int, why: str) -> dict:
    def failed(frame):
        return int((~frame["passed"]).sum()) if frame is not None else 0

    def max_abs_p99(frame):
        return quantile(frame["max_abs"], 0.99) if frame is not None else np.nan

    rec = dict(zip(GROUP_KEYS, key, strict=True))
    rec.update(base_cases=0 if base is None else base["case_id"].nunique(),
               cur_cases=0 if cur is None else cur["case_id"].nunique(),
               base_failed=failed(base), cur_failed=failed(cur),
               base_max_abs_p99=max_abs_p99(base), cur_max_abs_p99=max_abs_p99(cur))
    rec["mode"], rec["paired_cases"] = mode, shared
    new_failures = bool(rec["cur_failed"] and not rec["base_failed"] and cur is not None)
    return {**rec, **group_verdict(metrics, rec["mode"], new_failures, why)}


def group_verdict(metrics: list[dict], mode: str, new_failures: bool, why: str = "") -> dict:
    """A group's finding (the flags and "improved", joined), its word, and the metric that speaks for
    it (its worst flagged one, else its worst worse one, else its largest ratio), from its metrics'
    records (METRIC_COLUMNS); `why` (`uncompared`) makes a group with no finding NOT_COMPARABLE, and is
    kept as its `uncompared` where it does."""
    findings = [f for f in (NOT_BITWISE, DRIFT, IMPROVED) if any(m["finding"] == f for m in metrics)]
    if new_failures:
        findings.insert(0, NEW_FAILURES)
    within = [f for f in (WORSE, BETTER) if any(m["finding"] == f for m in metrics)]
    word = group_word(findings + within, FLAGS, IMPROVED, mode in (PAIRED, UNPAIRED), why) or mode
    rec = {"finding": ", ".join(findings), "word": word, "uncompared": why if word == NOT_COMPARABLE else ""}
    flagged = ([m for m in metrics if m["finding"] in FLAGS] or [m for m in metrics if m["finding"] == WORSE]
               or [m for m in metrics if m["finding"]] or metrics)
    top = max(flagged, key=lambda m: -np.inf if np.isnan(m["worst_ratio"]) else m["worst_ratio"], default=None)
    for col in ("metric", "ratio", "worst_ratio", "worst_case", "shift"):
        rec[col] = top.get(col, np.nan) if top else ("" if col in ("metric", "worst_case") else np.nan)
    return rec


@dataclass(frozen=True)
class Drift:
    """The drift of a run against a baseline: one row per group (GROUP_COLUMNS) and one per group
    and metric (METRIC_COLUMNS), the implementation pairs, and the settings that judged them."""

    groups: pd.DataFrame
    metrics: pd.DataFrame
    pairs: pd.DataFrame                   # reports.pairing.PAIR_COLUMNS
    unpaired: tuple[list[str], list[str]]  # implementations compared with nothing (run, baseline)
    factor: float
    confidence: float
    min_cases: int
    worst: Worst | None
    cur_rows: pd.DataFrame                # both runs' rows of paired implementations (`measured`,
    base_rows: pd.DataFrame               # with base_impl): what the drift figure draws
    fail_on: str = DRIFTED                # the word that fails the run: drifted, or worse (and drifted)

    @property
    def flagged(self) -> pd.DataFrame:
        """The groups with a finding of FLAGS: their word is drifted (`_group_record`)."""
        return self.word(DRIFTED)

    @property
    def improvements(self) -> pd.DataFrame:
        """The groups that improved and are not flagged: improved is then their one finding."""
        return self.groups[(self.groups["word"] != DRIFTED) & (self.groups["finding"] == IMPROVED)]

    def mode(self, mode: str) -> pd.DataFrame:
        return self.groups[self.groups["mode"] == mode]

    def word(self, word: str) -> pd.DataFrame:
        return self.groups[self.groups["word"] == word]

    @property
    def drifted(self) -> bool:
        return not self.flagged.empty

    @property
    def failed(self) -> bool:
        """Drifted, or (fail_on="worse") worse."""
        return self.drifted or (self.fail_on == WORSE and not self.word(WORSE).empty)

    @property
    def exit_code(self) -> int:
        """0: nothing that fails (worse is reported, and fails only with fail_on="worse"), 1: drift."""
        return int(self.failed)

    @property
    def settings(self) -> str:
        return f"factor {self.factor:g}, confidence {self.confidence:g}, min {self.min_cases} cases"

    @property
    def compared(self) -> int:
        """Groups compared with the baseline, paired or unpaired (0: nothing was: no verdict)."""
        return len(self.mode(PAIRED)) + len(self.mode(UNPAIRED))

    @property
    def verdict(self) -> str:
        paired, unpaired = len(self.mode(PAIRED)), len(self.mode(UNPAIRED))
        compared = paired + unpaired
        skipped = [f"{n} {what}" for what, n in ((TOO_FEW, len(self.mode(TOO_FEW))), ("new", len(self.mode(NEW))),
                                                  ("gone", len(self.mode(GONE)))) if n]
        counts = f"{paired} paired, {unpaired} unpaired" + (f"; not compared: {', '.join(skipped)}" if skipped else "")
        words = ", ".join(f"{len(self.word(w))} {w}" for w in (DRIFTED, WORSE, UNCHANGED, BETTER, NOT_COMPARABLE)
                          if len(self.word(w)))
        n, worse = len(self.flagged), len(self.word(WORSE))
        head = (f"DRIFT in {n} group{'s' * (n != 1)}, {compared} compared" if self.drifted
                else f"WORSE in {worse} group{'s' * (worse != 1)} within the factor, {compared} compared"
                if worse else f"no drift in {compared} groups compared" if compared
                else "NO VERDICT: nothing compared with the baseline")
        return f"{head} ({counts}; {words or 'no group compared'}; {self.settings})"

    def pairing_line(self) -> str:
        across = self.pairs[self.pairs["how"] != "same name"]
        same = len(self.pairs) - len(across)
        parts = [f"{same} by the same name"] if same else []
        parts += [f"{r.op}: {r.impl} with {r.base_impl} ({r.how})" for r in across.itertuples()]
        return "implementations paired: " + "; ".join(parts)

    def lines(self, replay: str | None = None) -> list[str]:
        """The verdict, one line per flagged group, the case that drifted most (with `replay`, its
        command), then the context (`context_lines`)."""
        out = [f"baseline drift: {self.verdict}"]
        out += [f"  {g['finding'].upper()} {group_label(*(g[k] for k in GROUP_KEYS))}: {self.explain(g)}"
                for _, g in self.flagged.iterrows()]
        out += [f"  {g['word']}: {self.headline(g)} ({group_label(*(g[k] for k in GROUP_KEYS))}"
                + (f"; {self.explain(g)})" if g["word"] == WORSE else ")")
                for _, g in self.groups.iterrows() if g["word"] in (DRIFTED, WORSE)]
        if self.worst is not None:
            out.append(f"  {self.worst_line(replay)}")
        return out + [f"  {line}" for line in self.context_lines()]

    def worst_line(self, replay: str | None = None) -> str:
        w = self.worst
        return (f"{'drifted most' if self.drifted else 'moved most'}: case {w.case_id} of {w.label}, {w.what()}"
                + (f": {replay}" if replay else ""))

    def context_lines(self) -> list[str]:
        """How implementations were paired, improvements, and what was not compared, and why."""
        out = [self.pairing_line()]
        out += [f"improved {group_label(*(g[k] for k in GROUP_KEYS))}: {self.explain(g)}"
                for _, g in self.improvements.iterrows()]
        out += [f"better: {self.headline(g)} ({group_label(*(g[k] for k in GROUP_KEYS))}; {self.explain(g)})"
                for i, g in self.word(BETTER).iterrows() if i not in self.improvements.index]
        apart = self.word(NOT_COMPARABLE)
        if not apart.empty:   # one line, however many: each group's reason is in its row (the HTML's table)
            first = apart.iloc[0]
            names = ", ".join(group_label(*(g[k] for k in GROUP_KEYS)) for _, g in apart.head(3).iterrows())
            out.append(f"{NOT_COMPARABLE}: {len(apart)} group{'s' * (len(apart) != 1)} ({names}"
                       f"{', ...' if len(apart) > 3 else ''}); the first: {first['uncompared']}")
        too_few = self.mode(TOO_FEW)
        if not too_few.empty:
            out.append(f"{TOO_FEW}: {len(too_few)} groups share no case with the baseline and hold fewer than "
                       f"{self.min_cases} cases on a side (cases pair when both runs drew them: the baseline's "
                       "seed and profile under the same draws; after the draws changed, more examples a side)")
        for tag, mode in (("appeared", NEW), ("disappeared", GONE)):
            rows = self.mode(mode)
            if not rows.empty:
                out.append(f"{tag}: " + ", ".join(group_label(*(r[k] for k in GROUP_KEYS)) for _, r in rows.iterrows()))
        for side, names in zip(("run", "baseline"), self.unpaired, strict=True):
            if names:
                out.append(f"compared with nothing ({side}; pair them with --pair NEW=OLD): {', '.join(names)}")
        return out

    def _metrics_of(self, g: pd.Series) -> pd.DataFrame:
        key = tuple(g[k] for k in GROUP_KEYS)
        return self.metrics[self.metrics[list(GROUP_KEYS)].apply(tuple, axis=1) == key]

    def headline(self, g: pd.Series) -> str:
        """The numbers behind a group's word (`headline`)."""
        return headline(g, self._metrics_of(g))

    def explain(self, g: pd.Series) -> str:
        """What a group's findings rest on, metric by metric."""
        mine = self._metrics_of(g)
        parts = [] if NEW_FAILURES not in g["finding"] else [
            f"{int(g['cur_failed'])} failed row{'s' * (g['cur_failed'] != 1)}, none in the baseline"]
        own = ", of one run only" if g["mode"] == PAIRED else ""   # a paired group's unshared cases
        for _, m in mine[mine["finding"] != ""].iterrows():
            if np.isfinite(m["shift"]):
                over = (f"{int(m['paired_cases'])} paired cases" if m["mode"] == PAIRED
                        else f"{int(m['base_cases'])} vs {int(m['cur_cases'])} cases, Welch")
                parts.append(f"{m['metric']} shift {signed(m['shift'])} ± {number(m['shift_ci'])} (t interval at "
                             f"{self.confidence:g}) over {over}, floor {number(m['floor'])} (mean "
                             f"{signed(m['base_mean'])} -> {signed(m['cur_mean'])})")
            elif m["finding"] == NOT_BITWISE:
                parts.append(f"{m['metric']} was 0 (bitwise) and is not in {int(m['bitwise_lost'])} of "
                             f"{int(m['paired_cases'] or m['cur_cases'])} cases")
            elif m["finding"] in (WORSE, BETTER) and m["mode"] == PAIRED:
                parts.append(f"{m['metric']} median x{number(m['ratio'])}, p90 x{number(m['p90_ratio'])} over "
                             f"{int(m['paired_cases'])} paired cases, {int(m['moved_up'])} up by x{WORSE_TAIL:g} or "
                             f"more and {int(m['moved_down'])} down (p = {number(m['p_moved'])}, the median's or the tail's sign test)")
            elif m["finding"] in (WORSE, BETTER):
                parts.append(f"{m['metric']} p99 {number(m['base_p99'])} -> {number(m['cur_p99'])}, p90 "
                             f"x{number(m['p90_ratio'])} ({m['moved_by']} p = {number(m['p_moved'])}, "
                             f"{int(m['base_cases'])} vs {int(m['cur_cases'])} cases{own})")
            elif m["mode"] == PAIRED:
                parts.append(f"{m['metric']} median x{number(m['ratio'])} over {int(m['paired_cases'])} paired cases "
                             f"(worst x{number(m['worst_ratio'])}, case {m['worst_case']})")
            else:
                parts.append(f"{m['metric']} p99 {number(m['base_p99'])} -> {number(m['cur_p99'])} "
                             f"(x{number(m['ratio'])}, rank test p = {number(m['p_value'])}, "
                             f"{int(m['base_cases'])} vs {int(m['cur_cases'])} cases{own})")
        return "; ".join(parts)


def headline(g: pd.Series, mine: pd.DataFrame) -> str:
    """The numbers behind a group's word (`g`: its GROUP_COLUMNS; `mine`: its METRIC_COLUMNS rows):
    "out bf16_units p99 1 -> 1.94 (x1.94), median x1.07, abs_bias p90 x10.7": the first metric that
    moved it (one beyond the factor first) in full, then the others (`_numbers`)."""
    against = (IMPROVED, BETTER) if g["word"] in (DRIFTED, WORSE) else (DRIFT, NOT_BITWISE, WORSE)
    moved = mine[(mine["finding"] != "") & ~mine["finding"].isin(against)]
    moved = moved.iloc[np.argsort(~moved["finding"].isin(FLAGS).to_numpy(), kind="stable")]
    moved = moved if len(moved) else mine[mine["metric"] == g["metric"]]
    if moved.empty:
        return str(g["tensor"])
    return ", ".join([f"{g['tensor']} {_numbers(moved.iloc[0])}",
                      *(_numbers(m, short=True) for _, m in moved.iloc[1:].iterrows())])


def _numbers(m: pd.Series, short: bool = False) -> str:
    """A metric's move: "bf16_units p99 1 -> 1.94 (x1.94), median x1.07" (p99s raised to the floor;
    short: "abs_bias p90 x10.7", the per-case ratios' p90, or their median where it drifted); a bias
    metric's: its shift."""
    if np.isfinite(m["shift"]):
        return f"{m['metric']} shift {signed(m['shift'])}" + (
            "" if short else f" (mean {signed(m['base_mean'])} -> {signed(m['cur_mean'])})")
    with np.errstate(divide="ignore", invalid="ignore"):
        p99 = np.float64(max(m["cur_p99"], m["floor"])) / np.float64(max(m["base_p99"], m["floor"]))
    if short:   # the statistic its finding rests on: paired, the median beyond the factor, else the tail's p90
        if m["mode"] != PAIRED:
            return f"{m['metric']} p99 x{number(p99)}"
        return (f"{m['metric']} median x{number(m['ratio'])}" if m["finding"] in FLAGS
                else f"{m['metric']} p90 x{number(m['p90_ratio'])}")
    median = (f"median x{number(m['ratio'])}" if m["mode"] == PAIRED
              else f"median {number(m['base_p50'])} -> {number(m['cur_p50'])}")
    return f"{m['metric']} p99 {number(m['base_p99'])} -> {number(m['cur_p99'])} (x{number(p99)}), {median}"


def replay_specs(row: pd.Series) -> tuple[str, ...]:
    """The --impl specs that rerun a row's implementation: a pipeline's stages, else its name."""
    if row["op"] != "property" and row["stages"]:
        return tuple(f"{stage}={impl}" for stage, impl in row["stages"])
    return (row["impl"],)


def _worst(groups: pd.DataFrame, cur: pd.DataFrame) -> Worst | None:
    flagged = groups[(groups["word"] == DRIFTED) & (groups["worst_case"] != "")]
    if flagged.empty:   # nothing drifted: the case of a group that got worse
        flagged = groups[(groups["word"] == WORSE) & (groups["worst_case"] != "")]
    if flagged.empty:
        return None
    g = flagged.loc[flagged["worst_ratio"].fillna(-np.inf).idxmax()]
    row = cur[(cur["case_id"] == g["worst_case"]) & (cur["op"] == g["op"]) & (cur["impl"] == g["impl"])].iloc[0]
    case = row["case"] if "case" in row and isinstance(row["case"], str) else ""
    return Worst(group_label(*(g[k] for k in GROUP_KEYS)), g["metric"], float(g["worst_ratio"]), g["worst_case"],
                 case, replay_specs(row), device_type(row["device"]), float(g["shift"]))


def compare(current: pd.DataFrame, baseline: pd.DataFrame, *, factor: float = DRIFT_FACTOR,
            confidence: float = DRIFT_CONFIDENCE, min_cases: int = DRIFT_MIN_CASES,
            pairs: Mapping[str, str] | None = None, fail_on: str = DRIFTED) -> Drift:
    """Drift of `current` against `baseline` (stored rows, as `load_run` returns them). `pairs`
    maps current implementation names to baseline ones (`--pair NEW=OLD`); `fail_on` "worse" makes a
    worse group fail the run too (exit_code 1). Raises NothingComparable when no implementation of any
    op pairs, ValueError for bad settings."""
    if fail_on not in (DRIFTED, WORSE):
        raise ValueError(f"fail on {fail_on!r}: expected {DRIFTED} or {WORSE}")
    if not factor > 1.0:
        raise ValueError(f"drift factor must be > 1, got {factor}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"drift confidence must be between 0 and 1, got {confidence}")
    if min_cases < 1:
        raise ValueError(f"minimum cases must be >= 1, got {min_cases}")
    cur_all, base_all = measured(current), measured(baseline)
    impl_pairs = pair_implementations(cur_all, base_all, pairs)
    if impl_pairs.empty:
        shared = sorted(set(cur_all["op"]) & set(base_all["op"]))
        raise NothingComparable(
            "nothing comparable: the runs share no op" if not shared else
            f"nothing comparable: the runs share {', '.join(shared)} but no implementation pairs "
            "(name them with --pair NEW=OLD)")
    cur, base = with_partner(cur_all, base_all, impl_pairs)
    cur_groups = {k: g.drop_duplicates("case_id") for k, g in grouped(cur, GROUP_KEYS)}
    base_groups = {k: g.drop_duplicates("case_id") for k, g in grouped(base, GROUP_KEYS)}
    metric_records, group_records = [], []
    for key in sorted(set(cur_groups) | set(base_groups), key=lambda k: tuple(map(str, k))):
        c, b = cur_groups.get(key), base_groups.get(key)
        if c is not None and b is not None:
            records, mode, shared, why = _group_metrics(key, c, b, min_cases, factor, confidence)
        else:
            records, mode, shared, why = [], NEW if b is None else GONE, 0, ""
        metric_records += records
        group_records.append(_group_record(key, c, b, records, mode, shared, why))
    groups = pd.DataFrame.from_records(group_records, columns=list(GROUP_COLUMNS))
    metrics = pd.DataFrame.from_records(metric_records, columns=list(METRIC_COLUMNS))
    # what needs a look first: flagged, improved, compared, then what was not compared
    rank = np.select([(groups["word"] == DRIFTED).to_numpy(dtype=bool), (groups["word"] == WORSE).to_numpy(dtype=bool),
                      (groups["finding"] != "").to_numpy(dtype=bool),
                      groups["mode"].isin([PAIRED, UNPAIRED]).to_numpy(dtype=bool)], [0, 1, 2, 3], default=4)
    groups = (groups.assign(_rank=rank, _r=-groups["worst_ratio"].fillna(0))
              .sort_values(["_rank", "_r"], kind="stable").drop(columns=["_rank", "_r"]).reset_index(drop=True))
    return Drift(groups=groups, metrics=metrics, pairs=impl_pairs,
                 unpaired=unpaired_implementations(cur_all, base_all, impl_pairs),
                 factor=factor, confidence=confidence, min_cases=min_cases, worst=_worst(groups, cur),
                 cur_rows=cur, base_rows=base, fail_on=fail_on)

