"""A property as a Spec (`equivalence.spec`): its targets, their base problems and draws, and
how its rows are made.

As in `ops.base`, the implementation runs on poisoned outputs with seeded generators and may
raise (a failure of the case, one row); every stage call is guarded (`equivalence.sandbox.call_guards`:
inputs read-only, no output aliasing an input); the problems are built before it runs, so a
harness error stays ours. `mismatch_frac` of a property row is the fraction of elements that
differ bit for bit, whatever the bound (0: the property held bitwise); float64 answers (a merge)
have no bits to compare (NaN). Zeros are compared without their sign: a sum that starts from +0
(a merge, a block of invalid keys folded in) turns -0 into +0, and the sign of a zero is not a value.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from hypothesis import strategies as st

from mla_verify.optimized import registry

from ..cases import cost
from ..cases.case import Case
from ..cases.draws import SEEDS
from ..cases.profiles import Profile
from ..cases.schema import OneOf, Params, param
from ..errors import UsageError
from ..judge import metrics as M, mismatch
from ..judge.oracle import measure, verdict
from ..judge.policy import EXACT, property_bounds
from ..judge.rows import Row, RowContext
from ..sandbox.call_guards import Snapshot, guarded
from ..sandbox.device import device_type
from ..sandbox.calls import Raised, call_implementation, input_rows, judged_row, raised_row
from ..sandbox.produced import Compared, Produced
from ..spec import SPECS, op_of
from ..subject import Subject, stage_overrides

PREFIX = "property:"


def property_op(name: str) -> str:
    """A property's op, "property:NAME", for NAME or "property:NAME"."""
    return name if name.startswith(PREFIX) else PREFIX + name


Inputs = dict[str, Any]


@dataclass(frozen=True)
class Target:
    name: str                                    # the op whose base problem it poses (its params, its knobs)
    stages: Callable[[Any], list[str]]           # registry stages a case of these params calls
    under_test: tuple[str, ...]                  # stages whose implementations the target exercises
    inputs: Callable[[Any, int, str], Inputs]    # (params, seed, device) -> the base problem
    check: Callable[[Inputs, Any, registry.Resolved], list[Compared]]
    knobs: Callable[[Any], dict[str, Any]]       # the rows' knob columns
    draw: Callable[[Profile], st.SearchStrategy[dict]]  # the base problem plus the property's knobs
    runs: Callable[[Any], int] = lambda p: 2     # times the check runs the base problem's work (equivalence.cases.cost)


@dataclass(frozen=True)
class NoKnobs:
    """The fields of a property without knobs of its own."""


@functools.cache
def _params_class(own: type, base: type[Params], targets: tuple[str, ...]) -> type[Params]:
    """A case's params on one target: the target op's (`base`), the property's own fields
    (`own`, a frozen dataclass whose fields have defaults or are keyword-only) and the target."""
    clash = {f.name for f in dataclasses.fields(own)} & {f.name for f in dataclasses.fields(base)}
    if clash:  # the property's field would silently replace the op's
        raise TypeError(f"{own.__name__} redefines {base.__name__}'s {', '.join(sorted(clash))}")
    return dataclasses.make_dataclass(f"{own.__name__}On{base.__name__}",
                                      [("target", str, param(OneOf(*targets), kw_only=True))],
                                      bases=(own, base), frozen=True)


def _unsigned_zeros(t: torch.Tensor) -> torch.Tensor:
    return t + 0 if t.is_floating_point() else t  # -0 + 0 = +0; all else, infinities and NaN too, unchanged


@dataclass(frozen=True)
class PropertySpec:
    short: str                                   # NAME of "property:NAME"
    checks: tuple[str, ...]
    targets: Mapping[str, Target]
    doc: str
    own_params: type = NoKnobs   # the property's own knobs (a frozen dataclass of `schema.param` fields)
    family: str = "property"
    own_processes: bool = False
    ranks: tuple[int, ...] = ()
    stage: None = None           # no stage of its own: it calls the stages of its targets
    tag: str = "property: needs no reference"

    @property
    def name(self) -> str:
        return PREFIX + self.short

    def facts(self, device: str) -> list[str]:
        return [f"checks: {', '.join(self.checks)}", f"targets (--path): {', '.join(self.targets)}",
                f"implementations here (--impl NAME): {', '.join(self.subjects(device)) or 'none'}"]

    def params_class(self, target: str) -> type[Params]:
        return _params_class(self.own_params, SPECS[target].spec.params, tuple(self.targets))

    def params_of(self, data: Mapping) -> Params:
        """A case's params (its JSON) as its target's dataclass."""
        return self.params_class(data["target"]).of(data)

    def target(self, params: Params) -> Target:
        return self.targets[params.target]

    def inputs(self, params: Params, seed: int, device: str) -> Inputs:
        """The base problem a case of these params poses (its target's), as the check is handed it."""
        return self.target(params).inputs(params, seed, device)

    def validate(self, params: Mapping) -> None:
        target = params.get("target")
        if not isinstance(target, str) or target not in self.targets:
            raise ValueError(f"{self.name}: target {target!r} is not one of {', '.join(self.targets)}")
        self.params_class(target).parse(self.name, params)

    def strategy(self, profile: Profile, path: str | None = None, world_size: int | None = None) -> st.SearchStrategy[Case]:
        """Cases on target `path`, or on any of the targets."""
        if world_size is not None:
            raise KeyError(f"{self.name} runs in one process; --world-size applies to an op of ranks")
        if path is not None and path not in self.targets:
            raise KeyError(f"{self.name} has no target {path!r}; targets: {', '.join(self.targets)}")
        names = [path] if path is not None else list(self.targets)
        params = st.one_of(*(self.targets[t].draw(profile).map(lambda d, t=t: {"target": t, **d}) for t in names))
        return st.builds(lambda d, seed: Case(self.name, d, seed), params, SEEDS)

    def examples(self, profile: Profile) -> int:
        return profile.property_examples

    def interpreted_s(self, params: Params) -> float:
        """The Triton interpreter's seconds for a case (equivalence.cases.cost): its check's runs of the base problem."""
        return cost.interpreted_s(params, self.target(params).runs(params))

    def identity(self, case: Case, params: Params | None = None) -> dict[str, Any]:
        """The rows' columns: op "property", path NAME, the case, the target's knobs (`params`: the
        case's params, typed already)."""
        params = self.params_of(case.params) if params is None else params
        return dict(op="property", path=self.short, case=json.dumps(case.to_dict(), sort_keys=True),
                    **self.target(params).knobs(params))

    def covered(self, stages: Iterable[str]) -> list[str]:
        """Targets that exercise one of `stages` (an --impl's overrides); none given: every target."""
        stages = set(stages)
        return [t.name for t in self.targets.values() if not stages or stages & set(t.under_test)]

    def subject(self, specs: Sequence[str], device: str, deviations: Sequence[str] = ()) -> Subject:
        """The registry's preferred implementation of every stage, with the --impl strings'
        replacements (a property calls several stages: a MODULE:CALLABLE must name its STAGE=)."""
        overrides, wholes = stage_overrides(specs, device, deviations)
        if wholes:
            raise UsageError(f"--impl {wholes[0]!r}: {self.name} calls several stages; name the one it replaces "
                             f"(STAGE={wholes[0]})")
        if not self.covered(overrides):
            under_test = sorted({st for t in self.targets.values() for st in t.under_test})
            raise UsageError(f"--impl {', '.join(specs)} replaces none of the stages {self.name} tests "
                             f"({', '.join(under_test)})")
        return Subject(",".join(specs) or "preferred", overrides=overrides, specs=tuple(specs), declared=tuple(deviations))

    def subjects(self, device: str) -> dict[str, tuple[str, ...]]:
        """One subject per implementation name of the stages under test that runs on `device`."""
        names: dict[str, None] = {}
        for target in self.targets.values():
            for stage in target.under_test:
                names.update((i.name, None) for i in registry.implementations(stage) if i.why_not(device) is None)
        return {name: (name,) for name in names}

    def campaigns(self, subject: Subject) -> list[str | None]:
        covered = self.covered(subject.overrides)
        return [None] if len(covered) == len(self.targets) else covered

    def path_for(self, path: str | None, subject: Subject) -> str | None:
        """The target to draw on: the one the subject covers when it covers one."""
        covered = self.covered(subject.overrides)
        if path is None and len(covered) == 1:
            return covered[0]
        if (path is None and len(covered) < len(self.targets)) or path not in (None, *covered):
            raise UsageError(f"--path: {self.name} with this --impl runs on one of {', '.join(covered)}")
        return path

    def evaluate(self, case: Case, subject: Subject, context: RowContext) -> list:
        """Every tensor the property compares, as a Row (a single failure row if the
        implementation raised); the context's `notes` collect the stages that fell back from their
        preferred implementation; its `on_call` runs just before the implementation is first called."""
        produced = self.produce(case, subject, context, on_host=False)
        if context.notes is not None:
            context.notes.update(produced.notes)
        return self.judge_produced(case, produced, context)

    def evaluate_block(self, cases: Sequence[Case], subject: Subject, context: RowContext) -> list[list]:
        """`evaluate` of each case: a property's cases pose problems of their own, judged one by one."""
        return [self.evaluate(case, subject, context) for case in cases]

    def prepare_block(self, cases: Sequence[Case], device: str = "cpu") -> None:
        """Nothing: a property's problems are posed by what its calls return."""

    def judge_produced_block(self, cases: Sequence[Case], produced: Sequence[Produced], context: RowContext,
                             prepared: None = None) -> list[list]:
        return [self.judge_produced(case, p, context) for case, p in zip(cases, produced)]

    def produce(self, case: Case, subject: Subject, context: RowContext, inputs: None = None,
                on_host: bool = True) -> Produced:
        """The implementation's side of `case`: the comparisons its calls make (copied to the host
        for a judge in another process, `on_host`) and the rows only this side can make (it
        raised, wrote an input)."""
        params, device = self.params_of(case.params), context.device
        target = self.target(params)
        stages = registry.resolve(target.stages(params), device_type(device), subject.overrides)
        deviations = tuple(sorted({d for impl in stages.chosen.values() for d in impl.deviations}))
        base = context.base(case, self.identity(case, params), stages.pairs())
        inputs = target.inputs(params, case.seed, device)
        saved = Snapshot(inputs)
        try:
            compared, t_impl = call_implementation(lambda: target.check(inputs, params, guarded(stages, op_of)),
                                                   case.seed, device, context.on_call)
        except Raised as raised:  # the implementation's failure is the case's result, not ours
            return Produced.failed_case(raised_row(base, raised))
        notes = tuple(f"{stage}: {why}" for stage, why in stages.fallbacks.items())
        rows = [r.to_record() for r in input_rows(base, saved.changed(), time_impl_s=t_impl)]
        if on_host:
            compared = [dataclasses.replace(c, got=_host(c.got), base=_host(c.base), scale=_host(c.scale))
                        for c in compared]
        return Produced(rows, stages=stages.pairs(), deviations=deviations, notes=notes, t_impl=t_impl,
                        compared=compared)

    def judge_produced(self, case: Case, produced: Produced, context: RowContext) -> list:
        """The rows of `case` from what `produce` made: every comparison judged here."""
        rows = [Row.from_record(r) for r in produced.rows]
        if produced.failed:
            return rows
        params = self.params_of(case.params)
        base = context.base(case, self.identity(case, params), produced.stages)
        for c in produced.compared:
            kind, bounds, deviation = property_bounds(f"{self.short}.{c.check}", c.kind, produced.deviations)
            got, want = _unsigned_zeros(c.got), _unsigned_zeros(c.base)
            m = measure(kind, got, want, c.scale)
            if kind != EXACT:
                m.mismatch_frac = M.exact(got, want).mismatch_frac if got.dtype == want.dtype else math.nan
            rows.append(judged_row(base, f"{c.check}.{c.tensor}", "exact" if kind == EXACT else c.tensor,
                                   verdict(kind, m, bounds, deviation,
                                           lambda: mismatch.Pair(f"{c.check}.{c.tensor}", got, want, c.scale)),
                                   check=c.check, time_impl_s=produced.t_impl))
        return rows


def _host(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to("cpu", copy=True)
