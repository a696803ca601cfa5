"""Judging a block of cases, in this process or through an isolation worker: the one place that
chooses, for every caller (a run's driver, replay, the library's API, the benchmarks).

Isolated (`default_isolation`), the kernel runs in a worker (`sandbox.worker.Worker`, transport
only: a case out, what the kernel produced back) and everything else happens here: the block's
inputs are built once (on CPU handed to the worker), the reference answers them on a thread of its
own while the worker produces (`catalog.prepare_block`; the calls' clocks stay the worker's), and
what came back is judged (`catalog.judge_produced_block`), its findings given the rows' identity
(`RowContext.base`), a deviation the run did not resolve refused. In this process the spec judges
the block itself (`Spec.evaluate_block`). Either way a harness error met once the implementation
ran on a CUDA context it took with it is the case's crash, never the harness's
(`sandbox.device.context_lost`), and `Judging.lost` says the device cannot run another case.
"""

from __future__ import annotations

import contextvars
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Sequence

from . import catalog
from .cases.case import Case
from .errors import UsageError
from .judge.rows import FailureKind, Row, RowContext
from .sandbox.boundary import Boundary
from .sandbox.call_guards import CALLED_WITH
from .sandbox.calls import after_return_rows, failure_row, noted, unsupported_row
from .sandbox.device import context_lost, device_type, is_cuda, usable
from .sandbox.produced import Produced
from .sandbox.worker import UNREADABLE, Key, Unanswered, Worker
from .serve import PRELOAD, serve
from .subject import Subject


def default_isolation(isolate: bool | None, named: bool, own_processes: bool = False) -> bool:
    """Whether a run's cases go to a worker, so that the judge runs where the kernel cannot reach
    it: by default whenever the implementation can be imported there by name ("MODULE:CALLABLE"
    or a registered name), on CPU as on CUDA (on CPU a case costs about 12% more and a worker
    starts from a preloaded forkserver: docs/concepts/isolation.md). A callable object cannot
    cross processes and runs in this one. An op whose ranks are processes of their own (dcp)
    already runs the kernel outside its judge. UsageError for isolate=True with an implementation
    that is not named."""
    if isolate and not named:
        raise UsageError("isolate=True needs an implementation importable by MODULE:CALLABLE (a module-level "
                         "function); a lambda, closure or partial runs in this process only")
    return (named if isolate is None else isolate) and not own_processes


class Judging:
    """Blocks of cases judged on `device`: through an isolation worker (`isolate`: its calls held
    to `timeout` seconds, behind `sandbox`), or in this process. Close it (or use it as a context
    manager) to let its worker go."""

    def __init__(self, device: str, isolate: bool = False, timeout: float = 300.0, sandbox: str = "auto",
                 hand_over: bool | None = None):
        self.device = device
        self.worker = Worker(device, serve, timeout, hand_over, sandbox, PRELOAD) if isolate else None
        self.lost = False  # in this process, a call took the CUDA context with it: no case can run after
        self._described: dict[Key, Subject] = {}  # what the judge knows of an isolated implementation

    def __enter__(self) -> "Judging":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()

    def start(self) -> Boundary | None:
        """Start the worker now (not at the first case), where there is one, and say what it
        stands behind."""
        return self.worker.start() if self.worker is not None else None

    def subject(self, op: str, specs: Sequence[str] = (), deviations: Sequence[str] = (),
                conventions: Sequence[str] = ()) -> Subject:
        """The implementation `specs` names for `op`, as this judge knows it: isolated, a user's
        callable described from its module's source, never imported here
        (`catalog.resolve_subject(described=True)`); else resolved in this process."""
        key = (op, tuple(specs), tuple(deviations), tuple(conventions))
        if self.worker is None:
            return catalog.resolve_subject(op, specs, device_type(self.device), deviations=deviations,
                                           conventions=conventions)
        if key not in self._described:
            self._described[key] = catalog.resolve_subject(op, specs, device_type(self.device), deviations=deviations,
                                                           conventions=conventions, described=True)
        return self._described[key]

    def resolve(self, op: str, specs: Sequence[str] = (), deviations: Sequence[str] = (),
                conventions: Sequence[str] = ()) -> Subject:
        """`subject`, and isolated, imported in a worker first (its import-time code, signature
        and declared deviations run there, behind the sandbox): UsageError, in one line, where it
        cannot be. Call it before the first case: the run then starts only with an implementation
        its worker could import."""
        subject = self.subject(op, specs, deviations, conventions)  # the judge's reading first: no worker time
        if self.worker is not None and not catalog.get_spec(op).own_processes:
            if (why := self.worker.load((op, tuple(specs), tuple(deviations), tuple(conventions)))) is not None:
                raise UsageError(why)
        return subject

    def case(self, case: Case, subject: Subject, context: RowContext | None = None) -> list[Row]:
        """The rows of `case` (`block` of one); `context`: by default the subject's label on this device."""
        return self.block([case], subject, context or RowContext(label=subject.label, device=self.device))[0]

    def block(self, cases: Sequence[Case], subject: Subject, context: RowContext) -> list[list[Row] | None]:
        """The rows of each of `cases` (one op and params, their seeds differ: a fuzz block), the
        rows saying what `context` says; `context.on_call` runs as each case's implementation is
        called (isolated: as it is sent). None for a case not judged: in this process, one after a
        call that took the CUDA context with it."""
        if self.worker is None or catalog.get_spec(cases[0].op).own_processes:
            return self._here(cases, subject, context)
        return self._isolated(cases, subject, context)

    def sandboxed(self) -> dict:
        """What the run records of its workers' sandbox ({} in this process)."""
        return self.worker.sandboxed() if self.worker is not None else {}

    def summary(self) -> str:
        """The sandbox in one line ("" in this process)."""
        return self.worker.summary() if self.worker is not None else ""

    def _here(self, cases: Sequence[Case], subject: Subject, context: RowContext) -> list[list[Row] | None]:
        called: list[bool] = []

        def on_call() -> None:
            called.append(True)
            if context.on_call is not None:
                context.on_call()

        try:
            # the rows name the subject as it resolved here (a local callable by its whole name)
            found = catalog.get_spec(cases[0].op).evaluate_block(cases, subject,
                                                                 replace(context, label=subject.label, on_call=on_call))
        except Exception as exc:
            if not called or (why := context_lost(exc, self.device)) is None:
                raise
            at = len(called) - 1
            found = [None] * len(cases)
            found[at] = [failure_row(catalog.row_base(cases[at], context), "*", FailureKind.CRASHED, why,
                                     device_error=True)]
        if is_cuda(self.device) and not self.lost:
            self.lost = any(r.device_error for rows in found if rows for r in rows) or not usable(self.device)
        return found

    def _isolated(self, cases: Sequence[Case], subject: Subject, context: RowContext) -> list[list[Row]]:
        """The worker producing one case at a time, this process judging them together. What the
        judge can compute before the outputs exist (the cases' inputs and the reference's answer)
        it computes meanwhile, on a thread of its own: the clocks of the calls stay the worker's.
        On a GPU the two processes share, a case's kernel time can include some of the judge's
        work that ran meanwhile, and its reference time some of the worker's."""
        op, worker = cases[0].op, self.worker
        key = (op, subject.specs, subject.declared, subject.conventions)
        allowed = catalog.allowed_deviations(self.subject(*key), device_type(self.device))
        bases = [catalog.row_base(case, context) for case in cases]
        # Built once, here, before the worker starts the block: the reference reads them, and the
        # worker is handed them (`segment`). Inputs that cannot be (a Batch) are built on the
        # judge's thread while the worker builds its own.
        inputs = catalog.prepare_inputs(cases, self.device) if worker.hands_over(op) else None
        handed = inputs.kwargs if inputs is not None else []
        writes = getattr(catalog.get_spec(op), "writes", ())
        with ThreadPoolExecutor(1, thread_name_prefix="judge-ahead") as ahead:
            # A thread starts with an empty context: the reference's memory_limit goes with it.
            prepared = ahead.submit(contextvars.copy_context().run, catalog.prepare_block, cases, self.device, inputs)
            answers = []
            for i, case in enumerate(cases):
                if context.on_call is not None:
                    context.on_call()
                answers.append(worker.produce(case, key, context, handed[i] if i < len(handed) else None, writes))
            if not any(isinstance(a, Produced) for a in answers):
                return [[failure_row(base, "*", a.metric, a.reason)] for a, base in zip(answers, bases)]
            produced = [_received(a, base, allowed, context) for a, base in zip(answers, bases)]
            judged = catalog.judge_produced_block(cases, produced, context, prepared.result())
        if (failed := worker.ask_after()) is not None:
            last = max(i for i, a in enumerate(answers) if isinstance(a, Produced))
            judged[last].append(failure_row(bases[last], "*", *failed))
        for case, rows, p, base in zip(cases, judged, produced, bases):
            if changed := worker.written_after(case.case_id):
                rows += after_return_rows(base, changed, time_impl_s=p.t_impl)
            noted(rows, p.threads)
        return [rows or [failure_row(base, "*", FailureKind.CRASHED, f"{UNREADABLE}: it holds nothing to judge "
                                     "(no output, no finding)")] for rows, base in zip(judged, bases)]


def _received(answer: Produced | Unanswered, base: dict, allowed: frozenset[str], context: RowContext) -> Produced:
    """What the worker answered for a case, as the judge reads it: its rows made here from its
    findings (each can only fail the case; `base` gives them their identity, its path and stages
    the answer's), what it noted and the keywords its stages were handed taken in. An answer
    under a deviation the run did not resolve (`allowed`) is the case's contract failure: the
    bounds are the run's, never the worker's. No answer is the case's one failure row."""
    if isinstance(answer, Unanswered):
        return Produced([failure_row(base, "*", answer.metric, answer.reason).to_record()], failed=True)
    if context.notes is not None:
        context.notes.update(answer.notes)
    for stage, keywords in answer.called.items():  # what the stages were handed, as if called here
        CALLED_WITH[stage].update(keywords)
    base = {**base, "path": answer.path or base["path"], "stages": answer.stages}
    if (beyond := _beyond(answer, allowed)) is not None:
        return Produced([failure_row(base, "*", FailureKind.CONTRACT, beyond).to_record()], failed=True,
                        t_impl=answer.t_impl)
    return replace(answer, rows=[_finding_row(base, f, answer.t_impl).to_record() for f in answer.rows])


def _finding_row(base: dict, finding: dict, t_impl: float) -> Row:
    """The row of one finding (`produced.FINDING_FIELDS`): a decline counted, anything else failed
    (an input written with the call's clock, as `calls.input_rows` makes it)."""
    metric = finding["gate_metric"]
    if metric == FailureKind.UNSUPPORTED:
        return unsupported_row(base, finding["reason"])
    timed = {"time_impl_s": t_impl, "written": finding["written"]} if metric == FailureKind.INPUT_WRITTEN else {}
    return failure_row(base, finding["tensor"], metric, finding["reason"], **timed)


def _beyond(answer: Produced, allowed: frozenset[str]) -> str | None:
    """Why `answer` claims bounds the run did not resolve (a deviation of its own, or of one of its
    stage calls, outside `allowed`), else None."""
    claimed = {*answer.deviations, *(d for run in answer.stage_calls for call in run for d in call["deviations"])}
    if not (extra := sorted(claimed - allowed)):
        return None
    resolved = ", ".join(sorted(allowed)) or "none"
    return (f"the worker answered under deviation(s) {', '.join(extra)}, which the run did not resolve (resolved: "
            f"{resolved}; a user's callable declares them as a literal __mla_verify_deviations__ in its module's "
            "source, or with --deviation): never a looser bound")
