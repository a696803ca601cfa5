"""Broken index converters, each the reference with one defect from the backend's bug history."""

import torch

from mla_verify import reference
from mla_verify.reference.indices import compact_rows


def ignores_block_stride(req_id, block_table, topk_indices, block_size, block_stride_rows=None,
                         prefill_request_ids=None, prefill_workspace_starts=None, return_valid_counts=False,
                         idx_mapping=None):
    """vLLM #54465: phys = block * block_size + offset although blocks are stride rows apart."""
    return reference.convert_index(req_id, block_table, topk_indices, block_size, None, prefill_request_ids,
                                   prefill_workspace_starts, return_valid_counts, idx_mapping=idx_mapping)


def unstable_compaction(req_id, block_table, topk_indices, block_size, block_stride_rows=None,
                        prefill_request_ids=None, prefill_workspace_starts=None, return_valid_counts=False,
                         idx_mapping=None):
    """Valid entries compacted to the front in reverse order (the multi-tile atomic path's risk)."""
    phys = reference.convert_index(req_id, block_table, topk_indices, block_size, block_stride_rows,
                                   prefill_request_ids, prefill_workspace_starts, False, idx_mapping=idx_mapping)
    if not return_valid_counts:
        return phys
    out, counts = compact_rows(phys.flip(1))
    return out, counts


def counts_without_compaction(req_id, block_table, topk_indices, block_size, block_stride_rows=None,
                              prefill_request_ids=None, prefill_workspace_starts=None, return_valid_counts=False,
                         idx_mapping=None):
    """vLLM 02a26fa0: valid counts returned but entries left in place (wrong with topk_length)."""
    phys = reference.convert_index(req_id, block_table, topk_indices, block_size, block_stride_rows,
                                   prefill_request_ids, prefill_workspace_starts, False, idx_mapping=idx_mapping)
    return (phys, (phys >= 0).sum(1).to(torch.int32)) if return_valid_counts else phys


def no_block_range_check(req_id, block_table, topk_indices, block_size, block_stride_rows=None,
                         prefill_request_ids=None, prefill_workspace_starts=None, return_valid_counts=False,
                         idx_mapping=None):
    """Logical blocks past the block table read its last column instead of becoming -1."""
    last_ok = block_table.shape[1] * block_size - 1
    clamped = torch.where(topk_indices >= 0, topk_indices.clamp(max=last_ok), topk_indices)
    return reference.convert_index(req_id, block_table, clamped, block_size, block_stride_rows,
                                   prefill_request_ids, prefill_workspace_starts, return_valid_counts, idx_mapping=idx_mapping)


def only_minus_one_invalid(req_id, block_table, topk_indices, block_size, block_stride_rows=None,
                           prefill_request_ids=None, prefill_workspace_starts=None, return_valid_counts=False,
                         idx_mapping=None):
    """Treats only -1 as invalid (the upstream test reference's gap): other negatives pass through."""
    result = reference.convert_index(req_id, block_table, topk_indices, block_size, block_stride_rows,
                                     prefill_request_ids, prefill_workspace_starts, False, idx_mapping=idx_mapping)
    result = torch.where(topk_indices < -1, topk_indices, result)
    if not return_valid_counts:
        return result
    valid = result != -1
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    return result.gather(1, order), valid.sum(1).to(torch.int32)


def prefill_rows_through_block_table(req_id, block_table, topk_indices, block_size, block_stride_rows=None,
                                     prefill_request_ids=None, prefill_workspace_starts=None,
                                     return_valid_counts=False, idx_mapping=None):
    """Prefill tokens converted to cache slots instead of workspace rows."""
    return reference.convert_index(req_id, block_table, topk_indices, block_size, block_stride_rows, None, None,
                                   return_valid_counts, idx_mapping=idx_mapping)


def dcp_no_ownership_filter(req_id, block_table, topk_indices, block_size, dcp_size, dcp_rank, interleave,
                            compact_valid_to_front):
    """vLLM #46514: global positions converted through the local block table, unfiltered."""
    out = reference.convert_index(req_id, block_table, topk_indices, block_size)
    return compact_rows(out)[0] if compact_valid_to_front else out


def dcp_interleave_ignored(req_id, block_table, topk_indices, block_size, dcp_size, dcp_rank, interleave,
                           compact_valid_to_front):
    """Ownership computed as if the interleave were 1."""
    return reference.dcp_convert_index(req_id, block_table, topk_indices, block_size, dcp_size, dcp_rank, 1,
                                       compact_valid_to_front)


def first_request_workspace(req_id, block_table, topk_indices, block_size, block_stride_rows=None,
                            prefill_request_ids=None, prefill_workspace_starts=None, return_valid_counts=False,
                            idx_mapping=None):
    """Every prefill token reads the first prefill request's workspace start (a kernel loading
    starts[0] instead of starts[prefill_request_ids[t]]): right while a batch holds one prefill."""
    first = None
    if prefill_request_ids is not None:
        first = torch.where(prefill_request_ids >= 0, 0, prefill_request_ids).to(prefill_request_ids.dtype)
    return reference.convert_index(req_id, block_table, topk_indices, block_size, block_stride_rows, first,
                                   prefill_workspace_starts, return_valid_counts, idx_mapping=idx_mapping)


def first_request_base(req_id, block_table, topk_indices, block_size, block_stride_rows=None,
                       prefill_request_ids=None, prefill_workspace_starts=None, return_valid_counts=False,
                       idx_mapping=None):
    """Every token converted from the first request's base (its block-table row and, for a prefill
    token, the first prefill request's workspace start): a per-request load hoisted out of the
    token loop. Right for request 0, wrong for every later one."""
    first = torch.zeros_like(req_id)
    prefill = None if prefill_request_ids is None else torch.where(prefill_request_ids >= 0, 0, prefill_request_ids)
    return reference.convert_index(first, block_table, topk_indices, block_size, block_stride_rows, prefill,
                                   prefill_workspace_starts, return_valid_counts, idx_mapping=idx_mapping)


def assumes_dense_block_table(req_id, block_table, topk_indices, block_size, block_stride_rows=None,
                              prefill_request_ids=None, prefill_workspace_starts=None, return_valid_counts=False,
                              idx_mapping=None):
    """Reads the block table as a dense [R, M] array from the start of its storage (a kernel taking
    the allocation's base pointer and row r at r * M): right for a contiguous table, wrong for a
    slice of a wider persistent one or one at a storage offset (issue 37)."""
    dense = torch.as_strided(block_table, block_table.shape, (block_table.shape[1], 1), 0)
    return reference.convert_index(req_id, dense, topk_indices, block_size, block_stride_rows, prefill_request_ids,
                                   prefill_workspace_starts, return_valid_counts, idx_mapping=idx_mapping)


def prefill_base_added_twice(req_id, block_table, topk_indices, block_size, block_stride_rows=None,
                             prefill_request_ids=None, prefill_workspace_starts=None, return_valid_counts=False,
                             idx_mapping=None):
    """A prefill token's workspace row computed as start + start + position (the request's base
    added once in the pointer and again in the offset): right for the first request of each
    workspace chunk, whose start is 0, wrong for a second request sharing the chunk."""
    doubled = None if prefill_workspace_starts is None else prefill_workspace_starts * 2
    return reference.convert_index(req_id, block_table, topk_indices, block_size, block_stride_rows,
                                   prefill_request_ids, doubled, return_valid_counts, idx_mapping=idx_mapping)


def invalid_entries_not_minus_one(req_id, block_table, topk_indices, block_size, block_stride_rows=None,
                                  prefill_request_ids=None, prefill_workspace_starts=None, return_valid_counts=False,
                                  idx_mapping=None):
    """Invalid entries written as -2 (a sentinel of its own) instead of -1. The BF16 prefill kernel
    skips any negative entry, so forward_mqa's bf16 path answers right: only the converter's own
    contract (invalid entries exactly -1, a metadata invariant) shows it there."""
    result = reference.convert_index(req_id, block_table, topk_indices, block_size, block_stride_rows,
                                     prefill_request_ids, prefill_workspace_starts, return_valid_counts,
                                     idx_mapping=idx_mapping)
    if return_valid_counts:
        return torch.where(result[0] < 0, -2, result[0]).to(result[0].dtype), result[1]
    return torch.where(result < 0, -2, result).to(result.dtype)
