"""DeepSeek V4's two FP8 token rows: a token's 512-dim latent K (448 NoPE + 64 RoPE dims; V is
the same 512 dims), as its data bytes and its ue8m0 scale bytes (where a page keeps each part:
`reference.v4_pages`).

V4 ("MODEL1", 576 data + 8 scale bytes = 584):
    data  [0, 448)    448 x float8_e4m3fn   NoPE dims 0..447; element d at byte d
    data  [448, 576)   64 x bfloat16        RoPE dims 448..511, copied verbatim
    scale [0, 7)        7 x ue8m0           scale t covers NoPE dims [64t, 64t + 64)
    scale [7]           0                   padding
V4.1 (512 data + 16 scale bytes = 528):
    data  [0, 512)    512 x float8_e4m3fn   every dim, RoPE included
    scale [0, 16)      16 x ue8m0           scale t covers dims [32t, 32t + 32)

ue8m0: byte e means 2^(e - 127); 255 is NaN. Writer, per token and tile t (FlashMLA tests/quant.py):
    amax_t  = max |x_d| over the tile                          (fp32, exact from bf16)
    s_t     = 2^ceil(log2(max(amax_t / 448, 1e-4)))           scale rule "pow2" (FlashMLA's tests)
            = 2^ceil(log2(max(amax_t, 1e-4) / 448))           scale rule "pow2_amax" (vLLM's V4 writer)
    code_d  = e4m3_RNE_satfinite(float32(x_d) / s_t)          (exact division: s_t is a power of two)
    a tile holding a NaN or an infinity: scale byte 255 (NaN), every code 0x7F (NaN)
Meaning (what every reader must compute): value_d = e4m3(code_d) * s_t, exact in bf16 and float64;
-0 stays -0 (code 0x80). The two rules differ only for tiles with amax < 448e-4: "pow2" floors the
scale at 2^-13, "pow2_amax" goes down to 2^-22 (finer codes for small tiles).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

D_QK = 512
V4_NOPE = 448
E4M3_MAX = 448.0
SCALE_FLOOR = 1e-4
UE8M0_BIAS = 127
UE8M0_NAN = 255
E4M3_NAN = 0x7F
SCALE_RULES = ("pow2", "pow2_amax")


class RowFormat(NamedTuple):
    """Where a token's parts sit in its data bytes and how many dims a scale covers."""

    data_bytes: int   # 576 (V4) or 512 (V4.1)
    scale_bytes: int  # 8 (V4: 7 scales and a pad byte) or 16 (V4.1)
    quantized: int    # dims stored as e4m3 codes, from dim 0: 448 (V4) or 512 (V4.1)
    tile: int         # dims per scale: 64 (V4) or 32 (V4.1)


V4 = RowFormat(576, 8, V4_NOPE, 64)
V41 = RowFormat(512, 16, D_QK, 32)


def ue8m0_scales(x: torch.Tensor, tile: int, scale_rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, D] float32 -> (tile scales [N, D / tile] float32, their ue8m0 bytes); NaN where a tile
    holds a non-finite value."""
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    tiles = x.view(x.shape[0], x.shape[1] // tile, tile)
    finite = torch.isfinite(tiles).all(dim=-1)
    amax = torch.where(torch.isfinite(tiles), tiles.abs(), 0).amax(dim=-1)
    # Tensor divisions: PyTorch's CUDA kernels multiply by the reciprocal of a scalar divisor.
    fp8_max = torch.full_like(amax, E4M3_MAX)
    if scale_rule == "pow2":
        ratio = torch.clamp_min(amax / fp8_max, SCALE_FLOOR)
    else:
        ratio = torch.clamp_min(amax, SCALE_FLOOR) / fp8_max
    # frexp: ratio = m * 2^e with m in [0.5, 1); the least power of two >= ratio is 2^(e-1) when
    # m == 0.5 (ratio is one) and 2^e otherwise.
    mantissa, exponent = torch.frexp(ratio)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    scales = torch.where(finite, torch.ldexp(torch.ones_like(ratio), exponent), float("nan"))
    codes = torch.where(finite, exponent + UE8M0_BIAS, UE8M0_NAN).to(torch.uint8)
    return scales, codes


def ue8m0_values(codes: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """ue8m0 bytes -> 2^(e - 127) in `dtype` (NaN for 255)."""
    e = codes.to(torch.int32) - UE8M0_BIAS
    values = torch.ldexp(torch.ones(codes.shape, dtype=dtype, device=codes.device), e.to(dtype))
    return values.masked_fill_(codes == UE8M0_NAN, float("nan"))


def quantize_rows(kv: torch.Tensor, fmt: RowFormat, scale_rule: str = "pow2") -> tuple[torch.Tensor, torch.Tensor]:
    """[N, 512] bf16 -> (data [N, fmt.data_bytes], scales [N, fmt.scale_bytes]) uint8."""
    if kv.dtype != torch.bfloat16 or kv.dim() != 2 or kv.shape[1] != D_QK:
        raise ValueError(f"kv must be [N, {D_QK}] bfloat16, got {tuple(kv.shape)} {kv.dtype}")
    n, q = kv.shape[0], fmt.quantized
    x = kv[:, :q].float()
    scales, scale_codes = ue8m0_scales(x, fmt.tile, scale_rule)
    y = (x.view(n, q // fmt.tile, fmt.tile) / torch.nan_to_num(scales, nan=1.0)[..., None]).view(n, q)
    # Clamping first is exactly satfinite: |y| in (448, 464) rounds to 448 under RNE anyway.
    codes = y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    codes = codes.masked_fill((scale_codes == UE8M0_NAN).repeat_interleave(fmt.tile, dim=1), E4M3_NAN)
    data = torch.empty(n, fmt.data_bytes, dtype=torch.uint8, device=kv.device)
    data[:, :q] = codes
    data[:, q:] = kv[:, q:].contiguous().view(torch.uint8)  # V4's RoPE, bf16 verbatim (none in V4.1)
    scale_bytes = torch.zeros(n, fmt.scale_bytes, dtype=torch.uint8, device=kv.device)
    scale_bytes[:, :scale_codes.shape[1]] = scale_codes
    return data, scale_bytes


def row_values(data: torch.Tensor, scales: torch.Tensor, fmt: RowFormat, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The exact meaning of rows: ([..., data_bytes], [..., scale_bytes]) uint8 -> [..., 512] in
    `dtype`: e4m3(code_d) * 2^(e_t - 127), then V4's RoPE values."""
    lead, q = data.shape[:-1], fmt.quantized
    values = torch.empty(*lead, D_QK, dtype=dtype, device=data.device)
    values[..., :q] = data[..., :q].contiguous().view(torch.float8_e4m3fn)
    tile_scales = ue8m0_values(scales[..., :q // fmt.tile], dtype)
    values[..., :q].view(*lead, q // fmt.tile, fmt.tile).mul_(tile_scales[..., None])
    values[..., q:] = data[..., q:].contiguous().view(torch.bfloat16)
    return values
