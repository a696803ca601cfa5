"""The isolation worker's own side: the process `sandbox.worker.Worker` starts (`serve`), behind
the OS boundary, answering its judge's requests one at a time.

A request names an implementation to import ("resolve": its import-time code runs here, never
in the judge) or a case to produce (`catalog.produce`: the call, the checks only this process
can make); the answer is data (`sandbox.produced.Produced.to_header`, framed by `sandbox.wire`),
never a row or a verdict. After every call the worker's channel to its judge is checked and put
back (`_Channel`); a process whose CUDA context saw an error answers and exits.
"""

from __future__ import annotations

import gc
import json
import multiprocessing.connection as mpc
import os
import signal
import traceback
from typing import Callable

import torch

from .cases.case import Case
from .cases.values import release_pools
from .errors import UsageError
from .judge.rows import RowContext
from .sandbox import boundary, guards, produced as produced_, reaper, segment, wire
from .sandbox.call_guards import CALLED_WITH
from .sandbox.device import WORKER_SHARE, context_lost, device_type, is_cuda, take_gpu_share, usable
from .sandbox.produced import Produced
from .sandbox.wire import Message

# What a CPU worker's fork server imports once, beside this module: a replacement after a crash
# then forks with every spec and kernel loaded (`sandbox.worker.Worker`).
PRELOAD = ("mla_verify.optimized", "mla_verify.equivalence.catalog")


def _warm_up(device: str) -> None:
    """The CUDA context and the libraries a first kernel call would otherwise initialize."""
    import torch

    if is_cuda(device):
        if ":" in device:
            torch.cuda.set_device(device)
        a = torch.ones(64, 64, device=device)
        (a @ a).sum().item()


def serve(conn, device: str, sandbox: str = "off", judge: int = 0, no_namespaces: str = "") -> None:
    """The worker process: behind `sandbox` (`boundary.MODES`; without the namespaces where
    `no_namespaces` says why) for `device`, its judge the process `judge` (the one pid it may
    signal), answering on `conn` until told to stop."""
    # Ctrl-C, and the SIGTERM that `timeout` or a scheduler sends the whole process group, are the
    # parent's to handle: it finishes the case; the worker dying of one would read as a crash.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    # Behind the OS boundary first, before CUDA starts and before anything of the user's runs: what
    # the worker runs from here on (the CUDA context included) runs behind it. A spawned worker
    # runs threads by now (its imports'): it goes on in a single-threaded child (`boundary._alone`).
    fence = boundary.enter(sandbox, device, {judge} - {0}, no_namespaces)
    reaper.become_subreaper()  # what a kernel forks stays below this process (`reaper`)
    if not is_cuda(device):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    take_gpu_share(WORKER_SHARE)  # the rest is its judge's
    _warm_up(device)
    channel = _Channel(conn)
    channel.send({"kind": Message.READY, "pid": os.getpid(), "sandbox": fence.to_dict()})  # before any user code
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
                  ("json.encoder", json.encoder, False), ("mla_verify.equivalence.sandbox.wire", wire, False),
                  ("mla_verify.equivalence.sandbox.produced", produced_, False),
                  ("mla_verify.equivalence.sandbox.produced.Produced", Produced, True)]
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
    from .catalog import produce, resolve_subject  # it imports the kernels: not before `serve` set up Triton

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
            channel.send({"kind": Message.AFTER, "seq": seq, "after": after})
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
            channel.send({"kind": Message.CALLING, "seq": seq, "after": after})

        def attempt() -> Produced:
            key = (case.op, tuple(specs), tuple(deviations), tuple(conventions))
            if key not in subjects:
                subjects[key] = resolve_subject(case.op, specs, device_type(device), deviations=deviations,
                                                conventions=conventions)
            CALLED_WITH.clear()
            # the parent's inputs, not built here, where the segment could be mapped
            kwargs = given and mapped["inputs"] and segment.inputs_of(given, mapped["inputs"], device)
            context = RowContext(request["run_id"], request["source"], subjects[key].label, device, on_call=on_call)
            return produce(case, subjects[key], context, kwargs)

        try:
            produced = _with_room(attempt, called)
        except Exception as exc:
            if called and (lost := context_lost(exc, device)):  # the implementation's crash, not ours
                channel.send({"kind": Message.CRASHED, "seq": seq, "reason": lost})
                return
            channel.send({"kind": Message.ERROR, "seq": seq, "detail": traceback.format_exc()})
            continue
        if tampered := channel.tampered():
            produced = Produced([dict(tensor="*", gate_metric="contract", reason=_tampering(tampered))], failed=True)
        retire = is_cuda(device) and (produced.device_error or not usable(device))
        produced.called = {stage: sorted(keywords) for stage, keywords in CALLED_WITH.items()}  # for the judge's notes
        header, tensors = produced.to_header()
        header = dict(kind=Message.PRODUCED, seq=seq, case_id=case.case_id, retire=retire, children=_children_left(),
                      after=after, **header)
        channel.send_frames(wire.encode(header, tensors, mapped["outputs"]))
        if retire:
            return  # never trust a context that saw a CUDA error with another case
        if produced.returned is not None:
            last = (case.case_id, produced.returned, produced.threads)


def _with_room(attempt: Callable[[], Produced], called: list) -> Produced:
    """attempt(), once more after the input pools and the allocator's cache are given back where the
    harness's side of it (building the case's inputs) ran out of device memory before the
    implementation was called: other parts on the card peaked with it."""
    try:
        return attempt()
    except torch.OutOfMemoryError:
        if called:
            raise
    release_pools()
    gc.collect()
    torch.cuda.empty_cache()
    return attempt()


def _resolved(seq: int, asked: dict, subjects: dict, device: str) -> dict:
    """The answer to a "resolve" request: the implementation imported here and checked (its
    signature, its declared deviations), or the usage error that stops it, in one line. This runs
    the user's import-time code: here, behind the boundary, never in the judge."""
    from .catalog import resolve_subject  # it imports the kernels: not before `serve` set up Triton

    key = (asked["op"], tuple(asked["specs"]), tuple(asked["deviations"]), tuple(asked["conventions"]))
    try:
        subjects[key] = resolve_subject(asked["op"], key[1], device_type(device), deviations=key[2],
                                        conventions=key[3])
    except UsageError as exc:
        return {"kind": Message.USAGE, "seq": seq, "message": str(exc)}
    except Exception:
        return {"kind": Message.ERROR, "seq": seq, "detail": traceback.format_exc()}
    return {"kind": Message.RESOLVED, "seq": seq}


def _tampering(changed: list[str]) -> str:
    return (f"tampered with the worker's channel to its judge: {', '.join(changed[:4])}{' ...' if changed[4:] else ''} "
            "(put back)")
