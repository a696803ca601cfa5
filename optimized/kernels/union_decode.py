"""DeepSeek V4 / V4.1 sparse decode in Triton: one softmax over a main and an extra top-k list
read straight from their quantized caches, with a per-head sink (FlashMLA's
`flash_mla_with_kvcache` V4 contract without its 64/128-head and top-k-multiple limits).

A cache row is dequantized exactly (every product fits bf16: `optimized.v4_formats`):
    V4       K[d] = e4m3(code_d) * 2^(e_{d//64} - 127)  d < 448;  K[448 + r] = bf16 RoPE r
    V4.1     K[d] = e4m3(code_d) * 2^(e_{d//32} - 127)
    V4.1 FP4 K[d] = e2m1(nibble_d) * e4m3(sf_{d//16})
For batch b, query position s, head h: entry j of the main list counts when j < topk_length[b]
and indices[b,s,j] != -1, likewise the extra list with its own length; over the counted rows
    s_j = sm_scale <q[b,s,h], K_j>,  lse[b,h,s] = ln sum_j e^(s_j),
    out[b,s,h] = softmax(s) @ K * 1/(1 + e^(sink_h - lse))                (V is K: d_v = 512)
and an empty union gives out 0, lse +inf. Blocks past a list's length are not visited, so a value
there is never read.

The two lists are walked as one sequence of blocks (the main list's, then the extra list's). When
B*S*head-blocks programs would leave SMs idle, that sequence is split over several programs
(split-KV) and a combine kernel merges their partial results (lse = ln sum_i e^(lse_i),
out = sum_i e^(lse_i - lse) out_i, then the sink): a request's bits depend on the batch around it
("split_kv").
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mla_verify.optimized import buffers
from mla_verify.optimized.kernels.attention_launch import AttentionConfig, num_sms, split_plan
from mla_verify.optimized.kernels.bits import bf16_to_f32, e2m1_bits_to_f32, e4m3_to_f32, to_bf16
from mla_verify.optimized.kernels.launch import native
from mla_verify.optimized.kernels.online_softmax import LOG2E, attend_rows, finish
from mla_verify.optimized.registry import TRITON, register
from mla_verify.optimized.v4_checks import V41_PAIRS, V4_PAIRS, ListArgs, check_union_decode_contract
from mla_verify.optimized.v4_formats import D_V, CacheFormat


@triton.jit
def _row_parts(cache_ptr, slot, valid, block_size, stride_block, DATA: tl.constexpr, SCALE: tl.constexpr,
               BLOCK_MAJOR: tl.constexpr):
    """uint8 addresses of the data and scale parts of cache slots `slot` (slot 0 where not valid)."""
    s = tl.where(valid, slot, 0).to(tl.int64)
    block = s // block_size
    offset = s % block_size
    base = cache_ptr + block * stride_block
    if BLOCK_MAJOR:
        return base + offset * DATA, base + block_size * DATA + offset * SCALE
    else:
        data = base + offset * (DATA + SCALE)
        return data, data + DATA


@triton.jit
def _ue8m0(e):
    """ue8m0 byte -> 2^(e - 127) in fp32: the exponent field itself (0: the subnormal 2^-127; 255: NaN)."""
    e = e.to(tl.int32)
    value = (e << 23).to(tl.float32, bitcast=True)
    value = tl.where(e == 0, (e | (1 << 22)).to(tl.float32, bitcast=True), value)
    return tl.where(e == 255, float("nan"), value)


@triton.jit
def _dequant(data, scales, valid, FMT: tl.constexpr, NATIVE: tl.constexpr):
    """Rows at uint8 addresses `data` / `scales` [BN] -> K [BN, 512] bf16 (zero rows where not valid)."""
    d = tl.arange(0, 512)
    live = valid[:, None]
    if FMT == 0:  # V4: 448 e4m3 in tiles of 64, then 64 bf16 RoPE
        nope = d[None, :] < 448
        codes = tl.load(data[:, None] + d[None, :], mask=live & nope, other=0)
        e = tl.load(scales[:, None] + (d // 64)[None, :], mask=live & nope, other=127)
        rope = tl.load(data.to(tl.pointer_type(tl.bfloat16))[:, None] + (224 + d - 448)[None, :],
                       mask=live & (d[None, :] >= 448), other=0.0)
        k = tl.where(nope, e4m3_to_f32(codes, NATIVE) * _ue8m0(e), bf16_to_f32(rope, NATIVE))
    elif FMT == 1:  # V4.1: 512 e4m3 in tiles of 32
        codes = tl.load(data[:, None] + d[None, :], mask=live, other=0)
        e = tl.load(scales[:, None] + (d // 32)[None, :], mask=live, other=127)
        k = e4m3_to_f32(codes, NATIVE) * _ue8m0(e)
    else:  # V4.1 FP4: 512 e2m1 two a byte (even dim low nibble), e4m3 scales in tiles of 16
        packed = tl.load(data[:, None] + (d // 2)[None, :], mask=live, other=0).to(tl.int32)
        sf = tl.load(scales[:, None] + (d // 16)[None, :], mask=live, other=0)
        k = e2m1_bits_to_f32(packed >> ((d % 2) * 4)[None, :]) * e4m3_to_f32(sf, NATIVE)
    return to_bf16(k, NATIVE)


@triton.jit
def _walk(q, idx_row, length, width, cache_ptr, block_size, stride_block, first, last, m, l, acc, scale_log2e,
          FMT: tl.constexpr, DATA: tl.constexpr, SCALE: tl.constexpr, BLOCK_MAJOR: tl.constexpr,
          BLOCK_N: tl.constexpr, NATIVE: tl.constexpr):
    """Fold blocks [first, last) of one list (entries j < min(length, width)) into (m, l, acc)."""
    end = tl.minimum(length, width)
    last = tl.minimum(last, tl.cdiv(end, BLOCK_N))
    for blk in range(first, last):
        j = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = j < end
        idx = tl.load(idx_row + j, mask=inside, other=-1)
        valid = inside & (idx != -1)
        data, scales = _row_parts(cache_ptr, idx, valid, block_size, stride_block, DATA, SCALE, BLOCK_MAJOR)
        k = _dequant(data, scales, valid, FMT, NATIVE)
        m, l, acc = attend_rows(q, k, valid, m, l, acc, scale_log2e, NATIVE)
    return m, l, acc


@triton.jit
def _union_decode_kernel(
    q_ptr, cache_ptr, idx_ptr, len_ptr, xcache_ptr, xidx_ptr, xlen_ptr, sink_ptr,
    out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
    sm_scale, seq, num_heads, topk, xtopk, head_blocks, num_splits, blocks_per_split, main_blocks,
    block_size, stride_block, xblock_size, xstride_block,
    stride_q_b, stride_q_s, stride_q_h, stride_idx_b, stride_idx_s, stride_xidx_b, stride_xidx_s,
    FMT: tl.constexpr, DATA: tl.constexpr, SCALE: tl.constexpr, BLOCK_MAJOR: tl.constexpr,
    XFMT: tl.constexpr, XDATA: tl.constexpr, XSCALE: tl.constexpr, XBLOCK_MAJOR: tl.constexpr,
    HAS_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_XLEN: tl.constexpr, HAS_SINK: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NATIVE: tl.constexpr,
):
    """One program: one (b, s) row, one head block, one split of the union's blocks. Outputs by
    row = b*S + s: out [rows, H, 512], lse [rows, H]; partials [rows, H, splits, 512] / [.., splits]."""
    pid = tl.program_id(0)
    hb = pid % head_blocks
    split = (pid // head_blocks) % num_splits
    row = (pid // (head_blocks * num_splits)).to(tl.int64)
    b = row // seq
    s = row % seq
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    dv = tl.arange(0, 512)
    q = tl.load(q_ptr + b * stride_q_b + s * stride_q_s + heads[:, None] * stride_q_h + dv[None, :],
                mask=head_ok[:, None], other=0.0)

    first = split * blocks_per_split
    last = first + blocks_per_split
    scale_log2e = sm_scale * LOG2E
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, 512), tl.float32)
    length = topk
    if HAS_LEN:
        length = tl.load(len_ptr + b)
    m, l, acc = _walk(q, idx_ptr + b * stride_idx_b + s * stride_idx_s, length, topk, cache_ptr, block_size,
                      stride_block, first, tl.minimum(last, main_blocks), m, l, acc, scale_log2e,
                      FMT, DATA, SCALE, BLOCK_MAJOR, BLOCK_N, NATIVE)
    if HAS_EXTRA:
        xlength = xtopk
        if HAS_XLEN:
            xlength = tl.load(xlen_ptr + b)
        m, l, acc = _walk(q, xidx_ptr + b * stride_xidx_b + s * stride_xidx_s, xlength, xtopk, xcache_ptr,
                          xblock_size, xstride_block, tl.maximum(first, main_blocks) - main_blocks,
                          last - main_blocks, m, l, acc, scale_log2e, XFMT, XDATA, XSCALE, XBLOCK_MAJOR,
                          BLOCK_N, NATIVE)

    sink = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    if HAS_SINK and not SPLIT:
        sink = tl.load(sink_ptr + heads, mask=head_ok, other=float("-inf"))
    lse, _, scale = finish(m, l, sm_scale, sink)
    o = acc * scale[:, None]
    if SPLIT:
        part = (row * num_heads + heads) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * 512 + dv[None, :], o, mask=head_ok[:, None])
        tl.store(part_lse_ptr + part, tl.where(l > 0.0, lse, float("-inf")), mask=head_ok)
    else:
        tl.store(out_ptr + (row * num_heads + heads)[:, None] * 512 + dv[None, :], to_bf16(o, NATIVE),
                 mask=head_ok[:, None])
        tl.store(lse_ptr + row * num_heads + heads, lse, mask=head_ok)


@triton.jit
def _combine_kernel(part_out_ptr, part_lse_ptr, sink_ptr, out_ptr, lse_ptr, num_heads, num_splits,
                    HAS_SINK: tl.constexpr, BLOCK_S: tl.constexpr, NATIVE: tl.constexpr):
    """One program per (row, head): lse = ln sum_i e^(lse_i), out = sum_i e^(lse_i - lse) out_i
    * sigmoid(lse - sink); no split with a counted entry: out 0, lse +inf."""
    rh = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_S)
    top = tl.max(tl.load(part_lse_ptr + rh * num_splits + i, mask=i < num_splits, other=float("-inf")), 0)
    nonempty = top > float("-inf")
    top = tl.where(nonempty, top, 0.0)
    dv = tl.arange(0, 512)
    total = 0.0
    o = tl.zeros((512,), tl.float32)
    for k in range(0, num_splits):
        w = tl.math.exp2((tl.load(part_lse_ptr + rh * num_splits + k) - top) * LOG2E)
        total += w
        o += w * tl.load(part_out_ptr + (rh * num_splits + k) * 512 + dv)
    total = tl.where(nonempty, total, 1.0)
    lse = top + tl.log(total)
    factor = 1.0
    if HAS_SINK:
        x = lse - tl.load(sink_ptr + rh % num_heads)
        e = tl.math.exp2(-tl.abs(x) * LOG2E)
        factor = tl.where(x >= 0.0, 1.0 / (1.0 + e), e / (1.0 + e))
    tl.store(out_ptr + rh * 512 + dv, to_bf16(tl.where(nonempty, o / total * factor, 0.0), NATIVE))
    tl.store(lse_ptr + rh, tl.where(nonempty, lse, float("inf")))


class UnionList(NamedTuple):
    """One list as the launcher takes it: checked, with its cache's format."""

    cache: torch.Tensor
    indices: torch.Tensor
    length: torch.Tensor | None
    fmt: CacheFormat


def _format_args(fmt: CacheFormat | None) -> tuple[int, int, int, bool]:
    return (0, 576, 8, True) if fmt is None else (fmt.code, fmt.data_bytes, fmt.scale_bytes, fmt.block_major)


def _default_config(heads: int) -> AttentionConfig:
    """64 gathered rows a step fit SM90's 227 KiB of shared memory (232,448 B) only with 64-head
    tiles: compiled for sm_90a (triton 3.6) a V4 kernel of 64 heads needs 229,888 B, of 16 or 32
    heads 246,272 at 2 or 3 stages (the H100 refused every 16-head V4 case: OutOfResources); at
    32 rows the small tiles need 131-148 KB (tests/test_v4_kernel_resources.py)."""
    return AttentionConfig(block_n=64 if heads > 32 else 32)


def launch_union_decode(
    q: torch.Tensor,
    main: UnionList,
    extra: UnionList | None,
    sm_scale: float,
    attn_sink: torch.Tensor | None = None,
    config: AttentionConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The union decode without the checks (for timing): inputs must already pass them."""
    is_native = native(q.device)
    batch, seq, heads, _ = q.shape
    topk = main.indices.shape[2]
    xtopk = 0 if extra is None else extra.indices.shape[2]
    cfg = (config or _default_config(heads)).resolve(heads, topk + xtopk)
    rows, head_blocks = batch * seq, triton.cdiv(heads, cfg.block_h)
    main_blocks = triton.cdiv(topk, cfg.block_n)
    blocks = main_blocks + triton.cdiv(xtopk, cfg.block_n)
    splits, split_len = split_plan(blocks * cfg.block_n, cfg.block_n, rows * head_blocks, num_sms(q.device),
                                   cfg.num_splits)
    out = buffers.empty((batch, seq, heads, D_V), torch.bfloat16, q.device)
    lse = buffers.empty((batch, seq, heads), torch.float32, q.device)
    part_out = part_lse = None
    if splits > 1:
        part_out = buffers.empty((rows, heads, splits, D_V), torch.float32, q.device)
        part_lse = buffers.empty((rows, heads, splits), torch.float32, q.device)
    x = extra or main  # without an extra list its arguments are the main list's, never read
    _union_decode_kernel[(rows * head_blocks * splits,)](
        q, main.cache, main.indices, main.length, x.cache, x.indices, None if extra is None else extra.length, attn_sink,
        out, lse, part_out, part_lse,
        sm_scale, seq, heads, topk, xtopk, head_blocks, splits, split_len // cfg.block_n, main_blocks,
        main.cache.shape[1], main.cache.stride(0), x.cache.shape[1], x.cache.stride(0),
        q.stride(0), q.stride(1), q.stride(2), main.indices.stride(0), main.indices.stride(1),
        x.indices.stride(0), x.indices.stride(1),
        *_format_args(main.fmt), *_format_args(None if extra is None else extra.fmt),
        HAS_LEN=main.length is not None, HAS_EXTRA=extra is not None,
        HAS_XLEN=extra is not None and extra.length is not None, HAS_SINK=attn_sink is not None,
        SPLIT=splits > 1, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, NATIVE=is_native,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        _combine_kernel[(rows * heads,)](part_out, part_lse, attn_sink, out, lse, heads, splits,
                                         HAS_SINK=attn_sink is not None, BLOCK_S=triton.next_power_of_2(splits),
                                         NATIVE=is_native, num_warps=4)
    return out, lse.transpose(1, 2)


def decode_checked(
    q: torch.Tensor,
    main: ListArgs,
    extra: ListArgs,
    sm_scale: float,
    attn_sink: torch.Tensor | None,
    pairs: tuple[tuple[str, str | None], ...],
    config: AttentionConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract's checks (for the format `pairs`), then `launch_union_decode` with `config`."""
    sm_scale, fmt, extra_fmt = check_union_decode_contract(q, main, extra, sm_scale, attn_sink, pairs)
    return launch_union_decode(q, UnionList(*main, fmt), None if extra_fmt is None else UnionList(*extra, extra_fmt),
                               sm_scale, attn_sink, config)


@register("sparse_decode_v4", "triton", priority=TRITON, devices=("cpu", "cuda"), interpreted_on=("cpu",),
          deviations=("split_kv",))
def sparse_decode_v4(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    topk_length: torch.Tensor | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Union decode over V4 (584-byte) caches: (out [B,S,H,512] bf16, lse [B,H,S] f32).

    q [B,S,H,512] bf16; kv_cache and extra_kv_cache [NB,BS,584] uint8 (block-major pages);
    indices [B,S,K], extra_indices [B,S,K2] int32 slots (-1 invalid); topk_length,
    extra_topk_length [B] int32 per request; attn_sink [H] f32. See the module docstring
    (`decode_checked` takes a launch configuration).
    """
    return decode_checked(q, ListArgs(kv_cache, indices, topk_length),
                          ListArgs(extra_kv_cache, extra_indices, extra_topk_length), sm_scale, attn_sink, V4_PAIRS)


@register("sparse_decode_v41", "triton", priority=TRITON, devices=("cpu", "cuda"), interpreted_on=("cpu",),
          deviations=("split_kv",))
def sparse_decode_v41(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    topk_length: torch.Tensor | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Union decode over a V4.1 (528-byte) main cache and a V4.1 or V4.1 FP4 (288-byte) extra
    cache, per-token pages (FlashMLA's 2026.09.30 layout): as `sparse_decode_v4` otherwise."""
    return decode_checked(q, ListArgs(kv_cache, indices, topk_length),
                          ListArgs(extra_kv_cache, extra_indices, extra_topk_length), sm_scale, attn_sink, V41_PAIRS)
