"""Nothing a kernel starts outlives its case: the processes an isolation worker's code forked
(a double fork and `setsid` included) are found and killed when the case ends.

Linux keeps an orphan with its nearest "child subreaper" ancestor (prctl PR_SET_CHILD_SUBREAPER)
instead of handing it to init. A worker is one before any user code runs, so while it lives every
process its code started stays below it, and its parent kills them when the case ends. Every worker
process, and so every process forked from it, also carries MARK (the parent's pid) in the
environment it started with (/proc/PID/environ, fixed at exec), which is how the parent finds what
a dead worker left wherever it went. The parent is no subreaper itself: it would inherit, and
never wait for, the orphans of every other process below it (a pytest session's, a CI runner's).
Code that execs itself with another environment escapes, as anything that leaves the process tree
does; the limit is an OS boundary (docs/concepts/isolation.md). Elsewhere than Linux nothing of
this applies and nothing is done.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from typing import Iterator

PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37
MARK = "MLA_VERIFY_WORKER_TREE"
_LINUX = sys.platform.startswith("linux")


def _prctl(option: int, arg: int | ctypes.c_int | ctypes.Array) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(option, arg, 0, 0, 0)


def become_subreaper() -> bool:
    """Make this process the child subreaper of its descendants; whether it is one now."""
    return _LINUX and _prctl(PR_SET_CHILD_SUBREAPER, 1) == 0


def is_subreaper() -> bool:
    if not _LINUX:
        return False
    flag = ctypes.c_int(0)
    return _prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag)) == 0 and flag.value != 0


@contextlib.contextmanager
def marked() -> Iterator[None]:
    """MARK set in this process's environment while a worker (or the server it forks from) starts."""
    before = os.environ.get(MARK)
    os.environ[MARK] = str(os.getpid())
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(MARK, None)
        else:
            os.environ[MARK] = before


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process visible in /proc."""
    found = {}
    for name in os.listdir("/proc") if _LINUX else ():
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # the command name (field 2) is in parentheses and may hold spaces: fields resume after its ')'
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1:
            found[int(name)] = int(fields[1])
    return found


def descendants(pid: int, parents: dict[int, int] | None = None) -> list[int]:
    """Every living process below `pid`, nearest first."""
    parents = _parents() if parents is None else parents
    children: dict[int, list[int]] = {}
    for child, parent in parents.items():
        children.setdefault(parent, []).append(child)
    found, queue = [], list(children.get(pid, ()))
    while queue:
        p = queue.pop(0)
        found.append(p)
        queue += children.get(p, ())
    return found


def _marked(pid: int) -> bool:
    """Whether process `pid` started with this process's MARK (another user's cannot be read)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{MARK}={os.getpid()}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def in_namespace(root: int, ns_pid: int) -> int | None:
    """The pid, as this process numbers it, of the process below `root` that its own PID namespace
    numbers `ns_pid` (the last of /proc/PID/status's NSpid: the same pid where it has no namespace
    of its own), or None."""
    for pid in descendants(root):
        try:
            with open(f"/proc/{pid}/status") as f:
                nspid = next((line.split()[1:] for line in f if line.startswith("NSpid:")), [])
        except OSError:
            continue
        if nspid and nspid[-1] == str(ns_pid):
            return pid
    return None


def kill_below(pid: int) -> int:
    """SIGKILL every process below `pid` (it stays); how many there were."""
    found = descendants(pid)
    for p in found:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)
    return len(found)


def kill_strays(keep: set[int]) -> int:
    """SIGKILL every process that came from a worker of this one (MARK, with this process's pid)
    and is neither in `keep` (the live workers and the server they fork from) nor below one of
    them (a live worker's processes are its case's to end); how many there were."""
    if not _LINUX:
        return 0
    parents = _parents()
    stray = [p for p in parents if p not in keep and not _kept_above(p, keep, parents) and _marked(p)]
    for p in stray:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)
    return len(stray)


def _kept_above(pid: int, keep: set[int], parents: dict[int, int]) -> bool:
    """Whether a process of `keep` is above `pid` (a worker's own children are its case's to end)."""
    p = parents.get(pid)
    while p is not None and p > 1:
        if p in keep:
            return True
        p = parents.get(p)
    return False
