"""A seccomp filter (Linux, unprivileged once no_new_privs is set) that refuses the system calls
through which a process reaches another one: tracing it, reading or writing its memory, taking
its descriptors, signalling it; and the ways around the filter and around Landlock that a
filter can see. `deny(protected)` installs it, for every thread of this process and everything
it starts; what it cannot stop is said in docs/concepts/isolation.md.

Refused (EPERM), whatever the arguments: ptrace, process_vm_readv/writev, process_madvise,
pidfd_getfd, pidfd_send_signal (a /proc/PID directory is a pidfd too), kcmp, open_by_handle_at,
io_uring_setup (io_uring runs operations no filter sees). Refused by argument: kill, tkill, tgkill,
rt_sigqueueinfo, rt_tgsigqueueinfo and pidfd_open naming a `protected` pid or a negative one (a
process group other than its own, or -1: every process it may signal); socket(AF_UNIX) (a named
socket can be connected to whatever its path, the fork server's among them); the terminal ioctls
that type into a terminal (TIOCSTI, TIOCLINUX). System calls of another ABI (i386 on x86_64, x32)
are all refused. The program is classic BPF over `struct seccomp_data`, built here.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
from typing import Iterable

_SET_MODE_FILTER, _FILTER_FLAG_TSYNC = 1, 1
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_LD_W_ABS, _JEQ_K, _JSET_K, _JGE_K, _RET_K = 0x20, 0x15, 0x45, 0x35, 0x06
_NR, _ARCH, _ARG0, _ARG1 = 0, 4, 16, 24   # offsets in seccomp_data (little-endian: an argument's low half)
AF_UNIX, TIOCSTI, TIOCLINUX = 1, 0x5412, 0x541C
_X32 = 0x40000000

# machine -> (AUDIT_ARCH_*, the seccomp syscall, {name: number})
_TABLES = {
    "x86_64": (0xC000003E, 317, dict(
        ptrace=101, process_vm_readv=310, process_vm_writev=311, process_madvise=440, pidfd_getfd=438,
        pidfd_send_signal=424, kcmp=312, open_by_handle_at=304, io_uring_setup=425, kill=62, tkill=200, tgkill=234,
        rt_sigqueueinfo=129, rt_tgsigqueueinfo=297, pidfd_open=434, socket=41, ioctl=16)),
    "aarch64": (0xC00000B7, 277, dict(
        ptrace=117, process_vm_readv=270, process_vm_writev=271, process_madvise=440, pidfd_getfd=438,
        pidfd_send_signal=424, kcmp=272, open_by_handle_at=265, io_uring_setup=425, kill=129, tkill=130, tgkill=131,
        rt_sigqueueinfo=138, rt_tgsigqueueinfo=240, pidfd_open=434, socket=198, ioctl=29)),
}
_ALWAYS = ("ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "pidfd_getfd", "pidfd_send_signal",
           "kcmp", "open_by_handle_at", "io_uring_setup")
_BY_PID = ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "pidfd_open")


class _Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Filter))]


def supported() -> str | None:
    """None where this machine's system calls are known here, else why not."""
    if struct.pack("=I", 1) != struct.pack("<I", 1):
        return "a big-endian machine"
    return None if platform.machine() in _TABLES else f"no syscall table for {platform.machine()}"


def program(protected: Iterable[int]) -> list[tuple[int, int, int, int]]:
    """The BPF instructions (code, jt, jf, k) of the filter for this machine."""
    arch, _, nr = _TABLES[platform.machine()]
    deny, allow = (_RET_K, 0, 0, _RET_ERRNO | errno.EPERM), (_RET_K, 0, 0, _RET_ALLOW)
    pids = sorted({p & 0xFFFFFFFF for p in protected})
    # Tail blocks, each ending in a return; the head jumps to them by name.
    blocks = {  # "deny" last: BPF jumps only forward
        "pid": [(_LD_W_ABS, 0, 0, _ARG0), (_JSET_K, 0, 0, 0x80000000)]  # a negative pid, then each protected
        + [(_JEQ_K, 0, 0, p) for p in pids] + [allow],
        "socket": [(_LD_W_ABS, 0, 0, _ARG0), (_JEQ_K, 0, 0, AF_UNIX), allow],
        "ioctl": [(_LD_W_ABS, 0, 0, _ARG1), (_JEQ_K, 0, 0, TIOCSTI), (_JEQ_K, 0, 0, TIOCLINUX), allow],
        "deny": [deny],
    }
    head = [(_LD_W_ABS, 0, 0, _ARCH), ("deny-unless", arch), (_LD_W_ABS, 0, 0, _NR)]
    if platform.machine() == "x86_64":
        head.append(("deny-if-ge", _X32))
    head += [("to", nr[name], "deny") for name in _ALWAYS]
    head += [("to", nr[name], "pid") for name in _BY_PID]
    head += [("to", nr["socket"], "socket"), ("to", nr["ioctl"], "ioctl"), allow]
    # Lay out head then blocks; resolve jumps (BPF jumps are relative, forward, at most 255).
    starts, at = {}, len(head)
    for name, block in blocks.items():
        starts[name] = at
        at += len(block)
    out = []
    for i, ins in enumerate(head):
        if ins[0] == "deny-unless":
            out.append((_JEQ_K, 0, starts["deny"] - i - 1, ins[1]))
        elif ins[0] == "deny-if-ge":
            out.append((_JGE_K, starts["deny"] - i - 1, 0, ins[1]))
        elif ins[0] == "to":
            out.append((_JEQ_K, starts[ins[2]] - i - 1, 0, ins[1]))
        else:
            out.append(ins)
    for name, block in blocks.items():
        for j, ins in enumerate(block):
            i = starts[name] + j
            if ins[0] in (_JEQ_K, _JSET_K) and name != "deny":
                out.append((ins[0], starts["deny"] - i - 1, 0, ins[3]))  # a match refuses
            else:
                out.append(ins)
    if any(not 0 <= jt <= 255 or not 0 <= jf <= 255 for _, jt, jf, _ in out):
        raise ValueError("a seccomp jump out of range")
    return out


def deny(protected: Iterable[int]) -> str:
    """Install the filter on every thread of this process (no_new_privs must be set); what it
    refuses, in words. OSError where it cannot be installed."""
    if (why := supported()) is not None:
        raise OSError(why)
    instructions = program(protected)
    filters = (_Filter * len(instructions))(*(_Filter(*ins) for ins in instructions))
    prog = _Program(len(instructions), filters)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    _, number, _ = _TABLES[platform.machine()]
    if libc.syscall(number, _SET_MODE_FILTER, _FILTER_FLAG_TSYNC, ctypes.byref(prog)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return "no ptrace, cross-process memory or descriptors, signals only to its own, no AF_UNIX socket, no io_uring"
