"""A fuzz campaign: Hypothesis draws cases for one op, the oracle judges each, and the first
discrepancy is shrunk to the smallest case that still fails and saved as a replayable file.

Nothing found is lost. The first failing case is saved the moment it is seen, then re-run: if a
re-run passes, the failure is reported as flaky (failed k of n re-runs) and the campaign ends
there, never in a Hypothesis traceback. A hung case is not re-run or shrunk (each try costs the
whole timeout). `started` is told of every case before it runs (a run directory journals it, so a
case whose process dies in the call is still a finding: `mla_verify.rundir`) and returns the call
that says it finished; `journal` receives every case's rows as it finishes; `stop_reason` is asked
after every case (Ctrl-C, a lost CUDA context) and ends the campaign with what it has.

A Hypothesis example may stand for a block of cases (`block`): the drawn case and the cases of the
same params at the next seeds, run through `run_block` (the reference answers them in one pass and
the oracle judges them at once: `OpSpec.evaluate_block`), for the cost of one draw. Each is an
ordinary case: counted, journaled and saved on its own, replayed alone. Shrinking keeps the failing
case's place in its block and shrinks that one case, as a campaign without blocks does.
"""

from __future__ import annotations

import contextlib
import gc
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from hypothesis import HealthCheck, Phase, example, given, seed as hypothesis_seed, settings
from hypothesis.errors import Flaky
from hypothesis.strategies import SearchStrategy

from mla_verify.equivalence.case import Case
from mla_verify.equivalence.catalog import get_spec
from mla_verify.equivalence.coverage import covering_set
from mla_verify.equivalence.profiles import Profile
from mla_verify.equivalence.rows import Row
from mla_verify.optimized import registry

from . import casefile
from .progress import Progress

Runner = Callable[[Case, str], list[Row]]  # (case, source) -> rows
# (cases of one params, source, on_call) -> each case's rows, None for a case not judged (a lost
# CUDA context ended its block); on_call() runs before each case's implementation is called, in order
BlockRunner = Callable[[list[Case], str, Callable[[], None]], list[list[Row]]]
Started = Callable[[Case, str], Callable[[], None]]  # (case, source) -> the call that says it finished
RERUNS = 3  # re-runs of the first failing case: a pass among them makes it flaky


class Discrepancy(Exception):
    def __init__(self, case: Case, rows: list[Row]):
        super().__init__(f"{case.short()}: " + "; ".join(r.reason for r in rows if not r.passed))
        self.case, self.rows = case, rows


class StopCampaign(BaseException):
    """Ends the search at once. A BaseException: Hypothesis would shrink and replay an Exception."""


@dataclass
class FuzzResult:
    op: str
    seed: int
    examples: int                 # cases evaluated while searching (re-runs and shrink steps not counted)
    rows: list[Row] = field(default_factory=list)
    failure: Discrepancy | None = None    # the minimized failing case (as found, if not shrunk)
    first_failure_at: int | None = None   # 1-based example number of the first failing case
    case_file: Path | None = None         # the finding's one case file (the minimized case where there is one)
    found_file: Path | None = None        # the first failing case as found, saved at once (until minimized)
    flaky: tuple[int, int] | None = None  # (failed k, of n re-runs) when a re-run passed
    stopped: str = ""                     # why the campaign ended before its budget ("interrupted", ...)
    shrunk: bool = False                  # the failure is Hypothesis's minimized case


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


def strategy(op: str, profile: Profile, path: str | None, world_size: int | None, impl_specs: tuple[str, ...],
             device: str) -> SearchStrategy[Case]:
    """The cases of a campaign: the op's draws within `profile`, and for interpreted kernels
    (Triton on CPU) only those the interpreter runs within the profile's budget a case."""
    spec = get_spec(op)
    if not registry.interpreted(impl_specs, device.split(":")[0]) or profile.interpreter_s is None:
        return spec.strategy(profile, path, world_size)
    budget = profile.interpreted()
    return spec.strategy(budget, path, world_size).filter(
        lambda case: spec.interpreted_s(spec.params_of(case.params)) <= budget.budget_s)


def first_cases(op: str, profile: Profile, path: str | None, world_size: int | None, impl_specs: tuple[str, ...],
                device: str, seed: int) -> list[Case]:
    """The covering set a campaign starts with (`equivalence.coverage`), held to the interpreter's
    budget as `strategy` holds the draws."""
    if world_size is not None:
        return []
    spec = get_spec(op)
    if not registry.interpreted(impl_specs, device.split(":")[0]) or profile.interpreter_s is None:
        return covering_set(op, profile, seed, path, device=device)
    return covering_set(op, profile, seed, path, device=device,
                        admit=lambda case: spec.interpreted_s(spec.params_of(case.params)) <= profile.interpreter_s)


def fuzz(
    op: str,
    run: Runner,
    *,
    profile: Profile,
    examples: int,
    seed: int,
    impl_specs: tuple[str, ...] = (),
    impl_label: str = "",
    deviations: tuple[str, ...] = (),
    conventions: tuple[str, ...] = (),
    device: str = "cpu",
    out_dir: Path | None = None,
    shrink: bool = True,
    progress_label: str | None = None,
    show_progress: bool = True,
    path: str | None = None,
    world_size: int | None = None,
    reruns: int = RERUNS,
    journal: Callable[[list[Row]], None] | None = None,
    stop_reason: Callable[[], str] = lambda: "",
    started: Started | None = None,
    block: int = 1,
    run_block: BlockRunner | None = None,
) -> FuzzResult:
    """Run up to `examples` cases of `op`; stop at the first failing case, re-run it, shrink it.

    Failing cases are saved under `out_dir`/failures (named by op, implementation and case), with
    `impl_specs` and the `deviations` and `conventions` declared for them, for replay.
    Exceptions of `run` other than a failing case's rows (a harness error) end the campaign and
    are raised after it; the rows so far have reached `journal` by then. The cases are drawn
    within the profile's interpreter budget when `impl_specs` name kernels interpreted on
    `device` (`strategy`); `show_progress`: print progress lines (a gate prints its own). With
    `block` > 1 and a `run_block`, each example is a block of up to `block` cases (module doc);
    `examples` still counts cases.
    """
    result = FuzzResult(op, seed, 0)
    progress = Progress(progress_label or op, examples, every_s=5.0 if show_progress else math.inf)
    state: dict = {"shrinking": False, "last": None, "error": None, "offset": 0, "found": None, "first": None}
    # The covering set runs first, as Hypothesis's explicit examples. Hypothesis shrinks only its
    # draws: a failing covering case is saved and re-run as any first failure, then the draws go
    # on to the first failure they make, which is shrunk; none: the covering case is the result.
    # Within the budget: a set larger than `examples` (blocks of `block`) keeps its first picks.
    cover = first_cases(op, profile, path, world_size, impl_specs, device, seed)[:max(1, -(-examples // max(block, 1)))]
    covering = {case.case_id for case in cover}
    found_by = (f"mla-verify fuzz --op {op}" + (f" --path {path}" if path else "")
                + (f" --world-size {world_size}" if world_size else "") + f" --seed {seed}"
                + "".join(f" --deviation {name}" for name in deviations)
                + "".join(f" --convention {c}" for c in conventions))

    def save(case: Case, rows: list[Row], note: str, where: Path | None = None, unshrunk: Case | None = None
             ) -> Path | None:
        if out_dir is None:
            return None
        cf = casefile.CaseFile(case, impl_specs, device, casefile.failure_summary(rows),
                               note=f"{note}; found by `{found_by}` (profile {profile.name})",
                               deviations=tuple(deviations), flaky=result.flaky, conventions=tuple(conventions),
                               unshrunk=unshrunk)
        if where is not None:
            return casefile.save(where, cf)
        return casefile.save_new(Path(out_dir) / "failures", casefile.stem(op, impl_label or ",".join(impl_specs), case), cf)

    def evaluate(case: Case, source: str) -> list[Row]:
        finished = started(case, source) if started is not None else None
        try:
            rows = run(case, source)
        except Exception as exc:  # the harness's own failure: stop now, raise it after the campaign
            state["error"] = exc
            raise StopCampaign("harness error") from None
        if finished is not None:
            finished()
        return rows

    def evaluate_block(cases: list[Case], source: str) -> list[list[Row]]:
        if len(cases) == 1 or run_block is None:
            return [evaluate(case, source) for case in cases]
        waiting, calling = list(cases), []

        def on_call() -> None:
            # Journaled as each case's call starts; the case before it returned by then, so a
            # process that dies in a call leaves that case alone unfinished.
            if calling:
                calling.pop()()
            case = waiting.pop(0)
            if started is not None:
                calling.append(started(case, source))

        try:
            found = run_block(cases, source, on_call)
        except Exception as exc:
            state["error"] = exc
            raise StopCampaign("harness error") from None
        for finished in calling:
            finished()
        return found

    def first_failure(case: Case, rows: list[Row]) -> None:
        result.first_failure_at, state["found"] = result.examples, case
        result.found_file = save(case, rows, f"found at example {result.examples}")
        if any(r.gate_metric == "hung" for r in rows):
            raise StopCampaign("")  # a hang is not re-run or shrunk: every try costs the timeout
        if stop_reason():
            raise StopCampaign(stop_reason())
        failed = sum(_failing(evaluate(case, "rerun")) for _ in range(reruns))
        if failed < reruns:
            result.flaky = (failed, reruns)
            save(case, rows, f"flaky: failed {failed} of {reruns} re-runs", result.found_file)
            raise StopCampaign("")
        if stop_reason() or not shrink:
            raise StopCampaign(stop_reason())
        state["shrinking"] = True

    # Past a covering set as large as the budget, nothing is drawn.
    drawn = (Phase.reuse, Phase.generate) + ((Phase.shrink,) if shrink else ()) if examples > len(cover) else ()
    phases = (Phase.explicit, *drawn)

    @settings(max_examples=max(1, -(-(examples - len(cover)) // max(block, 1))), deadline=None, database=None,
              phases=phases, print_blob=False, report_multiple_bugs=False, suppress_health_check=list(HealthCheck))
    @hypothesis_seed(seed)
    @given(case=strategy(op, profile, path, world_size, impl_specs, device))
    def search(case: Case) -> None:
        shrinking = state["shrinking"]
        if shrinking:  # the failing case's place in its block, at the shrunk draw
            case = Case(case.op, case.params, case.seed + state["offset"])
            found = [(case, evaluate(case, "shrink"))]
        else:
            count = max(1, min(block, examples - result.examples))
            cases = [case] + [Case(case.op, case.params, case.seed + i) for i in range(1, count)]
            found = [(c, rows) for c, rows in zip(cases, evaluate_block(cases, "fuzz")) if rows is not None]
            for c, rows in found:
                result.examples += 1
                result.rows.extend(rows)
                if journal is not None:
                    journal(rows)
                progress.step(_failing(rows))
        failing = next((i for i, (_, rows) in enumerate(found) if _failing(rows)), None)
        if failing is not None:
            state["last"] = found[failing]
            if not shrinking:
                state["offset"] = failing
                if state["first"] is None:
                    state["first"] = found[failing]
                    first_failure(*found[failing])
                if case.case_id in covering:  # not Hypothesis's to shrink: draw on for a failure it can shrink
                    state["shrinking"] = False
                    return
                state["shrinking"] = True
            elif stop_reason():
                raise StopCampaign(stop_reason())
            raise Discrepancy(*found[failing])  # one place: Hypothesis tells failures apart by where they rose
        if stop_reason():
            raise StopCampaign(stop_reason())

    for case in reversed(cover):  # each applied on top: they run in the set's order
        search = example(case=case)(search)
    final = None
    try:
        with _frozen_heap():
            search()
        final = state["first"]  # a covering case's failure the draws did not repeat
    except Discrepancy as d:
        final, result.shrunk = (d.case, d.rows), shrink
    except StopCampaign as stop:
        final, result.stopped = state["last"], str(stop.args[0]) if stop.args else ""
    except Flaky:  # the minimized case passed on Hypothesis's last replay: keep the last failure seen
        final = state["last"]
    except KeyboardInterrupt:  # a second Ctrl-C: stop now, keep what was found
        final, result.stopped = state["last"], "interrupted"
    if state["error"] is not None:
        raise state["error"]
    if final is not None:
        case, rows = final
        result.failure = Discrepancy(case, rows)
        result.case_file = result.found_file
        if all(r.case_id != case.case_id for r in result.rows):  # the minimized case, found while shrinking
            result.rows.extend(rows)
            if journal is not None:
                journal(rows)
            # One file a finding: the minimized case holds the one it was shrunk from, whose file,
            # saved at once in case the run died while shrinking, goes once this one is written.
            result.case_file = save(case, rows, f"minimized from the case found at example {result.first_failure_at}",
                                    unshrunk=state.get("found"))
            if result.found_file is not None and result.case_file is not None:
                result.found_file.unlink(missing_ok=True)
                result.found_file = None
    return result
