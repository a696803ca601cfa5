"""A fuzz campaign: Hypothesis draws cases for one op, the judge judges each, and the first
discrepancy is shrunk to the smallest case that still fails and saved as a replayable file.

`fuzz(campaign, judge, sink)` searches what a frozen `Campaign` describes (op, profile, budget,
seed, what is tested, path, world size, block, shrink), as Hypothesis searches under one
`settings` object; the `judge` turns cases into rows; the `sink` hears of every case (a run
directory journals it, a progress line counts it) and says when to stop.

Nothing found is lost. The first failing case is saved the moment it is seen, then re-run: if a
re-run passes, the failure is reported as flaky (failed k of n re-runs) and the campaign ends
there, never in a Hypothesis traceback. A hung case is not re-run or shrunk (each try costs the
whole timeout). The sink is told of every case before its implementation is called (a run
directory journals it, so a case whose process dies in the call is still a finding:
`mla_verify.runs.rundir`) and when the call returned; it receives every searched case's rows as
it finishes, and its `stop_reason` is asked after every case (Ctrl-C, a lost CUDA context) and
ends the campaign with what it has. Findings are saved, replaced and dropped through the store
the campaign is handed (`Campaign.findings`, `fuzz.findings`), never by path.

A Hypothesis example may stand for a block of cases (`Campaign.block`): the drawn case and the
cases of the same params at the next seeds, judged together (the reference answers them in one
pass and the oracle judges them at once: `OpSpec.evaluate_block`), for the cost of one draw. Each
is an ordinary case: counted, journaled and saved on its own, replayed alone. Shrinking keeps the
failing case's place in its block and shrinks that one case, as a campaign without blocks does.
"""

from __future__ import annotations

import contextlib
import gc
import random
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Callable, Protocol

from hypothesis import HealthCheck, Phase, example, given, seed as hypothesis_seed, settings
from hypothesis.errors import Flaky
from hypothesis.strategies import SearchStrategy, one_of

from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.catalog import get_spec
from mla_verify.equivalence.coverage.sets import covering_set
from mla_verify.equivalence.cases.profiles import Profile
from mla_verify.equivalence.sandbox.device import device_type
from mla_verify.equivalence.judge.rows import FailureKind, Row
from mla_verify.optimized import registry

from .findings import Findings, UnderTest

# (cases of one params, source, on_call) -> each case's rows, None for a case not judged (a lost
# CUDA context ended its block); on_call() runs before each case's implementation is called, in order
Judge = Callable[[list[Case], str, Callable[[], None]], list["list[Row] | None"]]
Runner = Callable[[Case, str], list[Row]]  # (case, source) -> its rows
RERUNS = 3  # re-runs of the first failing case: a pass among them makes it flaky


class Sink(Protocol):
    """Who hears of a campaign's cases (`mla_verify.runs.sink.Sink`; `QUIET` hears nothing)."""

    def started(self, case: Case, source: str) -> None:
        """`case` is about to be handed to the implementation."""

    def finished(self, case: Case) -> None:
        """The implementation's call of `case` returned."""

    def judged(self, rows: list[Row], source: str) -> None:
        """A case's rows, as the campaign keeps them (searched cases, and the minimized one)."""

    def stop_reason(self) -> Stop | None:
        """Why the campaign must end after this case (None to go on)."""


class _Quiet:
    def started(self, case: Case, source: str) -> None:
        pass

    def finished(self, case: Case) -> None:
        pass

    def judged(self, rows: list[Row], source: str) -> None:
        pass

    def stop_reason(self) -> Stop | None:
        return None


QUIET: Sink = _Quiet()


@dataclass(frozen=True)
class Campaign:
    """What one campaign searches: up to `examples` cases of `op` within `profile`, from `seed`.
    `findings`: the store failing cases are saved in (None: not saved); `block` > 1: each example
    is a block of up to `block` cases (module doc); `examples` still counts cases. `covering`:
    False draws without the op's covering set (`first_cases`): `examples` drawn cases and no
    others, for benchmarks and tests of the harness's own mechanics (blocks, shards, options);
    a run that skips it says so in its PASS line and meta.json (`runs.plan.Run.covering`)."""

    op: str
    profile: Profile
    examples: int
    seed: int
    under_test: UnderTest = UnderTest()
    path: str | None = None
    world_size: int | None = None
    block: int = 1
    shrink: bool = True
    findings: Findings | None = None
    reruns: int = RERUNS
    covering: bool = True

    def found_by(self) -> str:
        """The command that draws this campaign's cases again."""
        return (f"mla-verify fuzz --op {self.op}" + (f" --path {self.path}" if self.path else "")
                + (f" --world-size {self.world_size}" if self.world_size else "") + f" --seed {self.seed}"
                + "".join(f" --deviation {name}" for name in self.under_test.deviations)
                + "".join(f" --convention {c}" for c in self.under_test.conventions)
                + ("" if self.covering else " --no-covering-set"))


class Discrepancy(Exception):
    def __init__(self, case: Case, rows: list[Row]):
        super().__init__(f"{case.short()}: " + "; ".join(r.reason for r in rows if not r.passed))
        self.case, self.rows = case, rows


class Stop(StrEnum):
    """Why a campaign ended before its budget (Hypothesis's `ExitReason`); its value is what the
    run's meta.json ("stopped") and notes say."""

    INTERRUPTED = "interrupted"
    HARNESS_ERROR = "harness error"  # the harness's own exception, raised again after the campaign
    DEVICE_LOST = ("the CUDA context is unusable after a CUDA error of the implementation; run isolated "
                   "(--isolate) to go on past crashes")


class StopCampaign(BaseException):
    """Ends the search at once (args: the `Stop`, or None where the campaign ends with its finding).
    A BaseException: Hypothesis would shrink and replay an Exception."""


@dataclass
class FuzzResult:
    op: str
    seed: int
    examples: int                 # cases evaluated while searching (re-runs and shrink steps not counted)
    rows: list[Row] = field(default_factory=list)
    failure: Discrepancy | None = None    # the finding: the minimized failing case (as found, if not shrunk)
    first_failure_at: int | None = None   # 1-based example number of the first failing case
    case_file: Path | None = None         # the finding's one case file (the minimized case where there is one)
    found_file: Path | None = None        # the first failing case as found, saved at once (until minimized)
    flaky: tuple[int, int] | None = None  # (failed k, of n re-runs) when a re-run passed
    stopped: Stop | None = None           # why the campaign ended before its budget
    shrunk: bool = False                  # the failure is Hypothesis's minimized case
    unminimized: str = ""                 # why a finding was not minimized, and how to have it minimized


def _traced(rows: list[Row], again: list[Row]) -> None:
    """The failing rows of a case told what its traced re-run's same failures were told (the
    first stage that differs, and its name: `Row.differing_stage`), each by its tensor, metric and
    value."""
    told = {(r.tensor, r.gate_metric, r.value): r for r in again if not r.passed}
    for r in rows:
        if not r.passed and (same := told.get((r.tensor, r.gate_metric, r.value))) is not None:
            r.reason, r.differing_stage = same.reason, same.differing_stage


def new_seed() -> int:
    return random.SystemRandom().randrange(2**31)


def _failing(rows: list[Row]) -> bool:
    return any(not r.passed for r in rows)


@contextlib.contextmanager
def _frozen_heap():
    """Objects alive when a campaign starts (modules, torch, row pools) stay out of garbage
    collection while it runs: Hypothesis's own gc.collect() before its first test, and any full
    collection, would walk them all (0.3 s at 190k objects in a CPU process, more with CUDA)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()  # collectable again: nothing is kept for good


def drawn_paths(op: str, path: str | None, impl_specs: tuple[str, ...]) -> tuple[str | None, ...]:
    """What a campaign draws: `path`; where it names none and replaces stages of a pipeline
    (`STAGE=...`), the draws that call them (`PipelineSpec.draws_for`: a HiSparse stage is called
    on the HiSparse paths only, which the unrestricted draw never takes)."""
    spec = get_spec(op)
    replaced = [s.split("=", 1)[0] for s in impl_specs if "=" in s]
    if path is not None or not replaced or not hasattr(spec, "draws_for"):
        return (path,)
    return spec.draws_for(replaced)


def strategy(op: str, profile: Profile, path: str | None, world_size: int | None, impl_specs: tuple[str, ...],
             device: str) -> SearchStrategy[Case]:
    """The cases of a campaign: the op's draws within `profile` (on each of `drawn_paths`), and for
    interpreted kernels (Triton on CPU) only those the interpreter runs within the profile's
    budget a case."""
    spec = get_spec(op)
    interpreted = registry.interpreted(impl_specs, device_type(device)) and profile.interpreter_s is not None
    within = profile.interpreted() if interpreted else profile
    drawn = one_of(*(spec.strategy(within, p, world_size) for p in drawn_paths(op, path, impl_specs)))
    if not interpreted:
        return drawn
    return drawn.filter(lambda case: spec.interpreted_s(spec.params_of(case.params)) <= within.budget_s)


def first_cases(op: str, profile: Profile, path: str | None, world_size: int | None, impl_specs: tuple[str, ...],
                device: str, seed: int) -> list[Case]:
    """The covering set a campaign starts with (`equivalence.coverage.sets`; of each of
    `drawn_paths`), held to the interpreter's budget as `strategy` holds the draws, and its
    routing pairs to the op's `Pairs.cap` a case."""
    spec = get_spec(op)
    found: list[Case] = []
    for p in drawn_paths(op, path, impl_specs):
        if not registry.interpreted(impl_specs, device_type(device)) or profile.interpreter_s is None:
            found += covering_set(op, profile, seed, p, device=device, world_size=world_size)
        else:
            found += covering_set(op, profile, seed, p, device=device, world_size=world_size,
                                  admit=lambda case: spec.interpreted_s(spec.params_of(case.params)) <= profile.interpreter_s,
                                  interpreted=True)
    return found


def each(run: Runner) -> Judge:
    """A judge of one case at a time."""
    def judge(cases: list[Case], source: str, on_call: Callable[[], None]) -> list[list[Row] | None]:
        found = []
        for case in cases:
            on_call()
            found.append(run(case, source))
        return found

    return judge


def fuzz(campaign: Campaign, judge: Judge, sink: Sink = QUIET) -> FuzzResult:
    """Search `campaign`: stop at the first failing case, re-run it, shrink it, save it.

    Failing cases are saved under `campaign.failures` (named by op, implementation and case),
    with what `campaign.under_test` declares, for replay. Exceptions of `judge` (a harness error) end
    the campaign and are raised after it; the rows so far have reached the sink by then. The cases
    are drawn within the profile's interpreter budget when the tested specs name kernels
    interpreted on the device (`strategy`)."""
    return _Search(campaign, judge, sink).run()


class _Search:
    """One campaign's search: Hypothesis's test function and what it keeps between examples."""

    def __init__(self, campaign: Campaign, judge: Judge, sink: Sink):
        self.campaign, self.judge, self.sink = campaign, judge, sink
        self.result = FuzzResult(campaign.op, campaign.seed, 0)
        self.shrinking = False
        self.last: tuple[Case, list[Row]] | None = None
        self.error: Exception | None = None
        self.offset = 0   # the failing case's place in its block
        self.found: Case | None = None  # the first failing case, as found (saved at once: result.found_file)
        self.first: tuple[Case, list[Row]] | None = None  # and its rows
        self.drawn = 0    # drawn cases judged (the covering set's not counted)
        self.origin: tuple[Case, list[Row], int] | None = None  # the drawn failure shrunk: its rows, example number
        # The covering set runs first, as Hypothesis's explicit examples. Hypothesis shrinks only its
        # draws: a failing covering case is saved and re-run as any first failure, then the draws go
        # on to the first failure they make, which is shrunk; none: the covering case is the result.
        # The whole set runs, whatever the budget (its pairs may pass it: ci's 6); the draws fill
        # what is left of the budget after it, or the whole budget once a covering case failed.
        c = campaign
        self.cover = first_cases(c.op, c.profile, c.path, c.world_size, c.under_test.specs, c.under_test.device,
                                 c.seed) if c.covering else []
        self.covering = {case.case_id for case in self.cover}

    def note(self, note: str) -> str:
        c = self.campaign
        return f"{note}; found by `{c.found_by()}` (profile {c.profile.name})"

    def save(self, case: Case, rows: list[Row], note: str, unshrunk: Case | None = None,
             journaled: bool = True) -> Path | None:
        """The finding `case` saved in the campaign's store (None where it has none), its rows naming it."""
        if self.campaign.findings is None:
            return None
        return self.campaign.findings.save(self.campaign.under_test, case, rows, self.note(note),
                                           flaky=self.result.flaky, unshrunk=unshrunk, journaled=journaled)

    def evaluate(self, cases: list[Case], source: str) -> list[list[Row] | None]:
        """Each case's rows from the judge; the sink told as each call starts and returns."""
        waiting, calling = list(cases), []

        def on_call() -> None:
            # Told as each case's call starts; the case before it returned by then, so a process
            # that dies in a call leaves that case alone unfinished.
            if calling:
                self.sink.finished(calling.pop())
            calling.append(waiting.pop(0))
            self.sink.started(calling[-1], source)

        if len(cases) == 1:  # a case alone is told started before anything of it is built
            on_call()
        try:
            found = self.judge(cases, source, (lambda: None) if len(cases) == 1 else on_call)
        except Exception as exc:  # the harness's own failure: stop now, raise it after the campaign
            self.error = exc
            raise StopCampaign(Stop.HARNESS_ERROR) from None
        for case in calling:
            self.sink.finished(case)
        return found

    def stop_if_asked(self) -> None:
        if reason := self.sink.stop_reason():
            raise StopCampaign(reason)

    def first_failure(self, case: Case, rows: list[Row], at: int) -> None:
        result, reruns = self.result, self.campaign.reruns
        result.first_failure_at, self.found = at, case
        result.found_file = self.save(case, rows, f"found at example {at}")
        if any(r.gate_metric == FailureKind.HUNG for r in rows):
            raise StopCampaign(None)  # a hang is not re-run or shrunk: every try costs the timeout
        self.stop_if_asked()
        # The first re-run records a pipeline's stages (`ops.stages`: in the worker, a call within
        # its time cap): the finding names the first stage that differs, shrunk or not.
        runs = [self.evaluate([case], "trace" if i == 0 else "rerun")[0] for i in range(reruns)]
        if runs and _failing(runs[0]):
            _traced(rows, runs[0])
        failed = sum(map(_failing, runs))
        if failed < reruns:
            result.flaky = (failed, reruns)
            if result.found_file is not None:
                self.campaign.findings.replace(result.found_file, self.note(f"flaky: failed {failed} of {reruns} "
                                                                            "re-runs"), result.flaky)
            raise StopCampaign(None)
        self.stop_if_asked()
        if not self.campaign.shrink:
            raise StopCampaign(None)

    def example(self, case: Case) -> None:
        """Hypothesis's test: judge the drawn case (with its block), raise the first failure."""
        if self.shrinking:  # the failing case's place in its block, at the shrunk draw
            case = Case(case.op, case.params, case.seed + self.offset)
            found = [(case, self.evaluate([case], "shrink")[0])]
        else:
            # A covering case runs alone, past the budget if the set is larger; the draws fill what
            # the set left of the budget, or, once a covering case failed, draw the whole budget
            # for a failure Hypothesis can shrink.
            room = self.campaign.examples - self.drawn - (len(self.cover) if self.first is None else 0)
            count = 1 if case.case_id in self.covering else min(self.campaign.block, room)
            if count <= 0:  # the covering set and the blocks drawn spent the budget: no case past it
                return
            cases = [case] + [Case(case.op, case.params, case.seed + i) for i in range(1, count)]
            found = [(c, rows) for c, rows in zip(cases, self.evaluate(cases, "fuzz")) if rows is not None]
            self.drawn += len(found) if case.case_id not in self.covering else 0
            for _, rows in found:
                self.result.examples += 1
                self.result.rows.extend(rows)
                self.sink.judged(rows, "fuzz")
        failing = next((i for i, (_, rows) in enumerate(found) if _failing(rows)), None)
        if failing is not None:
            self.last = found[failing]
            if not self.shrinking:
                self.offset = failing
                at = self.result.examples - (len(found) - 1 - failing)  # its example number
                if self.first is None:
                    self.first = found[failing]
                    self.first_failure(*found[failing], at)
                if case.case_id in self.covering:  # not Hypothesis's to shrink: draw on for a failure it can shrink
                    return
                self.shrinking, self.origin = True, (*found[failing], at)
            else:
                self.stop_if_asked()
            raise Discrepancy(*found[failing])  # one place: Hypothesis tells failures apart by where they rose
        self.stop_if_asked()

    def run(self) -> FuzzResult:
        c, result = self.campaign, self.result
        # The draws run where the budget is left after the covering set or a covering case failed
        # (`example`): Hypothesis is asked for the budget's blocks, those past what is left skipped.
        drawn = (Phase.reuse, Phase.generate) + ((Phase.shrink,) if c.shrink else ())

        @settings(max_examples=max(1, -(-c.examples // max(c.block, 1))), deadline=None,
                  database=None, phases=(Phase.explicit, *drawn), print_blob=False, report_multiple_bugs=False,
                  suppress_health_check=list(HealthCheck))
        @hypothesis_seed(c.seed)
        @given(case=strategy(c.op, c.profile, c.path, c.world_size, c.under_test.specs, c.under_test.device))
        def search(case: Case) -> None:
            self.example(case)

        for case in reversed(self.cover):  # each applied on top: they run in the set's order
            search = example(case=case)(search)
        final = None
        try:
            with _frozen_heap():
                search()
            final = self.first  # a covering case's failure the draws did not repeat
            if final is not None and c.shrink:
                ends = (f"the {self.drawn} examples drawn after it found no failure to shrink" if self.drawn else
                        f"this {c.examples}-example budget ends before any example is drawn to shrink")
                result.unminimized = (f"it is a covering case (drawn first at every seed, never shrunk), and {ends}: "
                                      f"more examples (--examples {5 * c.examples}) draw on until one fails, and "
                                      "minimize it")
        except Discrepancy as d:
            final, result.shrunk = (d.case, d.rows), c.shrink
        except StopCampaign as stop:
            final, result.stopped = self.last, stop.args[0]
        except Flaky:  # the minimized case passed on Hypothesis's last replay: keep the last failure seen
            final = self.last
        except KeyboardInterrupt:  # a second Ctrl-C: stop now, keep what was found
            final, result.stopped = self.last, Stop.INTERRUPTED
        if self.error is not None:
            raise self.error
        if final is not None:
            self.keep(*final)
        return result

    def keep(self, case: Case, rows: list[Row]) -> None:
        """The campaign's one finding and its one file: the drawn failure it shrank, minimized to
        `case` (the case as found inside the file), else its first failing case as found. The rows
        of that case carry the file's name (`Row.finding`); every other failing case is evidence."""
        result = self.result
        if self.origin is None or case == self.found:  # nothing shrunk: the first failure, saved as found
            result.failure, result.case_file = Discrepancy(*self.first), result.found_file
            return
        origin, origin_rows, at = self.origin
        if case == origin:  # Hypothesis could not make it smaller: the case as found, its rows judged
            rows, judged, unshrunk, note = origin_rows, True, None, f"found at example {at}"
        else:
            judged, unshrunk, note = False, origin, f"minimized from the case found at example {at}"
        result.case_file = self.save(case, rows, note, unshrunk, judged)
        result.failure = Discrepancy(case, rows)
        if not judged:
            result.rows.extend(rows)
            self.sink.judged(rows, "shrink")
        # One file a finding: the first failure's, saved at once in case the run died before this
        # one, goes now that this one is written (its case is one more failing case).
        if result.found_file is not None and result.case_file is not None:
            self.campaign.findings.drop(result.found_file, self.first[1])
            result.found_file = None
