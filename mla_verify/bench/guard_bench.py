"""`mla-verify bench --only guards`: what each guard of a case costs (`equivalence.guards`, the
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
                  (`equivalence.wire`)
  journal         the case journaled as started and finished in a run directory
and isolation: the same case (and a small quantize case) evaluated in this process and in an
isolation worker (`equivalence.isolation.Worker`), ms per case each, plus the worker's start and
a replacement after a crash.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
from typing import Callable

from mla_verify.equivalence.case import Case


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

    from mla_verify.equivalence import guards, wire
    from mla_verify.equivalence.catalog import evaluate, get_spec, resolve_subject
    from mla_verify.equivalence.contract import Snapshot
    from mla_verify.equivalence.isolation import Worker
    from mla_verify.optimized.buffers import poisoned

    from mla_verify.runs.rundir import RunDir

    reps = 5 if quick else 20
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    spec = get_spec(case.op)
    params = spec.params_of(case.params)
    subject = resolve_subject(case.op, [], device)
    kwargs = spec.inputs(params, case.seed, device)
    with poisoned():
        got = spec.call(subject, kwargs, params)
    shape = f"{case.short()[:44]}"
    in_mib = sum(t.untyped_storage().nbytes() for t in kwargs.values() if isinstance(t, torch.Tensor)) / 2**20
    out_mib = sum(t.numel() * t.element_size() for t in got.tensors.values()) / 2**20

    def process_state():
        state = guards.ProcessState.now()
        state.restore()
        state.close()

    def judge_functions():
        guards.JudgeFunctions.now().restore()

    watched = guards.JudgeFunctions.now()

    def sigint_watch():
        with guards.sigint_watch():
            pass

    def inputs():
        saved = Snapshot(kwargs)
        saved.changed()
        for name, t in got.tensors.items():
            saved.aliased_by(name, t)

    def owned_outputs():
        guards.owned(got.tensors)

    def after_return():
        guards.Returned.of(got.tensors).changed()

    def message():  # the outputs through a pipe as the worker sends them and the parent reads them
        r, w = os.pipe()
        try:
            frames = wire.encode({"kind": "produced"}, [t.to("cpu") for t in got.tensors.values()])
            writer = threading.Thread(target=wire.write, args=(w, frames))
            writer.start()
            wire.Reader(r, w).read(time.monotonic() + 60)
            writer.join()
        finally:
            os.close(r)
            os.close(w)

    rows = [
        _row(shape, "process_state", _median_ms(process_state, reps, sync), "torch settings, cwd, std streams"),
        _row(shape, "judge_functions", _median_ms(judge_functions, reps, sync),
             f"{sum(len(vars(ns)) for _, ns, _ in guards._judge_namespaces())} names watched"),
        _row(shape, "judge_functions, block", _median_ms(watched.restore, reps, sync),
             "one check of names saved before (a block's, a worker's call's)"),
        _row(shape, "sigint_watch", _median_ms(sigint_watch, reps, sync), "SIGINT handler around the call"),
        _row(shape, "inputs", _median_ms(inputs, reps, sync), f"{in_mib:.1f} MiB of inputs copied, compared"),
        _row(shape, "owned_outputs", _median_ms(owned_outputs, reps, sync), f"{out_mib:.1f} MiB of outputs copied"),
        _row(shape, "after_return", _median_ms(after_return, reps, sync),
             f"{out_mib:.1f} MiB of outputs copied at return and compared back"),
        _row(shape, "message", _median_ms(message, reps, sync),
             f"{out_mib:.1f} MiB of outputs encoded, through a pipe, parsed (isolated)"),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = RunDir.open(f"{tmp}/run")
        try:
            journal = _median_ms(lambda: run_dir.case_started(case, "fuzz", run_id="bench", impl=subject.label,
                                                              specs=(), device=device)(), reps, sync)
        finally:
            run_dir.release()
    rows.append(_row(shape, "journal", journal, "case journaled as started and finished"))
    small = Case("quantize_fp8_ds_mla", {"n": 64, "value_regime": "normal", "scale_rule": "pow2"}, 3)
    for c in (small, case):
        label = c.short()[:44]
        resolved = resolve_subject(c.op, [], device)
        in_process = _median_ms(lambda c=c, resolved=resolved: evaluate(c, resolved, device), reps, sync)
        worker = Worker(device, timeout_s=600)
        try:
            start = time.perf_counter()
            worker.run(c, [], "default")
            first = (time.perf_counter() - start) * 1e3
            isolated = _median_ms(lambda c=c: worker.run(c, [], "default"), reps, sync)
            crashed = 0.0
            if c is small:
                worker.run(c, [f"{__name__}:aborts"], "aborts")
                start = time.perf_counter()
                worker.run(c, [], "default")
                crashed = (time.perf_counter() - start) * 1e3
        finally:
            worker.close()
        note = (f"in-process {in_process:.2f} ms, isolated {isolated:.2f} ms; first case (worker start) {first:.0f} ms"
                + (f"; the case after a crash {crashed:.0f} ms" if crashed else ""))
        rows.append({**_row(label, "isolation", isolated - in_process, note), "in_process_ms": in_process,
                     "isolated_ms": isolated, "first_case_ms": first, "after_crash_ms": crashed or None})
    return rows
