"""`nvfp4_ds_mla`: the 352-byte KV cache row (SM100 only; vLLM `csrc/nvfp4_ds_mla_cache.cu`).

    bytes [0, 256)    512 x e2m1 NoPE, two per byte: low nibble = even element, high = odd
    bytes [256, 320)   64 x float8_e4m3fn RoPE, unscaled
    bytes [320, 352)   32 x float8_e4m3fn NoPE block scales, one per 16 elements, PERMUTED:
                       the scale of block s (elements [16s, 16s+16)) is at byte 320 + 8*(s%4) + s//4

Writer, per 16-element block:
    sf_f = max(amax / 6, 2**-9);  sf = e4m3_RNE(sf_f)
           scale rounding "up" (the CUDA writer): one e4m3 step up when float(sf) < sf_f and the
           code is below 0x7E, so amax / sf <= 6; "rn" (vLLM's Triton writer): plain RNE
    q_i  = e2m1_RNE_satfinite(x_i * (1 / float(sf)))   (multiply by the fp32 reciprocal)
    RoPE = e4m3_RNE_satfinite(k_pe)
Meaning: value_i = e2m1(q_i) * float(sf) (exact in bf16), RoPE = float(e4m3).
"""

from __future__ import annotations

import torch

NOPE_DIM = 512
ROPE_DIM = 64
HEAD_DIM = NOPE_DIM + ROPE_DIM
BLOCK = 16
NUM_BLOCKS = NOPE_DIM // BLOCK  # 32
ROW_BYTES = NOPE_DIM // 2 + ROPE_DIM + NUM_BLOCKS  # 352
ROPE_OFFSET = NOPE_DIM // 2  # 256
SCALE_OFFSET = ROPE_OFFSET + ROPE_DIM  # 320
E2M1_MAX = 6.0
E4M3_MAX = 448.0
SCALE_FLOOR = 2.0**-9
SCALE_ROUNDINGS = ("up", "rn")

# e2m1 magnitude of each 3-bit code: the code itself is the index into this table.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes and which way a tie goes: to the even code.
_TIES_DOWN = (0.25, 1.25, 2.5, 5.0)   # the lower neighbour has the even code
_TIES_UP = (0.75, 1.75, 3.5)          # the upper neighbour has the even code


def scale_position(block: torch.Tensor | int) -> torch.Tensor | int:
    """Byte offset (from 320) of the scale of NoPE block `block`."""
    return 8 * (block % 4) + block // 4


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, RNE, saturating (clamp first: |x| in (448, 464) rounds to 448)."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> e2m1 4-bit codes, round to nearest even, saturating at +-6."""
    a = y.abs()
    code = sum((a > t).to(torch.uint8) for t in _TIES_DOWN) + sum(
        (a >= t).to(torch.uint8) for t in _TIES_UP
    )
    return code | (torch.signbit(y).to(torch.uint8) << 3)


def _block_scales(nope: torch.Tensor, scale_rounding: str) -> torch.Tensor:
    if scale_rounding not in SCALE_ROUNDINGS:
        raise ValueError(f"scale_rounding must be one of {SCALE_ROUNDINGS}, got {scale_rounding!r}")
    amax = nope.abs().view(-1, NUM_BLOCKS, BLOCK).amax(dim=-1)
    # Tensor divisions: PyTorch's CUDA kernels multiply by the reciprocal of a scalar divisor.
    wanted = torch.clamp_min(amax / torch.full_like(amax, E2M1_MAX), SCALE_FLOOR)
    sf = _e4m3(wanted)
    if scale_rounding == "up":
        bits = sf.view(torch.uint8)
        bump = (sf.float() < wanted) & (bits < 0x7E)
        sf = torch.where(bump, bits + 1, bits).view(torch.float8_e4m3fn)
    return sf


def quantize_nvfp4_ds_mla(kv: torch.Tensor, scale_rounding: str = "up") -> torch.Tensor:
    """[N, 576] bf16 rows -> [N, 352] uint8 nvfp4_ds_mla rows (see the module docstring)."""
    if kv.dtype != torch.bfloat16 or kv.dim() != 2 or kv.shape[1] != HEAD_DIM:
        raise ValueError(f"kv must be [N, {HEAD_DIM}] bfloat16, got {tuple(kv.shape)} {kv.dtype}")
    n = kv.shape[0]
    nope = kv[:, :NOPE_DIM].float()
    sf = _block_scales(nope, scale_rounding)
    inv = torch.ones_like(sf, dtype=torch.float32) / sf.float()
    codes = e2m1_codes(nope.view(n, NUM_BLOCKS, BLOCK) * inv[:, :, None]).view(n, NOPE_DIM)
    rows = torch.empty(n, ROW_BYTES, dtype=torch.uint8, device=kv.device)
    rows[:, :ROPE_OFFSET] = codes[:, 0::2] | (codes[:, 1::2] << 4)
    rows[:, ROPE_OFFSET:SCALE_OFFSET] = _e4m3(kv[:, NOPE_DIM:].float()).view(torch.uint8)
    positions = scale_position(torch.arange(NUM_BLOCKS, device=kv.device))
    rows[:, SCALE_OFFSET + positions] = sf.view(torch.uint8)
    return rows


def nvfp4_ds_mla_values(rows: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The exact meaning of each [..., 352] row as [..., 576] values in `dtype`."""
    if rows.dtype != torch.uint8 or rows.shape[-1] != ROW_BYTES:
        raise ValueError(f"rows must be [..., {ROW_BYTES}] uint8, got {tuple(rows.shape)} {rows.dtype}")
    lead = rows.shape[:-1]
    packed = rows[..., :ROPE_OFFSET]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(*lead, NOPE_DIM)
    # Code bit 3 is the sign: codes 8-15 are the negated magnitudes of codes 0-7.
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=dtype, device=rows.device)
    positions = scale_position(torch.arange(NUM_BLOCKS, device=rows.device))
    sf = rows[..., SCALE_OFFSET + positions].contiguous().view(torch.float8_e4m3fn).to(dtype)
    values = torch.empty(*lead, HEAD_DIM, dtype=dtype, device=rows.device)
    values[..., :NOPE_DIM] = table[codes.int()]
    values[..., :NOPE_DIM].view(*lead, NUM_BLOCKS, BLOCK).mul_(sf[..., None])
    values[..., NOPE_DIM:] = rows[..., ROPE_OFFSET:SCALE_OFFSET].contiguous().view(torch.float8_e4m3fn)
    return values


def dequantize_nvfp4_ds_mla(rows: torch.Tensor) -> torch.Tensor:
    """[N, 352] uint8 -> [N, 576] bf16, as the gather/up-convert reader writes the workspace.

    The products fit bf16 exactly (2-bit by 4-bit significands), so this is the exact meaning.
    """
    return nvfp4_ds_mla_values(rows, torch.float32).to(torch.bfloat16)
