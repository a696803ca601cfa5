"""Saved cases: a failing case as a small JSON file that `mla-verify replay FILE` re-runs exactly.

The file holds the Case itself (op, params, seed), the implementation spec that failed and the
deviations declared for it, the device, and the failure as it was seen, so a reader knows what
to expect before replaying.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mla_verify.equivalence.case import CASE_FORMAT, Case


@dataclass
class CaseFile:
    case: Case
    impl: tuple[str, ...] = ()
    device: str = "cpu"
    failure: list[dict[str, Any]] = field(default_factory=list)
    note: str = ""
    deviations: tuple[str, ...] = ()  # declared for the implementation (--deviation)

    def to_dict(self) -> dict[str, Any]:
        return {"format": CASE_FORMAT, "case": self.case.to_dict(), "impl": list(self.impl), "device": self.device,
                "failure": self.failure, "note": self.note, "deviations": list(self.deviations)}


def save(path: Path, cf: CaseFile) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cf.to_dict(), indent=2, sort_keys=True) + "\n")
    return path


def load(path: Path) -> CaseFile:
    data = json.loads(Path(path).read_text())
    if data.get("format") != CASE_FORMAT:
        raise ValueError(f"{path}: not an mla-verify case file (format {data.get('format')!r}, expected {CASE_FORMAT!r})")
    return CaseFile(Case.from_dict(data["case"]), tuple(data.get("impl", ())), data.get("device", "cpu"),
                    data.get("failure", []), data.get("note", ""), tuple(data.get("deviations", ())))


def failure_summary(rows) -> list[dict[str, Any]]:
    return [{"tensor": r.tensor, "metric": r.gate_metric, "value": r.value, "bound": r.bound, "reason": r.reason}
            for r in rows if not r.passed]
