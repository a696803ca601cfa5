"""A run started: what `runs.driver.drive` is handed, every part of it built and checked here.

`start` turns a planned run (`runs.plan`: settings) into ready objects, in the order a run needs
them: the kept corpus opened and its cases dealt to the units, the units of this slot chosen,
their worker started with each user's implementation imported in it (a usage error before the run
directory starts), the header line said, the run directory started, and for each unit its
implementation resolved, its kept and pinned cases, the judge its blocks go to (`runs.judges`)
and its campaigns (`fuzz.campaign.Campaign`). The driver composes them: it names no setting.
"""

from __future__ import annotations

import sys
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from mla_verify.equivalence import catalog
from mla_verify.equivalence.blocks import Judging
from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.cases.profiles import Profile
from mla_verify.equivalence.errors import HarnessError
from mla_verify.equivalence.judge.rows import RowContext
from mla_verify.equivalence.ops import dcp_ranks
from mla_verify.equivalence.sandbox import call_guards
from mla_verify.fuzz.campaign import Campaign, Judge
from mla_verify.fuzz.findings import Findings, UnderTest
from mla_verify.fuzz.regressions import corpus
from mla_verify.pytest_plugin import DEFAULTS
from mla_verify.runs.progress import Progress

from .corpus import Corpus, Replay, not_replayed
from .judges import unit_judge
from .plan import FuzzRun, GateRun, Run
from .sink import Sink
from .units import Unit

MIN_DRAWS = 25  # params a campaign draws at the least where its budget allows (`block_size`)


@dataclass(frozen=True)
class Ready:
    """One unit as the driver runs it: what its findings are saved as, its kept then pinned cases
    (case, source, why), the judge of its blocks and its campaigns."""

    unit: Unit
    tested: UnderTest
    findings: Findings
    replays: tuple[tuple[Case, Replay, str], ...]
    judge: Judge
    campaigns: tuple[Campaign, ...]

    @property
    def pinned(self) -> int:
        return sum(source == Replay.PINNED for _, source, _ in self.replays)


@dataclass
class Started:
    """A run started in this process: its settings (`run`), the units of its slot made ready,
    every unit it chose (the gate's, over all slots), the kept corpus, how it judges (its worker
    started), what meta.json records, the sink that hears of its cases, the notes its judging
    adds, and a fuzz run's note of kept cases it does not replay."""

    run: FuzzRun | GateRun
    chosen: list[Unit]
    kept: Corpus | None
    judging: Judging
    meta: dict
    sink: Sink
    units: list[Ready] = field(default_factory=list)
    notes: set[str] = field(default_factory=set)
    left: list[str] = field(default_factory=list)

    @property
    def writes_lines(self) -> bool:
        """A line per campaign on stderr (the gate's), beside the progress line."""
        return isinstance(self.run, GateRun)

    @contextmanager
    def guarded(self) -> Iterator[None]:
        """mla-verify's own failure while the run directory is open: exit 3 (`HarnessError`), its
        traceback in the directory's harness-error.txt, where the message says; the journal keeps
        the rows so far (a fuzz run's directory is finished with them), and an interrupted gate
        lets the next run take the directory's lock."""
        out, gate = self.run.out, isinstance(self.run, GateRun)
        try:
            yield
        except Exception as exc:
            detail = (exc.detail if isinstance(exc, HarnessError) else None) or traceback.format_exc()
            if out:
                out.write_file("harness-error.txt", detail)
                if gate:
                    out.release()
                else:
                    out.finish(self.sink.rows, self.meta)
            if isinstance(exc, HarnessError):
                raise
            where = f" in {out.path}" if gate else ""
            raise HarnessError(f"harness error{where}: {type(exc).__name__}: {exc}", detail) from exc
        except BaseException:
            if gate:
                out.release()
            raise

    def close(self) -> None:
        """Its worker stopped (and the gate's rank processes)."""
        if isinstance(self.run, GateRun):
            dcp_ranks.close_all()
        self.judging.close()


def start(run: FuzzRun | GateRun, log: Callable[[str], None]) -> Started:
    """`run`, one part, started in this process (`runs.driver.execute` gives a run of several
    parts to their processes): see the module's doc. `log` hears the header line."""
    kept = Corpus(run.corpus) if run.corpus else None
    chosen = run.units(kept)
    mine = run.shard_of(chosen)
    left = _kept_left(run, kept, chosen)
    judged, judged_by = judging(run, mine)
    try:
        log(run.header())
        meta = with_extra(run.meta(), judged_by)
        if run.out:
            run.out.start(meta)
        call_guards.CALLED_WITH.clear()
        sink = Sink(run.out, f"{run.command}-{time.strftime('%Y%m%d-%H%M%S')}", run.device)
        started = Started(run, chosen, kept, judged, meta, sink, left=left)
        with started.guarded():
            started.units = _ready(run, mine, started)
            dcp_ranks.set_timeout(run.timeout)
    except BaseException:
        judged.close()
        raise
    return started


def _kept_left(run: Run, kept: Corpus | None, chosen: list[Unit]) -> list[str]:
    """A fuzz run's note of the kept cases its unit does not replay (the gate's is said at its end)."""
    return not_replayed(kept, chosen, run.ops, "run") if isinstance(run, FuzzRun) and run.corpus_replay else []


def _ready(run: FuzzRun | GateRun, mine: list[Unit], started: Started) -> list[Ready]:
    """Each unit of `mine` made ready (`Ready`), the progress line counting all their cases."""
    seed, examples = _draws(run)
    readies = []
    for unit in mine:
        spec = catalog.get_spec(unit.op)
        # Isolated, a user's module is imported by the worker only (dcp's ranks are processes of their own).
        subject = unit.resolved(run.device, described=run.isolate and not spec.own_processes)
        budget = examples if examples is not None else spec.examples(run.profile)
        context = RowContext(started.sink.run_id, label=unit.label, device=run.device, notes=started.notes)
        tested = UnderTest(unit.specs, unit.label, unit.deviations, unit.conventions, run.device)
        findings = Findings(_failures_dir(run), started.sink)
        replays = ([(k.case, Replay.KEPT, k.path.name) for k in unit.kept]
                   + [(c, Replay.PINNED, why) for c, why in _pinned(unit)])
        campaigns = [Campaign(unit.op, run.profile, budget, seed, tested, path, run.ranks(spec),
                              block_size(run.profile, budget), run.shrink, findings, covering=run.covering)
                     for path in unit.campaigns(subject)]
        judge = unit_judge(subject, started.judging, context, started.sink if run.stops_when_lost else None)
        readies.append(Ready(unit, tested, findings, tuple(replays), judge, tuple(campaigns)))
    if isinstance(run, FuzzRun):
        started.sink.counting(Progress(run.op, examples, every_s=5.0))
    else:
        cases = sum(len(r.replays) + sum(c.examples for c in r.campaigns) for r in readies)
        started.sink.counting(Progress("gate", cases, every_s=10.0, stream=sys.stderr), name_units=True)
    return readies


def _draws(run: FuzzRun | GateRun) -> tuple[int, int | None]:
    """The seed and examples of each campaign (the gate's examples: None for the profile's budget)."""
    if isinstance(run, FuzzRun):
        (seed, examples), = run.campaigns
        return seed, examples
    return run.seed, run.examples


def _pinned(unit: Unit) -> list[tuple[Case, str]]:
    """(case, why) of the unit's pinned regression cases, less those its kept corpus replays already."""
    kept = [k.case for k in unit.kept]
    return [(case, why) for case, why in (corpus(unit.op) if unit.corpus else []) if case not in kept]


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


def with_extra(meta: dict, extra: dict) -> dict:
    """`meta` with `extra` added to its "extra" record."""
    return {**meta, "extra": {**(meta.get("extra") or {}), **extra}} if extra else meta
