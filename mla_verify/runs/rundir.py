"""A run directory while a run writes it: checked and locked before the first case, every case's
rows journaled as it finishes, the run written whole at the end. Nothing computed is lost and
nothing is ever overwritten:

    OUT/.lock           the writing process's pid: a second run into OUT is refused
    OUT/meta.json       what runs (written at the start, completed at the end)
    OUT/journal.jsonl   a line as each case starts, before its implementation is called, one
                        per row as it finishes, and one when a case becomes the run's finding or
                        stops being one (`found`); after the process died (SIGKILL, SIGSEGV,
                        os._exit) `mla-verify report OUT` reads it (a torn last line is dropped)
                        and turns the case that started and never finished into a `crashed`
                        finding, saved under failures/ (`recover_crashed`)
    OUT/failures/       case files, one per finding (named by op, implementation, case), which
                        the rows of its case name (`Row.finding`)
    OUT/rows.parquet    at the end (with rows.csv; written aside, then renamed into place),
                        after which the journal goes and meta.json gets its record (`record`)

A directory that already holds a run is refused, and a fresh default directory is named for the
command, op, implementation and time (`FreshDir`), with a counter when two runs start together.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from . import record
from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.catalog import row_base
from mla_verify.equivalence.sandbox.calls import failure_row
from mla_verify.equivalence.judge.rows import FailureKind, Row, RowContext
from mla_verify.equivalence.errors import UsageError
from mla_verify.fuzz import casefile
from mla_verify.fuzz.casefile import slug, write_atomic
from mla_verify.reports.meta import finish_meta
from mla_verify.reports.store import CRASHED, JOURNAL, META_JSON, ROWS_CSV, ROWS_PARQUET, unfinished_cases, write_run
from mla_verify.reports.store import load_run as read_run

LOCK = ".lock"
_RUN_FILES = (META_JSON, ROWS_PARQUET, ROWS_CSV, JOURNAL, "failures")


@dataclass(frozen=True)
class FreshDir:
    """A new directory named `path`, or `path`-2, -3, ... when that is taken."""

    path: Path

    @classmethod
    def named(cls, root: str | Path, command: str, *parts: str) -> "FreshDir":
        """root/COMMAND-PART-...-YYYYmmdd-HHMMSS, e.g. runs/fuzz-sparse_prefill-mykernel.decode-20250101-120000."""
        name = "-".join([command, *(slug(p, 40) for p in parts if p), time.strftime("%Y%m%d-%H%M%S")])
        return cls(Path(root) / name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunDir:
    """The directory a run writes; `open` checks and locks it before any case runs."""

    def __init__(self, path: Path):
        self.path = path
        self._journal = None

    @classmethod
    def open(cls, out: str | Path | FreshDir) -> "RunDir":
        """Create (or take an empty) run directory and lock it; UsageError if it cannot be
        written, is a file, holds a run, or another run is writing it."""
        # Absolute from the start: a kernel that changes the working directory must not move the run.
        if isinstance(out, FreshDir):
            path = cls._fresh(out.path.absolute())
        else:
            path = Path(out).absolute()
            if path.exists() and not path.is_dir():
                raise UsageError(f"--out {path}: a file, not a directory")
            if path.is_dir() and (theirs := record.foreign(path)):
                raise UsageError(f"--out {path} holds {', '.join(theirs)}, which no run writes: a run writes only "
                                 "into a new or empty directory, or a run's own")
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise UsageError(f"--out {path}: cannot create it ({exc.strerror or exc})") from None
        run = cls(path)
        run._lock()
        held = [name for name in _RUN_FILES if (path / name).exists()]
        if held and not isinstance(out, FreshDir):
            run.release()
            raise UsageError(f"--out {path} already holds a run ({', '.join(held)}); runs are never overwritten: "
                             "name a new directory, or leave --out out for a fresh one")
        return run

    @staticmethod
    def _fresh(base: Path) -> Path:
        try:
            base.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot create {base.parent} ({exc.strerror or exc})") from None
        for n in range(1, 1000):
            path = base if n == 1 else base.with_name(f"{base.name}-{n}")
            try:
                path.mkdir()
                return path
            except FileExistsError:
                continue
            except OSError as exc:
                raise UsageError(f"cannot create {path} ({exc.strerror or exc})") from None
        raise UsageError(f"no free run directory name next to {base}")

    def _lock(self) -> None:
        lock = self.path / LOCK
        for _ in range(2):
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                try:
                    pid = int(lock.read_text() or 0)
                except (OSError, ValueError):
                    pid = 0
                if pid and _alive(pid):
                    raise UsageError(f"--out {self.path} is being written by another run (pid {pid})") from None
                lock.unlink(missing_ok=True)  # left by a run that was killed
                continue
            except OSError as exc:
                raise UsageError(f"--out {self.path}: not writable ({exc.strerror or exc})") from None
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            return
        raise UsageError(f"--out {self.path}: cannot take its lock")

    def start(self, meta: Mapping[str, Any]) -> None:
        """meta.json as the run starts (what runs, where), and failures/ made now: the run's
        directory is whole before any case runs, and nothing else can take the name a finding is
        saved under. The end completes meta.json."""
        (self.path / "failures").mkdir(exist_ok=True)
        write_atomic(self.path / META_JSON, json.dumps({**meta, "finished_at": None}, indent=2, default=str) + "\n")

    def append(self, rows: Iterable[Row]) -> None:
        """One case's rows onto the journal, in one write: a kill leaves whole lines and at most
        one torn last line."""
        self._write("".join(json.dumps(r.to_record(), default=str) + "\n" for r in rows))

    def found(self, row: Row, name: str) -> None:
        """Journal that the case of `row` (its rows journaled before, of its implementation and
        source) is now the finding saved as `name` ("": no longer): `reports.store.read_journal`
        gives its rows that `finding`."""
        self._write(json.dumps({"found": name, "case_id": row.case_id, "impl": row.impl, "source": row.source})
                    + "\n")

    def case_started(self, case: Case, context: RowContext, specs: Sequence[str],
                     deviations: Sequence[str] = ()) -> Callable[[], None]:
        """Journal `case` as started, before its implementation is called: the row it gets in
        `context` if the process never comes back (`reports.store.CRASHED`), and what replays it
        (the --impl strings `specs`, declared `deviations`). Returns the call that journals it
        finished."""
        row = failure_row(row_base(case, context), "*", FailureKind.CRASHED, CRASHED,
                          finding=crashed_file(case, specs, context.label).name)
        self._write(json.dumps({"started": row.to_record(), "impl_specs": list(specs),
                                "deviations": list(deviations)}, default=str) + "\n")
        return lambda: self._write(json.dumps({"finished": case.case_id}) + "\n")

    def _write(self, lines: str) -> None:
        if not lines:
            return
        if self._journal is None:
            self._journal = open(self.path / JOURNAL, "a", buffering=1)
        self._journal.write(lines)
        self._journal.flush()

    def write_file(self, name: str, text: str) -> Path:
        return write_atomic(self.path / name, text)

    def finish(self, rows, meta: Mapping[str, Any]) -> None:
        """The run's rows and meta (`reports.write_run`), written aside and renamed into place;
        then the journal is removed and the lock released."""
        staging = self.path / f".writing-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        write_run(staging, rows, finish_meta(meta))
        for item in staging.iterdir():
            os.replace(item, self.path / item.name)
        staging.rmdir()
        record.seal(self.path, len(rows))  # meta.json last, with the digests `report` checks
        self._close_journal()
        (self.path / JOURNAL).unlink(missing_ok=True)
        self.release()

    def _close_journal(self) -> None:
        if self._journal is not None:
            self._journal.close()
            self._journal = None

    def release(self) -> None:
        self._close_journal()
        (self.path / LOCK).unlink(missing_ok=True)


def load_run(path: str | Path, what: str = "run"):
    """(rows, meta) of a run directory; UsageError where it is missing, unreadable or empty."""
    try:
        rows, meta = read_run(path)
    except (OSError, ValueError) as exc:  # missing, empty, truncated or corrupt (pyarrow's errors are ValueErrors)
        raise UsageError(f"{what} {path}: not a readable run ({exc})") from None
    if rows.empty:
        raise UsageError(f"{what} {path}: the run holds no rows")
    return rows, meta


def crashed_file(case: Case, specs: Sequence[str], impl: str) -> Path:
    """The file (under failures/) of a case whose process died in its call: the finding its
    journaled row names (`RunDir.case_started`) and `recover_crashed` saves."""
    return Path(f"{casefile.stem(case.op, ','.join(specs) or impl, case)}-crashed.json")


def recover_crashed(run_dir: str | Path, replay_command: Callable[..., str]) -> list[str]:
    """Save every case a run journaled as started and never finished (its process died during the
    call) under run_dir/failures as a `crashed` finding, once; a line per case, with the command
    that replays it isolated (`replay_command`: `mla_verify.api.replay_command`)."""
    path = Path(run_dir)
    lines = []
    for started in unfinished_cases(path / JOURNAL):
        row, specs = started["started"], tuple(started["impl_specs"])
        case = Case.from_dict(json.loads(row["case"]))
        where = path / "failures" / crashed_file(case, specs, row["impl"])
        if not where.exists():
            cf = casefile.CaseFile(case, specs, row["device"], casefile.failure_summary([Row.from_record(row)]),
                                   note=f"crashed: {CRASHED}", deviations=tuple(started["deviations"]))
            casefile.save(where, cf)
        lines.append(f"crashed: {case.short()} started and never finished ({row['impl']}); case saved: {where}\n"
                     f"  replay: {replay_command(where, specs, row['device'], started['deviations'], isolate=True)}")
    return lines
