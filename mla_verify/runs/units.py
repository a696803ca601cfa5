"""The units of a run: what it judges in one go, and what the gate deals to its shards. The gate is
every op and forward_mqa path, every implementation that runs on the device, the regression corpus
plus a fuzz budget; then every property (equivalence.properties) for every implementation of the
stages it tests.

Implementations checked per op: every registered one that runs here (on a GPU: flash_mla, our
Triton kernels and the float32 eager ones; on CPU the Triton kernels under the interpreter and
the eager ones), so when one disagrees with the reference and the others do not, the gate names
the odd one out. A property runs once per implementation name (`--impl NAME`: that
implementation for every stage that has one), over the targets it covers.

The multi-process DCP op runs with world size 2 on CPU (two gloo ranks) and on a GPU machine with
the most ranks its GPUs hold one each (2, 4 or 8; a single GPU: 2 gloo ranks sharing it). Its
ranks are processes of their own, so it never runs inside the isolation worker.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from mla_verify.equivalence import catalog
from mla_verify.equivalence.judge.rows import Row
from mla_verify.equivalence.sandbox.device import device_type
from mla_verify.equivalence.spec import Spec
from mla_verify.equivalence.subject import Subject

from . import durations
from .corpus import Kept
from .parts import Shard


def gate_world_size(spec: Spec, device: str) -> int | None:
    """The ranks a multi-process spec runs in the gate: the most its GPUs hold one each, else
    its default (None: a spec of one process)."""
    if not spec.ranks:
        return None
    gpus = 0
    if device == "cuda":
        gpus = torch.cuda.device_count()
    return max([n for n in spec.ranks if n <= gpus], default=spec.ranks[0])


def odd_ones_out(rows: list[Row]) -> list[str]:
    """Cases where some implementations fail and others pass: name the ones that disagree."""
    by_case: dict[tuple[str, str], dict[str, bool]] = defaultdict(dict)
    for r in rows:
        verdict = by_case[(r.op, r.case_id)]
        verdict[r.impl] = verdict.get(r.impl, True) and r.passed
    lines = []
    for (op, case_id), verdict in sorted(by_case.items()):
        bad = sorted(i for i, ok in verdict.items() if not ok)
        if bad and len(bad) < len(verdict):
            lines.append(f"{op} case {case_id}: {', '.join(bad)} disagree(s) with the reference; "
                         f"{', '.join(sorted(i for i, ok in verdict.items() if ok))} agree")
    return lines


@dataclass(frozen=True)
class Unit:
    """What a run judges in one go, and what the gate deals to its shards: one op (or property)
    and implementation, its pinned corpus, and its fuzz campaigns (paths; None: the op's own
    draw). A fuzz run is one unit of the implementation it was given, without the corpus."""

    op: str
    label: str
    specs: tuple[str, ...]
    subject: Subject | None = field(default=None, compare=False, repr=False)  # None: resolved from specs
    paths: tuple[str | None, ...] | None = None  # None: every campaign the spec runs for the subject
    corpus: bool = True
    deviations: tuple[str, ...] = ()
    conventions: tuple[str, ...] = ()
    kept: tuple[Kept, ...] = ()  # a kept corpus's cases that apply to it (runs.corpus.applies), run first

    @property
    def key(self) -> str:
        """How `runs.durations` names the unit: "OP LABEL"."""
        return f"{self.op} {self.label}"

    @property
    def multi_rank(self) -> bool:
        return bool(catalog.get_spec(self.op).ranks)

    def resolved(self, device: str, described: bool = False) -> Subject:
        """The implementation under test, labelled as the rows name it; `described`: a user's
        callable read from its source, never imported here (its isolation worker imports it)."""
        if self.subject is not None:
            return self.subject
        subject = catalog.resolve_subject(self.op, self.specs, device_type(device), described=described)
        return Subject(self.label, subject.fn, subject.overrides, subject.deviations, self.specs)

    def campaigns(self, subject: Subject) -> tuple[str | None, ...]:
        return tuple(catalog.get_spec(self.op).campaigns(subject)) if self.paths is None else self.paths


def units(ops: list[str] | None, device: str) -> list[Unit]:
    """The gate's units for `ops` (None: every op and property) on `device`, in catalog order."""
    kind = device_type(device)
    return [Unit(op, label, tuple(specs)) for op in catalog.select(ops or ["op", "property"])
            for label, specs in catalog.get_spec(op).subjects(kind).items()]


def shard_units(ops: list[str] | None, device: str, shard: Shard, chosen: list[Unit] | None = None,
                seconds: Mapping[str, float] | None = None) -> list[Unit]:
    """The units of shard `shard` (`runs.parts`: the multi-rank ones dealt first; by each unit's
    `seconds` last time where given, `runs.durations`) among `chosen` (None: the gate's `units`)."""
    every = units(ops, device) if chosen is None else chosen
    return shard.deal(every, [u.multi_rank for u in every], durations.weights([u.key for u in every], seconds))
