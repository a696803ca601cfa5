"""Saved cases: a failing case as a small JSON file that `mla-verify replay FILE` re-runs exactly.

The file holds the Case itself (op, params, seed), the implementation spec that failed and the
deviations declared for it, the device, and the failure as it was seen, so a reader knows what to
expect before replaying. One file is one finding: a minimized case carries the case it was shrunk
from (`unshrunk`), which `replay` does not run. A case file is data: loading it validates every
parameter against the op's schema (`equivalence.catalog.validate_case`) and imports nothing; the
implementation it names is a hint for the reader.
Files are written whole or not at all (temporary file + rename), and a new file never replaces
another (its name carries op, implementation and case, plus a counter where needed).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mla_verify.equivalence.cases.case import CASE_FORMAT, Case
from mla_verify.equivalence.catalog import validate_case
from mla_verify.equivalence.sandbox.files import read_json

CASE_LIMIT = 2**20  # bytes a case file may have (one is under 4 KiB)


@dataclass
class CaseFile:
    case: Case
    impl: tuple[str, ...] = ()
    device: str = "cpu"
    failure: list[dict[str, Any]] = field(default_factory=list)
    note: str = ""
    deviations: tuple[str, ...] = ()       # declared for the implementation (--deviation)
    flaky: tuple[int, int] | None = None   # (failed k, of n re-runs) when the failure was flaky
    conventions: tuple[str, ...] = ()      # declared for the implementation (--convention KEY=VALUE)
    unshrunk: Case | None = None           # the failing case as found, where `case` was shrunk from it

    def to_dict(self) -> dict[str, Any]:
        return {"format": CASE_FORMAT, "case": self.case.to_dict(), "impl": list(self.impl), "device": self.device,
                "failure": self.failure, "note": self.note, "deviations": list(self.deviations),
                "flaky": list(self.flaky) if self.flaky else None, "conventions": list(self.conventions),
                "unshrunk": self.unshrunk.to_dict() if self.unshrunk else None}


def slug(text: str, limit: int = 48) -> str:
    """`text` as a file-name part: [A-Za-z0-9._-] only."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[:limit] or "impl"


def stem(op: str, impl: str, case: Case) -> str:
    """The file name (without .json) of a failing case: op, implementation, case id."""
    return f"{slug(op.replace(':', '-'))}-{slug(impl or 'default')}-{case.case_id}"


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_MODE = 0o666 & ~_umask()  # what open() would have given: mkstemp makes files private


def text(cf: CaseFile) -> str:
    """The case file as it is written (JSON)."""
    return json.dumps(cf.to_dict(), indent=2, sort_keys=True) + "\n"


def write_atomic(path: Path, text: str) -> Path:
    """Write `text` to `path` through a temporary file in the same directory and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.chmod(tmp, _MODE)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def save(path: Path, cf: CaseFile) -> Path:
    """Write (or update) the case file at `path`."""
    return write_atomic(path, text(cf))


def save_new(directory: Path, name: str, cf: CaseFile) -> Path:
    """A new case file `directory`/`name`.json (`name`-2.json, ... if taken): never replaces one."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.")
    os.chmod(tmp, _MODE)
    with os.fdopen(fd, "w") as f:
        f.write(text(cf))
    try:
        for n in range(1, 10_000):
            path = directory / (f"{name}.json" if n == 1 else f"{name}-{n}.json")
            try:
                os.link(tmp, path)  # fails if the name is taken: no file is ever replaced
                return path
            except FileExistsError:
                continue
        raise FileExistsError(f"{directory}: no free name for {name}")
    finally:
        Path(tmp).unlink(missing_ok=True)


def load(path: Path) -> CaseFile:
    """Read and validate a case file; ValueError (or OSError) with the reason otherwise."""
    data = read_json(path, CASE_LIMIT)
    if not isinstance(data, dict):
        raise ValueError(f"a JSON {type(data).__name__}, not an mla-verify case file")
    if data.get("format") != CASE_FORMAT:
        raise ValueError(f"not an mla-verify case file (format {data.get('format')!r}, expected {CASE_FORMAT!r})")
    case = data.get("case")
    if not isinstance(case, dict):
        raise ValueError("its 'case' is not an object")
    validate_case(case)
    impl = data.get("impl", [])
    if not isinstance(impl, list) or not all(isinstance(s, str) for s in impl):
        raise ValueError("its 'impl' is not a list of strings")
    deviations = data.get("deviations", [])
    if not isinstance(deviations, list) or not all(isinstance(s, str) for s in deviations):
        raise ValueError("its 'deviations' is not a list of strings")
    conventions = data.get("conventions", [])
    if not isinstance(conventions, list) or not all(isinstance(s, str) for s in conventions):
        raise ValueError("its 'conventions' is not a list of strings")
    failure = data.get("failure", [])
    if not isinstance(failure, list) or not all(_saved_row(f) for f in failure):
        raise ValueError("its 'failure' is not a list of saved rows (tensor and metric strings, value and bound numbers)")
    flaky = data.get("flaky")
    if flaky is not None and not (isinstance(flaky, list) and len(flaky) == 2
                                  and all(isinstance(n, int) and not isinstance(n, bool) for n in flaky)):
        raise ValueError("its 'flaky' is not [failed, of re-runs]")
    for key in ("device", "note"):
        if not isinstance(data.get(key, ""), str):
            raise ValueError(f"its {key!r} is not a string")
    unshrunk = data.get("unshrunk")
    if unshrunk is not None:
        if not isinstance(unshrunk, dict):
            raise ValueError("its 'unshrunk' is not a case object")
        validate_case(unshrunk)
    return CaseFile(Case.from_dict(case), tuple(impl), data.get("device", "cpu"), failure, data.get("note", ""),
                    tuple(deviations), tuple(flaky) if flaky else None, tuple(conventions),
                    Case.from_dict(unshrunk) if unshrunk is not None else None)


def _saved_row(f: Any) -> bool:
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    return (isinstance(f, dict) and isinstance(f.get("tensor"), str) and isinstance(f.get("metric"), str)
            and number(f.get("value")) and number(f.get("bound")) and isinstance(f.get("reason", ""), str))


def failure_summary(rows) -> list[dict[str, Any]]:
    return [{"tensor": r.tensor, "metric": r.gate_metric, "value": r.value, "bound": r.bound, "reason": r.reason}
            for r in rows if not r.passed]
