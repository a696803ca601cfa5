"""`nvfp4_ds_mla`, the 352-byte cache row (SM100), read through tables (the eager side has no writer):

    [0, 256) e2m1 NoPE pairs (low nibble = even element) | [256, 320) 64 x e4m3 RoPE |
    [320, 352) 32 e4m3 block scales, block s at 8(s%4) + s//4
"""

from __future__ import annotations

import functools

import torch

from .common import decode, e4m3_table

NVFP4_ROW, NVFP4_ROPE, NVFP4_SCALES, NVFP4_BLOCK = 352, 256, 320, 16


@functools.lru_cache(maxsize=None)
def e2m1_table(device: str) -> torch.Tensor:
    """float32 value of each 4-bit e2m1 code: (-1)^s * 2^(e-1) * (1 + m/2), subnormal m/2."""
    code = torch.arange(16)
    e, m = (code >> 1) & 3, code & 1
    mag = torch.where(e == 0, m * 0.5, (2 + m) * torch.exp2((e - 2).double()))
    return torch.where(code >= 8, -mag, mag).float().to(device)


def nvfp4_nope(rows: torch.Tensor) -> torch.Tensor:
    """nvfp4_ds_mla rows [..., 352] -> float32 NoPE [..., 512] (exact: e2m1 times an e4m3 scale)."""
    packed = rows[..., :NVFP4_ROPE]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    # Scale bytes as a 4 x 8 grid: byte (i, j) holds block 4j + i, so the transpose is block order.
    scale_codes = rows[..., NVFP4_SCALES:].unflatten(-1, (4, 8)).transpose(-1, -2).flatten(-2)
    scales = decode(e4m3_table, scale_codes).repeat_interleave(NVFP4_BLOCK, dim=-1)
    return decode(e2m1_table, codes) * scales


def nvfp4_rope(rows: torch.Tensor) -> torch.Tensor:
    """nvfp4_ds_mla rows -> float32 RoPE [..., 64] (unscaled e4m3)."""
    return decode(e4m3_table, rows[..., NVFP4_ROPE:NVFP4_SCALES])
