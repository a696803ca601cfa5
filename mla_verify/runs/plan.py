"""What a run is, whatever starts it: `check()` and `mla-verify fuzz` (one op and implementation),
`gate()` and `mla-verify gate` (every op and implementation here), a part of either on one of this
host's GPUs (`runs.parts`), a shard of either on another machine. What a caller asks is `Options`;
`plan` checks it, once for check() and gate(), into a `Run` of its kind (`FuzzRun`, `GateRun`: one
shared settings type, each kind's own beside it); `runs.driver` runs it.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, ClassVar, Collection, Mapping

import torch

from mla_verify.equivalence import catalog
from mla_verify.equivalence.ops import dcp_ranks
from mla_verify.equivalence.catalog import get_spec, resolve_subject
from mla_verify.equivalence.sandbox.device import device_type, is_cuda
from mla_verify.equivalence.blocks import default_isolation
from mla_verify.equivalence.cases.profiles import Profile, get_profile
from mla_verify.equivalence.sandbox.boundary import MODES
from mla_verify.equivalence.subject import Subject, did_you_mean, local_label
from mla_verify.equivalence.errors import UsageError
from mla_verify.equivalence.spec import Spec
from mla_verify.fuzz.campaign import new_seed
from mla_verify.reports.meta import collect_meta, rerun_settings
from mla_verify.reports.store import run_file

from . import durations
from .corpus import Corpus, with_kept
from .outcome import DEFAULT_TIMEOUT_S, CheckResult, GateOutcome
from .parts import Shard, check_in_parts, gate_in_parts
from .rundir import FreshDir, RunDir, load_run
from .selection import impl_units
from .units import Unit, gate_world_size, shard_units, units

FUZZ, GATE = "fuzz", "gate"


@dataclass(frozen=True, kw_only=True)
class Run(ABC):
    """What every run is, fuzz or gate: where it runs, what it draws, how its cases are judged and
    where it writes. `examples`: fuzz, the whole run's cases (shared out over its campaigns); the
    gate, per unit (None: the profile's budgets). A kind's own settings are its class's
    (`FuzzRun`, `GateRun`); `command` names it."""

    command: ClassVar[str]
    # In this process, a CUDA context the implementation took with it ends the run (the fuzz
    # campaign's `Stop.DEVICE_LOST`); the gate goes on to its next case.
    stops_when_lost: ClassVar[bool]
    device: str                           # "cpu", "cuda" or "cuda:N"
    profile: Profile
    examples: int | None
    seed: int
    isolate: bool
    timeout: float
    sandbox: str = "auto"                 # the OS boundary of the isolation workers (sandbox.boundary.MODES)
    out: RunDir | None = None             # the run directory being written
    baseline: Path | None = None          # the run whose cases these are again
    shard: Shard = Shard()
    parts: int = 1                        # this host's processes: the shard's slots (runs.parts)
    invocation: str | None = field(default_factory=lambda: invocation())  # meta.json's command
    corpus: str | None = None             # the kept corpus (runs.corpus): replayed first, findings added
    shrink: bool = True                   # a campaign's finding is minimized

    @property
    def device_type(self) -> str:
        return device_type(self.device)

    @property
    def slots(self) -> list[Shard]:
        """The slots of the whole run this host runs, one per part."""
        return self.shard.slots(self.parts)

    def options(self) -> dict[str, Any]:
        """The settings every shard of one run shares (`merge` checks them)."""
        return {"command": self.command, "examples": self.examples, "seed": self.seed, "profile": self.profile.name,
                "device": self.device_type, "isolate": self.isolate, "timeout": self.timeout, **self._options()}

    def meta(self) -> dict[str, Any]:
        """meta.json: what `check(baseline=...)` and `gate --baseline` read back to draw the same
        cases (reports.meta.rerun_settings), and for a shard what `merge` checks."""
        seeds, extra = self._meta()
        if not self.shard.whole:
            extra |= {"shard": str(self.shard), "run": self.options()}
        return collect_meta(self.profile.name, seeds, self.device, command=self.invocation, extra=extra)

    def to_json(self) -> str:
        """A part's Run for its process (`Run.from_json`; a fuzz run's subject is resolved again
        there from its specs)."""
        plain = {f.name: getattr(self, f.name) for f in fields(self)
                 if f.name not in ("subject", "profile", "shard", "out", "baseline")}
        return json.dumps({"command": self.command, **plain, "profile": self.profile.name, "shard": str(self.shard),
                           "out": str(self.out)})

    @staticmethod
    def from_json(text: str) -> "FuzzRun | GateRun":
        d = json.loads(text)
        kind = {FUZZ: FuzzRun, GATE: GateRun}[d.pop("command")]
        d |= {"profile": get_profile(d["profile"]), "shard": Shard.parse(d["shard"]), "out": RunDir.open(d["out"])}
        return kind._restored(d)

    # Each kind's own (FuzzRun, GateRun): the line it starts with, its campaigns' world size for a
    # spec, its units and those of its slot, its run in one child process per part, and what
    # options() and meta() add to the shared settings. A Run itself is never made.
    @abstractmethod
    def header(self) -> str:
        raise NotImplementedError

    @abstractmethod
    def ranks(self, spec: Spec) -> int | None:
        raise NotImplementedError

    @abstractmethod
    def units(self, kept: Corpus | None = None) -> list[Unit]:
        raise NotImplementedError

    @abstractmethod
    def shard_of(self, chosen: list[Unit]) -> list[Unit]:
        raise NotImplementedError

    @abstractmethod
    def in_parts(self, log: Callable[[str], None]) -> CheckResult | GateOutcome:
        raise NotImplementedError

    @abstractmethod
    def _options(self) -> dict[str, Any]:
        raise NotImplementedError

    @abstractmethod
    def _meta(self) -> tuple[list[int], dict[str, Any]]:
        raise NotImplementedError

    def _here(self) -> dict[str, Any]:
        """What every part's Run changes of this one's settings: this host's device type, one part."""
        return dict(device=self.device_type, parts=1, baseline=None)


@dataclass(frozen=True, kw_only=True)
class FuzzRun(Run):
    """One op and implementation, its campaigns of this host (`campaigns`)."""

    command: ClassVar[str] = FUZZ
    stops_when_lost: ClassVar[bool] = True
    op: str
    specs: tuple[str, ...] = ()           # the implementation as --impl strings
    subject: Subject | None = None        # the resolved implementation
    deviations: tuple[str, ...] = ()
    conventions: tuple[str, ...] = ()     # the implementation's declared conventions ("lse_base=2", ...)
    path: str | None = None
    world_size: int | None = None
    corpus_replay: bool = True            # this part replays the corpus (a fuzz run's first part only)
    covering: bool = True                 # the op's covering set runs first (False: the draws alone, said so)

    @property
    def ops(self) -> tuple[str, ...]:
        return (self.op,)

    @property
    def label(self) -> str:
        """The rows' name for the implementation; a local callable by its own name."""
        return local_label(self.subject.label) if self.subject is not None else ""

    @property
    def in_process(self) -> bool:
        """Judged in the implementation's own process (not isolated, no rank processes)."""
        return not (self.isolate or self.world_size)

    @property
    def campaigns(self) -> list[tuple[int, int]]:
        """(seed, examples) of each campaign this host runs."""
        return [c for c in (slot.campaign(self.seed, self.examples) for slot in self.slots) if c[1]]

    def units(self, kept: Corpus | None = None) -> list[Unit]:
        """Its one unit: the implementation it was given, on its path, without the pinned corpus;
        with the kept corpus's cases that apply to it where this part replays them."""
        return [Unit(self.op, self.label, self.specs, subject=self.subject, paths=(self.path,), corpus=False,
                     deviations=self.deviations, conventions=self.conventions,
                     kept=kept.applying(self.op, self.specs) if kept and self.corpus_replay else ())]

    def shard_of(self, chosen: list[Unit]) -> list[Unit]:
        """All of `chosen`: a fuzz run's slots share its one unit's examples (`campaigns`)."""
        return chosen

    def ranks(self, spec: Spec) -> int | None:
        """The world size of its campaigns of `spec` (--world-size, else the gate's: None for one process)."""
        return self.world_size or gate_world_size(spec, self.device_type)

    def _options(self) -> dict[str, Any]:
        return {"op": self.op, "impl": list(self.specs), "path": self.path, "world_size": self.world_size,
                "deviations": list(self.deviations), "conventions": list(self.conventions), "shrink": self.shrink,
                "covering_set": self.covering, "campaigns": self.shard.count * self.parts}

    def _meta(self) -> tuple[list[int], dict[str, Any]]:
        return [s for s, _ in self.campaigns], {
            "op": self.op, "examples": sum(n for _, n in self.campaigns), "path": self.path,
            "isolated": not self.in_process, "deviations": list(self.deviations), "conventions": list(self.conventions),
            "covering_set": self.covering}

    def part(self, slot: Shard, index: int, root: Path) -> "FuzzRun":
        """The Run of one part, the whole campaign of its slot's seed and examples, in ROOT/part-INDEX."""
        seed, examples = slot.campaign(self.seed, self.examples)
        return replace(self, seed=seed, examples=examples, shard=Shard(), out=root / f"part-{index}",
                       corpus_replay=self.corpus_replay and index == 0, **self._here())

    @classmethod
    def _restored(cls, d: dict[str, Any]) -> "FuzzRun":
        d |= {k: tuple(d[k]) for k in ("specs", "deviations", "conventions")}
        run = cls(**d)
        return replace(run, subject=resolve_subject(run.op, run.specs, run.device_type, deviations=run.deviations,
                                                    conventions=run.conventions, described=run.isolate))

    def header(self) -> str:
        """The line a run starts with."""
        where = f", run {self.out.path}" if self.out else ""
        ranks = ""
        if self.world_size:
            ranks = f", {self.world_size} ranks ({dcp_ranks.placement(self.world_size, self.device_type).describe()})"
        budget = (f"{self.examples} examples or the whole covering set" if self.covering
                  else f"{self.examples} examples drawn, the covering set skipped (--no-covering-set)")
        return (f"mla-verify fuzz: op {self.op}, implementation {self.label}, {budget}, profile "
                f"{self.profile.name}, device {self.device}, seed {self.seed}{ranks}{', isolated' if self.isolate else ''}"
                f"{where}" + (f"; the cases of baseline {self.baseline}" if self.baseline is not None else "")
                + ("" if self.shard.whole else f"; shard {self.shard} of {self.shard.count * self.parts} campaigns: "
                   + ", ".join(f"seed {s} x {n}" for s, n in self.campaigns)))

    def in_parts(self, log: Callable[[str], None]) -> CheckResult:
        """Its campaigns, one child process each (`runs.parts`)."""
        return check_in_parts(self, log)


@dataclass(frozen=True, kw_only=True)
class GateRun(Run):
    """Every op and implementation here (or those `ops` and `impls` ask for), the units of its shard."""

    command: ClassVar[str] = GATE
    stops_when_lost: ClassVar[bool] = False
    covering: ClassVar[bool] = True       # every campaign runs its covering set first (fuzz may skip it)
    ops: tuple[str, ...] = ()             # what was asked (empty: every op and property)
    impls: tuple[str, ...] = ()           # OP=SPEC / STAGE=SPEC it is restricted to (runs.selection)
    durations: dict[str, float] | None = None  # each unit's seconds last time (runs.durations); None: not asked

    def units(self, kept: Corpus | None = None) -> list[Unit]:
        """The gate's units: those of its --impl strings (`runs.selection`), else every op and
        implementation here; each with the kept corpus's cases that apply to it."""
        chosen = impl_units(self.impls, self.device, self.ops) if self.impls else units(list(self.ops) or None, self.device)
        return with_kept(chosen, kept)

    def shard_of(self, chosen: list[Unit]) -> list[Unit]:
        """The units of its shard (`Shard()`: all of them) among `chosen`."""
        return shard_units(list(self.ops) or None, self.device, self.shard, chosen, self.durations)

    def ranks(self, spec: Spec) -> int | None:
        """The world size of its campaigns of `spec`: the most its GPUs hold (`units.gate_world_size`)."""
        return gate_world_size(spec, self.device_type)

    def _options(self) -> dict[str, Any]:
        return {"ops": list(self.ops) or None, "impls": list(self.impls) or None,
                "durations": durations.digest(self.durations)}

    def _meta(self) -> tuple[list[int], dict[str, Any]]:
        return [self.seed], {"examples": self.examples, "ops": list(self.ops) or None,
                             "impls": list(self.impls) or None, "isolated": self.isolate}

    def part(self, slot: Shard, index: int, root: Path) -> "GateRun":
        """The Run of one part: its slot, in ROOT/part-INDEX."""
        return replace(self, shard=slot, out=root / f"part-{index}", **self._here())

    @classmethod
    def _restored(cls, d: dict[str, Any]) -> "GateRun":
        return cls(**{**d, "ops": tuple(d["ops"]), "impls": tuple(d["impls"])})

    def header(self) -> str:
        """The line a run starts with."""
        where = f", run {self.out.path}" if self.out else ""
        budget = (f"{self.examples}" if self.examples is not None
                  else f"{self.profile.examples} (properties: {self.profile.property_examples})")
        return (f"mla-verify gate: device {self.device}, profile {self.profile.name}, {budget} fuzz examples per "
                f"op and implementation or its whole covering set, seed {self.seed}{self._shard_words()}"
                f"{', only ' + ' '.join(self.impls) if self.impls else ''}"
                f"{f', corpus {self.corpus}' if self.corpus else ''}"
                f"{where}")

    def _shard_words(self) -> str:
        """", shard 1/2 (SLURM_ARRAY_TASK_ID=1 of SLURM_ARRAY_TASK_COUNT=2), sized by 14 units' seconds
        last time": which shard, and how its units were dealt."""
        if self.shard.whole and self.parts == 1:
            return ""
        how = ("" if self.durations is None else ", dealt by count (no unit's seconds kept yet)" if not self.durations
               else f", sized by {len(self.durations)} units' seconds last time")
        source = f" ({self.shard.source})" if self.shard.source else ""
        return ("" if self.shard.whole else f", shard {self.shard}{source}") + how

    def in_parts(self, log: Callable[[str], None]) -> GateOutcome:
        """Its units dealt to one child process per part (`runs.parts`)."""
        return gate_in_parts(self, self.units(), log)


def invocation() -> str | None:
    """This process's command line as meta.json records it (None inside a bare interpreter)."""
    return shlex.join(["mla-verify"] + sys.argv[1:]) if sys.argv[1:] else None




@dataclass(frozen=True)
class Options:
    """What a caller asks of a run, before it is checked: `check()`'s and `gate()`'s arguments,
    and the CLI's run options (declared once for fuzz and gate). `plan` makes it a Run. `specs`:
    the implementation as --impl strings, `named`: each importable in another process."""

    command: str                                  # FUZZ or GATE
    ops: tuple[str, ...] = ()                     # fuzz: its op; gate: only these (empty: every op and property)
    specs: tuple[str, ...] = ()
    named: bool = True
    device: str | None = None
    profile: str | None = None
    examples: int | None = None
    seed: int | None = None
    out: str | Path | FreshDir | None = None
    isolate: bool | None = None
    timeout: float | None = None
    deviations: tuple[str, ...] = ()
    conventions: Any = ()                         # ("lse_base=2", ...) or {"lse_base": 2}
    path: str | None = None
    world_size: int | None = None
    shrink: bool = True
    covering: bool | None = None                  # fuzz: False skips the covering set (None: run it, or as the baseline did)
    parallel: int | None = None
    shard: Any = None                             # "I/N" or a Shard
    baseline: Path | None = None
    junit: Path | None = None
    impls: tuple[str, ...] = ()                   # gate: OP=SPEC / STAGE=SPEC strings (runs.selection)
    corpus: str | Path | None = None              # a kept corpus directory (runs.corpus)
    durations: str | Path | None = None           # gate: a durations.json, or a run holding one (runs.durations)
    sandbox: str = "auto"                         # auto | strict | off (equivalence.sandbox.boundary)

    @classmethod
    def asked(cls, command: str, given: Mapping[str, Any], besides: Collection[str] = ()) -> "Options":
        """The options `given` (a call's arguments by name), but the names `besides` (the call's
        own, or translated into options on the way); TypeError for any other name, so that a
        parameter misspelled or added without its field is never dropped silently."""
        names = {f.name for f in fields(cls)} - {"command"}
        stray = sorted(set(given) - names - set(besides))
        if stray:
            raise TypeError(f"{command}: {', '.join(stray)}: no run option (runs.plan.Options) of that name")
        return cls(command, **{k: v for k, v in given.items() if k in names})


def resolve_device(device: str | None) -> str:
    """"cpu", "cuda" or "cuda:N" (None: cuda when present); on CPU the Triton kernels run under
    their interpreter, which must be chosen before any kernel module is imported."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    kind = device_type(device)
    if kind not in ("cpu", "cuda") or (kind == "cpu" and device != "cpu"):
        raise UsageError(f"device {device!r}: expected cpu, cuda or cuda:N")
    if kind == "cuda" and not torch.cuda.is_available():
        raise UsageError("device cuda asked for, but no CUDA GPU is visible")
    if kind == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return device


def plan(options: Options, log: Callable[[str], None] = lambda line: None) -> FuzzRun | GateRun:
    """The Run `options` ask for, checked before any case runs (UsageError with the reason
    otherwise): the one validation of `check()` and `gate()`. `log` hears of a baseline's reuse."""
    device = resolve_device(options.device)
    if options.command == GATE:
        known = [*catalog.names(), "property"]
        unknown = [op for op in options.ops if op not in known]
        if unknown:
            raise UsageError(f"--op {unknown[0]!r}: unknown; {did_you_mean(unknown[0], known)}known: "
                             f"{', '.join(known)}")
    if options.sandbox not in MODES:
        raise UsageError(f"--sandbox {options.sandbox!r}: expected one of {', '.join(MODES)}")
    o = _again(options, log) if options.baseline is not None else options
    for name, kind in (("examples", int), ("timeout", float), ("parallel", int)):
        positive(name, getattr(o, name), kind)
    try:
        shard = Shard.parse(o.shard)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    o = replace(o, seed=new_seed() if o.seed is None else o.seed)
    return _fuzz_run(o, device, shard) if o.command == FUZZ else _gate_run(o, device, shard)


def _profile(o: Options, device: str) -> Profile:
    try:
        return get_profile(o.profile or ("gpu" if is_cuda(device) else "dev" if o.command == FUZZ else "ci"))
    except KeyError as exc:
        raise UsageError(str(exc.args[0])) from None


def _fuzz_run(o: Options, device: str, shard: Shard) -> FuzzRun:
    """check(): one op and implementation."""
    op, kind = o.ops[0], device_type(device)
    try:
        spec = get_spec(op)
    except KeyError as exc:
        raise UsageError(str(exc.args[0])) from None
    if o.world_size is not None and o.world_size not in spec.ranks:
        raise UsageError(f"--world-size must be one of {', '.join(map(str, spec.ranks))}, got {o.world_size}"
                         if spec.ranks else f"--world-size: {op} runs in one process")
    world_size = (o.world_size or spec.ranks[0]) if spec.ranks else None
    deviations = tuple(o.deviations or ())
    isolate = default_isolation(o.isolate, o.named, spec.own_processes)
    # Isolated, the judge never imports a user's module: its worker does (`Worker.resolve`).
    subject = resolve_subject(op, o.specs, kind, deviations=deviations, conventions=o.conventions, described=isolate)
    path = spec.path_for(o.path, subject)
    profile = _profile(o, device)
    examples = o.examples or spec.examples(profile)
    timeout_needs_isolation(o.timeout, isolate or spec.own_processes)
    parts = 1 if world_size or not o.named else (o.parallel or _gpu_count(kind))
    if shard.index * parts >= examples:  # its first campaign, slot I * P, has no share of the examples
        raise UsageError(f"shard {shard}: {examples} examples over {shard.count * parts} campaigns leave it none "
                         f"(give at least {shard.count * parts} examples)")
    if o.junit is not None:
        writable_file(o.junit, "--junit")
    corpus = open_corpus(o.corpus)
    return FuzzRun(**_shared(o, device, shard, profile), op=op, examples=examples, isolate=isolate,
                   out=_opened(o.out), parts=parts, corpus=corpus, specs=o.specs, subject=subject,
                   deviations=deviations, conventions=tuple(subject.conventions), path=path, world_size=world_size,
                   corpus_replay=shard.index == 0, covering=o.covering is not False)


def _gate_run(o: Options, device: str, shard: Shard) -> GateRun:
    """gate(): every op and implementation here (the registered ones: named)."""
    if o.junit is not None:
        writable_file(o.junit, "--junit")
    profile = _profile(o, device)
    chosen = impl_units(o.impls, device, list(o.ops) or None) if o.impls else None
    corpus = open_corpus(o.corpus)
    seconds = durations.read(o.durations) if o.durations is not None else None
    if not shard_units(list(o.ops) or None, device, shard, chosen, seconds):
        raise UsageError(f"--shard {shard}: the gate has fewer units (ops and implementations) than shards here")
    isolate = default_isolation(o.isolate, named=True)
    if o.timeout is not None and not isolate:
        raise UsageError("--timeout needs isolation (the default; not --no-isolate): an in-process call cannot be stopped")
    return GateRun(**_shared(o, device, shard, profile), ops=o.ops, examples=o.examples, isolate=isolate,
                   out=_opened(o.out if o.out is not None else FreshDir.named("runs", "gate")),
                   parts=o.parallel or _gpu_count(device_type(device)), impls=o.impls, corpus=corpus,
                   durations=seconds)


def _shared(o: Options, device: str, shard: Shard, profile: Profile) -> dict[str, Any]:
    """The settings (`Run`'s fields) every kind of run takes from `o` alike."""
    return dict(device=device, shard=shard, profile=profile, seed=o.seed, timeout=_timeout(o), sandbox=o.sandbox,
                baseline=o.baseline, shrink=o.shrink)


def _again(o: Options, log: Callable[[str], None]) -> Options:
    """`o` with what its baseline ran filling what it leaves unset, so that its cases are drawn
    again and drift pairs them."""
    rows, meta = load_run(o.baseline, "baseline")
    again = rerun_settings(meta)
    seed = again["seed"] if o.seed is None else o.seed
    profile, examples = o.profile or again["profile"], o.examples or again["examples"]
    if o.command == GATE:
        ops, impls = o.ops or tuple(again["ops"] or ()), o.impls or tuple(again["impls"] or ())
        log(f"baseline {o.baseline}: its cases again (seed {seed}, profile {profile}"
            f"{', ops ' + ' '.join(ops) if ops else ''}{', --impl ' + ' '.join(impls) if impls else ''})")
        return replace(o, seed=seed, profile=profile, examples=examples, ops=ops, impls=impls)
    op = o.ops[0]
    ran = {catalog.spec_of_row(*row) for row in zip(rows["op"], rows["path"])}
    if op not in ran:
        raise UsageError(f"baseline {o.baseline} holds no rows of {op} (it ran {', '.join(sorted(ran))}): "
                         "nothing comparable")
    return replace(o, seed=seed, profile=profile, examples=examples, path=o.path or again["path"],
                   parallel=o.parallel or again["campaigns"],
                   covering=again["covering"] is not False if o.covering is None else o.covering)


def open_corpus(directory: str | Path | None) -> str | None:
    """The kept corpus's absolute path as a Run holds it, its files read and checked now (a
    usage error names a bad one before any case runs); None for none."""
    if directory is None:
        return None
    corpus = Corpus(directory)
    corpus.cases()
    return str(corpus.directory)


def positive(name: str, value: float | None, kind: type) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0
                              or (kind is int and not isinstance(value, int))):
        raise UsageError(f"{name} must be a positive {'integer' if kind is int else 'number'}, got {value!r}")


def timeout_needs_isolation(timeout: float | None, stoppable: bool) -> None:
    """A timeout is kept only where the call can be stopped: an isolation worker, or rank processes."""
    if timeout is not None and not stoppable:
        raise UsageError("--timeout needs isolation (the default; not --no-isolate, isolate=False or a callable "
                         "object): an in-process call cannot be stopped, and a timeout that is not kept would let a "
                         "hang pass")


def _timeout(o: Options) -> float:
    return DEFAULT_TIMEOUT_S if o.timeout is None else float(o.timeout)


def _gpu_count(device_type: str) -> int:
    return torch.cuda.device_count() if device_type == "cuda" else 1


def _opened(out: str | Path | FreshDir | None) -> RunDir | None:
    return RunDir.open(out) if out is not None else None


def writable_file(path: str | Path, what: str) -> Path:
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{what} {path}: a directory, not a file")
    if run_file(path):
        raise UsageError(f"{what} {run_file(path)}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{what} {path}: cannot create its directory ({exc.strerror or exc})") from None
    if not os.access(path.parent, os.W_OK):
        raise UsageError(f"{what} {path}: its directory is not writable")
    return path
