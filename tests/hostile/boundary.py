"""Kernels that attack the line between an isolation worker and its judge (issue 35) instead of the
values: each computes the right quantize_fp8_ds_mla answer and then goes for the worker's pipe, its
process or the run directory. The outcome each must get is in `tests.hostile.BOUNDARY`."""

import ctypes
import json
import os
import sys
import threading
import time

from mla_verify.optimized import eager

DAEMON = "mla-vrf-daemon"  # the name `leaves_a_daemon`'s grandchild gives itself (15 characters at most)


def _caller_local(name: str):
    """A local variable of the nearest caller frame that has one (the worker's request, channel)."""
    frame = sys._getframe(1)
    while frame is not None:
        if name in frame.f_locals:
            return frame.f_locals[name]
        frame = frame.f_back
    raise LookupError(name)


def _write_message(header: dict) -> None:
    from mla_verify.equivalence.sandbox import wire

    body = json.dumps(header).encode()
    os.write(_caller_local("channel").fd, wire._FRAME.pack(wire.MAGIC, len(body)) + body)


class _Reduces:
    """An object whose unpickling runs code: what a pickled message could carry into the judge."""

    def __reduce__(self):
        return (os.system, ("touch /tmp/mla-verify-pwned",))


def returns_a_pickle_bomb(kv, scale_rule="pow2"):
    """Returns an object whose `__reduce__` runs code where it is unpickled."""
    return _Reduces()


def writes_garbage_to_its_pipe(kv, scale_rule="pow2"):
    """Right answer, and bytes no message starts with written into the worker's pipe."""
    os.write(_caller_local("channel").fd, b"\x80\x04\x95garbage")
    return eager.quantize_fp8_ds_mla(kv, scale_rule)


def forges_an_error(kv, scale_rule="pow2"):
    """Sends an "error" message for its own case: a harness error would exit 3 and save nothing."""
    _write_message({"kind": "error", "seq": _caller_local("request")["seq"], "detail": "forged by the kernel"})
    time.sleep(30)


def forges_a_failure_without_rows(kv, scale_rule="pow2"):
    """Sends an answer for its own case that holds no output and no finding (the "failed, no rows"
    message that used to pass), then waits to be judged on it."""
    request = _caller_local("request")
    _write_message({"kind": "produced", "seq": request["seq"], "case_id": _case_id(request), "findings": [],
                    "outputs": {}})
    time.sleep(30)


def answers_out_of_sequence(kv, scale_rule="pow2"):
    """Sends an answer to a request the parent has not made."""
    request = _caller_local("request")
    _write_message({"kind": "produced", "seq": request["seq"] + 7, "case_id": _case_id(request)})
    time.sleep(30)


def claims_a_huge_tensor(kv, scale_rule="pow2"):
    """Sends a header that claims a tensor of 2**50 bytes: refused before anything is allocated."""
    request = _caller_local("request")
    _write_message({"kind": "produced", "seq": request["seq"], "case_id": _case_id(request), "outputs": {"rows": 0},
                    "tensors": [{"dtype": "uint8", "shape": [2**50], "device": "cpu", "nbytes": 2**50}]})
    time.sleep(30)


def _case_id(request: dict) -> str:
    from mla_verify.equivalence.cases.case import Case

    return Case.from_dict(request["case"]).case_id


def swaps_the_channels_send(kv, scale_rule="pow2"):
    """Replaces the worker's sending function with one that would send the right answer for any."""
    channel = _caller_local("channel")
    channel.send_frames = lambda frames: None
    return eager.quantize_fp8_ds_mla(kv, scale_rule)


def dies_leaving_a_child_on_the_pipe(kv, scale_rule="pow2"):
    """Forks a child that keeps every descriptor (the pipe) open, then exits: the worker is dead
    though its pipe is not closed."""
    if os.fork() == 0:
        time.sleep(120)
        os._exit(0)
    os._exit(0)


def leaves_a_daemon(kv, scale_rule="pow2"):
    """Right answer, and a double-forked, setsid'd grandchild that outlives the call: it names
    itself DAEMON (its comm, which a test finds in /proc) and says so on the output it inherited,
    the run's (behind the sandbox it may write no file; it would rewrite the run's rows later)."""
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            ctypes.CDLL(None).prctl(15, DAEMON.encode(), 0, 0, 0)  # PR_SET_NAME
            os.write(1, f"daemon started: {DAEMON}\n".encode())
            time.sleep(120)
        os._exit(0)
    os.wait()
    return eager.quantize_fp8_ds_mla(kv, scale_rule)


def writes_after_return(kv, scale_rule="pow2"):
    """Right answer at return, and a thread it leaves running changes it 20 ms later (on a GPU:
    work left on another stream)."""
    result = eager.quantize_fp8_ds_mla(kv, scale_rule)

    def later():
        time.sleep(0.02)
        result.view(-1)[0] ^= 1

    threading.Thread(target=later, daemon=True).start()
    return result


def leaves_a_thread(kv, scale_rule="pow2"):
    """Right answer, and a thread left running that never touches it."""
    threading.Thread(target=time.sleep, args=(0.5,), daemon=True).start()
    return eager.quantize_fp8_ds_mla(kv, scale_rule)


# ----------------------------------------------------------------------------- the shared segments (issue 41)


def _segment_message(tensors: list[dict]) -> None:
    request = _caller_local("request")
    _write_message({"kind": "produced", "seq": request["seq"], "case_id": _case_id(request), "outputs": {"rows": 0},
                    "tensors": tensors})
    time.sleep(30)


def claims_past_the_segment(kv, scale_rule="pow2"):
    """Answers with an output said to lie in the outputs segment, ending past its end."""
    size = _caller_local("request")["outputs"]["size"]
    _segment_message([{"dtype": "uint8", "shape": [16], "device": "cpu", "nbytes": 16, "offset": size - 8}])


def claims_overlapping_outputs(kv, scale_rule="pow2"):
    """Answers with two outputs said to share bytes of the outputs segment."""
    _segment_message([{"dtype": "uint8", "shape": [16], "device": "cpu", "nbytes": 16, "offset": 0},
                      {"dtype": "uint8", "shape": [16], "device": "cpu", "nbytes": 16, "offset": 8}])


def scribbles_the_segment_after_answering(kv, scale_rule="pow2"):
    """Right answer, and a thread that fills the outputs segment with 0xff bytes (NaN in every
    float) 0.3 s later, after the worker answered: the judge reads its copy, taken on arrival."""
    out = _caller_local("mapped")["outputs"]

    def later():
        time.sleep(0.3)
        out.view[:1 << 16] = b"\xff" * (1 << 16)

    threading.Thread(target=later, daemon=True).start()
    return eager.quantize_fp8_ds_mla(kv, scale_rule)


def resizes_the_segments(kv, scale_rule="pow2"):
    """Right answer, after trying to truncate and grow both segments the parent shares (a
    truncated mapping faults its reader) through the descriptors it was handed, and to unlink them
    (they have no name but /proc's): what each attempt raised goes to the file its run id names (a
    test's: the worker's environment is its fork server's)."""
    request, mapped, tried = _caller_local("request"), _caller_local("mapped"), []
    for which in ("inputs", "outputs"):
        fd = os.dup(mapped[which].fd)
        for attempt, do in (("truncate", lambda: os.ftruncate(fd, 0)), ("grow", lambda: os.ftruncate(fd, 1 << 40)),
                            ("unlink", lambda: os.unlink(f"/proc/self/fd/{fd}"))):
            try:
                do()
                tried.append(f"{which} {attempt}: done")
            except OSError as exc:
                tried.append(f"{which} {attempt}: {type(exc).__name__}")
        os.close(fd)
    with open(request["run_id"], "w") as f:
        f.write("\n".join(tried))
    return eager.quantize_fp8_ds_mla(kv, scale_rule)


def writes_its_input_and_hides_it(kv, scale_rule="pow2"):
    """Writes its input in place, and makes the worker's own snapshot see no write: the judge's
    comparison of what it handed over still does."""
    from mla_verify.equivalence.sandbox import call_guards

    result = eager.quantize_fp8_ds_mla(kv, scale_rule)
    kv.view(-1)[0] += 1
    call_guards.Snapshot.changed = lambda self, allowed=(): []
    return result
