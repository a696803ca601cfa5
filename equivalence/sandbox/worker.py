"""Crash isolation: run cases in a worker process that is replaced when it dies, hangs or sees a
CUDA error.

A CUDA illegal address or device-side assert poisons the whole context, and a kernel can spin
forever; either way the campaign must record the case as failed and go on. The worker receives
(case, --impl specs, declared deviations), runs the implementation's side of it
(`equivalence.catalog.produce`: the call, the checks only that process can make) and sends back
its outputs on the host. The parent builds a block's inputs once (`catalog.prepare_inputs`): its
reference reads them, and on CPU each case's are handed to the worker through a shared segment
(`equivalence.sandbox.segment`; elsewhere, and for inputs that are not plain tensors, the worker builds
its own from the seed). The outputs come back through a segment too, the pipe carrying the
header. The parent judges them (`catalog.judge_produced`): it computes the reference and every
verdict where the implementation cannot reach them, neither the reference's tensors, the
judge's functions nor its own copy of the inputs, which it compares with what it handed over.

The worker is untrusted: it runs the user's code. What it sends is data (`equivalence.sandbox.wire`: a
JSON header and raw tensor bytes, parsed with size bounds, never unpickled), outputs and clock
readings and findings that can only fail its case, never a row or a verdict; a message that does
not parse or comes out of turn is the case's `crashed` finding. The parent waits on the worker's
process beside its pipe (a dead worker is a crash at once, whoever holds the pipe), the worker
watches its own channel after every call (`_Channel`), and what a call forked is killed when its
case ends (`equivalence.sandbox.reaper`). The returned storage is compared with the copy sent, before the
next call and after the block's judge (`guards.Returned`: a write after return).

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
import json
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import shutil
import signal
import socket
import time
import traceback
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..cases.case import Case
from ..errors import HarnessError, UsageError
from ..judge.policy import DEVIATIONS
from ..judge.rows import Row
from ..produced import Produced
from . import boundary, guards, reaper, segment, wire
from .call_guards import CALLED_WITH
from .calls import after_return_rows, failure_row, input_rows, noted, unsupported_row
from .device import WORKER_SHARE, device_type, first_line, is_cuda, is_device_error, take_gpu_share, usable

STARTUP_TIMEOUT_S = 300.0   # imports, CUDA context, warm-up: never counted against a case
# Spares kept warming once a worker has been replaced. A CUDA worker takes seconds to start (CUDA
# context, cuBLAS): shrinking a crash replaces one per failing step, so two start side by side.
SPARES = {"cpu": 1, "cuda": 2}
HARNESS_TIMEOUT_S = 1800.0  # a case's inputs (ours, not the implementation's)
RESOLVE_FLOOR_S = 30.0      # a module's import in the worker (a JIT build at import) may take this long at least
READ_GRACE_S = 60.0         # a message's bytes once its first arrived (outputs of gigabytes on a slow host)
UNREADABLE = "the worker sent an unreadable message"


def default_isolation(isolate: bool | None, named: bool, own_processes: bool = False) -> bool:
    """Whether a run's cases go to a worker (`Worker`), so that the judge runs where the kernel
    cannot reach it: by default whenever the implementation can be imported there by name
    ("MODULE:CALLABLE" or a registered name), on CPU as on CUDA (on CPU a case costs about 12%
    more and a worker starts from a preloaded forkserver: docs/concepts/isolation.md). A
    callable object cannot cross processes and runs in this one. An op whose ranks are processes
    of their own (dcp) already runs the kernel outside its judge. UsageError for isolate=True
    with an implementation that is not named."""
    if isolate and not named:
        from ..errors import UsageError

        raise UsageError("isolate=True needs an implementation importable by MODULE:CALLABLE (a module-level "
                         "function); a lambda, closure or partial runs in this process only")
    return (named if isolate is None else isolate) and not own_processes


def _warm_up(device: str) -> None:
    """The CUDA context and the libraries a first kernel call would otherwise initialize."""
    import torch

    if is_cuda(device):
        if ":" in device:
            torch.cuda.set_device(device)
        a = torch.ones(64, 64, device=device)
        (a @ a).sum().item()


def _serve(conn, device: str, sandbox: str = "off", judge: int = 0) -> None:
    # Ctrl-C, and the SIGTERM that `timeout` or a scheduler sends the whole process group, are the
    # parent's to handle: it finishes the case; the worker dying of one would read as a crash.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    # Behind the OS boundary first, while the process has one thread and has run nothing of the
    # user's: what the worker runs from here on (the CUDA context included) runs behind it.
    fence = boundary.enter(sandbox, device, {judge} - {0})
    reaper.become_subreaper()  # what a kernel forks stays below this process (`reaper`)
    if not is_cuda(device):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    take_gpu_share(WORKER_SHARE)  # the rest is its judge's
    _warm_up(device)
    channel = _Channel(conn)
    channel.send({"kind": "ready", "pid": os.getpid(), "sandbox": fence.to_dict()})  # before any user code
    with guards.kept_watch():  # taken once: each call puts back what it changed, for the next
        try:
            _answer_cases(channel, device)
        except (EOFError, ConnectionResetError):
            pass  # the judge let go of this worker (behind a PID namespace, it dies a moment later)


class _Channel:
    """The worker's end of its pipe to the parent, watched like the judge's names: after every
    call, the connection's attributes, its class's methods, the functions a message is written
    with, its file descriptor and the worker's subreaper flag must be the ones the harness set up
    (what changed is put back, and fails the case)."""

    def __init__(self, conn) -> None:
        self.conn, self.fd = conn, conn.fileno()
        self.handles = segment.Handles(self.fd)  # the segments' descriptors, as the parent sends them
        self.ident, self.dup = guards.fd_identity(self.fd), os.dup(self.fd)
        self.subreaper, self.names = reaper.is_subreaper(), []
        spaces = [("the worker's connection", conn, True), ("the worker's channel", self, True),
                  *((f"{c.__module__}.{c.__qualname__}", c, True) for c in type(conn).__mro__ if c is not object),
                  ("multiprocessing.connection", mpc, False), ("os", os, False), ("json", json, False),
                  ("json.encoder", json.encoder, False), ("mla_verify.equivalence.sandbox.wire", wire, False)]
        self.names.extend(guards.namespaces(spaces))

    def send(self, header: dict, tensors: list | None = None) -> None:
        wire.write(self.fd, wire.encode(header, tensors or []))

    def send_frames(self, frames: list) -> None:
        wire.write(self.fd, frames)

    def receive(self) -> dict | None:
        """The parent's next request, the descriptors of the segments it names first received."""
        request = json.loads(self.conn.recv_bytes())
        if request is not None:
            self.handles.receive(request.get("handles", []))
        return request

    def tampered(self) -> list[str]:
        """What a call changed of the channel, each put back."""
        changed = guards.put_back(self.names)
        if guards.fd_identity(self.fd) != self.ident:
            changed.append(f"file descriptor {self.fd} (the pipe to the judge)")
            os.dup2(self.dup, self.fd)
        if self.subreaper and not reaper.is_subreaper():
            changed.append("the worker's child-subreaper flag")
            reaper.become_subreaper()
        return changed


def _children_left() -> bool:
    """Whether this process has a child (zombies reaped): the worker is the subreaper of whatever
    a call forked, so anything still running is one."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True


def _answer_cases(channel: _Channel, device: str) -> None:
    """Produce each case the parent sends, until it sends None or a context cannot be trusted."""
    from ..catalog import produce, resolve_subject  # it imports the kernels: not before `_serve` set up Triton

    subjects, last, mapped = {}, None, {"inputs": None, "outputs": None}
    while True:
        request = channel.receive()
        # The last case's outputs as returned against the copies sent: before this request's call,
        # which may write a static buffer again (after the block's judge, for its last case).
        after = last and {"case_id": last[0], "changed": last[1].changed(last[2])}
        last = None
        if request is None:
            return
        seq = request["seq"]
        if request.get("after"):
            channel.send({"kind": "after", "seq": seq, "after": after})
            continue
        if "resolve" in request:
            channel.send(_resolved(seq, request["resolve"], subjects, device))
            continue
        case = Case.from_dict(request["case"])
        specs, deviations, conventions = request["specs"], request["deviations"], request["conventions"]
        called, given = [], request.get("inputs")
        mapped["outputs"] = segment.mapping(mapped["outputs"], request.get("outputs"), channel.handles)
        if given:  # kept between cases that hand nothing over: its descriptor came once
            mapped["inputs"] = segment.mapping(mapped["inputs"], given["segment"], channel.handles)

        def on_call() -> None:
            called.append(True)
            channel.send({"kind": "calling", "seq": seq, "after": after})

        try:
            key = (case.op, tuple(specs), tuple(deviations), tuple(conventions))
            if key not in subjects:
                subjects[key] = resolve_subject(case.op, specs, device_type(device), deviations=deviations,
                                                conventions=conventions)
            CALLED_WITH.clear()
            # the parent's inputs, not built here, where the segment could be mapped
            kwargs = given and mapped["inputs"] and segment.inputs_of(given, mapped["inputs"], device)
            produced = produce(case, subjects[key], device, run_id=request["run_id"], source=request["source"],
                               on_call=on_call, inputs=kwargs)
            del kwargs
        except Exception as exc:
            if called and (is_device_error(exc) or not usable(device)):
                # The context died while (or right after) the implementation ran: its crash.
                channel.send({"kind": "crashed", "seq": seq,
                              "reason": f"CUDA error after the implementation ran: {first_line(exc)}"})
                return
            channel.send({"kind": "error", "seq": seq, "detail": traceback.format_exc()})
            continue
        if tampered := channel.tampered():
            produced = Produced([dict(tensor="*", gate_metric="contract", reason=_tampering(tampered))], failed=True)
        retire = is_cuda(device) and (produced.device_error or not usable(device))
        called_with = {stage: sorted(keywords) for stage, keywords in CALLED_WITH.items()}  # for the parent's notes
        channel.send_frames(wire.produced_frames(seq, case.case_id, produced, retire, called_with, _children_left(),
                                                 after, into=mapped["outputs"]))
        if retire:
            return  # never trust a context that saw a CUDA error with another case
        if produced.returned is not None:
            last = (case.case_id, produced.returned, produced.threads)


def _resolved(seq: int, asked: dict, subjects: dict, device: str) -> dict:
    """The answer to a "resolve" request: the implementation imported here and checked (its
    signature, its declared deviations), or the usage error that stops it, in one line. This runs
    the user's import-time code: here, behind the boundary, never in the judge."""
    from ..catalog import resolve_subject  # it imports the kernels: not before `_serve` set up Triton

    key = (asked["op"], tuple(asked["specs"]), tuple(asked["deviations"]), tuple(asked["conventions"]))
    try:
        subjects[key] = resolve_subject(asked["op"], key[1], device_type(device), deviations=key[2],
                                        conventions=key[3])
    except UsageError as exc:
        return {"kind": "usage", "seq": seq, "message": str(exc)}
    except Exception:
        return {"kind": "error", "seq": seq, "detail": traceback.format_exc()}
    return {"kind": "resolved", "seq": seq}


def _beyond(answer: wire.Answer, allowed: frozenset[str]) -> str | None:
    """Why `answer` claims bounds the run did not resolve (a deviation of its own, or of one of its
    stage calls, outside `allowed`), else None."""
    claimed = {*answer.deviations, *(d for run in answer.stage_calls for call in run for d in call["deviations"])}
    if not (extra := sorted(claimed - allowed)):
        return None
    resolved = ", ".join(sorted(allowed)) or "none"
    return (f"the worker answered under deviation(s) {', '.join(extra)}, which the run did not resolve (resolved: "
            f"{resolved}; a user's callable declares them as a literal __mla_verify_deviations__ in its module's "
            "source, or with --deviation): never a looser bound")


def _key(op: str, specs: Sequence[str], deviations: Sequence[str], conventions: Sequence[str]) -> tuple:
    """An implementation as the worker resolves it: (op, specs, deviations, conventions)."""
    return op, tuple(specs), tuple(deviations), tuple(conventions)


def _writes(case: Case) -> tuple[str, ...]:
    """The arguments `case`'s op writes in place (their bytes are its checks, not a finding)."""
    from ..catalog import get_spec

    return getattr(get_spec(case.op), "writes", ())


def _tampering(changed: list[str]) -> str:
    return (f"tampered with the worker's channel to its judge: {', '.join(changed[:4])}{' ...' if changed[4:] else ''} "
            "(put back)")


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
    resolved: set = field(default_factory=set)   # the implementations it imported (`Worker._resolve_in`)
    fence: boundary.Boundary | None = None       # what it said it stands behind, before any user code

    def close_segments(self) -> None:
        for s in (self.inputs, self.reader.segment):
            if s is not None:
                s.close()
        self.inputs = self.reader.segment = None

    def runner(self) -> int:
        """The pid of the process that runs the cases: the worker's own, or behind a PID namespace
        the worker the stand-in we started waits for (pid 2 there: `boundary._pid_namespace`)."""
        if self.fence is None or "pid namespace" not in self.fence.held:
            return self.proc.pid
        return reaper.in_namespace(self.proc.pid, 2) or self.proc.pid

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

    def __init__(self, device: str, timeout_s: float = 300.0, hand_over: bool | None = None, sandbox: str = "auto"):
        """`hand_over`: whether the inputs this process builds go to the worker through a shared
        segment (else the worker builds them again). By default on CPU only: on CUDA the segment is
        host memory, a copy to the host and one back (the decode case B=64 H=128 holds ~350 MB of
        cache: tens of ms each way) against a build of 1.2-1.9 ms on the device, until device
        memory can be shared. `sandbox`: the OS boundary each worker puts itself behind
        (`boundary.MODES`); strict refuses a worker where a layer did not hold (UsageError). This
        process, the judge, is made not dumpable (`boundary.protect_judge`)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout_s}")
        if sandbox not in boundary.MODES:
            raise ValueError(f"sandbox mode {sandbox!r}: expected one of {', '.join(boundary.MODES)}")
        boundary.protect_judge()
        self.device, self.timeout_s, self.sandbox = device, timeout_s, sandbox
        self.fence: boundary.Boundary | None = None  # what the workers stand behind (the last one's words)
        self.fell_back = ""  # why the workers run without the sandbox (auto, where a worker could not start behind it)
        self._described: dict[tuple, Any] = {}  # implementation key -> the judge's Subject of it (never imported)
        self.hand_over = not is_cuda(device) if hand_over is None else hand_over
        self._active: _Process | None = None
        self._spares: list[_Process] = []
        self.restarts, self._seq = 0, 0
        self._after: dict[str, list[str]] = {}  # case id -> its outputs written after the call returned
        self._not_plain: set[str] = set()  # ops whose inputs cannot be handed over (`segment.hand_over`)
        _LIVE.add(self)

    def _spawn(self) -> _Process:
        if is_cuda(self.device):
            ctx = mp.get_context("spawn")
        else:
            # The server imports every spec (and the kernels) once: a replacement after a crash then
            # forks in ~0.07 s, not ~0.8 s (measured, quantize n=64). Triton must run interpreted
            # there before it imports anything, as in every CPU process of the run.
            os.environ.setdefault("TRITON_INTERPRET", "1")
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(["mla_verify.equivalence.sandbox.worker", "mla_verify.optimized",
                                        "mla_verify.equivalence.catalog"])
        conn, child = ctx.Pipe()  # a socket pair: the segments' descriptors cross it too
        proc = ctx.Process(target=_serve, args=(child, self.device, self.sandbox, os.getpid()), daemon=True)
        with reaper.marked():  # the worker (and the server it forks from) carries the mark of its tree
            proc.start()
        child.close()
        # Liveness from the process itself: a pidfd is readable once it exited, whoever still holds
        # its pipe or its multiprocessing sentinel (a spawned worker's forked child inherits that).
        alive = os.pidfd_open(proc.pid) if hasattr(os, "pidfd_open") else None
        reader = wire.Reader(conn.fileno(), proc.sentinel if alive is None else alive)
        return _Process(proc, conn, reader, socket.socket(fileno=os.dup(conn.fileno())), alive)

    def _await_ready(self, p: _Process) -> None:
        """Wait for `p`'s "ready", which says what it stands behind (`boundary.Boundary`); a worker
        that cannot start behind the sandbox in auto mode is started again without it, and says why."""
        if p.ready:
            return
        kind, header = self._receive(p, None, STARTUP_TIMEOUT_S)
        if kind == "ready":
            try:
                p.fence = self.fence = boundary.Boundary.from_dict(header.get("sandbox"))
            except ValueError as exc:
                raise HarnessError(f"an isolation worker for {self.device} did not say what it stands behind: {exc}")
            p.ready = True
            if (refused := p.fence.refused()) is not None:
                raise UsageError(f"{refused} (this host; --sandbox auto runs with what holds)")
            return
        why = _exit_reason(p.proc.exitcode)
        for q in (p, *self._spares):
            q.proc.kill()
            q.proc.join(5)
            q.close()
        self._spares = []
        if self.sandbox == "auto":
            self.sandbox, self.fell_back = "off", f"a worker could not start behind it ({why})"
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
        self.reap()
        self.restarts += 1
        self._top_up()

    def reap(self) -> int:
        """Kill what a worker of this process left running once it is gone (`reaper.kill_strays`);
        how many there were."""
        return reap_all()

    def _pids(self) -> set[int]:
        return {p.proc.pid for p in (self._active, *self._spares) if p is not None}

    def _receive(self, p: _Process, seq: int | None, timeout_s: float) -> tuple[str, Any]:
        """(kind, header) of the worker's next message, answering request `seq`; ("timeout", None),
        ("died", None) when the worker process ended with nothing more to read (whoever else holds
        its pipe), or ("unreadable", why)."""
        state = p.reader.wait(timeout_s)
        if state != "data":
            return state, None
        try:
            header, _ = p.reader.read(time.monotonic() + timeout_s + READ_GRACE_S)
        except (EOFError, ConnectionResetError):
            return "died", None
        except wire.Unreadable as exc:
            return "unreadable", str(exc)
        if header.get("seq") != seq:
            return "unreadable", f"it answers request {str(header.get('seq'))[:20]}, not {seq}"
        try:
            if (after := wire.after_of(header)) is not None:
                self._after[after[0]] = after[1]
        except wire.Unreadable as exc:
            return "unreadable", str(exc)
        return str(header.get("kind")), header

    def _ask_after(self) -> tuple[str, str] | None:
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
        if kind == "after":
            return None
        self._kill_active()
        if kind == "timeout":
            return "hung", f"hung: the worker was still busy {self.timeout_s:g} s after it answered"
        return ("crashed", f"{UNREADABLE}: {header}") if kind == "unreadable" else None

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
        from ..catalog import judge_produced_block, prepare_block, prepare_inputs  # they import the kernels: not before `_serve` set up Triton

        # Built once, here, before the worker starts the block: the reference reads them, and the
        # worker is handed them (`segment`). Inputs that cannot be (a Batch) are built on the
        # judge's thread while the worker builds its own, as before.
        hand = self.hand_over and cases[0].op not in self._not_plain
        inputs = prepare_inputs(cases, self.device) if hand else None
        handed = inputs.kwargs if inputs is not None else []
        with ThreadPoolExecutor(1, thread_name_prefix="judge-ahead") as ahead:
            # A thread starts with an empty context: the reference's memory_limit goes with it.
            prepared = ahead.submit(contextvars.copy_context().run, prepare_block, cases, self.device, inputs)
            found: list = []
            for i, case in enumerate(cases):
                if on_call is not None:
                    on_call()
                found.append(self._produce(case, specs, label, run_id, source, notes, deviations, conventions,
                                           handed[i] if i < len(handed) else None))
            if not any(isinstance(f, Produced) for f in found):
                return found
            produced = [f if isinstance(f, Produced) else Produced([r.to_record() for r in f], failed=True) for f in found]
            judged = judge_produced_block(cases, produced, label, self.device, run_id=run_id, source=source,
                                          prepared=prepared.result())
        if (failed := self._ask_after()) is not None:
            last = max(i for i, f in enumerate(found) if isinstance(f, Produced))
            judged[last].append(failure_row(self._base(cases[last], label, run_id, source), "*", *failed))
        for case, rows, p in zip(cases, judged, produced):
            if changed := self._after.pop(case.case_id, []):
                rows += after_return_rows(self._base(case, label, run_id, source), changed, time_impl_s=p.t_impl)
            noted(rows, p.threads)
        return [rows or [self._nothing_judged(case, label, run_id, source)] for case, rows in zip(cases, judged)]

    def _base(self, case: Case, label: str, run_id: str, source: str) -> dict:
        from ..catalog import get_spec

        return dict(run_id=run_id, case_id=case.case_id, impl=label, stages=(), device=self.device, seed=case.seed,
                    source=source, **get_spec(case.op).identity(case))

    def _nothing_judged(self, case: Case, label: str, run_id: str, source: str) -> Row:
        """A case the parent judged no tensor of: never a pass (what the worker sent names none)."""
        return failure_row(self._base(case, label, run_id, source), "*", "crashed",
                           f"{UNREADABLE}: it holds nothing to judge (no output, no finding)")

    def _produce(self, case: Case, specs: Sequence[str], label: str, run_id: str, source: str,
                 notes: set[str] | None, deviations: Sequence[str], conventions: Sequence[str],
                 kwargs: dict | None = None) -> Produced | list[Row]:
        """What the worker produced for `case` (handed `kwargs`, its inputs as built here, where
        given), or its single failure row when it died, hung or sent something that is not an answer."""
        p = self._ensure()
        base = self._base(case, label, run_id, source)
        key = _key(case.op, specs, deviations, conventions)
        if (why := self._resolve_in(p, key)) is not None:  # a fresh worker, whose import of it failed
            return [failure_row(base, "*", "crashed", f"the implementation could not be resolved in a fresh worker: {why}")]
        self._seq += 1
        request = dict(seq=self._seq, case=case.to_dict(), specs=list(specs), deviations=list(deviations),
                       conventions=list(conventions), run_id=run_id, source=source)
        handed = self._segments(p, request, kwargs, case.op)
        if not self._send(p, request):
            self._retire()
            return [failure_row(base, "*", "crashed", "the worker process died between cases")]
        kind, header = self._receive(p, self._seq, HARNESS_TIMEOUT_S)
        called = kind == "calling"
        if called:
            kind, header = self._receive(p, self._seq, self.timeout_s)
            if kind == "timeout":
                self._kill_active()
                return [failure_row(base, "*", "hung", f"hung: no answer within {self.timeout_s:g} s")]
        elif kind == "timeout":
            self._kill_active()
            raise HarnessError(f"building the inputs and reference of {case.short()} took over {HARNESS_TIMEOUT_S:g} s")
        if kind == "produced":
            try:
                written = [] if handed is None else segment.written(p.inputs, handed, _writes(case))
                return self._answered(p, case, header, base, notes, self._allowed(key), written)
            except wire.Unreadable as exc:
                kind, header = "unreadable", str(exc)
        if kind == "error" and not called:  # the harness's side, before any of the implementation's code ran
            raise HarnessError(f"harness error in the worker on {case.short()}", _said(header, "detail"))
        if kind == "died":
            p.proc.join(5)
            self._retire()
            when = "" if called else " before the implementation was called"
            return [failure_row(base, "*", "crashed", f"the worker process died{when} ({_exit_reason(p.proc.exitcode)})")]
        self._kill_active()
        if kind == "crashed" and called:
            reason = _said(header, "reason")
        elif kind == "error":
            reason = f"the worker reported an error after the implementation was called: {_last_line(header)}"
        else:
            why = header if kind == "unreadable" else f"a message of kind {kind[:40]!r} out of turn"
            reason = f"{UNREADABLE}: {why}"
        return [failure_row(base, "*", "crashed", reason)]

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

    def resolve(self, op: str, specs: Sequence[str], deviations: Sequence[str] = (),
                conventions: Sequence[str] = ()) -> Any:
        """The implementation `specs` names for `op`, resolved where it runs: imported in a worker
        (its import-time code, its signature and its declared deviations run there, behind the
        sandbox), and described here from its module's source (`catalog.resolve_subject(described=
        True)`: nothing of it runs in the judge). The judge's Subject; UsageError, in one line, where
        it cannot be resolved (the worker's reason, or an import that did not finish within
        max(timeout, RESOLVE_FLOOR_S)). Call it before the first case: the run then starts only
        with an implementation its worker could import."""
        key = _key(op, specs, deviations, conventions)
        subject = self._subject(key)
        if (why := self._resolve_in(self._ensure(), key)) is not None:
            raise UsageError(why)
        return subject

    def _subject(self, key: tuple) -> Any:
        """The judge's Subject of `key`, its user's callables described, never imported."""
        from ..catalog import resolve_subject

        if key not in self._described:
            op, specs, deviations, conventions = key
            self._described[key] = resolve_subject(op, specs, device_type(self.device), deviations=deviations,
                                                   conventions=conventions, described=True)
        return self._described[key]

    def _allowed(self, key: tuple) -> frozenset[str]:
        from ..catalog import allowed_deviations

        return allowed_deviations(self._subject(key), device_type(self.device))

    def _resolve_in(self, p: _Process, key: tuple) -> str | None:
        """Have worker `p` import the implementation of `key` (once per process); None once it has,
        else why not, in one line (the worker is then replaced)."""
        if key in p.resolved:
            return None
        self._subject(key)  # the judge's reading first: a bad --impl costs no worker time
        op, specs, deviations, conventions = key
        self._seq += 1
        asked = {"op": op, "specs": list(specs), "deviations": list(deviations), "conventions": list(conventions)}
        if not self._send(p, {"seq": self._seq, "resolve": asked}):
            self._retire()
            return "the worker process died before it could import the implementation"
        limit = max(self.timeout_s, RESOLVE_FLOOR_S)
        kind, header = self._receive(p, self._seq, limit)
        if kind == "resolved":
            p.resolved.add(key)
            return None
        what = f"--impl {' '.join(specs)}"
        if kind == "died":
            p.proc.join(5)
            self._retire()
            return f"{what}: the worker died while importing it ({_exit_reason(p.proc.exitcode)})"
        self._kill_active()
        if kind == "usage":
            return _said(header, "message")
        if kind == "timeout":
            return f"{what}: importing it in the worker did not finish within {limit:g} s"
        why = _last_line(header) if kind == "error" else f"{UNREADABLE}: {header if kind == 'unreadable' else kind}"
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

    def _answered(self, p: _Process, case: Case, header: dict, base: dict, notes: set[str] | None,
                  allowed: frozenset[str], written: list[tuple[str, str]] = ()) -> Produced:
        """The Produced of a "produced" message: its outputs and clock as sent, every row made here
        from what the worker found (each can only fail the case) and from the inputs this process
        handed over that the call `written`; Unreadable when it does not parse. An answer under a
        deviation the run did not resolve (`allowed`) is the case's contract failure: the bounds
        are the run's, never the worker's."""
        if header.get("case_id") != case.case_id:
            raise wire.Unreadable(f"it answers case {str(header.get('case_id'))[:40]!r}, not {case.case_id!r}")
        answer = wire.answer_of(header, DEVIATIONS)
        if notes is not None:
            notes.update(answer.notes)
        for stage, keywords in answer.called.items():  # what the stages were handed, as if called here
            CALLED_WITH[stage].update(keywords)
        if header.get("children") is True and p.proc.is_alive():
            reaper.kill_below(p.runner())  # what the call left running ends with its case
        if answer.retire:
            self._retire()
        base = {**base, "path": answer.path or base["path"], "stages": answer.stages}
        if (beyond := _beyond(answer, allowed)) is not None:
            return Produced([failure_row(base, "*", "contract", beyond).to_record()], failed=True, t_impl=answer.t_impl)
        timed = {"time_impl_s": answer.t_impl}  # an input's row, as `running.input_rows` makes it
        rows = [unsupported_row(base, reason) if metric == "unsupported" else
                failure_row(base, tensor, metric, reason,
                            **({**timed, "written": name} if metric == "input_written" else {}))
                for tensor, metric, reason, name in answer.findings]
        told = {name for _, metric, _, name in answer.findings if metric == "input_written"}
        rows += input_rows(base, [(name, why) for name, why in written if name not in told], **timed)
        failed = any(tensor == "*" or metric == "unsupported" for tensor, metric, *_ in answer.findings)
        from ..properties.base import Compared  # it imports the kernels: not before `_serve` set up Triton

        compared = [Compared(*c) for c in answer.compared]
        return Produced([r.to_record() for r in rows], failed=failed, tensors=answer.tensors, devices=answer.devices,
                        strides=answer.strides, problems=answer.problems, stages=answer.stages,
                        deviations=answer.deviations, path=answer.path, notes=answer.notes, t_impl=answer.t_impl,
                        compared=compared, threads=answer.threads, stage_calls=answer.stage_calls)

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
        self.reap()
