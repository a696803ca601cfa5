"""Kernels that go for what lies outside their worker (issue 45): the judge's process, its memory
and descriptors, its process group, the fork server, the harness's own files. Each stands for the
exploit its primitive opens: where the primitive works, it returns the right quantize_fp8_ds_mla
answer (a wrong kernel that won: it could have patched the judge, taken its journal, killed it);
refused, it returns its own wrong answer, and its case fails as a wrong kernel's must. Behind the
sandbox every one fails its case (`tests.hostile.SANDBOX`); with `--sandbox off`, on a host where
the worker runs as its judge's user, several pass: what the boundary is for.

Probes are harmless where they work (signal 0, a read, a file removed again): a sandbox that did
not hold must not take the test session down with it.
"""

import ctypes
import glob
import os
import socket
import sys

import torch

from mla_verify.optimized import eager

MARK = "MLA_VERIFY_WORKER_TREE"  # the judge's pid, in every worker's environment (`reaper.marked`)
PTRACE_ATTACH, PTRACE_DETACH, WALL = 16, 17, 0x40000000


def _judge() -> int:
    return int(os.environ[MARK])


def _answer(kv: torch.Tensor, scale_rule: str, won: bool) -> torch.Tensor:
    """The right answer where the attack won, else one byte off."""
    result = eager.quantize_fp8_ds_mla(kv, scale_rule)
    if not won:
        result.view(-1)[0] ^= 1
    return result


def _works(attempt) -> bool:
    try:
        attempt()
        return True
    except OSError:
        return False


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = libc.ptrace.restype = ctypes.c_long
    return libc


def _ptrace() -> None:
    libc, judge = _libc(), _judge()
    if libc.ptrace(PTRACE_ATTACH, judge, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "ptrace")
    os.waitpid(judge, WALL)  # its attach stop, then let it go on
    libc.ptrace(PTRACE_DETACH, judge, 0, 0)


def ptraces_the_judge(kv, scale_rule="pow2"):
    """PTRACE_ATTACH to the judge (POKEDATA would then patch its row judge), detached at once."""
    return _answer(kv, scale_rule, _works(_ptrace))


def _first_mapping(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return next(int(line.split("-")[0], 16) for line in f if line.split()[1].startswith("r"))


def _read_mem() -> None:
    judge = _judge()
    with open(f"/proc/{judge}/mem", "rb", buffering=0) as f:
        f.seek(_first_mapping(judge))
        f.read(1)


def reads_the_judges_memory(kv, scale_rule="pow2"):
    """Reads the judge's memory through /proc/PID/mem (opened for writing, it patches it)."""
    return _answer(kv, scale_rule, _works(_read_mem))


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _vm_read() -> None:
    judge = _judge()
    buffer = ctypes.create_string_buffer(1)
    local, remote = _IOVec(ctypes.addressof(buffer), 1), _IOVec(_first_mapping(judge), 1)
    libc = _libc()
    libc.process_vm_readv.restype = ctypes.c_ssize_t
    if libc.process_vm_readv(judge, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) != 1:
        raise OSError(ctypes.get_errno(), "process_vm_readv")


def reads_the_judges_memory_by_syscall(kv, scale_rule="pow2"):
    """process_vm_readv of the judge's memory (process_vm_writev would patch it)."""
    return _answer(kv, scale_rule, _works(_vm_read))


def _open_fds() -> None:
    judge = _judge()
    fds = os.listdir(f"/proc/{judge}/fd")
    opened = [fd for fd in fds if _works(lambda fd=fd: os.close(os.open(f"/proc/{judge}/fd/{fd}", os.O_RDONLY)))]
    if not opened:
        raise OSError("none opened")


def opens_the_judges_descriptors(kv, scale_rule="pow2"):
    """Opens the judge's descriptors through /proc/PID/fd (its journal, the segments, the spare
    workers' pipes)."""
    return _answer(kv, scale_rule, _works(_open_fds))


def _pidfd_getfd() -> None:
    libc = _libc()
    pidfd = libc.syscall(434, _judge(), 0)  # pidfd_open
    if pidfd < 0:
        raise OSError(ctypes.get_errno(), "pidfd_open")
    try:
        fd = libc.syscall(438, pidfd, 0, 0)  # pidfd_getfd: its descriptor 0
        if fd < 0:
            raise OSError(ctypes.get_errno(), "pidfd_getfd")
        os.close(fd)
    finally:
        os.close(pidfd)


def takes_a_judges_descriptor(kv, scale_rule="pow2"):
    """pidfd_getfd: a copy of one of the judge's descriptors."""
    return _answer(kv, scale_rule, _works(_pidfd_getfd))


def signals_the_judge(kv, scale_rule="pow2"):
    """kill(judge, 0): a signal that could be SIGKILL (or SIGSTOP while it waits for this answer)."""
    return _answer(kv, scale_rule, _works(lambda: os.kill(_judge(), 0)))


def signals_the_judges_group(kv, scale_rule="pow2"):
    """kill(-its process group, 0): what `kill(0, SIGKILL)` did from the judge's own group."""
    return _answer(kv, scale_rule, _works(lambda: os.kill(-os.getpgid(_judge()), 0)))


def _forkserver() -> None:
    from multiprocessing import forkserver

    address = getattr(forkserver._forkserver, "_forkserver_address", None)
    candidates = [address] if address else glob.glob("/tmp/pymp-*/listener-*")
    for path in candidates:
        with socket.socket(socket.AF_UNIX) as s:
            if _works(lambda: s.connect(path)):
                return
    raise OSError("no fork server reached")


def asks_the_fork_server(kv, scale_rule="pow2"):
    """Connects to the fork server's socket: the process it forks on request runs outside the
    sandbox, whatever it is sent."""
    return _answer(kv, scale_rule, _works(_forkserver))


def _plant(directory: str) -> None:
    path = os.path.join(directory, f".planted-by-a-kernel-{os.getpid()}")
    with open(path, "w") as f:
        f.write("x")
    os.unlink(path)


def writes_the_harness(kv, scale_rule="pow2"):
    """Creates a file beside mla-verify's own code (then patching the oracle is one write away)."""
    import mla_verify

    return _answer(kv, scale_rule, _works(lambda: _plant(os.path.dirname(mla_verify.__file__))))


def writes_the_working_directory(kv, scale_rule="pow2"):
    """Creates a file in the working directory (where runs/ and a corpus usually live)."""
    return _answer(kv, scale_rule, _works(lambda: _plant(os.getcwd())))


def kills_its_judge(kv, scale_rule="pow2"):
    """SIGKILL to its parent (the judge itself on CUDA, the fork server on CPU) and to the judge:
    unconfined, the run dies with no case saved and no row."""
    for pid in dict.fromkeys((os.getppid(), _judge())):
        _works(lambda pid=pid: os.kill(pid, 9))
    return _answer(kv, scale_rule, False)


SURVIVOR = r"""
import os, sys, time
judge, out = int(sys.argv[1]), sys.argv[2]


def alive():
    try:
        with open(f"/proc/{judge}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


deadline = time.monotonic() + 120
while alive() and time.monotonic() < deadline:
    time.sleep(0.05)
tried = []
for what, do in (("rewrite rows.csv", lambda: open(os.path.join(out, "rows.csv"), "w").write("forged")),
                 ("delete failures/", lambda: [os.unlink(os.path.join(out, "failures", f))
                                               for f in os.listdir(os.path.join(out, "failures"))])):
    try:
        do()
        tried.append(f"{what}: done")
    except OSError as exc:
        tried.append(f"{what}: refused ({type(exc).__name__})")
print("survivor: " + "; ".join(tried), flush=True)
"""


def _run_dir(judge: int) -> str:
    with open(f"/proc/{judge}/cmdline", "rb") as f:
        argv = f.read().decode().split("\0")
    return argv[argv.index("--out") + 1]


def survives_the_judge(kv, scale_rule="pow2"):
    """Wrong by one bit, and a process that outlives the run: the worker's subreaper flag cleared
    around a double fork (it leaves the worker's tree), then an exec with an empty environment (it
    loses the worker's mark). It waits for the judge to exit, then rewrites the run's rows and
    deletes its findings, and says how that went on the run's output, which it inherited. Behind
    a PID namespace it finds no judge to wait for, and would die with its worker anyway."""
    try:
        judge, out = _judge(), _run_dir(_judge())
    except OSError:  # the judge is not in its PID namespace: nowhere to go
        return _answer(kv, scale_rule, False)
    libc = _libc()
    libc.prctl(36, 0, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER off: orphans go past the worker
    if os.fork() == 0:
        if os.fork() == 0:
            os.execve(sys.executable, [sys.executable, "-c", SURVIVOR, str(judge), out], {})
        os._exit(0)
    os.wait()
    libc.prctl(36, 1, 0, 0, 0)
    return _answer(kv, scale_rule, False)
