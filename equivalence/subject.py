"""The implementation under test: the project's own, or one a user names on the command line.

`--impl` accepts, for an op: a registered implementation name (`triton`, `flash_mla`,
`torch-fp32`) or `MODULE:CALLABLE`; for forward_mqa: `STAGE=NAME` or `STAGE=MODULE:CALLABLE`
(that stage replaced inside the pipeline, the rest as registered), or `MODULE:CALLABLE` (a whole
forward_mqa with the contract's keyword arguments); for a property (`property:NAME`, which calls
several stages): `STAGE=NAME`, `STAGE=MODULE:CALLABLE`, or `NAME` (that implementation for every
stage that has one here). A callable must accept every keyword of the op's contract; anything else
is a usage error, found before any case runs, and one with the native signature of a FlashMLA or
vLLM function names the `mla_verify.adapters` function that wraps it.

A user's callable has the documented deviations (`equivalence.judge.policy.DEVIATIONS`) it declares in
its `__mla_verify_deviations__` attribute, plus those declared for it (`--deviation`,
`deviations=`); registered implementations carry their own.

The judge of an isolated run never imports a user's module (`described()`): each MODULE:CALLABLE
is then a `Described` stand-in, its deviations read from its module's source as a literal
(`sandbox.declared`), and only the worker imports it, checks its signature and calls it. What the
worker answers under is held to what the judge resolved (`catalog.allowed_deviations`).
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import importlib
import inspect
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from mla_verify.optimized import adapters
from mla_verify.optimized import registry

from .contracts import CONTRACTS, arguments as contract_arguments
from .errors import HarnessError, UsageError
from .judge.policy import DEVIATIONS
from .sandbox import declared
from .sandbox.device import first_line
from .sandbox.guards import sigint_watch

_DESCRIBED = contextvars.ContextVar("described", default=False)


# Callables that cannot be imported by name (lambdas, closures, partials) are reached in their own
# process through `mla_verify.api.local`: their specs start so, and their rows' label does not.
LOCAL = "mla_verify.api:local."
_LOCAL_PREFIX = re.compile(rf"{re.escape(LOCAL)}fn\d+_")


def local_label(label: str) -> str:
    """`label` with each local callable by its own name ("mla_verify.api:local.fn0_decode": "decode")."""
    return _LOCAL_PREFIX.sub("", label)


def is_local(spec: str) -> bool:
    """Whether an --impl string names a local callable (importable in this process only)."""
    return LOCAL in spec


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """"did you mean 'X'? " for the choice closest to a misspelt `word`, else ""."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


@dataclass(frozen=True)
class Subject:
    label: str                                   # what the rows call the implementation
    fn: Callable | None = None                   # the op's implementation (or a whole forward_mqa)
    overrides: dict = field(default_factory=dict)  # forward_mqa: stage -> registry.Implementation
    deviations: tuple[str, ...] = ()
    specs: tuple[str, ...] = ()                  # the --impl strings, kept in replay files
    declared: tuple[str, ...] = ()               # --deviation names: they travel with the specs
    conventions: tuple[str, ...] = ()            # --convention KEY=VALUE (equivalence.judge.conventions), likewise


class Described:
    """A user's callable as a judge knows it without importing its module: its name and the
    deviations its source declares (`sandbox.declared`). It accepts any keyword (the worker checks
    the real signature) and is never called: the kernel runs in the worker."""

    def __init__(self, spec: str):
        module, _, attr = spec.partition(":")
        self.spec, self.__module__, self.__qualname__ = spec, module, attr
        self.__name__ = attr.rpartition(".")[2]
        try:
            self.__mla_verify_deviations__ = declared.deviations(spec)
        except declared.NotFound as exc:
            raise UsageError(f"--impl {spec!r}: cannot import {module!r}: {exc}") from None
        except declared.Undeclared:
            self.__mla_verify_deviations__ = ()  # not Python source: declare with --deviation

    def __call__(self, **kwargs):
        raise HarnessError(f"{self.spec} was called in the judge: a user's kernel runs only in its worker")


@contextlib.contextmanager
def described(on: bool = True) -> Iterator[None]:
    """While on, a user's MODULE:CALLABLE resolves to a `Described` stand-in, never imported."""
    token = _DESCRIBED.set(on)
    try:
        yield
    finally:
        _DESCRIBED.reset(token)


def load_callable(spec: str) -> Callable:
    """`package.module:attr` -> the object; the working directory is importable, as in pytest.
    Inside `described()`, its `Described` stand-in: nothing of the module runs."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UsageError(f"--impl {spec!r}: expected MODULE:CALLABLE or a registered implementation name")
    if _DESCRIBED.get():
        return Described(spec)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    with sigint_watch() as sigints:
        try:
            obj = importlib.import_module(module_name)
        except BaseException as exc:  # SystemExit too (a script-style file): the user's input, in one line
            if isinstance(exc, KeyboardInterrupt) and sigints:
                raise  # the user's Ctrl-C
            what = (f"exited (SystemExit({exc.code!r})): a module --impl names must not end the process"
                    if isinstance(exc, SystemExit) else f"{type(exc).__name__}: {first_line(exc)}")
            raise UsageError(f"--impl {spec!r}: cannot import {module_name!r}: {what}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"--impl {spec!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"--impl {spec!r}: {attr!r} is not callable")
    return obj


def check_signature(fn: Callable, arguments: Sequence[str], what: str) -> None:
    """UsageError where `fn` cannot take the contract's keywords; reading its signature runs the
    user's code (a `__signature__` property), and whatever that raises is its usage error too."""
    try:
        native = adapters.native_signature(fn)
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and C extensions: nothing to inspect, the first call will tell
    except Exception as exc:  # noqa: BLE001 - the user's code, in one line
        raise UsageError(f"{what}: reading its signature raised {type(exc).__name__}: {first_line(exc)}") from None
    if native is not None:
        raise UsageError(f"{what}: {native.hint(fn)}")
    params = sig.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    names = {p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    missing = [a for a in arguments if a not in names]
    if missing:
        raise UsageError(f"{what}: the contract passes keyword(s) {', '.join(missing)} that {fn.__qualname__}{sig} does not accept")


def check_deviations(names: Sequence[str], what: str) -> None:
    unknown = [n for n in names if n not in DEVIATIONS]
    if unknown:
        raise UsageError(f"{what}: unknown deviation {', '.join(map(repr, unknown))}; known: {', '.join(DEVIATIONS)} "
                         "(mla-verify list --deviations)")


def declared_deviations(fn: Callable, deviations: Sequence[str], what: str) -> tuple[str, ...]:
    """The deviations of a user's callable: its `__mla_verify_deviations__`, then `deviations`
    (reading the attribute runs the user's code: what it raises is a usage error)."""
    try:
        own = getattr(fn, "__mla_verify_deviations__", ())
        own = (own,) if isinstance(own, str) else tuple(own)
    except Exception as exc:  # noqa: BLE001 - the user's code, in one line
        raise UsageError(f"{what}: reading its __mla_verify_deviations__ raised {type(exc).__name__}: "
                         f"{first_line(exc)}") from None
    if not all(isinstance(n, str) for n in own):
        raise UsageError(f"{what}: its __mla_verify_deviations__ is not a tuple of names")
    names = tuple(dict.fromkeys([*own, *deviations]))
    check_deviations(names, what)
    return names


def stage_arguments(stage: str) -> tuple[str, ...]:
    """The keywords a stage is called with: its op's contract, or for a pipeline-internal stage (the
    HiSparse data plane, the index group) the parameters of its registered implementation."""
    if stage in CONTRACTS:
        return contract_arguments(stage)
    return tuple(inspect.signature(registry.implementations(stage)[0].fn).parameters)


def implementation(stage: str, spec: str, device: str, deviations: Sequence[str] = ()) -> registry.Implementation:
    """A registered implementation by name, or a user's callable wrapped as one (with its deviations)."""
    if ":" not in spec:
        names = [i.name for i in registry.implementations(stage)]
        if spec not in names and "." in spec:  # MODULE.CALLABLE: the colon forgotten
            module, _, attr = spec.rpartition(".")
            raise UsageError(f"--impl {spec!r} for {stage}: no implementation is registered by that name and a "
                             f"callable is named MODULE:CALLABLE; did you mean {f'{module}:{attr}'!r}?")
        try:
            impl = registry.select(stage, device, name=spec)
        except (KeyError, RuntimeError) as exc:
            raise UsageError(f"--impl {spec!r} for {stage}: {did_you_mean(spec, names)}{exc.args[0]}") from None
        return impl
    fn = load_callable(spec)
    check_signature(fn, stage_arguments(stage), f"--impl {spec}")
    # A user's kernel is captured as it is called: serving would capture it so.
    return registry.Implementation(stage=stage, name=spec, fn=fn, devices=frozenset({device}), graph=fn,
                                   deviations=declared_deviations(fn, deviations, f"--impl {spec}"))


def _stage_override(spec: str, device: str, deviations: Sequence[str] = ()) -> tuple[str, registry.Implementation]:
    """`STAGE=NAME` or `STAGE=MODULE:CALLABLE` -> (stage, the implementation that replaces it)."""
    stage, _, target = spec.partition("=")
    if stage not in registry.stages():
        raise UsageError(f"--impl {spec!r}: unknown stage {stage!r}; stages: {', '.join(registry.stages())}")
    return stage, implementation(stage, target, device, deviations)


def _named_everywhere(name: str, device: str) -> dict[str, registry.Implementation]:
    """stage -> its implementation called `name`, for every stage that has one running on `device`."""
    found = [i for stage in registry.stages() for i in registry.implementations(stage) if i.name == name]
    if not found:
        names = sorted({i.name for stage in registry.stages() for i in registry.implementations(stage)})
        raise UsageError(f"--impl {name!r}: no stage has an implementation of that name; known: {', '.join(names)}")
    runnable = {i.stage: i for i in found if i.why_not(device) is None}
    if not runnable:
        raise UsageError(f"--impl {name!r} does not run here: {found[0].why_not(device)}")
    return runnable


def stage_overrides(specs: Sequence[str], device: str,
                    deviations: Sequence[str] = ()) -> tuple[dict[str, registry.Implementation], list[str]]:
    """(stage -> implementation, the specs left over) for the --impl strings of something that calls
    several stages: `STAGE=...` replaces that stage, a registered `NAME` every stage that has one
    (save those a STAGE= names); what is left (MODULE:CALLABLE) is the caller's to take or refuse.
    Two --impl choosing for one stage are refused: the last would win silently."""
    overrides: dict[str, registry.Implementation] = {}
    by: dict[str, str] = {}  # stage -> the --impl that chose it
    rest = []
    for s in (s for s in specs if "=" in s):
        stage, impl = _stage_override(s, device, deviations)
        if stage in by:
            raise UsageError(f"--impl {by[stage]!r} and --impl {s!r} both replace stage {stage}: name it once")
        by[stage], overrides[stage] = s, impl
    explicit = set(by)
    for s in specs:
        if "=" in s:
            continue
        if ":" in s:
            rest.append(s)
            continue
        for stage, impl in _named_everywhere(s, device).items():
            if stage in explicit:
                continue  # STAGE=... is the more specific choice
            if stage in by:
                raise UsageError(f"--impl {by[stage]!r} and --impl {s!r} both choose stage {stage}'s implementation: "
                                 f"name one (STAGE=NAME for a single stage)")
            by[stage], overrides[stage] = s, impl
    return overrides, rest


def check_declared(specs: Sequence[str], deviations: Sequence[str]) -> None:
    """`--deviation` names documented deviations, for a user's callable among `specs`."""
    check_deviations(deviations, "--deviation")
    if deviations and not any(":" in s for s in specs):
        raise UsageError(f"--deviation {', '.join(deviations)}: declares a deviation of a user's --impl "
                         "[STAGE=]MODULE:CALLABLE; registered implementations carry their own (mla-verify list)")


def pipeline_subject(op: str, specs: Sequence[str], device: str, deviations: Sequence[str] = ()) -> Subject:
    """A pipeline op's subject: its stages, any replaced (`stage_overrides`), or one whole
    MODULE:CALLABLE taking the op's contract keywords."""
    overrides, wholes = stage_overrides(specs, device, deviations)
    if len(wholes) > 1:
        raise UsageError(f"give at most one whole-{op} --impl")
    if wholes and overrides:
        raise UsageError(f"a whole-{op} --impl cannot be combined with stage overrides")
    if wholes:
        whole = load_callable(wholes[0])
        check_signature(whole, contract_arguments(op), f"--impl {wholes[0]}")
        own = declared_deviations(whole, deviations, f"--impl {wholes[0]}")
        return Subject(wholes[0], whole, {}, own, tuple(specs), tuple(deviations))
    label = f"pipeline[{','.join(specs)}]" if specs else "pipeline"
    return Subject(label, None, overrides, (), tuple(specs), tuple(deviations))


def replaced(specs: Sequence[str]) -> list[str]:
    """The stages --impl STAGE=... strings replace, each once, in order."""
    return list(dict.fromkeys(s.split("=", 1)[0] for s in specs if "=" in s))


def never_called(specs: Sequence[str], called: dict[str, set[str]], ops: Sequence[str] = ()) -> list[str]:
    """The stages an --impl STAGE=... replaced that no pipeline or property call reached
    (`called`: stage -> keywords passed), but those in `ops` (an op's own campaign calls its
    implementation directly): nothing judged them."""
    return [stage for stage in replaced(specs) if stage not in called and stage not in ops]


def unexercised(specs: Sequence[str], called: dict[str, set[str]]) -> list[str]:
    """For each stage an --impl STAGE=... replaced and a call reached, the keywords of its contract
    no call passed (`called`: stage -> keywords passed): what a pipeline or property pass of it
    does not cover."""
    return [f"{stage}: no case passed it {', '.join(missing)} (check({stage!r}, ...) exercises them)"
            for stage in replaced(specs) if stage in called
            and (missing := [a for a in stage_arguments(stage) if a not in called[stage]])]
