"""A run directory's record: what the parent wrote is what `report` reads.

A kernel's process can outlive its case and reach the files of the run (a daemon it left rewrote
rows.parquet to passed and deleted failures/). So once a run is written, and every process a
worker left was killed (`equivalence.reaper`), the parent seals it: meta.json, written last, gets
a "record" of the row count and the SHA-256 of rows.parquet, rows.csv, harness-error.txt and each
failures/*.json. `verify` reads it back; `mla-verify report` says TAMPERED (exit 1) and names what
differs. A run written before records existed has none: report says so and reads it as it is.

The digests are not keyed: a process that can write the run directory can recompute them. What a
CI keeps out of its reach is the record's own digest (`digest`), which the run prints at its end:
`mla-verify report DIR --expect DIGEST` says TAMPERED unless the record is still that one and the
files still match it.

And `--out` is ours alone (`foreign`): an existing directory that holds anything a run does not
write is refused before the first case, `/` and a home directory included.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
from pathlib import Path
from typing import Any, Mapping

from mla_verify.fuzz.casefile import write_atomic
from mla_verify.reports.store import META_JSON, ROWS_CSV, ROWS_PARQUET

RECORD = "record"
SEALED = (ROWS_PARQUET, ROWS_CSV, "harness-error.txt")
# What a run (its parts, its report) writes into its directory: another entry means the directory
# is someone else's.
RUN_ENTRIES = (META_JSON, ROWS_PARQUET, ROWS_CSV, "journal.jsonl", "failures", "drift", ".lock", ".writing-*",
               "report.html", "harness-error.txt", "fuzz.log", "result.json", "part-*", "junit.xml", "durations.json")


def foreign(path: Path) -> list[str]:
    """The entries of directory `path` that no run writes (a few, sorted); [] for an empty
    directory or a run's."""
    try:
        names = sorted(p.name for p in path.iterdir())
    except OSError:
        return []
    return [n for n in names if not any(fnmatch.fnmatchcase(n, pattern) for pattern in RUN_ENTRIES)][:3]


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(run_dir: Path) -> dict[str, str]:
    """The sealed files present, relative name -> SHA-256."""
    found = {name: _digest(run_dir / name) for name in SEALED if (run_dir / name).is_file()}
    failures = run_dir / "failures"
    if failures.is_dir():
        found |= {f"failures/{p.name}": _digest(p) for p in sorted(failures.glob("*.json")) if p.is_file()}
    return found


def seal(run_dir: str | Path, rows: int) -> None:
    """Add the record (`rows` rows, the sealed files' digests) to the run's meta.json, written
    last; every process a worker of this one left is killed first."""
    from mla_verify.equivalence.sandbox.worker import reap_all

    reap_all()
    run_dir = Path(run_dir)
    meta = json.loads((run_dir / META_JSON).read_text())
    meta[RECORD] = {"rows": rows, "sha256": _files(run_dir)}
    write_atomic(run_dir / META_JSON, json.dumps(meta, indent=2) + "\n")


def verify(run_dir: str | Path, meta: Mapping[str, Any], rows: int) -> list[str] | None:
    """What differs from the run's record (`meta`'s, `rows` rows read): one line per change, []
    when none; None when the run has no record."""
    record = meta.get(RECORD)
    if not isinstance(record, dict):
        return None
    want = record.get("sha256") if isinstance(record.get("sha256"), dict) else {}
    have = _files(Path(run_dir))
    changed = [f"{name} changed" for name in sorted(want) if name in have and have[name] != want[name]]
    changed += [f"{name} deleted" for name in sorted(want) if name not in have]
    changed += [f"{name} added" for name in sorted(have) if name not in want]
    if record.get("rows") != rows:
        changed.append(f"{rows} rows where the run wrote {record.get('rows')}")
    return changed


def digest(meta: Mapping[str, Any]) -> str | None:
    """The SHA-256 of the run's record (its row count and every sealed file's digest), as the run
    prints it at its end; None where the run has no record."""
    record = meta.get(RECORD)
    if not isinstance(record, dict):
        return None
    return hashlib.sha256(json.dumps(record, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def digest_of(run_dir: str | Path) -> str | None:
    """`digest` of the run written at `run_dir` (None where it has none, or no readable meta.json)."""
    try:
        return digest(json.loads((Path(run_dir) / META_JSON).read_text()))
    except (OSError, ValueError):
        return None


def report_lines(run_dir: str | Path, meta: Mapping[str, Any], rows: int,
                 expect: str | None = None) -> tuple[list[str], bool]:
    """(what `report` prints about the record, whether the run was TAMPERED with); `expect`: the
    record's digest as the run printed it (a record rewritten to match rewritten files is caught)."""
    if expect is not None and digest(meta) != expect.strip().lower().removeprefix("sha256:"):
        have = digest(meta)
        why = "it has no record" if have is None else f"its record's digest is {have}"
        return [f"TAMPERED: {run_dir} is not what its run wrote: {why}, not the {expect} expected"], True
    changed = verify(run_dir, meta, rows)
    if changed is None:
        if meta.get("finished_at") and not meta.get("incomplete"):
            return [f"note: {run_dir} has no digest recorded (written before runs recorded one): "
                    "a change made after the run cannot be told"], False
        return [], False
    if not changed:
        return [], False
    return [f"TAMPERED: {run_dir} is not what its run wrote: {'; '.join(changed[:8])}"
            f"{' ...' if changed[8:] else ''}"], True
