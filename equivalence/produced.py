"""What an implementation's process hands its judge when the two are apart (an isolation worker
and its parent): plain data, with every tensor on the host (`equivalence.sandbox.wire` sends it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .judge.rows import Row, Stages


@dataclass
class Produced:
    """What an implementation's process sends its judge (`OpSpec.produce`, `PropertySpec.produce`):
    the rows it could make itself (as records) and, unless it `failed` outright, its outputs on
    the host with the device each was returned on and the reasons some break the contract (an
    op), or its comparisons (a property)."""

    rows: list[dict]
    failed: bool = False
    tensors: dict = field(default_factory=dict)
    devices: dict[str, str] = field(default_factory=dict)
    strides: dict[str, tuple[int, ...]] = field(default_factory=dict)  # outputs returned not contiguous (the copy is)
    problems: dict[str, str] = field(default_factory=dict)
    stages: Stages = ()  # (stage, impl) pairs (`equivalence.judge.rows.Stages`)
    deviations: tuple[str, ...] = ()
    path: str | None = None
    notes: tuple[str, ...] = ()
    t_impl: float = float("nan")
    compared: list = field(default_factory=list)  # a property's comparisons (tensors on the host)
    # A pipeline's stage calls, plain and fed (`stages.traced`), each `stages.Call`'s fields as a dict
    stage_calls: tuple[list[dict], list[dict]] = field(default_factory=lambda: ([], []))
    # Stay with the implementation's process: the outputs as returned against the copies above
    # (`guards.Returned`, checked there later for a write after return) and the threads the call
    # left running (their names cross).
    returned: Any = None
    threads: list = field(default_factory=list)
    device_error: bool = False  # the call left a CUDA error (`Row.device_error`): its process retires

    @classmethod
    def failed_case(cls, row: Row) -> "Produced":
        """A case that failed as a whole (its implementation raised): its one row."""
        return cls([row.to_record()], failed=True, device_error=row.device_error)
