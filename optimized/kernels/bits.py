"""Exact number-format conversions as integer bit arithmetic, for use inside Triton kernels.

Why not `x.to(tl.bfloat16)` / `tl.float8e4nv`: Triton's CPU interpreter rounds fp32 -> bf16 toward
zero and mis-encodes float8e4nv (measured with triton 3.6 and 3.9: 126.6 -> 104, 0x7F decodes to
480 instead of NaN); with triton 3.6 it also flushes bf16 subnormals to zero when widening to
fp32. These helpers give the same bits compiled and interpreted. Kernels whose
inner loop is conversion-bound pass NATIVE=True on a GPU to use the hardware instructions, which
round the same way.
"""

import triton
import triton.language as tl


@triton.jit
def f32_to_bf16_bits(x):
    """fp32 -> bf16 bit pattern (int16), round to nearest even; NaN -> canonical NaN."""
    u = x.to(tl.int32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where(x != x, 0x7FC0, r)
    return r.to(tl.int16)


@triton.jit
def to_bf16(x, NATIVE: tl.constexpr):
    """fp32 -> bf16 value with round-to-nearest-even on every backend."""
    if NATIVE:
        return x.to(tl.bfloat16)
    else:
        return f32_to_bf16_bits(x).to(tl.bfloat16, bitcast=True)


@triton.jit
def bf16_to_f32(x, NATIVE: tl.constexpr):
    """bf16 -> fp32, exactly (the interpreter's `.to(tl.float32)` flushes bf16 subnormals to zero)."""
    if NATIVE:
        return x.to(tl.float32)
    else:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _with_sign(mag, sign):
    """Set the sign bit of fp32 `mag` where `sign` is 1. Not `-mag`: Triton negates as 0 - x,
    which turns -0 into +0."""
    return (mag.to(tl.int32, bitcast=True) | (sign.to(tl.int32) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_bits_to_f32(b):
    """float8_e4m3fn bit pattern (any int type, low 8 bits used) -> fp32, exactly; 0x7F/0xFF -> NaN."""
    b = b.to(tl.int32) & 0xFF
    sign = b >> 7
    exp = (b >> 3) & 0xF
    man = b & 0x7
    normal = ((exp + 120) << 23) | (man << 20)
    mag = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal.to(tl.float32, bitcast=True))
    mag = tl.where((exp == 15) & (man == 7), float("nan"), mag)
    return _with_sign(mag, sign)


@triton.jit
def e4m3_to_f32(b, NATIVE: tl.constexpr):
    """uint8 float8_e4m3fn payload -> fp32 (hardware conversion when NATIVE)."""
    if NATIVE:
        return b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        return e4m3_bits_to_f32(b)


@triton.jit
def f32_to_e4m3_bits(x):
    """fp32 -> float8_e4m3fn bits (int32 in [0, 255]): round to nearest even, saturate to +-448
    (CUDA's __NV_SATFINITE), NaN -> 0x7F."""
    a = tl.minimum(tl.abs(x), 448.0)
    a = tl.where(x != x, 0.0, a)  # NaN is encoded below; keep the arithmetic finite
    u = a.to(tl.int32, bitcast=True)
    normal = ((u + 0x7FFFF + ((u >> 20) & 1)) >> 20) - (120 << 3)
    # Below 2**-6 the format is fixed-point in steps of 2**-9; adding 2**23 rounds to an integer
    # with the FPU's round-to-nearest-even.
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(a >= 0.015625, normal, sub)
    code = tl.where(x != x, 0x7F, code)
    sign = (x.to(tl.int32, bitcast=True) >> 31) & 1
    return code | (sign << 7)


@triton.jit
def e2m1_bits_to_f32(n):
    """e2m1 (fp4) nibble (low 4 bits used) -> fp32: magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6."""
    n = n.to(tl.int32) & 0xF
    exp = (n >> 1) & 0x3
    man = (n & 1).to(tl.float32)
    mag = tl.where(exp == 0, man * 0.5, (2.0 + man) * tl.where(exp == 1, 0.5, tl.where(exp == 2, 1.0, 2.0)))
    return _with_sign(mag, n >> 3)
