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
"""

from __future__ import annotations

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


def _subjects(ops: list[str] | None, kind: str):
    """(op, --impl strings, subject) of every implementation the gate runs of `ops` on device `kind`."""
    for op in catalog.select(ops or ["op", "property"]):
        for label, specs in catalog.get_spec(op).subjects(kind).items():
            subject = catalog.resolve_subject(op, specs, kind)
            yield op, specs, Subject(label, subject.fn, subject.overrides, subject.deviations, specs)


def _examples(op: str, examples: int | None, profile: Profile) -> int:
    return examples if examples is not None else catalog.get_spec(op).examples(profile)


def run_gate(
    *,
    device: str,
    profile: Profile,
    examples: int | None,
    seed: int,
    run_id: str,
    out_dir: Path,
    isolate: bool,
    timeout_s: float,
    ops: list[str] | None = None,
    log=None,
    journal: Callable[[list[Row]], None] | None = None,
    stop_reason: Callable[[], str] = lambda: "",
    started: Callable[..., Callable[[], None]] | None = None,
) -> GateResult:
    """`examples` per op (or property) and implementation; None: the profile's budgets. In `ops`,
    "property" stands for every property. `started(case, source, impl=, specs=)` is told of each
    case before it runs and returns the call that says it finished (`mla_verify.rundir`
    journals both); `journal` receives each case's rows as it finishes;
    a `stop_reason` (Ctrl-C) ends the gate after the current case. `log`: default the stderr of
    the moment (pytest's capture replaces it between tests)."""
    log = log or sys.stderr
    result = GateResult()
    kind = device.split(":")[0]
    cases = sum(len(corpus(op)) + _examples(op, examples, profile) * len(catalog.get_spec(op).campaigns(subject))
                for op, _, subject in _subjects(ops, kind))
    progress = Progress("gate", cases, every_s=10.0, stream=log)  # one line for the whole gate
    worker = Worker(device, timeout_s) if isolate else None
    distributed.set_timeout(timeout_s)
    try:
        for op, specs, subject in _subjects(ops, kind):
            spec, label = catalog.get_spec(op), subject.label
            budget = _examples(op, examples, profile)
            pinned = corpus(op)
            in_worker = None if spec.own_processes else worker
            world_size = gate_world_size(spec, kind)

            def run(case: Case, source: str, subject=subject, specs=specs, label=label, worker=in_worker) -> list[Row]:
                if worker is not None:
                    rows = worker.run(case, specs, label, run_id, source, notes=result.notes)
                    for r in rows:
                        r.impl = label
                else:
                    rows = catalog.evaluate(case, subject, device, run_id=run_id, source=source, notes=result.notes)
                if source in ("corpus", "fuzz"):
                    progress.step(any(not r.passed for r in rows), now_at=f"{op} / {label}")
                return rows

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
            for path in spec.campaigns(subject):
                if stop_reason():
                    return result
                fz = fuzz(op, run, profile=profile, examples=budget, seed=seed, impl_specs=specs, impl_label=label,
                          device=device, out_dir=out_dir, show_progress=False, path=path,
                          world_size=world_size, journal=journal, stop_reason=stop_reason, started=watch)
                result.fuzz.append(fz)
                result.rows.extend(fz.rows)
                where = f"{op} ({path})" if path else op
                bad = sum(not r.passed for r in [*pinned_rows, *fz.rows])
                log.write(f"{where:38s} {label:28s} {len(pinned):3d} corpus + {fz.examples:4d} fuzz cases "
                          f"{time.monotonic() - t0:6.1f} s  {'FAIL' if bad else 'ok'}{f' ({bad} rows)' if bad else ''}\n")
                log.flush()
                t0 = time.monotonic()
    finally:
        if worker is not None:
            worker.close()
        distributed.close_all()
    return result
