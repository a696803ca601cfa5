"""Sparse MQA attention in float32: the prefill kernel's contract over flat bf16 rows and the
decode kernel's over a paged quantized cache, both through one core, `attend`, on chunks of
tokens within the work budget. Errors stay around 1e-6 of the values.
"""

from __future__ import annotations

import torch

from .. import buffers
from ..validation import InputError, check_index_range, check_same_device, check_tensor
from .common import HEAD, NOPE, chunks, full_fp32_matmul, stage
from .fp8_ds_mla import FP8_ROW
from .nvfp4_ds_mla import NVFP4_ROW
from .paged_cache import DECODE_BYTES_PER_ROW, check_paged_cache, row_values, slot_coords


def attend(
    q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sm_scale: float, attn_sink: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [c, H, 576], keys [c, K, 576] float32 (zero where invalid), valid [c, K] ->
    out [c, H, 512] = softmax(s) @ V, lse = logsumexp(s), max_logits = max(s) over the valid
    s_j = sm_scale <q, K_j>; times sigmoid(lse - sink) with a sink; empty rows 0 / +inf / -inf.

    All three in float32, before any bf16 store: public so a variant of a stage can reuse the
    core and change only what it does with the result. Inputs are not checked."""
    masked = ~valid[:, None, :]
    with full_fp32_matmul():
        logits = torch.bmm(q, keys.transpose(1, 2)).mul_(sm_scale).masked_fill_(masked, float("-inf"))
        probs = torch.softmax(logits, dim=-1).masked_fill_(masked, 0.0)  # empty rows: NaN -> 0
        out = torch.bmm(probs, keys[..., :NOPE])
    lse = torch.logsumexp(logits, dim=-1)
    if attn_sink is not None:
        # exp(lse) / (exp(lse) + exp(sink)): the sink is one more logit with a zero value vector.
        out *= torch.sigmoid(lse - attn_sink[None, :])[..., None]
    empty = ~valid.any(dim=1)[:, None]
    return out.masked_fill_(empty[..., None], 0.0), lse.masked_fill_(empty, float("inf")), logits.amax(dim=-1)


def _check_sm_scale(sm_scale: float) -> None:
    if not sm_scale > 0:
        raise InputError(f"sm_scale must be > 0 (the kernels take the row max before scaling), got {sm_scale}")


@stage("sparse_prefill", deviations=("gemm_batch",))
def sparse_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`flash_mla_sparse_fwd` over flat bf16 rows: entry j of token t is valid iff
    0 <= indices[t, j] < N and j < topk_length[t]. Returns (out bf16, lse f32, max_logits f32)."""
    check_tensor("q", q, dtype=torch.bfloat16, shape=(None, None, HEAD), last_dim_contiguous=True)
    num_tokens, num_heads, _ = q.shape
    check_tensor("kv", kv, dtype=torch.bfloat16, shape=(None, HEAD), last_dim_contiguous=True)
    check_tensor("indices", indices, dtype=torch.int32, shape=(num_tokens, None))
    topk = indices.shape[1]
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dtype=torch.int32, shape=(num_tokens,))
        check_index_range("topk_length", topk_length, topk + 1)  # longer would read past the row
    if attn_sink is not None:
        check_tensor("attn_sink", attn_sink, dtype=torch.float32, shape=(num_heads,))
    check_same_device(q=q, kv=kv, indices=indices, topk_length=topk_length, attn_sink=attn_sink)
    _check_sm_scale(sm_scale)

    idx = indices.long()
    valid = (idx >= 0) & (idx < kv.shape[0])
    if topk_length is not None:
        valid &= torch.arange(topk, device=q.device)[None, :] < topk_length[:, None]
    out = buffers.empty((num_tokens, num_heads, NOPE), torch.bfloat16, q.device)
    lse = buffers.empty((num_tokens, num_heads), torch.float32, q.device)
    max_logits = buffers.empty((num_tokens, num_heads), torch.float32, q.device)
    for part in chunks(num_tokens, topk * (HEAD * 4 + num_heads * 12)):
        v = valid[part]
        keys = torch.zeros((*v.shape, HEAD), dtype=torch.float32, device=q.device)
        keys[v] = kv[idx[part][v]].float()  # only valid rows are read: others may hold NaN
        o, l, m = attend(q[part].float(), keys, v, sm_scale, attn_sink)
        out[part], lse[part], max_logits[part] = o, l, m
    return out, lse, max_logits


def _sparse_decode(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 decode kernel's contract on a paged quantized cache: indices are physical slots,
    only -1 is invalid. Returns out [B, S, H, 512] bf16 and lse [B, H, S] f32 (a transposed view
    of a [B, S, H] buffer, as the kernel returns it)."""
    check_tensor("q", q, dtype=torch.bfloat16, shape=(None, None, None, HEAD), last_dim_contiguous=True)
    batch, s_q, num_heads, _ = q.shape
    check_paged_cache(kv_cache, width)
    check_tensor("indices", indices, dtype=torch.int32, shape=(batch, s_q, None))
    check_same_device(q=q, kv_cache=kv_cache, indices=indices)
    _check_sm_scale(sm_scale)
    # The kernel checks nothing: any other out-of-range slot is an out-of-bounds read.
    check_index_range("indices", indices, kv_cache.shape[0] * kv_cache.shape[1], sentinels=(-1,))

    rows = batch * s_q
    topk = indices.shape[2]
    idx = indices.reshape(rows, topk)
    valid = idx != -1
    q_rows = q.reshape(rows, num_heads, HEAD)
    out = buffers.empty((batch, s_q, num_heads, NOPE), torch.bfloat16, q.device)
    lse = buffers.empty((batch, s_q, num_heads), torch.float32, q.device)
    out_rows, lse_rows = out.view(rows, num_heads, NOPE), lse.view(rows, num_heads)
    for part in chunks(rows, topk * (DECODE_BYTES_PER_ROW + num_heads * 12)):
        v = valid[part]
        keys = torch.zeros((*v.shape, HEAD), dtype=torch.float32, device=q.device)
        keys[v] = row_values(kv_cache[slot_coords(kv_cache, idx[part][v])])
        o, l, _ = attend(q_rows[part].float(), keys, v, sm_scale, None)
        out_rows[part], lse_rows[part] = o, l
    return out, lse.transpose(1, 2)


@stage("sparse_decode_fp8", deviations=("gemm_batch",))
def sparse_decode_fp8(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`flash_mla_with_kvcache` sparse decode on a [NB, BS, 656] fp8_ds_mla cache:
    q [B, S, H, 576], indices [B, S, K] -> (out [B, S, H, 512] bf16, lse [B, H, S] f32)."""
    return _sparse_decode(q, kv_cache, indices, sm_scale, FP8_ROW)


@stage("sparse_decode_nvfp4")
def sparse_decode_nvfp4(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same decode on a [NB, BS, 352] nvfp4_ds_mla cache (SM100's FP4 decode)."""
    return _sparse_decode(q, kv_cache, indices, sm_scale, NVFP4_ROW)

