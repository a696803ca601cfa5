"""The gate: every op and forward_mqa path, every implementation that runs on the device, the
regression corpus plus a fuzz budget; then every property (equivalence.properties) for every
implementation of the stages it tests; rows into one run directory; a verdict a CI can use.

Implementations checked per op: every registered one that runs here (on a GPU: flash_mla, our
Triton kernels and the float32 eager ones; on CPU the Triton kernels under the interpreter and
the eager ones), so when one disagrees with the reference and the others do not, the gate names
the odd one out. A property runs once per implementation name (`--impl NAME`: that
implementation for every stage that has one), over the targets it covers.

The multi-process DCP op runs with world size 2 on CPU (two gloo ranks) and on a GPU machine with
the most ranks its GPUs hold one each (2, 4 or 8; a single GPU: 2 gloo ranks sharing it). Its
ranks are processes of their own, so it never runs inside the isolation worker.

`run_units` is the one campaign driver, of the gate and of `mla-verify fuzz` alike: a `Unit` is one
op and implementation with its corpus and campaigns (a fuzz run: one unit, no corpus), and a shard
of the gate is its share of the units (`fuzz.shard`, `run_gate`).
"""

from __future__ import annotations

import math
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from mla_verify.equivalence import catalog, distributed
from mla_verify.equivalence.case import Case
from mla_verify.equivalence.isolation import Worker
from mla_verify.equivalence.profiles import Profile
from mla_verify.equivalence.rows import Row
from mla_verify.equivalence.spec import Spec
from mla_verify.equivalence.subject import Subject

from .campaign import FuzzResult, fuzz
from .progress import Progress
from .regressions import corpus
from .shard import Shard

MIN_DRAWS = 25  # params a campaign draws at the least where its budget allows (`block_size`)


@dataclass
class GateResult:
    rows: list[Row] = field(default_factory=list)
    fuzz: list[FuzzResult] = field(default_factory=list)
    notes: set[str] = field(default_factory=set)

    @property
    def failed(self) -> bool:
        return any(not r.passed for r in self.rows)


def gate_world_size(spec: Spec, device: str) -> int | None:
    """The ranks a multi-process spec runs in the gate: the most its GPUs hold one each, else
    its default (None: a spec of one process)."""
    if not spec.ranks:
        return None
    gpus = 0
    if device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
    return max([n for n in spec.ranks if n <= gpus], default=spec.ranks[0])


def odd_ones_out(rows: list[Row]) -> list[str]:
    """Cases where some implementations fail and others pass: name the ones that disagree."""
    by_case: dict[tuple[str, str], dict[str, bool]] = defaultdict(dict)
    for r in rows:
        verdict = by_case[(r.op, r.case_id)]
        verdict[r.impl] = verdict.get(r.impl, True) and r.passed
    lines = []
    for (op, case_id), verdict in sorted(by_case.items()):
        bad = sorted(i for i, ok in verdict.items() if not ok)
        if bad and len(bad) < len(verdict):
            lines.append(f"{op} case {case_id}: {', '.join(bad)} disagree(s) with the reference; "
                         f"{', '.join(sorted(i for i, ok in verdict.items() if ok))} agree")
    return lines


@dataclass(frozen=True)
class Unit:
    """What a run judges in one go, and what the gate deals to its shards: one op (or property)
    and implementation, its pinned corpus, and its fuzz campaigns (paths; None: the op's own
    draw). A fuzz run is one unit of the implementation it was given, without the corpus."""

    op: str
    label: str
    specs: tuple[str, ...]
    subject: Subject | None = field(default=None, compare=False, repr=False)  # None: resolved from specs
    paths: tuple[str | None, ...] | None = None  # None: every campaign the spec runs for the subject
    corpus: bool = True
    deviations: tuple[str, ...] = ()
    conventions: tuple[str, ...] = ()
    kept: tuple[Case, ...] = ()  # a kept corpus's cases of this op and implementation (mla_verify.corpus), run first

    @property
    def multi_rank(self) -> bool:
        return bool(catalog.get_spec(self.op).ranks)

    def resolved(self, device: str) -> Subject:
        """The implementation under test, labelled as the rows name it."""
        if self.subject is not None:
            return self.subject
        subject = catalog.resolve_subject(self.op, self.specs, device.split(":")[0])
        return Subject(self.label, subject.fn, subject.overrides, subject.deviations, self.specs)

    def campaigns(self, subject: Subject) -> tuple[str | None, ...]:
        return tuple(catalog.get_spec(self.op).campaigns(subject)) if self.paths is None else self.paths


def units(ops: list[str] | None, device: str) -> list[Unit]:
    """The gate's units for `ops` (None: every op and property) on `device`, in catalog order."""
    device_type = device.split(":")[0]
    return [Unit(op, label, tuple(specs)) for op in catalog.select(ops or ["op", "property"])
            for label, specs in catalog.get_spec(op).subjects(device_type).items()]


def shard_units(ops: list[str] | None, device: str, shard: Shard, chosen: list[Unit] | None = None) -> list[Unit]:
    """The units of shard `shard` (`fuzz.shard`: the multi-rank ones dealt first) among `chosen`
    (None: the gate's `units`)."""
    every = units(ops, device) if chosen is None else chosen
    return shard.deal(every, [u.multi_rank for u in every])


def _examples(op: str, examples: int | None, profile: Profile) -> int:
    return examples if examples is not None else catalog.get_spec(op).examples(profile)


def _block_runner(unit: Unit, subject: Subject, device: str, run_id: str, worker: Worker | None, notes: set[str],
                  lost: list[str] | None):
    """(cases, source, on_call) -> each case's rows (None: not judged), for a campaign's blocks
    (`fuzz.campaign`): in the isolation worker, or in this process. With `lost` (a fuzz run), a
    CUDA context that saw a CUDA error of the implementation cannot run another case: its block
    ends there (`OpSpec.evaluate_block`) and so does the campaign, the case being the
    implementation's crash."""
    from mla_verify.equivalence import device as dev
    from mla_verify.equivalence.running import failure_row

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
    """The one campaign driver: each unit's kept cases and corpus, then its campaigns of `examples` cases (None:
    the profile's budget for the op) with `seed`. `world_size`: a multi-rank op's ranks (default:
    `gate_world_size`). `started(case, source, impl=, specs=)` is told of each case before it runs
    and returns the call that says it finished (`mla_verify.rundir` journals both); `journal`
    receives each case's rows as it finishes; a `stop_reason` (Ctrl-C, a lost CUDA context: `lost`,
    see `_block_runner`) ends the run after the current case. `progress`: the gate's progress line
    over every unit and a line per campaign on `log` (default the stderr of the moment: pytest's
    capture replaces it between tests); without it each campaign shows its own."""
    log = log or sys.stderr
    result = GateResult()
    kind = device.split(":")[0]
    subjects = [(unit, unit.resolved(device)) for unit in chosen]
    cases = sum(len(u.kept) + (len(corpus(u.op)) if u.corpus else 0)
                + _examples(u.op, examples, profile) * len(u.campaigns(s))
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
                if progress and source in ("kept", "corpus", "fuzz"):
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
            for case, source in [(c, "kept") for c in unit.kept] + [(c, "corpus") for c, _why in pinned]:
                if stop_reason():
                    return result
                finished = watch(case, source) if watch is not None else None
                case_rows = run(case, source)
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
                    kept = f"{len(unit.kept)} kept + " if unit.kept else ""
                    log.write(f"{where:38s} {label:28s} {kept}{len(pinned):3d} corpus + {fz.examples:4d} fuzz cases "
                              f"{time.monotonic() - t0:6.1f} s  {'FAIL' if bad else 'ok'}{f' ({bad} rows)' if bad else ''}\n")
                    log.flush()
                t0 = time.monotonic()
    finally:
        if worker is not None:
            worker.close()
    return result


def run_gate(*, ops: list[str] | None, shard: Shard, device: str, chosen: list[Unit] | None = None,
             **settings) -> GateResult:
    """The gate's units of `shard` (`Shard()`: all of them; `chosen`: among those) through
    `run_units`, with its `settings` (profile, examples, seed, run_id, out_dir, isolate, timeout_s, ...)."""
    return run_units(shard_units(ops, device, shard, chosen), device=device, **settings)
