"""A run's findings: one case file each under the run's failures/, which the rows of its case name.

`Findings` is the store a campaign, the driver's replay of kept and pinned cases and the driver's
bookkeeping after a campaign are handed, in the shape of Hypothesis's example database (handed to
its engine, which never sees a path): `save` writes a new finding, never replacing a file (named
by op, implementation and case, a counter where two share a name), `replace` writes a finding's
file again (the flaky count a re-run found after it was saved), `drop` removes one (the first
failing case, once its minimized case is saved) or hands its rows to another finding (a campaign
that shrank to a case the run replayed already). Each says where the rows go: the rows' `finding`,
and the run's journal (`Journal`: `mla_verify.runs.sink.Sink`, whose `found` record lets a run
that died still name its findings). A finding is never lost to its file: one that cannot be written
(failures/ replaced by a file, a full disk) is printed whole on stderr, to be saved by hand, and the
run goes on to its verdict.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Protocol, Sequence

from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.judge.rows import Row

from . import casefile


class Journal(Protocol):
    def found(self, rows: list[Row], name: str) -> None:
        """The case of these rows (journaled already) is now the finding saved as `name` ("": no longer)."""


@dataclass(frozen=True)
class UnderTest:
    """What a run tests, as a saved case file names it for its replay."""

    specs: tuple[str, ...] = ()           # the implementation as --impl strings
    label: str = ""                       # the rows' name for it (case files are named by it)
    deviations: tuple[str, ...] = ()
    conventions: tuple[str, ...] = ()
    device: str = "cpu"


class Findings:
    """The findings of a run writing into `directory` (its case files under directory/failures)."""

    def __init__(self, directory: str | Path, journal: Journal | None = None):
        self.directory = Path(directory) / "failures"
        self.journal = journal
        self._held: dict[Path, casefile.CaseFile] = {}  # what each finding's file holds

    def save(self, tested: UnderTest, case: Case, rows: Sequence[Row], note: str, *, flaky: tuple[int, int] | None = None,
             unshrunk: Case | None = None, journaled: bool = True) -> Path | None:
        """`case` of `tested` as a new finding, with its failing `rows` and `note` (`unshrunk`: the
        case it was minimized from): its file (None: it could not be written), which the rows name,
        and where they were `journaled` already the journal is told."""
        cf = casefile.CaseFile(case, tested.specs, tested.device, casefile.failure_summary(rows), note=note,
                               deviations=tested.deviations, flaky=flaky, conventions=tested.conventions,
                               unshrunk=unshrunk)
        stem = casefile.stem(case.op, tested.label or ",".join(tested.specs), case)
        path = self._written(cf, lambda: casefile.save_new(self.directory, stem, cf))
        if path is not None:
            self._held[path] = cf
        self._name(rows, path, journaled)
        return path

    def replace(self, path: Path, note: str, flaky: tuple[int, int] | None) -> None:
        """The finding saved at `path`, written again with `note` and its `flaky` count."""
        cf = self._held[path] = replace(self._held[path], note=note, flaky=flaky)
        self._written(cf, lambda: casefile.save(path, cf))

    def drop(self, path: Path, rows: Sequence[Row], instead: Path | None = None) -> None:
        """The finding at `path` is none any more: its file goes, and its `rows` name `instead` (a
        finding of the same case saved already) or nothing."""
        self._name(rows, instead, True)
        self._held.pop(path, None)
        path.unlink(missing_ok=True)

    def _written(self, cf: casefile.CaseFile, write: Callable[[], Path]) -> Path | None:
        try:
            return write()
        except OSError as exc:
            print(f"mla-verify: the failing case could not be saved under {self.directory} ({exc.strerror or exc}); "
                  f"here it is whole, save it as a .json file to replay it:\n{casefile.text(cf)}", file=sys.stderr,
                  flush=True)
            return None

    def _name(self, rows: Sequence[Row], path: Path | None, journaled: bool) -> None:
        name = path.name if path is not None else ""
        for r in rows:
            r.finding = name
        if journaled and self.journal is not None and rows:
            self.journal.found(list(rows), name)
