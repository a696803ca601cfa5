"""Logical top-k token positions -> physical KV rows (spec §5.2, §5.3).

For row t, column k, with tok = topk_indices[t, k], r = req_id[t], DCP size N, rank n,
interleave I (N = 1, I = 1 without DCP):
    owner = (tok // I) % N,   local = (tok // (N * I)) * I + tok % I
    b = local // block_size,  o = local % block_size
    invalid  = tok < 0  or  not 0 <= b < M  or  (owner != n and not a prefill row)
    decode:  phys = block_table[r, b] * S + o        S = block_stride_rows or block_size
    prefill: phys = prefill_workspace_starts[p] + tok (p = prefill_request_ids[t] >= 0)
    invalid entries -> -1
Compaction (when asked) is stable: the valid entries of a row keep their input order at the
front, the rest of the row is -1, and the count is the number of valid entries.

One program owns one row and walks it in tiles, carrying the count of valid entries it has
placed, so compaction is stable for every K (upstream's multi-tile case is not). K is a
compile-time constant, as upstream's NUM_TOPK_TOKENS: one compilation per top-k width. Inputs are
made contiguous (they are [T] and [T, K] int32: small next to the attention they feed).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mla_verify.optimized import buffers
from mla_verify.optimized.kernels.launch import check_launchable
from mla_verify.optimized.registry import TRITON, register
from mla_verify.optimized.validation import InputError, check_index_range, check_same_device, check_tensor

_MAX_TILE = 1024
_INT32_MAX = 2**31 - 1


@triton.jit
def _convert_kernel(
    req_id, block_table, bt_stride, topk, out, counts, prefill_ids, prefill_starts, idx_mapping,
    M, block_size, stride_rows, dcp_size, dcp_rank, interleave,
    K: tl.constexpr, HAS_PREFILL: tl.constexpr, COMPACT: tl.constexpr, TILE: tl.constexpr,
    HAS_IDX_MAPPING: tl.constexpr,
):
    t = tl.program_id(0)
    r = tl.load(req_id + t)
    if HAS_IDX_MAPPING:
        # A request without a state row (-1) reads row 0, as upstream's max(mapping, 0).
        r = tl.maximum(tl.load(idx_mapping + r), 0)
    table_row = block_table + r.to(tl.int64) * bt_stride
    row_in = topk + t.to(tl.int64) * K
    row_out = out + t.to(tl.int64) * K
    if HAS_PREFILL:
        p = tl.load(prefill_ids + t)
        ws_start = tl.load(prefill_starts + tl.maximum(p, 0))
    placed = tl.zeros([], tl.int32)
    for k0 in range(0, K, TILE):
        k = k0 + tl.arange(0, TILE)
        tok = tl.load(row_in + k, mask=k < K, other=-1)
        owner = (tok // interleave) % dcp_size
        local = (tok // (dcp_size * interleave)) * interleave + tok % interleave
        b = local // block_size
        valid = (tok >= 0) & (b < M)
        if HAS_PREFILL:
            # The row's prefill flag as a vector: the interpreter of triton >= 3.7 turns a vector
            # mask combined with a scalar bool into an int array that tl.load refuses.
            is_prefill = (tok * 0 + p) >= 0
            # Workspace rows hold every rank's tokens, so ownership does not apply to them.
            valid &= (owner == dcp_rank) | is_prefill
            blk = tl.load(table_row + b, mask=valid & ~is_prefill, other=0)
            phys = tl.where(is_prefill, ws_start + tok, blk * stride_rows + local % block_size)
        else:
            valid &= owner == dcp_rank
            blk = tl.load(table_row + b, mask=valid, other=0)
            phys = blk * stride_rows + local % block_size
        if COMPACT:
            v = valid.to(tl.int32)
            dest = placed + tl.cumsum(v, 0) - v
            tl.store(row_out + dest, phys, mask=valid)
            placed += tl.sum(v, 0)
        else:
            tl.store(row_out + k, tl.where(valid, phys, -1), mask=k < K)
    if COMPACT:
        for k0 in range(0, K, TILE):
            k = k0 + tl.arange(0, TILE)
            tl.store(row_out + k, tl.full([TILE], -1, tl.int32), mask=(k >= placed) & (k < K))
        tl.store(counts + t, placed)


def _checked_rows(
    req_id: torch.Tensor, block_table: torch.Tensor, topk_indices: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checks shared by both converters; returns the three tensors made contiguous."""
    check_tensor("topk_indices", topk_indices, dtype=torch.int32, ndim=2)
    num_tokens, topk = topk_indices.shape
    if topk == 0:
        raise InputError("topk_indices: K (dim 1) must be positive, got 0")
    # A req_id longer than topk_indices is vLLM bug #47327 (the full-batch req_id_per_token
    # handed over with only the decode rows); upstream sized its grid by req_id and wrote past
    # the output.
    check_tensor("req_id", req_id, dtype=torch.int32, shape=(num_tokens,))
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2)
    check_same_device(req_id=req_id, block_table=block_table, topk_indices=topk_indices)
    if block_size < 1:
        raise InputError(f"block_size must be positive, got {block_size}")
    check_index_range("req_id", req_id, block_table.shape[0])
    return req_id.contiguous(), block_table.contiguous(), topk_indices.contiguous()


def _check_fits_int32(block_table: torch.Tensor, stride_rows: int) -> None:
    """Physical rows are int32: the largest block id times the stride must not wrap."""
    if block_table.numel() and int(block_table.max()) * stride_rows + stride_rows - 1 > _INT32_MAX:
        raise InputError(
            f"block_table: block id {int(block_table.max())} times block stride {stride_rows} "
            f"rows does not fit the int32 physical index"
        )


class Shard(NamedTuple):
    """The positions one DCP rank owns (module docstring): N, n, I; the default, no DCP, owns all."""

    size: int = 1
    rank: int = 0
    interleave: int = 1


def _convert(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    topk: torch.Tensor,
    *,
    block_size: int,
    stride_rows: int,
    compact: bool,
    shard: Shard = Shard(),
    prefill: tuple[torch.Tensor, torch.Tensor] | None = None,
    idx_mapping: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The kernel's launch: `prefill` the prefill rows' (request ids, workspace starts)."""
    num_tokens, topk_width = topk.shape
    out = buffers.empty(topk.shape, torch.int32, topk.device)
    counts = buffers.empty((num_tokens,), torch.int32, topk.device) if compact else None
    prefill_ids, prefill_starts = prefill or (None, None)
    if num_tokens:
        _convert_kernel[(num_tokens,)](
            req_id, block_table, block_table.stride(0), topk, out, counts, prefill_ids, prefill_starts, idx_mapping,
            block_table.shape[1], block_size, stride_rows, shard.size, shard.rank, shard.interleave,
            K=topk_width, HAS_PREFILL=prefill_ids is not None, COMPACT=compact,
            TILE=min(triton.next_power_of_2(topk_width), _MAX_TILE), HAS_IDX_MAPPING=idx_mapping is not None,
        )
    return out, counts


def launch_convert_index(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    topk_indices: torch.Tensor,
    block_size: int,
    block_stride_rows: int | None = None,
    prefill_request_ids: torch.Tensor | None = None,
    prefill_workspace_starts: torch.Tensor | None = None,
    return_valid_counts: bool = False,
    idx_mapping: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`convert_index` without its checks (they read req_id and the block table on the host; what
    a CUDA graph captures): inputs must already pass them."""
    def dense(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.contiguous()

    prefill = None if prefill_request_ids is None else (dense(prefill_request_ids), dense(prefill_workspace_starts))
    out, counts = _convert(
        req_id.contiguous(), block_table.contiguous(), topk_indices.contiguous(),
        block_size=block_size, stride_rows=block_stride_rows or block_size, compact=return_valid_counts,
        prefill=prefill, idx_mapping=dense(idx_mapping),
    )
    return (out, counts) if return_valid_counts else out


@register("convert_index", "triton", priority=TRITON, devices=("cpu", "cuda"), interpreted_on=("cpu",),
          graph=launch_convert_index)
def convert_index(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    topk_indices: torch.Tensor,
    block_size: int,
    block_stride_rows: int | None = None,
    prefill_request_ids: torch.Tensor | None = None,
    prefill_workspace_starts: torch.Tensor | None = None,
    return_valid_counts: bool = False,
    idx_mapping: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """triton_convert_req_index_to_global_index with dcp_size = 1 (spec §5.2).

    idx_mapping [R'] int32 (HAS_IDX_MAPPING, HiSparse's request_state_indices): the block-table
    row of token t is max(idx_mapping[req_id[t]], 0) instead of req_id[t].

    req_id [T], block_table [R, M], topk_indices [T, K], all int32 -> [T, K] int32:
    phys = block_table[req_id[t], tok // BS] * S + tok % BS with S = block_stride_rows or BS;
    rows with prefill_request_ids[t] = p >= 0 map into the prefill workspace instead:
    phys = prefill_workspace_starts[p] + tok (the block-range check still applies; there is no
    tok < seq_len check). -1 where tok < 0 or tok // BS is outside [0, M).
    return_valid_counts=True compacts each row stably (valid entries first, in input order,
    then -1) and also returns the counts [T] int32.
    """
    if idx_mapping is not None:
        check_tensor("idx_mapping", idx_mapping, dtype=torch.int32, ndim=1)
        check_same_device(req_id=req_id, idx_mapping=idx_mapping)
        check_index_range("req_id", req_id, idx_mapping.shape[0])
        # _checked_rows bounds req_id by the table's rows; under a mapping it bounds the mapping.
        rows_checked = _checked_rows(idx_mapping[req_id.long()].clamp(min=0), block_table, topk_indices, block_size)
        req_id, block_table, topk_indices = req_id.contiguous(), rows_checked[1], rows_checked[2]
        idx_mapping = idx_mapping.contiguous()
    else:
        req_id, block_table, topk_indices = _checked_rows(req_id, block_table, topk_indices, block_size)
    stride_rows = block_stride_rows or block_size
    if stride_rows < block_size:
        raise InputError(
            f"block_stride_rows={stride_rows} is below block_size={block_size}: blocks would overlap"
        )
    _check_fits_int32(block_table, stride_rows)
    if (prefill_request_ids is None) != (prefill_workspace_starts is None):
        raise InputError("prefill_request_ids and prefill_workspace_starts come together or not at all")
    if prefill_request_ids is not None:
        check_tensor("prefill_request_ids", prefill_request_ids, dtype=torch.int32, shape=(topk_indices.shape[0],))
        check_tensor("prefill_workspace_starts", prefill_workspace_starts, dtype=torch.int32, ndim=1)
        check_same_device(
            topk_indices=topk_indices,
            prefill_request_ids=prefill_request_ids,
            prefill_workspace_starts=prefill_workspace_starts,
        )
        # Any negative id marks a decode row; the others name a workspace request.
        check_index_range(
            "prefill_request_ids", prefill_request_ids, prefill_workspace_starts.shape[0], lower=-(2**31)
        )
        prefill_request_ids = prefill_request_ids.contiguous()
        prefill_workspace_starts = prefill_workspace_starts.contiguous()
    check_launchable(topk_indices.device)
    return launch_convert_index(req_id, block_table, topk_indices, block_size, stride_rows, prefill_request_ids,
                                prefill_workspace_starts, return_valid_counts, idx_mapping)


@register("dcp_convert_index", "triton", priority=TRITON, devices=("cpu", "cuda"), interpreted_on=("cpu",))
def dcp_convert_index(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    topk_indices: torch.Tensor,
    block_size: int,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
    compact_valid_to_front: bool,
) -> torch.Tensor:
    """triton_filter_and_convert_dcp_index (spec §5.3): keep this rank's share of global positions.

    owner = (tok // I) % N, local = (tok // (N * I)) * I + tok % I; entries with owner != rank,
    tok < 0 or local // BS outside [0, M) -> -1; the rest -> block_table[r, local // BS] * BS +
    local % BS (this rank's block table). Compacts stably (-1 tail) iff compact_valid_to_front
    and dcp_size > 1: upstream delegates dcp_size == 1 to the plain converter, which ignores the
    flag (it compacts only with return_valid_counts), and we follow it.
    """
    req_id, block_table, topk_indices = _checked_rows(req_id, block_table, topk_indices, block_size)
    if dcp_size < 1:
        raise InputError(f"dcp_size must be at least 1, got {dcp_size}")
    if not 0 <= dcp_rank < dcp_size:
        raise InputError(f"dcp_rank={dcp_rank} is outside [0, dcp_size={dcp_size})")
    if interleave < 1 or block_size % interleave:
        raise InputError(
            f"interleave={interleave} must be positive and divide block_size={block_size} "
            f"(a block holds whole interleave runs)"
        )
    _check_fits_int32(block_table, block_size)
    check_launchable(topk_indices.device)
    out, _ = _convert(
        req_id, block_table, topk_indices, block_size=block_size, stride_rows=block_size,
        compact=compact_valid_to_front and dcp_size > 1, shard=Shard(dcp_size, dcp_rank, interleave),
    )
    return out
