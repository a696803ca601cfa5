"""A run's findings grouped by their cause, where the harness knows it: one bug that reaches an op,
the forward_mqa paths through its stage and the properties that run it reads as one group with its
case files under it, not as ten findings.

A finding (the case file its case's rows name: `Row.finding`) is put down to a kernel, a stage and
the implementation that ran it, where the rows say which:

* a pipeline's: the first stage whose output differs from the reference's stage on the same inputs
  (`Row.differing_stage`, `equivalence.ops.stages`), with the implementation its rows name for it;
* an op's: the op's own stage (the op is one kernel) and its implementation;
* a property's, where its case ran one implementation of the stages it tests: that kernel.

Where they do not (a property of several kernels; a pipeline whose stages were not traced: the
HiSparse paths, a call past an isolation worker's trace cap), the finding joins the one kernel its
case ran that the run's other findings are put down to, where exactly one is, and its line says
so; else it groups by its op (and path) or property and implementation, as does a pipeline every
stage of which matches on its own inputs (how they are put together differs). The failing tensors
and metrics are not part of the cause: one defect moves several (a truncated output's mean error in
the op, its units in a property), and each file's line says its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from mla_verify.equivalence import catalog
from mla_verify.equivalence.judge.rows import QUIET_METRICS

JOINED = "not traced: the one failing kernel its case ran"  # what a finding put down to a kernel so says


@dataclass(frozen=True)
class Cause:
    """What a group of findings is put down to: a kernel (a stage and its implementation) or, where
    none is known, the op (and path) or property they came from and its implementation."""

    impl: str
    stage: str = ""   # the kernel's stage; "" where no kernel is known
    unit: str = ""    # else the op (and path) or property

    def __str__(self) -> str:
        return f"{f'stage {self.stage}' if self.stage else self.unit} ({self.impl})"


@dataclass(frozen=True)
class Finding:
    """A saved case file, the failing row that decides it, and whether its kernel was inferred
    (`JOINED`) rather than read from its rows."""

    name: str
    row: Any  # a `Row`, or a stored row (a frame's itertuples)
    joined: bool = False

    def where(self) -> str:
        r = self.row
        return r.op if r.path in (r.op, "") else f"{r.op} {r.path}"

    def failing(self) -> str:
        r = self.row
        what = (f"{r.tensor} {r.gate_metric}" if r.gate_metric in QUIET_METRICS
                else f"{r.tensor} {r.gate_metric} = {r.value:.4g} > {r.bound:.4g}")
        return what + (f"; {JOINED}" if self.joined else "")


@dataclass
class Group:
    cause: Cause
    findings: list[Finding] = field(default_factory=list)

    def line(self) -> str:
        """'stage convert_index (triton): 6 findings, first forward_mqa bf16: indices mismatch_frac = 0.2 > 0'."""
        n, first = len(self.findings), self.findings[0]
        return f"{self.cause}: {n} finding{'s' * (n != 1)}, first {first.where()}: {first.failing()}"

    def lines(self, indent: str = "  ") -> list[str]:
        """The group's line, and a line per case file under it."""
        return [f"{indent}{self.line()}", *(f"{indent}  {f.name} ({f.where()}: {f.failing()})" for f in self.findings)]


def by_cause(rows: Iterable[Any]) -> list[Group]:
    """The findings the rows name (`Row`s, or a stored frame's itertuples), grouped by cause, the
    largest group first; each group's findings in the rows' order."""
    failing: dict[str, list[Any]] = {}
    for r in rows:
        if r.finding and not r.passed:
            failing.setdefault(r.finding, []).append(r)
    deciding = {name: next((r for r in bad if r.differing_stage), bad[0]) for name, bad in failing.items()}
    known = {name: _known(r) for name, r in deciding.items()}
    kernels = {c for c in known.values() if isinstance(c, Cause) and c.stage}
    groups: dict[Cause, Group] = {}
    for name, r in deciding.items():
        cause, joined = known[name], False
        if not isinstance(cause, Cause):  # the kernels its case ran: the one the other findings name
            named = cause & kernels
            cause, joined = (next(iter(named)), True) if len(named) == 1 else (Cause(r.impl, unit=_unit(r)), False)
        groups.setdefault(cause, Group(cause)).findings.append(Finding(name, r, joined))
    return sorted(groups.values(), key=lambda g: -len(g.findings))


def of_frame(frame: pd.DataFrame) -> list[Group]:
    """`by_cause` of stored rows (as `load_run` returns them: a run written before rows named their
    finding groups nothing, one written before they named their first differing stage what it can)."""
    if "finding" not in frame:
        return []
    return by_cause(frame[~frame["passed"] & (frame["finding"] != "")].itertuples(index=False))


def table(groups: Iterable[Group]) -> pd.DataFrame:
    """A row per finding, group by group: its cause, the group's size, its file, where and what failed."""
    return pd.DataFrame([{"cause": str(g.cause), "findings": len(g.findings), "case file": f.name,
                          "op/path": f.where(), "failing": f.failing()} for g in groups for f in g.findings],
                        columns=["cause", "findings", "case file", "op/path", "failing"])


def lines(groups: Iterable[Group], indent: str = "  ") -> list[str]:
    """Every group's lines (`Group.lines`)."""
    return [line for g in groups for line in g.lines(indent)]


def _unit(r: Any) -> str:
    """The op and path, or property, of row `r` ("forward_mqa bf16", "property determinism")."""
    return Finding("", r).where()


def _known(r: Any) -> Cause | set[Cause]:
    """The cause of the finding whose deciding row is `r`, or the kernels its case ran among which
    it lies (those a property tests; every stage of an untraced pipeline)."""
    stages = dict(r.stages or ())
    if r.differing_stage == r.op:  # a pipeline whose stages each match on their own inputs
        return Cause(r.impl, unit=_unit(r))
    if r.differing_stage:
        return Cause(stages.get(r.differing_stage, r.impl), r.differing_stage)
    try:
        spec = catalog.get_spec(catalog.spec_of_row(r.op, r.path))
    except KeyError:  # an op this version does not know (an old run's)
        return Cause(r.impl, unit=_unit(r))
    if spec.stage is not None:
        return Cause(r.impl, spec.stage)
    tested = {st for target in getattr(spec, "targets", {}).values() for st in target.under_test} or set(stages)
    ran = {Cause(impl, st) for st, impl in stages.items() if st in tested}
    return next(iter(ran)) if len(ran) == 1 and r.op == "property" else ran
