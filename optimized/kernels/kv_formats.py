"""Byte layouts of the quantized DeepSeek sparse-MLA cache rows, and Triton row (de)quantizers.

`fp8_ds_mla`, 656 bytes a token (spec §3.2):
    [0, 512)    512 float8_e4m3fn NoPE values, element i at byte i
    [512, 528)  4 little-endian fp32 scales; scale j covers NoPE elements [128j, 128j + 128)
    [528, 656)  64 bf16 RoPE values, copied verbatim

`nvfp4_ds_mla`, 352 bytes a token (spec §3.3):
    [0, 256)    512 e2m1 NoPE values, two a byte, low nibble = even element
    [256, 320)  64 float8_e4m3fn RoPE values, unscaled
    [320, 352)  32 float8_e4m3fn scales, one per 16 NoPE elements; block s at byte
                320 + 8 * (s & 3) + (s >> 2), so the 8 scales one reader thread needs are adjacent

The helpers work on a vector of R row pointers at once (one program converts a tile of rows):
byte pointers into the cache, element pointers into bf16 [*, 576] rows. Loads and stores are
byte-wise where the cache is read or written, because a cache's block stride need not keep the
fp32 scales or bf16 RoPE aligned.
"""

import triton
import triton.language as tl

from mla_verify.optimized.kernels.bits import bf16_to_f32, e2m1_bits_to_f32, e4m3_to_f32, f32_to_e4m3_bits, to_bf16

NOPE = tl.constexpr(512)
ROPE = tl.constexpr(64)
HEAD_DIM = tl.constexpr(576)

FP8_ROW_BYTES = tl.constexpr(656)
FP8_TILE = tl.constexpr(128)  # NoPE elements per fp32 scale
FP8_SCALES_AT = tl.constexpr(512)
FP8_ROPE_AT = tl.constexpr(528)

NVFP4_ROW_BYTES = tl.constexpr(352)
NVFP4_BLOCK = tl.constexpr(16)  # NoPE elements per e4m3 scale
NVFP4_ROPE_AT = tl.constexpr(256)
NVFP4_SCALES_AT = tl.constexpr(320)

E4M3_MAX = tl.constexpr(448.0)
POW2_SCALE_FLOOR = tl.constexpr(1e-4)
FLT_MIN = tl.constexpr(1.1754943508222875e-38)


@triton.jit
def _fp8_nope_offsets():
    """[1, 4, 128] offsets of the NoPE values (bytes in a row = elements in a bf16 row), by tile."""
    return tl.arange(0, NOPE // FP8_TILE)[None, :, None] * FP8_TILE + tl.arange(0, FP8_TILE)[None, None, :]


@triton.jit
def _fp8_scale_offsets():
    """[1, 4, 4] byte offsets of the fp32 scales: [tile, byte], least significant byte first."""
    return FP8_SCALES_AT + tl.arange(0, NOPE // FP8_TILE)[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]


@triton.jit
def _fp8_ds_mla_scale(amax, POW2: tl.constexpr):
    """Per-tile fp32 scale from amax = max |x| (spec §3.2).

    POW2 (v0.33.0, vLLM PR #49435): s = 2 ** ceil(log2(max(amax / 448, 1e-4))).
    Otherwise (older writers):       s = max(amax / 448, FLT_MIN).
    amax / 448 is an IEEE division; the power-of-two ceiling is taken on the bits (a positive
    normal float is already a power of two iff its mantissa is zero; else bump the exponent),
    so it is exact where log2/exp2 approximations are not.
    """
    r = tl.math.div_rn(amax, tl.full(amax.shape, E4M3_MAX, tl.float32))
    if POW2:
        u = tl.maximum(r, POW2_SCALE_FLOOR).to(tl.int32, bitcast=True)
        u = tl.where((u & 0x7FFFFF) == 0, u, (u & 0x7F800000) + 0x800000)
        return u.to(tl.float32, bitcast=True)
    else:
        return tl.maximum(r, FLT_MIN)


@triton.jit
def quantize_fp8_ds_mla_rows(src, dst, mask, POW2: tl.constexpr, NATIVE: tl.constexpr):
    """Write fp8_ds_mla rows: src [R] bf16 row pointers (576 values), dst [R] uint8 row pointers.

    Per tile j: s_j = _fp8_ds_mla_scale(max |x|), NaN ignored; q_i = e4m3fn_rn_satfinite(x_i / s_j) with an IEEE
    fp32 division (not a reciprocal multiply); RoPE bits copied. Rows where `mask` is False are
    neither read nor written.
    """
    nope = _fp8_nope_offsets()
    m3 = mask[:, None, None]
    x = bf16_to_f32(tl.load(src[:, None, None] + nope, mask=m3, other=0.0), NATIVE)
    # NaN takes no part in amax, as in the CUDA writer's fmaxf reduction (tl.max would drop it on
    # the GPU but keep it in the interpreter); the NaN itself quantizes to e4m3 NaN.
    amax = tl.max(tl.where(x != x, 0.0, tl.abs(x)), axis=2)
    scale = _fp8_ds_mla_scale(amax, POW2)
    q = f32_to_e4m3_bits(tl.math.div_rn(x, tl.broadcast_to(scale[:, :, None], x.shape)))
    tl.store(dst[:, None, None] + nope, q.to(tl.uint8), mask=m3)

    at = _fp8_scale_offsets()
    shift = 8 * ((at - FP8_SCALES_AT) % 4)
    bits = scale.to(tl.int32, bitcast=True)[:, :, None]
    tl.store(dst[:, None, None] + at, ((bits >> shift) & 0xFF).to(tl.uint8), mask=m3)

    d = tl.arange(0, ROPE)[None, :]
    rope = tl.load(src[:, None] + NOPE + d, mask=mask[:, None]).to(tl.int16, bitcast=True).to(tl.int32)
    at = FP8_ROPE_AT + 2 * d
    tl.store(dst[:, None] + at, (rope & 0xFF).to(tl.uint8), mask=mask[:, None])
    tl.store(dst[:, None] + at + 1, ((rope >> 8) & 0xFF).to(tl.uint8), mask=mask[:, None])


@triton.jit
def dequantize_fp8_ds_mla_rows(src, dst, mask, NATIVE: tl.constexpr):
    """Read fp8_ds_mla rows: src [R] uint8 row pointers, dst [R] bf16 row pointers (576 values).

    NoPE_i = bf16_rn(float(e4m3 q_i) * s_{i // 128}) (fp32 multiply, then one rounding);
    RoPE bits copied.
    """
    nope = _fp8_nope_offsets()
    m3 = mask[:, None, None]
    at = _fp8_scale_offsets()
    shift = 8 * ((at - FP8_SCALES_AT) % 4)
    sbytes = tl.load(src[:, None, None] + at, mask=m3, other=0).to(tl.int32)
    # The four shifted bytes share no bits, so their sum is their bitwise or.
    scale = tl.sum(sbytes << shift, axis=2).to(tl.float32, bitcast=True)
    q = tl.load(src[:, None, None] + nope, mask=m3, other=0)
    x = e4m3_to_f32(q, NATIVE) * scale[:, :, None]
    tl.store(dst[:, None, None] + nope, to_bf16(x, NATIVE), mask=m3)

    d = tl.arange(0, ROPE)[None, :]
    at = FP8_ROPE_AT + 2 * d
    lo = tl.load(src[:, None] + at, mask=mask[:, None], other=0).to(tl.int32)
    hi = tl.load(src[:, None] + at + 1, mask=mask[:, None], other=0).to(tl.int32)
    rope = (lo | (hi << 8)).to(tl.int16).to(tl.bfloat16, bitcast=True)
    tl.store(dst[:, None] + NOPE + d, rope, mask=mask[:, None])


@triton.jit
def dequantize_nvfp4_ds_mla_rows(src, dst, mask, NATIVE: tl.constexpr):
    """Read nvfp4_ds_mla rows: src [R] uint8 row pointers, dst [R] bf16 row pointers (576 values).

    NoPE_i = bf16(e2m1(nibble i) * float(e4m3 scale of block i // 16)) (exact: a 2-bit mantissa
    times a 4-bit one fits bf16); RoPE_d = bf16(float(e4m3 byte 256 + d)) (exact).
    """
    e = tl.arange(0, NOPE)[None, :]
    m2 = mask[:, None]
    packed = tl.load(src[:, None] + e // 2, mask=m2, other=0).to(tl.int32)
    value = e2m1_bits_to_f32(packed >> ((e & 1) * 4))
    blk = e // NVFP4_BLOCK
    sf = tl.load(src[:, None] + NVFP4_SCALES_AT + 8 * (blk & 3) + (blk >> 2), mask=m2, other=0)
    tl.store(dst[:, None] + e, to_bf16(value * e4m3_to_f32(sf, NATIVE), NATIVE), mask=m2)

    d = tl.arange(0, ROPE)[None, :]
    rope = tl.load(src[:, None] + NVFP4_ROPE_AT + d, mask=m2, other=0)
    tl.store(dst[:, None] + NOPE + d, to_bf16(e4m3_to_f32(rope, NATIVE), NATIVE), mask=m2)
