"""Sparse MQA attention with the FlashMLA kernels' conventions, in float64 (or float32).

For query token t, head h, with the valid entries V_t of the token's index row:
    s_j        = sm_scale * <q[t, h, :576], K_j[:576]>                j in V_t
    lse        = ln sum_j exp(s_j)                                    natural log
    max_logits = max_j s_j
    out        = sum_j exp(s_j - lse) * K_j[:512]                      V is the NoPE part of K
    with an attention sink: out *= 1 / (1 + exp(sink_h - lse))        (never changes lse)
A row with no valid entry gives out = 0, lse = +inf, max_logits = -inf. Duplicate entries count
once each. Every head reads the same K rows (MQA, one latent KV head).

Two index forms:
  * prefill (`flash_mla_sparse_fwd`): indices are rows of a flat bf16 array `kv [N, 576]`;
    invalid = negative or >= N, and positions j >= topk_length[t] are ignored.
  * FP8 decode (`flash_mla_with_kvcache` with indices): indices are physical slots
    block * page_size + offset into a paged fp8_ds_mla cache; ONLY -1 is invalid. Anything else
    out of range is a caller bug the kernel does not check (it reads out of bounds), so the
    reference refuses it.

Memory is bounded by chunking over query tokens: a chunk gathers its K rows in the compute dtype.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .fp8_ds_mla import HEAD_DIM, NOPE_DIM, ROW_BYTES, fp8_ds_mla_values
from .nvfp4_ds_mla import ROW_BYTES as NVFP4_ROW_BYTES, nvfp4_ds_mla_values

DEFAULT_BUDGET_BYTES = 512 << 20


class AttentionResult(NamedTuple):
    out: torch.Tensor          # [..., H, 512]
    lse: torch.Tensor          # natural log; +inf on empty rows
    max_logits: torch.Tensor   # -inf on empty rows
    logit_l1: torch.Tensor     # max_j sm_scale * sum_d |q_d| |K_jd|: the size fp32 errors scale with


def token_chunk(num_heads: int, topk: int, itemsize: int, budget_bytes: int) -> int:
    """Query tokens per chunk so that gathered rows and logits stay within `budget_bytes`."""
    per_token = topk * (HEAD_DIM + 2 * num_heads) * itemsize
    return max(1, budget_bytes // max(per_token, 1))


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    valid: torch.Tensor,
    sm_scale: float,
    attn_sink: torch.Tensor | None = None,
) -> AttentionResult:
    """The formula above for a chunk: q [c, H, 576], keys [c, k, 576], valid [c, k]."""
    keys = torch.where(valid[..., None], keys, 0)  # invalid rows are never read: no NaN leaks
    logits = sm_scale * torch.einsum("thd,tkd->thk", q, keys)
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    max_logits = logits.amax(dim=-1)
    empty = ~valid.any(dim=-1)[:, None].expand_as(lse)
    probs = torch.exp(logits - torch.where(empty, 0, lse)[..., None])
    out = torch.einsum("thk,tkd->thd", probs, keys[..., :NOPE_DIM])
    if attn_sink is not None:
        sink = attn_sink.to(out.dtype)
        out = out / (1 + torch.exp(sink[None, :] - lse))[..., None]
    # Only a scale for the tolerance: float32 is plenty and halves the reference's extra cost.
    l1 = sm_scale * torch.einsum("thd,tkd->thk", q.abs().float(), keys.abs().float()).to(q.dtype)
    logit_l1 = l1.masked_fill(~valid[:, None, :], 0).amax(dim=-1)
    out = out.masked_fill(empty[..., None], 0)
    lse = lse.masked_fill(empty, float("inf"))
    return AttentionResult(out, lse, max_logits, logit_l1)


def attend_rows(
    q: torch.Tensor,
    valid: torch.Tensor,
    gather: Callable[[torch.Tensor], torch.Tensor],
    sm_scale: float,
    attn_sink: torch.Tensor | None,
    dtype: torch.dtype,
    budget_bytes: int,
) -> AttentionResult:
    """`attend` over q [n, H, 576] in token chunks; `gather(rows)` returns the chunk's keys."""
    n, num_heads, _ = q.shape
    if sm_scale <= 0:
        raise ValueError(f"sm_scale must be > 0 (the kernels take the row max before scaling), got {sm_scale}")
    if n == 0:
        z = q.new_zeros((0, num_heads), dtype=dtype)
        return AttentionResult(q.new_zeros((0, num_heads, NOPE_DIM), dtype=dtype), z, z, z)
    chunk = token_chunk(num_heads, valid.shape[1], dtype.itemsize, budget_bytes)
    parts = []
    for start in range(0, n, chunk):
        rows = torch.arange(start, min(start + chunk, n), device=q.device)
        parts.append(attend(q[rows].to(dtype), gather(rows).to(dtype), valid[rows], sm_scale, attn_sink))
    return AttentionResult(*(torch.cat(p, dim=0) for p in zip(*parts)))


def sparse_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float64,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> AttentionResult:
    """`flash_mla_sparse_fwd`: q [T, H, 576], kv [N, 576], indices [T, K], topk_length [T].

    Valid entry: 0 <= indices[t, j] < N and j < topk_length[t]. Returns out [T, H, 512],
    lse / max_logits / logit_l1 [T, H], all in `dtype`.
    """
    if q.dim() != 3 or q.shape[2] != HEAD_DIM or kv.dim() != 2 or kv.shape[1] != HEAD_DIM:
        raise ValueError(f"q [T, H, {HEAD_DIM}] and kv [N, {HEAD_DIM}] expected, got {tuple(q.shape)}, {tuple(kv.shape)}")
    if indices.dim() != 2 or indices.shape[0] != q.shape[0]:
        raise ValueError(f"indices must be [T={q.shape[0]}, K], got {tuple(indices.shape)}")
    idx = indices.long()
    valid = (idx >= 0) & (idx < kv.shape[0])
    if topk_length is not None:
        valid &= torch.arange(idx.shape[1], device=idx.device)[None, :] < topk_length.long()[:, None]
    return attend_rows(
        q, valid, lambda rows: kv[torch.where(valid[rows], idx[rows], 0)],
        sm_scale, attn_sink, dtype, budget_bytes,
    )


def cache_row_values(kv_cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The exact values of the cache rows at physical `slots` (block * page_size + offset)."""
    block_size = kv_cache.shape[1]
    rows = kv_cache[slots // block_size, slots % block_size]
    width = kv_cache.shape[-1]
    if kv_cache.dtype == torch.uint8 and width == ROW_BYTES:
        return fp8_ds_mla_values(rows, dtype)
    if kv_cache.dtype == torch.uint8 and width == NVFP4_ROW_BYTES:
        return nvfp4_ds_mla_values(rows, dtype)
    if kv_cache.dtype == torch.bfloat16 and width == HEAD_DIM:
        return rows.to(dtype)
    raise ValueError(f"unknown cache row format: {kv_cache.dtype} x {width}")


def sparse_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    attn_sink: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float64,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> AttentionResult:
    """`flash_mla_with_kvcache` sparse decode: q [B, S, H, 576], indices [B, S, K] physical slots.

    Reads any cache format by its exact meaning. Returns out [B, S, H, 512] and lse / max_logits /
    logit_l1 laid out [B, H, S], as the kernel lays out its lse.
    """
    if q.dim() != 4 or q.shape[3] != HEAD_DIM or indices.dim() != 3 or indices.shape[:2] != q.shape[:2]:
        raise ValueError(f"q [B, S, H, {HEAD_DIM}] and indices [B, S, K] expected, got {tuple(q.shape)}, {tuple(indices.shape)}")
    batch, s_q, num_heads, _ = q.shape
    capacity = kv_cache.shape[0] * kv_cache.shape[1]
    idx = indices.long().reshape(batch * s_q, indices.shape[-1])
    bad = (idx != -1) & ((idx < 0) | (idx >= capacity))
    if bool(bad.any()):
        where = tuple(bad.nonzero()[0].tolist())
        raise ValueError(
            f"decode index {int(idx[where])} at {where} is neither -1 nor a slot in [0, {capacity}): "
            "the FP8 decode kernel would read out of bounds"
        )
    valid = idx != -1
    flat = attend_rows(
        q.reshape(batch * s_q, num_heads, HEAD_DIM), valid,
        lambda rows: cache_row_values(kv_cache, torch.where(valid[rows], idx[rows], 0), dtype),
        sm_scale, attn_sink, dtype, budget_bytes,
    )

    def heads_major(x: torch.Tensor) -> torch.Tensor:
        return x.view(batch, s_q, num_heads).transpose(1, 2)

    return AttentionResult(
        flat.out.view(batch, s_q, num_heads, NOPE_DIM),
        heads_major(flat.lse), heads_major(flat.max_logits), heads_major(flat.logit_l1),
    )


def sparse_decode_fp8(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    attn_sink: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float64,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> AttentionResult:
    """The public-contract decode op: `sparse_decode` on a [NB, BS, 656] uint8 fp8_ds_mla cache."""
    if kv_cache.dtype != torch.uint8 or kv_cache.dim() != 3 or kv_cache.shape[2] != ROW_BYTES:
        raise ValueError(f"kv_cache must be [NB, BS, {ROW_BYTES}] uint8, got {tuple(kv_cache.shape)} {kv_cache.dtype}")
    return sparse_decode(q, kv_cache, indices, sm_scale, attn_sink, dtype=dtype, budget_bytes=budget_bytes)
