"""The one protocol of everything the harness checks, and the table of what implements it.

An op of the public contract (`ops.base.OpSpec`), a pipeline (`ops.forward`: forward_mqa, and
`ops.dcp`'s multi-process `dcp`) and a property (`properties.base.PropertySpec`) each answer the
same questions; the CLI, the library API, the gate, replay and the isolation worker ask them and
never what kind of thing they hold (torch's `_comparison.Pair` idea: each handles its own inputs).

    params_of(data)             a case's params (its JSON) as the spec's frozen dataclass
                                (`schema.Params`: fields with their types and ranges)
    validate(data)              the same, checked field by field (replay checks files here)
    strategy(profile, path)     Hypothesis cases within a fuzz profile (`path`: a pipeline's path, a
                                property's target)
    examples(profile)           the profile's fuzz budget for one campaign
    interpreted_s(params)       the Triton interpreter's seconds for a case (`equivalence.cases.cost`): a
                                CPU campaign of interpreted kernels draws within the profile's budget
    identity(case)              the rows' op, path, case and knob columns
    subject(specs, device, deviations)  the --impl strings resolved to what runs
    subjects(device)            label -> --impl strings: every implementation the gate runs here
    campaigns(subject)          the paths a gate campaign covers (None: the unrestricted draw)
    path_for(path, subject)     a requested --path, checked (UsageError) and defaulted
    evaluate(case, subject, context)  the case's rows, judged in this process (`context`: a
                                `judge.rows.RowContext`, what its rows say besides the case)
    produce(case, subject, context, inputs)  the implementation's side of a case
                                (`sandbox.produced.Produced`: its outputs on the host), made where
                                the implementation runs
    judge_produced(case, produced, context)  the rows from it, the reference and every verdict
                                computed here (an isolation worker's judge: `equivalence.blocks`)
    evaluate_block(cases, ...), judge_produced_block(cases, produced, context, prepared)  the same
                                for cases of one params whose seeds differ (a fuzz block): judged
                                together where the spec can (one reference pass, each check at once)
    prepare_block(cases, device)  what judge_produced_block can compute before any output exists
                                (an op: inputs and the reference's answer), passed to it as
                                `prepared`; an isolation worker's judge computes it meanwhile
                                (an op also has prepare_inputs(cases, device): the inputs alone,
                                built once by that judge and handed to its worker, then answered
                                by prepare_block(cases, device, inputs))
    checks, own_processes, ranks  what it compares; whether it starts processes of its own (never
                                inside an isolation worker); the world sizes it runs (multi-process only)

Registration (`register`) takes the spec and an explicit `priority`: the order `mla-verify list`,
the gate and `--op property` walk them (ascending; names break ties). `equivalence.catalog`
imports every spec module and looks them up; spec modules never import the catalog.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence, TYPE_CHECKING

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

    from .cases.case import Case
    from .cases.profiles import Profile
    from .cases.schema import Params
    from .judge.rows import Row, RowContext
    from .sandbox.produced import Produced
    from .subject import Subject


class Spec(Protocol):
    name: str                  # a case's op: "sparse_prefill", "forward_mqa", "property:split_invariance"
    family: str                # "op" | "property": what `--op property` selects, and the list's sections
    doc: str
    checks: tuple              # what its rows compare (Check for an op, a check name for a property)
    own_processes: bool
    ranks: tuple[int, ...]     # world sizes of a multi-process spec (the first is the default), else ()

    def params_of(self, data: Mapping[str, Any]) -> "Params": ...
    def validate(self, data: Mapping[str, Any]) -> None: ...
    def strategy(self, profile: "Profile", path: str | None = None,
                 world_size: int | None = None) -> "SearchStrategy[Case]": ...
    def examples(self, profile: "Profile") -> int: ...
    def interpreted_s(self, params: "Params") -> float: ...
    def identity(self, case: "Case", params: "Params | None" = None) -> dict[str, Any]: ...
    def subject(self, specs: Sequence[str], device: str, deviations: Sequence[str] = ()) -> "Subject": ...
    def subjects(self, device: str) -> dict[str, tuple[str, ...]]: ...
    def campaigns(self, subject: "Subject") -> list[str | None]: ...
    def path_for(self, path: str | None, subject: "Subject") -> str | None: ...
    def evaluate(self, case: "Case", subject: "Subject", context: "RowContext") -> list["Row"]: ...
    def produce(self, case: "Case", subject: "Subject", context: "RowContext", inputs: Any = None) -> "Produced": ...
    def judge_produced(self, case: "Case", produced: "Produced", context: "RowContext") -> list["Row"]: ...
    def evaluate_block(self, cases: Sequence["Case"], subject: "Subject",
                       context: "RowContext") -> list[list["Row"]]: ...
    def prepare_block(self, cases: Sequence["Case"], device: str = "cpu") -> Any: ...
    def judge_produced_block(self, cases: Sequence["Case"], produced: Sequence["Produced"], context: "RowContext",
                             prepared: Any = None) -> list[list["Row"]]: ...


@dataclass(frozen=True)
class Entry:
    spec: Spec
    priority: int


SPECS: dict[str, Entry] = {}


def op_of(stage: str) -> Spec | None:
    """The spec of the op a registry stage is (its declared writes and views guard the stage's
    calls: `sandbox.call_guards.guarded`), None for a pipeline-internal stage."""
    return SPECS[stage].spec if stage in SPECS else None


def register(spec: Spec, *, priority: int) -> Spec:
    """Add `spec` to the table, listed by ascending `priority` (then name)."""
    if spec.name in SPECS:
        raise ValueError(f"{spec.name!r} registered twice")
    SPECS[spec.name] = Entry(spec, priority)
    return spec
