"""One run, whatever starts it: `check()` and `mla-verify fuzz` (one op and implementation),
`gate()` and `mla-verify gate` (every op and implementation here), a part of either on one of this
host's GPUs, a shard of either on another machine. A `Run` holds what the run is; `drive` runs it:

    parts == 1   this process runs its slot (`fuzz.shard`): the fuzz campaign of seed S + k and
                 its share of the examples, or the gate's units of slot k
    parts > 1    one child process per part, each the Run of one slot of this host
                 (`python -m mla_verify.run RUN_JSON`, `mla_verify.parallel`), their rows joined
                 into the run directory

Both kinds judge each case through `fuzz.gate.run_units`, the one campaign driver. The CLI builds
a Run through `check()` or `gate()` and prints; nothing here starts the CLI.
"""

from __future__ import annotations

import json
import shlex
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Callable

from mla_verify.equivalence.device import take_gpu_share
from mla_verify.equivalence.isolation import HarnessError
from mla_verify.equivalence.profiles import Profile
from mla_verify.equivalence.subject import Subject, UsageError
from mla_verify.fuzz.shard import Shard

from .corpus import Corpus, keep, still_failing, with_kept
from .interrupt import Interrupt
from .results import RESULT_JSON, CheckResult, Failure, GateOutcome, replay_command
from .rundir import RunDir

FUZZ, GATE = "fuzz", "gate"


@dataclass(frozen=True)
class Run:
    """What one run is. `examples`: fuzz, the whole run's cases (shared out over its campaigns);
    the gate, per unit (None: the profile's budgets)."""

    command: str                          # FUZZ or GATE
    ops: tuple[str, ...]                  # fuzz: its op; gate: what was asked (empty: every op and property)
    device: str                           # "cpu", "cuda" or "cuda:N"
    profile: Profile
    examples: int | None
    seed: int
    isolate: bool
    timeout: float
    out: RunDir | None = None             # the run directory being written
    baseline: Path | None = None          # the run whose cases these are again
    shard: Shard = Shard()
    parts: int = 1                        # this host's processes: the shard's slots (fuzz.shard)
    specs: tuple[str, ...] = ()           # fuzz: the implementation as --impl strings
    subject: Subject | None = None        # fuzz: the resolved implementation
    label: str = ""                       # fuzz: the rows' name for it
    deviations: tuple[str, ...] = ()
    conventions: tuple[str, ...] = ()     # fuzz: the implementation's declared conventions ("lse_base=2", ...)
    path: str | None = None
    world_size: int | None = None
    shrink: bool = True
    named: bool = True                    # every implementation importable in another process
    in_process: bool = False              # judged in the implementation's own process (not isolated, no ranks)
    invocation: str | None = None         # the command line that started it (meta.json's command)
    impls: tuple[str, ...] = ()           # gate: OP=SPEC / STAGE=SPEC it is restricted to (mla_verify.selection)
    corpus: str | None = None             # the kept corpus (mla_verify.corpus): replayed first, findings added
    corpus_replay: bool = True            # this part replays the corpus (a fuzz run's first part only)

    @property
    def op(self) -> str:
        return self.ops[0]

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    @property
    def slots(self) -> list[Shard]:
        """The slots of the whole run this host runs, one per part."""
        return self.shard.slots(self.parts)

    @property
    def campaigns(self) -> list[tuple[int, int]]:
        """fuzz: (seed, examples) of each campaign this host runs."""
        return [c for c in (slot.campaign(self.seed, self.examples) for slot in self.slots) if c[1]]

    def options(self) -> dict[str, Any]:
        """The settings every shard of one run shares (`merge` checks them)."""
        common = {"command": self.command, "examples": self.examples, "seed": self.seed,
                  "profile": self.profile.name, "device": self.device_type, "isolate": self.isolate,
                  "timeout": self.timeout}
        if self.command == GATE:
            return {**common, "ops": list(self.ops) or None, "impls": list(self.impls) or None}
        return {**common, "op": self.op, "impl": list(self.specs), "path": self.path, "world_size": self.world_size,
                "deviations": list(self.deviations), "conventions": list(self.conventions), "shrink": self.shrink,
                "campaigns": self.shard.count * self.parts}

    def meta(self) -> dict[str, Any]:
        """meta.json: what `check(baseline=...)` and `gate --baseline` read back to draw the same
        cases (reports.meta.rerun_settings), and for a shard what `merge` checks."""
        from mla_verify import reports

        if self.command == GATE:
            seeds, extra = [self.seed], {"examples": self.examples, "ops": list(self.ops) or None,
                                         "isolated": self.isolate}
        else:
            seeds = [s for s, _ in self.campaigns]
            extra = {"op": self.op, "examples": sum(n for _, n in self.campaigns), "path": self.path,
                     "isolated": not self.in_process, "deviations": list(self.deviations),
                     "conventions": list(self.conventions)}
        if not self.shard.whole:
            extra |= {"shard": str(self.shard), "run": self.options()}
        return reports.collect_meta(self.profile.name, seeds, self.device, command=self.invocation, extra=extra)

    def part(self, slot: Shard, index: int, root: Path) -> "Run":
        """The Run of one part: its slot, in ROOT/part-INDEX. A fuzz part is the whole campaign of
        its slot's seed and examples."""
        here = dict(device=self.device_type, parts=1, out=root / f"part-{index}", baseline=None)
        if self.command == FUZZ:
            seed, examples = slot.campaign(self.seed, self.examples)
            return replace(self, seed=seed, examples=examples, shard=Shard(), **here,
                           corpus_replay=self.corpus_replay and index == 0)
        return replace(self, shard=slot, **here)

    def to_json(self) -> str:
        """A part's Run for its process (the subject is resolved again there from `specs`)."""
        plain = {f.name: getattr(self, f.name) for f in fields(self)
                 if f.name not in ("subject", "profile", "shard", "out", "baseline")}
        return json.dumps({**plain, "profile": self.profile.name, "shard": str(self.shard), "out": str(self.out)})

    @classmethod
    def from_json(cls, text: str) -> "Run":
        from mla_verify.equivalence.catalog import resolve_subject
        from mla_verify.equivalence.profiles import get_profile

        d = json.loads(text)
        d |= {"profile": get_profile(d["profile"]), "shard": Shard.parse(d["shard"]), "out": RunDir.open(d["out"]),
              **{k: tuple(d[k]) for k in ("ops", "specs", "deviations", "conventions", "impls")}}
        run = cls(**d)
        if run.command == FUZZ:
            run = replace(run, subject=resolve_subject(run.op, run.specs, run.device_type, deviations=run.deviations,
                                                       conventions=run.conventions))
        return run

    def header(self) -> str:
        """The line a run starts with."""
        where = f", run {self.out.path}" if self.out else ""
        if self.command == GATE:
            budget = (f"{self.examples}" if self.examples is not None
                      else f"{self.profile.examples} (properties: {self.profile.property_examples})")
            return (f"mla-verify gate: device {self.device}, profile {self.profile.name}, {budget} fuzz examples per "
                    f"op and implementation, seed {self.seed}{'' if self.shard.whole else f', shard {self.shard}'}"
                    f"{', only ' + ' '.join(self.impls) if self.impls else ''}"
                    f"{f', corpus {self.corpus}' if self.corpus else ''}"
                    f"{where}")
        ranks = ""
        if self.world_size:
            from mla_verify.equivalence import distributed

            ranks = f", {self.world_size} ranks ({distributed.placement(self.world_size, self.device_type).describe()})"
        return (f"mla-verify fuzz: op {self.op}, implementation {self.label}, {self.examples} examples, profile "
                f"{self.profile.name}, device {self.device}, seed {self.seed}{ranks}{', isolated' if self.isolate else ''}"
                f"{where}" + (f"; the cases of baseline {self.baseline}" if self.baseline is not None else "")
                + ("" if self.shard.whole else f"; shard {self.shard} of {self.shard.count * self.parts} campaigns: "
                   + ", ".join(f"seed {s} x {n}" for s, n in self.campaigns)))


def invocation() -> str | None:
    """This process's command line as meta.json records it (None inside a bare interpreter)."""
    return shlex.join(["mla-verify"] + sys.argv[1:]) if sys.argv[1:] else None


def drive(run: Run, log: Callable[[str], None] | None = None):
    """Run `run`: a CheckResult for fuzz, a GateOutcome for the gate. `log` receives the lines of
    a run in parts (the parts' own go to their logs or this process's output)."""
    if run.parts > 1:
        from .parallel import check_in_parts, gate_in_parts

        return (check_in_parts if run.command == FUZZ else gate_in_parts)(run, log)
    return _fuzz(run) if run.command == FUZZ else _gate(run)


def _stop(interrupt: Interrupt, lost: list[str]) -> Callable[[], str]:
    return lambda: "interrupted" if interrupt.requested else lost[0] if lost else ""


def _fuzz(run: Run) -> CheckResult:
    """One campaign in this process (its cases isolated or not), written to the run directory."""
    from mla_verify.equivalence import contract, distributed
    from mla_verify.equivalence.subject import unexercised
    from mla_verify.fuzz.gate import Unit, run_units
    from mla_verify.reports import rows_frame

    from .pytest_plugin import DEFAULTS

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
    kept = Corpus(run.corpus) if run.corpus else None
    unit = Unit(run.op, run.label, run.specs, subject=run.subject, paths=(run.path,), corpus=False,
                deviations=run.deviations, conventions=run.conventions,
                kept=kept.applying(run.op, run.specs) if kept and run.corpus_replay else ())
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
    failures = [] if kept is None else [
        Failure.of(case, case_rows, path, replay_command(path, run.specs, run.device, run.deviations, run.timeout,
                                                         run.isolate, run.conventions), seed=seed, from_corpus=True)
        for case, case_rows, path in still_failing(kept, unit, rows)]
    if fz.failure is not None:
        failures.append(Failure.of(fz.failure.case, fz.failure.rows, fz.case_file,
                                   replay_command(fz.case_file, run.specs, run.device, run.deviations, run.timeout,
                                                  run.isolate, run.conventions),
                                   found_at=fz.first_failure_at, seed=seed, flaky=fz.flaky, minimized=fz.shrunk))
    extra = keep(kept, result.fuzz, rows) + sorted(result.notes)
    extra += [fz.stopped] * (fz.stopped not in ("", "interrupted"))
    extra += unexercised(run.specs, contract.CALLED_WITH)  # what the replaced stages were never handed
    if run.world_size:
        extra += [f"worst per rank over {fz.examples} cases: {line}" for line in distributed.worst_by_rank(fz.rows)]
    return CheckResult(run.op, run.label, not failures and fz.stopped != "interrupted" and bool(frame.passed.all()),
                       frame, seed, fz.examples, run_dir.path if run_dir else None, failures,
                       interrupted=fz.stopped == "interrupted", notes=extra, in_process=run.in_process)


def _gate(run: Run) -> GateOutcome:
    """The gate's units of this slot in this process, written to the run directory."""
    from mla_verify.equivalence import distributed
    from mla_verify.equivalence.mismatch import line
    from mla_verify.fuzz.casefile import load
    from mla_verify.fuzz.gate import odd_ones_out, run_gate, units

    from .selection import impl_units

    run_dir, meta, interrupt = run.out, run.meta(), Interrupt()
    kept = Corpus(run.corpus) if run.corpus else None
    chosen = with_kept(impl_units(run.impls, run.device, run.ops) if run.impls
                       else units(list(run.ops) or None, run.device), kept)
    run_id = f"gate-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.start(meta)
    try:
        with interrupt.installed():
            result = run_gate(ops=list(run.ops) or None, shard=run.shard, device=run.device, chosen=chosen,
                              profile=run.profile,
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
    outcome = GateOutcome(result.rows, result.failed, run_dir.path, interrupt.requested,
                          keep(kept, result.fuzz, result.rows) + sorted(result.notes), odd_ones_out(result.rows),
                          isolated=run.isolate)
    run_dir.finish(result.rows, {**meta, "stopped": "interrupted"} if interrupt.requested else meta)
    def said(path: Path, rows) -> list[str]:  # the replay command (with the implementation saved), the failing rows
        command = replay_command(path, load(path).impl, run.device, timeout=run.timeout, isolate=run.isolate)
        return [f"  replay: {command}", *(f"  {line(r.tensor, r.gate_metric, r.value, r.bound, r.reason)}"
                                          for r in rows if not r.passed)]

    outcome.case_files = [(path, ["  from the corpus: still fails", *said(path, rows)])
                          for _, rows, path in still_failing(kept, chosen, result.rows)]
    outcome.case_files += [(fz.case_file, said(fz.case_file, fz.failure.rows if fz.failure else ()))
                           for fz in result.fuzz if fz.case_file]
    return outcome


def main(argv: list[str] | None = None) -> int:
    """A part's process: `python -m mla_verify.run RUN_JSON` (`Run.to_json`; mla_verify.parallel starts it)."""
    from mla_verify.fuzz.casefile import write_atomic

    from .results import result_file

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
    elif outcome.lines():
        print("\n".join(outcome.lines()))
    return outcome.exit_code


if __name__ == "__main__":
    sys.exit(main())
