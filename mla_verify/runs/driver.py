"""The one execution of a run (`runs.plan.Run`), fuzz or gate: `drive` runs it

    parts == 1   this process runs its slot (`runs.parts`): the fuzz campaign of seed S + k and
                 its share of the examples, or the gate's units of slot k
    parts > 1    one child process per part, each the Run of one slot of this host
                 (`python -m mla_verify.runs.driver RUN_JSON`, `runs.parts`), their rows joined
                 into the run directory

Both kinds judge each case through `run_units`, the one campaign driver: a `Unit`
(`runs.units`) is one op and implementation with its corpus and campaigns (a fuzz run: one unit,
no corpus); each campaign is a Hypothesis search (`fuzz.campaign`) whose blocks of cases the block
runner judges, in the isolation worker or in this process.
"""

from __future__ import annotations

import gc
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from mla_verify.equivalence import catalog
from mla_verify.equivalence.blocks import Judging
from mla_verify.equivalence.sandbox import call_guards
from mla_verify.equivalence.ops import dcp_ranks
from mla_verify.equivalence.sandbox import device as dev
from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.cases.values import release_pools
from mla_verify.equivalence.sandbox.device import WORKER_SHARE, take_gpu_share
from mla_verify.equivalence.errors import HarnessError
from mla_verify.equivalence.cases.profiles import Profile
from mla_verify.equivalence.judge.rows import FailureKind, Row, RowContext
from mla_verify.equivalence.subject import Subject, never_called, unexercised
from mla_verify.equivalence.errors import UsageError
from mla_verify.fuzz.campaign import Campaign, FuzzResult, Judge, Stop, fuzz
from mla_verify.fuzz.casefile import load, write_atomic
from mla_verify.fuzz.findings import Findings, UnderTest
from mla_verify.runs.progress import Progress
from mla_verify.fuzz.regressions import corpus
from mla_verify.pytest_plugin import DEFAULTS
from mla_verify.reports.store import rows_frame

from .corpus import Corpus, Replay, Replayed, keep, not_replayed, save_replayed
from .declines import asked_again
from .outcome import (RESULT_JSON, CheckResult, Failure, GateOutcome, Outcome, replay_command, rest_command,
                      result_file)
from .plan import FuzzRun, GateRun, Run
from .sink import Sink
from . import durations
from .units import Unit, odd_ones_out

MIN_DRAWS = 25  # params a campaign draws at the least where its budget allows (`block_size`)


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


def _pinned(unit: Unit) -> list[tuple[Case, str]]:
    """(case, why) of the unit's pinned regression cases, less those its kept corpus replays already."""
    kept = [k.case for k in unit.kept]
    return [(case, why) for case, why in (corpus(unit.op) if unit.corpus else []) if case not in kept]


def _examples(spec, examples: int | None, profile: Profile) -> int:
    return examples if examples is not None else spec.examples(profile)


def _block_runner(subject: Subject, judging: Judging, context: RowContext, losing: Sink | None) -> Judge:
    """(cases, source, on_call) -> each case's rows (None: not judged), for a campaign's blocks
    (`fuzz.campaign`), by the run's `judging`, in `context` at the block's source. With `losing` (a
    fuzz run), a CUDA context the implementation took with it ends the campaign (`Sink.lose`)."""
    def judged(cases, source, on_call):
        found = judging.block(cases, subject, replace(context, source=source, on_call=on_call))
        if losing is not None and judging.lost:
            losing.lose(Stop.DEVICE_LOST)
        return found

    return judged


OOM_WAITS = (2.0, 8.0)  # seconds a block the judge ran out of device memory for waits before each retry


def _within_memory(judge: Judge, context: RowContext) -> Judge:
    """`judge`, where the judge's own side (inputs, reference, verdicts; never the implementation's
    call, whose failure is its own) runs out of device memory because the other parts on the card
    peaked with it: its cached memory given back, the block waits and runs again, then one case at
    a time; a case that still does not fit is a `not_judged` row of this part's log, counted and
    not failed, and the run goes on (it was exit 3 for the whole run)."""
    def judged(cases, source, on_call):
        told = []  # the campaign hears of each case's call once, whatever is retried

        def once() -> None:
            if len(told) < len(cases):
                told.append(True)
                on_call()

        for wait in OOM_WAITS:
            try:
                return judge(cases, source, once)
            except torch.OutOfMemoryError as exc:
                error = exc
            _give_back(wait)
        if len(cases) > 1:
            return [rows for case in cases for rows in judged([case], source, once)]
        base = catalog.row_base(cases[0], replace(context, source=source))
        return [[Row(**base, tensor="*", passed=True, gate_metric=FailureKind.NOT_JUDGED, value=0.0, bound=0.0,
                     headroom=float("inf"), reason=f"not judged: the judge ran out of device memory "
                     f"({dev.first_line(error)}); fewer --parallel parts or a smaller --reference-memory fit it")]]

    return judged


def _give_back(seconds: float) -> None:
    """This process's input pools and cached device memory back to the card, then a wait for the
    other parts'."""
    release_pools()
    gc.collect()
    torch.cuda.empty_cache()
    time.sleep(seconds)


def block_size(profile: Profile, examples: int) -> int:
    """Cases a campaign of `examples` runs per drawn example: the profile's block, fewer where the
    campaign would draw under MIN_DRAWS params (blocks share their params: they trade breadth for
    speed)."""
    return max(1, min(profile.block, examples // MIN_DRAWS))


def _failures_dir(run: Run) -> Path:
    """Where failing cases are saved: the run directory, else pytest's --mla-verify-failures or a
    temporary directory."""
    if run.out is not None:
        return run.out.path
    return Path(DEFAULTS.get("failures") or Path(tempfile.gettempdir()) / "mla-verify")


def judging(run: Run, chosen: list[Unit]) -> tuple[Judging, dict]:
    """How a run judges its blocks (`Judging`: in its isolation worker, or in this process), its
    worker started and each unit's user implementation resolved in it (imported there, never
    here: UsageError before the run directory starts), and what meta.json records of it: the
    sandbox its workers stand behind and the deviations each user's --impl resolved to (read from
    its source, or --deviation)."""
    judged = Judging(run.device, run.isolate, run.timeout, run.sandbox)
    if not run.isolate:
        return judged, {}
    resolved = {}
    try:
        judged.start()
        for unit in chosen:
            if any(":" in s for s in unit.specs) and not catalog.get_spec(unit.op).own_processes:
                subject = judged.resolve(unit.op, unit.specs, unit.deviations, unit.conventions)
                resolved[" ".join(unit.specs)] = {"op": unit.op, "deviations": list(subject.deviations)}
    except BaseException:
        judged.close()
        raise
    return judged, {"sandbox": judged.sandboxed(), **({"resolved": resolved} if resolved else {})}


def run_units(chosen: list[Unit], run: Run, sink: Sink, judging: Judging, *, seed: int, examples: int | None,
              log=None) -> UnitsResult:
    """The one campaign driver: each unit's corpus, then its campaigns of `examples` cases (None:
    the profile's budget for the op) with `seed`, every case told to `sink`, which stops the run
    after the current case when it has a reason. With `log` (the gate's; a stream), one progress
    line over every unit and a line per campaign; without it, a fuzz run's own progress line.
    `judging`: how the run judges its blocks (`judging()`), closed at the end."""
    result = UnitsResult()
    # Isolated, a user's module is imported by the worker only (dcp's ranks are processes of their own).
    subjects = [(unit, unit.resolved(run.device, described=run.isolate and not catalog.get_spec(unit.op).own_processes))
                for unit in chosen]
    if log is not None:
        cases = sum(len(u.kept) + len(_pinned(u))
                    + _examples(catalog.get_spec(u.op), examples, run.profile) * len(u.campaigns(s)) for u, s in subjects)
        sink.counting(Progress("gate", cases, every_s=10.0, stream=log), name_units=True)
    dcp_ranks.set_timeout(run.timeout)
    try:
        for unit, subject in subjects:
            if not _run_unit(unit, subject, run, sink, result, judging, seed=seed, examples=examples, log=log):
                break
    finally:
        judging.close()
    return result


def _run_unit(unit: Unit, subject: Subject, run: Run, sink: Sink, result: UnitsResult, judging: Judging, *,
              seed: int, examples: int | None, log) -> bool:
    """One unit's kept cases, corpus and campaigns into `result`; False where the sink stopped the run."""
    spec = catalog.get_spec(unit.op)
    budget = _examples(spec, examples, run.profile)
    context = RowContext(sink.run_id, label=unit.label, device=run.device, notes=result.notes)
    judge = asked_again(_within_memory(
        _block_runner(subject, judging, context, sink if run.stops_when_lost else None), context))
    sink.judging(unit)
    tested = UnderTest(unit.specs, unit.label, unit.deviations, unit.conventions, run.device)
    findings = Findings(_failures_dir(run), sink)
    t0 = start = time.monotonic()  # a campaign's seconds include the corpus cases run before it
    finished = True                # every campaign ran its budget (a stopped one: the unit is not done)
    pinned, replayed = _pinned(unit), len(result.replayed)
    pinned_rows = []
    for case, source, why in ([(k.case, Replay.KEPT, k.path.name) for k in unit.kept]
                              + [(c, Replay.PINNED, why) for c, why in pinned]):
        if sink.stop_reason():
            return False
        sink.started(case, source)
        case_rows, = judge([case], source, lambda: None)
        sink.finished(case)
        if any(not r.passed for r in case_rows):  # a finding of this run: saved, its rows naming the file
            result.replayed.append(save_replayed(findings, tested, case, case_rows, source, why))
        sink.judged(case_rows, source)
        pinned_rows += case_rows
    result.rows.extend(pinned_rows)
    for path in unit.campaigns(subject):
        if sink.stop_reason():
            return False
        campaign = Campaign(unit.op, run.profile, budget, seed, tested, path, run.ranks(spec),
                            block_size(run.profile, budget), run.shrink, findings)
        fz = fuzz(campaign, judge, sink)
        finished &= not fz.stopped
        _found_again(fz, result.replayed[replayed:], findings)
        result.fuzz.append(fz)
        result.rows.extend(fz.rows)
        if log is not None:
            where = f"{unit.op} ({path})" if path else unit.op
            bad = sum(not r.passed for r in [*pinned_rows, *fz.rows])
            kept = f"{len(unit.kept)} kept + " if unit.kept else ""
            log.write(f"{where:38s} {unit.label:28s} {kept}{len(pinned):3d} corpus + {fz.examples:4d} fuzz cases "
                      f"{time.monotonic() - t0:6.1f} s  {'FAIL' if bad else 'ok'}{f' ({bad} rows)' if bad else ''}\n")
            log.flush()
        t0 = time.monotonic()
    if finished:   # its seconds size the next run's shards; an unfinished unit is an interrupted run's rest
        result.seconds[unit.key] = time.monotonic() - start
    return True


def _found_again(fz: FuzzResult, replayed: list[Replayed], findings: Findings) -> None:
    """A campaign's finding that is a kept or pinned case its unit replayed (and saved) already
    (a search often shrinks to the same small case): one finding, one file. The campaign's file
    goes and its case's rows name the replayed case's."""
    same = next((r for r in replayed if fz.failure is not None and r.case == fz.failure.case), None)
    if same is None or same.path is None or fz.case_file is None:
        return
    findings.drop(fz.case_file, [r for r in fz.rows if r.finding == fz.case_file.name], instead=same.path)
    fz.case_file = same.path


def drive(run: FuzzRun | GateRun, log: Callable[[str], None] | None = None) -> CheckResult | GateOutcome:
    """Run `run`: a CheckResult for fuzz, a GateOutcome for the gate (`runs.outcome.Outcome`: its
    lines, its exit code). `log` receives the run's header line (once its worker could import the
    implementation: a usage error is the only line otherwise) and the lines of a run in parts (the
    parts' own go to their logs or this process's output)."""
    log = log or (lambda line: None)
    if run.parts > 1:
        log(run.header())
        return run.in_parts(log)
    return _fuzz(run, log) if isinstance(run, FuzzRun) else _gate(run, log)


def _started(run: FuzzRun | GateRun, chosen: list[Unit], log: Callable[[str], None]) -> tuple[Judging, dict, Sink]:
    """How `run` judges (`judging`, each user's implementation of `chosen` imported in its worker
    first), its header said, its run directory started with the meta it records, and the sink that
    hears of its cases."""
    judged, judged_by = judging(run, chosen)
    log(run.header())
    meta = with_extra(run.meta(), judged_by)
    if run.out:
        run.out.start(meta)
    call_guards.CALLED_WITH.clear()
    return judged, meta, Sink(run.out, f"{run.command}-{time.strftime('%Y%m%d-%H%M%S')}", run.device)


def _fuzz(run: FuzzRun, log: Callable[[str], None]) -> CheckResult:
    """One campaign in this process (its cases isolated or not), written to the run directory."""
    (seed, examples), = run.campaigns
    kept = Corpus(run.corpus) if run.corpus else None
    unit = Unit(run.op, run.label, run.specs, subject=run.subject, paths=(run.path,), corpus=False,
                deviations=run.deviations, conventions=run.conventions,
                kept=kept.applying(run.op, run.specs) if kept and run.corpus_replay else ())
    left = not_replayed(kept, [unit], (run.op,), "run") if run.corpus_replay else []
    judged, meta, sink = _started(run, [unit], log)
    sink.counting(Progress(run.op, examples, every_s=5.0))
    try:
        with sink.interrupt.installed():
            result = run_units([unit], run, sink, judged, seed=seed, examples=examples)
    except Exception as exc:
        if run.out:
            detail = exc.detail if isinstance(exc, HarnessError) else traceback.format_exc()
            run.out.write_file("harness-error.txt", detail or traceback.format_exc())
            run.out.finish(sink.rows, meta)
        if isinstance(exc, HarnessError):
            raise
        raise HarnessError(f"harness error: {type(exc).__name__}: {exc}", traceback.format_exc()) from exc
    finally:
        judged.close()  # closed by run_units, unless it never got there
    fz, = result.fuzz
    if run.out:
        run.out.finish(sink.rows, {**meta, "stopped": fz.stopped} if fz.stopped else meta)  # a stopped run is no pass
    notes = keep(kept, result.new_findings(), sink.rows) + left + sorted(result.notes)
    failures = [Failure.of(r.case, r.rows, r.path, replay_command(r.path, run.specs, run.device, run.deviations,
                                                                  run.timeout, run.isolate, run.conventions),
                           seed=seed, from_corpus=True) for r in result.replayed]
    return _check_result(run, fz, rows_frame(sink.rows), notes, seed, failures, judged.summary())


def with_extra(meta: dict, extra: dict) -> dict:
    """`meta` with `extra` added to its "extra" record."""
    return {**meta, "extra": {**(meta.get("extra") or {}), **extra}} if extra else meta


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
                       sandbox=sandbox, never_called=_never_judged(run.op, silent, f"these {fz.examples} cases"))


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


def _gate(run: GateRun, log: Callable[[str], None]) -> GateOutcome:
    """The gate's units of this slot in this process, written to the run directory."""
    kept = Corpus(run.corpus) if run.corpus else None
    chosen = run.units(kept)
    mine = run.shard_of(chosen)
    judged, meta, sink = _started(run, mine, log)
    try:
        with sink.interrupt.installed():  # the stderr of the moment: pytest's capture replaces it
            result = run_units(mine, run, sink, judged, seed=run.seed, examples=run.examples, log=sys.stderr)
    except Exception as exc:  # mla-verify's own failure: exit 3, its traceback where the message says
        detail = (exc.detail if isinstance(exc, HarnessError) else None) or traceback.format_exc()
        run.out.write_file("harness-error.txt", detail)
        run.out.release()
        if isinstance(exc, HarnessError):
            raise
        raise HarnessError(f"harness error in {run.out.path}: {type(exc).__name__}: {exc}", detail) from exc
    except BaseException:  # the journal keeps the rows so far; the next run may take the directory's lock
        run.out.release()
        raise
    finally:
        dcp_ranks.close_all()
        judged.close()  # closed by run_units, unless it never got there
    interrupted = sink.interrupt.requested
    silent = never_called(run.impls, call_guards.CALLED_WITH, [u.op for u in chosen])
    outcome = GateOutcome(result.rows, result.failed, run.out.path, interrupted,
                          keep(kept, result.new_findings(), result.rows) + not_replayed(kept, chosen, run.ops)
                          + sorted(result.notes),
                          odd_ones_out(result.rows),
                          isolated=run.isolate, rest=_rest(run, mine, result) if interrupted else (0, ""),
                          sandbox=judged.summary(), case_files=_case_files(run, result),
                          never_called=_never_judged("forward_mqa", silent, "the gate's cases"))
    durations.write(run.out.path, result.seconds)
    run.out.finish(result.rows, {**meta, "stopped": Stop.INTERRUPTED} if interrupted else meta)
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


def _rest(run: GateRun, mine: list[Unit], result: UnitsResult) -> tuple[int, str]:
    """An interrupted gate's ops (and properties) with a unit of its shard (`mine`) it did not
    finish, and the command that runs them (`outcome.rest_command`)."""
    left = list(dict.fromkeys(u.op for u in mine if u.key not in result.seconds))
    return len(left), rest_command(run, left, run.out.path.with_name(f"{run.out.path.name}-rest")) if left else ""


def main(argv: list[str] | None = None) -> int:
    """A part's process: `python -m mla_verify.runs.driver RUN_JSON` (`Run.to_json`; `runs.parts` starts it)."""
    text = (argv or sys.argv[1:])[0]  # the parent chose the Triton interpreter on CPU: the environment has it
    try:
        run = Run.from_json(text)
        take_gpu_share(1 - WORKER_SHARE if run.isolate else 1.0)  # an isolated part's worker takes the rest
        outcome: Outcome = drive(run, lambda line: print(line, flush=True))
    except KeyboardInterrupt:
        return 130
    except UsageError as exc:
        print(f"mla-verify: {exc}", file=sys.stderr)
        return 2
    except HarnessError as exc:
        print(f"mla-verify: {exc}", file=sys.stderr)
        return 3
    if lines := outcome.lines():
        print("\n".join(lines))
    if isinstance(outcome, CheckResult):  # what its parent reads back (`parts.check_in_parts`)
        write_atomic(outcome.out / RESULT_JSON, result_file(outcome))
    return outcome.exit_code


if __name__ == "__main__":
    sys.exit(main())
