"""`fp8_ds_mla`, the 656-byte cache row (little-endian), written and read with shifts and tables:

    [0, 512) e4m3 NoPE | [512, 528) 4 x f32 tile scales | [528, 656) 64 x bf16 RoPE

e4m3 rounding is done arithmetically rather than by a dtype cast, and the pow2 rule's scales are
rounded up on their bits.
"""

from __future__ import annotations

import torch

from .. import buffers
from ..validation import check_choice, check_tensor
from .common import HEAD, NOPE, decode, e4m3_table, from_le_bytes, le_bytes, stage

FP8_ROW, FP8_SCALES, FP8_ROPE, FP8_TILE = 656, 512, 528, 128
E4M3_MAX = 448.0
POW2_FLOOR = 1e-4
SCALE_RULES = ("pow2", "raw")


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """float32 -> e4m3fn byte: round to nearest even on the e4m3 grid, saturating at +-448.

    Normal binade [2^k, 2^(k+1)) has spacing 2^(k-3); below 2^-6 the spacing is 2^-9. Dividing by
    a power of two is exact, so `round` (half to even) does the whole rounding.
    """
    a = x.abs().clamp(max=E4M3_MAX)
    _, ex = torch.frexp(a)  # a = f * 2^ex, f in [0.5, 1)
    spacing = torch.ldexp(torch.ones_like(a), (ex - 4).clamp(min=-9))
    r = torch.round(a / spacing) * spacing
    f, ex = torch.frexp(r)
    # Normal: biased exponent ex + 6, mantissa 16f - 8; subnormal: r / 2^-9. Codes grow with r.
    code = torch.where(r < 2.0**-6, r * 512, (ex + 6) * 8 + f * 16 - 8)
    return code.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 7)


def tile_scales(nope: torch.Tensor, scale_rule: str) -> torch.Tensor:
    """[N, 512] float32 -> [N, 4] float32 scales: amax / 448 (an fp32 division), then
    pow2: the smallest power of two >= max(ratio, 1e-4); raw: max(ratio, FLT_MIN)."""
    amax = nope.abs().unflatten(-1, (-1, FP8_TILE)).amax(dim=-1)
    # Divide by a tensor: CUDA kernels replace division by a Python scalar with a reciprocal multiply.
    ratio = amax / torch.full_like(amax, E4M3_MAX)
    if scale_rule == "raw":
        return ratio.clamp(min=torch.finfo(torch.float32).tiny)
    # A positive normal float rounds up to a power of two by carrying any mantissa bit into the
    # exponent: add 2^23 - 1 to the bits, then clear the mantissa.
    bits = ratio.clamp(min=POW2_FLOOR).view(torch.int32)
    return ((bits + 0x7FFFFF) & -0x800000).view(torch.float32)


def fp8_nope(rows: torch.Tensor) -> torch.Tensor:
    """fp8_ds_mla rows [..., 656] -> float32 NoPE [..., 512]: code * tile scale (one fp32 rounding)."""
    scales = from_le_bytes(rows[..., FP8_SCALES:FP8_ROPE], 4, torch.float32)
    return decode(e4m3_table, rows[..., :NOPE]) * scales.repeat_interleave(FP8_TILE, dim=-1)


def fp8_rope(rows: torch.Tensor) -> torch.Tensor:
    """fp8_ds_mla rows -> bf16 RoPE [..., 64], bit for bit."""
    return from_le_bytes(rows[..., FP8_ROPE:], 2, torch.bfloat16)


@stage("quantize_fp8_ds_mla")
def quantize_fp8_ds_mla(kv: torch.Tensor, scale_rule: str = "pow2") -> torch.Tensor:
    """[N, 576] bf16 -> [N, 656] uint8: q_i = e4m3_RNE_sat(float32(x_i) / scale_tile(i))."""
    check_tensor("kv", kv, dtype=torch.bfloat16, shape=(None, HEAD))
    check_choice("scale_rule", scale_rule, SCALE_RULES)
    nope = kv[:, :NOPE].float()
    scales = tile_scales(nope, scale_rule)
    codes = e4m3_encode(nope / scales.repeat_interleave(FP8_TILE, dim=-1))
    rows = buffers.empty((kv.shape[0], FP8_ROW), torch.uint8, kv.device)
    rows[:, :NOPE] = codes
    rows[:, FP8_SCALES:FP8_ROPE] = le_bytes(scales.view(torch.int32), 4)
    rows[:, FP8_ROPE:] = le_bytes(kv[:, NOPE:].view(torch.int16), 2)
    return rows


@stage("dequantize_fp8_ds_mla")
def dequantize_fp8_ds_mla(rows: torch.Tensor) -> torch.Tensor:
    """[N, 656] uint8 -> [N, 576] bf16: bf16(float32(q_i) * scale), RoPE bits copied."""
    check_tensor("rows", rows, dtype=torch.uint8, shape=(None, FP8_ROW))
    out = buffers.empty((rows.shape[0], HEAD), torch.bfloat16, rows.device)
    out[:, :NOPE] = fp8_nope(rows)
    out[:, NOPE:] = fp8_rope(rows)
    return out
