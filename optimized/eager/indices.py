"""Index conversion: the indexer's logical top-k to the physical rows the kernels read, and the
DCP filter to one rank's shard. Entries go through the block table as one flat gather, and
compaction is a cumsum-scatter (valid entries first, in their order).
"""

from __future__ import annotations

import torch

from .. import buffers
from ..validation import InputError, check_index_range, check_same_device, check_tensor
from .common import stage


def _check_conversion_inputs(req_id: object, block_table: object, topk_indices: object, block_size: int) -> None:
    check_tensor("topk_indices", topk_indices, dtype=torch.int32, ndim=2)
    # The grid is sized by req_id: a longer one wrote past the output (vLLM bug #47327).
    check_tensor("req_id", req_id, dtype=torch.int32, shape=(topk_indices.shape[0],))
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2)
    check_same_device(req_id=req_id, block_table=block_table, topk_indices=topk_indices)
    if block_size <= 0:
        raise InputError(f"block_size must be positive, got {block_size}")
    check_index_range("req_id", req_id, block_table.shape[0])


def _through_block_table(
    req_id: torch.Tensor, block_table: torch.Tensor, pos: torch.Tensor, block_size: int, stride_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block_table[r, pos // BS] * stride_rows + pos % BS, and 0 <= pos // BS < M) for pos [T, K]."""
    width_blocks = block_table.shape[1]
    cols, offsets = pos // block_size, pos % block_size
    inside = (pos >= 0) & (cols < width_blocks)
    flat = req_id.long()[:, None] * width_blocks + cols.clamp(0, max(width_blocks - 1, 0))
    blocks = block_table.reshape(-1).long()[flat] if block_table.numel() else torch.zeros_like(pos)
    return blocks * stride_rows + offsets, inside


def _place(phys: torch.Tensor, valid: torch.Tensor, compact: bool) -> torch.Tensor:
    """[T, K] rows with -1 where invalid: in place, or stably compacted (valid entries first, in
    their order) by scattering each valid entry to its running count."""
    num_tokens, topk = phys.shape
    out = buffers.empty((num_tokens, topk), torch.int32, phys.device)
    if not compact:
        out.copy_(torch.where(valid, phys, -1))
        return out
    # Invalid entries all land in a spill column past the row, which is then dropped.
    dest = torch.where(valid, valid.cumsum(dim=1) - 1, topk)
    packed = torch.full((num_tokens, topk + 1), -1, dtype=torch.long, device=phys.device)
    packed.scatter_(1, dest, torch.where(valid, phys, -1))
    out.copy_(packed[:, :topk])
    return out


@stage("convert_index")
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
    """Logical top-k [T, K] -> physical rows, int32, -1 where invalid.

    idx_mapping [R'] int32 (HAS_IDX_MAPPING): the table row is max(idx_mapping[req_id[t]], 0).

    tok < 0 or tok // BS >= M is invalid; decode rows: block_table[r, tok // BS] * S + tok % BS
    (S = block_stride_rows or BS); prefill rows (prefill_request_ids[t] = p >= 0):
    prefill_workspace_starts[p] + tok. With counts, rows are stably compacted.
    """
    if idx_mapping is not None:
        check_tensor("idx_mapping", idx_mapping, dtype=torch.int32, ndim=1)
        check_same_device(req_id=req_id, idx_mapping=idx_mapping)
        check_index_range("req_id", req_id, idx_mapping.shape[0])
        req_id = idx_mapping[req_id.long()].clamp(min=0)
    _check_conversion_inputs(req_id, block_table, topk_indices, block_size)
    num_tokens = topk_indices.shape[0]
    if (prefill_request_ids is None) != (prefill_workspace_starts is None):
        raise InputError("prefill_request_ids and prefill_workspace_starts come together")
    tok = topk_indices.long()
    phys, valid = _through_block_table(req_id, block_table, tok, block_size, block_stride_rows or block_size)
    if prefill_request_ids is not None:
        check_tensor("prefill_workspace_starts", prefill_workspace_starts, dtype=torch.int32, ndim=1)
        check_tensor("prefill_request_ids", prefill_request_ids, dtype=torch.int32, ndim=1)
        if prefill_request_ids.shape[0] < num_tokens:
            raise InputError(f"prefill_request_ids has {prefill_request_ids.shape[0]} rows, fewer than {num_tokens}")
        check_same_device(topk_indices=topk_indices, prefill_request_ids=prefill_request_ids,
                          prefill_workspace_starts=prefill_workspace_starts)
        ids = prefill_request_ids[:num_tokens]
        check_index_range("prefill_request_ids", ids, prefill_workspace_starts.shape[0], lower=-1)
        # Decode rows (id -1) look up an appended 0 that the final `where` discards.
        num_prefills = prefill_workspace_starts.shape[0]
        starts = torch.cat([prefill_workspace_starts.long(), prefill_workspace_starts.new_zeros(1)])
        row_start = starts[torch.where(ids >= 0, ids.long(), num_prefills)][:, None]
        phys = torch.where(ids[:, None] >= 0, row_start + tok, phys)
    out = _place(phys, valid, compact=return_valid_counts)
    if not return_valid_counts:
        return out
    counts = buffers.empty((num_tokens,), torch.int32, out.device)
    counts.copy_(valid.sum(dim=1))
    return out, counts


@stage("dcp_convert_index")
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
    """Global top-k -> this rank's physical slots, -1 for entries another rank owns.

    Position p lies in run g = p // I; rank g % N owns it, at local position (g // N) * I + p % I,
    which converts through this rank's block table. Compacted (stably) iff compact_valid_to_front
    and dcp_size > 1: at dcp_size 1 upstream delegates to the plain converter, which ignores the flag.
    """
    _check_conversion_inputs(req_id, block_table, topk_indices, block_size)
    if dcp_size < 1 or not 0 <= dcp_rank < dcp_size or interleave < 1 or block_size % interleave:
        raise InputError(
            f"need dcp_size >= 1, 0 <= dcp_rank < dcp_size and block_size % interleave == 0; got "
            f"dcp_size={dcp_size}, dcp_rank={dcp_rank}, block_size={block_size}, interleave={interleave}"
        )
    tok = topk_indices.long()
    pos = tok.clamp(min=0)
    run = pos // interleave
    local = (run // dcp_size) * interleave + pos % interleave
    phys, inside = _through_block_table(req_id, block_table, local, block_size, block_size)
    valid = (tok >= 0) & inside & (run % dcp_size == dcp_rank)
    return _place(phys, valid, compact=compact_valid_to_front and dcp_size > 1)

