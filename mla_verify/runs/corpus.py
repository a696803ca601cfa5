"""A kept corpus: the findings of earlier runs, kept in a directory a CI cache or a repository holds,
and replayed first by every run that names it (`--corpus DIR`, `corpus=`, `--mla-verify-corpus`).

Each finding is added as the case file `failures/` holds (plain JSON that `mla-verify replay`
reads), named by a hash of what makes it the same finding: op, params, seed, implementation,
declared deviations and conventions. A rerun that finds it again adds nothing; a case that passes
now stays, a regression test of the fix. Files are written aside and linked into place, never
replacing one, so shards and parallel parts may add to one directory at once. A file whose name is
not the hash of the finding it holds is refused (a usage error naming it), and one squatting the
name a finding takes (another finding, or no case at all) is replaced by the finding: a name taken
beforehand never keeps a finding out.

A kept case applies to a run's unit (op and implementation, `runs.units.Unit`) by what it
exercises: its op, and every implementation its `--impl` strings name (an op's kernel; for a
pipeline or a property each stage it replaced, `STAGE=SPEC`) named by the unit too, whatever else
the unit names: a finding kept by a gate of one kernel is replayed by a gate of that kernel and
others (`applies`). It is replayed before the unit's pinned corpus and campaigns, whatever the
run's seed, and its rows have source "kept"; the run says how many kept cases of the ops it judges
it did not replay (`not_replayed`). A kept or pinned case that fails is a finding of the run like a
campaign's: saved under the run's failures/ (`save_replayed`, through the run's `Findings`), and a
pinned one is kept here too.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Iterable, Sequence

from mla_verify.equivalence import catalog
from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.errors import UsageError
from mla_verify.fuzz import casefile
from mla_verify.fuzz.findings import Findings, UnderTest


class Replay(StrEnum):
    """Where a case replayed before the campaigns comes from: its rows' source."""

    KEPT = "kept"      # a kept corpus's (this module)
    PINNED = "corpus"  # the pinned regression corpus's (fuzz/corpus)


@dataclass(frozen=True)
class Kept:
    """A case of the corpus: its file and what it holds."""

    path: Path
    saved: casefile.CaseFile = field(compare=False)

    @property
    def case(self) -> Case:
        return self.saved.case


def applies(kept: Kept, op: str, specs: Sequence[str]) -> bool:
    """Whether `kept` applies to a unit of `op` judging the --impl strings `specs`: the same op, and
    each implementation the kept case names (its kernel, or each replaced stage as STAGE=SPEC) named
    there too; a case kept with none (the project's own implementations) only where none is named."""
    impl = kept.saved.impl
    return kept.case.op == op and (set(impl) <= set(specs) if impl else not specs)


def name(cf: casefile.CaseFile) -> str:
    """The file name of a finding: its op and a hash of what makes it the same finding."""
    what = {"case": cf.case.to_dict(), "impl": list(cf.impl), "deviations": sorted(cf.deviations),
            "conventions": sorted(cf.conventions)}
    digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
    return f"{casefile.slug(cf.case.op.replace(':', '-'))}-{digest}.json"


class Corpus:
    """The kept corpus in `directory` (made when the first finding is added)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise UsageError(f"--corpus {directory}: not a directory")
        self._cases: list[Kept] | None = None

    def cases(self) -> list[Kept]:
        """Every kept case, by file name; a file that is no case file is a usage error naming it."""
        if self._cases is None:
            found = []
            for path in sorted(self.directory.glob("*.json")) if self.directory.is_dir() else []:
                try:
                    kept = Kept(path, casefile.load(path))
                except (OSError, ValueError) as exc:
                    raise UsageError(f"--corpus {self.directory}: {path.name}: {exc}") from None
                if path.name != name(kept.saved):
                    raise UsageError(f"--corpus {self.directory}: {path.name}: its name is not the hash of the "
                                     f"finding it holds ({name(kept.saved)}): not a file mla-verify kept; remove it")
                found.append(kept)
            self._cases = found
        return self._cases

    def applying(self, op: str, specs: Sequence[str]) -> tuple[Kept, ...]:
        """The kept cases a unit of `op` judging the --impl strings `specs` replays (`applies`), each
        case once (two kernels' gates may each have kept it)."""
        once = {}
        for k in self.cases():
            if applies(k, op, specs):
                once.setdefault(k.case.case_id, k)
        return tuple(once.values())

    def add(self, case_file: Path) -> Path | None:
        """Keep the finding saved in `case_file`: its path in the corpus, None if it was kept already."""
        cf = casefile.load(case_file)
        target = self.directory / name(cf)
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{target.name}.")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(cf.to_dict(), indent=2, sort_keys=True) + "\n")
            os.chmod(tmp, 0o644)
            try:
                os.link(tmp, target)  # never replaces: a finding kept already (by this or a concurrent run) stays
            except FileExistsError:
                if _holds(target, target.name):
                    return None
                os.replace(tmp, target)  # a squatter: the name is the finding's
        finally:
            Path(tmp).unlink(missing_ok=True)
        self._cases = None
        return target


def _holds(path: Path, file_name: str) -> bool:
    """Whether `path` is a case file of the finding `file_name` names."""
    try:
        return name(casefile.load(path)) == file_name
    except (OSError, ValueError):
        return False


@dataclass(frozen=True)
class Replayed:
    """A kept or pinned case that failed when replayed first: a finding of this run."""

    case: Case
    rows: list
    path: Path | None  # its case file under the run's failures/ (None: it could not be written)
    source: Replay
    kept_as: str    # a kept case's file name in the corpus ("" for a pinned one)


def save_replayed(findings: Findings, tested: UnderTest, case: Case, rows: list, source: Replay,
                  whence: str) -> Replayed:
    """Save the failing kept or pinned `case` in the run's `findings` as the finding its rows name
    (`Row.finding`): one file a finding, whichever way the run came to it. `whence`: a kept case's
    file name in the corpus, or why a pinned case is pinned."""
    kept_as = whence if source == Replay.KEPT else ""
    note = f"from the kept corpus ({kept_as}): it still fails" if kept_as else f"a pinned regression case: {whence}"
    return Replayed(case, rows, findings.save(tested, case, rows, note, journaled=False), source, kept_as)


def with_kept(units: list, corpus: Corpus | None) -> list:
    """`units` (`runs.units.Unit`s) each with the corpus's cases that apply to it."""
    if corpus is None:
        return units
    return [replace(u, kept=corpus.applying(u.op, u.specs)) for u in units]


def not_replayed(corpus: Corpus | None, units: Sequence, ops: Sequence[str] = (), run: str = "gate") -> list[str]:
    """The line that counts the kept cases of the ops the `run` judges (`ops`: those it was narrowed
    to, none: every op) that none of its `units` replays: they name implementations it does not."""
    if corpus is None:
        return []
    judged = set(catalog.select(list(ops))) if ops else None
    left = sum(1 for k in corpus.cases() if (judged is None or k.case.op in judged)
               and not any(applies(k, u.op, u.specs) for u in units))
    if not left:
        return []
    return [f"{left} kept case{'s' * (left != 1)} not replayed ({'they name' if left != 1 else 'it names'} "
            f"implementations this {run} does not)"]


def keep(corpus: Corpus | None, findings: Iterable[Path | None], rows) -> list[str]:
    """Add each of the run's findings (case files: the campaigns', the pinned cases' that failed)
    to the corpus; the lines that say what the corpus did this run."""
    if corpus is None:
        return []
    added = [corpus.add(path) for path in findings if path is not None]
    return ([line] if (line := summary(rows)) else []) + [f"kept in the corpus: {p}" for p in added if p]


def outcome(rows) -> tuple[list[str], list[str]]:
    """(case ids that still fail, case ids that pass now) among the kept cases' rows."""
    verdict: dict[str, bool] = {}
    for r in rows:
        if r.source == Replay.KEPT:
            verdict[r.case_id] = verdict.get(r.case_id, True) and bool(r.passed)
    return [c for c, ok in verdict.items() if not ok], [c for c, ok in verdict.items() if ok]


def summary(rows) -> str | None:
    """'from the corpus: 2 still fail, 1 now passes' (None: no kept case ran)."""
    failing, passing = outcome(rows)
    if not failing and not passing:
        return None
    fail = f"{len(failing)} still fail{'s' if len(failing) == 1 else ''}"
    now = f"{len(passing)} now pass{'es' if len(passing) == 1 else ''}"
    return f"from the corpus: {fail}, {now}"
