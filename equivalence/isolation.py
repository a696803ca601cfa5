"""Crash isolation: run cases in a worker process that is replaced when it dies, hangs or sees a
CUDA error.

A CUDA illegal address or device-side assert poisons the whole context, and a kernel can spin
forever; either way the campaign must record the case as failed and go on. The worker receives
(case, --impl specs, declared deviations), runs the implementation's side of it
(`equivalence.catalog.produce`: inputs, the call, the checks only that process can make) and sends
back its outputs on the host. The parent judges them (`catalog.judge_produced`): it builds the
inputs again, computes the reference and every verdict where the implementation cannot reach
them, neither the reference's tensors nor the judge's functions.

Clocks. A worker says "ready" once it has imported everything, created its CUDA context and
warmed up; it says "calling" once a case's inputs are built, just before the
implementation runs. Only the implementation's part counts against `timeout_s`: a fresh worker's
start-up never makes a correct case look hung.

Recycling. After an implementation raises a CUDA error, or whenever the context no longer works,
the worker answers and exits; the next case runs in a fresh one. A harness-side failure after the
implementation ran with the context gone is the implementation's crash. Once one worker has been
replaced, spares are kept warming in the background, so a campaign that shrinks a crash does not
wait for start-ups. On CPU, workers fork from a server that has imported torch, mla-verify and every
spec once (multiprocessing's forkserver), which makes a replacement take tens of milliseconds;
CUDA workers are spawned fresh (nothing CUDA ever runs in a process that forks).
"""

from __future__ import annotations

import contextvars
import multiprocessing as mp
import os
import signal
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from . import guards
from .case import Case
from .contract import CALLED_WITH
from .device import first_line, is_device_error, take_gpu_share, usable
from .produced import Produced
from .rows import Row
from .running import failure_row

STARTUP_TIMEOUT_S = 300.0   # imports, CUDA context, warm-up: never counted against a case
# Spares kept warming once a worker has been replaced. A CUDA worker takes seconds to start (CUDA
# context, cuBLAS): shrinking a crash replaces one per failing step, so two start side by side.
SPARES = {"cpu": 1, "cuda": 2}
HARNESS_TIMEOUT_S = 1800.0  # a case's inputs (ours, not the implementation's)


def default_isolation(isolate: bool | None, named: bool, own_processes: bool = False) -> bool:
    """Whether a run's cases go to a worker (`Worker`), so that the judge runs where the kernel
    cannot reach it: by default whenever the implementation can be imported there by name
    ("MODULE:CALLABLE" or a registered name), on CPU as on CUDA (on CPU a case costs about 12%
    more and a worker starts from a preloaded forkserver: docs/concepts/isolation.md). A
    callable object cannot cross processes and runs in this one. An op whose ranks are processes
    of their own (dcp) already runs the kernel outside its judge. UsageError for isolate=True
    with an implementation that is not named."""
    if isolate and not named:
        from .subject import UsageError

        raise UsageError("isolate=True needs an implementation importable by MODULE:CALLABLE (a module-level "
                         "function); a lambda, closure or partial runs in this process only")
    return (named if isolate is None else isolate) and not own_processes


class HarnessError(RuntimeError):
    """mla-verify itself failed (building inputs, the reference, a worker that cannot start);
    `detail` holds the traceback."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail


def _warm_up(device: str) -> None:
    """The CUDA context and the libraries a first kernel call would otherwise initialize."""
    import torch

    if device.startswith("cuda"):
        if ":" in device:
            torch.cuda.set_device(device)
        a = torch.ones(64, 64, device=device)
        (a @ a).sum().item()


def _serve(conn, device: str) -> None:
    # Ctrl-C, and the SIGTERM that `timeout` or a scheduler sends the whole process group, are the
    # parent's to handle: it finishes the case; the worker dying of one would read as a crash.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    if not device.startswith("cuda"):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    take_gpu_share(0.5)  # the other half is its judge's
    _warm_up(device)
    conn.send(("ready", os.getpid()))
    with guards.kept_watch():  # taken once: each call puts back what it changed, for the next
        _answer_cases(conn, device)


def _answer_cases(conn, device: str) -> None:
    """Produce each case the parent sends, until it sends None or a context cannot be trusted."""
    from .catalog import produce, resolve_subject  # it imports the kernels: not before `_serve` set up Triton

    subjects = {}
    while True:
        msg = conn.recv()
        if msg is None:
            return
        case_dict, specs, deviations, conventions, run_id, source = msg
        case = Case.from_dict(case_dict)
        called = []

        def on_call() -> None:
            called.append(True)
            conn.send(("calling", None))

        notes: set[str] = set()
        try:
            key = (case.op, tuple(specs), tuple(deviations), tuple(conventions))
            if key not in subjects:
                subjects[key] = resolve_subject(case.op, specs, device.split(":")[0], deviations=deviations,
                                                conventions=conventions)
            CALLED_WITH.clear()
            produced = produce(case, subjects[key], device, run_id=run_id, source=source, on_call=on_call)
            notes.update(produced.notes)
            rows = [Row.from_record(r) for r in produced.rows]
        except Exception as exc:
            if called and (is_device_error(exc) or not usable(device)):
                # The context died while (or right after) the implementation ran: its crash.
                conn.send(("crashed", f"CUDA error after the implementation ran: {first_line(exc)}"))
                return
            conn.send(("error", traceback.format_exc()))
            continue
        retire = device.startswith("cuda") and (
            any(r.gate_metric == "raised" and is_device_error(r.reason) for r in rows) or not usable(device))
        called = {stage: sorted(keywords) for stage, keywords in CALLED_WITH.items()}  # for the parent's notes
        conn.send(("produced", (produced, sorted(notes), retire, called)))
        if retire:
            return  # never trust a context that saw a CUDA error with another case


@dataclass
class _Process:
    proc: Any
    conn: Any
    ready: bool = False


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class Worker:
    """One isolated evaluation process for `device` (e.g. "cuda:0"), replaced as needed."""

    def __init__(self, device: str, timeout_s: float = 300.0):
        if timeout_s <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout_s}")
        self.device, self.timeout_s = device, timeout_s
        self._active: _Process | None = None
        self._spares: list[_Process] = []
        self.restarts = 0

    def _spawn(self) -> _Process:
        if self.device.startswith("cuda"):
            ctx = mp.get_context("spawn")
        else:
            # The server imports every spec (and the kernels) once: a replacement after a crash then
            # forks in ~0.07 s, not ~0.8 s (measured, quantize n=64). Triton must run interpreted
            # there before it imports anything, as in every CPU process of the run.
            os.environ.setdefault("TRITON_INTERPRET", "1")
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(["mla_verify.equivalence.isolation", "mla_verify.optimized",
                                        "mla_verify.equivalence.catalog"])
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child, self.device), daemon=True)
        proc.start()
        child.close()
        return _Process(proc, conn)

    def _await_ready(self, p: _Process) -> None:
        if p.ready:
            return
        if p.conn.poll(STARTUP_TIMEOUT_S):
            try:
                kind, _ = p.conn.recv()
            except (EOFError, ConnectionResetError):
                kind = "died"
            if kind == "ready":
                p.ready = True
                return
        p.proc.kill()
        p.proc.join(5)
        raise HarnessError(f"an isolation worker for {self.device} did not start within {STARTUP_TIMEOUT_S:g} s "
                           f"({_exit_reason(p.proc.exitcode)})")

    def _top_up(self) -> None:
        while len(self._spares) < SPARES[self.device.split(":")[0]]:
            self._spares.append(self._spawn())

    def _ensure(self) -> _Process:
        if self._active is None:
            self._active = self._spares.pop(0) if self._spares else self._spawn()
            if self.restarts:  # crashes come in runs while shrinking: keep the next ones warming
                self._top_up()
        self._await_ready(self._active)
        return self._active

    def _retire(self) -> None:
        p, self._active = self._active, None
        if p is not None:
            if p.proc.is_alive():
                p.proc.join(2)
            if p.proc.is_alive():
                p.proc.kill()
            p.proc.join(5)
        self.restarts += 1
        self._top_up()

    def _receive(self, p: _Process, timeout_s: float) -> tuple[str, Any]:
        if not p.conn.poll(timeout_s):
            return "timeout", None
        try:
            return p.conn.recv()
        except (EOFError, ConnectionResetError, OSError):
            return "died", None

    def run(
        self, case: Case, specs: Sequence[str], label: str, run_id: str = "", source: str = "fuzz",
        notes: set[str] | None = None, deviations: Sequence[str] = (), conventions: Sequence[str] = (),
    ) -> list[Row]:
        """The case's rows, or a single failure row ("crashed" / "hung") when the worker died or
        did not answer in time. Raises HarnessError for a failure of the harness itself."""
        return self.run_block([case], specs, label, run_id, source, notes, deviations, conventions)[0]

    def run_block(
        self, cases: Sequence[Case], specs: Sequence[str], label: str, run_id: str = "", source: str = "fuzz",
        notes: set[str] | None = None, deviations: Sequence[str] = (), conventions: Sequence[str] = (),
        on_call: Callable[[], None] | None = None,
    ) -> list[list[Row]]:
        """`run` of each of `cases` (one params: a fuzz block), the worker producing one case at a
        time and this process judging them together (`judge_produced_block`); `on_call` runs as
        each case is sent. What the judge can compute before the outputs exist (the cases' inputs
        and the reference's answer: `prepare_block`) it computes meanwhile, on a thread of its own:
        the clocks of the calls stay this thread's. On a GPU the two processes share, a case's
        kernel time can include some of the judge's work that ran meanwhile, and its reference
        time some of the worker's."""
        from .catalog import judge_produced_block, prepare_block  # they import the kernels: not before `_serve` set up Triton

        with ThreadPoolExecutor(1, thread_name_prefix="judge-ahead") as ahead:
            # A thread starts with an empty context: the reference's memory_limit goes with it.
            prepared = ahead.submit(contextvars.copy_context().run, prepare_block, cases, self.device)
            found: list = []
            for case in cases:
                if on_call is not None:
                    on_call()
                found.append(self._produce(case, specs, label, run_id, source, notes, deviations, conventions))
            if not any(isinstance(f, Produced) for f in found):
                return found
            produced = [f if isinstance(f, Produced) else Produced([r.to_record() for r in f], failed=True) for f in found]
            return judge_produced_block(cases, produced, label, self.device, run_id=run_id, source=source,
                                        prepared=prepared.result())

    def _produce(self, case: Case, specs: Sequence[str], label: str, run_id: str, source: str,
                 notes: set[str] | None, deviations: Sequence[str], conventions: Sequence[str]) -> Produced | list[Row]:
        """What the worker produced for `case`, or its single failure row when it died or hung."""
        from .catalog import get_spec

        p = self._ensure()
        base = dict(run_id=run_id, case_id=case.case_id, impl=label, stages="", device=self.device,
                    seed=case.seed, source=source, **get_spec(case.op).identity(case))
        try:
            p.conn.send((case.to_dict(), list(specs), list(deviations), list(conventions), run_id, source))
        except (BrokenPipeError, OSError):
            self._retire()
            return [failure_row(base, "*", "crashed", "the worker process died between cases")]
        kind, payload = self._receive(p, HARNESS_TIMEOUT_S)
        called = kind == "calling"
        if called:
            kind, payload = self._receive(p, self.timeout_s)
            if kind == "timeout":
                self._kill_active()
                return [failure_row(base, "*", "hung", f"hung: no answer within {self.timeout_s:g} s")]
        elif kind == "timeout":
            self._kill_active()
            raise HarnessError(f"building the inputs and reference of {case.short()} took over {HARNESS_TIMEOUT_S:g} s")
        if kind == "produced":
            produced, reported, retire, called = payload
            if notes is not None:
                notes.update(reported)
            for stage, keywords in called.items():  # what the stages were handed, as if called here
                CALLED_WITH[stage].update(keywords)
            if retire:
                self._retire()
            return produced
        if kind == "error":
            raise HarnessError(f"harness error in the worker on {case.short()}", payload)
        if kind == "crashed":
            self._retire()
            return [failure_row(base, "*", "crashed", payload)]
        p.proc.join(5)
        self._retire()
        when = "" if called else " before the implementation was called"
        return [failure_row(base, "*", "crashed", f"the worker process died{when} ({_exit_reason(p.proc.exitcode)})")]

    def _kill_active(self) -> None:
        if self._active is not None:
            self._active.proc.kill()
        self._retire()

    def close(self) -> None:
        for p in (self._active, *self._spares):
            if p is None:
                continue
            try:
                if p.ready and p.proc.is_alive():
                    p.conn.send(None)
                    p.proc.join(10)
            except (BrokenPipeError, OSError):
                pass
            if p.proc.is_alive():
                p.proc.kill()
            p.proc.join(5)
        self._active, self._spares = None, []
