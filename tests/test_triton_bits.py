"""The exact e4m3 / e2m1 decoders the Triton kernels share (optimized.kernels.bits) against torch.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mla_verify.optimized.kernels.bits import e2m1_bits_to_f32, e4m3_bits_to_f32
from tests.triton_glue_helpers import DEVICE, assert_same_bits


@triton.jit
def _decode_kernel(codes, e4m3, e2m1):
    i = tl.arange(0, 256)
    b = tl.load(codes + i)
    tl.store(e4m3 + i, e4m3_bits_to_f32(b))
    tl.store(e2m1 + i, e2m1_bits_to_f32(b))


def test_triton_bits_decoders_match_torch_including_negative_zero():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    e4m3 = torch.full((256,), math.nan, device=DEVICE)
    e2m1 = torch.full((256,), math.nan, device=DEVICE)
    _decode_kernel[(1,)](codes.to(DEVICE), e4m3, e2m1)
    want = codes.view(torch.float8_e4m3fn).float()
    nan = want.isnan()
    assert torch.equal(e4m3.cpu().isnan(), nan)
    assert_same_bits(e4m3.cpu()[~nan], want[~nan])  # 0x80 is -0.0, not +0.0
    magnitudes = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    assert_same_bits(e2m1.cpu(), torch.cat([magnitudes, -magnitudes])[(codes & 0xF).long()])
