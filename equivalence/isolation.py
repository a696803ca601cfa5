"""Crash isolation: run cases in a worker process that is replaced when it dies or hangs.

A CUDA illegal address poisons the whole context, and a kernel can spin forever; either way the
campaign must record the case as failed and go on. The worker receives (case, --impl specs,
declared deviations), evaluates it with `equivalence.evaluate`, and sends back plain row dicts.
If it exits, is killed by a signal, or does not answer within the timeout, the parent kills it,
starts a fresh one for the next case, and returns a single failure row ("crashed" / "hung").
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from typing import Sequence

from .case import Case
from .evaluate import identity
from .rows import Row


def _serve(conn, device: str) -> None:
    if not device.startswith("cuda"):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from .evaluate import evaluate
    from .subject import resolve_subject

    subjects = {}
    while True:
        msg = conn.recv()
        if msg is None:
            return
        case_dict, specs, deviations, run_id, source = msg
        case = Case.from_dict(case_dict)
        key = (case.op, tuple(specs), tuple(deviations))
        if key not in subjects:
            subjects[key] = resolve_subject(case.op, specs, device.split(":")[0], deviations=deviations)
        notes: set[str] = set()
        try:
            rows = evaluate(case, subjects[key], device, run_id=run_id, source=source, notes=notes)
        except Exception:  # the harness's own error (inputs, reference): the parent re-raises it
            conn.send(("error", traceback.format_exc()))
            continue
        conn.send(("rows", ([r.to_record() for r in rows], sorted(notes))))


class Worker:
    """One isolated evaluation process for `device` (e.g. "cuda:0")."""

    def __init__(self, device: str, timeout_s: float = 300.0):
        self.device, self.timeout_s = device, timeout_s
        self._proc = None
        self._conn = None
        self.restarts = 0

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, self.device), daemon=True)
        self._proc.start()
        child.close()

    def _kill(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
        if self._proc is not None:
            self._proc.join(5)
        self._proc = None

    def run(
        self, case: Case, specs: Sequence[str], label: str, run_id: str = "", source: str = "fuzz",
        notes: set[str] | None = None, deviations: Sequence[str] = (),
    ) -> list[Row]:
        if self._proc is None:
            self._start()
        self._conn.send((case.to_dict(), list(specs), list(deviations), run_id, source))
        if self._conn.poll(self.timeout_s):
            try:
                kind, payload = self._conn.recv()
            except (EOFError, ConnectionResetError):
                kind, payload = "died", None
            if kind == "rows":
                records, reported = payload
                if notes is not None:
                    notes.update(reported)
                return [Row(**d) for d in records]
            if kind == "error":
                raise RuntimeError(f"harness error in the worker on {case.short()}:\n{payload}")
            self._proc.join(5)
            code = self._proc.exitcode
            what = f"the worker process died (exit code {code}{', a signal' if code is not None and code < 0 else ''})"
        else:
            what = f"hung: no answer within {self.timeout_s:g} s"
        self._kill()
        self.restarts += 1
        return [Row(run_id=run_id, case_id=case.case_id, tensor="*", impl=label, stages="", device=self.device,
                    seed=case.seed, source=source, passed=False, gate_metric="crashed", value=1.0, bound=0.0,
                    headroom=0.0, reason=what, **identity(case))]

    def close(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            try:
                self._conn.send(None)
                self._proc.join(10)
            except (BrokenPipeError, OSError):
                pass
        self._kill()
