"""Input checks of the sparse attention contracts, shared by every implementation.

These are the contracts of `sparse_prefill` and `sparse_decode_fp8` themselves (dtypes, shapes,
layouts, one device, a positive scale, decode indices that are -1 or a slot of the cache); each
implementation adds the limits of its own kernels on top (FlashMLA: 64/128 heads, top-k
multiples, alignment of its vector loads).
"""

from __future__ import annotations

import torch

from mla_verify.optimized.formats import D_QK, FP8_ROW_BYTES
from mla_verify.optimized.validation import InputError, check_index_range, check_same_device, check_sm_scale, check_tensor


def check_prefill_contract(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
) -> float:
    """q [T,H,576] bf16, kv [N,576] bf16, indices [T,K] int32, topk_length [T] int32, attn_sink
    [H] f32 (last dims contiguous, H >= 1, K >= 1, one device); returns sm_scale (> 0)."""
    check_tensor("q", q, dtype=torch.bfloat16, shape=(None, None, D_QK), last_dim_contiguous=True)
    tokens, heads, _ = q.shape
    if heads < 1:
        raise InputError(f"q: needs at least one head, got shape {tuple(q.shape)}")
    check_tensor("kv", kv, dtype=torch.bfloat16, shape=(None, D_QK), last_dim_contiguous=True)
    check_tensor("indices", indices, dtype=torch.int32, shape=(tokens, None), last_dim_contiguous=True)
    if indices.shape[1] < 1:
        raise InputError(f"indices: top-k width must be >= 1, got shape {tuple(indices.shape)}")
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtype=torch.int32, shape=(tokens,), contiguous=True)
    if attn_sink is not None:
        check_tensor("attn_sink", attn_sink, dtype=torch.float32, shape=(heads,), contiguous=True)
    check_same_device(q=q, kv=kv, indices=indices, topk_length=topk_length, attn_sink=attn_sink)
    return check_sm_scale(sm_scale)


def check_decode_contract(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float
) -> float:
    """q [B,S,H,576] bf16, kv_cache [NB,BS,656] uint8 with packed rows (stride(1) == 656),
    indices [B,S,K] int32 each -1 or in [0, NB*BS); returns sm_scale (> 0).

    Only -1 is an invalid index: FlashMLA reads any other value unchecked, and an out-of-bounds
    read can take down the CUDA context, so everything else out of range is refused here.
    """
    check_tensor("q", q, dtype=torch.bfloat16, shape=(None, None, None, D_QK), last_dim_contiguous=True)
    batch, seq, heads, _ = q.shape
    if min(batch, seq, heads) < 1:
        raise InputError(f"q: batch, query tokens and heads must all be >= 1, got shape {tuple(q.shape)}")
    check_tensor("kv_cache", kv_cache, dtype=torch.uint8, shape=(None, None, FP8_ROW_BYTES), last_dim_contiguous=True)
    if kv_cache.stride(1) != FP8_ROW_BYTES:
        raise InputError(
            f"kv_cache: rows of a page must be packed (stride(1) == {FP8_ROW_BYTES}), got strides {kv_cache.stride()}"
        )
    check_tensor("indices", indices, dtype=torch.int32, shape=(batch, seq, None), last_dim_contiguous=True)
    if indices.shape[2] < 1:
        raise InputError(f"indices: top-k width must be >= 1, got shape {tuple(indices.shape)}")
    check_same_device(q=q, kv_cache=kv_cache, indices=indices)
    sm_scale = check_sm_scale(sm_scale)
    check_index_range("indices", indices, kv_cache.shape[0] * kv_cache.shape[1], sentinels=(-1,))
    return sm_scale
