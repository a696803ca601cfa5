"""Run one property case: build its problems, call the implementation, hold its answers to each
other under the policy's property rules, one Row per compared tensor.

As in `equivalence.evaluate`, the implementation runs on poisoned outputs with seeded generators and
may raise (a failure of the case, one row); every stage call is guarded (`equivalence.contract`:
inputs read-only, no output aliasing an input); the problems are built before it runs, so a
harness error stays ours.
`mismatch_frac` of a property row is the fraction of elements that differ bit for bit, whatever
the bound (0: the property held bitwise); float64 answers (a merge) have no bits to compare (NaN).
Zeros are compared without their sign: a sum that starts from +0 (a merge, a block of invalid
keys folded in) turns -0 into +0, and the sign of a zero is not a value.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from mla_verify.equivalence import metrics as M
from mla_verify.equivalence.case import Case
from mla_verify.equivalence.contract import Snapshot, guarded
from mla_verify.equivalence.evaluate import Raised, call_implementation, identity, input_rows, judged_row, raised_row
from mla_verify.equivalence.oracle import measure, verdict
from mla_verify.equivalence.policy import EXACT, property_bounds
from mla_verify.equivalence.rows import Row
from mla_verify.equivalence.subject import Subject
from mla_verify.optimized import registry

from . import get_property


def _unsigned_zeros(t: torch.Tensor) -> torch.Tensor:
    return t + 0 if t.is_floating_point() else t  # -0 + 0 = +0; all else, infinities and NaN too, unchanged


def evaluate_property(
    case: Case, subject: Subject, device: str = "cpu", *, run_id: str = "", source: str = "fuzz",
    notes: set[str] | None = None, on_call: Callable[[], None] | None = None,
) -> list[Row]:
    """Every tensor property `case` compares, as a Row (a single failure row if the implementation
    raised); `notes` collects the stages that fell back from their preferred implementation;
    `on_call` runs just before the implementation is first called."""
    prop = get_property(case.op)
    params = case.params
    target = prop.targets[params["target"]]
    stages = registry.resolve(target.stages(params), device.split(":")[0], subject.overrides)
    deviations = sorted({d for impl in stages.chosen.values() for d in impl.deviations})
    base = dict(run_id=run_id, case_id=case.case_id, impl=subject.label, stages=stages.describe(), device=device,
                seed=case.seed, source=source, **identity(case))
    inputs = target.inputs(params, case.seed, device)
    saved = Snapshot(inputs)
    try:
        compared, t_impl = call_implementation(lambda: target.check(inputs, params, guarded(stages)), case.seed,
                                               device, on_call)
    except Raised as raised:  # the implementation's failure is the case's result, not ours
        return [raised_row(base, raised)]
    if notes is not None:
        notes.update(f"{stage}: {why}" for stage, why in stages.fallbacks.items())
    rows = input_rows(base, saved, (), time_impl_s=t_impl)
    for c in compared:
        kind, bounds, deviation = property_bounds(f"{prop.name}.{c.check}", c.kind, deviations)
        got, want = _unsigned_zeros(c.got), _unsigned_zeros(c.base)
        m = measure(kind, got, want, c.scale)
        if kind != EXACT:
            m.mismatch_frac = M.exact(got, want).mismatch_frac if got.dtype == want.dtype else math.nan
        rows.append(judged_row(base, f"{c.check}.{c.tensor}", "exact" if kind == EXACT else c.tensor,
                               verdict(kind, m, bounds, deviation), time_impl_s=t_impl))
    return rows
