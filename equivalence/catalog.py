"""Every spec the harness checks, by name, and the calls that dispatch through them.

Importing this module imports every module of `equivalence.ops` and `equivalence.properties`
(each registers its specs, `equivalence.spec.register`); nothing here asks what kind of spec it holds.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Callable, Mapping, Sequence

from mla_verify.optimized import registry

from . import ops, properties
from .cases.case import Case
from .errors import UsageError
from .judge import conventions as conventions_
from .judge.rows import Row, RowContext
from .sandbox.produced import Produced
from .properties.base import PREFIX
from .spec import SPECS, Spec
from .subject import Subject, check_declared, described as described_, did_you_mean


def _load() -> None:
    """Import every module of the ops and properties packages: each registers its specs (a new
    one is found by being there; its priority, not the import order, places it)."""
    for package in (ops, properties):
        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{package.__name__}.{module.name}")


_load()


def specs(family: str | None = None) -> list[Spec]:
    """Every spec (of `family`: "op" or "property"), by priority then name."""
    entries = sorted(SPECS.values(), key=lambda e: (e.priority, e.spec.name))
    return [e.spec for e in entries if family is None or e.spec.family == family]


def names(family: str | None = None) -> list[str]:
    return [s.name for s in specs(family)]


def select(requested: Sequence[str]) -> list[str]:
    """Spec names for `requested`, where a family's name ("op", "property") stands for every spec of it."""
    families = {s.family for s in specs()}
    return [n for r in requested for n in (names(r) if r in families else [r])]


def spec_of_row(op: str, path: str) -> str:
    """The spec a stored row came from: its op, or "property:NAME" for a property's row (op
    "property", path NAME: `PropertySpec.identity`)."""
    return PREFIX + path if op == "property" else op


def get_spec(name: str) -> Spec:
    if name not in SPECS:
        raise KeyError(f"unknown op {name!r}; {did_you_mean(name, names())}known: {', '.join(names())}")
    return SPECS[name].spec


def resolve_subject(op: str, specs: Sequence[str], device: str, deviations: Sequence[str] = (),
                    conventions: Sequence[str] | Mapping[str, Any] | None = (), *, described: bool = False) -> Subject:
    """The --impl strings for `op` as a Subject; none: the project's implementation (for a property,
    the registry's preferred implementation of every stage, labelled "preferred").

    `deviations` (`--deviation`) are declared for the user's callables among `specs`, on top of
    what each declares itself; naming one without a user's callable is a usage error.
    `conventions` (`--convention KEY=VALUE`, equivalence.judge.conventions) convert what the user's
    callables that return an LSE return into the reference's conventions. `described`: a user's
    callable is described from its module's source, never imported (`subject.Described`): the
    judge of an isolated run, whose worker imports it."""
    check_declared(specs, deviations)
    try:
        spec = get_spec(op)
    except KeyError as exc:
        raise UsageError(str(exc.args[0])) from None
    try:
        declared = conventions_.parse(conventions)
    except ValueError as exc:
        raise UsageError(f"--convention: {exc}") from None
    with described_(described):
        subject = spec.subject(tuple(specs), device, tuple(deviations))
    try:
        return conventions_.apply(subject, op, declared)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def allowed_deviations(subject: Subject, device: str) -> frozenset[str]:
    """The deviations a worker may answer under for `subject` on `device`: a whole callable's own,
    or for a pipeline or property the union over the implementation each stage resolves to (a
    replaced stage's, the registry's default elsewhere). The judge resolved them without running
    the user's code; a worker answering under another is the case's contract failure."""
    if subject.fn is not None:
        return frozenset(subject.deviations)
    found = set(subject.deviations)
    for stage in registry.stages():
        if stage in subject.overrides:
            found.update(subject.overrides[stage].deviations)
            continue
        try:
            found.update(registry.select(stage, device).deviations)
        except (KeyError, RuntimeError):
            continue  # no implementation of it runs here: no call of it either
    return frozenset(found)


def evaluate(case: Case, subject: Subject, device: str = "cpu", *, run_id: str = "", source: str = "fuzz",
             notes: set[str] | None = None, on_call: Callable[[], None] | None = None) -> list[Row]:
    """Every checked tensor of `case` as a Row (a single failure row if the implementation raised),
    judged in this process; see the spec's own `evaluate`. (`equivalence.blocks.Judging` judges
    here or through an isolation worker.)"""
    return get_spec(case.op).evaluate(case, subject, _here(subject, device, run_id, source, notes, on_call))


def evaluate_block(cases: Sequence[Case], subject: Subject, device: str = "cpu", *, run_id: str = "",
                   source: str = "fuzz", notes: set[str] | None = None,
                   on_call: Callable[[], None] | None = None) -> list[list[Row]]:
    """The rows of each of `cases` (one op and params, their seeds differ: a fuzz block), judged
    together in this process where the spec can (its reference in one pass, its checks at once);
    `on_call` runs before each case's implementation call."""
    return get_spec(cases[0].op).evaluate_block(cases, subject, _here(subject, device, run_id, source, notes, on_call))


def _here(subject: Subject, device: str, run_id: str, source: str, notes: set[str] | None,
          on_call: Callable[[], None] | None) -> RowContext:
    """The rows' context of a call judged in this process: they name the subject as it resolved."""
    return RowContext(run_id, source, subject.label, device, notes, on_call)


def row_base(case: Case, context: RowContext) -> dict[str, Any]:
    """The identity columns of `case`'s rows in `context` (`RowContext.base` with its spec's identity)."""
    return context.base(case, get_spec(case.op).identity(case))


def produce(case: Case, subject: Subject, context: RowContext, inputs: dict[str, Any] | None = None) -> Produced:
    """The implementation's side of `case` (its outputs, on the host), for `judge_produced_block`
    in another process: an isolation worker produces, its judge judges. `inputs`: the case's
    arguments as its judge built them (`prepare_inputs`), else built here."""
    return get_spec(case.op).produce(case, subject, context, inputs)


def judge_produced_block(cases: Sequence[Case], produced: Sequence[Produced], context: RowContext,
                         prepared: Any = None) -> list[list[Row]]:
    """The rows of each case of a block (`evaluate_block`'s) from what `produce` sent, the
    reference and every verdict computed here; `prepared`: `prepare_block(cases, device)`,
    computed while the block was produced."""
    return get_spec(cases[0].op).judge_produced_block(cases, produced, context, prepared)


def prepare_block(cases: Sequence[Case], device: str = "cpu", inputs: Any = None) -> Any:
    """What judging the block of `cases` needs before any output exists (an op: its inputs and the
    reference's answer), for `judge_produced_block`: a judge computes it while the block is produced.
    `inputs`: `prepare_inputs(cases, device)`, where taken already."""
    spec = get_spec(cases[0].op)
    return spec.prepare_block(cases, device) if inputs is None else spec.prepare_block(cases, device, inputs)


def prepare_inputs(cases: Sequence[Case], device: str = "cpu") -> Any:
    """The inputs of the block's first part, built once by the judge (`OpSpec.prepare_inputs`) for
    the reference and for the implementation's process to be handed; None for a property, whose
    cases pose their targets' problems inside the implementation's process."""
    spec = get_spec(cases[0].op)
    return spec.prepare_inputs(cases, device) if spec.family == "op" and not spec.own_processes else None


def inputs(op: str, params: Mapping[str, Any], seed: int, device: str = "cpu") -> dict[str, Any]:
    """The keyword arguments an implementation of `op` is called with for the case (op, params,
    seed), built on `device` as `evaluate` builds them: `params` (a case's JSON params) are
    validated as a case file is first. For a kernel repo's own tests of one op."""
    spec = get_spec(op)
    if spec.family != "op":
        raise ValueError(f"{op} has no inputs of its own: a property poses its targets' problems")
    spec.validate(params)
    return spec.inputs(spec.params_of(params), seed, device)


def validate_case(data: Any) -> None:
    """Raise ValueError with the reason unless `data` (a case's JSON object) is within its op's
    schema: a known op, every parameter of the right type and range, no unknown ones, and inputs
    within the size budget."""
    if not isinstance(data, dict):
        raise ValueError(f"a case is a JSON object, not a {type(data).__name__}")
    op, params, seed = data.get("op"), data.get("params", {}), data.get("seed", 0)
    if not isinstance(op, str):
        raise ValueError(f"case op {op!r} is not a string")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise ValueError(f"case seed {seed!r} is not an integer in [0, 2**63)")
    if not isinstance(params, dict):
        raise ValueError(f"case params of {op} are not an object")
    try:
        spec = get_spec(op)
    except KeyError as exc:
        raise ValueError(str(exc.args[0])) from None
    spec.validate(params)
