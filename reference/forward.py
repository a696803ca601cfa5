"""`FlashMLASparseImpl.forward_mqa`, end to end: the backend's three paths, and DCP over ranks.

Inputs are the MQA query (tensor [T, Hq, 576] or the tuple (ql_nope, q_pe)), one layer's paged
cache, the batch as the builder sees it (`query_start_loc`, `seq_lens`, `block_table`), the
indexer's logical top-k (request-local positions, or global positions under DCP) and the layer's
configuration. T may be smaller than the batch's token count: when dense MHA handles the
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

from typing import NamedTuple, Sequence

import torch

from .attention import sparse_decode, sparse_prefill
from .dcp import dcp_merge, dcp_merge_exact, mask_empty_shards, neutralize_empty_rows
from .indices import convert_index, dcp_convert_index, req_id_per_token
from .metadata import (
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


def forward_mqa(
    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    kv_cache: torch.Tensor,
    *,
    query_start_loc: Sequence[int],
    seq_lens: Sequence[int],
    block_table: torch.Tensor,
    topk_indices: torch.Tensor,
    num_heads: int,
    kv_cache_dtype: str,
    sm_scale: float,
    max_model_len: int,
    arch: str = "sm90",
    workspace_size: int | None = None,
    max_decode_query_len: int = 1,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    interleave: int = 1,
    dtype: torch.dtype = torch.float64,
) -> MQAResult:
    """One rank's forward_mqa (module docstring). `workspace_size` defaults to the backend's
    `prefill_workspace_size(max_model_len)`."""
    if isinstance(q, tuple):
        q = concat_mla_q(*q)
    num_tokens = q.shape[0]
    topk = topk_indices[:num_tokens]
    # req_id covers the whole batch and any CUDA-graph padding rows past it (request 0's); slice it
    # to the MQA rows (vLLM bug #47327).
    req_id = req_id_per_token(query_start_loc, max(query_start_loc[-1], num_tokens))[:num_tokens].to(q.device)
    check_dcp_supported(num_heads, dcp_size, kv_cache_dtype)
    path = select_path(kv_cache_dtype, num_heads)
    block_size = kv_cache.shape[1]

    if path == "bf16":
        rows, stride_rows = flat_kv_row_view(kv_cache)
        idx, counts = convert_index(req_id, block_table, topk, block_size, stride_rows, return_valid_counts=True)
        res = sparse_prefill(q, rows, idx, sm_scale, topk_length=counts, dtype=dtype)
        return MQAResult(res.out, res.lse, res.logit_l1, path)

    if path == "fp8_mixed":
        if dcp_size > 1:
            idx = dcp_convert_index(req_id, block_table, topk, block_size, dcp_size, dcp_rank, interleave, False)
        else:
            idx = convert_index(req_id, block_table, topk, block_size)
        res = sparse_decode(q[None], kv_cache, idx[None], sm_scale, dtype=dtype)
        out, lse, logit_l1 = res.out[0], res.lse[0].transpose(0, 1), res.logit_l1[0].transpose(0, 1)
        if dcp_size > 1:
            out, lse = neutralize_empty_rows(out, lse, idx)
        return MQAResult(out, lse, logit_l1, path)

    threshold = reorder_batch_threshold(num_heads, arch, max_decode_query_len=max_decode_query_len)
    split = split_decodes_and_prefills(query_start_loc, threshold)
    num_decode_tokens = split.num_decode_tokens
    num_prefill_tokens = num_tokens - num_decode_tokens
    if num_prefill_tokens not in (0, split.num_prefill_tokens):
        raise ValueError("forward_mqa expects either the decode tokens only or the full batch")
    plan = None
    if num_prefill_tokens == 0:
        idx, counts = convert_index(req_id, block_table, topk, block_size, return_valid_counts=True)
    else:
        plan = plan_prefill(
            query_start_loc, seq_lens, split, workspace_size or prefill_workspace_size(max_model_len)
        )
        idx, counts = convert_index(
            req_id, block_table, topk, block_size,
            prefill_request_ids=plan.request_ids[:num_tokens].to(q.device),
            prefill_workspace_starts=plan.workspace_starts.to(q.device),
            return_valid_counts=True,
        )

    out = q.new_zeros((num_tokens, q.shape[1], 512), dtype=dtype)
    lse = q.new_zeros((num_tokens, q.shape[1]), dtype=dtype)
    logit_l1 = torch.zeros_like(lse)
    if num_decode_tokens:
        _, active = active_decodes(query_start_loc, split)
        q_d = reshape_query_for_spec_decode(q[:num_decode_tokens], active)
        res = sparse_decode(q_d, kv_cache, idx[:num_decode_tokens].view(active, q_d.shape[1], -1), sm_scale, dtype=dtype)
        out[:num_decode_tokens] = reshape_attn_output_for_spec_decode(res.out)
        lse[:num_decode_tokens] = res.lse.transpose(1, 2).reshape(num_decode_tokens, -1)
        logit_l1[:num_decode_tokens] = res.logit_l1.transpose(1, 2).reshape(num_decode_tokens, -1)
    gather = gather_upconvert_nvfp4 if kv_cache.shape[-1] == NVFP4_ROW_BYTES else gather_upconvert_fp8
    for chunk in plan.chunks if plan else ():
        workspace = gather(
            kv_cache, block_table[slice(*chunk.requests)],
            torch.tensor(chunk.workspace_starts, dtype=torch.int32, device=q.device), chunk.total_rows,
        )
        rows = slice(*chunk.tokens)
        res = sparse_prefill(q[rows], workspace, idx[rows], sm_scale, topk_length=counts[rows], dtype=dtype)
        out[rows], lse[rows], logit_l1[rows] = res.out, res.lse, res.logit_l1
    return MQAResult(out, lse, logit_l1, path)


def forward_mqa_dcp(
    q: torch.Tensor,
    rank_caches: Sequence[torch.Tensor],
    rank_block_tables: Sequence[torch.Tensor],
    *,
    exact_merge: bool = False,
    **kwargs,
) -> MQAResult:
    """Every rank's forward_mqa on its shard, merged over ranks, for all gathered heads.

    q is the head-gathered query [T, H * N, 576] every rank sees; rank r's cache and block table
    hold its shard of each sequence (`reference.indices.dcp_owner_and_local`). `kwargs` are
    `forward_mqa`'s keyword arguments without block_table / dcp_rank. The rows of no request are
    masked before the merge (`mask_empty_shards`). Returns the merged [T, H * N, 512] output
    (rank r keeps heads [r*H, (r+1)*H) of it) and the merged LSE.
    """
    dcp_size = len(rank_caches)
    parts = [
        forward_mqa(q, cache, block_table=table, dcp_size=dcp_size, dcp_rank=r, **kwargs)
        for r, (cache, table) in enumerate(zip(rank_caches, rank_block_tables))
    ]
    outs = torch.stack([p.out for p in parts])
    lses = mask_empty_shards(torch.stack([p.lse for p in parts]), kwargs["seq_lens"], kwargs["query_start_loc"])
    out, lse = (dcp_merge_exact if exact_merge else dcp_merge)(outs, lses)
    logit_l1 = torch.stack([p.logit_l1 for p in parts]).amax(dim=0)
    return MQAResult(out, lse, logit_l1, parts[0].path + "_dcp")
