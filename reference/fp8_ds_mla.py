"""`fp8_ds_mla`: DeepSeek V3.2's 656-byte KV cache row (vLLM `csrc/cache_kernels.cu`).

    bytes [0, 512)    512 x float8_e4m3fn   NoPE latent kv_c; element i at byte i
    bytes [512, 528)    4 x float32         tile scales; scale j covers elements [128j, 128j+128)
    bytes [528, 656)   64 x bfloat16        RoPE part k_pe, copied verbatim (not quantized)

Writer, per token and tile j:
    amax_j  = max |kv_c[128j : 128j+128]|                    (fp32, exact from bf16)
    scale_j = 2 ** ceil(log2(max(amax_j / 448, 1e-4)))        scale rule "pow2" (vLLM >= #49435)
            = max(amax_j / 448, FLT_MIN)                      scale rule "raw" (older writers)
    q_i     = e4m3fn_RNE_satfinite(float32(kv_c_i) / scale_j)   (an fp32 division, not a reciprocal)

Meaning of a row (what every reader must compute): value_i = float(q_i) * scale_j, exactly.
With "pow2" scales that product is exact in bf16 too; with "raw" scales a bf16 reader rounds it.
The byte layout assumes a little-endian machine (every GPU and x86/Arm host torch runs on).
"""

from __future__ import annotations

import torch

NOPE_DIM = 512
ROPE_DIM = 64
HEAD_DIM = NOPE_DIM + ROPE_DIM
TILE = 128
NUM_TILES = NOPE_DIM // TILE
ROW_BYTES = NOPE_DIM + 4 * NUM_TILES + 2 * ROPE_DIM  # 656
SCALE_OFFSET = NOPE_DIM                              # 512
ROPE_OFFSET = SCALE_OFFSET + 4 * NUM_TILES           # 528
FP8_MAX = 448.0
POW2_FLOOR = 1e-4
SCALE_RULES = ("pow2", "raw")


def tile_scales(nope: torch.Tensor, scale_rule: str) -> torch.Tensor:
    """[N, 512] float32 NoPE values -> [N, 4] float32 tile scales under `scale_rule`."""
    amax = nope.abs().view(-1, NUM_TILES, TILE).amax(dim=-1)
    # An IEEE fp32 division, as the writers do it. Dividing by a tensor, not the Python scalar:
    # PyTorch's CUDA kernels turn division by a scalar into a multiply by its reciprocal, which
    # rounds differently (amax 448 would give a ratio of 1 + 2**-23 and a scale of 2.0).
    ratio = amax / torch.full_like(amax, FP8_MAX)
    if scale_rule == "pow2":
        ratio = ratio.clamp_min(POW2_FLOOR)  # the floor rounds to fp32, as the writers' constant does
        # frexp: ratio = m * 2**e with m in [0.5, 1); the smallest power of two >= ratio is
        # 2**(e-1) when m == 0.5 (ratio is already a power of two) and 2**e otherwise.
        mantissa, exponent = torch.frexp(ratio)
        exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
        return torch.ldexp(torch.ones_like(ratio), exponent)
    if scale_rule == "raw":
        return torch.clamp_min(ratio, torch.finfo(torch.float32).tiny)
    raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")


def quantize_fp8_ds_mla(kv: torch.Tensor, scale_rule: str = "pow2") -> torch.Tensor:
    """[N, 576] bf16 rows -> [N, 656] uint8 fp8_ds_mla rows (see the module docstring)."""
    if kv.dtype != torch.bfloat16 or kv.dim() != 2 or kv.shape[1] != HEAD_DIM:
        raise ValueError(f"kv must be [N, {HEAD_DIM}] bfloat16, got {tuple(kv.shape)} {kv.dtype}")
    nope = kv[:, :NOPE_DIM].float()
    scales = tile_scales(nope, scale_rule)
    scaled = nope.view(-1, NUM_TILES, TILE) / scales[:, :, None]
    # Clamping first is exactly satfinite: |x| in (448, 464) rounds to 448 under RNE anyway.
    q = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    rows = torch.empty(kv.shape[0], ROW_BYTES, dtype=torch.uint8, device=kv.device)
    rows[:, :NOPE_DIM] = q.view(-1, NOPE_DIM)
    rows[:, SCALE_OFFSET:ROPE_OFFSET] = scales.contiguous().view(torch.uint8)
    rows[:, ROPE_OFFSET:] = kv[:, NOPE_DIM:].contiguous().view(torch.uint8)
    return rows


def unpack_fp8_ds_mla(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., 656] uint8 -> (fp8 NoPE [..., 512], fp32 scales [..., 4], bf16 RoPE [..., 64])."""
    if rows.dtype != torch.uint8 or rows.shape[-1] != ROW_BYTES:
        raise ValueError(f"rows must be [..., {ROW_BYTES}] uint8, got {tuple(rows.shape)} {rows.dtype}")
    rows = rows.contiguous()
    nope = rows[..., :NOPE_DIM].view(torch.float8_e4m3fn)
    scales = rows[..., SCALE_OFFSET:ROPE_OFFSET].contiguous().view(torch.float32)
    rope = rows[..., ROPE_OFFSET:].contiguous().view(torch.bfloat16)
    return nope, scales, rope


def fp8_ds_mla_values(rows: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The exact meaning of each row: float(q_i) * scale_j and the RoPE values, in `dtype`.

    float64 holds every product exactly (4 significant bits times 24). q_i is widened on its way
    through bfloat16, which holds every e4m3 value exactly: a temporary of 2 bytes an element, and
    the product written once in `dtype`.
    """
    nope, scales, rope = unpack_fp8_ds_mla(rows)
    lead = nope.shape[:-1]
    values = torch.empty(*lead, HEAD_DIM, dtype=dtype, device=rows.device)
    torch.mul(nope.to(torch.bfloat16).view(*lead, NUM_TILES, TILE), scales.to(dtype)[..., None],
              out=values[..., :NOPE_DIM].view(*lead, NUM_TILES, TILE))
    values[..., NOPE_DIM:] = rope
    return values


def dequantize_fp8_ds_mla(rows: torch.Tensor) -> torch.Tensor:
    """[N, 656] uint8 -> [N, 576] bf16 as the readers produce it: bf16(float32(q_i) * scale_j).

    This is what `cp_gather_and_upconvert_fp8_kv_cache` writes into the BF16 prefill workspace:
    one fp32 multiply, then round-to-nearest-even to bf16.
    """
    nope, scales, rope = unpack_fp8_ds_mla(rows)
    lead = nope.shape[:-1]
    values = nope.float().view(*lead, NUM_TILES, TILE) * scales[..., None]
    return torch.cat([values.view(*lead, NOPE_DIM).to(torch.bfloat16), rope], dim=-1)
