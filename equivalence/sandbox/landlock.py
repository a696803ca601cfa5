"""Landlock (Linux 5.13+, unprivileged): what a process may write, and whom it may signal or reach,
from now on, for it and everything it starts. `restrict(writable, scope=True)` is the one call.

A Landlock domain only narrows: rights the ruleset "handles" are denied except beneath the paths a
rule grants them on. Here the handled rights are every right that changes the file system (write,
truncate, create, remove, rename across directories, device ioctls), never read or execute: the
worker reads what its user can (Python, torch, the kernel's own files) and writes only where
`writable` says. A domain also keeps the process from ptrace-ing, or reaching through /proc (its
`mem`, its `fd/`), any process outside it (ABI 1), and from ABI 6 from signalling one or connecting
to its abstract unix sockets. The syscalls and structures are those of <linux/landlock.h>.
"""

from __future__ import annotations

import ctypes
import os
from typing import Iterable

_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446  # one number on every architecture
_VERSION = 1 << 0        # landlock_create_ruleset flag: answer the ABI version
_PATH_BENEATH = 1

WRITE_FILE, REMOVE_DIR, REMOVE_FILE = 1 << 1, 1 << 4, 1 << 5
MAKE_CHAR, MAKE_DIR, MAKE_REG, MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM = (1 << b for b in range(6, 13))
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15    # ABI 2, 3, 5
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6
_ON_FILES = WRITE_FILE | TRUNCATE | IOCTL_DEV              # the handled rights a rule on a file may grant


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _syscall(*args) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    result = libc.syscall(*args)
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return result


def abi() -> int:
    """The Landlock ABI this kernel offers; 0 where it has none (or it is turned off)."""
    try:
        return _syscall(_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_VERSION))
    except OSError:
        return 0


def handled(version: int) -> int:
    """The file-system rights a ruleset handles at ABI `version`: all that change anything."""
    rights = WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE_CHAR | MAKE_DIR | MAKE_REG | MAKE_SOCK | MAKE_FIFO
    rights |= MAKE_BLOCK | MAKE_SYM
    for since, right in ((2, REFER), (3, TRUNCATE), (5, IOCTL_DEV)):
        if version >= since:
            rights |= right
    return rights


def restrict(writable: Iterable[str], scope: bool = True) -> str:
    """Put this process (and all it starts) in a domain that writes only beneath `writable` (paths
    that do not exist are skipped; a file, a device node, gets the rights a file can have) and, with
    `scope` and ABI 6, signals and reaches abstract sockets only within it. The process must have
    no_new_privs set (or CAP_SYS_ADMIN). What holds, in words; OSError where it cannot be set up."""
    version = abi()
    if version < 1:
        raise OSError("Landlock is not available on this kernel")
    rights = handled(version)
    scoped = SCOPE_SIGNAL | SCOPE_ABSTRACT_UNIX_SOCKET if scope and version >= 6 else 0
    attr = _RulesetAttr(rights, 0, scoped)
    # an older kernel takes the larger structure where the fields it does not know are zero
    ruleset = _syscall(_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)), ctypes.c_uint32(0))
    granted = []
    try:
        for path in dict.fromkeys(writable):
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                allowed = rights if os.path.isdir(path) else rights & _ON_FILES
                rule = _PathBeneath(allowed, fd)
                _syscall(_ADD_RULE, ruleset, ctypes.c_int(_PATH_BENEATH), ctypes.byref(rule), ctypes.c_uint32(0))
                granted.append(path)
            finally:
                os.close(fd)
        _syscall(_RESTRICT_SELF, ruleset, ctypes.c_uint32(0))
    finally:
        os.close(ruleset)
    scoping = "signals and abstract sockets scoped" if scoped else f"signals not scoped (ABI {version} < 6)"
    return f"ABI {version}: writes beneath {len(granted)} paths only, {scoping}, no ptrace or /proc out of its domain"
