"""Drift over many versions (issue 39): many runs of one kernel line (commits, versions, nightly
runs), in time order or an order the user gives, read together.

Per line (op, path, tensor, implementation, deviation) and run: the drift metrics' median and p99
over the run's cases, the bias metrics' mean with its t interval, the largest share of a bound used
(`trend`). Each step between neighbouring runs of a line is judged as `mla-verify report NEW
--baseline OLD` judges it (`reports.judge`, `reports.drift.group_verdict`): paired on the cases the
two runs share, else unpaired; its word (drifted, worse, unchanged, better) and the numbers behind
it (`steps`), with the case that moved most. Where each run holds one implementation of an op
(mykern_v1 in one run, mykern_v2 in the next), they are one line, as the two-run report pairs them.

Only the columns the judge reads are loaded, with pyarrow, one Parquet file per run: 200 runs of
5,000 rows take seconds (`mla-verify bench --only history`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from mla_verify.equivalence.sandbox.files import read_json
from mla_verify.equivalence.sandbox.device import device_type
from mla_verify.equivalence.judge.policy import (
    DRIFT_CONFIDENCE,
    DRIFT_FACTOR,
    DRIFT_MIN_CASES,
    bias_metrics,
    drift_metrics,
)
from mla_verify.reports import judge
from mla_verify.reports.drift import (PAIRED, UNPAIRED, Worst, group_verdict, headline, judged_parts, louder,
                                      replay_specs, uncompared)
from mla_verify.reports.significance import t_quantile
from mla_verify.reports.store import META_JSON, META_LIMIT, ROWS_PARQUET, load_run
from mla_verify.reports.words import DRIFTED, NOT_COMPARABLE, UNCHANGED, WORSE

LINE_KEYS: tuple[str, ...] = ("op", "path", "tensor", "line", "deviation", "kind")
_READ = ("op", "path", "tensor", "impl", "deviation", "kind", "case_id", "passed", "bf16_units", "elem_bf16_units",
         "lse_fp32_units", "mismatch_frac", "mean_err", "headroom", "gain", "bias_units")
VALUES = ("bf16_units", "elem_bf16_units", "lse_fp32_units", "mismatch_frac", "abs_bias", "bound_use", "gain",
          "bias_units")
RUN_COLUMNS = ("run", "label", "dir", "run_id", "when", "revision", "rows")
STEP_COLUMNS = (*LINE_KEYS, "run", "before", "mode", "cases", "word", "finding", "metric", "ratio", "worst_ratio",
                "worst_case", "shift", "impl", "headline")


@dataclass(frozen=True)
class Run:
    label: str
    dir: Path
    run_id: str
    when: str
    revision: str


def _run_of(run_dir: Path) -> Run:
    meta_path = run_dir / META_JSON
    meta = read_json(meta_path, META_LIMIT) if meta_path.exists() else {}
    meta = meta if isinstance(meta, dict) else {}
    git = meta.get("git") if isinstance(meta.get("git"), dict) else {}
    return Run(run_dir.name, run_dir, str(meta.get("run_id") or run_dir.name),
               str(meta.get("finished_at") or meta.get("started_at") or ""), str(git.get("revision") or ""))


def ordered(run_dirs: Sequence[str | Path], order: str | Sequence[str] = "time") -> list[Run]:
    """The runs in `order`: "time" (finished, else started; the given order breaks ties), "given", or
    a list of revisions (prefixes of the runs' meta.json git revisions): ValueError for a run none matches."""
    runs = [_run_of(Path(d)) for d in run_dirs]
    if order == "given":
        return runs
    if order == "time":
        return sorted(runs, key=lambda r: r.when)
    revisions = list(order)

    def place(run: Run) -> int:
        hit = [i for i, rev in enumerate(revisions) if rev and run.revision.startswith(rev)]
        if not hit:
            raise ValueError(f"{run.dir}: its revision {run.revision or '(none recorded)'} is in no revision of "
                             "the order given")
        return hit[0]

    return sorted(runs, key=place)


def _table(run: Run) -> pa.Table:
    """The columns the judge reads of one run: straight from its Parquet file where it holds them
    all, else through `load_run` (a run written before a column existed, a CSV or a journal)."""
    path = run.dir / ROWS_PARQUET
    if path.exists() and set(_READ) <= set(pq.read_schema(path).names):
        return pq.read_table(path, columns=list(_READ))
    rows, _ = load_run(run.dir)
    return pa.Table.from_pandas(rows[list(_READ)], preserve_index=False)


def _lines(frame: pd.DataFrame) -> pd.Series:
    """The line of each row: its implementation, or where every run holds one implementation of the
    op, their names in order ("v1 -> v2 -> v3"), one line as the two-run report pairs them."""
    line = frame["impl"].astype(object).copy()
    per_run = frame.groupby(["op", "run"], observed=True)["impl"].nunique()
    for op, counts in per_run.groupby(level="op", observed=True):
        if counts.max() == 1:
            names = frame.loc[frame["op"] == op].sort_values("run", kind="stable")["impl"].drop_duplicates()
            line[frame["op"] == op] = " -> ".join(names)
    return line


def load(runs: Sequence[Run]) -> pd.DataFrame:
    """Every run's rows (the judged columns, one row per case of a line) with `run` (its place in
    `runs`), `line`, abs_bias and bound_use (as `reports.drift.measured` derives them)."""
    parts = []
    for i, run in enumerate(runs):
        t = _table(run)
        parts.append(t.append_column("run", pa.array(np.full(t.num_rows, i, dtype=np.int32))))
    frame = pa.concat_tables(parts, promote_options="default").to_pandas()
    frame["abs_bias"] = frame["mean_err"].abs()
    with np.errstate(divide="ignore"):
        frame["bound_use"] = 1.0 / frame["headroom"].to_numpy(dtype="float64")
    frame["line"] = _lines(frame)
    return frame.drop_duplicates(["run", *LINE_KEYS, "case_id"]).reset_index(drop=True)


def trend(frame: pd.DataFrame, confidence: float = DRIFT_CONFIDENCE) -> pd.DataFrame:
    """Per line and run: cases, failed rows, each drift metric's median and p99 ("bf16_units p50",
    "bf16_units p99"), each bias metric's mean and the half-width of its t interval ("gain", "gain ci"),
    and the largest bound use."""
    keys = [*LINE_KEYS, "run"]
    g = frame.groupby(keys, observed=True, sort=True)
    out = pd.DataFrame({"cases": g["case_id"].size(), "failed": g["passed"].agg(lambda p: int((~p).sum()))})
    drift = ["bf16_units", "elem_bf16_units", "lse_fp32_units", "abs_bias"]
    p50 = g[drift].median()
    p99 = g[drift].quantile(0.99, interpolation="higher")
    for name in drift:
        out[f"{name} p50"], out[f"{name} p99"] = p50[name], p99[name]
    for name in ("gain", "bias_units"):
        mean, std, n = g[name].mean(), g[name].std(ddof=1), g[name].count()
        t = {k: t_quantile(confidence, k - 1) for k in set(n.tolist()) if k >= 2}   # one per sample size
        width = pd.Series([t.get(k, math.nan) for k in n], index=n.index)
        out[name], out[f"{name} ci"] = mean, width * std / np.sqrt(n)
    out["bound use"] = g["bound_use"].max()
    return out.reset_index()


@dataclass(frozen=True)
class _Cells:
    """The loaded rows as arrays, and where each (line, run) cell of them lies."""

    values: np.ndarray        # rows x VALUES, float64
    cases: np.ndarray         # case_id per row
    failed: np.ndarray        # bool per row
    impl: np.ndarray


def _metric(cells: _Cells, name: str, floor: float, c: np.ndarray, b: np.ndarray, mode: str,
            shared: tuple[np.ndarray, np.ndarray], settings: tuple[float, float, int]) -> dict | None:
    """`reports.judge` of one metric between two cells (row positions `c`, new, and `b`, before)."""
    factor, confidence, tail_tests = settings
    col = VALUES.index(name)
    if mode == PAIRED:
        new, old = cells.values[c[shared[0]], col], cells.values[b[shared[1]], col]
        keep = ~np.isnan(new) & ~np.isnan(old)
        new, old, ids = new[keep], old[keep], cells.cases[c[shared[0]]][keep]
    else:
        new, old = cells.values[c, col], cells.values[b, col]
        ids, new, old = cells.cases[c][~np.isnan(new)], new[~np.isnan(new)], old[~np.isnan(old)]
    signed = name in ("gain", "bias_units")
    if signed and (not new.size or not old.size):     # rows stored before the metric existed
        return None
    rec = judge.metric(new, old, floor, is_signed=signed, is_paired=mode == PAIRED, judged=mode in (PAIRED, UNPAIRED),
                       factor=factor, confidence=confidence, tail_tests=tail_tests)
    at = rec.pop("worst_at")
    return {**rec, "metric": name, "mode": mode, "floor": floor, "worst_case": ids[at] if at is not None else ""}


def _step(cells: _Cells, key: tuple, c: np.ndarray, b: np.ndarray, min_cases: int,
          settings: tuple[float, float]) -> dict:
    """One step of a line, judged as `reports.drift.compare` judges a group (the shared cases paired,
    enough cases of one run only unpaired too, `drift.judged_parts`): STEP_COLUMNS."""
    kind = key[LINE_KEYS.index("kind")]
    _, ic, ib = np.intersect1d(cells.cases[c], cells.cases[b], assume_unique=True, return_indices=True)
    mode, rest = judged_parts(ic.size, c.size, b.size, min_cases)
    tail_tests = len(drift_metrics(kind))
    sides = [(mode, c, b)] + ([(UNPAIRED, np.delete(c, ic), np.delete(b, ib))] if rest else [])
    same = ic.size == c.size == b.size and np.array_equal(cells.values[c[ic]], cells.values[b[ib]], equal_nan=True)
    metrics = []
    for m in () if same else (*drift_metrics(kind), *bias_metrics(kind)):  # a rerun of the same values: unchanged
        judged = [_metric(cells, m.name, m.floors[kind], new, old, part, (ic, ib), (*settings, tail_tests))
                  for part, new, old in sides]
        if judged[0] is not None:
            metrics.append(louder([r for r in judged if r is not None]))
    new_failures = bool(cells.failed[c].any() and not cells.failed[b].any())
    why = uncompared(ic.size, c.size, b.size, mode, rest, (1.0 - settings[1]) / tail_tests)
    rec = {**dict(zip(LINE_KEYS, key, strict=True)), "mode": mode, "cases": int(ic.size) if ic.size else int(c.size),
           "impl": cells.impl[c[0]], **group_verdict(metrics, mode, new_failures, why)}
    rec["headline"] = (rec["uncompared"] if rec["word"] == NOT_COMPARABLE else "" if rec["word"] in (UNCHANGED, mode)
                       else headline(pd.Series(rec), pd.DataFrame(metrics)))
    return rec


def steps(frame: pd.DataFrame, *, factor: float = DRIFT_FACTOR, confidence: float = DRIFT_CONFIDENCE,
          min_cases: int = DRIFT_MIN_CASES) -> pd.DataFrame:
    """STEP_COLUMNS: every line's step from one run holding it to the next (`load`'s rows)."""
    cells = _Cells(frame[list(VALUES)].to_numpy(dtype="float64"), frame["case_id"].to_numpy(dtype=object),
                   ~frame["passed"].to_numpy(dtype=bool), frame["impl"].to_numpy(dtype=object))
    by_line: dict[tuple, list[tuple[int, np.ndarray]]] = {}
    for key, rows in frame.groupby([*LINE_KEYS, "run"], observed=True, sort=True).indices.items():
        by_line.setdefault(key[:-1], []).append((int(key[-1]), rows))
    records = []
    for key, cells_of in by_line.items():
        for (before, b), (run, c) in zip(cells_of, cells_of[1:]):
            records.append({**_step(cells, key, c, b, min_cases, (factor, confidence)), "run": run, "before": before})
    return pd.DataFrame.from_records(records, columns=list(STEP_COLUMNS))


@dataclass(frozen=True)
class History:
    """Runs of one kernel line read together: `runs` (RUN_COLUMNS, in order), `trend` (`trend`),
    `steps` (STEP_COLUMNS) and the settings that judged the steps."""

    runs: pd.DataFrame
    trend: pd.DataFrame
    steps: pd.DataFrame
    factor: float
    confidence: float
    min_cases: int
    fail_on: str = DRIFTED

    @property
    def marked(self) -> pd.DataFrame:
        """The steps the two-run judge calls drifted or worse."""
        return self.steps[self.steps["word"].isin([DRIFTED, WORSE])]

    @property
    def exit_code(self) -> int:
        """1 when a line's newest step is drifted (or, with fail_on="worse", worse): the last run moved."""
        failing = (DRIFTED,) if self.fail_on == DRIFTED else (DRIFTED, WORSE)
        newest = self.steps[self.steps["run"] == self.steps.groupby(list(LINE_KEYS), observed=True)["run"]
                            .transform("max")]
        return int(newest["word"].isin(failing).any())

    def label(self, run: int) -> str:
        return str(self.runs["label"].iloc[run])

    def lines(self) -> list[str]:
        """What the terminal prints: the runs, the count of each word, and every marked step."""
        words = self.steps["word"].value_counts()
        counts = ", ".join(f"{n} {w}" for w, n in words.items())
        first, last = self.label(0), self.label(len(self.runs) - 1)
        out = [f"history of {len(self.runs)} runs ({first} .. {last}): {self.trend[list(LINE_KEYS)].drop_duplicates().shape[0]} "
               f"lines, {len(self.steps)} steps judged ({counts or 'none'}; factor {self.factor:g}, confidence "
               f"{self.confidence:g})"]
        for _, s in self.marked.iterrows():
            where = s["op"] if s["op"] == s["path"] else f"{s['op']}/{s['path']}"
            out.append(f"  {s['word']} at {self.label(s['run'])} (after {self.label(s['before'])}): {s['headline']} "
                       f"[{where} {s['tensor']} {s['line']}; worst case {s['worst_case']}]")
        apart = self.steps[self.steps["word"] == NOT_COMPARABLE]
        if len(apart):
            first = apart.iloc[0]
            out.append(f"  {NOT_COMPARABLE}: {len(apart)} step{'s' * (len(apart) != 1)}, first at "
                       f"{self.label(first['run'])} (after {self.label(first['before'])}): {first['headline']}")
        return out


def history(run_dirs: Sequence[str | Path], *, order: str | Sequence[str] = "time", factor: float = DRIFT_FACTOR,
            confidence: float = DRIFT_CONFIDENCE, min_cases: int = DRIFT_MIN_CASES, fail_on: str = DRIFTED) -> History:
    """Read the runs (`ordered`), their trend and the judged steps between neighbours."""
    if len(run_dirs) < 2:
        raise ValueError(f"a history needs 2 runs or more, got {len(run_dirs)}")
    runs = ordered(run_dirs, order)
    frame = load(runs)
    table = pd.DataFrame({"run": range(len(runs)), "label": [r.label for r in runs], "dir": [str(r.dir) for r in runs],
                          "run_id": [r.run_id for r in runs], "when": [r.when for r in runs],
                          "revision": [r.revision[:10] for r in runs],
                          "rows": frame.groupby("run")["case_id"].size().reindex(range(len(runs)), fill_value=0)})
    return History(table, trend(frame, confidence), steps(frame, factor=factor, confidence=confidence,
                                                          min_cases=min_cases), factor, confidence, min_cases, fail_on)


def worst_case(h: History, step: pd.Series) -> tuple[Worst, dict] | None:
    """The case that moved most in a step (`History.steps` row), as the two-run report saves it, with
    its run's meta.json (the deviations and conventions the run declared); None where it has none."""
    if not step["worst_case"]:
        return None
    rows, meta = load_run(h.runs["dir"].iloc[int(step["run"])])
    hit = rows[(rows["case_id"] == step["worst_case"]) & (rows["op"] == step["op"]) & (rows["impl"] == step["impl"])]
    if hit.empty:
        return None
    row = hit.iloc[0]
    where = step["op"] if step["op"] == step["path"] else f"{step['op']}/{step['path']}"
    case = row["case"] if "case" in row and isinstance(row["case"], str) else ""
    return Worst(f"{where} {step['tensor']} [{step['line']}]", step["metric"], float(step["worst_ratio"]),
                 step["worst_case"], case, replay_specs(row), device_type(row["device"]),
                 float(step.get("shift", np.nan))), meta
