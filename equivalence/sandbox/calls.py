"""Running an implementation on a case and turning what happened into rows: the pieces every
spec's `evaluate` is made of.

The implementation runs after the reference, on its own poisoned outputs
(`optimized.buffers.poisoned`), with Python's, numpy's and torch's global generators seeded from
the case (a replay sees what the fuzz run saw). Whatever it does is the case's result, never the
harness's: raising anything (SystemExit too, and a KeyboardInterrupt no SIGINT caused) fails the
case (reason "raised"), and so does breaking the contract beyond values (`equivalence.sandbox.call_guards`):
writing an input, returning the wrong arity, type, layout, dtype, shape or device, or an input as
output; changing the process for the cases after it, or the functions the judge relies on
(`equivalence.sandbox.guards`: both are put back first). Inputs the case generator builds are valid by
contract, so a refusal (InputError) is a failure too; only `unsupported(reason)` declines a case
without failing it (counted and reported).
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
import traceback
from typing import Any, Callable

import numpy as np
import torch

from mla_verify.optimized.buffers import breached, poisoned, red_zones

from ..errors import ContractError
from ..judge.oracle import Verdict
from ..judge.rows import FailureKind, Row
from . import device as dev
from . import guards


class Unsupported(Exception):
    """An input the implementation does not take (raised by `unsupported`)."""


def unsupported(reason: str) -> None:
    """Decline this case from inside an implementation, as Hypothesis's `assume` declines an
    example: the case is counted and reported as unsupported (a row with gate_metric
    "unsupported"), not failed. For what a kernel does not yet do (a head count, a top-k width),
    never for a wrong answer."""
    raise Unsupported(reason)


class Raised(Exception):
    """The implementation raised `error` (`device_error`: what the device reported after it);
    `on_device`: the error is the CUDA device's, or the device reported one after it."""

    def __init__(self, error: BaseException, device_error: str | None = None):
        super().__init__(dev.first_line(error))
        self.error, self.device_error = error, device_error
        self.on_device = device_error is not None or dev.is_device_error(error)


def _sync(device: str) -> None:
    if dev.is_cuda(device):
        torch.cuda.synchronize(device)  # that device's, whichever is current on this thread


def timed(fn, device):
    """(fn(), seconds it took, the device synchronized on both sides)."""
    _sync(device)
    start = time.perf_counter()
    result = fn()
    _sync(device)
    return result, time.perf_counter() - start


def failure_row(base: dict, tensor: str, metric: str, reason: str, **fields) -> Row:
    """A row that failed without a comparison: a crash, a hang, a broken contract."""
    return Row(**{**base, **fields}, tensor=tensor, passed=False, gate_metric=metric, value=1.0, bound=0.0,
               headroom=0.0, reason=reason)


def unsupported_row(base: dict, reason: str, **fields) -> Row:
    """The single row of a case the implementation declined (`unsupported`): counted, not failed."""
    return Row(**{**base, **fields}, tensor="*", passed=True, gate_metric=FailureKind.UNSUPPORTED, value=0.0, bound=0.0,
               headroom=float("inf"), reason=reason)


def raised_row(base: dict, raised: Raised, **fields) -> Row:
    """The single failure row of a case whose implementation raised (or broke the contract)."""
    exc = raised.error
    if isinstance(exc, Unsupported):
        return unsupported_row(base, f"unsupported: {exc}", **fields)
    if isinstance(exc, ContractError):
        return failure_row(base, "*", FailureKind.CONTRACT, str(exc), **fields)
    frames = traceback.extract_tb(exc.__traceback__)
    at = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    message = dev.first_line(exc)
    reason = f"raised {type(exc).__name__}{': ' + message if message else ''}{at}"
    if raised.device_error and raised.device_error not in reason:
        reason += f"; the device then reported: {raised.device_error}"
    return failure_row(base, "*", FailureKind.RAISED, reason, device_error=raised.on_device, **fields)


def seed_globals(seed: int) -> None:
    """Python's, numpy's and torch's global generators from the case's seed, so an implementation
    that draws from them sees the same numbers in the fuzz run and in its replay."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    # torch.manual_seed would also queue seeds for every absent backend (xpu, mtia, and CUDA on
    # a CPU build), formatting a stack trace for each: a millisecond per case.
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def call_implementation(fn: Callable[[], Any], seed: int, device: str,
                        on_call: Callable[[], None] | None = None,
                        watch: guards.Watch | None = None) -> tuple[Any, float]:
    """(fn(), seconds) with poisoned, red-zoned outputs (`optimized.buffers`: a write past one
    fails the call) and seeded generators; anything it raises becomes
    `Raised`, after the device was synchronized, except a KeyboardInterrupt while a SIGINT arrived
    (the user's Ctrl-C). The process-wide state and the judge's functions are put back after the
    call (to `watch`'s, taken once for a block of calls; else `guards.kept_watch`'s; else taken
    now); a change to either is `Raised` with a ContractError. `on_call` runs just before: an
    isolation worker starts the case's clock there. The threads the call left running are named
    in `watch.threads_left` (a note on the case's rows)."""
    seed_globals(seed)
    with contextlib.ExitStack() as stack:
        watch = watch or guards.kept() or stack.enter_context(guards.Watch())
        if on_call is not None:
            on_call()
        error: BaseException | None = None
        threads = threading.enumerate()
        try:
            with guards.sigint_watch() as sigints, poisoned(), red_zones() as zones:
                try:
                    result = timed(fn, device)
                    if broken := breached(zones):
                        raise ContractError("wrote outside the buffers it allocated (red zones): " + "; ".join(broken[:3]))
                except KeyboardInterrupt as exc:
                    if sigints:
                        raise
                    error = exc
                except BaseException as exc:  # SystemExit, GeneratorExit too: the case's failure, not the run's end
                    error = exc
        finally:
            changed, patched = watch.restore()
            watch.threads_left = guards.threads_left(threads)
    if error is not None:
        raise Raised(error, dev.synchronize(device)) from None
    if patched:
        raise Raised(patched_error(patched))
    if changed:
        raise Raised(ContractError(f"changed process-wide state: {'; '.join(changed)} (put back: the cases after it "
                                   "must not inherit it)"))
    return result


def patched_error(patched: list[str], where: str = "") -> ContractError:
    """The failure of a call (`where`: of which calls) that replaced the judge's names `patched`
    (`guards.JudgeFunctions.restore`)."""
    return ContractError(f"replaced {', '.join(patched[:4])}{' ...' if len(patched) > 4 else ''}{where}: the functions "
                         "the judge relies on are not the implementation's to change (put back)")


def after_return_rows(base: dict, changed: list[str], **fields) -> list[Row]:
    """One failing row per output written after its call returned (`guards.Returned.changed`)."""
    return [failure_row(base, name, FailureKind.CONTRACT, f"{name}: {guards.AFTER_RETURN}", **fields) for name in changed]


def noted(rows: list[Row], threads: list[str]) -> list[Row]:
    """`rows` of a case whose call left the threads named `threads` running, each with a note saying so."""
    if threads:
        note = f"note: the call left {len(threads)} thread(s) running ({', '.join(threads[:3])})"
        for r in rows:
            r.reason = f"{r.reason}; {note}" if r.reason else note
    return rows


def input_rows(base: dict, written: list[tuple[str, str]], **fields) -> list[Row]:
    """One failing row per input the implementation wrote (`Snapshot.changed`: tensor "input:NAME")."""
    return [failure_row(base, f"input:{name}", FailureKind.INPUT_WRITTEN, reason, written=name, **fields)
            for name, reason in written]


def judged_row(base: dict, tensor: str, kind: str, v: Verdict, **fields) -> Row:
    """One compared tensor's row, of kind `kind` (equivalence.judge.rows): its metrics and the oracle's verdict."""
    return Row(**base, tensor=tensor, kind=kind, metrics=v.metrics, gate_metric=v.gate_metric, value=v.value,
               bound=v.bound, headroom=v.headroom, deviation=v.deviation, passed=v.passed, reason=v.reason, **fields)
