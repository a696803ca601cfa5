"""Run one Case: build its inputs, ask the reference, call the implementation, judge each tensor.

The implementation runs after the reference, on its own poisoned outputs
(`optimized.buffers.poisoned`), and may raise: that is a failure of the case (reason "raised"),
never of the harness. Inputs the case generator builds are valid by contract, so a refusal
(InputError) is a failure too.
"""

from __future__ import annotations

import time
import traceback

import torch

from mla_verify.optimized.buffers import poisoned

from .case import Case
from .oracle import Verdict, judge
from .ops import get_op
from .policy import EXACT
from .properties import get_property, is_property
from .rows import Row
from .subject import Subject


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device):
    """(fn(), seconds it took, the device synchronized on both sides)."""
    _sync(device)
    start = time.perf_counter()
    result = fn()
    _sync(device)
    return result, time.perf_counter() - start


def identity(case: Case) -> dict:
    """The op, path and knob columns of `case`'s rows (a property's op column reads "property")."""
    if is_property(case.op):
        prop = get_property(case.op)
        return dict(op="property", path=prop.name, **prop.knobs(case.params))
    spec = get_op(case.op)
    return dict(op=case.op, path=spec.path_of(case.params), **spec.knobs(case.params))


def raised_row(base: dict, exc: Exception, **fields) -> Row:
    """The single failure row of a case whose implementation raised."""
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    reason = f"raised {type(exc).__name__}: {exc} (at {frame.filename}:{frame.lineno})"
    return Row(**base, tensor="*", passed=False, gate_metric="raised", value=1.0, bound=0.0, headroom=0.0,
               reason=reason, **fields)


def judged_row(base: dict, tensor: str, kind: str, v: Verdict, **fields) -> Row:
    """One compared tensor's row: its metrics and the oracle's verdict."""
    m = v.metrics
    return Row(
        **base, tensor=tensor, exact=kind == EXACT,
        numel=m.numel, ref_rms=m.ref_rms, rel_l2=m.rel_l2, cos_dist=m.cos_dist, max_abs=m.max_abs,
        max_abs_at=m.max_abs_at, mismatch_frac=m.mismatch_frac, mean_err=m.mean_err,
        bf16_units=m.bf16_units, elem_bf16_units=m.elem_bf16_units, lse_fp32_units=m.lse_fp32_units,
        nan_count=m.nan_count, inf_mismatch=m.inf_mismatch,
        gate_metric=v.gate_metric, value=v.value, bound=v.bound, headroom=v.headroom,
        deviation=v.deviation, passed=v.passed, reason=v.reason, **fields,
    )


def evaluate(
    case: Case, subject: Subject, device: str = "cpu", *, run_id: str = "", source: str = "fuzz",
    notes: set[str] | None = None,
) -> list[Row]:
    """Every checked tensor of `case` as a Row (a single failure row if the implementation raised).

    `notes` collects what the implementation side reported, e.g. a stage that fell back to a
    portable implementation because the preferred one cannot run on this device. A property case
    (`property:NAME`) runs the implementation against itself (equivalence.properties).
    """
    if is_property(case.op):
        from .properties.run import evaluate_property  # it builds on this module's helpers

        return evaluate_property(case, subject, device, run_id=run_id, source=source, notes=notes)
    spec = get_op(case.op)
    params = case.params
    base = dict(run_id=run_id, case_id=case.case_id, impl=subject.label, stages="", device=device, seed=case.seed,
                source=source, **identity(case))
    kwargs = spec.inputs(params, case.seed, device)
    ref, t_ref = timed(lambda: spec.reference(kwargs, params), device)
    try:
        with poisoned():
            got, t_impl = timed(lambda: spec.call(subject, kwargs, params), device)
    except Exception as exc:  # the implementation's failure is the case's result, not ours
        return [raised_row(base, exc, time_ref_s=t_ref)]
    if notes is not None:
        notes.update(got.notes)
    rows = []
    for check in spec.checks:
        if check.tensor not in ref or (check.optional and check.tensor not in got.tensors):
            continue  # not asked for by this case, or not produced by this implementation
        if check.tensor not in got.tensors:
            rows.append(Row(**{**base, "stages": got.stages}, tensor=check.tensor, passed=False, gate_metric="missing",
                            reason=f"the implementation returned no {check.tensor!r}", time_ref_s=t_ref, time_impl_s=t_impl))
            continue
        scale = ref.get(check.scale) if check.scale else None
        judged_as = {**params, "dcp_size": 1} if check.single_rank else params
        v = judge(check.kind, got.tensors[check.tensor], ref[check.tensor], judged_as, got.deviations, scale)
        rows.append(judged_row({**base, "path": got.path or base["path"], "stages": got.stages}, check.tensor,
                               check.kind, v, time_ref_s=t_ref, time_impl_s=t_impl))
    return rows
