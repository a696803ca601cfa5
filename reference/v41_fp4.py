"""DeepSeek V4.1's FP4 token row, only ever the extra (compressed) cache beside a V4.1 main cache:
a token's 512-dim latent as 256 data bytes and 32 scale bytes (288 a token; where a page keeps
each part: `reference.v4_pages`).

    data  [0, 256)    512 x e2m1; element d in byte d // 2, even d in the low nibble
    scale [0, 32)      32 x float8_e4m3fn   scale t covers dims [16t, 16t + 16), RoPE dims too

e2m1 nibble: bit 3 the sign, bits 0-2 index the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
Writer, per token and tile t (FlashMLA tests/quant.py, V41_FP4):
    sf_t   = e4m3_RNE(clamp(amax_t / 6, 2^-9, 448))            (fp32 division)
    code_d = e2m1_RNE_satfinite(float32(x_d) / float(sf_t))     ties to the even code, +-6 saturates
    a tile holding a NaN or an infinity: scale byte 0x7F (NaN), every code 0
Meaning: value_d = e2m1(code_d) * float(sf_t), exact in bf16 (2 + 4 significant bits); -0 stays -0
(code 8).
"""

from __future__ import annotations

import torch

from .nvfp4_ds_mla import E2M1_VALUES, e2m1_codes
from .v4_rows import D_QK

DATA_BYTES = D_QK // 2   # 256
SCALE_BYTES = 32
TILE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
SCALE_FLOOR = 2.0**-9    # e4m3's least subnormal
E4M3_NAN = 0x7F


def quantize_fp4_rows(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, 512] bf16 -> (data [N, 256], scales [N, 32]) uint8 (see the module docstring)."""
    if kv.dtype != torch.bfloat16 or kv.dim() != 2 or kv.shape[1] != D_QK:
        raise ValueError(f"kv must be [N, {D_QK}] bfloat16, got {tuple(kv.shape)} {kv.dtype}")
    n = kv.shape[0]
    tiles = kv.float().view(n, SCALE_BYTES, TILE)
    finite = torch.isfinite(tiles).all(dim=-1)
    amax = torch.where(torch.isfinite(tiles), tiles.abs(), 0).amax(dim=-1)
    wanted = torch.clamp(amax / torch.full_like(amax, E2M1_MAX), SCALE_FLOOR, E4M3_MAX)
    sf = wanted.to(torch.float8_e4m3fn)
    codes = e2m1_codes(tiles / sf.float()[..., None]).masked_fill_(~finite[..., None], 0).view(n, D_QK)
    data = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scales = sf.view(torch.uint8).masked_fill(~finite, E4M3_NAN)
    return data, scales


def fp4_row_values(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The exact meaning of rows: ([..., 256], [..., 32]) uint8 -> [..., 512] in `dtype`."""
    lead = data.shape[:-1]
    codes = torch.stack([data & 0xF, data >> 4], dim=-1).view(*lead, D_QK)
    # Bit 3 is the sign: codes 8-15 are the negated magnitudes of codes 0-7 (-0 included).
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=dtype, device=data.device)
    values = table[codes.long()]
    sf = scales.contiguous().view(torch.float8_e4m3fn).to(dtype)
    values.view(*lead, SCALE_BYTES, TILE).mul_(sf[..., None])
    return values
