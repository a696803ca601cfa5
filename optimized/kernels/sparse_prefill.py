"""Sparse MLA prefill attention over a bf16 KV array, in Triton (FlashMLA `flash_mla_sparse_fwd`'s
contract without its 64/128-head and top-k % 128 limits).

For query token t and head h, with V_t = {j < K : 0 <= idx[t,j] < N and j < topk_length[t]}
(duplicates count once per occurrence):

    s_j        = sm_scale * <q[t,h,:576], kv[idx[t,j], :576]>            j in V_t
    lse        = ln sum_j e^(s_j),   max_logits = max_j s_j
    out[t,h]   = sum_j softmax(s)_j kv[idx[t,j], :512] * 1/(1 + e^(sink_h - lse))

An index outside [0, N) is invalid and its row is never read. Empty V_t: out 0, lse +inf,
max_logits -inf (whatever the sink).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_verify.optimized import buffers
from mla_verify.optimized.attention_checks import check_prefill_contract
from mla_verify.optimized.formats import D_V
from mla_verify.optimized.kernels.attention_launch import AttentionConfig, fits_int32
from mla_verify.optimized.kernels.launch import native
from mla_verify.optimized.kernels.bits import to_bf16
from mla_verify.optimized.kernels.gathered_rows import offset, prefetch_rows
from mla_verify.optimized.kernels.online_softmax import LOG2E, attend_block, finish
from mla_verify.optimized.registry import TRITON, register


@triton.jit
def _in_range(idx, num_kv):
    """0 <= idx < num_kv as one unsigned comparison."""
    return idx.to(tl.uint32, bitcast=True) < tl.cast(num_kv, tl.uint32)


@triton.jit
def _sparse_prefill_kernel(
    q_ptr, kv_ptr, idx_ptr, topk_length_ptr, sink_ptr,
    out_ptr, lse_ptr, max_logits_ptr,
    sm_scale, num_kv, num_heads, topk, head_blocks,
    stride_q_t, stride_q_h, stride_kv, stride_idx_t, stride_out_t, stride_out_h,
    HAS_TOPK_LENGTH: tl.constexpr, HAS_SINK: tl.constexpr, OFFSETS32: tl.constexpr, PREFETCH: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NATIVE: tl.constexpr,
):
    # Head blocks vary fastest: the programs of one token run together and share its rows in L2.
    pid = tl.program_id(0)
    t = (pid // head_blocks).to(tl.int64)
    heads = (pid % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    dv = tl.arange(0, 512)
    dr = 512 + tl.arange(0, 64)

    q_rows = q_ptr + t * stride_q_t + heads[:, None] * stride_q_h
    q_nope = tl.load(q_rows + dv[None, :], mask=head_ok[:, None], other=0.0)
    q_rope = tl.load(q_rows + dr[None, :], mask=head_ok[:, None], other=0.0)

    k_end = topk
    if HAS_TOPK_LENGTH:
        k_end = tl.minimum(tl.maximum(tl.load(topk_length_ptr + t), 0), topk)

    idx_row = idx_ptr + t * stride_idx_t
    scale_log2e = sm_scale * LOG2E
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, 512), tl.float32)
    for start in range(0, k_end, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_row + j, mask=j < k_end, other=-1)
        if PREFETCH:
            # Loaded now, used after this block's dots: its latency hides behind them.
            ahead = j + PREFETCH * BLOCK_N
            idx_ahead = tl.load(idx_row + ahead, mask=ahead < k_end, other=-1)
        valid = _in_range(idx, num_kv)
        rows = kv_ptr + offset(idx, OFFSETS32) * stride_kv
        k_nope = tl.load(rows[:, None] + dv[None, :], mask=valid[:, None], other=0.0)
        k_rope = tl.load(rows[:, None] + dr[None, :], mask=valid[:, None], other=0.0)
        m, l, acc = attend_block(q_nope, q_rope, k_nope, k_rope, valid, m, l, acc, scale_log2e, NATIVE)
        if PREFETCH:
            ahead_rows = kv_ptr + offset(idx_ahead, OFFSETS32) * stride_kv
            prefetch_rows(ahead_rows.to(tl.pointer_type(tl.uint8)), _in_range(idx_ahead, num_kv),
                          idx_row.to(tl.pointer_type(tl.uint8)), 2 * 576, NATIVE)

    sink = float("-inf")
    if HAS_SINK:
        sink = tl.load(sink_ptr + heads, mask=head_ok, other=float("-inf"))
    lse, max_logit, scale = finish(m, l, sm_scale, sink)
    out = to_bf16(acc * scale[:, None], NATIVE)
    tl.store(out_ptr + t * stride_out_t + heads[:, None] * stride_out_h + dv[None, :], out, mask=head_ok[:, None])
    tl.store(lse_ptr + t * num_heads + heads, lse, mask=head_ok)
    tl.store(max_logits_ptr + t * num_heads + heads, max_logit, mask=head_ok)


def launch_sparse_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
    config: AttentionConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sparse_prefill` without the checks (for timing): inputs must already pass them."""
    is_native = native(q.device)
    tokens, heads, _ = q.shape
    topk = indices.shape[1]
    cfg = (config or AttentionConfig()).resolve(heads, topk)
    out = buffers.empty((tokens, heads, D_V), torch.bfloat16, q.device)
    lse = buffers.empty((tokens, heads), torch.float32, q.device)
    max_logits = buffers.empty((tokens, heads), torch.float32, q.device)
    if tokens == 0:
        return out, lse, max_logits
    head_blocks = triton.cdiv(heads, cfg.block_h)
    _sparse_prefill_kernel[(tokens * head_blocks,)](
        q, kv, indices, topk_length, attn_sink,
        out, lse, max_logits,
        sm_scale, kv.shape[0], heads, topk, head_blocks,
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), out.stride(0), out.stride(1),
        HAS_TOPK_LENGTH=topk_length is not None, HAS_SINK=attn_sink is not None,
        OFFSETS32=cfg.lean_addressing and fits_int32(kv.shape[0] * kv.stride(0)), PREFETCH=cfg.l2_prefetch,
        BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, NATIVE=is_native,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse, max_logits


@register("sparse_prefill", "triton", priority=TRITON, devices=("cpu", "cuda"), interpreted_on=("cpu",),
          deviations=("loop_bound",), graph=launch_sparse_prefill)
def sparse_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    *,
    config: AttentionConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse prefill attention: (out [T,H,512] bf16, lse [T,H] f32, max_logits [T,H] f32).

    q [T,H,576] bf16, kv [N,576] bf16, indices [T,K] int32 (outside [0,N) = invalid),
    topk_length [T] int32 (only the first topk_length[t] entries count), attn_sink [H] f32.
    lse = ln sum_j e^(s_j), s_j = sm_scale <q, kv[idx_j]>; out = softmax(s) @ kv[idx, :512],
    scaled by 1/(1+e^(sink-lse)); empty rows give out 0, lse +inf, max_logits -inf.
    """
    sm_scale = check_prefill_contract(q, kv, indices, sm_scale, topk_length, attn_sink)
    return launch_sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink, config)
