"""Versions of a user's sparse prefill kernel for the drift tests: `v1` is the float32 eager kernel;
the others are the same attention, biased by a known amount before the stores, inside every bound:

    v2          output gain 1 + 2**-11 (a scale folded in wrongly): its mean relative error, 4.9e-4,
                is half of abs_mean_err's 1e-3; its error grows by 4% of a bf16 rounding
    gain10      output gain 1 + 2**-10, a quarter of the bf16 unit roundoff (issue 27)
    lse_offset  every LSE 4 fp32 steps of its row's logit scale high, 2**-22 (logit_l1 + |lse| + 1)
                (the scale `equivalence.judge.metrics.lse` measures in; 1/16 of lse_fp32_units' bound)

The drift report must flag each against v1, case for case (and a single run warn of the bias).
"""

from __future__ import annotations

import torch

from mla_verify.optimized import eager

GAIN = 1 + 2.0**-11
LSE_STEPS = 4


def v1(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
       topk_length: torch.Tensor | None = None, attn_sink: torch.Tensor | None = None):
    return eager.sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink)


def _attend(q, kv, indices, sm_scale, topk_length, attn_sink):
    """(out, lse, max_logits) in float32 as v1 computes them, and each row's logit scale."""
    idx = indices.long()
    valid = (idx >= 0) & (idx < kv.shape[0])
    if topk_length is not None:
        valid &= torch.arange(indices.shape[1])[None, :] < topk_length[:, None]
    keys = torch.zeros((*valid.shape, kv.shape[1]), dtype=torch.float32)
    keys[valid] = kv[idx[valid]].float()
    logit_l1 = (sm_scale * torch.bmm(q.float().abs(), keys.abs().transpose(1, 2))).amax(dim=-1)
    return (*eager.attend(q.float(), keys, valid, sm_scale, attn_sink), logit_l1)


def _gained(gain: float):
    def kernel(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
        out, lse, max_logits, _ = _attend(q, kv, indices, sm_scale, topk_length, attn_sink)
        return (out * gain).to(torch.bfloat16), lse, max_logits
    return kernel


v2 = _gained(GAIN)
gain10 = _gained(1 + 2.0**-10)


def lse_offset(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    out, lse, max_logits, logit_l1 = _attend(q, kv, indices, sm_scale, topk_length, attn_sink)
    step = 2.0**-24 * (logit_l1.double() + lse.double().abs() + 1.0)
    return out.to(torch.bfloat16), (lse.double() + LSE_STEPS * step).float(), max_logits


def scale_bf16(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float):
    """The float32 eager FP8 decode with each row's four fp32 tile scales (bytes 512..527) rounded
    to bf16 first: the SM90 FlashMLA decode kernel's declared deviation bf16_cache_scale, emulated
    on CPU (run it with deviations=("bf16_cache_scale",))."""
    rounded = kv_cache.clone()
    scales = rounded[..., 512:528].contiguous().view(torch.float32)
    rounded[..., 512:528] = scales.to(torch.bfloat16).float().view(torch.uint8)
    return eager.sparse_decode_fp8(q, rounded, indices, sm_scale)
