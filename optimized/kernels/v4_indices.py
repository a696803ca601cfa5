"""DeepSeek V4's serving index builders in Triton (vLLM's `compute_swa_indices_and_lens`,
`combine_topk_swa_indices` and the decode half of `build_flashinfer_mixed_sparse_indices`).

Request r's query tokens are the last query_len_r of its seq_len_r tokens: its i-th sits at
pos = seq_len_r - query_len_r + i. A token's window is its last w = min(pos + 1, window) raw
tokens; it sees k = min((pos + 1) // compress_ratio, topk) of the indexer's compressed picks.

    window_indices           [T, window] cache slots of positions pos - w + 1 .. pos, then -1
    v4_prefill_indices       rows over the gathered buffer (request r at rows [M r, M r + M): N
                             compressed entries, then raw tokens from seq_len_r - gather_len_r):
                             picks + M r (j < k), then M r + N + pos - w + 1 - (seq_len_r -
                             gather_len_r) + i (i < w), then -1; width ceil((topk + window) / 128)
                             * 128; lengths k + w
    flashinfer_decode_table  [T, window + ceil4(K)]: the window slots, then the compressed slots,
                             then -1; lengths window + compressed length (the window counted whole)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_verify.optimized import buffers
from mla_verify.optimized.registry import TRITON, register
from mla_verify.optimized.validation import InputError, check_index_range, check_same_device, check_tensor

PREFILL_ALIGN = 128
TABLE_ALIGN = 4


@triton.jit
def _window_kernel(pos_ptr, req_ptr, table_ptr, table_stride, out_ptr, len_ptr, block_size, window,
                   WINDOW_P2: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    r = tl.load(req_ptr + t).to(tl.int64)
    w = tl.minimum(pos + 1, window)
    i = tl.arange(0, WINDOW_P2)
    live = i < w
    p = pos - w + 1 + i
    block = tl.load(table_ptr + r * table_stride + p // block_size, mask=live, other=0).to(tl.int64)
    tl.store(out_ptr + t * window + i, tl.where(live, block * block_size + p % block_size, -1).to(tl.int32),
             mask=i < window)
    tl.store(len_ptr + t, w.to(tl.int32))


@register("window_indices", "triton", priority=TRITON, devices=("cpu", "cuda"), interpreted_on=("cpu",))
def window_indices(
    positions: torch.Tensor, req_of_token: torch.Tensor, block_table: torch.Tensor, block_size: int, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's window as cache slots: (indices [T, window] int32, lengths [T] int32)."""
    check_tensor("positions", positions, dtype=(torch.int32, torch.int64), ndim=1, contiguous=True)
    tokens = positions.shape[0]
    check_tensor("req_of_token", req_of_token, dtype=(torch.int32, torch.int64), shape=(tokens,), contiguous=True)
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, last_dim_contiguous=True)
    check_same_device(positions=positions, req_of_token=req_of_token, block_table=block_table)
    if block_size < 1 or window < 1:
        raise InputError(f"block_size={block_size} and window={window} must be >= 1")
    check_index_range("req_of_token", req_of_token, block_table.shape[0])
    check_index_range("positions", positions, block_table.shape[1] * block_size)
    out = buffers.empty((tokens, window), torch.int32, positions.device)
    lengths = buffers.empty((tokens,), torch.int32, positions.device)
    if tokens:
        _window_kernel[(tokens,)](positions, req_of_token, block_table, block_table.stride(0), out, lengths, block_size,
                                  window, WINDOW_P2=triton.next_power_of_2(window))
    return out, lengths


@triton.jit
def _prefill_kernel(topk_ptr, topk_stride, qsl_ptr, seq_ptr, gather_ptr, out_ptr, len_ptr, m, n, window, ratio, topk,
                    width, WIDTH_P2: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    base = tl.load(qsl_ptr).to(tl.int64)
    start = tl.load(qsl_ptr + r).to(tl.int64) - base
    end = tl.load(qsl_ptr + r + 1).to(tl.int64) - base
    seq = tl.load(seq_ptr + r).to(tl.int64)
    first_raw = seq - tl.load(gather_ptr + r).to(tl.int64)
    j = tl.arange(0, WIDTH_P2)
    for t in range(start, end):
        pos = seq - (end - start) + (t - start)
        k = tl.minimum((pos + 1) // ratio, topk)
        w = tl.minimum(pos + 1, window)
        picks = tl.load(topk_ptr + t * topk_stride + j, mask=j < k, other=0).to(tl.int64)
        raw = m * r + n + pos - w + 1 - first_raw + (j - k)
        row = tl.where(j < k, picks + m * r, tl.where((j >= k) & (j < k + w), raw, -1))
        tl.store(out_ptr + t * width + j, row.to(tl.int32), mask=j < width)
        tl.store(len_ptr + t, (k + w).to(tl.int32))


def _token_positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, position) of every query token, for the checks before launch."""
    qsl = query_start_loc.long() - query_start_loc[0].long()
    query_lens = qsl[1:] - qsl[:-1]
    if bool((query_lens < 0).any()) or bool((query_lens > seq_lens.long()).any()):
        raise InputError("query_start_loc must ascend, and no request may have more query tokens than tokens")
    req = torch.repeat_interleave(torch.arange(seq_lens.shape[0], device=qsl.device), query_lens)
    return req, seq_lens.long()[req] - query_lens[req] + torch.arange(req.shape[0], device=qsl.device) - qsl[req]


@register("v4_prefill_indices", "triton", priority=TRITON, devices=("cpu", "cuda"), interpreted_on=("cpu",))
def v4_prefill_indices(
    topk_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor,
    window: int,
    compress_ratio: int,
    topk: int,
    m: int,
    n: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's V4 prefill rows (module docstring): (rows [T, ceil((topk + window) / 128) * 128]
    int32, lengths [T] int32). topk_indices [T, >= topk] int32 local picks; query_start_loc
    [R + 1], seq_lens, gather_lens [R] int32."""
    check_tensor("topk_indices", topk_indices, dtype=torch.int32, ndim=2, last_dim_contiguous=True)
    reqs = seq_lens.shape[0]
    check_tensor("query_start_loc", query_start_loc, dtype=torch.int32, shape=(reqs + 1,), contiguous=True)
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(reqs,), contiguous=True)
    check_tensor("gather_lens", gather_lens, dtype=torch.int32, shape=(reqs,), contiguous=True)
    check_same_device(topk_indices=topk_indices, query_start_loc=query_start_loc, seq_lens=seq_lens,
                      gather_lens=gather_lens)
    if min(window, compress_ratio) < 1 or topk < 0 or topk > topk_indices.shape[1]:
        raise InputError(f"window={window}, compress_ratio={compress_ratio} >= 1 and 0 <= topk={topk} <= "
                         f"{topk_indices.shape[1]} (the picks' width) expected")
    req, pos = _token_positions(query_start_loc, seq_lens)
    tokens = req.shape[0]
    if tokens > topk_indices.shape[0]:
        raise InputError(f"{tokens} query tokens but topk_indices has {topk_indices.shape[0]} rows")
    seen = torch.clamp((pos + 1) // compress_ratio, max=topk)
    picks = topk_indices[:tokens, :topk].long()
    counted = torch.arange(topk, device=picks.device)[None, :] < seen[:, None]
    check_index_range("topk_indices (within each token's picks)", picks.masked_fill(~counted, 0), n)
    width = -(-(topk + window) // PREFILL_ALIGN) * PREFILL_ALIGN
    rows = buffers.empty((tokens, width), torch.int32, topk_indices.device)
    lengths = buffers.empty((tokens,), torch.int32, topk_indices.device)
    if tokens:
        _prefill_kernel[(reqs,)](topk_indices, topk_indices.stride(0), query_start_loc, seq_lens, gather_lens, rows,
                                 lengths, m, n, window, compress_ratio, topk, width,
                                 WIDTH_P2=triton.next_power_of_2(width))
    return rows, lengths


@triton.jit
def _table_kernel(win_ptr, win_stride, comp_ptr, comp_stride, clen_ptr, out_ptr, len_ptr, window, k, width,
                  HAS_LEN: tl.constexpr, WINDOW_P2: tl.constexpr, K_P2: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, WINDOW_P2)
    tl.store(out_ptr + t * width + i, tl.load(win_ptr + t * win_stride + i, mask=i < window), mask=i < window)
    j = tl.arange(0, K_P2)
    comp = tl.load(comp_ptr + t * comp_stride + j, mask=j < k, other=-1)
    tl.store(out_ptr + t * width + window + j, comp, mask=j < width - window)
    counted = k
    if HAS_LEN:
        counted = tl.load(clen_ptr + t)
    tl.store(len_ptr + t, (window + counted).to(tl.int32))


@register("flashinfer_decode_table", "triton", priority=TRITON, devices=("cpu", "cuda"), interpreted_on=("cpu",))
def flashinfer_decode_table(
    window_slots: torch.Tensor, compressed_slots: torch.Tensor, compressed_lens: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's decode table (module docstring): window_slots [T, W], compressed_slots [T, K]
    int32 global slots, compressed_lens [T] int32 or None (all K) -> (table [T, W + ceil4(K)],
    lengths [T] = W + compressed length)."""
    check_tensor("window_slots", window_slots, dtype=torch.int32, ndim=2, last_dim_contiguous=True)
    tokens, window = window_slots.shape
    check_tensor("compressed_slots", compressed_slots, dtype=torch.int32, shape=(tokens, None), last_dim_contiguous=True)
    k = compressed_slots.shape[1]
    if compressed_lens is not None:
        check_tensor("compressed_lens", compressed_lens, dtype=torch.int32, shape=(tokens,), contiguous=True)
        check_index_range("compressed_lens", compressed_lens, k + 1)
    check_same_device(window_slots=window_slots, compressed_slots=compressed_slots, compressed_lens=compressed_lens)
    width = window + -(-k // TABLE_ALIGN) * TABLE_ALIGN
    table = buffers.empty((tokens, width), torch.int32, window_slots.device)
    lengths = buffers.empty((tokens,), torch.int32, window_slots.device)
    if tokens:
        _table_kernel[(tokens,)](window_slots, window_slots.stride(0), compressed_slots, compressed_slots.stride(0),
                                 compressed_lens, table, lengths, window, k, width, HAS_LEN=compressed_lens is not None,
                                 WINDOW_P2=triton.next_power_of_2(max(window, 1)),
                                 K_P2=triton.next_power_of_2(max(width - window, 1)))
    return table, lengths
