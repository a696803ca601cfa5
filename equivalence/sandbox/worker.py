"""Crash isolation, the judge's side: a worker process that runs the implementation's side of each
case, replaced when it dies, hangs or sees a CUDA error. This module is transport only: it carries
a case to the worker and what the kernel produced back (`produced.Produced`); what is judged, and
how, is `equivalence.blocks`'s.

A CUDA illegal address or device-side assert poisons the whole context, and a kernel can spin
forever; either way the campaign must record the case as failed and go on. The worker (the process
`serve` its judge hands in: `equivalence.serve`) receives a case, the --impl strings and declared
deviations, runs the implementation's side of it and sends back its outputs on the host. Where its
judge built the case's inputs already, on CPU they are handed to the worker through a shared
segment (`equivalence.sandbox.segment`; elsewhere, and for inputs that are not plain tensors, the
worker builds its own from the seed). The outputs come back through a segment too, the pipe
carrying the header.

The worker is untrusted: it runs the user's code. What it sends is data (`equivalence.sandbox.wire`:
a JSON header and raw tensor bytes, parsed with size bounds, never unpickled), outputs and clock
readings and findings that can only fail its case, never a row or a verdict; a message that does
not parse or comes out of turn is the case's `crashed` answer (`Unanswered`). The parent waits on
the worker's process beside its pipe (a dead worker is a crash at once, whoever holds the pipe),
the worker watches its own channel after every call, and what a call forked is killed when its
case ends (`equivalence.sandbox.reaper`). The returned storage is compared with the copy sent,
before the next call and after the block's judge (`guards.Returned`: a write after return).

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
CUDA workers are spawned fresh (no CUDA context is ever forked). A spawned worker runs threads
once its imports are done, which a user namespace refuses: it forks once behind its boundary,
before CUDA starts (`boundary._alone`), and the process started here stands in for it.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple, Sequence

from ..cases.case import Case
from ..errors import HarnessError, UsageError
from ..judge.policy import DEVIATIONS
from ..judge.rows import FailureKind, RowContext
from . import boundary, reaper, segment, wire
from .device import device_type, is_cuda
from .produced import FINDING_FIELDS, Produced
from .wire import Message

STARTUP_TIMEOUT_S = 300.0   # imports, CUDA context, warm-up: never counted against a case
# Spares kept warming once a worker has been replaced. A CUDA worker takes seconds to start (CUDA
# context, cuBLAS): shrinking a crash replaces one per failing step, so two start side by side.
SPARES = {"cpu": 1, "cuda": 2}
HARNESS_TIMEOUT_S = 1800.0  # a case's inputs (ours, not the implementation's)
RESOLVE_FLOOR_S = 30.0      # a module's import in the worker (a JIT build at import) may take this long at least
READ_GRACE_S = 60.0         # a message's bytes once its first arrived (outputs of gigabytes on a slow host)
UNREADABLE = "the worker sent an unreadable message"
# A spawned worker's imports ask torch whether there is a GPU (mla_verify.optimized, judge.fused)
# before its boundary: through NVML, not the CUDA runtime, whose start a child it forks to enter
# its namespaces could not use (`boundary._alone`; where the driver was loaded all the same, the
# namespaces are missing and say so).
SPAWNED_ENV = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}

# An implementation as a worker imports it: (op, --impl strings, declared deviations, conventions)
Key = tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...]]


class Unanswered(NamedTuple):
    """A case the worker gave no answer for: its process died or hung, or what it sent is not an
    answer (`metric` crashed or hung, and why)."""

    metric: FailureKind
    reason: str


@dataclass
class _Process:
    proc: Any
    conn: Any
    reader: wire.Reader
    sock: Any                                # its pipe as a socket: the segments' descriptors go through it
    alive: int | None = None                 # a pidfd of the process (liveness, whoever holds the pipe)
    ready: bool = False
    inputs: segment.Segment | None = None   # the cases' inputs, written here (`segment.hand_over`)
    handed: set = field(default_factory=set)     # serials of the segments whose descriptor it holds
    resolved: set = field(default_factory=set)   # the implementations it imported (`Worker.load`)
    fence: boundary.Boundary | None = None       # what it said it stands behind, before any user code
    said_pid: int | None = None                  # its pid as it sees it (in its own PID namespace, if any)

    def close_segments(self) -> None:
        for s in (self.inputs, self.reader.segment):
            if s is not None:
                s.close()
        self.inputs = self.reader.segment = None

    def runner(self) -> int:
        """The pid of the process that runs the cases: the one we started, or the worker it stands
        in for (`boundary._alone`, `boundary._pid_namespace`: pid 2 behind a PID namespace), found
        below it by the pid it said it has (a pid it made up finds nothing there: the one we started)."""
        if self.said_pid is None or self.said_pid == self.proc.pid:
            return self.proc.pid
        return reaper.in_namespace(self.proc.pid, self.said_pid) or self.proc.pid

    def close(self) -> None:
        """Its segments, descriptors and scratch directory, once the process is gone."""
        self.close_segments()
        self.conn.close()
        self.sock.close()
        if self.alive is not None:
            os.close(self.alive)
        for scratch in boundary.scratch_dirs(self.proc.pid):  # a spare that never said ready made one too
            shutil.rmtree(scratch, ignore_errors=True)


_LIVE: "weakref.WeakSet[Worker]" = weakref.WeakSet()


def reap_all() -> int:
    """Kill every process a worker of this process left running (`reaper.kill_strays`), the live
    workers and multiprocessing's own helpers kept; how many there were. A run calls it before
    its final record (`mla_verify.runs.record.seal`)."""
    keep = set().union(*(w._pids() for w in list(_LIVE)))
    return reaper.kill_strays(keep | _servers())


def _servers() -> set[int]:
    """The pids of multiprocessing's own helpers (the fork server, the resource tracker): started
    with a worker, so marked, and never strays."""
    from multiprocessing import forkserver, resource_tracker

    pids = {getattr(forkserver._forkserver, "_forkserver_pid", None),
            getattr(resource_tracker._resource_tracker, "_pid", None)}
    return {p for p in pids if p}


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """`values` in this process's environment (each where not set already) while a worker starts."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _said(header: dict, key: str) -> str:
    """header[key], the worker's own words, where it is a bounded string."""
    try:
        return wire.text(header, key) or "(nothing said)"
    except wire.Unreadable:
        return f"{UNREADABLE}: its {key!r} is not a string"


def _last_line(header: dict) -> str:
    detail = _said(header, "detail").strip().splitlines()
    return detail[-1][:300] if detail else "(no detail)"


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

    def __init__(self, device: str, serve: Callable, timeout_s: float = 300.0, hand_over: bool | None = None,
                 sandbox: str = "auto", preload: Sequence[str] = (), start: str | None = None):
        """`serve`: the worker process's function (`equivalence.serve.serve`), `preload`: the modules
        a CPU worker's fork server imports once. `start`: multiprocessing's start method, "spawn"
        on CUDA and "forkserver" elsewhere by default (a CPU worker spawned is started as a CUDA
        one is: how the tests check that path). `hand_over`: whether the inputs its judge builds go
        to the worker through a shared segment (else the worker builds them again). By default on
        CPU only: on CUDA the segment is host memory, a copy to the host and one back (the decode
        case B=64 H=128 holds ~350 MB of cache: tens of ms each way) against a build of 1.2-1.9 ms
        on the device, until device memory can be shared. `sandbox`: the OS boundary each worker
        puts itself behind (`boundary.MODES`); strict refuses a worker where a layer did not hold
        (UsageError). This process, the judge, is made not dumpable (`boundary.protect_judge`)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout_s}")
        if sandbox not in boundary.MODES:
            raise ValueError(f"sandbox mode {sandbox!r}: expected one of {', '.join(boundary.MODES)}")
        boundary.protect_judge()
        if start not in (None, "spawn", "forkserver"):
            raise ValueError(f"start method {start!r}: expected spawn or forkserver")
        self.device, self.timeout_s, self.sandbox = device, timeout_s, sandbox
        self.start_method = start or ("spawn" if is_cuda(device) else "forkserver")
        self._serve, self._preload = serve, [serve.__module__, *preload]
        self.fence: boundary.Boundary | None = None  # what the workers stand behind (the last one's words)
        self.fell_back = ""  # why the workers run without the sandbox (auto, where a worker could not start behind it)
        self.no_namespaces = ""  # why they run without its namespaces (auto, the step before)
        self.hand_over = not is_cuda(device) if hand_over is None else hand_over
        self._active: _Process | None = None
        self._spares: list[_Process] = []
        self.restarts, self._seq = 0, 0
        self._after: dict[str, list[str]] = {}  # case id -> its outputs written after the call returned
        self._not_plain: set[str] = set()  # ops whose inputs cannot be handed over (`segment.hand_over`)
        _LIVE.add(self)

    def _spawn(self) -> _Process:
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            # The server imports every spec (and the kernels) once: a replacement after a crash then
            # forks in ~0.07 s, not ~0.8 s (measured, quantize n=64). Triton must run interpreted
            # there before it imports anything, as in every CPU process of the run.
            os.environ.setdefault("TRITON_INTERPRET", "1")
            ctx.set_forkserver_preload(self._preload)
        conn, child = ctx.Pipe()  # a socket pair: the segments' descriptors cross it too
        proc = ctx.Process(target=self._serve, args=(child, self.device, self.sandbox, os.getpid(), self.no_namespaces),
                           daemon=True)
        spawned = SPAWNED_ENV if self.start_method == "spawn" else {}
        with reaper.marked(), _environment(spawned):  # the worker (and its fork server) carries its tree's mark
            proc.start()
        child.close()
        # Liveness from the process itself: a pidfd is readable once it exited, whoever still holds
        # its pipe or its multiprocessing sentinel (a spawned worker's forked child inherits that).
        alive = os.pidfd_open(proc.pid) if hasattr(os, "pidfd_open") else None
        reader = wire.Reader(conn.fileno(), proc.sentinel if alive is None else alive)
        return _Process(proc, conn, reader, socket.socket(fileno=os.dup(conn.fileno())), alive)

    def _await_ready(self, p: _Process) -> None:
        """Wait for `p`'s "ready", which says what it stands behind (`boundary.Boundary`); a worker
        that cannot start behind the sandbox in auto mode is started again without its namespaces
        (the layers least proven under CUDA), then without the sandbox, and says why."""
        if p.ready:
            return
        kind, header = self._receive(p, None, STARTUP_TIMEOUT_S)
        if kind == Message.READY:
            try:
                p.fence = self.fence = boundary.Boundary.from_dict(header.get("sandbox"))
            except ValueError as exc:
                raise HarnessError(f"an isolation worker for {self.device} did not say what it stands behind: {exc}")
            p.ready = True
            said = header.get("pid")
            p.said_pid = said if type(said) is int and said > 0 else None
            if (refused := p.fence.refused()) is not None:
                raise UsageError(f"{refused} (this host; --sandbox auto runs with what holds)")
            return
        p.proc.join(1)  # its pipe closed as it died: reaped, it tells how it ended
        why = _exit_reason(p.proc.exitcode)
        for q in (p, *self._spares):
            q.proc.kill()
            q.proc.join(5)
            q.close()
        self._spares = []
        if self.sandbox == "auto":
            if self.no_namespaces or self.fence is not None:  # a worker has started behind these layers before
                self.sandbox, self.fell_back = "off", f"a worker could not start behind it ({why})"
            else:
                self.no_namespaces = f"left out: a worker behind them could not start ({why})"
            self._active = self._spawn()
            self._await_ready(self._active)
            return
        self._active = None
        raise HarnessError(f"an isolation worker for {self.device} did not start within {STARTUP_TIMEOUT_S:g} s ({why})")

    def _top_up(self) -> None:
        while len(self._spares) < SPARES[device_type(self.device)]:
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
                reaper.kill_below(p.proc.pid)
                p.proc.kill()
            p.proc.join(5)
            p.close()
        reap_all()
        self.restarts += 1
        self._top_up()

    def _pids(self) -> set[int]:
        return {p.proc.pid for p in (self._active, *self._spares) if p is not None}

    def _receive(self, p: _Process, seq: int | None, timeout_s: float) -> tuple[str, Any]:
        """(kind, header) of the worker's next message, answering request `seq`; (TIMEOUT, None),
        (DIED, None) when the worker process ended with nothing more to read (whoever else holds
        its pipe), or (UNREADABLE, why)."""
        state = p.reader.wait(timeout_s)
        if state is not None:
            return state, None
        try:
            header, _ = p.reader.read(time.monotonic() + timeout_s + READ_GRACE_S)
        except (EOFError, ConnectionResetError):
            return Message.DIED, None
        except wire.Unreadable as exc:
            return Message.UNREADABLE, str(exc)
        if header.get("seq") != seq:
            return Message.UNREADABLE, f"it answers request {str(header.get('seq'))[:20]}, not {seq}"
        try:
            if (after := wire.after_of(header)) is not None:
                self._after[after[0]] = after[1]
        except wire.Unreadable as exc:
            return Message.UNREADABLE, str(exc)
        return str(header.get("kind")), header

    def ask_after(self) -> tuple[str, str] | None:
        """The active worker's check of its last case for a write after return (`guards.Returned`),
        asked once the block was judged; None when it answered or is gone, else the (metric, reason)
        of the last case's failure (a worker still busy after its answer was sent is one whose
        answer was not its harness's)."""
        p = self._active
        if p is None or not p.ready or not p.proc.is_alive():
            return None
        self._seq += 1
        try:
            p.conn.send_bytes(json.dumps({"seq": self._seq, "after": True}).encode())
        except (BrokenPipeError, OSError):
            return None
        kind, header = self._receive(p, self._seq, self.timeout_s)
        if kind == Message.AFTER:
            return None
        self._kill_active()
        if kind == Message.TIMEOUT:
            return FailureKind.HUNG, f"hung: the worker was still busy {self.timeout_s:g} s after it answered"
        return (FailureKind.CRASHED, f"{UNREADABLE}: {header}") if kind == Message.UNREADABLE else None

    def written_after(self, case_id: str) -> list[str]:
        """The outputs of case `case_id` its worker found written after its call returned (told
        before its next case, or when asked: `ask_after`), once."""
        return self._after.pop(case_id, [])

    def hands_over(self, op: str) -> bool:
        """Whether the inputs of `op`'s cases go to the worker as its judge built them (`produce`)."""
        return self.hand_over and op not in self._not_plain

    def produce(self, case: Case, key: Key, context: RowContext, kwargs: dict | None = None,
                writes: Sequence[str] = ()) -> Produced | Unanswered:
        """What the worker produced for `case` with the implementation `key` (handed `kwargs`, its
        inputs as its judge built them, where given; `writes`: the arguments its op writes in
        place), or why there is no answer: it died, hung or sent something that is not one. Its
        findings are rows' records less their identity (`produced.FINDING_FIELDS`), an input
        handed over that the call wrote among them. Raises HarnessError for a failure of the
        harness itself."""
        p = self._ensure()
        if (why := self._load_in(p, key)) is not None:  # a fresh worker, whose import of it failed
            return Unanswered(FailureKind.CRASHED, f"the implementation could not be resolved in a fresh worker: {why}")
        self._seq += 1
        request = dict(seq=self._seq, case=case.to_dict(), specs=list(key[1]), deviations=list(key[2]),
                       conventions=list(key[3]), run_id=context.run_id, source=context.source)
        handed = self._segments(p, request, kwargs, case.op)
        if not self._send(p, request):
            self._retire()
            return Unanswered(FailureKind.CRASHED, "the worker process died between cases")
        kind, header = self._receive(p, self._seq, HARNESS_TIMEOUT_S)
        called = kind == Message.CALLING
        if called:
            kind, header = self._receive(p, self._seq, self.timeout_s)
            if kind == Message.TIMEOUT:
                self._kill_active()
                return Unanswered(FailureKind.HUNG, f"hung: no answer within {self.timeout_s:g} s")
        elif kind == Message.TIMEOUT:
            self._kill_active()
            raise HarnessError(f"building the inputs and reference of {case.short()} took over {HARNESS_TIMEOUT_S:g} s")
        if kind == Message.PRODUCED:
            try:
                written = [] if handed is None else segment.written(p.inputs, handed, writes)
                return self._answered(p, case, header, written)
            except wire.Unreadable as exc:
                kind, header = Message.UNREADABLE, str(exc)
        if kind == Message.ERROR and not called:  # the harness's side, before any of the implementation's code ran
            raise HarnessError(f"harness error in the worker on {case.short()}", _said(header, "detail"))
        if kind == Message.DIED:
            p.proc.join(5)
            self._retire()
            when = "" if called else " before the implementation was called"
            return Unanswered(FailureKind.CRASHED, f"the worker process died{when} ({_exit_reason(p.proc.exitcode)})")
        self._kill_active()
        if kind == Message.CRASHED and called:
            reason = _said(header, "reason")
        elif kind == Message.ERROR:
            reason = f"the worker reported an error after the implementation was called: {_last_line(header)}"
        else:
            why = header if kind == Message.UNREADABLE else f"a message of kind {kind[:40]!r} out of turn"
            reason = f"{UNREADABLE}: {why}"
        return Unanswered(FailureKind.CRASHED, reason)

    def start(self) -> boundary.Boundary:
        """Start a worker now (not at the first case) and say what it stands behind."""
        self._ensure()
        return self.fence

    def sandboxed(self) -> dict:
        """What the run records of its workers' sandbox (`Boundary.record`), and why the workers
        run without it where one could not start behind it (auto)."""
        fence = self.fence or boundary.Boundary(self.sandbox)
        return {**fence.record(), **({"fell_back": self.fell_back} if self.fell_back else {})}

    def summary(self) -> str:
        """The sandbox in one line, as a PASS line ends: "sandbox auto: ...; missing: ..."."""
        fence = self.fence or boundary.Boundary(self.sandbox)
        return fence.summary() + (f" ({self.fell_back})" if self.fell_back else "")

    def load(self, key: Key) -> str | None:
        """Have the worker import the implementation `key` (its import-time code, its signature
        and its declared deviations run there, behind the sandbox): None once it has, else why not,
        in one line (an import that did not finish within max(timeout, RESOLVE_FLOOR_S) among them)."""
        return self._load_in(self._ensure(), key)

    def _load_in(self, p: _Process, key: Key) -> str | None:
        """`load` in worker `p` (once per process; the worker is replaced where it fails)."""
        if key in p.resolved:
            return None
        op, specs, deviations, conventions = key
        self._seq += 1
        asked = {"op": op, "specs": list(specs), "deviations": list(deviations), "conventions": list(conventions)}
        if not self._send(p, {"seq": self._seq, "resolve": asked}):
            self._retire()
            return "the worker process died before it could import the implementation"
        limit = max(self.timeout_s, RESOLVE_FLOOR_S)
        kind, header = self._receive(p, self._seq, limit)
        if kind == Message.RESOLVED:
            p.resolved.add(key)
            return None
        what = f"--impl {' '.join(specs)}"
        if kind == Message.DIED:
            p.proc.join(5)
            self._retire()
            return f"{what}: the worker died while importing it ({_exit_reason(p.proc.exitcode)})"
        self._kill_active()
        if kind == Message.USAGE:
            return _said(header, "message")
        if kind == Message.TIMEOUT:
            return f"{what}: importing it in the worker did not finish within {limit:g} s"
        why = (_last_line(header) if kind == Message.ERROR
               else f"{UNREADABLE}: {header if kind == Message.UNREADABLE else kind}")
        return f"{what}: the worker failed while importing it: {why}"

    def _send(self, p: _Process, request: dict) -> bool:
        """`request` to worker `p`, then the descriptors of the segments it names for the first
        time; False where the worker is gone."""
        handing = [s for s in (p.reader.segment, p.inputs) if s is not None and s.serial in request.get("handles", ())]
        try:
            p.conn.send_bytes(json.dumps(request).encode())
            segment.send_handles(p.sock, handing)
        except (BrokenPipeError, OSError):
            return False
        p.handed.update(s.serial for s in handing)
        return True

    def _segments(self, p: _Process, request: dict, kwargs: dict | None, op: str) -> segment.Handed | None:
        """`request` given the worker's outputs segment (grown where the last answer's outputs came
        through the pipe, not fitting) and, where `kwargs` can be handed over, its inputs
        (`segment.hand_over`, described under "inputs"): what was handed, or None."""
        p.reader.segment = segment.grown(p.reader.segment, p.reader.piped, writable=False)
        if p.reader.segment is not None:
            request["outputs"] = p.reader.segment.describe()
        handed = None
        if kwargs is not None:
            p.inputs, handed = segment.hand_over(kwargs, p.inputs)
            if handed is not None:
                request["inputs"] = handed.described
            else:
                self._not_plain.add(op)
        # the segments this worker holds no descriptor of yet: `_send` hands them over
        request["handles"] = [s.serial for s in (p.reader.segment, handed and p.inputs)
                              if s is not None and s.serial not in p.handed]
        return handed

    def _answered(self, p: _Process, case: Case, header: dict, written: list[tuple[str, str]]) -> Produced:
        """The Produced of a "produced" message (`Produced.from_header`), with a finding for each
        input this process handed over that the call `written` (where the worker told none);
        Unreadable when it does not parse. What the call left running ends with its case."""
        if header.get("case_id") != case.case_id:
            raise wire.Unreadable(f"it answers case {str(header.get('case_id'))[:40]!r}, not {case.case_id!r}")
        produced = Produced.from_header(header, DEVIATIONS)
        if header.get("children") is True and p.proc.is_alive():
            reaper.kill_below(p.runner())  # what the call left running ends with its case
        if header.get("retire") is True:
            self._retire()
        told = {r["written"] for r in produced.rows if r["gate_metric"] == FailureKind.INPUT_WRITTEN}
        produced.rows += [dict(zip(FINDING_FIELDS, (f"input:{name}", FailureKind.INPUT_WRITTEN, why, name)))
                          for name, why in written if name not in told]
        return produced

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
                    p.conn.send_bytes(b"null")
                    p.proc.join(10)
            except (BrokenPipeError, OSError):
                pass
            if p.proc.is_alive():
                reaper.kill_below(p.proc.pid)
                p.proc.kill()
            p.proc.join(5)
            p.close()
        self._active, self._spares = None, []
        reap_all()
