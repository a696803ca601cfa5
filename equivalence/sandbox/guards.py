"""What the harness guards around every implementation call, so that what a kernel does to the
process cannot leak into the next case or into the verdict.

    ProcessState    torch's process-wide settings (default dtype and device, grad and anomaly
                    mode, deterministic-algorithm flags, TF32 and matmul precision, flush-denormal,
                    threads), the working directory and the standard streams (sys.stdin/stdout/
                    stderr and file descriptors 0-2): saved before the call, restored after it;
                    what changed is the case's contract failure.
    JudgeFunctions  the functions the oracle relies on (torch's, torch.Tensor's, numpy's, math's,
                    the builtins, and every function and class of the harness's own judging
                    modules): their identities before the call, checked and put back after it.
    sigint_watch    whether a SIGINT arrived during the call: a KeyboardInterrupt without one is
                    the kernel's own raise, not the user's Ctrl-C.
    owned           a copy of a call's output tensors, taken before the next call: a serving
                    kernel returns the same static buffer every call (CUDA-graph capture,
                    workspace managers), which the next call overwrites.
    foreign         why a returned tensor is not a plain dense torch.Tensor: a subclass (its
                    __torch_function__ can answer any comparison) or a sparse or mkldnn layout.

In-process, these stop a kernel that changes the process by accident or by design of its own
framework; a kernel set on fooling the judge can still reach anything in its process, which is why
an isolated run judges in the parent (`equivalence.sandbox.worker`).
"""

from __future__ import annotations

import builtins
import contextlib
import contextvars
import math
import operator
import os
import signal
import sys
import threading
import time
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch

# ----------------------------------------------------------------------------- process-wide state


def _flush_denormal() -> bool:
    """Whether float32 subnormals flush to zero (torch has a setter and no getter)."""
    return bool((torch.tensor(1e-40, dtype=torch.float32) * 1.0).item() == 0.0)


def fd_identity(fd: int) -> tuple[int, int] | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


# name -> (get, set): the settings a kernel (or the framework it brings) can change for everyone after it
_TORCH: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {
    "torch default dtype": (torch.get_default_dtype, torch.set_default_dtype),
    # back to none set rather than "cpu" set: a set default device is a mode every factory call goes through
    "torch default device": (lambda: str(torch.get_default_device()),
                             lambda d: torch.set_default_device(None if d == "cpu" else d)),
    "torch grad mode": (torch.is_grad_enabled, torch.set_grad_enabled),
    "torch anomaly detection": (torch.is_anomaly_enabled, torch.set_anomaly_enabled),
    "torch deterministic algorithms": (
        lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
        lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1])),
    "torch.backends.cudnn.deterministic": (lambda: torch.backends.cudnn.deterministic,
                                           lambda v: setattr(torch.backends.cudnn, "deterministic", v)),
    "torch.backends.cudnn.benchmark": (lambda: torch.backends.cudnn.benchmark,
                                       lambda v: setattr(torch.backends.cudnn, "benchmark", v)),
    "torch.backends.cudnn.allow_tf32": (lambda: torch.backends.cudnn.allow_tf32,
                                        lambda v: setattr(torch.backends.cudnn, "allow_tf32", v)),
    "torch.backends.cuda.matmul.allow_tf32": (lambda: torch.backends.cuda.matmul.allow_tf32,
                                              lambda v: setattr(torch.backends.cuda.matmul, "allow_tf32", v)),
    "torch float32 matmul precision": (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    "torch flush-denormal": (_flush_denormal, torch.set_flush_denormal),
    "torch threads": (torch.get_num_threads, torch.set_num_threads),
}
_STREAMS = ("stdin", "stdout", "stderr")


@dataclass
class ProcessState:
    """The process-wide state an implementation call must leave as it found it."""

    torch_settings: dict[str, Any]
    cwd: str | None
    streams: tuple[Any, ...]
    fds: dict[int, tuple[tuple[int, int] | None, int | None]]  # fd -> (identity, a duplicate to restore it from)

    @classmethod
    def now(cls) -> "ProcessState":
        try:
            cwd = os.getcwd()
        except OSError:  # a working directory removed under us: nothing to compare
            cwd = None
        fds = {}
        for fd in (0, 1, 2):
            ident = fd_identity(fd)
            fds[fd] = (ident, os.dup(fd) if ident is not None else None)
        return cls({name: get() for name, (get, _) in _TORCH.items()}, cwd,
                   tuple(getattr(sys, s) for s in _STREAMS), fds)

    def restore(self) -> list[str]:
        """Put everything back; one line per setting the call changed ("torch default dtype:
        torch.float32 -> torch.float64"). The state holds again afterwards: a block of calls
        takes it once (`Watch`)."""
        changed = []
        for name, (get, put) in _TORCH.items():
            before, after = self.torch_settings[name], get()
            if after != before:
                changed.append(f"{name}: {before} -> {after}")
                put(before)
        try:
            cwd = os.getcwd()
        except OSError:
            cwd = None
        if self.cwd is not None and cwd != self.cwd:
            changed.append(f"working directory: {self.cwd} -> {cwd}")
            os.chdir(self.cwd)
        for name, before in zip(_STREAMS, self.streams):
            if getattr(sys, name) is not before:
                changed.append(f"sys.{name} replaced")
                setattr(sys, name, before)
        for fd, (ident, dup) in self.fds.items():
            if dup is not None and fd_identity(fd) != ident:
                changed.append(f"file descriptor {fd} replaced or closed")
                os.dup2(dup, fd)
        return changed

    def close(self) -> None:
        """Release the duplicates kept to restore file descriptors from."""
        for _, dup in self.fds.values():
            if dup is not None:
                os.close(dup)
        self.fds = {}


# ----------------------------------------------------------------------------- the judge's functions

# Packages whose modules (and the classes they define) make the verdict: rebinding any of their
# names during a call could change it. The implementations (mla_verify.optimized) keep state of
# their own and are not among them.
JUDGE_PACKAGES = ("mla_verify.equivalence", "mla_verify.reference", "mla_verify.fuzz")
_LIBRARIES: tuple[tuple[str, Any], ...] = (
    ("torch", torch), ("torch.Tensor", torch.Tensor), ("torch.nn.functional", torch.nn.functional),
    ("torch.linalg", torch.linalg), ("torch.special", torch.special), ("numpy", np), ("math", math),
    ("builtins", builtins), ("operator", operator),
)
_MISSING = object()
# What Python itself caches on classes and modules while running (pickling a class caches its
# `__slotnames__`, a warning its module's registry): never a patch.
_CACHES = frozenset({"__slotnames__", "__warningregistry__"})
_namespaces: dict[int, list[tuple[str, Any, bool]]] = {}


def _judge_namespaces() -> list[tuple[str, Any, bool]]:
    """(name, namespace, is a class) of everything `JudgeFunctions` watches; recomputed when
    modules were imported since."""
    key = len(sys.modules)
    if key not in _namespaces:
        found = [(name, ns, isinstance(ns, type)) for name, ns in _LIBRARIES]
        for name, module in list(sys.modules.items()):
            if not isinstance(module, types.ModuleType) or not name.startswith(JUDGE_PACKAGES):
                continue
            found.append((name, module, False))
            found += [(f"{name}.{k}", v, True) for k, v in vars(module).items()
                      if isinstance(v, type) and v.__module__ == name]
        _namespaces.clear()
        _namespaces[key] = found
    return _namespaces[key]


@dataclass
class _Namespace:
    name: str
    ns: Any
    is_class: bool
    before: dict[str, Any]
    values: tuple          # before's values, in order
    last: Any              # before's last key (None: empty)

    @classmethod
    def of(cls, name: str, ns: Any, is_class: bool) -> "_Namespace":
        before = dict(vars(ns))
        return cls(name, ns, is_class, before, tuple(before.values()), next(reversed(before), None))

    def unchanged(self) -> bool:
        """The same names bound to the same objects, in C: the same length, last name and values
        object for object in order. A name deleted and another added moves the last name; deleted
        and re-added, it moves its value out of place (a per-name Python loop cost 0.65 ms a case
        over 6332 names on the H200 host; keys and values compared as two passes, 0.35)."""
        now = vars(self.ns)
        return (len(now) == len(self.before) and next(reversed(now), None) is self.last
                and all(map(operator.is_, now.values(), self.values)))


def namespaces(spaces: list[tuple[str, Any, bool]]) -> list[_Namespace]:
    """(name, namespace, watched as a class: attributes added are put back too) of each of
    `spaces`, saved now for `put_back`."""
    return [_Namespace.of(name, ns, is_class) for name, ns, is_class in spaces]


def put_back(saved: list[_Namespace]) -> list[str]:
    """Put back every name of `saved` rebound or deleted since (and every attribute added to a
    class, or to an object watched as one); the names, each namespace saved again."""
    patched = []
    for i, space in enumerate(saved):
        if space.unchanged():
            continue
        ns, now = space.ns, vars(space.ns)
        for k, v in space.before.items():
            if now.get(k, _MISSING) is not v and k not in _CACHES:
                patched.append(f"{space.name}.{k}")
                setattr(ns, k, v)
        if space.is_class:
            for k in [k for k in now if k not in space.before and k not in _CACHES]:
                patched.append(f"{space.name}.{k}")
                delattr(ns, k)
        saved[i] = _Namespace.of(space.name, ns, space.is_class)
    return patched


@dataclass
class JudgeFunctions:
    """The identities of every name in the judge's namespaces, before a call."""

    saved: list[_Namespace]
    modules: int = 0  # len(sys.modules) when the namespaces were listed

    @classmethod
    def now(cls) -> "JudgeFunctions":
        return cls([_Namespace.of(name, ns, is_class) for name, ns, is_class in _judge_namespaces()], len(sys.modules))

    def restore(self) -> list[str]:
        """Put back every name the call rebound or deleted (and, on a class, every attribute it
        added: `Tensor.__ne__` set on torch.Tensor shadows the C one); the names, e.g.
        ["torch.sub", "torch.Tensor.__ne__"]. A module gaining a name is an import, not a patch:
        it joins the names watched, so the saved identities hold for the next call of a block."""
        patched = put_back(self.saved)
        if len(sys.modules) != self.modules:  # a judge module imported since joins the names watched
            known = {saved.name for saved in self.saved}
            self.saved += [_Namespace.of(name, ns, is_class) for name, ns, is_class in _judge_namespaces()
                           if name not in known]
            self.modules = len(sys.modules)
        return patched


class Watch:
    """The process state and the judge's functions before a run of implementation calls (a fuzz
    block's, an isolation worker's), taken once: `restore` after each call puts back what the call
    changed, so what was taken holds again for the next call. With `judge_each_call=False` the
    judge's names are checked only when asked (`judge.restore()`: a block that judges after its
    last call checks them once there, 0.2-0.4 ms a call saved). A context manager: leaving it
    releases the saved file descriptors."""

    def __init__(self, judge_each_call: bool = True) -> None:
        self.state, self.judge = ProcessState.now(), JudgeFunctions.now()
        self.judge_each_call = judge_each_call
        self.threads_left: list[threading.Thread] = []  # of the last call (`running.call_implementation`)

    def restore(self) -> tuple[list[str], list[str]]:
        """(the process-wide state a call changed, the judge's names it patched), each put back."""
        return self.state.restore(), self.judge.restore() if self.judge_each_call else []

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.state.close()


_kept: contextvars.ContextVar[Watch | None] = contextvars.ContextVar("kept_watch", default=None)


@contextlib.contextmanager
def kept_watch() -> Iterator[Watch]:
    """One `Watch` for every implementation call made inside that is given none of its own (an
    isolation worker's cases: the process does nothing else between them that could change what
    it holds)."""
    with Watch() as watch:
        token = _kept.set(watch)
        try:
            yield watch
        finally:
            _kept.reset(token)


def kept() -> Watch | None:
    """The innermost `kept_watch`'s Watch, or None."""
    return _kept.get()


# ----------------------------------------------------------------------------- Ctrl-C


@contextlib.contextmanager
def sigint_watch() -> Iterator[list[int]]:
    """A list that holds an entry for every SIGINT received inside the block; the handler in
    place before (the run's `Interrupt`, Python's default) still runs for each."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum, frame):
        received.append(signum)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    try:
        yield received
    finally:
        if signal.getsignal(signal.SIGINT) is handler:  # an `Interrupt` that moved on keeps its choice
            signal.signal(signal.SIGINT, previous)


# ----------------------------------------------------------------------------- outputs


def foreign(name: str, t: torch.Tensor) -> str | None:
    """Why output `name` is not a plain dense torch.Tensor (one line), or None."""
    if type(t) is not torch.Tensor:
        return f"{name}: a {type(t).__name__}, a torch.Tensor subclass; the contract says a plain torch.Tensor"
    if t.layout != torch.strided:
        return f"{name}: layout {str(t.layout).removeprefix('torch.')}, the contract says a dense (strided) tensor"
    return None


def owned(result: Any) -> Any:
    """`result` with every tensor in it (tuples, lists, dicts) replaced by a copy of its own, the
    strides kept: what the caller holds survives the implementation's next call."""
    if isinstance(result, torch.Tensor):
        if result.layout != torch.strided or result.device.type == "meta":
            return result
        return result.clone(memory_format=torch.preserve_format)
    if isinstance(result, tuple) and not hasattr(result, "_fields"):
        return tuple(owned(x) for x in result)
    if isinstance(result, tuple):  # a namedtuple
        return type(result)(*(owned(x) for x in result))
    if isinstance(result, list):
        return [owned(x) for x in result]
    if isinstance(result, dict):
        return {k: owned(v) for k, v in result.items()}
    return result


THREAD_GRACE_S = 0.2  # what a call's left threads get to finish before its outputs are compared with the copies
AFTER_RETURN = ("the output changed after the call returned: a write after return, from a thread or an "
                "unsynchronized stream")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    if flat.stride(0) != 1:  # one element viewed with any stride (a decode adapter's [1, 1, 1] lse) is contiguous
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)


@dataclass
class Returned:
    """A call's outputs as it returned them and the copy of each taken at return (what is judged):
    every real caller reads the returned storage, so a write to it after the return (a thread the
    call left running, work on another stream) must show. `changed` compares the two, the devices
    synchronized: after the judge, or before the next call (which may write a static buffer again)."""

    tensors: dict[str, torch.Tensor]
    copies: dict[str, Any]

    @classmethod
    def of(cls, tensors: dict[str, Any], copies: dict[str, Any] | None = None) -> "Returned":
        """`tensors` as returned, with `copies` taken at return (None: `owned` copies them now)."""
        plain = {n: t for n, t in tensors.items()
                 if type(t) is torch.Tensor and t.layout == torch.strided and t.device.type != "meta"}
        return cls(plain, owned(tensors) if copies is None else copies)

    def changed(self, threads: list[threading.Thread] = ()) -> list[str]:
        """The outputs whose bytes differ from their copy at return; the `threads` the call left
        running are given up to THREAD_GRACE_S together to finish first."""
        deadline = time.monotonic() + THREAD_GRACE_S
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        for device in {t.device for t in self.tensors.values() if t.device.type == "cuda"}:
            torch.cuda.synchronize(device)
        return [name for name, t in self.tensors.items()
                if isinstance(c := self.copies.get(name), torch.Tensor) and c.shape == t.shape and c.dtype == t.dtype
                and not torch.equal(_bytes(t).to(c.device), _bytes(c))]


def threads_left(before: list[threading.Thread]) -> list[threading.Thread]:
    """The threads running now that did not before (a call left them)."""
    return [t for t in threading.enumerate() if t not in before and t.is_alive()]
