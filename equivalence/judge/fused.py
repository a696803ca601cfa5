"""The fused judge: an attention output's metric scalars (`metrics.outputs`) from one Triton pass.

The eager judge measures an output [C, rows, W] in about thirty passes of float64 torch ops over
the block; this kernel reads the implementation's output, the reference and the derived bound
once and writes each row's partial sums and maxima, which a few torch ops reduce per case. The
scalars are the eager judge's by definition, element for element (the same comparisons, the same
roundings: bf16 through fp32 as torch rounds a float64, the bf16 step from the exponent bits as
frexp gives it); the sums run in another order, so they agree with the eager ones to float64
rounding (tests/test_fused_judge.py holds every row and verdict of the zoo, the hostile set and
the gate's corpus to the eager judge's). The eager judge stays the reference: `oracle` re-judges
with it every case the fused judge fails or puts within a hair of its limit, so a failure's row
and message are the eager judge's. Compiled on a GPU; on a CPU it runs under TRITON_INTERPRET=1
(the tests) and the eager judge is the default.
"""

from __future__ import annotations

import math
import os

import torch

# Triton picks interpreter or compiler when a kernel is defined: with no GPU only the interpreter runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

MAX_WIDTH = 1024   # longest last dim fused (an output row: 512)
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# Elements a program holds: TILE // BLOCK_W rows of BLOCK_W. On the H200 one row of 512 a program
# and 2 warps measured fastest; the interpreter runs one program at a time, so it takes many rows.
TILE = 8192 if INTERPRETED else 512
WARPS = 2
# Columns of a row's partials, in order.
FIELDS = ("n", "ref_sq", "err_sq", "dot", "max_abs", "arg", "rounding_sq", "elem", "beyond", "rel_sum", "rel_n",
          "ulp_sum", "dr", "rr", "bound_ratio")
SUMMED = ("n", "ref_sq", "err_sq", "dot", "rounding_sq", "beyond", "rel_sum", "rel_n", "ulp_sum")


@triton.jit
def _row_partials(a_ptr, r_ptr, vmax_ptr, bound_ptr, out_ptr, rows, width, elem_units,
                  HAS_VMAX: tl.constexpr, HAS_BOUND: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
                  NF: tl.constexpr):
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    col = tl.arange(0, BLOCK_W)
    live_row = row < rows
    mask = live_row[:, None] & (col[None, :] < width)
    at = row[:, None].to(tl.int64) * width + col[None, :]
    a = tl.load(a_ptr + at, mask=mask, other=0.0).to(tl.float64)
    r = tl.load(r_ptr + at, mask=mask, other=0.0).to(tl.float64)
    d = a - r
    finite = ((d - d) == 0.0) & mask
    d = tl.where(finite, d, 0.0)
    rf = tl.where(finite, r, 0.0)
    abs_d = tl.abs(d)
    abs_r = tl.abs(rf)
    floor = tl.full((BLOCK_R,), 2.0**-126, tl.float64)
    if HAS_VMAX:
        vmax = tl.load(vmax_ptr + row, mask=live_row, other=1.0).to(tl.float64)
        floor = 2.0**-126 * tl.maximum(vmax, 1.0)
    scale = tl.maximum(tl.max(abs_r, axis=1) * 2.0**-8, floor)
    max_abs = tl.max(abs_d, axis=1)
    arg = tl.min(tl.where(abs_d == max_abs[:, None], col[None, :], BLOCK_W), axis=1)
    sizable = (abs_r >= scale[:, None]) & finite
    # bf16(r) as torch rounds a float64: to fp32, then to nearest even on the top 16 bits (by hand:
    # the interpreter's cast truncates)
    bits = rf.to(tl.float32).to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    rounding = bits.to(tl.float32, bitcast=True).to(tl.float64) - rf
    # |r| in [2**(e-1), 2**e) has exponent bits e + 1022: one bf16 step there is 2**(e - 8)
    e = ((rf.to(tl.int64, bitcast=True) >> 52) & 0x7FF) - 1022
    step = tl.where(sizable, ((1023 + 8 - e) << 52), 1023 << 52).to(tl.float64, bitcast=True)
    ds = tl.where(sizable, d, 0.0)
    rs = tl.where(sizable, rf, 0.0)
    ratio = tl.zeros((BLOCK_R, BLOCK_W), tl.float64)
    if HAS_BOUND:
        bound = tl.load(bound_ptr + at, mask=mask, other=1.0).to(tl.float64)
        ratio = tl.where(abs_d > 0, abs_d / bound, 0.0)
    out = out_ptr + row.to(tl.int64) * NF
    tl.store(out + 0, tl.sum(finite.to(tl.float64), axis=1), mask=live_row)
    tl.store(out + 1, tl.sum(rf * rf, axis=1), mask=live_row)
    tl.store(out + 2, tl.sum(d * d, axis=1), mask=live_row)
    tl.store(out + 3, tl.sum(d * rf, axis=1), mask=live_row)
    tl.store(out + 4, max_abs, mask=live_row)
    tl.store(out + 5, arg.to(tl.float64), mask=live_row)
    tl.store(out + 6, tl.sum(rounding * rounding, axis=1), mask=live_row)
    tl.store(out + 7, max_abs / scale, mask=live_row)
    tl.store(out + 8, tl.sum((abs_d > elem_units * scale[:, None]).to(tl.float64), axis=1), mask=live_row)
    tl.store(out + 9, tl.sum(tl.where(sizable, d / tl.where(sizable, rf, 1.0), 0.0), axis=1), mask=live_row)
    tl.store(out + 10, tl.sum(sizable.to(tl.float64), axis=1), mask=live_row)
    tl.store(out + 11, tl.sum(tl.where(sizable, d * step, 0.0), axis=1), mask=live_row)
    tl.store(out + 12, tl.sum(ds * rs, axis=1), mask=live_row)
    tl.store(out + 13, tl.sum(rs * rs, axis=1), mask=live_row)
    tl.store(out + 14, tl.max(ratio, axis=1), mask=live_row)


def fits(a: torch.Tensor, r: torch.Tensor) -> bool:
    """Whether the fused judge measures this block: a float output of C cases [C, ..., W], W at
    most MAX_WIDTH, nothing empty."""
    return (r.dim() >= 2 and a.shape == r.shape and a.is_floating_point() and r.numel() > 0
            and 0 < r.shape[-1] <= MAX_WIDTH and a.device == r.device)


def output_stats(a: torch.Tensor, r: torch.Tensor, elem_units: float, value_max: torch.Tensor | None,
                 bound: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The scalars `metrics.outputs` reduces per case ([C] float64 each, the eager names), for a
    block `a`, `r` [C, ..., W] that `fits`."""
    cases, width = r.shape[0], r.shape[-1]
    rows = r.numel() // width
    block_w = triton.next_power_of_2(width)
    block_r = max(1, TILE // block_w)
    part = torch.empty((rows, len(FIELDS)), dtype=torch.float64, device=r.device)
    vmax = None if value_max is None else value_max.to(r.device).reshape(-1).contiguous()
    bnd = None if bound is None else bound.to(r.device).contiguous()
    _row_partials[(triton.cdiv(rows, block_r),)](
        a.contiguous(), r.contiguous(), vmax if vmax is not None else part, bnd if bnd is not None else part, part,
        rows, width, float(elem_units), HAS_VMAX=vmax is not None, HAS_BOUND=bnd is not None,
        BLOCK_R=block_r, BLOCK_W=block_w, NF=len(FIELDS), num_warps=WARPS)
    part = part.view(cases, rows // cases, len(FIELDS))
    col = {name: part[..., i] for i, name in enumerate(FIELDS)}
    sums = part[..., [FIELDS.index(name) for name in SUMMED]].sum(dim=1)
    stats = {name: sums[:, i] for i, name in enumerate(SUMMED)}
    max_abs, at_row = col["max_abs"].max(dim=1)
    stats["max_abs"] = max_abs
    stats["argmax"] = at_row * width + col["arg"].gather(1, at_row[:, None])[:, 0]
    stats["elem"] = col["elem"].amax(dim=1)
    dr, rr = col["dr"], col["rr"]
    dot, sq = dr.sum(dim=1), rr.sum(dim=1)
    gain = dot / sq.clamp(min=torch.finfo(torch.float64).tiny)
    score = dr - gain[:, None] * rr
    stats.update(gain_dot=dot, gain_sq=sq, score_sq=torch.linalg.vecdot(score, score),
                 clusters=(rr > 0).sum(dim=1, dtype=torch.float64))
    if bound is not None:
        stats["bound_ratio"] = col["bound_ratio"].amax(dim=1)
    return stats


def near(value: float, limit: float) -> bool:
    """Whether a fused metric is too close to its limit to decide: float64 sums in another order
    differ in their last bits, so within a millionth of the limit the eager judge decides."""
    return math.isfinite(limit) and abs(value - limit) <= 1e-6 * max(abs(limit), abs(value))
