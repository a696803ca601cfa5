"""Two versions of a user's sparse prefill kernel for the drift tests: `v1` is the float32 eager
kernel, `v2` the same attention with its float32 output off by a gain of 1 + 2**-11 before the
bf16 store (a scale folded in wrongly). v2 stays inside every bound (its bias, 4.9e-4, is half
of abs_mean_err's 1e-3; its error grows by 4% of a bf16 rounding) but is measurably worse: the
drift report must flag it against v1, case for case.
"""

from __future__ import annotations

import torch

from mla_verify.optimized import eager

GAIN = 1 + 2.0**-11


def v1(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
       topk_length: torch.Tensor | None = None, attn_sink: torch.Tensor | None = None):
    return eager.sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink)


def v2(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float,
       topk_length: torch.Tensor | None = None, attn_sink: torch.Tensor | None = None):
    idx = indices.long()
    valid = (idx >= 0) & (idx < kv.shape[0])
    if topk_length is not None:
        valid &= torch.arange(indices.shape[1])[None, :] < topk_length[:, None]
    keys = torch.zeros((*valid.shape, kv.shape[1]), dtype=torch.float32)
    keys[valid] = kv[idx[valid]].float()
    out, lse, max_logits = eager.attend(q.float(), keys, valid, sm_scale, attn_sink)
    return (out * GAIN).to(torch.bfloat16), lse, max_logits
