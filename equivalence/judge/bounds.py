"""Per-element error bounds: how far a correct kernel's result may be from the float64 reference.

The tolerance policy (`equivalence.judge.policy`) gates aggregate metrics calibrated on measurements.
This module derives, element by element, what the arithmetic of a correct implementation can
explain: a result outside its bound is a bug, whatever the aggregate says. The functions return
bound tensors shaped like the result (float64); comparing is the caller's business (the oracle's
`elem_bound_ratio`, the tests' assertions).

Notation
--------
u           the fp32 unit roundoff: 2**-24 with IEEE round-to-nearest (CPU torch, the Triton
            interpreter), 2**-23 on a GPU, whose tensor cores may truncate rather than round
            when they accumulate (`fp32_unit`). The library defaults to the looser 2**-23, so one
            bound holds on every device.
gamma_n     n u / (1 - n u): the relative error bound of n fp32 roundings in sequence, or of an
            n-term sum in any order (Higham, Accuracy and Stability, 3.1).
2**-8       bf16's relative rounding step (8 significant bits: half an ulp is 2**-9 of the
            value, 2**-8 covers it with the second-order terms).
s_j         sm_scale * <q, K_j>, the logits; l1 = sm_scale * sum_d |q_d| |K_jd| (max over j: the
            reference's `logit_l1`), what a dot product's rounding error grows with.
p_j         exp(s_j - lse), the exact softmax weights; f = 1 / (1 + exp(sink - lse)) the sink
            factor (1 without a sink).
A, B        per (token, head, dim): A = f sum_j p_j |V_jd|, B = f sum_j |V_jd|
            (the reference's magnitudes out_abs and value_abs, computed in its own pass;
            V is the NoPE part of K, 512 dims).

1. Sparse attention kernels (bf16 tensor-core kernels: FlashMLA, our Triton; and torch-fp32)
-------------------------------------------------------------------------------------------
The kernel dots bf16 q with bf16 rows in fp32 (exact products, fp32 accumulation), keeps the
softmax in fp32, rounds P to bf16 for the PV product, accumulates PV in fp32 and rounds the output
to bf16 once (`attention_bounds`):

    score error      delta = (gamma_600 + dequant_rel) * l1
                     a 576-term fp32 dot of exact bf16 products, then a few scalings (600 > 576
                     + the scalings); dequant_rel is the relative error of the rows themselves
                     when a kernel dequantizes fp8 rows to bf16 from non-power-of-two scales
                     (2**-8: one bf16 rounding per element; 2**-8 + 2**-9 + 2**-17 when the fp32
                     tile scale is rounded to bf16 first, 2**-9 of the scale, then the product)
    lse error        delta + lam,  lam = gamma_(K+16) + 4u (|lse| + 1)
                     the sum of K exponentials (each within gamma of its exact value, one more for
                     the sum), exp2/log (GPU approximations within 2**-22, i.e. 2 u at u = 2**-23)
                     and a split-KV merge, relative to |lse| + 1
    max_logits       delta + u |max|
    out error        |out - ref| <= 2**-8 |ref| + (1 + 2**-8) * c * A + floor
                     c = 2**-8                      P rounded to bf16 for the PV dot
                       + dequant_rel                V rounded to bf16 (non-power-of-two scales)
                       + expm1(3 delta + 2 lam)     the weights: exp(s_j - lse) with s_j and lse
                                                    each off by delta + lam (and the sink factor
                                                    by another delta + lam)
                       + gamma_(K + K/16 + 8)       the fp32 PV accumulation, its per-block
                                                    rescalings (one per 16 keys) and the final
                                                    division
                     The leading 2**-8 |ref| is the final rounding to bf16 (of a value within
                     c A of ref: hence the (1 + 2**-8)).
    floor            below the normal ranges rounding is absolute:
                     IEEE subnormals:  2**-134 (1 + B) + K 2**-149
                         half bf16's smallest subnormal step for the output and for each P entry
                         (weighted by its |V_j|), and an fp32 subnormal step per key
                     flush-to-zero (GPU fp32 math flushes results below 2**-126):
                                       2**-126 (1 + B + K)
                         the output, each P entry, and one rescaled partial per key may flush
    sink underflow   where f < 2**-126 an fp32 kernel's sink factor itself underflows (exp(sink -
                     lse) overflows fp32 from sink - lse > 88.7): its output may be 0 however
                     large |ref| = f |sum p_j V_j| <= A. A kernel normalizing by the max logit m
                     instead (FlashMLA: out = O / (L + e^(sink - m)), O and L relative to m)
                     flushes where 1 / (1 + e^(sink - m)) < 2**-126, up to e^(lse - m) <= K times
                     sooner (measured on the H200: every row with sink - m > 126 ln 2 came out 0).
                     The bound adds A where that factor, which is <= f, is below 2**-126
                     (`sink` given).
Exact contracts are not bounds: a row with no valid entry has out exactly 0 (its bound is 0) and
lse +inf, max_logits -inf (compared by position).

2. torch-fp32 stages (the eager pipeline) against float64 (`ErrorModel`)
-----------------------------------------------------------------------
An IEEE fp32 implementation of every stage, u = 2**-24, bounded with the probabilistic model of
Higham and Mary (a sum of n rounding errors grows like sqrt(n) u; the worst case n u is never
approached), and a per-dim value scale instead of per-key weights:
* logits: a 576-term fp32 dot errs by ~sqrt(576) u sum_d |q_d k_d|; sum_d |q_d k_d| <= sum_d |q_d|
  kmax_d (kmax_d the largest |value| in dim d of any cache row), so ds = 24 u sm_scale L1 bounds
  every logit's error (`ErrorModel.ds`).
* LSE: ds, plus the sum of <= K exponentials (K u) and two roundings of |lse| (log, add).
* out, before its bf16 rounding: the weights carry 2 ds (logit and lse), the K-term weighted sum
  K u, the sink factor one ds more, all relative to sum_j p_j |v_jd| <= vmax_d:
  dout = (3 ds + (K + 4) u) vmax_d. After rounding, an element's error exceeds the reference's own
  bf16 rounding error by at most 2 dout (a flip across a rounding midpoint within dout of the
  exact value).
* out in aggregate: flips are rare (dout / ulp ~ 1e-3 of elements), so ||out - ref|| stays within
  2**-10 of ||bf16(ref) - ref|| (`FP32_AGGREGATE`); a kernel with any bf16 intermediate (P,
  scores, accumulator) lands far above.
* a DCP merge of fp32 ranks' outputs (`ErrorModel.merged_out`): four bf16 roundings (each rank's
  output, its scaled term on both sides, the final sum), each <= 2**-8 of sum_n f_n |out_n|
  (2**-6 in all); the fp32 weights add 2 dlse of it and each rank's output its own 2 dout.
Measured over 600 random batches of every path and regime: the LSE error reaches 0.33 of its
bound, the elementwise excess 0.007 of its bound, the aggregate excess 5.6e-5 (bound 9.8e-4).

3. The DCP merge kernel (`dcp_merge_bounds`)
-------------------------------------------
Per (t, h), against the reference's float64 L and weights f_n = exp(lse_n - L), each partial
rounded to bf16 once and an exact sum; p_n = o_n f_n (reference, unrounded), m = max_n lse_n:
    L:        a handful of fp32 operations (exp, sum of N terms, log, + m), each within a few units
              of 2**-24 of its magnitude, plus the GPU's ex2/lg2 approximations (<= 2**-22):
              |dL| <= 2**-20 (1 + N + |L| + max_n |lse_n - m|)                          (tol_L)
    f_n       fp32 exp(lse_n - L): relative error <= |dL| + 2**-24 |lse_n - L| + 2**-22   (eps_n)
    partial   bf16(fp32(o_n f_n)) vs bf16(p_n): the unrounded values differ by (eps_n + 2**-24)
              |p_n|, two round-to-nearest results by that plus one bf16 ulp (<= 2**-7 |p_n|);
              where f_n is so small that fp32 flushes it, |o_n| 2**-126 more
    sum       N fp32 additions, <= N 2**-24 sum_n |p_n|; the final bf16 rounding <= 2**-8 |out|
    tol = 2**-8 |out_ref| + sum_n [(2**-7 (1 + 2**-7) + eps_n + (N + 1) 2**-24) |p_n| + 2**-126 |o_n|]
          + N 2**-133
(the 2**-7 factor covers the second-order terms; 2**-133 is bf16's smallest subnormal step). An
fp32 merge (torch: `fp32_merge_bounds`) rounds each term once more on both sides: 2**-7 sum_n |p_n|
+ 2**-8 |out|, and its L within 8 u (1 + |L|).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from mla_verify import reference as R

U_NEAREST = 2.0**-24     # IEEE fp32, round to nearest (CPU torch, the Triton interpreter)
U_TRUNCATING = 2.0**-23  # GPU tensor cores: fp32 accumulation may truncate
BF16_U = 2.0**-8         # bf16's relative rounding step, as the bounds use it
FP32_TINY = 2.0**-126    # smallest normal fp32: GPU math flushes results below it
BF16_HALF_SUBNORMAL = 2.0**-134  # half of bf16's smallest subnormal step (2**-133)
FP32_SUBNORMAL = 2.0**-149       # fp32's smallest subnormal step
SCORE_ROUNDINGS = 600    # a 576-term dot product and the few scalings after it
FP32_AGGREGATE = 2.0**-10  # torch-fp32 out: ||out - ref|| <= (1 + this) ||bf16(ref) - ref||
DEQUANT_REL = {          # a deviation's relative error of the rows a kernel multiplies (section 1)
    "bf16_dequant": BF16_U,                                   # each element rounded to bf16
    "bf16_cache_scale": BF16_U + 2.0**-9 + 2.0**-17,          # the tile scale to bf16, then as above
}


def fp32_unit(truncating: bool = True) -> float:
    """u: 2**-23 where fp32 accumulation may truncate (GPU tensor cores), 2**-24 under IEEE
    round to nearest (CPU, the Triton interpreter)."""
    return U_TRUNCATING if truncating else U_NEAREST


def gamma(n: int, unit: float = U_TRUNCATING) -> float:
    """n u / (1 - n u): the bound on n fp32 roundings (an n-term sum in any order)."""
    return n * unit / (1 - n * unit)


# ---------------------------------------------------------------------------------------------
# 1. Sparse attention


class Exact(NamedTuple):
    """The reference's values an attention bound is derived from, in one layout: out [..., H, 512],
    lse / max_logits / logit_l1 [..., H], and its magnitudes A = out_abs, B = value_abs like out."""

    out: torch.Tensor
    lse: torch.Tensor
    max_logits: torch.Tensor
    logit_l1: torch.Tensor
    out_abs: torch.Tensor
    value_abs: torch.Tensor


class AttentionBounds(NamedTuple):
    out: torch.Tensor         # like the output [..., H, 512]
    lse: torch.Tensor         # like the lse; 0 on empty rows (their +inf is compared by position)
    max_logits: torch.Tensor  # like the lse


def attention_bounds(ref: Exact, topk: int, *, unit: float = U_TRUNCATING, dequant_rel: float = 0.0,
                     ftz: bool = True, sink: torch.Tensor | None = None) -> AttentionBounds:
    """Section 1's bounds from the reference's values `ref`; topk the index row width (an upper
    bound on the valid keys). `ftz`: the floors of a flush-to-zero device (else IEEE subnormals);
    `sink` [H]: cover a sink factor that underflows fp32 (needs the lse layout [..., H])."""
    ref_out, ref_max, a, b = ref.out, ref.max_logits, ref.out_abs, ref.value_abs
    ref_lse = ref.lse.double()
    live = torch.isfinite(ref_lse)
    l1 = torch.where(live, ref.logit_l1.double(), 0)
    delta = (gamma(SCORE_ROUNDINGS, unit) + dequant_rel) * l1
    lam = gamma(topk + 16, unit) + 4 * unit * (torch.where(live, ref_lse, 0).abs() + 1)
    lse = torch.where(live, delta + lam, 0)
    ref_max = ref_max.double()
    max_logits = torch.where(live, delta + unit * torch.where(live, ref_max, 0).abs(), 0)
    c = BF16_U + dequant_rel + torch.expm1(3 * delta + 2 * lam) + gamma(topk + topk // 16 + 8, unit)
    if ftz:
        floor = FP32_TINY * (1 + b + topk)
    else:
        floor = BF16_HALF_SUBNORMAL * (1 + b) + topk * FP32_SUBNORMAL
    out = BF16_U * ref_out.double().abs() + (1 + BF16_U) * c[..., None] * a + floor
    if sink is not None:  # the sink factor against the max logit, <= the exact one (docstring)
        f = 1 / (1 + torch.exp(sink.double() - torch.where(live, ref_max, 0)))
        out = out + torch.where((f < FP32_TINY)[..., None], a, 0)
    out = torch.where(live[..., None], out, 0)
    return AttentionBounds(out, lse, max_logits)


def worst(err: torch.Tensor, bound: torch.Tensor) -> tuple[float, int]:
    """(max err / bound, its flat index): 0 where err is 0, inf where err > 0 = bound."""
    ratio = torch.where(err > 0, err / bound, 0).reshape(-1)
    if ratio.numel() == 0:
        return 0.0, 0
    value, at = ratio.max(dim=0)
    return float(value), int(at)


# ---------------------------------------------------------------------------------------------
# 2. torch-fp32 stages

DOT_SPREAD = math.sqrt(576)  # Higham-Mary: a random-walk sum of n rounding errors grows like sqrt(n)


def cache_values(cache: torch.Tensor, cache_dtype: str) -> torch.Tensor:
    """Every row's exact values [rows, 576]; poisoned rows (NaN) read as 0."""
    rows = cache.reshape(-1, cache.shape[-1])
    values = {
        "bfloat16": lambda r: r.double(),
        "fp8_ds_mla": R.fp8_ds_mla_values,
        "nvfp4_ds_mla": R.nvfp4_ds_mla_values,
    }[cache_dtype](rows)
    return torch.nan_to_num(values, nan=0.0)


def bf16_rounding(ref: torch.Tensor) -> torch.Tensor:
    """|bf16(ref) - ref|: the reference's own rounding error."""
    return (ref.to(torch.bfloat16).double() - ref).abs()


class ErrorModel:
    """Section 2's fp32 bounds for a batch: ds [T, H], vmax [512], K."""

    unit = U_NEAREST

    def __init__(self, q, caches, cache_dtype, sm_scale, topk):
        kmax = torch.stack([cache_values(c, cache_dtype).abs().amax(0) for c in caches]).amax(0)
        q = q if isinstance(q, torch.Tensor) else torch.cat(q, dim=-1)
        self.ds = DOT_SPREAD * U_NEAREST * sm_scale * (q.double().abs() * kmax).sum(-1)
        self.vmax = kmax[:512]
        self.topk = topk

    def lse(self, ref_lse):
        return self.ds + U_NEAREST * (self.topk + 2 * ref_lse.abs())

    def out(self):
        """dout: an element's excess over the reference's own bf16 rounding error is <= 2 dout."""
        return (3 * self.ds[..., None] + (self.topk + 4) * U_NEAREST) * self.vmax

    def out_excess(self):
        return 2 * self.out()

    def max_logits(self):
        return self.ds

    def merged_out(self, part_outs, part_lses):
        """A DCP merge of fp32 ranks (section 2, last item): part_outs [N, T, H, 512], part_lses
        [N, T, H] the ranks' reference results."""
        _, f = R.merge_weights(part_lses)
        scale = (part_outs.abs() * f[..., None]).sum(0)
        dlse = self.lse(torch.nan_to_num(part_lses, posinf=0.0, neginf=0.0).abs().amax(0))
        return (2.0**-6 + 2 * dlse[..., None]) * scale + 2 * self.out()

    def merged_lse(self, ref_lse, ranks):
        return self.lse(ref_lse) + U_NEAREST * (ranks + 2 * ref_lse.abs())


# ---------------------------------------------------------------------------------------------
# 3. DCP merge


def dcp_merge_bounds(outs, lses, out_ref, lse_ref) -> tuple[torch.Tensor, torch.Tensor]:
    """Section 3: (tol_out [T, H, D], tol_lse [T, H]) of the merge kernel of outs [N, T, H, D] bf16
    and lses [N, T, H] against the reference's (out_ref, lse_ref)."""
    ranks = outs.shape[0]
    x = lses.double()
    x = torch.where(x.isnan() | (x == math.inf), -math.inf, x)
    finite = lse_ref.isfinite()
    m = torch.where(finite, x.amax(0), 0.0)
    spread = torch.where(x.isfinite(), (x - m).abs(), 0.0).amax(0)
    tol_lse = 2.0**-20 * (1 + ranks + lse_ref.abs().nan_to_num(0.0, 0.0, 0.0) + spread)
    _, f = R.merge_weights(lses)
    exponent = (lses.double() - lse_ref).abs().nan_to_num(0.0, 0.0, 0.0)
    eps = tol_lse + 2.0**-24 * exponent + 2.0**-22
    p = torch.where(f[..., None] == 0, 0.0, outs.double() * f[..., None]).abs()
    flushed = 2.0**-126 * torch.where(f[..., None] == 0, 0.0, outs.double()).abs()
    per_rank = (2.0**-7 * (1 + 2.0**-7) + eps[..., None] + (ranks + 1) * 2.0**-24) * p + flushed
    tol_out = 2.0**-8 * out_ref.abs() + per_rank.sum(0) + ranks * 2.0**-133
    return tol_out, tol_lse


def fp32_merge_bounds(outs, lses, out_ref, lse_ref) -> tuple[torch.Tensor, torch.Tensor]:
    """Section 3's last line: (tol_out, tol_lse) of an fp32 (torch) merge against the reference."""
    _, f = R.merge_weights(lses)
    terms = torch.where(f[..., None] == 0, 0.0, outs.double() * f[..., None]).abs().sum(0)
    return 2.0**-7 * terms + 2.0**-8 * out_ref.abs(), 8 * U_NEAREST * (1 + lse_ref.abs())
