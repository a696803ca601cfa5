"""The oracle: compare one implementation tensor with the reference's and give the verdict.

`judge` measures (equivalence.metrics), looks up the bounds (equivalence.policy) and returns the
metrics plus the gated metric with the least headroom. NaN never passes, and infinities must sit
exactly where the reference has them, whatever the tolerances.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from . import metrics as M
from .mismatch import Pair, describe
from .policy import EXACT, LSE, OUT, Bound, Numerics, bounds_for, limit_for

ELEM_UNITS_FOR_MISMATCH = 4.0  # per-element count reported as mismatch_frac (not gated itself)
ELEM_BOUND = "elem_bound_ratio"  # the metric of the derived per-element bound (equivalence.bounds)


@dataclass
class Verdict:
    metrics: M.Metrics
    passed: bool
    gate_metric: str
    value: float
    bound: float
    headroom: float
    deviation: str
    reason: str


def _value(m: M.Metrics, metric: str) -> float:
    if metric == "abs_mean_err":
        return abs(m.mean_err) if not math.isnan(m.mean_err) else 0.0
    v = getattr(m, metric)
    return 0.0 if isinstance(v, float) and math.isnan(v) else float(v)


def measure(kind: str, impl: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | None = None,
            bound: torch.Tensor | None = None) -> M.Metrics:
    """`scale` (per row): an LSE's logit_l1; an output's value_max (the largest |V| its row
    averages), which sets the size below which an fp32 kernel's weights flush to zero. `bound`
    (ref's shape): the derived per-element bound (equivalence.bounds), for elem_bound_ratio."""
    impl = impl.to(ref.device)  # an implementation may hand back its result on another device
    if impl.shape != ref.shape:
        return M.Metrics(numel=ref.numel(), mismatch_frac=1.0, extra={"shape": f"{tuple(impl.shape)} vs {tuple(ref.shape)}"})
    if kind == EXACT:
        return M.exact(impl, ref)
    if kind == OUT:
        return M.output(impl, ref, ELEM_UNITS_FOR_MISMATCH, scale, bound)
    if kind == LSE:
        return M.lse(impl, ref, scale if scale is not None else torch.zeros_like(ref), bound)
    raise ValueError(f"unknown tensor kind {kind!r}")


def verdict(kind: str, m: M.Metrics, bounds: tuple[Bound, ...], deviation: str, pair: Pair) -> Verdict:
    """The gated metric of `m` with the least headroom under `bounds`, and whether it passes; a
    failure's reason describes the mismatch (`equivalence.mismatch`) from `pair`, its tensors."""
    if "shape" in m.extra:
        return Verdict(m, False, "shape", 1.0, 0.0, 0.0, deviation, f"shape/dtype mismatch: {m.extra['shape']}")
    if kind != EXACT and (m.nan_count or m.inf_mismatch):
        metric = "inf_mismatch" if m.inf_mismatch else "nan_count"
        return Verdict(m, False, metric, float(m.inf_mismatch or m.nan_count), 0.0, 0.0, deviation,
                       describe(kind, pair, m, bounds, metric))
    worst: tuple[float, Bound, float, float] | None = None
    for b in bounds:
        v, limit = _value(m, b.metric), limit_for(b, m.rows)
        room = math.inf if v == 0 else (limit / v if limit > 0 else 0.0)
        if worst is None or room < worst[0]:
            worst = (room, b, v, limit)
    room, bound, value, limit = worst
    passed = value <= limit
    reason = "" if passed else describe(kind, pair, m, bounds, bound.metric)
    return Verdict(m, passed, bound.metric, value, limit, room, deviation, reason)


def judge(
    kind: str,
    impl: torch.Tensor,
    ref: torch.Tensor,
    case: Numerics,
    deviations: Iterable[str] = (),
    scale: torch.Tensor | None = None,
    bound: Mapping[str, torch.Tensor] | None = None,
    name: str = "",
) -> Verdict:
    """`impl` against `ref` as a tensor of `kind`, under the bounds for `case`'s numerics.

    `bound`: the reference's derived per-element bounds of this tensor by the deviation they
    allow for ("" none: `equivalence.ops.base.Check.bound`). The elem_bound_ratio bound applies
    only where the reference derived one for the deviation that set the bounds. `name`: the
    tensor's (out, lse, max_logits), for the failure's description."""
    bounds, deviation = bounds_for(kind, case, deviations)
    tensor = None if bound is None else bound.get(deviation)
    if tensor is None:
        bounds = tuple(b for b in bounds if b.metric != ELEM_BOUND)
    return verdict(kind, measure(kind, impl, ref, scale, tensor), bounds, deviation,
                   Pair(name or kind, impl, ref, scale, tensor))


def judge_many(kind, impls, ref, case, deviations=(), scale=None, bound=None, name=""):  # placeholder: batched version coming
    return [judge(kind, impl, ref[i], case, deviations, None if scale is None else scale[i],
                  None if bound is None else {k: v[i] for k, v in bound.items()}, name) for i, impl in enumerate(impls)]
