"""`mla-verify bench --only guards`: what each guard of a case costs (`equivalence.sandbox.guards`, the
reference's snapshot, the case journal) and what isolating a case costs, in ms per case.

Each guard is timed alone on a production-sized case (the harness section's decode case: B=64
s_q=2 H=128 on a GPU, B=2 H=16 on a CPU), median of `reps` runs:
  process_state   torch's process-wide settings, the working directory and the standard streams,
                  saved and compared back (`ProcessState`)
  judge_functions the judge's functions saved and checked (`JudgeFunctions`): a case alone, and one
                  check of saved ones (a block checks once, after its last call; an isolation
                  worker saves them once and checks after each call: `Watch`)
  sigint_watch    the SIGINT handler around the call
  inputs          the inputs copied and compared back, and the outputs checked for sharing their
                  storage (`Snapshot(inputs)`)
  owned_outputs   a copy of the kernel's outputs (what a stage call hands on inside a pipeline or
                  property)
  after_return    the outputs copied at return and compared back after the judge (a write after
                  return: `guards.Returned`)
  message         the outputs as an isolation worker sends them: encoded, through a pipe, parsed
                  (`equivalence.sandbox.wire`); ", segment": their bytes through the outputs segment, the
                  header through the pipe (`equivalence.sandbox.segment`); then 1-64 MiB messages each way
  inputs built    the case's inputs built from its seed (an isolation worker's work before issue
                  41), against "inputs handed over": written into the inputs segment by the parent,
                  viewed by the worker, compared back after the call
  journal         the case journaled as started and finished in a run directory
and isolation: the same case (and a small quantize case) evaluated in this process and in an
isolation worker (`equivalence.blocks.Judging`), ms per case each, plus the worker's start and
a replacement after a crash.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Callable

from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.sandbox import boundary
from mla_verify.equivalence.judge.rows import RowContext


def aborts(kv, scale_rule="pow2"):
    """A quantize_fp8_ds_mla that takes its process down: the crash whose replacement is timed."""
    os.abort()


def _median_ms(fn: Callable[[], object], reps: int, sync: Callable[[], None]) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _row(shape: str, guard: str, ms: float, note: str) -> dict:
    return {"kind": "guard", "shape": shape, "impl": guard, "ms": ms, "ops_note": note}


def bench_guards(device: str, case: Case, quick: bool) -> list[dict]:
    """One row per guard of `case` (a production-sized op case) and per isolation measurement."""
    import torch

    from mla_verify.equivalence.catalog import get_spec, resolve_subject
    from mla_verify.optimized.buffers import poisoned

    reps = 5 if quick else 20
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    spec = get_spec(case.op)
    params = spec.params_of(case.params)
    subject = resolve_subject(case.op, [], device)
    kwargs = spec.inputs(params, case.seed, device)
    with poisoned():
        got = spec.call(subject, kwargs, params)
    shape = f"{case.short()[:44]}"

    def timer(fn: Callable[[], object]) -> float:
        return _median_ms(fn, reps, sync)

    rows = _guard_rows(shape, kwargs, got.tensors, timer)
    rows += _message_rows(shape, [t.to("cpu") for t in got.tensors.values()], timer)
    rows += _hand_over_rows(shape, lambda: spec.inputs(params, case.seed, device), kwargs, spec.writes, device, timer)
    rows.append(_row(shape, "journal", _journal_ms(case, subject, device, timer), "case journaled as started and finished"))
    return rows + _isolation_rows(case, device, timer) + _sandbox_rows(device, reps)


def _guard_rows(shape: str, kwargs: dict, outputs: dict, timer: Callable) -> list[dict]:
    """The guards around a call: process state, the judge's functions, SIGINT, the inputs'
    snapshot, the outputs' copies."""
    import torch

    from mla_verify.equivalence.sandbox import guards
    from mla_verify.equivalence.sandbox.call_guards import Snapshot

    in_mib = sum(t.untyped_storage().nbytes() for t in kwargs.values() if isinstance(t, torch.Tensor)) / 2**20
    out_mib = sum(t.numel() * t.element_size() for t in outputs.values()) / 2**20

    def process_state():
        state = guards.ProcessState.now()
        state.restore()
        state.close()

    def sigint_watch():
        with guards.sigint_watch():
            pass

    def inputs():
        saved = Snapshot(kwargs)
        saved.changed()
        for name, t in outputs.items():
            saved.aliased_by(name, t)

    watched = guards.JudgeFunctions.now()
    return [
        _row(shape, "process_state", timer(process_state), "torch settings, cwd, std streams"),
        _row(shape, "judge_functions", timer(lambda: guards.JudgeFunctions.now().restore()),
             f"{sum(len(vars(ns)) for _, ns, _ in guards._judge_namespaces())} names watched"),
        _row(shape, "judge_functions, block", timer(watched.restore),
             "one check of names saved before (a block's, a worker's call's)"),
        _row(shape, "sigint_watch", timer(sigint_watch), "SIGINT handler around the call"),
        _row(shape, "inputs", timer(inputs), f"{in_mib:.1f} MiB of inputs copied, compared"),
        _row(shape, "owned_outputs", timer(lambda: guards.owned(outputs)), f"{out_mib:.1f} MiB of outputs copied"),
        _row(shape, "after_return", timer(lambda: guards.Returned.of(outputs).changed()),
             f"{out_mib:.1f} MiB of outputs copied at return and compared back"),
    ]


def _message(tensors: list, out=None, into=None) -> None:
    """`tensors` as a worker sends them (through the outputs segment `out`, mapped by the worker as
    `into`, where given) and as its parent reads them."""
    from mla_verify.equivalence.sandbox import wire

    r, w = os.pipe()
    try:
        frames = wire.encode({"kind": "produced"}, tensors, into)
        writer = threading.Thread(target=wire.write, args=(w, frames))
        writer.start()
        wire.Reader(r, w, out).read(time.monotonic() + 60)
        writer.join()
    finally:
        os.close(r)
        os.close(w)


def _message_rows(shape: str, outputs: list, timer: Callable) -> list[dict]:
    """The case's outputs as a worker answers, through the pipe and through the outputs segment,
    then random float32 messages of 1 to 64 MiB each way: ms against MiB."""
    import torch

    from mla_verify.equivalence.sandbox import segment

    sizes = [("", outputs)] + [(f" {mib} MiB", [torch.randn(mib << 18, generator=torch.Generator().manual_seed(mib))])
                               for mib in (1, 4, 16, 64)]
    rows = []
    for label, tensors in sizes:
        mib = sum(t.numel() * t.element_size() for t in tensors) / 2**20
        out = segment.Segment.create(2 * sum(segment.aligned(t.numel() * t.element_size()) for t in tensors), False)
        into = segment.Mapped(out.describe(), os.dup(out.fd)) if out is not None else None  # the worker maps it once
        try:
            rows.append(_row(shape, f"message{label}", timer(lambda: _message(tensors)),
                             f"{mib:.1f} MiB encoded, through a pipe, parsed (isolated, before issue 41)"))
            if out is not None:
                rows.append(_row(shape, f"message{label}, segment", timer(lambda: _message(tensors, out, into)),
                                 f"{mib:.1f} MiB written to the shared segment, header through the pipe, copied out"))
        finally:
            if into is not None:
                into.close()
            del into
            if out is not None:
                out.close()
    return rows


def _hand_over_rows(shape: str, build: Callable, kwargs: dict, writes, device: str, timer: Callable) -> list[dict]:
    """A case's inputs built from its seed (what a worker did besides its parent), against handed
    over: written into the inputs segment, viewed by the worker, compared back after the call."""
    from mla_verify.equivalence.sandbox import segment

    kept: list = [None]

    def hand_over():
        kept[0], handed = segment.hand_over(kwargs, kept[0])
        if handed is not None:
            mapped = segment.Mapped(kept[0].describe(), os.dup(kept[0].fd))  # as the worker holds it, handed over
            segment.inputs_of(handed.described, mapped, device)
            mapped.close()
            segment.written(kept[0], handed, writes)

    rows = [_row(shape, "inputs built", timer(build), "the case's inputs built from its seed (the worker's, before)")]
    try:
        rows.append(_row(shape, "inputs handed over", timer(hand_over),
                         "written to the inputs segment, viewed by the worker, compared back (isolated, issue 41)"))
    finally:
        if kept[0] is not None:
            kept[0].close()
    return rows


def _journal_ms(case: Case, subject, device: str, timer: Callable) -> float:
    from mla_verify.runs.rundir import RunDir

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = RunDir.open(f"{tmp}/run")
        try:
            return timer(lambda: run_dir.case_started(case, RowContext("bench", "fuzz", subject.label, device), ())())
        finally:
            run_dir.release()


def _isolation_rows(case: Case, device: str, timer: Callable) -> list[dict]:
    """`case` (and a small quantize case) evaluated in this process and in an isolation worker:
    ms per case each, the worker's first case and the case after a crash."""
    from mla_verify.equivalence.blocks import Judging
    from mla_verify.equivalence.catalog import evaluate, resolve_subject

    rows = []
    small = Case("quantize_fp8_ds_mla", {"n": 64, "value_regime": "normal", "scale_rule": "pow2"}, 3)
    for c in (small, case):
        label = c.short()[:44]
        resolved = resolve_subject(c.op, [], device)
        in_process = timer(lambda c=c, resolved=resolved: evaluate(c, resolved, device))
        with Judging(device, isolate=True, timeout=600) as judging:
            default = judging.subject(c.op)
            start = time.perf_counter()
            judging.case(c, default)
            first = (time.perf_counter() - start) * 1e3
            isolated = timer(lambda c=c: judging.case(c, default))
            crashed = 0.0
            if c is small:
                judging.case(c, judging.subject(c.op, [f"{__name__}:aborts"]))
                start = time.perf_counter()
                judging.case(c, default)
                crashed = (time.perf_counter() - start) * 1e3
        note = (f"in-process {in_process:.2f} ms, isolated {isolated:.2f} ms; first case (worker start) {first:.0f} ms"
                + (f"; the case after a crash {crashed:.0f} ms" if crashed else ""))
        rows.append({**_row(label, "isolation", isolated - in_process, note), "in_process_ms": in_process,
                     "isolated_ms": isolated, "first_case_ms": first, "after_crash_ms": crashed or None})
    return rows


def _enter_ms(device: str, reps: int) -> float:
    """The median ms of `boundary.enter("auto")` (scratch directory, session, user namespace,
    no_new_privs, Landlock, seccomp), each in a child forked from this process."""
    times = []
    for _ in range(reps):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            start = time.perf_counter()
            fence = boundary.enter("auto", device, ())
            os.write(w, f"{(time.perf_counter() - start) * 1e3} {fence.scratch}".encode())
            os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            ms, scratch = f.read().split(" ", 1)
        os.waitpid(pid, 0)
        shutil.rmtree(scratch, ignore_errors=True)
        times.append(float(ms))
    return statistics.median(times)


def _sandbox_rows(device: str, reps: int) -> list[dict]:
    """A small quantize case in a worker behind no sandbox and one behind "auto", both alive and
    timed in turn (a loaded machine's drift falls on both alike): ms per case (median), the first
    case (the worker's start), the case after a crash; and the layers' set-up alone."""
    from mla_verify.equivalence.blocks import Judging

    small = Case("quantize_fp8_ds_mla", {"n": 64, "value_regime": "normal", "scale_rule": "pow2"}, 3)
    modes = ("off", "auto")
    workers = {mode: Judging(device, isolate=True, timeout=600, sandbox=mode) for mode in modes}

    def timed(judging: Judging, specs: list[str]) -> float:
        subject = judging.subject(small.op, specs)
        start = time.perf_counter()
        judging.case(small, subject)
        return (time.perf_counter() - start) * 1e3

    try:
        first = {mode: timed(w, []) for mode, w in workers.items()}
        per_case: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(2 * reps):
            for mode, w in workers.items():
                per_case[mode].append(timed(w, []))
        crashed = {mode: (timed(w, [f"{__name__}:aborts"]), timed(w, []))[1] for mode, w in workers.items()}
        fences = {mode: w.summary() for mode, w in workers.items()}
    finally:
        for w in workers.values():
            w.close()
    rows, ms = [], {mode: statistics.median(per_case[mode]) for mode in modes}
    for mode in modes:
        rows.append({**_row(small.short()[:44], f"sandbox {mode}", ms[mode],
                            f"{fences[mode]}; first case (worker start) {first[mode]:.0f} ms; the case after a crash "
                            f"{crashed[mode]:.0f} ms"),
                     "isolated_ms": ms[mode], "first_case_ms": first[mode], "after_crash_ms": crashed[mode]})
    rows.append(_row(small.short()[:44], "sandbox cost", ms["auto"] - ms["off"],
                     f"per case {ms['auto'] - ms['off']:+.2f} ms, worker start {first['auto'] - first['off']:+.0f} ms, "
                     f"after a crash {crashed['auto'] - crashed['off']:+.0f} ms (auto against off, timed in turn)"))
    if sys.platform.startswith("linux"):
        rows.append(_row("boundary.enter", "sandbox set-up", _enter_ms(device, 10),
                         "the layers set up alone, in a forked child (once per worker, before any user code)"))
    return rows
