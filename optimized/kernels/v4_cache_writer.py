"""The DeepSeek V4 / V4.1 cache writers: quantize bf16 latent rows [N, 512] and write each token's
data and scale bytes where its page keeps them (`optimized.v4_formats`).

FP8 rows (V4: the first 448 dims in tiles of 64, RoPE bf16 verbatim; V4.1: all 512 in tiles of
32), per tile with amax = max |x| over its finite values:
    "pow2"      s = 2^ceil(log2(max(amax / 448, 1e-4)))       (FlashMLA's tests)
    "pow2_amax" s = 2^ceil(log2(max(amax, 1e-4) / 448))       (vLLM's V4 writer)
    code = e4m3_rn_satfinite(x / s) (exact: s is a power of two), scale byte = log2(s) + 127
FP4 rows (V4.1 extra), per tile of 16:
    sf = e4m3_rn(clamp(amax / 6, 2^-9, 448)), code = e2m1_rn_satfinite(x / float(sf))
A tile holding a NaN or an infinity gets a NaN scale (ue8m0 255, e4m3 0x7F) and codes 0x7F (FP8)
or 0 (FP4). Every byte is defined, so the writers are compared with the reference bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_verify.optimized.kernels.bits import bf16_to_f32, e4m3_bits_to_f32, f32_to_e4m3_bits
from mla_verify.optimized.kernels.launch import native, rows_per_program
from mla_verify.optimized.registry import TRITON, register
from mla_verify.optimized.v4_checks import cache_format
from mla_verify.optimized.v4_formats import D_QK, CacheFormat
from mla_verify.optimized.validation import check_choice, check_index_range, check_same_device, check_tensor

SCALE_RULES = ("pow2", "pow2_amax")


@triton.jit
def _pow2_ceil_exponent(r):
    """log2 of the least power of two >= r, for positive normal fp32 r, from its bits."""
    u = r.to(tl.int32, bitcast=True)
    return ((u >> 23) & 0xFF) - 127 + ((u & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _e2m1_code(y):
    """fp32 -> e2m1 nibble: round to nearest, ties to the even code, +-6 saturating, sign bit 3."""
    a = tl.abs(y)
    mag = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
           + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    return mag | (((y.to(tl.int32, bitcast=True) >> 31) & 1) << 3)


@triton.jit
def _tile_stats(x, live):
    """(amax over the finite values, every value finite) per tile of x [R, tiles, tile]."""
    finite = (x == x) & (tl.abs(x) != float("inf"))
    amax = tl.max(tl.where(finite & live, tl.abs(x), 0.0), axis=2)
    return amax, tl.min(tl.where(live, finite.to(tl.int32), 1), axis=2) == 1


@triton.jit
def _write_kernel(
    kv, kv_row_stride, cache, block_stride, slots, n_tokens, block_size,
    FMT: tl.constexpr, DATA: tl.constexpr, SCALE: tl.constexpr, BLOCK_MAJOR: tl.constexpr,
    POW2_AMAX: tl.constexpr, NATIVE: tl.constexpr, ROWS: tl.constexpr,
):
    n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    slot = tl.load(slots + n, mask=n < n_tokens, other=-1).to(tl.int64)
    mask = (n < n_tokens) & (slot >= 0)
    base = cache + (slot // block_size) * block_stride
    offset = slot % block_size
    if BLOCK_MAJOR:
        data = base + offset * DATA
        scales = base + block_size * DATA + offset * SCALE
    else:
        data = base + offset * (DATA + SCALE)
        scales = data + DATA
    src = kv + n.to(tl.int64) * kv_row_stride
    TILE: tl.constexpr = 64 if FMT == 0 else (32 if FMT == 1 else 16)
    TILES: tl.constexpr = D_QK // TILE
    QUANTIZED: tl.constexpr = 7 if FMT == 0 else TILES  # V4's 8th tile is its bf16 RoPE
    t = tl.arange(0, TILES)[None, :, None]
    dim = t * TILE + tl.arange(0, TILE)[None, None, :]
    live = mask[:, None, None] & (t < QUANTIZED)
    x = bf16_to_f32(tl.load(src[:, None, None] + dim, mask=live, other=0.0), NATIVE)
    amax, finite = _tile_stats(x, live)
    if FMT == 2:
        sf_bits = f32_to_e4m3_bits(tl.minimum(tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)),
                                                         0.001953125), 448.0))
        sf = e4m3_bits_to_f32(sf_bits)
        codes = _e2m1_code(tl.math.div_rn(x, tl.broadcast_to(sf[:, :, None], x.shape)))
        codes = tl.where(finite[:, :, None], codes, 0)
        lo, hi = tl.split(tl.reshape(codes, (ROWS, D_QK // 2, 2)))
        tl.store(data[:, None] + tl.arange(0, D_QK // 2)[None, :], (lo | (hi << 4)).to(tl.uint8), mask=mask[:, None])
        scale_bytes = tl.where(finite, sf_bits, 0x7F)
    else:
        if POW2_AMAX:
            r = tl.math.div_rn(tl.maximum(amax, 1e-4), tl.full(amax.shape, 448.0, tl.float32))
        else:
            r = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1e-4)
        e = _pow2_ceil_exponent(r)
        inv = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e, exact: x * 2^-e == x / 2^e
        codes = f32_to_e4m3_bits(x * inv[:, :, None])
        codes = tl.where(finite[:, :, None], codes, 0x7F)
        tl.store(data[:, None, None] + dim, codes.to(tl.uint8), mask=live)
        scale_bytes = tl.where(finite, e + 127, 255)
    tl.store(scales[:, None] + tl.arange(0, TILES)[None, :], scale_bytes.to(tl.uint8),
             mask=mask[:, None] & (tl.arange(0, TILES)[None, :] < QUANTIZED))
    if FMT == 0:
        # The RoPE dims 448..511 as bf16 bytes (little-endian), and the scale row's pad byte.
        d = tl.arange(0, 64)[None, :]
        rope = tl.load(src[:, None] + 448 + d, mask=mask[:, None]).to(tl.int16, bitcast=True).to(tl.int32)
        tl.store(data[:, None] + 448 + 2 * d, (rope & 0xFF).to(tl.uint8), mask=mask[:, None])
        tl.store(data[:, None] + 449 + 2 * d, ((rope >> 8) & 0xFF).to(tl.uint8), mask=mask[:, None])
        tl.store(scales + 7, tl.zeros((ROWS,), tl.uint8), mask=mask)


def _write(kv: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, scale_rule: str,
           allowed: tuple[str, ...]) -> None:
    check_tensor("kv", kv, dtype=torch.bfloat16, shape=(None, D_QK), last_dim_contiguous=True)
    check_choice("scale_rule", scale_rule, SCALE_RULES, "the ue8m0 scale rules")
    fmt: CacheFormat = cache_format("kv_cache", kv_cache, allowed)
    check_tensor("slot_mapping", slot_mapping, dtype=(torch.int32, torch.int64), shape=(kv.shape[0],))
    check_same_device(kv=kv, kv_cache=kv_cache, slot_mapping=slot_mapping)
    slots = slot_mapping.contiguous()
    # Negative slots are tokens not written (CUDA-graph padding); every other one is a slot.
    check_index_range("slot_mapping", slots, kv_cache.shape[0] * kv_cache.shape[1], lower=torch.iinfo(slots.dtype).min)
    rows = rows_per_program()
    if kv.shape[0]:
        _write_kernel[(triton.cdiv(kv.shape[0], rows),)](
            kv, kv.stride(0), kv_cache, kv_cache.stride(0), slots, kv.shape[0], kv_cache.shape[1],
            FMT=fmt.code, DATA=fmt.data_bytes, SCALE=fmt.scale_bytes, BLOCK_MAJOR=fmt.block_major,
            POW2_AMAX=scale_rule == "pow2_amax", NATIVE=native(kv.device), ROWS=rows,
        )


@register("write_v4_cache", "triton", priority=TRITON, devices=("cpu", "cuda"), interpreted_on=("cpu",))
def write_v4_cache(kv: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, scale_rule: str = "pow2") -> None:
    """Quantize kv [N, 512] bf16 into a V4 cache [NB, BS, 584] uint8 (block-major pages) in place:
    token n to slot slot_mapping[n] (negative: skipped). Other bytes are untouched."""
    _write(kv, kv_cache, slot_mapping, scale_rule, ("V4",))


@register("write_v41_cache", "triton", priority=TRITON, devices=("cpu", "cuda"), interpreted_on=("cpu",))
def write_v41_cache(kv: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, scale_rule: str = "pow2") -> None:
    """As `write_v4_cache` into a V4.1 cache [NB, BS, 528] (FP8, per-token pages) or a V4.1 FP4
    cache [NB, BS, 288] (the extra cache; its scales are e4m3 and `scale_rule` does not apply)."""
    _write(kv, kv_cache, slot_mapping, scale_rule, ("V41", "V41_FP4"))
