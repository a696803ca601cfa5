"""`FlashMLASparseImpl.forward_mqa`, end to end: the backend's three paths, and DCP over ranks.

Inputs are the MQA query (tensor [T, Hq, 576] or the tuple (ql_nope, q_pe)), one layer's paged
cache, the indexer's logical top-k (request-local positions, or global positions under DCP) and
`MQAMetadata`: the batch as the builder sees it (`query_start_loc`, `seq_lens`, `block_table`) and
the layer's configuration, grouped as the backend's `forward_mqa(q, kv_cache, attn_metadata, layer)`
receives them. T may be smaller than the batch's token count: when dense MHA handles the
prefills, forward_mqa sees only the leading decode tokens.

Paths (`reference.metadata` decides):
  bf16          bf16 cache: convert (block stride rows, compacted, counts) and run every token
                through the BF16 prefill kernel over the cache's flat rows.
  fp8_mixed     quantized cache, heads < 32: convert (in place, no counts; under DCP the rank's
                shard only) and run every token through the FP8 decode kernel as one batch of 1
                with s_q = T. Under DCP, rows this rank owns nothing of become (0, -inf).
  fp8_separate  quantized cache, heads >= 32: decodes through the FP8 decode kernel as
                [active_decodes, s, H, 576]; prefills chunk by chunk: up-convert the chunk's
                sequences into the BF16 workspace, then the BF16 prefill kernel over it, with the
                prefill indices already converted to chunk-local workspace rows.

Every path returns the LSE of every row as well (the backend keeps it only under DCP): it is the
sharpest signal the harness has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
from torch import Tensor

from .attention import AttentionResult, sparse_decode, sparse_prefill
from .dcp import dcp_merge, dcp_merge_exact, mask_empty_shards, neutralize_empty_rows
from .indices import convert_index, dcp_convert_index, req_id_per_token
from .metadata import (
    BatchSplit,
    PrefillChunk,
    active_decodes,
    check_dcp_supported,
    plan_prefill,
    prefill_workspace_size,
    reorder_batch_threshold,
    split_decodes_and_prefills,
    use_mixed_batch,
)
from .nvfp4_ds_mla import ROW_BYTES as NVFP4_ROW_BYTES
from .paged_cache import flat_kv_row_view
from .query import concat_mla_q, reshape_attn_output_for_spec_decode, reshape_query_for_spec_decode
from .workspace import gather_upconvert_fp8, gather_upconvert_nvfp4

CACHE_DTYPES = ("bfloat16", "fp8_ds_mla", "nvfp4_ds_mla")
Triple = tuple[Tensor, Tensor, Tensor]  # out, lse, logit_l1


class MQAResult(NamedTuple):
    out: torch.Tensor       # [T, Hq, 512]
    lse: torch.Tensor       # [T, Hq], natural log
    logit_l1: torch.Tensor  # [T, Hq]: the logit scale fp32 errors grow with (attention.AttentionResult)
    path: str


def select_path(kv_cache_dtype: str, num_heads: int) -> str:
    if kv_cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "bfloat16":
        return "bf16"
    return "fp8_mixed" if use_mixed_batch(num_heads) else "fp8_separate"


@dataclass(frozen=True)
class MQAMetadata:
    """What forward_mqa reads beside the query, the cache and the top-k: one rank's batch as
    `FlashMLASparseMetadataBuilder` leaves it, and the layer's configuration (`FlashMLASparseImpl`'s
    constructor and the builder's vllm_config). The optimized side spells its own
    (`optimized.pipeline.MQAMetadata`): the two share no code."""

    query_start_loc: Sequence[int]    # [B + 1], decodes first
    seq_lens: Sequence[int]           # [B] context + query tokens
    block_table: torch.Tensor         # [B, M] int32, this rank's
    num_heads: int                    # the layer's query heads on this rank
    kv_cache_dtype: str               # one of CACHE_DTYPES
    sm_scale: float
    max_model_len: int
    arch: str = "sm90"
    workspace_size: int | None = None  # None: the backend's prefill_workspace_size(max_model_len)
    max_decode_query_len: int = 1      # 1 + speculative tokens
    dcp_size: int = 1
    dcp_rank: int = 0
    interleave: int = 1


def forward_mqa(
    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    kv_cache: torch.Tensor,
    topk_indices: torch.Tensor,
    metadata: MQAMetadata,
    *,
    dtype: torch.dtype = torch.float64,
) -> MQAResult:
    """One rank's forward_mqa (module docstring): the path `select_path` names, on the MQA rows.

    req_id[t] = the request of token t over the whole batch and any CUDA-graph padding rows past
    it (request 0's), sliced to the T rows forward_mqa sees (vLLM bug #47327)."""
    m = metadata
    if isinstance(q, tuple):
        q = concat_mla_q(*q)
    num_tokens = q.shape[0]
    req_id = req_id_per_token(m.query_start_loc, max(m.query_start_loc[-1], num_tokens))[:num_tokens].to(q.device)
    check_dcp_supported(m.num_heads, m.dcp_size, m.kv_cache_dtype)
    path = select_path(m.kv_cache_dtype, m.num_heads)
    run = {"bf16": _bf16, "fp8_mixed": _fp8_mixed, "fp8_separate": _fp8_separate}[path]
    out, lse, logit_l1 = run(q, kv_cache, req_id, topk_indices[:num_tokens], m, dtype)
    return MQAResult(out, lse, logit_l1, path)


def _bf16(q: Tensor, kv_cache: Tensor, req_id: Tensor, topk: Tensor, m: MQAMetadata, dtype: torch.dtype) -> Triple:
    """bf16: rows = the cache's flat row view (stride S rows a block);
    idx, n = convert_index(req_id, block_table, topk) at stride S, valid entries compacted, counted;
    out, lse = sparse_prefill(q, rows, idx, topk_length = n)."""
    rows, stride_rows = flat_kv_row_view(kv_cache)
    idx, counts = convert_index(req_id, m.block_table, topk, kv_cache.shape[1], stride_rows, return_valid_counts=True)
    res = sparse_prefill(q, rows, idx, m.sm_scale, topk_length=counts, dtype=dtype)
    return res.out, res.lse, res.logit_l1


def _fp8_mixed(q: Tensor, kv_cache: Tensor, req_id: Tensor, topk: Tensor, m: MQAMetadata, dtype: torch.dtype) -> Triple:
    """fp8_mixed: idx = convert_index in place, no counts (under DCP dcp_convert_index: this rank's
    shard only, other ranks' entries -1);
    out, lse = sparse_decode(q as one batch of 1 with s_q = T, the paged cache, idx), the kernel's
    LSE [1, H, T] -> [T, H]; under DCP a row with no entry of this rank -> (0, -inf)."""
    block_size = kv_cache.shape[1]
    if m.dcp_size > 1:
        idx = dcp_convert_index(req_id, m.block_table, topk, block_size, m.dcp_size, m.dcp_rank, m.interleave, False)
    else:
        idx = convert_index(req_id, m.block_table, topk, block_size)
    res = sparse_decode(q[None], kv_cache, idx[None], m.sm_scale, dtype=dtype)
    out, lse, logit_l1 = res.out[0], res.lse[0].transpose(0, 1), res.logit_l1[0].transpose(0, 1)
    if m.dcp_size > 1:
        out, lse = neutralize_empty_rows(out, lse, idx)
    return out, lse, logit_l1


def _fp8_separate(q: Tensor, kv_cache: Tensor, req_id: Tensor, topk: Tensor, m: MQAMetadata, dtype: torch.dtype
                  ) -> Triple:
    """fp8_separate: split = split_decodes_and_prefills(query_start_loc, the reorder threshold);
    q holds the D decode tokens alone or the whole batch. Without prefills idx, n = convert_index
    (compacted, counted); with them the prefill plan (`plan_prefill`: chunks of requests whose
    sequences fit the workspace) and convert_index with each prefill token's workspace rows,
    workspace_start[request] + i, chunk-local. Then `_decodes` over rows [0, D) and
    `_prefill_chunks` over the rest."""
    num_tokens, block_size = q.shape[0], kv_cache.shape[1]
    threshold = reorder_batch_threshold(m.num_heads, m.arch, max_decode_query_len=m.max_decode_query_len)
    split = split_decodes_and_prefills(m.query_start_loc, threshold)
    num_decode_tokens = split.num_decode_tokens
    if num_tokens - num_decode_tokens not in (0, split.num_prefill_tokens):
        raise ValueError("forward_mqa expects either the decode tokens only or the full batch")
    plan = None
    if num_tokens == num_decode_tokens:
        idx, counts = convert_index(req_id, m.block_table, topk, block_size, return_valid_counts=True)
    else:
        plan = plan_prefill(
            m.query_start_loc, m.seq_lens, split, m.workspace_size or prefill_workspace_size(m.max_model_len)
        )
        idx, counts = convert_index(
            req_id, m.block_table, topk, block_size,
            prefill_request_ids=plan.request_ids[:num_tokens].to(q.device),
            prefill_workspace_starts=plan.workspace_starts.to(q.device),
            return_valid_counts=True,
        )
    out = q.new_zeros((num_tokens, q.shape[1], 512), dtype=dtype)
    lse = q.new_zeros((num_tokens, q.shape[1]), dtype=dtype)
    logit_l1 = torch.zeros_like(lse)
    if num_decode_tokens:
        rows = slice(0, num_decode_tokens)
        out[rows], lse[rows], logit_l1[rows] = _decodes(q[rows], kv_cache, idx[rows], m, split, dtype)
    for chunk in plan.chunks if plan else ():
        rows = slice(*chunk.tokens)
        res = _prefill_chunk(q[rows], kv_cache, idx[rows], counts[rows], m, chunk, dtype)
        out[rows], lse[rows], logit_l1[rows] = res.out, res.lse, res.logit_l1
    return out, lse, logit_l1


def _decodes(q: Tensor, kv_cache: Tensor, idx: Tensor, m: MQAMetadata, split: BatchSplit, dtype: torch.dtype) -> Triple:
    """The D decode tokens as [active decodes B, s, H, 576] (spec decode: s tokens a request);
    out, lse = sparse_decode over the paged cache, back to token-major [B * s, H, ...]."""
    _, active = active_decodes(m.query_start_loc, split)
    q_d = reshape_query_for_spec_decode(q, active)
    res = sparse_decode(q_d, kv_cache, idx.view(active, q_d.shape[1], -1), m.sm_scale, dtype=dtype)
    tokens = q.shape[0]
    return (reshape_attn_output_for_spec_decode(res.out), res.lse.transpose(1, 2).reshape(tokens, -1),
            res.logit_l1.transpose(1, 2).reshape(tokens, -1))


def _prefill_chunk(q: Tensor, kv_cache: Tensor, idx: Tensor, counts: Tensor, m: MQAMetadata, chunk: PrefillChunk,
                   dtype: torch.dtype) -> AttentionResult:
    """One chunk of prefills: workspace = its requests' sequences gathered and up-converted to bf16
    rows (workspace_start[r] + position); out, lse = sparse_prefill(q, workspace, idx, topk_length = n)."""
    gather = gather_upconvert_nvfp4 if kv_cache.shape[-1] == NVFP4_ROW_BYTES else gather_upconvert_fp8
    workspace = gather(
        kv_cache, m.block_table[slice(*chunk.requests)],
        torch.tensor(chunk.workspace_starts, dtype=torch.int32, device=q.device), chunk.total_rows,
    )
    return sparse_prefill(q, workspace, idx, m.sm_scale, topk_length=counts, dtype=dtype)


def forward_mqa_dcp(
    q: torch.Tensor,
    rank_caches: Sequence[torch.Tensor],
    topk_indices: torch.Tensor,
    rank_metadata: Sequence[MQAMetadata],
    *,
    exact_merge: bool = False,
    dtype: torch.dtype = torch.float64,
) -> MQAResult:
    """Every rank's forward_mqa on its shard, merged over ranks, for all gathered heads.

    q is the head-gathered query [T, H * N, 576] every rank sees; rank r's cache and metadata
    (its block table, dcp_size N, dcp_rank r) hold its shard of each sequence
    (`reference.indices.dcp_owner_and_local`). The rows of no request are masked before the merge
    (`mask_empty_shards`). Returns the merged [T, H * N, 512] output (rank r keeps heads
    [r*H, (r+1)*H) of it) and the merged LSE.
    """
    dcp_size = len(rank_caches)
    if [(m.dcp_size, m.dcp_rank) for m in rank_metadata] != [(dcp_size, r) for r in range(dcp_size)]:
        raise ValueError(f"rank_metadata must be ranks 0..{dcp_size - 1} of {dcp_size}, one per cache")
    parts = [forward_mqa(q, cache, topk_indices, m, dtype=dtype) for cache, m in zip(rank_caches, rank_metadata)]
    outs = torch.stack([p.out for p in parts])
    first = rank_metadata[0]
    lses = mask_empty_shards(torch.stack([p.lse for p in parts]), first.seq_lens, first.query_start_loc)
    out, lse = (dcp_merge_exact if exact_merge else dcp_merge)(outs, lses)
    logit_l1 = torch.stack([p.logit_l1 for p in parts]).amax(dim=0)
    return MQAResult(out, lse, logit_l1, parts[0].path + "_dcp")
