"""Sparse MLA decode attention reading the fp8_ds_mla KV cache directly, in Triton (FlashMLA
`flash_mla_with_kvcache`'s sparse FP8 contract without its 64/128-head and top-k % 64 limits).

A cache row is 656 bytes: [0, 512) float8_e4m3fn NoPE, [512, 528) four fp32 scales (scale i
covers NoPE elements [128i, 128i+128)), [528, 656) 64 bf16 RoPE. It is dequantized as

    K[d] = bf16(float(fp8[d]) * scale[d // 128])   d < 512   (fp32 multiply, round to nearest even)
    K[512 + r] = rope[r]

which is exact for power-of-two scales (the "bf16_dequant" deviation otherwise). An index is a
physical slot, block * page_size + offset, and only -1 is invalid. For batch b, query token s,
head h: s_j = sm_scale <q[b,s,h], K_j>, lse[b,h,s] = ln sum_j e^(s_j), out[b,s,h] =
softmax(s) @ K[:, :512]; a row of -1 gives out 0, lse +inf.

When B*S*head-blocks programs would leave SMs idle, the top-k list is split over several programs
(split-KV); each writes an fp32 partial output normalised by its own sum plus its lse, and a
combine kernel merges them: lse = ln sum_i e^(lse_i), out = sum_i e^(lse_i - lse) out_i. The
split plan depends on the batch, so a request's bits do too (the "split_kv" deviation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_verify.optimized import buffers
from mla_verify.optimized.attention_checks import check_decode_contract
from mla_verify.optimized.formats import D_V, FP8_ROW_BYTES
from mla_verify.optimized.kernels.attention_launch import AttentionConfig, fits_int32, num_sms, split_plan
from mla_verify.optimized.kernels.launch import native
from mla_verify.optimized.kernels.bits import e4m3_to_f32, to_bf16
from mla_verify.optimized.kernels.gathered_rows import offset, prefetch_rows
from mla_verify.optimized.kernels.online_softmax import LOG2E, attend_block, finish
from mla_verify.optimized.registry import TRITON, register
from mla_verify.optimized.validation import InputError


@triton.jit
def _row_ptrs(cache_ptr, idx, valid, block_size, stride_block, OFFSETS32: tl.constexpr, PACKED: tl.constexpr):
    """Byte addresses of cache slots `idx` (slot 0 where not `valid`). PACKED: pages follow each
    other without padding (stride(0) == page * 656), so slot s starts at byte s * 656."""
    slot = tl.where(valid, idx, 0)
    if PACKED:
        return cache_ptr + offset(slot, OFFSETS32) * 656
    else:
        return cache_ptr + offset(slot // block_size, OFFSETS32) * stride_block + offset(slot % block_size, OFFSETS32) * 656


@triton.jit
def _gather_dequant(rows, valid, BLOCK_N: tl.constexpr, NATIVE: tl.constexpr):
    """Cache rows at byte addresses `rows` -> (k_nope [BN, 512] bf16, k_rope [BN, 64] bf16)."""
    codes = tl.load(rows[:, None] + tl.arange(0, 512)[None, :], mask=valid[:, None], other=0)
    scales = tl.load((rows + 512).to(tl.pointer_type(tl.float32))[:, None] + tl.arange(0, 4)[None, :],
                     mask=valid[:, None], other=0.0)
    tiles = tl.reshape(e4m3_to_f32(codes, NATIVE), (BLOCK_N, 4, 128)) * scales[:, :, None]
    k_nope = to_bf16(tl.reshape(tiles, (BLOCK_N, 512)), NATIVE)
    k_rope = tl.load((rows + 528).to(tl.pointer_type(tl.bfloat16))[:, None] + tl.arange(0, 64)[None, :],
                     mask=valid[:, None], other=0.0)
    return k_nope, k_rope


@triton.jit
def _sparse_decode_kernel(
    q_ptr, cache_ptr, idx_ptr,
    out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
    sm_scale, seq, num_heads, topk, head_blocks, num_splits, split_len, block_size,
    stride_q_b, stride_q_s, stride_q_h, stride_block, stride_idx_b, stride_idx_s,
    SPLIT: tl.constexpr, OFFSETS32: tl.constexpr, PACKED: tl.constexpr, PREFETCH: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NATIVE: tl.constexpr,
):
    """One program: one (b, s) row, one head block, one split of the top-k list.

    Outputs are indexed by row = b*S + s: out [rows, H, 512], lse [rows, H] (the caller views it
    as [B, H, S]); partials [rows, H, splits, 512] and [rows, H, splits].
    """
    # Head blocks vary fastest, then splits: programs that gather the same rows run together.
    pid = tl.program_id(0)
    hb = pid % head_blocks
    split = (pid // head_blocks) % num_splits
    row = (pid // (head_blocks * num_splits)).to(tl.int64)
    b = row // seq
    s = row % seq
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    dv = tl.arange(0, 512)

    q_rows = q_ptr + b * stride_q_b + s * stride_q_s + heads[:, None] * stride_q_h
    q_nope = tl.load(q_rows + dv[None, :], mask=head_ok[:, None], other=0.0)
    q_rope = tl.load(q_rows + 512 + tl.arange(0, 64)[None, :], mask=head_ok[:, None], other=0.0)

    begin = split * split_len
    end = tl.minimum(begin + split_len, topk)
    idx_row = idx_ptr + b * stride_idx_b + s * stride_idx_s
    scale_log2e = sm_scale * LOG2E
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, 512), tl.float32)
    for start in range(begin, end, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_row + j, mask=j < end, other=-1)
        if PREFETCH:
            # Loaded now, used after this block's dots: its latency hides behind them.
            ahead = j + PREFETCH * BLOCK_N
            idx_ahead = tl.load(idx_row + ahead, mask=ahead < end, other=-1)
        valid = idx != -1
        rows = _row_ptrs(cache_ptr, idx, valid, block_size, stride_block, OFFSETS32, PACKED)
        k_nope, k_rope = _gather_dequant(rows, valid, BLOCK_N, NATIVE)
        m, l, acc = attend_block(q_nope, q_rope, k_nope, k_rope, valid, m, l, acc, scale_log2e, NATIVE)
        if PREFETCH:
            ahead_ok = idx_ahead != -1
            prefetch_rows(_row_ptrs(cache_ptr, idx_ahead, ahead_ok, block_size, stride_block, OFFSETS32, PACKED),
                          ahead_ok, idx_row.to(tl.pointer_type(tl.uint8)), 656, NATIVE)

    lse, _, scale = finish(m, l, sm_scale, float("-inf"))
    o = acc * scale[:, None]
    if SPLIT:
        # An empty split weighs e^-inf = 0 in the combine (an empty final row is +inf).
        part = (row * num_heads + heads) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * 512 + dv[None, :], o, mask=head_ok[:, None])
        tl.store(part_lse_ptr + part, tl.where(l > 0.0, lse, float("-inf")), mask=head_ok)
    else:
        tl.store(out_ptr + (row * num_heads + heads)[:, None] * 512 + dv[None, :], to_bf16(o, NATIVE),
                 mask=head_ok[:, None])
        tl.store(lse_ptr + row * num_heads + heads, lse, mask=head_ok)


@triton.jit
def _combine_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, num_splits,
                           BLOCK_S: tl.constexpr, NATIVE: tl.constexpr):
    """One program per (row, head): out = sum_i e^(lse_i - lse) out_i, lse = ln sum_i e^(lse_i)."""
    rh = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_S)
    top = tl.max(tl.load(part_lse_ptr + rh * num_splits + i, mask=i < num_splits, other=float("-inf")), 0)
    nonempty = top > float("-inf")
    top = tl.where(nonempty, top, 0.0)
    dv = tl.arange(0, 512)
    total = 0.0
    o = tl.zeros((512,), tl.float32)
    # One split at a time: a [splits, 512] tile would spill once there are many splits.
    for k in range(0, num_splits):
        w = tl.math.exp2((tl.load(part_lse_ptr + rh * num_splits + k) - top) * LOG2E)
        total += w
        o += w * tl.load(part_out_ptr + (rh * num_splits + k) * 512 + dv)
    total = tl.where(nonempty, total, 1.0)
    tl.store(out_ptr + rh * 512 + dv, to_bf16(o / total, NATIVE))
    tl.store(lse_ptr + rh, tl.where(nonempty, top + tl.log(total), float("inf")))


def check_decode_inputs(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float
) -> float:
    """The decode contract, plus word alignment of the rows (the fp32 scales are loaded as words)."""
    sm_scale = check_decode_contract(q, kv_cache, indices, sm_scale)
    if kv_cache.data_ptr() % 4 or kv_cache.stride(0) % 4:
        raise InputError(
            f"kv_cache: base address and stride(0) must be multiples of 4 bytes "
            f"(address % 4 = {kv_cache.data_ptr() % 4}, strides {kv_cache.stride()})"
        )
    return sm_scale


def launch_sparse_decode_fp8(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    config: AttentionConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sparse_decode_fp8` without the checks (for timing): inputs must already pass them."""
    is_native = native(q.device)
    batch, seq, heads, _ = q.shape
    topk = indices.shape[2]
    cfg = (config or AttentionConfig()).resolve(heads, topk)
    rows = batch * seq
    head_blocks = triton.cdiv(heads, cfg.block_h)
    splits, split_len = split_plan(topk, cfg.block_n, rows * head_blocks, num_sms(q.device), cfg.num_splits)

    out = buffers.empty((batch, seq, heads, D_V), torch.bfloat16, q.device)
    lse = buffers.empty((batch, seq, heads), torch.float32, q.device)
    if splits > 1:
        part_out = buffers.empty((rows, heads, splits, D_V), torch.float32, q.device)
        part_lse = buffers.empty((rows, heads, splits), torch.float32, q.device)
    else:
        part_out = part_lse = None
    _sparse_decode_kernel[(rows * head_blocks * splits,)](
        q, kv_cache, indices,
        out, lse, part_out, part_lse,
        sm_scale, seq, heads, topk, head_blocks, splits, split_len, kv_cache.shape[1],
        q.stride(0), q.stride(1), q.stride(2), kv_cache.stride(0), indices.stride(0), indices.stride(1),
        SPLIT=splits > 1, PREFETCH=cfg.l2_prefetch,
        OFFSETS32=cfg.lean_addressing and fits_int32(kv_cache.shape[0] * kv_cache.stride(0)),
        PACKED=cfg.lean_addressing and kv_cache.stride(0) == kv_cache.shape[1] * FP8_ROW_BYTES,
        BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, NATIVE=is_native,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        _combine_splits_kernel[(rows * heads,)](
            part_out, part_lse, out, lse, splits,
            BLOCK_S=triton.next_power_of_2(splits), NATIVE=is_native, num_warps=4,
        )
    return out, lse.transpose(1, 2)


@register("sparse_decode_fp8", "triton", priority=TRITON, devices=("cpu", "cuda"), interpreted_on=("cpu",),
          deviations=("bf16_dequant", "split_kv"), graph=launch_sparse_decode_fp8)
def sparse_decode_fp8(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    *,
    config: AttentionConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse decode over the fp8_ds_mla cache: (out [B,S,H,512] bf16, lse [B,H,S] f32).

    q [B,S,H,576] bf16, kv_cache [NB,BS,656] uint8 (stride(1) == 656, any stride(0)), indices
    [B,S,K] int32 physical slots (-1 = invalid). out = softmax(s) @ K[:, :512] with
    s_j = sm_scale <q, K_j> over the dequantized rows; lse = ln sum e^(s_j); all -1: out 0, lse +inf.
    lse is a [B,H,S] view of a [B,S,H] buffer, as FlashMLA returns it.
    """
    sm_scale = check_decode_inputs(q, kv_cache, indices, sm_scale)
    return launch_sparse_decode_fp8(q, kv_cache, indices, sm_scale, config)
