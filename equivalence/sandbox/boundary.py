"""The OS boundary an isolation worker puts itself behind before any of the user's code runs, so
that a kernel with arbitrary code execution in its worker can make its own case fail or crash, and
nothing else: not reach its judge's process, its descriptors, the run directory or the harness.

Layers, in the order they are set up (each needs the one before it only where said):

    session          setsid: no controlling terminal and a process group of its own, so kill(0)
                     and a terminal's input stay the worker's
    user namespace   unshare(CLONE_NEWUSER), its uid and gid mapped to themselves: it keeps its
                     files and loses every capability outside (root's included), so a judge that
                     is not dumpable (`protect_judge`) cannot be traced or opened through /proc.
                     The kernel refuses it to a process that runs threads (a spawned CUDA
                     worker's imports start some): such a worker forks first, before CUDA is
                     initialized, and goes on in the single-threaded child (`_alone`)
    pid namespace    (with the user namespace) the worker goes on as pid 2 of a PID and mount
                     namespace of its own, under an init (pid 1) that ends with it and takes every
                     process of the namespace along; its /proc shows that namespace only (the
                     judge is not in it); the process its judge started stays outside, waiting, and
                     ends as the worker ended (`_stand_in`)
    no_new_privs     nothing it executes gains privileges (setuid binaries); Landlock and seccomp
                     need it
    landlock         writes only beneath its scratch directory, the caches and device nodes it
                     needs; no ptrace, /proc/PID/mem or /proc/PID/fd of a process outside its
                     domain; signals and abstract unix sockets only within it (`sandbox.landlock`)
    seccomp          no ptrace, cross-process memory or descriptors, no signal to its judge or
                     to a group, no AF_UNIX socket, no io_uring (`sandbox.seccomp`)

`enter(mode, ...)` sets them up: "off" none, "auto" each the host allows, "strict" the same, and
`Boundary.refused` names what did not hold (the judge then refuses to run). Every layer says
whether it held and, where not, why: a host without Landlock or namespaces runs as before, and
says which layers are missing. Elsewhere than Linux nothing is set up.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import signal
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from . import landlock, seccomp
from .device import device_type, is_cuda

MODES = ("auto", "strict", "off")
LAYERS = ("session", "user namespace", "pid namespace", "no_new_privs", "landlock", "seccomp")
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNS = 0x10000000, 0x20000000, 0x00020000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REC, _MS_PRIVATE = 2, 4, 8, 0x4000, 0x40000
_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS, _PR_SET_DUMPABLE = 38, 4
SCRATCH_PREFIX = "mla-verify-worker-"
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/shm")
_CUDA_DEVICES = ("/dev/nvidia*", "/dev/nvidia-caps")


@dataclass(frozen=True)
class Layer:
    name: str
    held: bool
    detail: str  # what it holds, or why it is missing

    def __str__(self) -> str:
        return self.name if self.held else f"{self.name} ({self.detail})"


@dataclass(frozen=True)
class Boundary:
    """What a worker was put behind: its mode and each layer tried (none with "off")."""

    mode: str
    layers: tuple[Layer, ...] = ()
    scratch: str | None = None  # the worker's private writable directory

    @property
    def held(self) -> list[str]:
        return [layer.name for layer in self.layers if layer.held]

    @property
    def missing(self) -> list[Layer]:
        return [layer for layer in self.layers if not layer.held]

    def refused(self) -> str | None:
        """Why a strict run may not go on (a layer missing), else None."""
        if self.mode != "strict" or not self.missing:
            return None
        return "--sandbox strict: " + "; ".join(f"{layer.name}: {layer.detail}" for layer in self.missing)

    def summary(self) -> str:
        """One line: "sandbox auto: session, ..., seccomp; missing: landlock (why)"."""
        if self.mode == "off":
            return "sandbox off"
        missing = "; missing: " + ", ".join(map(str, self.missing)) if self.missing else ""
        return f"sandbox {self.mode}: {', '.join(self.held) or 'no layer held'}{missing}"

    def record(self) -> dict:
        """What meta.json keeps: the mode, the layers that held, and why each other did not."""
        return {"mode": self.mode, "held": self.held, "missing": {x.name: x.detail for x in self.missing}}

    def to_dict(self) -> dict:
        return {"mode": self.mode, "layers": [[x.name, x.held, x.detail] for x in self.layers],
                "scratch": self.scratch}

    @classmethod
    def from_dict(cls, d: dict) -> "Boundary":
        """The judge's reading of a worker's words (sent before any user code ran), checked as data:
        ValueError for anything out of place."""
        if not isinstance(d, dict) or d.get("mode") not in MODES or not isinstance(d.get("layers"), list):
            raise ValueError("not a sandbox description")
        layers = []
        for item in d["layers"][:len(LAYERS)]:
            if (not isinstance(item, list) or len(item) != 3 or item[0] not in LAYERS or not isinstance(item[1], bool)
                    or not isinstance(item[2], str)):
                raise ValueError("not a sandbox layer")
            layers.append(Layer(item[0], item[1], item[2][:300]))
        scratch = d.get("scratch")
        if scratch is not None and not (isinstance(scratch, str) and _is_scratch(scratch)):
            raise ValueError("not a scratch directory of a worker")
        return cls(d["mode"], tuple(layers), scratch)


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _checked(result: int) -> None:
    if result != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def _session() -> str:
    os.setsid()
    return "its own session and process group, no controlling terminal"


def _user_namespace(device: str) -> str:
    uid, gid = os.getuid(), os.getgid()
    alone = _alone(device)
    _checked(_libc().unshare(_CLONE_NEWUSER))
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    return f"uid {uid} and gid {gid} mapped to themselves, no capability outside{alone}"


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _may_fork(device: str) -> None:
    """OSError where a worker for `device` may not fork: CUDA must start in its final process only,
    and a forked child cannot use a CUDA context or driver its parent initialized (its first CUDA
    call fails). The driver counts once its library is mapped: torch maps it only to use it (a
    device count through the CUDA runtime; `worker.SPAWNED_ENV` has a spawned worker's imports
    count through NVML instead)."""
    if not is_cuda(device):
        return
    if torch.cuda.is_initialized():
        raise OSError("torch initialized CUDA in this process before its boundary, and a forked child could not use it")
    with open("/proc/self/maps") as f:
        if any(line.rstrip().rpartition("/")[2].startswith("libcuda.so") for line in f):
            raise OSError("the CUDA driver (libcuda.so) was loaded in this process before its boundary, and a forked "
                          "child could not use it")


def _alone(device: str) -> str:
    """Go on single-threaded, as a user namespace needs: where this process runs threads (a spawned
    worker's imports, torch's among them, start some), fork; the child, which has one thread,
    returns as the worker; this process stays outside as its stand-in and never returns
    (`_stand_in_for`). What the returned detail adds, "" where nothing was forked."""
    threads = _threads()
    if threads == 1:
        return ""
    try:
        _may_fork(device)
    except OSError as exc:
        raise OSError(f"the worker already runs threads and cannot fork to shed them: {exc}") from None
    parent = os.getpid()
    if (child := os.fork()) != 0:
        _stand_in_for(child)
    _die_with(parent)
    return f" (in a child forked for it: the process its judge started ran {threads} threads, and stands in)"


def _die_with(parent: int) -> None:
    """SIGKILL this process once `parent` (its stand-in) dies, as the judge kills a worker: what is
    behind the stand-in then ends too. Exits at once where the parent died before the call."""
    if _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0 or os.getppid() != parent:
        os._exit(70)


def _stand_in_for(child: int) -> None:
    """The process the judge started, outside, once its single-threaded child goes on as the
    worker: it waits for the child, then ends the same way (`_end_as`). It never returns."""
    try:
        _, status = os.waitpid(child, 0)
        _end_as(os.waitstatus_to_exitcode(status))
    finally:
        os._exit(70)


def _pid_namespace(device: str) -> str:
    """A PID and mount namespace, entered by forking twice: the caller's process stays outside as
    the worker's stand-in and never returns from here; the first child is the namespace's init;
    the second returns, as the worker (pid 2), with a /proc of the namespace mounted."""
    _may_fork(device)
    libc = _libc()
    _checked(libc.unshare(_CLONE_NEWPID | _CLONE_NEWNS))
    status_r, status_w = os.pipe()
    if (init := os.fork()) != 0:
        _stand_in(init, status_r, status_w)
    try:  # pid 1 from here: whatever fails ends it, and the stand-in with it (the worker did not start)
        os.close(status_r)
        _checked(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0))  # the stand-in killed: all go
        proc = "and /proc of its own"
        if libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0 or \
                libc.mount(b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None) != 0:
            proc = f"but the host's /proc (a new one may not be mounted here: {os.strerror(ctypes.get_errno())})"
        if (worker := os.fork()) != 0:
            _init(worker, status_w)
    except BaseException:
        os._exit(70)
    os.close(status_w)
    return f"pid {os.getpid()} under its own init, {proc}"


def _stand_in(init: int, status_r: int, status_w: int) -> None:
    """The process the judge started: it waits for the namespace's init to report how the worker
    ended, then ends the same way (an exit code, or the same signal), so the judge sees the worker.
    It never returns: it must not go on as a second worker."""
    try:
        os.close(status_w)
        data = os.read(status_r, 16)
        os.waitpid(init, 0)
        _end_as(int(data) if data else -signal.SIGKILL)
    finally:
        os._exit(70)


def _init(worker: int, status_w: int) -> None:
    """Pid 1 of the namespace: reap whatever ends in it; once the worker ends, tell the stand-in
    how and exit (the kernel then kills every process left in the namespace)."""
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == worker:
            os.write(status_w, str(os.waitstatus_to_exitcode(status)).encode())
            os._exit(0)


def _end_as(code: int) -> None:
    """Exit with `code`, or die of signal -code as the worker did (SIGKILL and SIGSTOP cannot be
    caught, so they need no handler put back)."""
    if code < 0:
        with contextlib.suppress(OSError, ValueError):
            signal.signal(-code, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [-code])
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 128 - code)


def _no_new_privs() -> str:
    _checked(_libc().prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))
    return "set"


def _attempt(name: str, setup: Callable[[], str]) -> Layer:
    try:
        return Layer(name, True, setup())
    except (OSError, ValueError, AttributeError) as exc:
        return Layer(name, False, str(exc) or type(exc).__name__)


def writable_paths(device: str, scratch: str) -> list[str]:
    """Where a worker for `device` may write: its scratch directory, the harmless device nodes and
    shared memory, on CUDA the GPU's device nodes, and the compilers' caches (Triton's, CUDA's,
    torch's extensions: a fresh worker would otherwise compile every kernel again), made first."""
    home = os.path.expanduser("~")
    caches = [os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.environ.get("TRITON_HOME") or home, ".triton"),
              os.environ.get("CUDA_CACHE_PATH") or os.path.join(home, ".nv"),
              os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(home, ".cache", "torch_extensions")]
    for cache in caches:
        try:
            os.makedirs(cache, exist_ok=True)
        except OSError:
            pass
    devices = [*_DEVICES, *(p for pattern in _CUDA_DEVICES for p in sorted(glob.glob(pattern)))] \
        if device_type(device) == "cuda" else list(_DEVICES)
    return [scratch, *devices, *caches]


def _is_scratch(path: str) -> bool:
    parent, name = os.path.split(os.path.normpath(path))
    return os.path.isabs(path) and name.startswith(SCRATCH_PREFIX) and parent == os.path.normpath(tempfile.gettempdir())


def scratch_dir() -> str:
    """A private directory for the worker's temporary files (TMPDIR points there from now on), named
    for this process (`scratch_dirs` finds it again, whatever became of the worker)."""
    path = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-")
    os.environ["TMPDIR"] = tempfile.tempdir = path
    return path


def scratch_dirs(pid: int) -> list[str]:
    """The scratch directories process `pid` made as it entered its boundary (none where it never
    got that far), for its judge to remove once the worker is gone."""
    return glob.glob(os.path.join(glob.escape(tempfile.gettempdir()), f"{SCRATCH_PREFIX}{pid}-*"))


def enter(mode: str, device: str, protected: Iterable[int], no_namespaces: str = "") -> Boundary:
    """Put this process behind the layers `mode` asks for; `protected`: the pids no signal of its
    may reach (its judge, its parent); `no_namespaces`: why the user and pid namespaces are left
    out ("": they are tried). Call it before any user code runs and, for a CUDA worker, before
    CUDA starts (a process that runs threads forks for the namespaces: `_alone`); the layers hold
    for everything it starts."""
    if mode not in MODES:
        raise ValueError(f"sandbox mode {mode!r}: expected one of {', '.join(MODES)}")
    if mode == "off":
        return Boundary("off")
    if not sys.platform.startswith("linux"):
        return Boundary(mode, tuple(Layer(name, False, f"not Linux ({sys.platform})") for name in LAYERS))
    scratch = scratch_dir()
    pids = {*protected, os.getppid()}  # as the judge's namespace numbers them (none is in a new one)
    layers = [_attempt("session", _session),
              Layer("user namespace", False, no_namespaces) if no_namespaces
              else _attempt("user namespace", lambda: _user_namespace(device))]
    layers.append(_attempt("pid namespace", lambda: _pid_namespace(device)) if layers[1].held
                  else Layer("pid namespace", False, no_namespaces or "needs the user namespace"))
    layers.append(nnp := _attempt("no_new_privs", _no_new_privs))
    pids |= set() if layers[0].held else {0}  # kill(0): the judge's group
    for name, setup in (("landlock", lambda: landlock.restrict(writable_paths(device, scratch))),
                        ("seccomp", lambda: seccomp.deny(pids))):
        layers.append(_attempt(name, setup) if nnp.held else Layer(name, False, "needs no_new_privs"))
    return Boundary(mode, tuple(layers), scratch)


def protect_judge() -> bool:
    """Make this process (the judge) not dumpable: /proc/PID/mem, /proc/PID/fd and ptrace then need
    CAP_SYS_PTRACE over it, which a worker in its own user namespace has not. Whether it holds."""
    return sys.platform.startswith("linux") and _libc().prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) == 0
