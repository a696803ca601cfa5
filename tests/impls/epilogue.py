"""A sparse prefill whose bf16 epilogue truncates: the fp32 output cut to bf16 toward zero (its low
16 bits dropped) where the contract rounds to nearest. One bug that reaches the op, every
forward_mqa path through the stage and the properties that run it (issue 50 item 2)."""

from __future__ import annotations

import torch

from mla_verify import reference


def _truncated_bf16(x: torch.Tensor) -> torch.Tensor:
    """`x` in bf16, rounded toward zero: the fp32 bits past bf16's 7 mantissa bits dropped."""
    bits = x.float().contiguous().view(torch.int32) & ~0xFFFF
    return bits.view(torch.float32).to(torch.bfloat16)  # exact: nothing is left to round


def sparse_prefill(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    res = reference.sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink, dtype=torch.float32)
    return _truncated_bf16(res.out), res.lse.float(), res.max_logits.float()
