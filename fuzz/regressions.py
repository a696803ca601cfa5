"""The regression corpus (fuzz/corpus/<op>.json): fixed cases the gate always runs first."""

from __future__ import annotations

import json
from pathlib import Path

from mla_verify.equivalence.cases.case import Case

CORPUS_DIR = Path(__file__).parent / "corpus"


def corpus(op: str) -> list[tuple[Case, str]]:
    """(case, why) for every pinned case of `op`."""
    path = CORPUS_DIR / f"{op}.json"
    if not path.exists():
        return []
    return [(Case.from_dict(entry), entry.get("why", "")) for entry in json.loads(path.read_text())]
