"""A Case: the plain-data description of one comparison.

A Case names an op (a public-contract function or a `forward_mqa` path), the structure of its
inputs (shapes, knobs, value regime, scale rule) and a seed. Every tensor is derived from the
seed by its op's `inputs` (`equivalence.ops`), so a Case is small JSON that reads the same on CPU and GPU, and a
saved failure replays without pickles.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

CASE_FORMAT = "mla-verify-case/1"


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class Case:
    op: str
    params: dict[str, Any] = field(default_factory=dict)
    seed: int = 0

    def __post_init__(self) -> None:
        # Round-trip through JSON now so a Case that cannot be saved fails where it is built.
        object.__setattr__(self, "params", json.loads(_canonical(self.params)))

    @property
    def case_id(self) -> str:
        """Stable 12-hex-digit identity of (op, params, seed)."""
        return hashlib.sha1(_canonical(self.to_dict()).encode()).hexdigest()[:12]

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "params": self.params, "seed": self.seed}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Case":
        return cls(op=d["op"], params=d.get("params", {}), seed=int(d.get("seed", 0)))

    def dumps(self) -> str:
        return _canonical(self.to_dict())

    def short(self) -> str:
        """One line for logs: op, the params, the seed."""
        body = ", ".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.op}({body}) seed={self.seed}"
