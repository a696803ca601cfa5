"""Index conversion: from the indexer's logical top-k to the rows the kernels read.

The indexer fills `topk_indices[t, k]` with request-local token positions (or -1). The backend
converts each entry (vLLM `sparse_utils.py`, `triton_convert_req_index_to_global_index`):

    r       = req_id[t]                               the token's request
    invalid = tok < 0                                 any negative value, not only -1
    b, o    = tok // block_size, tok % block_size     logical block and offset
    invalid |= not (0 <= b < M)                       M = block_table.shape[1]
    decode row:   phys = block_table[r, b] * S + o    S = block_stride_rows or block_size
    prefill row:  phys = workspace_starts[p] + tok    p = prefill_request_ids[t] >= 0
    phys = -1 where invalid

There is no `tok < seq_len` check: a logical index past the sequence reads whatever the block
table (or the neighbouring request's workspace rows) holds there.

Under decode context parallelism (DCP) the indices are global positions and each rank keeps
every (N * I)-th run of I tokens (N = dcp_size, I = interleave):
    owner = (tok // I) % N,   local = (tok // (N * I)) * I + tok % I
Entries owned by another rank become -1; owned ones convert through this rank's block table at
`local`.

With valid counts the row is compacted: valid entries first, in their original order (stable),
then -1; counts[t] = number of valid entries. The BF16 prefill kernel takes counts as topk_length.
"""

from __future__ import annotations

from typing import Sequence

import torch


def req_id_per_token(query_start_loc: Sequence[int] | torch.Tensor, num_tokens: int) -> torch.Tensor:
    """req_id[t] = r with query_start_loc[r] <= t < query_start_loc[r + 1], int32 [num_tokens].

    Zero-length (CUDA-graph padding) requests own no token; tokens past the last request map to
    request 0, as the backend's binary search leaves them.
    """
    qsl = torch.as_tensor(query_start_loc, dtype=torch.int64)
    tokens = torch.arange(num_tokens, dtype=torch.int64)
    req = torch.searchsorted(qsl, tokens, right=True) - 1
    return torch.where(tokens >= qsl[-1], 0, req).to(torch.int32)


def dcp_owner_and_local(tok: torch.Tensor, dcp_size: int, interleave: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global position -> (owning rank, position within that rank's shard)."""
    owner = (tok // interleave) % dcp_size
    local = (tok // (dcp_size * interleave)) * interleave + tok % interleave
    return owner, local


def dcp_local_seq_lens(seq_len: int, dcp_size: int, dcp_rank: int, interleave: int) -> int:
    """Tokens of a `seq_len`-token sequence that rank `dcp_rank` stores (`get_dcp_local_seq_lens`)."""
    base = seq_len // interleave // dcp_size * interleave
    remainder = seq_len - base * dcp_size
    return base + min(max(remainder - dcp_rank * interleave, 0), interleave)


def compact_rows(phys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable compaction of each row: valid (>= 0) entries first in order, then -1; and counts."""
    valid = phys >= 0
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    return phys.gather(1, order), valid.sum(dim=1).to(torch.int32)


def _check(req_id: torch.Tensor, block_table: torch.Tensor, topk_indices: torch.Tensor) -> None:
    for name, t in (("req_id", req_id), ("block_table", block_table), ("topk_indices", topk_indices)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    if req_id.shape[0] != topk_indices.shape[0]:
        # vLLM bug #47327: a full-batch req_id with decode-only indices wrote out of bounds.
        raise ValueError(f"req_id has {req_id.shape[0]} rows but topk_indices has {topk_indices.shape[0]}")
    if req_id.numel() and not bool(((req_id >= 0) & (req_id < block_table.shape[0])).all()):
        raise ValueError(f"req_id must index block_table rows [0, {block_table.shape[0]})")


def _through_block_table(
    req_id: torch.Tensor, block_table: torch.Tensor, pos: torch.Tensor, block_size: int, stride_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block_table[r, pos // BS] * stride_rows + pos % BS, whether the block is inside the table)."""
    blocks = pos // block_size
    inside = (pos >= 0) & (blocks < block_table.shape[1])
    r = req_id.long()[:, None].expand_as(pos)
    block_ids = block_table.long()[r, blocks.clamp(0, block_table.shape[1] - 1)]
    return block_ids * stride_rows + pos % block_size, inside


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
    """Logical top-k -> physical rows (module docstring), without DCP. int32 [T, K] (+ counts [T]).

    `idx_mapping` (upstream HAS_IDX_MAPPING, HiSparse's request_state_indices): the block-table
    row of token t is max(idx_mapping[req_id[t]], 0), so a -1 (no state row) reads row 0.
    """
    if idx_mapping is not None:
        if idx_mapping.dtype != torch.int32 or not bool(((req_id >= 0) & (req_id < idx_mapping.shape[0])).all()):
            raise ValueError(f"idx_mapping must be int32 and cover every req_id, got {idx_mapping.dtype} [{idx_mapping.shape[0]}]")
        req_id = idx_mapping.long()[req_id.long()].clamp(min=0).to(torch.int32)
    _check(req_id, block_table, topk_indices)
    tok = topk_indices.long()
    phys, valid = _through_block_table(req_id, block_table, tok, block_size, block_stride_rows or block_size)
    if prefill_request_ids is not None:
        p = prefill_request_ids.long()[:, None].expand_as(tok)
        is_prefill = p >= 0
        starts = prefill_workspace_starts.long()[p.clamp(min=0)]
        phys = torch.where(is_prefill, starts + tok, phys)
    phys = torch.where(valid, phys, -1).to(torch.int32)
    if return_valid_counts:
        return compact_rows(phys)
    return phys


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
    """Global top-k -> this rank's physical slots; other ranks' entries -1 (module docstring).

    Compacts (stably) iff `compact_valid_to_front` and dcp_size > 1. At dcp_size == 1 upstream
    (vLLM 0.33 `triton_filter_and_convert_dcp_index`) delegates to the plain converter, which
    ignores the flag: no compaction, -1 stays in place. We follow upstream (run on the H200 under
    our contract: 400 of 400 cases agreed once this was so).
    """
    _check(req_id, block_table, topk_indices)
    if dcp_size < 1 or not 0 <= dcp_rank < dcp_size or block_size % interleave:
        raise ValueError(f"need dcp_size >= 1, 0 <= dcp_rank < dcp_size and block_size % interleave == 0, got {dcp_size}, {dcp_rank}, {block_size} % {interleave}")
    tok = topk_indices.long()
    owner, local = dcp_owner_and_local(tok.clamp(min=0), dcp_size, interleave)
    phys, inside = _through_block_table(req_id, block_table, local, block_size, block_size)
    phys = torch.where((tok >= 0) & inside & (owner == dcp_rank), phys, -1).to(torch.int32)
    return compact_rows(phys)[0] if compact_valid_to_front and dcp_size > 1 else phys
