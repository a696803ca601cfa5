"""The OS boundary a worker puts itself behind (issue 45, `equivalence.sandbox.boundary`): each
layer, alone and together, refuses what it is for, in a child process forked from this one (the
test process itself is never put behind it); a host without a layer says so, and strict refuses.
A worker started as a CUDA one is (spawned, running threads by the time it enters its boundary)
stands behind every layer a forked CPU one does."""

import json
import mmap
import os
import signal
import socket
import sys
import tempfile
import threading
import time

import pytest
import torch

from mla_verify.equivalence import serve as serve_module
from mla_verify.equivalence.blocks import Judging
from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.sandbox import boundary, landlock, reaper, seccomp
from mla_verify.equivalence.sandbox.boundary import Boundary, Layer
from mla_verify.equivalence.sandbox.worker import Worker
from tests.isolated import gone, judged

LINUX = sys.platform.startswith("linux")
pytestmark = pytest.mark.skipif(not LINUX, reason="the sandbox's layers are Linux's")


@pytest.fixture(autouse=True)
def scratch_here(tmp_path, monkeypatch):
    """The children's scratch directories under the test's own (they never reach a judge's close)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def in_child(fn):
    """fn() in a forked child of this process; what it returned (JSON), or its exception's text."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            out = {"ok": fn()}
        except BaseException as exc:  # noqa: BLE001 - the child reports whatever it met
            out = {"error": f"{type(exc).__name__}: {exc}"}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    result = json.loads(data)
    assert "error" not in result, result["error"]
    return result["ok"]


def probes(judge: int, scratch: str | None) -> dict[str, bool]:
    """name -> whether it worked, for what a worker must not do to its judge (and two it must)."""
    def works(attempt) -> bool:
        try:
            attempt()
            return True
        except OSError:
            return False

    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    found = {
        "signal the judge": works(lambda: os.kill(judge, 0)),
        "signal every process (-1)": works(lambda: os.kill(-1, 0)),
        "open the judge's descriptors": works(lambda: os.close(os.open(f"/proc/{judge}/fd/0", os.O_RDONLY))),
        "open the judge's memory": works(lambda: open(f"/proc/{judge}/mem", "rb").close()),
        "ptrace the judge": libc.ptrace(0x4206, judge, 0, 0) == 0,  # PTRACE_SEIZE: never stops it
        "create an AF_UNIX socket": works(lambda: socket.socket(socket.AF_UNIX).close()),
        "write the working directory": works(lambda: os.unlink(_made(os.getcwd()))),
        "read a file": works(lambda: open(__file__, "rb").close()),
    }
    if scratch is not None:
        found["write the scratch directory"] = works(lambda: os.unlink(_made(scratch)))
    return found


def _made(directory: str) -> str:
    path = os.path.join(directory, f".sandbox-probe-{os.getpid()}")
    with open(path, "w") as f:
        f.write("x")
    return path


REFUSED = ("signal the judge", "signal every process (-1)", "open the judge's descriptors", "open the judge's memory",
           "ptrace the judge", "create an AF_UNIX socket", "write the working directory")


def test_every_layer_holds_or_says_why_and_together_they_keep_the_judge_out_of_reach():
    judge = os.getpid()

    def behind():
        b = boundary.enter("auto", "cpu", {judge})
        return b.to_dict(), probes(judge, b.scratch)

    described, found = in_child(behind)
    b = Boundary.from_dict(described)
    assert [x.name for x in b.layers] == list(boundary.LAYERS)
    assert all(x.held or x.detail for x in b.layers)
    if b.missing:
        pytest.skip(f"this host does not offer every layer: {b.summary()}")
    assert found["read a file"] and found["write the scratch directory"], found
    assert not any(found[name] for name in REFUSED), {name: found[name] for name in REFUSED}
    assert not os.path.exists(b.scratch) or os.path.isdir(b.scratch)


@pytest.mark.skipif(seccomp.supported() is not None, reason="no seccomp syscall table for this machine")
def test_seccomp_alone_refuses_tracing_cross_process_calls_signals_and_unix_sockets():
    judge = os.getpid()

    def behind():
        boundary._no_new_privs()
        seccomp.deny({judge})
        return probes(judge, None)

    found = in_child(behind)
    for name in ("signal the judge", "signal every process (-1)", "ptrace the judge", "create an AF_UNIX socket"):
        assert not found[name], name
    assert found["write the working directory"] and found["read a file"]  # the file system is Landlock's


@pytest.mark.skipif(landlock.abi() < 1, reason="this kernel has no Landlock")
def test_landlock_alone_keeps_writes_in_their_place_and_the_judge_out_of_its_domain(tmp_path):
    judge = os.getpid()

    def behind():
        boundary._no_new_privs()
        landlock.restrict([str(tmp_path)])
        return probes(judge, str(tmp_path))

    found = in_child(behind)
    assert found["write the scratch directory"] and not found["write the working directory"]
    assert not found["open the judge's memory"] and not found["open the judge's descriptors"]
    assert not found["ptrace the judge"]
    if landlock.abi() >= 6:
        assert not found["signal the judge"]


def test_off_sets_up_nothing_and_strict_refuses_a_missing_layer():
    assert boundary.enter("off", "cpu", ()).layers == () and boundary.enter("off", "cpu", ()).summary() == "sandbox off"
    layers = (Layer("session", True, "x"), Layer("landlock", False, "Landlock is not available on this kernel"))
    assert Boundary("auto", layers).refused() is None
    assert Boundary("strict", layers).refused() == "--sandbox strict: landlock: Landlock is not available on this kernel"
    assert Boundary("auto", layers).summary() == \
        "sandbox auto: session; missing: landlock (Landlock is not available on this kernel)"
    with pytest.raises(ValueError):
        boundary.enter("loose", "cpu", ())


@pytest.mark.parametrize("described", [
    None, [], {"mode": "lax", "layers": []}, {"mode": "auto", "layers": [["ptrace", True, ""]]},
    {"mode": "auto", "layers": [["landlock", "yes", ""]]}, {"mode": "auto", "layers": [], "scratch": "/home"},
])
def test_a_worker_description_that_is_not_one_is_refused(described):
    with pytest.raises(ValueError):
        Boundary.from_dict(described)


def test_the_seccomp_program_jumps_only_forward_and_ends_every_path_in_a_return():
    if seccomp.supported() is not None:
        pytest.skip(seccomp.supported())
    program = seccomp.program({1234, 99})
    for i, (code, jt, jf, _) in enumerate(program):
        if code & 0x07 == 0x05:  # a jump: both targets inside the program
            assert i + 1 + max(jt, jf) < len(program)
    assert program[-1][0] == 0x06  # the deny block


def _run_a_thread() -> None:
    """A second thread in this process, as a spawned CUDA worker has once torch is imported."""
    threading.Thread(target=threading.Event().wait, daemon=True).start()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("end, status", [
    (lambda: os._exit(3), ("exit", 3)), (lambda: os.kill(os.getpid(), 9), ("signal", 9)),
    (lambda: os.kill(os.getpid(), 10), ("signal", 10)), (lambda: None, ("exit", 0)),
])
def test_the_process_the_judge_started_ends_as_the_worker_behind_its_namespaces_ended(end, status, threads):
    """Behind a PID namespace the worker is the grandchild of the process the judge started, which
    must end the way the worker did (a SIGKILL it mirrored once went on as a second worker); one
    that ran threads forks once more first (`boundary._alone`), and still ends as the worker did."""
    pid = os.fork()
    if pid == 0:
        try:
            if threads > 1:
                _run_a_thread()
            boundary.enter("auto", "cpu", ())
            end()
        finally:
            os._exit(0)
    _, raw = os.waitpid(pid, 0)
    got = ("signal", os.WTERMSIG(raw)) if os.WIFSIGNALED(raw) else ("exit", os.WEXITSTATUS(raw))
    assert got == status


def _cuda_started(how: str, where: str):
    """Make this (forked, throwaway) process look as though CUDA started in it: torch's context
    ("torch"), or the driver loaded ("driver": a file called libcuda.so.1 mapped, as the runtime
    maps the real one)."""
    if how == "torch":
        torch.cuda.is_initialized = lambda: True
        return None
    path = os.path.join(where, "libcuda.so.1")
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 4096, prot=mmap.PROT_READ)


@pytest.mark.parametrize("how, says", [("torch", "torch initialized CUDA"), ("driver", "CUDA driver (libcuda.so)")])
def test_a_cuda_worker_where_cuda_started_before_its_boundary_forks_nothing_and_says_why(tmp_path, how, says):
    """A threaded worker sheds its threads only by forking, which neither a CUDA context nor an
    initialized driver survives: a CUDA worker where either started does not fork, and the
    namespaces are missing with why (strict refuses); a CPU worker, which never uses CUDA, forks."""
    def behind(device):
        _run_a_thread()
        mapped = _cuda_started(how, str(tmp_path))
        b = boundary.enter("strict", device, ())
        if mapped is not None:  # kept mapped while enter looked
            mapped.close()
        return b.to_dict(), os.getpid()

    described, pid = in_child(lambda: behind("cuda"))
    b = Boundary.from_dict(described)
    missing = {x.name: x.detail for x in b.missing}
    assert missing["user namespace"].startswith("the worker already runs threads and cannot fork") \
        and says in missing["user namespace"], missing
    assert missing["pid namespace"] == "needs the user namespace"
    assert b.refused().startswith("--sandbox strict: user namespace: the worker already runs threads")
    assert pid != 2  # nothing was forked: the process that called enter went on itself

    if _user_namespaces() is None:
        b = Boundary.from_dict(in_child(lambda: behind("cpu"))[0])
        assert {"user namespace", "pid namespace"} <= set(b.held), b.summary()


def threaded_serve(conn, device: str, sandbox: str = "off", judge: int = 0, no_namespaces: str = "") -> None:
    """`serve` in a process that runs a second thread when it enters its boundary, as a spawned CUDA
    worker does once its imports are done; the point where a CUDA worker creates its context
    (`serve._warm_up`) is checked to come behind the namespaces, with CUDA not yet initialized: a
    worker that would get there outside them exits 3 instead (and never says ready)."""
    _run_a_thread()
    warm_up = serve_module._warm_up

    def checked(device: str) -> None:
        with open("/proc/self/uid_map") as f:
            own_users = f.read().split() == [str(os.getuid()), str(os.getuid()), "1"]
        nvml = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") == "1"  # its imports counted GPUs without CUDA
        if os.getpid() != 2 or not own_users or torch.cuda.is_initialized() or not nvml:
            os._exit(3)
        warm_up(device)

    serve_module._warm_up = checked
    serve_module.serve(conn, device, sandbox, judge, no_namespaces)


def dies_behind_namespaces(conn, device: str, sandbox: str = "off", judge: int = 0, no_namespaces: str = "") -> None:
    """`serve` for a device whose context cannot start behind the namespaces (what a CUDA driver
    might do there, unseen so far): a worker that would get to its warm-up inside a new user
    namespace exits 3 instead."""
    warm_up = serve_module._warm_up

    def refused(device: str) -> None:
        with open("/proc/self/uid_map") as f:
            if f.read().split() != ["0", "0", "4294967295"]:
                os._exit(3)
        warm_up(device)

    serve_module._warm_up = refused
    serve_module.serve(conn, device, sandbox, judge, no_namespaces)


def test_a_worker_that_cannot_start_behind_the_namespaces_keeps_the_other_layers(tmp_path, monkeypatch):
    """auto steps down one rung at a time: a worker that dies before it says ready behind the
    namespaces is started again without them (session, no_new_privs, landlock and seccomp still
    held, the namespaces missing with the reason), not without the whole sandbox."""
    if (why := _user_namespaces()) is not None:
        print(f"skipped: this host gives no unprivileged user namespace ({why})")
        pytest.skip(f"no unprivileged user namespace here: {why}")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the spawned worker's scratch, where its judge looks
    worker = Worker("cpu", dies_behind_namespaces, 10.0, start="spawn")
    try:
        fence = worker.start()
        assert not worker.fell_back and fence.mode == "auto", worker.summary()
        assert {"session", "no_new_privs", "landlock", "seccomp"} <= set(fence.held), fence.summary()
        missing = {x.name: x.detail for x in fence.missing}
        assert set(missing) == {"user namespace", "pid namespace"}, fence.summary()
        assert "a worker behind them could not start (exit code 3)" in missing["user namespace"], missing
        assert worker.sandboxed()["missing"] == missing
    finally:
        worker.close()


def _user_namespaces() -> str | None:
    """Why this host gives a single-threaded process no user namespace, or None where it does."""
    def alone():
        try:
            boundary._user_namespace("cpu")
        except OSError as exc:
            return str(exc)
        return None

    return in_child(alone)


def _left(pids: list[int], within_s: float = 5.0) -> list[int]:
    """Those of `pids` still running after `within_s` seconds (a SIGKILL takes a moment to land)."""
    deadline = time.monotonic() + within_s
    while any(not gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    return [p for p in pids if not gone(p)]


def test_a_worker_started_as_a_cuda_one_stands_behind_the_namespaces_and_takes_its_processes_along(
        tmp_path, monkeypatch, capfd):
    """The start path of a CUDA worker, on CPU: spawned, with a thread running at its boundary
    (on the H100 such a worker held neither namespace: "the worker already runs threads"). It
    forks once, behind every layer a forked CPU worker holds, before the point where CUDA would
    start; its segments and pipe still carry a case; what its kernel starts ends with the case,
    and killing the process its judge started takes every process behind it along."""
    if (why := _user_namespaces()) is not None:
        print(f"skipped: this host gives no unprivileged user namespace ({why})")
        pytest.skip(f"no unprivileged user namespace here: {why}")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the spawned worker's scratch, where its judge looks
    judging = Judging("cpu", isolate=True, timeout=10.0)
    judging.worker = Worker("cpu", threaded_serve, 10.0, start="spawn")
    try:
        fence = judging.start()
        assert not judging.worker.fell_back, judging.summary()  # it got past the check at _warm_up
        held = {x.name: x.detail for x in fence.layers if x.held}
        assert {"user namespace", "pid namespace"} <= set(held), fence.summary()
        assert "in a child forked for it" in held["user namespace"], held["user namespace"]
        started, active = judging.worker._active.proc.pid, judging.worker._active
        behind = reaper.descendants(started)  # the forked child, the namespace's init, the worker
        assert len(behind) == 3 and active.runner() == behind[-1], (behind, active.runner())

        rows = judged(judging, Case("quantize_fp8_ds_mla", {"n": 2, "value_regime": "normal", "scale_rule": "pow2"}, 3),
                      ["tests.hostile.boundary:leaves_a_daemon"])
        assert rows and all(r.passed for r in rows), [(r.gate_metric, r.reason) for r in rows if not r.passed]
        assert "daemon started" in capfd.readouterr().out
        daemon = [p for p in reaper.descendants(started) if p not in behind]
        assert not _left(daemon)  # what its kernel started died with the case (SIGKILLed as it ended)

        os.kill(started, signal.SIGKILL)  # as the judge kills a hung worker
        assert not _left(behind)
    finally:
        judging.close()


@pytest.mark.gpu
def test_on_a_gpu_host_a_cuda_worker_holds_every_layer_a_cpu_worker_holds(monkeypatch):
    """What the test above stands in for, on the device: a CUDA worker (spawned, its imports' threads
    running, the CUDA driver not loaded before its boundary) stands behind the same layers as a CPU
    one on this host, and its CUDA context works behind them (it said ready after its warm-up)."""
    monkeypatch.setattr(tempfile, "tempdir", None)  # the workers' scratch where they make it
    with Judging("cpu", isolate=True, timeout=60.0) as cpu, Judging("cuda", isolate=True, timeout=60.0) as cuda:
        on_cpu, on_cuda = cpu.start(), cuda.start()
        print(f"cpu worker: {on_cpu.summary()}\ncuda worker: {on_cuda.summary()}")
        assert not cuda.worker.fell_back, cuda.summary()
        assert on_cuda.held == on_cpu.held, (on_cpu.summary(), on_cuda.summary())
