"""Versions of a user's FP8 sparse decode kernel for the drift words (issue 39): `v1` is float32
attention over the dequantized cache; the others change only how the softmax weights P meet V:

    v2     P rounded to bf16 before P.V, as a tensor-core kernel feeds them: inside every bound,
           and measurably worse (the median case's error grows by about a tenth, the tail's more)
    v3     P cut to 10 significant bits toward zero: the weights sum to about 1 - 2**-11, a gain the
           output's |bias| shows beyond the factor (rounding P coarser than bf16 fails bounds outright)
    v1_copy  v1 under another name, a rerun of the same kernel

The drift report must read v2 `worse`, v1 `unchanged` and v3 `drifted` against v1.
"""

from __future__ import annotations

import torch

from mla_verify.optimized.eager.paged_cache import row_values, slot_coords

NOPE = 512
TRUNCATED_BITS = 9


def _truncate(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x (>= 0) cut to `bits` significant bits, toward zero: every weight loses 2**-bits of itself on average."""
    mantissa, exponent = torch.frexp(x)
    return torch.ldexp(torch.floor(mantissa * 2.0**bits) / 2.0**bits, exponent)


def _decode(q, kv_cache, indices, sm_scale, weights=None):
    batch, s_q, heads, width = q.shape
    rows, topk = batch * s_q, indices.shape[2]
    idx = indices.reshape(rows, topk)
    valid = idx != -1
    keys = torch.zeros((rows, topk, width), dtype=torch.float32)
    keys[valid] = row_values(kv_cache[slot_coords(kv_cache, idx[valid])])
    logits = torch.bmm(q.reshape(rows, heads, width).float(), keys.transpose(1, 2)) * sm_scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    if weights is not None:
        probs = weights(probs)
    out = torch.bmm(probs, keys[..., :NOPE])
    empty = ~valid.any(dim=1)[:, None]
    out = out.masked_fill(empty[..., None], 0.0).reshape(batch, s_q, heads, NOPE).to(torch.bfloat16)
    lse = lse.masked_fill(empty, float("inf")).reshape(batch, s_q, heads).transpose(1, 2)
    return out, lse


def v1(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float):
    return _decode(q, kv_cache, indices, sm_scale)


def v2(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float):
    return _decode(q, kv_cache, indices, sm_scale, lambda p: p.to(torch.bfloat16).float())


def v3(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float):
    return _decode(q, kv_cache, indices, sm_scale, lambda p: _truncate(p, TRUNCATED_BITS))


v1_copy = v1

