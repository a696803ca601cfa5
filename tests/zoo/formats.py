"""Broken fp8_ds_mla writers: each is the reference's with one historical or plausible defect."""

import torch

from mla_verify import reference
from mla_verify.reference import fp8_ds_mla as F8


def _quantize_with(kv, scale_rule, *, divisor=F8.FP8_MAX, reciprocal=False, floor=F8.POW2_FLOOR):
    nope = kv[:, :512].float()
    amax = nope.abs().view(-1, 4, 128).amax(-1)
    ratio = amax / divisor
    if scale_rule == "pow2":
        mantissa, exponent = torch.frexp(torch.clamp_min(ratio, torch.tensor(floor, dtype=torch.float32)))
        scales = torch.ldexp(torch.ones_like(ratio), torch.where(mantissa == 0.5, exponent - 1, exponent))
    else:
        scales = torch.clamp_min(ratio, torch.finfo(torch.float32).tiny)
    x = nope.view(-1, 4, 128)
    scaled = x * (1.0 / scales[..., None]) if reciprocal else x / scales[..., None]
    rows = torch.empty(kv.shape[0], 656, dtype=torch.uint8, device=kv.device)
    rows[:, :512] = scaled.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).view(-1, 512)
    rows[:, 512:528] = scales.contiguous().view(torch.uint8)
    rows[:, 528:] = kv[:, 512:].contiguous().view(torch.uint8)
    return rows


def divisor_224(kv, scale_rule="pow2"):
    """vLLM #32976 in reverse: the ROCm fnuz divisor 224 used for e4m3fn."""
    return _quantize_with(kv, scale_rule, divisor=224.0)


def reciprocal_multiply(kv, scale_rule="pow2"):
    """x * (1/scale) instead of the contract's x / scale: differs wherever raw scales round."""
    return _quantize_with(kv, scale_rule, reciprocal=True)


def pow2_floor_flt_min(kv, scale_rule="pow2"):
    """The power-of-two rule with the old FLT_MIN floor instead of 1e-4: zero and tiny tiles differ."""
    return _quantize_with(kv, scale_rule, floor=torch.finfo(torch.float32).tiny)


def writes_negative_slots(kv, kv_cache, slot_mapping, scale_rule="pow2"):
    """Padding tokens (slot < 0) are not skipped: slot -1 lands in the cache's last row."""
    rows = reference.quantize_fp8_ds_mla(kv, scale_rule)
    bs = kv_cache.shape[1]
    slots = slot_mapping.long() % (kv_cache.shape[0] * bs)
    kv_cache[slots // bs, slots % bs] = rows


def ignores_block_stride(kv, kv_cache, slot_mapping, scale_rule="pow2"):
    """vLLM #47493 class: addresses blocks as if they were block_size rows apart."""
    rows = reference.quantize_fp8_ds_mla(kv, scale_rule)
    flat = kv_cache.as_strided((kv_cache.shape[0] * kv_cache.shape[1], 656), (656, 1))
    keep = slot_mapping >= 0
    flat[slot_mapping[keep].long()] = rows[keep]
