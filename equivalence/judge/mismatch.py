"""What a failing comparison shows, as `torch.testing.assert_close` says it: how many elements lie
outside their allowed difference, the worst one's position with the kernel's value, the
reference's and the allowed difference; for an LSE the ratio or offset a convention leaves (base 2,
-inf for an empty row, a constant shift); for +inf/-inf/NaN every pattern that differs, counted,
with its first position.

Positions are named along the tensor's axes where its check knows them (`Pair.axes`), and one
clause says where the differing elements are confined (`localize.where`).

`describe` runs only for a failing tensor, with its tensors at hand (a passing case pays nothing),
and its text is the row's reason. `line` is how every front end (the CLI's fuzz and replay,
`check()`'s report, JUnit) prints a failing row. The bound's own reason is `mla-verify list
--tolerances --long`'s, not every failure's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce

import torch

from .localize import Axes, named_at, where
from .metrics import Metrics, Position, lse_unit, output_row_scale, position
from .policy import EXACT, LSE, OUT, Bound

LN2 = math.log(2.0)
ELEMENT_METRICS = ("elem_bf16_units", "lse_fp32_units", "elem_bound_ratio")  # the bounds that hold each element


@dataclass(frozen=True)
class Pair:
    """One compared tensor and its reference as the oracle saw them (torch.testing's word): what
    `describe` reads beyond the metrics."""

    tensor: str                       # its name: out, lse, max_logits, a property's CHECK.out, ...
    impl: torch.Tensor
    ref: torch.Tensor
    scale: torch.Tensor | None = None  # an output's value_max or an LSE's logit scale (oracle.measure)
    bound: torch.Tensor | None = None  # the derived per-element bound, where one holds
    axes: Axes | None = None           # its dimensions' names, for where the error sits (`localize`)


def describe(kind: str, c: Pair, m: Metrics, bounds: tuple[Bound, ...], metric: str) -> str:
    """The failing tensor `c` (measured as `kind`, metrics `m`, failing `metric` under `bounds`)."""
    if metric in ("inf_mismatch", "nan_count"):  # never rounding: placed as a bit-for-bit difference is
        impl = c.impl.to(c.ref.device)
        return _with_where(_patterns(c), c, _classes(impl) != _classes(c.ref))
    if kind == EXACT:
        return _with_where(_exact(c, m), c, _bits(c.impl.to(c.ref.device)) != _bits(c.ref))
    impl, ref = c.impl.to(c.ref.device).double(), c.ref.double()
    both = torch.isfinite(impl) & torch.isfinite(ref)
    allowed = allowed_of(kind, ref, both, bounds, c)
    parts = [_elements(impl, ref, both, allowed, c.axes)]
    if allowed is not None:
        parts.append(where(c.axes, outside(impl, ref, both, allowed), exact=False, live=(impl != ref) | (ref != 0),
                           magnitude=torch.where(both, ref, 0.0).abs(), error=torch.where(both, impl - ref, 0.0).abs()))
    if metric == "abs_mean_err":   # the mean shows a lean, not its cause: a scale, a lost term, a wrong key read
        parts.append(f"mean {'gain' if kind == LSE else 'relative error'} {m.mean_err:+.3g}: the errors lean one way, "
                     "more than unbiased rounding leaves at this size")
    if allowed is not None and bool(both.any()):
        look = _lse_look if kind == LSE else _gain
        parts.append(look(c.tensor, impl, ref, both, allowed))
    return "; ".join(filter(None, parts))


def allowed_of(kind: str, ref: torch.Tensor, both: torch.Tensor, bounds: tuple[Bound, ...],
             c: Pair) -> torch.Tensor | None:
    """Each element's allowed |impl - ref|: the tightest of the element-wise bounds among `bounds`."""
    rf = torch.where(both, ref, 0.0)
    limits = []
    for b in bounds:
        if b.metric == "elem_bf16_units" and kind == OUT:
            limits.append(b.limit * output_row_scale(rf.abs(), c.scale).expand_as(ref))
        elif b.metric == "lse_fp32_units" and kind == LSE:
            limits.append(b.limit * lse_unit(rf, c.scale if c.scale is not None else torch.zeros_like(rf)))
        elif b.metric == "elem_bound_ratio" and c.bound is not None:
            limits.append(b.limit * c.bound.to(ref.device).double())
    return reduce(torch.minimum, limits) if limits else None


def outside(impl: torch.Tensor, ref: torch.Tensor, both: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The elements (finite on both sides) further from the reference than they are allowed."""
    return torch.where(both, impl - ref, 0.0).abs() > allowed


def _with_where(text: str, c: Pair, differ: torch.Tensor) -> str:
    return "; ".join(filter(None, (text, where(c.axes, differ, exact=True))))


def _bits(x: torch.Tensor) -> torch.Tensor:
    """Floats as integers of their width (compared bit for bit, as `metrics.exact` does)."""
    if not x.is_floating_point():
        return x
    return x.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def _elements(impl: torch.Tensor, ref: torch.Tensor, both: torch.Tensor, allowed: torch.Tensor | None,
              axes: Axes | None = None) -> str:
    d = torch.where(both, impl - ref, 0.0).abs()
    n = ref.numel()
    if allowed is None:  # no element-wise bound: the largest difference
        at = int(d.reshape(-1).argmax()) if n else 0
        return (f"largest difference at {_where(position(at, ref.shape), axes)}: kernel {_v(impl, at)}, "
                f"reference {_v(ref, at)}")
    over = int((d > allowed).sum())
    ratio = torch.where(d > 0, d / allowed, 0.0)  # an element allowed 0 and off at all: inf
    at = int(ratio.reshape(-1).argmax()) if n else 0
    head = (f"{over} / {n} elements ({_percent(over, n)}) outside their allowed difference; worst" if over
            else "every element within its allowed difference (the error is spread); closest to its bound")
    return (f"{head} at {_where(position(at, ref.shape), axes)}: kernel {_v(impl, at)}, reference {_v(ref, at)}, "
            f"off by {float(d.reshape(-1)[at]):.3g}, allowed {float(allowed.reshape(-1)[at]):.3g}")


def _matcher(ref: torch.Tensor, both: torch.Tensor, allowed: torch.Tensor):
    return lambda x: bool(((x - ref).abs() <= allowed)[both].all())


def _gain_of(impl: torch.Tensor, ref: torch.Tensor, both: torch.Tensor) -> float:
    r = ref[both]
    return float((impl[both] * r).sum() / (r * r).sum()) if bool((r != 0).any()) else 1.0


def _gain(tensor: str, impl: torch.Tensor, ref: torch.Tensor, both: torch.Tensor, allowed: torch.Tensor) -> str:
    """An output that is the reference times a constant (a wrong scale, a lost share of the softmax)."""
    gain = _gain_of(impl, ref, both)
    if int(both.sum()) > 1 and gain not in (0.0, 1.0) and _matcher(ref, both, allowed)(impl / gain):
        return f"{tensor} is the reference times {gain:.6g} everywhere: a gain error"
    return ""


def _lse_look(tensor: str, impl: torch.Tensor, ref: torch.Tensor, both: torch.Tensor, allowed: torch.Tensor) -> str:
    """The convention the kernel's LSE (max_logits) matches the reference in, where one does."""
    what = "max_logits" if "max_logits" in tensor else "LSE"
    key = "max_logits_base" if what == "max_logits" else "lse_base"
    matches = _matcher(ref, both, allowed)

    if matches(impl * LN2):
        return (f"{what} matches the reference in base 2: declare --convention {key}=2 if that is your kernel's "
                "convention")
    if matches(impl / LN2):
        return (f"{what} matches the reference times ln 2: a natural-log {what} converted as if it were base 2 "
                f"(is --convention {key}=2 declared for it?)")
    if int(both.sum()) < 2:  # one value is off by some offset and some gain whatever it is
        return ""
    offset = float((impl - ref)[both].median())
    if matches(impl - offset):
        named = " (ln 2)" if abs(abs(offset) - LN2) < 1e-4 else ""
        sign = "+" if offset > 0 else "-"
        return f"{what} is the reference {sign} {abs(offset):.6g}{named} everywhere: a constant offset"
    gain = _gain_of(impl, ref, both)
    if gain not in (0.0, 1.0) and matches(impl / gain):
        return f"{what} is the reference times {gain:.6g} everywhere"
    return ""


_CLASS_NAMES = ("finite", "NaN", "+inf", "-inf")


def _classes(x: torch.Tensor) -> torch.Tensor:
    """0 finite, 1 NaN, 2 +inf, 3 -inf."""
    codes = torch.zeros(x.shape, dtype=torch.long, device=x.device)
    codes[torch.isnan(x)] = 1
    codes[x == math.inf] = 2
    codes[x == -math.inf] = 3
    return codes


def _patterns(c: Pair) -> str:
    """Every (kernel, reference) pair of classes that differs, with its count and first position:
    the counts add up to inf_mismatch."""
    impl = c.impl.to(c.ref.device)
    ca, cr = _classes(impl), _classes(c.ref)
    pair = (ca * 4 + cr).reshape(-1)
    differ = (ca != cr).reshape(-1)
    total, n = int(differ.sum()), c.ref.numel()
    parts = []
    for code in torch.unique(pair[differ]).tolist():
        where = differ & (pair == code)
        first = int(where.nonzero()[0])
        got, want = _CLASS_NAMES[code // 4], _CLASS_NAMES[code % 4]
        ref_at = f", reference {_v(c.ref, first)}" if want == "finite" else ""
        kernel_at = f", kernel {_v(impl, first)}" if got == "finite" else ""
        parts.append(f"{int(where.sum())} {got} where the reference is {want} (first at "
                     f"{_where(position(first, c.ref.shape), c.axes)}{kernel_at}{ref_at})")
        if got == "-inf" and want == "+inf" and "lse" in c.tensor:
            parts[-1] += (": an empty row's LSE is +inf here; declare --convention empty_lse=-inf if that is your "
                          "kernel's convention")
        elif got == "NaN" and want == "finite":   # its possible causes: the op's inputs may narrow them (explain_nan)
            parts[-1] += (": a NaN comes from an input that holds one (what a kernel must not read is NaN) or from "
                          "inf - inf, 0 * inf")
    return f"{total} of {n} positions ({_percent(total, n)}) differ in +inf/-inf/NaN: " + "; ".join(parts)


def _exact(c: Pair, m: Metrics) -> str:
    """An exact tensor's differing elements, and the first of them."""
    n = c.ref.numel()
    differ = round(m.mismatch_frac * n) if not math.isnan(m.mismatch_frac) else n
    first = (f"; first at {_where(m.max_abs_at, c.axes)}: kernel "
             f"{m.extra['first_mismatch'].replace(' vs ', ', reference ')}") if "first_mismatch" in m.extra else ""
    return f"{differ} / {n} elements ({_percent(differ, n)}) differ bit for bit{first}"


def _where(at: Position, axes: Axes | None) -> str:
    """A position as printed: "[4,0] (token 4 of request 2, top-k position 0)"."""
    return f"[{','.join(map(str, at))}]{named_at(axes, at)}"


def _v(x: torch.Tensor, flat: int) -> str:
    return f"{float(x.reshape(-1)[flat]):.6g}"


def _percent(k: int, n: int) -> str:
    return f"{100 * k / n:.3g}%" if n else "0%"
