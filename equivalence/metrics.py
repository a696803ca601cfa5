"""How far an implementation's tensor is from the reference's: the numbers every row carries.

Three kinds of tensor, three ways of measuring:
* exact (cache bytes, indices, bf16 values a contract fixes bit for bit): fraction of elements
  that differ, bit for bit (NaN payloads included);
* out (an attention output, bf16 against the float64 reference):
    rel_l2          ||a - r|| / ||r||
    cos_dist        1 - <a, r> / (||a|| ||r||)
    bf16_units      ||a - r|| / ||bf16(r) - r||: the error in units of rounding the exact answer
                    to bf16, the least any bf16 output can do (the unit never drops below
                    2**-10 ||r||, for answers that happen to be bf16-representable)
    elem_bf16_units max |a - r| / (2**-8 * max|r| over the row's last dim): the worst element in
                    bf16 rounding steps of its own row's magnitude
    mean_err        <a - r, r> / <r, r>: the signed gain error along the reference. Rounding to
                    nearest averages out (~rel_l2 / sqrt(numel)); a wrong scale, a lost softmax
                    mass or a biased dequantization shows as a steady sign
* lse and max_logits (fp32 against float64):
    lse_fp32_units  max |a - r| / (2**-24 * (logit_l1 + |r| + 1)): the worst error in fp32 rounding
                    steps of the row's logit scale (logit_l1 = max_j sm_scale * sum_d |q_d K_jd|,
                    what an fp32 dot product's rounding error grows with)
Both float kinds compare NaN and infinities by position first: +inf, -inf and NaN must sit in
exactly the reference's places (`inf_mismatch` counts the positions that differ) and NaN the
reference does not have is counted in `nan_count`. The other metrics use the positions where
both are finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

BF16_UNIT = 2.0**-8    # unit roundoff of bf16 (8 significant bits)
FP32_UNIT = 2.0**-24


@dataclass
class Metrics:
    numel: int = 0
    ref_rms: float = math.nan
    rel_l2: float = math.nan
    cos_dist: float = math.nan
    max_abs: float = math.nan
    max_abs_at: str = ""
    mismatch_frac: float = math.nan
    mean_err: float = math.nan
    bf16_units: float = math.nan
    elem_bf16_units: float = math.nan
    lse_fp32_units: float = math.nan
    nan_count: int = 0
    inf_mismatch: int = 0
    extra: dict = field(default_factory=dict)


def _position(flat_index: int, shape: torch.Size) -> str:
    coords = []
    for size in reversed(shape):
        coords.append(flat_index % size)
        flat_index //= size
    return ",".join(str(c) for c in reversed(coords))


def _anomalies(a: torch.Tensor, r: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """(positions whose +inf/-inf/NaN class differs, NaN in `a` only, mask of finite pairs)."""
    def cls(x: torch.Tensor) -> torch.Tensor:
        return torch.isnan(x) * 1 + (x == math.inf) * 2 + (x == -math.inf) * 3

    ca, cr = cls(a), cls(r)
    return int((ca != cr).sum()), int((torch.isnan(a) & ~torch.isnan(r)).sum()), (ca == 0) & (cr == 0)


def exact(a: torch.Tensor, r: torch.Tensor) -> Metrics:
    """Bit-for-bit comparison (shapes must match; float tensors compare their bits)."""
    if a.shape != r.shape or a.dtype != r.dtype:
        return Metrics(numel=r.numel(), mismatch_frac=1.0, extra={"shape": f"{tuple(a.shape)} {a.dtype} vs {tuple(r.shape)} {r.dtype}"})
    if a.is_floating_point():
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a_bits, r_bits = a.contiguous().view(bits), r.contiguous().view(bits)
    else:
        a_bits, r_bits = a, r
    diff = (a_bits != r_bits).flatten()
    m = Metrics(numel=r.numel(), mismatch_frac=float(diff.float().mean()) if r.numel() else 0.0)
    if a.is_floating_point():
        m.nan_count = int((torch.isnan(a) & ~torch.isnan(r)).sum())
    if bool(diff.any()):
        first = int(diff.nonzero()[0])
        m.max_abs_at = _position(first, r.shape)
        av, rv = a.flatten()[first], r.flatten()[first]
        m.max_abs = float((av.double() - rv.double()).abs()) if a.is_floating_point() or a.dtype != torch.bool else 1.0
        m.extra["first_mismatch"] = f"{av.item()} vs {rv.item()}"
    else:
        m.max_abs = 0.0
    return m


def _finite_common(a: torch.Tensor, r: torch.Tensor) -> tuple[Metrics, torch.Tensor, torch.Tensor, torch.Tensor]:
    a, r = a.double(), r.double()
    inf_mismatch, nan_count, finite = _anomalies(a, r)
    m = Metrics(numel=r.numel(), inf_mismatch=inf_mismatch, nan_count=nan_count)
    d = torch.where(finite, a - r, 0.0)
    rf = torch.where(finite, r, 0.0)
    n = int(finite.sum())
    if n:
        m.ref_rms = float(rf.square().sum().div(n).sqrt())
        m.max_abs = float(d.abs().max())
        m.max_abs_at = _position(int(d.abs().flatten().argmax()), r.shape)
        ref_norm = float(rf.norm())
        m.rel_l2 = float(d.norm()) / ref_norm if ref_norm else float(d.norm() != 0) * math.inf
        m.mean_err = float((d * rf).sum()) / ref_norm**2 if ref_norm else 0.0
    return m, d, rf, finite


def output(a: torch.Tensor, r: torch.Tensor, elem_units: float) -> Metrics:
    """An attention output (bf16 or wider) against the float64 reference; `elem_units` is the
    per-element bound (in bf16 steps of the row's magnitude) that `mismatch_frac` counts against."""
    m, d, rf, finite = _finite_common(a, r)
    if not int(finite.sum()):
        return m
    af = torch.where(finite, a.double(), 0.0)
    denom = float(af.norm() * rf.norm())
    m.cos_dist = 1.0 - float((af * rf).sum()) / denom if denom else float(af.norm() != rf.norm())
    rounding = max(float((rf.to(torch.bfloat16).double() - rf).norm()), 2.0**-10 * float(rf.norm()))
    err = float(d.norm())
    m.bf16_units = err / rounding if rounding else (0.0 if err == 0 else math.inf)
    row_scale = BF16_UNIT * rf.abs().amax(dim=-1, keepdim=True)
    per_elem = torch.where(row_scale > 0, d.abs() / row_scale, torch.where(d != 0, math.inf, 0.0))
    m.elem_bf16_units = float(per_elem.max())
    m.mismatch_frac = float((per_elem > elem_units).double().mean())
    return m


def lse(a: torch.Tensor, r: torch.Tensor, logit_l1: torch.Tensor) -> Metrics:
    """An LSE (or max_logits) against the float64 reference, scaled by each row's logit scale."""
    m, d, rf, finite = _finite_common(a, r)
    if int(finite.sum()):
        scale = FP32_UNIT * (torch.where(finite, logit_l1.double(), 0.0) + rf.abs() + 1.0)
        m.lse_fp32_units = float((d.abs() / scale).max())
    else:
        m.lse_fp32_units = 0.0
    return m
