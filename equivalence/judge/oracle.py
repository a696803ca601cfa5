"""The oracle: compare one implementation tensor with the reference's and give the verdict.

`judge` measures (equivalence.judge.metrics), looks up the bounds (equivalence.judge.policy) and returns the
metrics plus the gated metric with the least headroom; `judge_many` does so for a block of cases
of one shape at once. NaN never passes, and infinities must sit
exactly where the reference has them, whatever the tolerances.

Two judges measure attention outputs: the eager one (torch ops, the reference of the judge) and
the fused one (`equivalence.judge.fused`: one Triton pass). `use_judge` picks: "auto" (the
default) fuses on a GPU and stays eager on a CPU, where Triton runs interpreted. A case the fused
judge fails, or puts within a millionth of a limit, is measured again by the eager judge, whose
row and message it gets: a failure always reads as the eager judge says it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import torch

from ..cases.numerics import Numerics
from . import fused as fused_judge, metrics as M
from .localize import Axes
from .mismatch import Pair, describe
from .policy import EXACT, LSE, OUT, Bound, Kind, bounds_for, limit_for

ELEM_UNITS_FOR_MISMATCH = 4.0  # per-element count reported as mismatch_frac (not gated itself)
ELEM_BOUND = "elem_bound_ratio"  # the metric of the derived per-element bound (equivalence.judge.bounds)
JUDGES = ("auto", "fused", "eager")
JUDGE_ENV = "MLA_VERIFY_JUDGE"  # the choice, read by this process and the ones it starts (--parallel parts)


def use_judge(name: str) -> None:
    """Judge attention outputs with `name`, one of JUDGES, from now on, here and in the processes
    started from here."""
    if name not in JUDGES:
        raise ValueError(f"unknown judge {name!r}; known: {', '.join(JUDGES)}")
    os.environ[JUDGE_ENV] = name


def fused_on(device: torch.device) -> bool:
    """Whether the fused judge measures outputs on `device` under the judge in use."""
    name = os.environ.get(JUDGE_ENV, "auto")
    if name not in JUDGES:
        raise ValueError(f"{JUDGE_ENV}={name!r}: not one of {', '.join(JUDGES)}")
    return name == "fused" or (name == "auto" and device.type == "cuda")


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


class Comparison:
    """How a tensor of one kind is held to the reference's (torch.testing's `Pair`, a class a
    kind): its measure over a block of cases that fit the reference's shape, whether NaN and
    misplaced infinities fail before any bound, whether the fused judge can measure it."""

    kind: Kind
    gates_nonfinite = True
    fusable = False

    def measure(self, impls: Sequence[torch.Tensor], ref: torch.Tensor, scale: torch.Tensor | None,
                bound: torch.Tensor | None, fused: bool) -> list[M.Metrics]:
        raise NotImplementedError


def _stacked(impls: Sequence[torch.Tensor]) -> torch.Tensor:
    # stack promotes mixed dtypes to the widest, which may round an integer: mixed, each is read as float64
    return torch.stack(list(impls) if len({t.dtype for t in impls}) == 1 else [t.double() for t in impls])


class ExactComparison(Comparison):
    """Bit for bit (`metrics.exact`): NaN and infinities are bits like any other."""

    kind, gates_nonfinite = EXACT, False

    def measure(self, impls, ref, scale, bound, fused):
        return [M.exact(impl, r) for impl, r in zip(impls, ref)]


class OutComparison(Comparison):
    """An attention output, in bf16 rounding units of its rows (`metrics.outputs`)."""

    kind, fusable = OUT, True

    def measure(self, impls, ref, scale, bound, fused):
        return M.outputs(_stacked(impls), ref, ELEM_UNITS_FOR_MISMATCH, scale, bound, fused=fused)


class LseComparison(Comparison):
    """A log-sum-exp, in fp32 steps of its row's logit scale (`metrics.lses`)."""

    kind = LSE

    def measure(self, impls, ref, scale, bound, fused):
        return M.lses(_stacked(impls), ref, scale if scale is not None else torch.zeros_like(ref), bound)


COMPARISONS: dict[str, Comparison] = {c.kind: c for c in (ExactComparison(), OutComparison(), LseComparison())}


def comparison(kind: str) -> Comparison:
    if kind not in COMPARISONS:
        raise ValueError(f"unknown tensor kind {kind!r}")
    return COMPARISONS[kind]


def measure(kind: str, impl: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | None = None,
            bound: torch.Tensor | None = None) -> M.Metrics:
    """`scale` (per row): an LSE's logit_l1; an output's value_max (the largest |V| its row
    averages), which sets the size below which an fp32 kernel's weights flush to zero. `bound`
    (ref's shape): the derived per-element bound (equivalence.judge.bounds), for elem_bound_ratio."""
    return measure_many(kind, [impl], ref[None], None if scale is None else scale[None],
                        None if bound is None else bound[None])[0]


def measure_many(kind: str, impls: Sequence[torch.Tensor], ref: torch.Tensor, scale: torch.Tensor | None = None,
                 bound: torch.Tensor | None = None, fused: bool = False) -> list[M.Metrics]:
    """`measure` of each impls[i] against ref[i] (`scale`, `bound`: [C, ...] or None), the cases
    of one shape (a fuzz block's) measured together: one set of ops and one read back for all.
    `fused`: outputs by the fused judge (equivalence.judge.fused)."""
    compare = comparison(kind)
    impls = [impl.to(ref.device) for impl in impls]  # an implementation may hand back its result on another device
    shape = ref.shape[1:]
    out = [M.Metrics(numel=math.prod(shape), mismatch_frac=1.0, shape=f"{tuple(impl.shape)} vs {tuple(shape)}")
           for impl in impls]
    fit = [i for i, impl in enumerate(impls) if impl.shape == shape]
    if not fit:
        return out
    if len(fit) < len(impls):
        at = torch.tensor(fit, device=ref.device)
        ref, scale, bound = (None if t is None else t.index_select(0, at.to(t.device)) for t in (ref, scale, bound))
    for i, m in zip(fit, compare.measure([impls[i] for i in fit], ref, scale, bound, fused)):
        out[i] = m
    return out


def verdict(kind: str, m: M.Metrics, bounds: tuple[Bound, ...], deviation: str, pair: Callable[[], Pair]) -> Verdict:
    """The gated metric of `m` with the least headroom under `bounds`, and whether it passes; a
    failure's reason describes the mismatch (`equivalence.judge.mismatch`) from `pair()`, its tensors
    (called only for a failure)."""
    if m.shape:
        return Verdict(m, False, "shape", 1.0, 0.0, 0.0, deviation, f"shape/dtype mismatch: {m.shape}")
    if comparison(kind).gates_nonfinite and (m.nan_count or m.inf_mismatch):
        metric = "inf_mismatch" if m.inf_mismatch else "nan_count"
        return Verdict(m, False, metric, float(m.inf_mismatch or m.nan_count), 0.0, 0.0, deviation,
                       describe(kind, pair(), m, bounds, metric))
    worst: tuple[float, Bound, float, float] | None = None
    for b in bounds:
        v, limit = _value(m, b.metric), limit_for(b, m.rows)
        room = math.inf if v == 0 else (limit / v if limit > 0 else 0.0)
        if worst is None or room < worst[0]:
            worst = (room, b, v, limit)
    room, bound, value, limit = worst
    passed = value <= limit
    reason = "" if passed else describe(kind, pair(), m, bounds, bound.metric)
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
    axes: Axes | None = None,
) -> Verdict:
    """`impl` against `ref` as a tensor of `kind`, under the bounds for `case`'s numerics.

    `bound`: the reference's derived per-element bounds of this tensor by the deviation they
    allow for ("" none: `equivalence.ops.base.Check.bound`). The elem_bound_ratio bound applies
    only where the reference derived one for the deviation that set the bounds. `name`: the
    tensor's (out, lse, max_logits), `axes` its dimensions' names, for the failure's description."""
    return judge_many(kind, [impl], ref[None], case, deviations, None if scale is None else scale[None],
                      None if bound is None else {k: v[None] for k, v in bound.items()}, name, lambda i: axes)[0]


def judge_many(
    kind: str,
    impls: Sequence[torch.Tensor],
    ref: torch.Tensor,
    case: Numerics,
    deviations: Iterable[str] = (),
    scale: torch.Tensor | None = None,
    bound: Mapping[str, torch.Tensor] | None = None,
    name: str = "",
    axes: Callable[[int], Axes | None] | None = None,
) -> list[Verdict]:
    """`judge` of each impls[i] against ref[i] (`ref`, `scale` and each `bound` [C, ...]: the
    cases of a fuzz block, which share their params), measured together (`measure_many`);
    `axes(i)`: the names of case i's dimensions (`localize`), asked for a failure only."""
    bounds, deviation = bounds_for(kind, case, deviations)
    tensor = None if bound is None else bound.get(deviation)
    if tensor is None:
        bounds = tuple(b for b in bounds if b.metric != ELEM_BOUND)
    fused = comparison(kind).fusable and fused_on(ref.device)

    def judged(i: int, m: M.Metrics) -> Verdict:
        # A case's Pair (views of the block) is built only for a failure's description.
        return verdict(kind, m, bounds, deviation,
                       lambda: Pair(name or kind, impls[i], ref[i], None if scale is None else scale[i],
                                    None if tensor is None else tensor[i], None if axes is None else axes(i)))

    verdicts = [judged(i, m) for i, m in enumerate(measure_many(kind, impls, ref, scale, tensor, fused))]
    for i, v in enumerate(verdicts):
        if fused and (not v.passed or fused_judge.near(v.value, v.bound)):  # the eager judge decides
            m = measure_many(kind, [impls[i]], ref[i:i + 1], *(None if t is None else t[i:i + 1] for t in (scale, tensor)))
            verdicts[i] = judged(i, m[0])
    return verdicts
