"""The one execution of a run (`runs.plan.Run`), fuzz or gate: `execute` runs it

    parts == 1   this process runs its slot (`runs.parts`): the fuzz campaign of seed S + k and
                 its share of the examples, or the gate's units of slot k: started
                 (`runs.start`: every part of it built) and driven here
    parts > 1    one child process per part, each the Run of one slot of this host
                 (`python -m mla_verify.runs.driver RUN_JSON`, `runs.parts`), their rows joined
                 into the run directory

`drive` composes a started run: each unit's kept and pinned cases, then its campaigns, each a
Hypothesis search (`fuzz.campaign`) whose blocks of cases go to the unit's judge (`runs.judges`,
in the isolation worker or in this process); then the run's outcome (`runs.outcome`).
"""

from __future__ import annotations

import sys
import time
from typing import Callable

from mla_verify.equivalence.errors import HarnessError, UsageError
from mla_verify.equivalence.sandbox.device import WORKER_SHARE, take_gpu_share
from mla_verify.fuzz.campaign import FuzzResult, fuzz
from mla_verify.fuzz.casefile import write_atomic
from mla_verify.fuzz.findings import Findings

from .corpus import Replayed, save_replayed
from .finish import UnitsResult, finish
from .outcome import RESULT_JSON, CheckResult, GateOutcome, Outcome, result_file
from .plan import FuzzRun, GateRun, Run
from .start import Ready, Started, start


def run_units(run: Started) -> UnitsResult:
    """The one campaign driver: each ready unit's kept and pinned cases, then its campaigns,
    every case told to the run's sink, which stops the run after the current case when it has a
    reason. The gate's log: one progress line over every unit and a line per campaign on stderr;
    a fuzz run's: its own progress line."""
    result = UnitsResult(notes=run.notes)
    log = sys.stderr if run.writes_lines else None  # the stderr of the moment: pytest's capture replaces it
    for ready in run.units:
        if not _run_unit(ready, run, result, log):
            break
    return result


def _run_unit(ready: Ready, run: Started, result: UnitsResult, log) -> bool:
    """One unit's kept cases, corpus and campaigns into `result`; False where the sink stopped the run."""
    unit, sink = ready.unit, run.sink
    sink.judging(unit)
    t0 = start = time.monotonic()  # a campaign's seconds include the corpus cases run before it
    finished = True                # every campaign ran its budget (a stopped one: the unit is not done)
    replayed = len(result.replayed)
    pinned_rows = []
    for case, source, why in ready.replays:
        if sink.stop_reason():
            return False
        sink.started(case, source)
        case_rows, = ready.judge([case], source, lambda: None)
        sink.finished(case)
        if any(not r.passed for r in case_rows):  # a finding of this run: saved, its rows naming the file
            result.replayed.append(save_replayed(ready.findings, ready.tested, case, case_rows, source, why))
        sink.judged(case_rows, source)
        pinned_rows += case_rows
    result.rows.extend(pinned_rows)
    for campaign in ready.campaigns:
        if sink.stop_reason():
            return False
        fz = fuzz(campaign, ready.judge, sink)
        finished &= not fz.stopped
        _found_again(fz, result.replayed[replayed:], ready.findings)
        result.fuzz.append(fz)
        result.rows.extend(fz.rows)
        if log is not None:
            where = f"{unit.op} ({campaign.path})" if campaign.path else unit.op
            bad = sum(not r.passed for r in [*pinned_rows, *fz.rows])
            kept = f"{len(unit.kept)} kept + " if unit.kept else ""
            log.write(f"{where:38s} {unit.label:28s} {kept}{ready.pinned:3d} corpus + {fz.examples:4d} fuzz cases "
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


def execute(run: FuzzRun | GateRun, log: Callable[[str], None] | None = None) -> CheckResult | GateOutcome:
    """Run `run`: a CheckResult for fuzz, a GateOutcome for the gate (`runs.outcome.Outcome`: its
    lines, its exit code). `log` receives the run's header line (once its worker could import the
    implementation: a usage error is the only line otherwise) and the lines of a run in parts (the
    parts' own go to their logs or this process's output)."""
    log = log or (lambda line: None)
    if run.parts > 1:
        log(run.header())
        return run.in_parts(log)
    started = start(run, log)
    return finish(started, drive(started))


def drive(run: Started) -> UnitsResult:
    """A started run (`runs.start`) driven: its units' cases judged, written to the run
    directory as they come; its worker stopped at the end."""
    try:
        with run.guarded(), run.sink.interrupt.installed():
            return run_units(run)
    finally:
        run.close()


def main(argv: list[str] | None = None) -> int:
    """A part's process: `python -m mla_verify.runs.driver RUN_JSON` (`Run.to_json`; `runs.parts` starts it)."""
    text = (argv or sys.argv[1:])[0]  # the parent chose the Triton interpreter on CPU: the environment has it
    try:
        run = Run.from_json(text)
        take_gpu_share(1 - WORKER_SHARE if run.isolate else 1.0)  # an isolated part's worker takes the rest
        outcome: Outcome = execute(run, lambda line: print(line, flush=True))
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
