"""What `runs.driver.drive` found (`UnitsResult`), and the run's outcome of it (`runs.outcome`):
a fuzz run's `CheckResult` or the gate's `GateOutcome`, with the commands that replay its
findings, the kept corpus given this run's findings, and the run directory finished."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mla_verify.equivalence import catalog
from mla_verify.equivalence.judge.rows import Row
from mla_verify.equivalence.ops import dcp_ranks
from mla_verify.equivalence.sandbox import call_guards
from mla_verify.equivalence.subject import never_called, unexercised
from mla_verify.fuzz.campaign import FuzzResult, Stop
from mla_verify.fuzz.casefile import load
from mla_verify.reports.store import rows_frame

from . import durations
from .corpus import Replay, Replayed, keep, not_replayed
from .outcome import CheckResult, Failure, GateOutcome, replay_command, rest_command
from .plan import FuzzRun, GateRun
from .start import Ready, Started
from .units import odd_ones_out


@dataclass
class UnitsResult:
    """What `run_units` leaves: every row, each campaign's result, the notes, the kept and pinned
    cases that failed, and each finished unit's seconds."""

    rows: list[Row] = field(default_factory=list)
    fuzz: list[FuzzResult] = field(default_factory=list)
    notes: set[str] = field(default_factory=set)
    replayed: list[Replayed] = field(default_factory=list)  # the kept and pinned cases that failed
    seconds: dict[str, float] = field(default_factory=dict)  # each finished unit's (runs.durations)

    @property
    def failed(self) -> bool:
        return any(not r.passed for r in self.rows)

    def new_findings(self) -> list[Path]:
        """The case files of the findings a kept corpus has yet to keep: the failing pinned cases',
        the campaigns'."""
        return ([r.path for r in self.replayed if r.source == Replay.PINNED]
                + [fz.case_file for fz in self.fuzz if fz.case_file is not None])


def finish(started: Started, result: UnitsResult) -> CheckResult | GateOutcome:
    """The outcome of `started` once driven to `result`, its run directory finished."""
    return _checked(started, result) if isinstance(started.run, FuzzRun) else _gated(started, result)


def _checked(started: Started, result: UnitsResult) -> CheckResult:
    """A fuzz run's outcome: its one campaign's, and its kept and pinned cases that failed."""
    run, sink, meta = started.run, started.sink, started.meta
    fz, = result.fuzz
    if run.out:
        run.out.finish(sink.rows, {**meta, "stopped": fz.stopped} if fz.stopped else meta)  # a stopped run is no pass
    notes = keep(started.kept, result.new_findings(), sink.rows) + started.left + sorted(result.notes)
    failures = [Failure.of(r.case, r.rows, r.path, replay_command(r.path, run.specs, run.device, run.deviations,
                                                                  run.timeout, run.isolate, run.conventions),
                           seed=fz.seed, from_corpus=True) for r in result.replayed]
    return _check_result(run, fz, rows_frame(sink.rows), notes, fz.seed, failures, started.judging.summary())


def _check_result(run: FuzzRun, fz: FuzzResult, frame, notes: list[str], seed: int, failures: list,
                  sandbox: str = "") -> CheckResult:
    if fz.failure is not None and all(f.case_file != fz.case_file for f in failures):  # not a corpus case's again
        failures.append(Failure.of(fz.failure.case, fz.failure.rows, fz.case_file,
                                   replay_command(fz.case_file, run.specs, run.device, run.deviations, run.timeout,
                                                  run.isolate, run.conventions),
                                   found_at=fz.first_failure_at, seed=seed, flaky=fz.flaky, minimized=fz.shrunk,
                                   unminimized=fz.unminimized))
    notes = notes + [str(fz.stopped)] * (fz.stopped not in (None, Stop.INTERRUPTED))
    notes += unexercised(run.specs, call_guards.CALLED_WITH)  # what the replaced stages were never handed
    if run.world_size:
        notes += [f"worst per rank over {fz.examples} cases: {line}" for line in dcp_ranks.worst_by_rank(fz.rows)]
    silent = never_called(run.specs, call_guards.CALLED_WITH, (run.op,))
    return CheckResult(run.op, run.label,
                       not failures and not silent and fz.stopped != Stop.INTERRUPTED and bool(frame.passed.all()),
                       frame, seed, fz.examples, run.out.path if run.out else None, failures,
                       interrupted=fz.stopped == Stop.INTERRUPTED, notes=notes, in_process=run.in_process,
                       sandbox=sandbox, covering=run.covering,
                       never_called=_never_judged(run.op, silent, f"these {fz.examples} cases"))


def _never_judged(op: str, stages: list[str], cases: str) -> str:
    """Why there is no verdict on the replaced `stages` no case called ("": there is), and where
    calls of them are drawn (`PipelineSpec.paths_calling`)."""
    if not stages:
        return ""
    spec = catalog.get_spec(op)
    paths = spec.paths_calling(stages) if hasattr(spec, "paths_calling") else ()
    where = (f"{op}'s paths that call {'it' if len(stages) == 1 else 'them'}: {', '.join(paths)}" if paths
             else f"no {op} batch calls {'it' if len(stages) == 1 else 'them'}")
    return f"{', '.join(stages)} never called by {cases}: nothing judged {'it' if len(stages) == 1 else 'them'} ({where})"


def _gated(started: Started, result: UnitsResult) -> GateOutcome:
    """The gate's outcome over the units of this slot."""
    run, kept, chosen = started.run, started.kept, started.chosen
    interrupted = started.sink.interrupt.requested
    silent = never_called(run.impls, call_guards.CALLED_WITH, [u.op for u in chosen])
    outcome = GateOutcome(result.rows, result.failed, run.out.path, interrupted,
                          keep(kept, result.new_findings(), result.rows) + not_replayed(kept, chosen, run.ops)
                          + sorted(result.notes),
                          odd_ones_out(result.rows),
                          isolated=run.isolate, rest=_rest(run, started.units, result) if interrupted else (0, ""),
                          sandbox=started.judging.summary(), case_files=_case_files(run, result),
                          never_called=_never_judged("forward_mqa", silent, "the gate's cases"))
    durations.write(run.out.path, result.seconds)
    run.out.finish(result.rows, {**started.meta, "stopped": Stop.INTERRUPTED} if interrupted else started.meta)
    return outcome


def _case_files(run: GateRun, result: UnitsResult) -> list[tuple[Path, list[str]]]:
    """Each finding's case file and the lines the gate prints under it: where it came from, the
    command that replays it (with the implementation saved) and its failing rows."""
    def said(path: Path, rows) -> list[str]:
        command = replay_command(path, load(path).impl, run.device, timeout=run.timeout, isolate=run.isolate)
        return [f"  replay: {command}", *(f"  {r.line()}" for r in rows if not r.passed)]

    replayed = [(r.path, [f"  from the corpus: still fails (kept as {r.kept_as})" if r.kept_as
                          else "  a pinned regression case: fails", *said(r.path, r.rows)])
                for r in result.replayed if r.path is not None]
    return replayed + [(fz.case_file, [f"  not minimized: {fz.unminimized}"] * bool(fz.unminimized)
                        + said(fz.case_file, fz.failure.rows if fz.failure else ()))
                       for fz in result.fuzz if fz.case_file and fz.case_file not in {r.path for r in result.replayed}]


def _rest(run: GateRun, mine: list[Ready], result: UnitsResult) -> tuple[int, str]:
    """An interrupted gate's ops (and properties) with a unit of its shard (`mine`) it did not
    finish, and the command that runs them (`outcome.rest_command`)."""
    left = list(dict.fromkeys(r.unit.op for r in mine if r.unit.key not in result.seconds))
    return len(left), rest_command(run, left, run.out.path.with_name(f"{run.out.path.name}-rest")) if left else ""
