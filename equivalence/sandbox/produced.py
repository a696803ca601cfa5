"""What an implementation's process hands its judge, and its one form on the worker's pipe.

`Produced` is plain data with every tensor on the host: made where the implementation ran
(`OpSpec.produce`, `PropertySpec.produce`), judged where the reference runs. Where the two are
processes apart (an isolation worker and its judge), `to_header` writes it as a message's header
and tensors (`equivalence.sandbox.wire` frames them) and `from_header` reads it back, field by
field with size bounds, never unpickled. Its rows cross as findings only (tensor, gate_metric,
reason, written): each can only fail its case, and the judge gives them their identity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..judge.policy import Kind
from ..judge.rows import FailureKind, Row, Stages
from . import wire

# What the worker may say about a case besides its outputs: each only ever fails it (or declines
# it, as the implementation may itself: `calls.unsupported`), and the judge makes the row.
FINDINGS = (FailureKind.RAISED, FailureKind.CONTRACT, FailureKind.INPUT_WRITTEN, FailureKind.UNSUPPORTED)
FINDING_FIELDS = ("tensor", "gate_metric", "reason", "written")  # a row's record less its identity and numbers
COMPARED_KINDS = tuple(Kind)  # how a tensor is measured (judge.policy)


@dataclass(frozen=True)
class Compared:
    """One tensor a property's check holds to another: `got` (the transformed problem's answer)
    against `base` (the plain problem's), measured as policy kind `kind`."""

    check: str
    tensor: str                      # out | lse | indices
    kind: str                        # exact | out | lse (the tensor's nature; PROPERTY_RULES may compare it exactly)
    got: torch.Tensor
    base: torch.Tensor
    scale: torch.Tensor | None = None  # lse: the logit scale of each row


@dataclass
class Produced:
    """What an implementation's process sends its judge: the rows it could make itself (as
    records; read from a header, their findings: FINDING_FIELDS) and, unless it `failed`
    outright, its outputs on the host with the device each was returned on and the reasons some
    break the contract (an op), or its comparisons (a property)."""

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
    compared: list[Compared] = field(default_factory=list)  # a property's comparisons (tensors on the host)
    # A pipeline's stage calls, plain and fed (`stages.traced`), each `stages.Call`'s fields as a dict
    stage_calls: tuple[list[dict], list[dict]] = field(default_factory=lambda: ([], []))
    # The keywords each stage was handed (`call_guards.CALLED_WITH`), where the calls ran apart
    called: dict[str, list[str]] = field(default_factory=dict)
    # The threads the call left running (their names cross). Stay with the implementation's
    # process: the outputs as returned against the copies above (`guards.Returned`, checked there
    # later for a write after return) and whether the call left a CUDA error (`Row.device_error`:
    # its process retires).
    threads: list = field(default_factory=list)
    returned: Any = None
    device_error: bool = False

    @classmethod
    def failed_case(cls, row: Row) -> "Produced":
        """A case that failed as a whole (its implementation raised): its one row."""
        return cls([row.to_record()], failed=True, device_error=row.device_error)

    def to_header(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """(header, tensors): this record as a message's data (`wire.encode` frames it), each
        tensor named by its place in `tensors` (one a tensor, however often it is named)."""
        tensors: list[torch.Tensor] = []
        at: dict[int, int] = {}

        def index(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            if id(t) not in at:  # a tensor handed twice (an output a comparison holds too) crosses once
                at[id(t)] = len(tensors)
                tensors.append(t)
            return at[id(t)]

        header = dict(
            findings=[{"tensor": r["tensor"], "metric": r["gate_metric"], "reason": r["reason"],
                       "written": r.get("written", "")} for r in self.rows],
            outputs={name: index(t) for name, t in self.tensors.items()},
            devices=self.devices, strides={k: list(v) for k, v in self.strides.items()}, problems=self.problems,
            stages=self.stages, deviations=list(self.deviations), path=self.path, notes=list(self.notes),
            t_impl=self.t_impl, threads=[getattr(t, "name", t) for t in self.threads], called=self.called,
            compared=[dict(check=c.check, tensor=c.tensor, kind=c.kind, got=index(c.got), base=index(c.base),
                           scale=index(c.scale)) for c in self.compared])
        header["stage_calls"] = wire.calls_out(self.stage_calls, tensors)
        return header, tensors

    @classmethod
    def from_header(cls, header: dict[str, Any], known_deviations: Any) -> "Produced":
        """The record a "produced" header holds (its tensors decoded: `wire.Reader.read`), checked
        field by field; `wire.Unreadable` for anything out of place. A deviation must be one of
        `known_deviations`. Its rows are the findings, as records of FINDING_FIELDS; it failed
        outright where one is the whole case's (tensor "*") or a decline."""
        tensors = header["tensors"]

        def tensor(i: Any, optional: bool = False) -> torch.Tensor | None:
            if i is None and optional:
                return None
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(tensors):
                raise wire.Unreadable(f"it names tensor {str(i)[:20]}, which it did not send")
            return tensors[i]

        rows = []
        for f in wire.listed(header.get("findings", []), "findings", 4096):
            if not isinstance(f, dict) or f.get("metric") not in FINDINGS:
                raise wire.Unreadable(f"a finding is not one of {', '.join(FINDINGS)}")
            rows.append(dict(zip(FINDING_FIELDS, (wire.text(f, "tensor"), f["metric"], wire.text(f, "reason"),
                                                  wire.text(f, "written")))))
        outputs = header.get("outputs", {})
        if not isinstance(outputs, dict) or len(outputs) > wire.MAX_TENSORS:
            raise wire.Unreadable("its outputs are not an object")
        deviations = wire.texts(header.get("deviations"), "deviations")
        if unknown := [d for d in deviations if d not in known_deviations]:
            raise wire.Unreadable(f"it declares deviations {unknown[:3]} that mla-verify does not know")
        compared = []
        for c in wire.listed(header.get("compared", []), "compared", 4096):
            if not isinstance(c, dict) or c.get("kind") not in COMPARED_KINDS:
                raise wire.Unreadable("a comparison is not an object of a known kind")
            compared.append(Compared(wire.text(c, "check"), wire.text(c, "tensor"), c["kind"], tensor(c.get("got")),
                                     tensor(c.get("base")), tensor(c.get("scale"), optional=True)))
        return cls(rows, failed=any(r["tensor"] == "*" or r["gate_metric"] == FailureKind.UNSUPPORTED for r in rows),
                   tensors={wire.name(k): tensor(i) for k, i in outputs.items()},
                   devices=wire.strings(header.get("devices")),
                   strides={wire.name(k): tuple(wire.ints(v)) for k, v in wire.mapping(header.get("strides")).items()},
                   problems=wire.strings(header.get("problems")), stages=wire.pairs(header.get("stages")),
                   deviations=tuple(deviations), path=wire.text(header, "path", None),
                   notes=tuple(wire.texts(header.get("notes"), "notes")),
                   t_impl=wire.number(header.get("t_impl", math.nan), "t_impl"), compared=compared,
                   called={wire.name(k): wire.texts(v, "keywords") for k, v in wire.mapping(header.get("called")).items()},
                   threads=wire.texts(header.get("threads"), "threads"),
                   stage_calls=wire.calls_in(header.get("stage_calls", []), tensor, known_deviations))
