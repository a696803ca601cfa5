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

import math
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from mla_verify.equivalence import catalog, contract, distributed
from mla_verify.equivalence import device as dev
from mla_verify.equivalence.case import Case
from mla_verify.equivalence.device import take_gpu_share
from mla_verify.equivalence.isolation import HarnessError, Worker
from mla_verify.equivalence.profiles import Profile
from mla_verify.equivalence.mismatch import line
from mla_verify.equivalence.rows import Row
from mla_verify.equivalence.running import failure_row
from mla_verify.equivalence.subject import Subject, UsageError, unexercised
from mla_verify.fuzz.campaign import FuzzResult, fuzz
from mla_verify.fuzz.casefile import write_atomic
from mla_verify.fuzz.progress import Progress
from mla_verify.fuzz.regressions import corpus
from mla_verify.pytest_plugin import DEFAULTS
from mla_verify.reports.store import rows_frame

from .interrupt import Interrupt
from .outcome import RESULT_JSON, CheckResult, Failure, GateOutcome, replay_command, result_file
from .parts import Shard, check_in_parts, gate_in_parts
from .plan import FUZZ, Run
from .units import Unit, gate_world_size, odd_ones_out, shard_units, units

MIN_DRAWS = 25  # params a campaign draws at the least where its budget allows (`block_size`)


@dataclass
class GateResult:
    rows: list[Row] = field(default_factory=list)
    fuzz: list[FuzzResult] = field(default_factory=list)
    notes: set[str] = field(default_factory=set)

    @property
    def failed(self) -> bool:
        return any(not r.passed for r in self.rows)



def _examples(op: str, examples: int | None, profile: Profile) -> int:
    return examples if examples is not None else catalog.get_spec(op).examples(profile)


def _block_runner(unit: Unit, subject: Subject, device: str, run_id: str, worker: Worker | None, notes: set[str],
                  lost: list[str] | None):
    """(cases, source, on_call) -> each case's rows (None: not judged), for a campaign's blocks
    (`fuzz.campaign`): in the isolation worker, or in this process. With `lost` (a fuzz run), a
    CUDA context that saw a CUDA error of the implementation cannot run another case: its block
    ends there (`OpSpec.evaluate_block`) and so does the campaign, the case being the
    implementation's crash."""
    if worker is not None:
        def isolated(cases, source, on_call):
            found = worker.run_block(cases, unit.specs, unit.label, run_id, source, notes=notes,
                                     deviations=unit.deviations, conventions=unit.conventions, on_call=on_call)
            for rows in found:
                for r in rows:
                    r.impl = unit.label
            return found

        return isolated
    cuda = device.startswith("cuda")

    def in_process(cases, source, on_call):
        if lost is None:
            return catalog.evaluate_block(cases, subject, device, run_id=run_id, source=source, notes=notes,
                                          on_call=on_call)
        called: list[bool] = []
        try:
            found = catalog.evaluate_block(cases, subject, device, run_id=run_id, source=source, notes=notes,
                                           on_call=lambda: (called.append(True), on_call()))
        except Exception as exc:  # a CUDA error the harness met after the implementation ran: that case's crash
            if not (cuda and called and (dev.is_device_error(exc) or not dev.usable(device))):
                raise
            case = cases[len(called) - 1]
            base = dict(run_id=run_id, case_id=case.case_id, impl=unit.label, stages="", device=device,
                        seed=case.seed, source=source, **catalog.get_spec(case.op).identity(case))
            found = [None] * len(cases)
            found[len(called) - 1] = [failure_row(base, "*", "crashed",
                                                  f"CUDA error after the implementation ran: {dev.first_line(exc)}")]
        if cuda and not lost and (
                any(r.gate_metric in ("raised", "crashed") and dev.is_device_error(r.reason)
                    for rows in found if rows for r in rows) or not dev.usable(device)):
            lost.append("the CUDA context is unusable after a CUDA error of the implementation; "
                        "run isolated (--isolate) to go on past crashes")
        return found

    return in_process


def block_size(profile: Profile, examples: int) -> int:
    """Cases a campaign of `examples` runs per drawn example: the profile's block, fewer where the
    campaign would draw under MIN_DRAWS params (blocks share their params: they trade breadth for
    speed)."""
    return max(1, min(profile.block, examples // MIN_DRAWS))


def run_units(
    chosen: list[Unit],
    *,
    device: str,
    profile: Profile,
    examples: int | None,
    seed: int,
    run_id: str,
    out_dir: Path,
    isolate: bool,
    timeout_s: float,
    shrink: bool = True,
    world_size: int | None = None,
    log=None,
    progress: bool = True,
    journal: Callable[[list[Row]], None] | None = None,
    stop_reason: Callable[[], str] = lambda: "",
    started: Callable[..., Callable[[], None]] | None = None,
    lost: list[str] | None = None,
) -> GateResult:
    """The one campaign driver: each unit's corpus, then its campaigns of `examples` cases (None:
    the profile's budget for the op) with `seed`. `world_size`: a multi-rank op's ranks (default:
    `gate_world_size`). `started(case, source, impl=, specs=)` is told of each case before it runs
    and returns the call that says it finished (`mla_verify.runs.rundir` journals both); `journal`
    receives each case's rows as it finishes; a `stop_reason` (Ctrl-C, a lost CUDA context: `lost`,
    see `_block_runner`) ends the run after the current case. `progress`: the gate's progress line
    over every unit and a line per campaign on `log` (default the stderr of the moment: pytest's
    capture replaces it between tests); without it each campaign shows its own."""
    log = log or sys.stderr
    result = GateResult()
    kind = device.split(":")[0]
    subjects = [(unit, unit.resolved(device)) for unit in chosen]
    cases = sum((len(corpus(u.op)) if u.corpus else 0) + _examples(u.op, examples, profile) * len(u.campaigns(s))
                for u, s in subjects)
    gate_progress = Progress("gate", cases, every_s=10.0 if progress else math.inf, stream=log)  # one line for all
    worker = Worker(device, timeout_s) if isolate else None
    distributed.set_timeout(timeout_s)
    try:
        for unit, subject in subjects:
            op, label, specs = unit.op, unit.label, unit.specs
            spec = catalog.get_spec(op)
            budget = _examples(op, examples, profile)
            pinned = corpus(op) if unit.corpus else []
            judge_block = _block_runner(unit, subject, device, run_id, None if spec.own_processes else worker,
                                        result.notes, lost)

            def run(case: Case, source: str, judge_block=judge_block, where=f"{op} / {label}") -> list[Row]:
                rows, = judge_block([case], source, lambda: None)
                if progress and source in ("corpus", "fuzz"):
                    gate_progress.step(any(not r.passed for r in rows), now_at=where)
                return rows

            def run_block(cases: list[Case], source: str, on_call, judge_block=judge_block,
                          where=f"{op} / {label}") -> list[list[Row]]:
                found = judge_block(cases, source, on_call)
                if progress and source == "fuzz":
                    for rows in filter(None, found):
                        gate_progress.step(any(not r.passed for r in rows), now_at=where)
                return found

            watch = None if started is None else (
                lambda case, source, label=label, specs=specs: started(case, source, impl=label, specs=specs))
            t0 = time.monotonic()  # a campaign's seconds include the corpus cases run before it
            pinned_rows = []
            for case, _why in pinned:
                if stop_reason():
                    return result
                finished = watch(case, "corpus") if watch is not None else None
                case_rows = run(case, "corpus")
                if finished is not None:
                    finished()
                pinned_rows += case_rows
                if journal is not None:
                    journal(case_rows)
            result.rows.extend(pinned_rows)
            for path in unit.campaigns(subject):
                if stop_reason():
                    return result
                fz = fuzz(op, run, profile=profile, examples=budget, seed=seed, impl_specs=specs, impl_label=label,
                          deviations=unit.deviations, conventions=unit.conventions, device=device, out_dir=out_dir,
                          shrink=shrink, show_progress=not progress, path=path,
                          world_size=world_size or gate_world_size(spec, kind), journal=journal,
                          stop_reason=stop_reason, started=watch, block=block_size(profile, budget),
                          run_block=run_block)
                result.fuzz.append(fz)
                result.rows.extend(fz.rows)
                if progress:
                    where = f"{op} ({path})" if path else op
                    bad = sum(not r.passed for r in [*pinned_rows, *fz.rows])
                    log.write(f"{where:38s} {label:28s} {len(pinned):3d} corpus + {fz.examples:4d} fuzz cases "
                              f"{time.monotonic() - t0:6.1f} s  {'FAIL' if bad else 'ok'}{f' ({bad} rows)' if bad else ''}\n")
                    log.flush()
                t0 = time.monotonic()
    finally:
        if worker is not None:
            worker.close()
    return result


def run_gate(*, ops: list[str] | None, shard: Shard, device: str, **settings) -> GateResult:
    """The gate's units of `shard` (`Shard()`: all of them) through `run_units`, with its
    `settings` (profile, examples, seed, run_id, out_dir, isolate, timeout_s, journal, ...)."""
    return run_units(shard_units(ops, device, shard), device=device, **settings)


def drive(run: Run, log: Callable[[str], None] | None = None):
    """Run `run`: a CheckResult for fuzz, a GateOutcome for the gate. `log` receives the lines of
    a run in parts (the parts' own go to their logs or this process's output)."""
    if run.parts > 1:
        if run.command == FUZZ:
            return check_in_parts(run, log)
        return gate_in_parts(run, units(list(run.ops) or None, run.device), log)
    return _fuzz(run) if run.command == FUZZ else _gate(run)


def _stop(interrupt: Interrupt, lost: list[str]) -> Callable[[], str]:
    return lambda: "interrupted" if interrupt.requested else lost[0] if lost else ""


def _fuzz(run: Run) -> CheckResult:
    """One campaign in this process (its cases isolated or not), written to the run directory."""
    run_id = f"fuzz-{time.strftime('%Y%m%d-%H%M%S')}"
    (seed, examples), = run.campaigns
    meta = run.meta()
    run_dir = run.out
    out_dir = run_dir.path if run_dir else Path(DEFAULTS.get("failures") or Path(tempfile.gettempdir()) / "mla-verify")
    if run_dir:
        run_dir.start(meta)
    interrupt, lost, rows = Interrupt(), [], []

    def journal(case_rows):
        rows.extend(case_rows)
        if run_dir:
            run_dir.append(case_rows)

    started = None if run_dir is None else (
        lambda case, source, impl, specs: run_dir.case_started(case, source, run_id=run_id, impl=impl, specs=specs,
                                                               device=run.device, deviations=run.deviations))
    unit = Unit(run.op, run.label, run.specs, subject=run.subject, paths=(run.path,), corpus=False,
                deviations=run.deviations, conventions=run.conventions)
    contract.CALLED_WITH.clear()
    try:
        with interrupt.installed():
            result = run_units([unit], device=run.device, profile=run.profile, examples=examples, seed=seed,
                               run_id=run_id, out_dir=out_dir, isolate=run.isolate, timeout_s=run.timeout,
                               shrink=run.shrink, world_size=run.world_size, journal=journal,
                               stop_reason=_stop(interrupt, lost), started=started, lost=lost, progress=False)
    except Exception as exc:
        if run_dir:
            detail = exc.detail if isinstance(exc, HarnessError) else traceback.format_exc()
            run_dir.write_file("harness-error.txt", detail or traceback.format_exc())
            run_dir.finish(rows, meta)
        if isinstance(exc, HarnessError):
            raise
        raise HarnessError(f"harness error: {type(exc).__name__}: {exc}", traceback.format_exc()) from exc
    fz, = result.fuzz
    if run_dir:
        run_dir.finish(rows, {**meta, "stopped": fz.stopped} if fz.stopped else meta)  # a stopped run is no pass
    frame = rows_frame(rows)
    failures = []
    if fz.failure is not None:
        failures.append(Failure.of(fz.failure.case, fz.failure.rows, fz.case_file,
                                   replay_command(fz.case_file, run.specs, run.device, run.deviations, run.timeout,
                                                  run.isolate, run.conventions),
                                   found_at=fz.first_failure_at, seed=seed, flaky=fz.flaky, minimized=fz.shrunk))
    extra = sorted(result.notes) + [fz.stopped] * (fz.stopped not in ("", "interrupted"))
    extra += unexercised(run.specs, contract.CALLED_WITH)  # what the replaced stages were never handed
    if run.world_size:
        extra += [f"worst per rank over {fz.examples} cases: {line}" for line in distributed.worst_by_rank(fz.rows)]
    return CheckResult(run.op, run.label, not failures and fz.stopped != "interrupted" and bool(frame.passed.all()),
                       frame, seed, fz.examples, run_dir.path if run_dir else None, failures,
                       interrupted=fz.stopped == "interrupted", notes=extra, in_process=run.in_process)


def _gate(run: Run) -> GateOutcome:
    """The gate's units of this slot in this process, written to the run directory."""
    run_dir, meta, interrupt = run.out, run.meta(), Interrupt()
    run_id = f"gate-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.start(meta)
    try:
        with interrupt.installed():
            result = run_gate(ops=list(run.ops) or None, shard=run.shard, device=run.device, profile=run.profile,
                              examples=run.examples, seed=run.seed, run_id=run_id, out_dir=run_dir.path,
                              isolate=run.isolate, timeout_s=run.timeout, journal=run_dir.append,
                              stop_reason=_stop(interrupt, []),
                              started=lambda case, source, impl, specs: run_dir.case_started(
                                  case, source, run_id=run_id, impl=impl, specs=specs, device=run.device))
    except Exception as exc:  # mla-verify's own failure: exit 3, its traceback where the message says
        detail = (exc.detail if isinstance(exc, HarnessError) else None) or traceback.format_exc()
        run_dir.write_file("harness-error.txt", detail)
        run_dir.release()
        if isinstance(exc, HarnessError):
            raise
        raise HarnessError(f"harness error in {run_dir.path}: {type(exc).__name__}: {exc}", detail) from exc
    except BaseException:  # the journal keeps the rows so far; the next run may take the directory's lock
        run_dir.release()
        raise
    finally:
        distributed.close_all()
    outcome = GateOutcome(result.rows, result.failed, run_dir.path, interrupt.requested, sorted(result.notes),
                          odd_ones_out(result.rows), isolated=run.isolate)
    run_dir.finish(result.rows, {**meta, "stopped": "interrupted"} if interrupt.requested else meta)
    outcome.case_files = [(fz.case_file, [f"  {line(r.tensor, r.gate_metric, r.value, r.bound, r.reason)}"
                                          for r in (fz.failure.rows if fz.failure else ()) if not r.passed])
                          for fz in result.fuzz if fz.case_file]
    return outcome


def main(argv: list[str] | None = None) -> int:
    """A part's process: `python -m mla_verify.runs.driver RUN_JSON` (`Run.to_json`; `runs.parts` starts it)."""
    text = (argv or sys.argv[1:])[0]  # the parent chose the Triton interpreter on CPU: the environment has it
    try:
        run = Run.from_json(text)
        take_gpu_share(0.5 if run.isolate else 1.0)  # an isolated part's worker takes the other half
        print(run.header(), flush=True)
        outcome = drive(run)
    except KeyboardInterrupt:
        return 130
    except UsageError as exc:
        print(f"mla-verify: {exc}", file=sys.stderr)
        return 2
    except HarnessError as exc:
        print(f"mla-verify: {exc}", file=sys.stderr)
        return 3
    if run.command == FUZZ:
        print(outcome.report())
        write_atomic(outcome.out / RESULT_JSON, result_file(outcome))
    elif outcome.lines(run.device_type):
        print("\n".join(outcome.lines(run.device_type)))
    return outcome.exit_code


if __name__ == "__main__":
    sys.exit(main())
