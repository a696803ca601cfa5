"""A run on disk: `rows.parquet` (typed, what `load_run` reads), `rows.csv` (for eyes and
spreadsheets; the same values) and `meta.json` (what ran, where, with which versions).

Column types follow the annotations of the stored fields (`equivalence.judge.rows.STORED_FIELDS`), so a
run written today and one written months ago load to identical dtypes: str -> string, int -> int64,
`int | None` -> Int64 (nullable), float (and `float | None`) -> float64 with NaN for missing,
bool -> bool, a pipeline's `stages` -> (stage, impl) pairs (a list of {stage, impl} structs in
rows.parquet, JSON in rows.csv and the journal), `max_abs_at` -> a tuple of ints (a list, or JSON). Optional strings (knobs) are <NA> when absent (an
empty knob is absent); required strings are never missing ("" is a value). A column an older run
lacks takes its default; `kind` alone, which runs stored before rows had one lack, is derived from
their tensors' names (`_old_kind`), `stages`, stored as the text "stage=impl,..." before it was
pairs, is read into pairs (`stage_pairs`), and `max_abs_at`, once the text "i,j,k", into a tuple
(`position`): the only places that read an old run's text as data.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import MISSING
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from mla_verify.equivalence.sandbox.files import read_json, read_text, regular_file
from mla_verify.equivalence.judge.metrics import Position
from mla_verify.equivalence.judge.rows import COLUMNS, STORED_FIELDS, Row, Stages

RUN_FORMAT = "mla-verify-run/1"
ROWS_PARQUET = "rows.parquet"
ROWS_CSV = "rows.csv"
META_JSON = "meta.json"
JOURNAL = "journal.jsonl"  # rows appended as each case finishes (mla_verify.runs.rundir); gone once the run is written
META_LIMIT = 16 * 2**20   # bytes a meta.json may have
ROWS_LIMIT = 16 * 2**30   # bytes rows.parquet, rows.csv or a journal may have
# The reason of the row a case gets when its run's journal says it started and never finished.
CRASHED = ("the run ended during this case, before its verdict: the process died in the implementation's call "
           "(os._exit, a signal such as SIGSEGV or SIGKILL, the machine); replay it isolated")

_DTYPE_OF_ANNOTATION = {
    "str": "string",
    "str | None": "string",
    "int": "int64",
    "int | None": "Int64",
    "float": "float64",
    "float | None": "float64",
    "bool": "bool",
    "Stages": "object",
    "Position": "object",
}
STAGES_TYPE = pa.list_(pa.struct([("stage", pa.string()), ("impl", pa.string())]))  # in rows.parquet
POSITION_TYPE = pa.list_(pa.int64())
# column -> (pandas dtype, may be missing)
SCHEMA: dict[str, tuple[str, bool]] = {
    f.name: (_DTYPE_OF_ANNOTATION[str(f.type)], str(f.type).endswith("| None")) for f in STORED_FIELDS
}
_DEFAULTS = {f.name: f.default for f in STORED_FIELDS if f.default is not MISSING}


def _old_kind(tensor: str, exact: bool) -> str:
    """The kind (equivalence.judge.rows) of a row stored before rows had one, from its tensor's name as
    the reports read it then: for those runs only (no kind column, or journal records without one).
    A row that failed before any comparison (missing, a broken contract) was not marked exact then:
    of an exact tensor, it reads as other."""
    if exact:
        return "exact"
    if tensor == "*" or tensor.startswith("input:"):
        return ""
    name = tensor.rsplit(".", 1)[-1]      # a property's "CHECK.TENSOR"
    base, sep, rank = name.rpartition("_rank")  # a DCP rank's "out_rank3", "partial_lse_rank1"
    if sep and rank.isdigit():
        name = base.removeprefix("partial_")
    return name if name in ("out", "lse", "max_logits") else "other"


def stage_pairs(stored: Any) -> Stages:
    """A row's stages, however its run stored them, as (stage, impl) pairs: {stage, impl} structs
    (rows.parquet), pairs (a Row, the journal) or their JSON (rows.csv); or the text
    "stage=impl,..." of a run written before stages were pairs."""
    if isinstance(stored, str) and not stored.startswith("["):
        return tuple((s, impl) for s, _, impl in (p.partition("=") for p in stored.split(",") if p))
    items = json.loads(stored) if isinstance(stored, str) else stored
    pairs = tuple(map(_pair, items)) if isinstance(items, _SEQUENCES) else None
    if pairs is None or not all(len(p) == 2 and all(isinstance(x, str) for x in p) for p in pairs):
        raise ValueError(f"rows' stages {str(stored)[:80]!r} are not (stage, implementation) pairs")
    return pairs


def position(stored: Any) -> Position:
    """A row's max_abs_at, however its run stored it, as a tuple of ints: a list (rows.parquet, a
    Row, the journal) or its JSON (rows.csv); or the text "i,j,k" of a run written before it was
    a tuple."""
    if isinstance(stored, str) and not stored.startswith("["):
        items = stored.split(",") if stored else []
        if not all(c.isdigit() for c in items):
            raise ValueError(f"rows' max_abs_at {stored[:80]!r} is not a position")
        return tuple(map(int, items))
    items = json.loads(stored) if isinstance(stored, str) else stored
    if not isinstance(items, _SEQUENCES) or not all(isinstance(c, (int, np.integer)) and not isinstance(c, bool)
                                                    for c in items):
        raise ValueError(f"rows' max_abs_at {str(stored)[:80]!r} is not a position")
    return tuple(int(c) for c in items)


_SEQUENCES = (list, tuple, np.ndarray)  # what pyarrow, json and a Row hand over as a list
_READERS = {"stages": stage_pairs, "max_abs_at": position}  # the columns stored as lists


def _pair(p: Any) -> tuple:
    if isinstance(p, Mapping) and list(p) == ["stage", "impl"]:
        return tuple(p.values())
    return tuple(p) if isinstance(p, _SEQUENCES) else ()


def rows_frame(rows: Iterable[Row | Mapping[str, Any]]) -> pd.DataFrame:
    """Rows (Row objects or records with Row's columns; missing columns take their defaults) as a
    DataFrame with COLUMNS in order and the schema's dtypes."""
    records = [(r if isinstance(r, Row) else Row.from_record(r)).to_record() for r in rows]
    return conform(pd.DataFrame.from_records(records, columns=list(COLUMNS)))


def conform(frame: pd.DataFrame) -> pd.DataFrame:
    """COLUMNS first, in order, with the schema's dtypes. A column an older run lacks is added
    with its default (missing for optional knobs; `kind` from the tensors' names); columns no
    longer stored are kept last."""
    out = frame.copy()
    if "kind" not in out.columns:
        out["kind"] = [_old_kind(t, e) for t, e in zip(out["tensor"], out["exact"].astype(bool), strict=True)]
    for name, (dtype, optional) in SCHEMA.items():
        if name not in out.columns:
            if not optional and (name not in _DEFAULTS or name == "passed"):  # no verdict is no pass
                raise ValueError(f"rows lack the required column {name!r}")
            default = None if optional else _DEFAULTS[name]
            out[name] = [default] * len(out) if isinstance(default, tuple) else default  # () is no column of 0
        if dtype == "bool":
            out[name] = _verdicts(out[name], name)
        if name in _READERS:
            out[name] = pd.Series([_READERS[name](v) for v in out[name]], index=out.index, dtype=object)
        out[name] = out[name].astype(dtype)
        if optional and dtype == "string":   # an empty knob is an absent knob (as in rows.csv)
            out[name] = out[name].mask(out[name] == "")
    extra = [c for c in out.columns if c not in SCHEMA]
    return out[[*COLUMNS, *extra]].reset_index(drop=True)


def _verdicts(column: pd.Series, name: str) -> pd.Series:
    """A true/false column as stored: bool values only. Anything else (strings, numbers, missing)
    is refused, never cast: "False" cast to bool is True, and a failing row would read as passed."""
    if pd.api.types.is_bool_dtype(column.dtype) and not column.isna().any():
        return column
    if column.map(lambda v: isinstance(v, (bool, np.bool_))).all():
        return column.astype(bool)
    bad = column[~column.map(lambda v: isinstance(v, (bool, np.bool_)))].iloc[0]
    bad = bad.item() if isinstance(bad, np.generic) else bad
    raise ValueError(f"rows' column {name!r} holds {bad!r} ({column.dtype}), not true/false")


def _parse_csv_column(raw: pd.Series, dtype: str, optional: bool) -> pd.Series:
    """Text from rows.csv back to the schema type. Parsing is ours, not read_csv's guesses:
    "NA" or "nan" in a reason stays text, and float() reads Python's shortest repr exactly."""
    if dtype in ("string", "object"):  # stages, max_abs_at: read by `conform`
        return raw.mask(raw == "", None).astype(dtype) if optional else raw.astype(dtype)
    if dtype == "float64":
        return raw.map(lambda s: float(s) if s else float("nan")).astype(dtype)
    if dtype == "bool":
        return raw.map({"True": True, "False": False}).astype(dtype)
    return raw.map(lambda s: int(s) if s else None).astype(dtype)


def read_csv_rows(path: Path) -> pd.DataFrame:
    raw = pd.read_csv(path, dtype=str, keep_default_na=False, na_filter=False)
    parsed = {
        name: _parse_csv_column(raw[name], *SCHEMA[name]) if name in SCHEMA else raw[name]
        for name in raw.columns
    }
    return conform(pd.DataFrame(parsed, index=raw.index))


def _json_default(obj: Any) -> Any:
    # numpy scalars (seeds, counts) reach meta from callers; anything else is a caller's bug.
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"meta value of type {type(obj).__name__} is not JSON: {obj!r}")


def write_parquet(frame: pd.DataFrame, path: Path) -> None:
    """`frame` (conformed) as rows.parquet: its stages a list of {stage, impl} structs, each
    max_abs_at a list of ints."""
    lists = {"stages": pa.array([[{"stage": s, "impl": i} for s, i in pairs] for pairs in frame["stages"]],
                                STAGES_TYPE),
             "max_abs_at": pa.array([list(at) for at in frame["max_abs_at"]], POSITION_TYPE)}
    table = pa.Table.from_pandas(frame.drop(columns=list(lists)), preserve_index=False)
    for name in sorted(lists, key=COLUMNS.index):
        table = table.add_column(COLUMNS.index(name), pa.field(name, lists[name].type), lists[name])
    pq.write_table(table, path)


def write_run(run_dir: str | Path, rows: Iterable[Row | Mapping[str, Any]] | pd.DataFrame,
              meta: Mapping[str, Any]) -> Path:
    """Write rows.parquet, rows.csv and meta.json under `run_dir` (created); returns it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    frame = conform(rows) if isinstance(rows, pd.DataFrame) else rows_frame(rows)
    write_parquet(frame, run_dir / ROWS_PARQUET)
    # RFC 4180 line ends: Python's csv quotes a field only for the characters of the line
    # terminator, and a bare "\r" in a reason must be quoted to survive the trip.
    text = frame.assign(stages=frame["stages"].map(json.dumps), max_abs_at=frame["max_abs_at"].map(json.dumps))
    text.to_csv(run_dir / ROWS_CSV, index=False, lineterminator="\r\n")
    body = {"format": RUN_FORMAT, **meta, "rows": len(frame)}
    (run_dir / META_JSON).write_text(json.dumps(body, indent=2, default=_json_default) + "\n")
    return run_dir


def _journal_lines(path: Path) -> list[dict[str, Any]]:
    """Every record of a journal; a torn last line (the writer was killed mid-write) is dropped."""
    lines = read_text(path, ROWS_LIMIT).splitlines()
    records = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            if i != len(lines) - 1:
                raise ValueError(f"{path}: line {i + 1} is not a row") from None
            continue
        if not isinstance(record, dict):
            raise ValueError(f"{path}: line {i + 1} is not a row")
        records.append(record)
    return records


def _unfinished(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The started records (mla_verify.runs.rundir.RunDir.case_started) no later line finished."""
    open_cases: dict[str, dict[str, Any]] = {}
    for record in records:
        if "started" in record:
            open_cases[str(record["started"].get("case_id"))] = record
        elif "finished" in record:
            open_cases.pop(str(record["finished"]), None)
    return list(open_cases.values())


def unfinished_cases(path: Path) -> list[dict[str, Any]]:
    """The cases a journal says started and never finished: {"started": the crashed row's record,
    "impl_specs": [...], "deviations": [...]} each. None where there is no journal."""
    return _unfinished(_journal_lines(path)) if Path(path).exists() else []


# What a run directory holds that no report or JUnit file may replace: its rows, meta, journal,
# lock, harness error, and the case files under failures/ and drift/.
_RUN_OWN = (ROWS_PARQUET, ROWS_CSV, META_JSON, JOURNAL, ".lock", "harness-error.txt")
_RUN_DIRS = ("failures", "drift")


def _holds_run(directory: Path) -> bool:
    return any((directory / name).exists() for name in (ROWS_PARQUET, ROWS_CSV, META_JSON, JOURNAL))


def run_file(path: str | Path) -> str | None:
    """Why writing `path` would overwrite a file of a run (one line), or None."""
    path = Path(path).resolve()
    for directory, parts in ((path.parent, (path.name,)), (path.parent.parent, (path.parent.name, path.name))):
        if _holds_run(directory) and (parts == (parts[0],) and parts[0] in _RUN_OWN or parts[0] in _RUN_DIRS
                                      and len(parts) == 2):
            return (f"{path} is a file of the run in {directory}; runs are never overwritten: write the report "
                    "elsewhere")
    return None


def read_journal(path: Path) -> list[dict[str, Any]]:
    """The row records of a journal, and a `crashed` row (reason CRASHED) for every case that
    started and never finished."""
    records = _journal_lines(path)
    rows = []
    for record in records:
        if "found" in record:  # a case journaled before became (or stopped being) a saved finding
            for row in rows:
                if all(row.get(key) == record.get(key) for key in ("case_id", "impl", "source")):
                    row["finding"] = record["found"]
        elif "started" not in record and "finished" not in record:
            rows.append(record)
    rows += [dict(u["started"]) for u in _unfinished(records)]
    for record in rows:
        if "tensor" not in record or "passed" not in record:
            raise ValueError(f"{path}: a line is not a row (no tensor or verdict)")
        if "kind" not in record:  # written before rows had a kind
            record["kind"] = _old_kind(record["tensor"], record.get("exact", False))
    return rows


def load_run(run_dir: str | Path) -> tuple[pd.DataFrame, dict[str, Any]]:
    """(rows, meta) of a run written by `write_run`: rows.parquet, or rows.csv where the parquet
    file is absent (a run copied around as text), or the journal of a run that never finished
    (meta then says "incomplete": true, as it does for a run that recorded it stopped early). Only regular files of a bounded size are read
    (`equivalence.sandbox.files`); ValueError (or OSError) with the reason otherwise."""
    run_dir = Path(run_dir)
    parquet, csv, journal = run_dir / ROWS_PARQUET, run_dir / ROWS_CSV, run_dir / JOURNAL
    incomplete = False
    if parquet.exists():
        regular_file(parquet, ROWS_LIMIT)
        frame = conform(pd.read_parquet(parquet))
    elif csv.exists():
        regular_file(csv, ROWS_LIMIT)
        frame = read_csv_rows(csv)
    elif journal.exists():
        frame, incomplete = rows_frame(read_journal(journal)), True
    else:
        raise FileNotFoundError(f"{run_dir} holds no {ROWS_PARQUET}, {ROWS_CSV} or {JOURNAL}: not a run")
    meta_path = run_dir / META_JSON
    meta = read_json(meta_path, META_LIMIT) if meta_path.exists() else {}
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path} is a JSON {type(meta).__name__}, not an object")
    # a run stopped before its budget (Ctrl-C, SIGTERM, a lost CUDA context) is incomplete too
    return frame, {**meta, "incomplete": True} if incomplete or meta.get("stopped") else meta
