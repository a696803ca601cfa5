"""`FlashMLASparseImpl.forward_mqa`, composed from registry stages as the seed composes the backend.

Every kernel call goes through a resolved stage (`stages.fn("sparse_prefill")(...)`), so a user's
kernel replaces one stage by an override and the rest of the backend stays as vLLM runs it:

  bf16          convert (flat rows at the cache's block stride, compacted, counts), then every
                token through `sparse_prefill` over the cache's flat row view.
  fp8_mixed     convert in place without counts (under DCP: `dcp_convert_index`, this rank's
                shard only), then every token through the decode stage as one batch of 1 with
                s_q = T. Under DCP, rows this rank owns nothing of become (out 0, lse -inf).
  fp8_separate  convert all rows (prefill rows to chunk-local workspace rows, compacted,
                counts); decodes through the decode stage as [active_decodes, s, H, 576];
                prefills chunk by chunk: gather + up-convert the chunk's sequences into a
                workspace of exactly its total rows, then `sparse_prefill` with topk_length.

Head padding (64 / 128 for the FP8 decode kernel, multiples of 64 for the BF16 prefill kernel) is
the kernel wrappers' job, not the pipeline's. Unlike the backend, which keeps it only under DCP,
every path returns the LSE of every row: it is the harness's sharpest signal. `Resolved.fallbacks`
travels with the result so the harness can say which implementation ran and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from . import buffers
from .metadata import (
    BatchSplit,
    active_decodes,
    check_dcp_supported,
    mask_empty_shards,
    plan_prefill,
    prefill_workspace_size,
    reorder_batch_threshold,
    req_id_per_token,
    select_path,
    split_decodes_and_prefills,
)
from .registry import Resolved, resolve
from .validation import InputError

V_DIM = 512


class PipelineResult(NamedTuple):
    out: torch.Tensor     # [T, Hq, 512] bf16
    lse: torch.Tensor     # [T, Hq] f32, natural log
    path: str             # bf16 | fp8_mixed | fp8_separate, "_dcp" appended when merged over ranks
    stages: Resolved      # the implementation each stage ran with, and the fallbacks taken


def _decode_stage(kv_cache_dtype: str) -> str:
    return "sparse_decode_nvfp4" if kv_cache_dtype == "nvfp4_ds_mla" else "sparse_decode_fp8"


def _gather_stage(kv_cache_dtype: str) -> str:
    return "gather_upconvert_nvfp4" if kv_cache_dtype == "nvfp4_ds_mla" else "gather_upconvert_fp8"


def needed_stages(kv_cache_dtype: str, num_heads: int, dcp_size: int = 1, q_is_tuple: bool = False) -> list[str]:
    """The stages a forward_mqa call on this configuration may use, in call order."""
    path = select_path(kv_cache_dtype, num_heads)
    stages = ["concat_mla_q"] if q_is_tuple else []
    if path == "bf16":
        stages += ["convert_index", "sparse_prefill"]
    elif path == "fp8_mixed":
        stages += ["dcp_convert_index" if dcp_size > 1 else "convert_index", _decode_stage(kv_cache_dtype)]
    else:
        stages += [
            "convert_index", "split_prefill_chunks", "reshape_query_for_spec_decode",
            _decode_stage(kv_cache_dtype), "reshape_attn_output_for_spec_decode",
            _gather_stage(kv_cache_dtype), "sparse_prefill",
        ]
    if dcp_size > 1:
        stages.append("dcp_merge")
    return stages


def flat_kv_rows(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """[NB, BS, W] -> ([(NB - 1) * S + BS, W] flat row view, S = stride(0) // W): slot
    (block j, offset o) is row j * S + o; rows between blocks (other layers' pages) are never
    addressed (`flat_kv_row_view`)."""
    num_blocks, block_size, width = kv_cache.shape
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != width or kv_cache.stride(0) % width:
        raise InputError(
            f"kv_cache: blocks must be whole rows apart, got strides {kv_cache.stride()} for {tuple(kv_cache.shape)}"
        )
    stride_rows = kv_cache.stride(0) // width
    rows = kv_cache.as_strided(((num_blocks - 1) * stride_rows + block_size, width), (width, 1))
    return rows, stride_rows


@dataclass(frozen=True)
class MQAMetadata:
    """What forward_mqa reads beside the query, the cache and the top-k: one rank's batch as
    `FlashMLASparseMetadataBuilder` leaves it, and the layer's configuration (`FlashMLASparseImpl`'s
    constructor and the builder's vllm_config). The reference spells its own
    (`reference.forward.MQAMetadata`): the two share no code."""

    query_start_loc: Sequence[int]    # [B + 1], decodes first
    seq_lens: Sequence[int]           # [B] context + query tokens
    block_table: torch.Tensor         # [B, M] int32, this rank's
    num_heads: int                    # the layer's query heads on this rank
    kv_cache_dtype: str               # bfloat16 | fp8_ds_mla | nvfp4_ds_mla
    sm_scale: float
    max_model_len: int
    arch: str = "sm90"
    workspace_size: int | None = None  # None: the backend's prefill_workspace_size(max_model_len)
    max_decode_query_len: int = 1      # 1 + speculative tokens
    dcp_size: int = 1
    dcp_rank: int = 0
    interleave: int = 1
    # [>= T] int32, the request of each token, as the builder keeps it in a persistent buffer
    # (what a CUDA graph of the call reads); None: built from query_start_loc, a copy from the host.
    req_id: torch.Tensor | None = None


@dataclass(frozen=True)
class _Step:
    """What every path reads: the concatenated query, the cache, the batch's indices, its metadata."""

    q: torch.Tensor            # [T, Hq, 576]
    kv_cache: torch.Tensor     # [NB, BS, W]
    req_id: torch.Tensor       # [T] int32, sliced to the MQA rows
    topk: torch.Tensor         # [T, K] int32 logical indices
    m: MQAMetadata
    stages: Resolved

    def convert(self, **kwargs) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.stages.fn("convert_index")(
            req_id=self.req_id, block_table=self.m.block_table, topk_indices=self.topk,
            block_size=self.kv_cache.shape[1], **kwargs,
        )


def forward_mqa(
    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    kv_cache: torch.Tensor,
    topk_indices: torch.Tensor,
    metadata: MQAMetadata,
    stages: Resolved | None = None,
) -> PipelineResult:
    """One rank's forward_mqa (module docstring). q is [T, Hq, 576] or (ql_nope, q_pe); T may
    be the decode tokens only (dense MHA took the prefills). `stages` defaults to the registry's
    preferred implementations on the cache's device."""
    m, q_is_tuple = metadata, isinstance(q, tuple)
    check_dcp_supported(m.num_heads, m.dcp_size, m.kv_cache_dtype)
    path = select_path(m.kv_cache_dtype, m.num_heads)
    if stages is None:
        stages = resolve(needed_stages(m.kv_cache_dtype, m.num_heads, m.dcp_size, q_is_tuple), kv_cache.device.type)
    if q_is_tuple:
        q = stages.fn("concat_mla_q")(ql_nope=q[0], q_pe=q[1])
    num_tokens = q.shape[0]
    # req_id covers the whole batch and any CUDA-graph padding rows past it (request 0's); slice it
    # to the MQA rows (vLLM bug #47327).
    req_id = m.req_id
    if req_id is None:
        req_id = req_id_per_token(m.query_start_loc, max(int(m.query_start_loc[-1]), num_tokens), q.device)
    step = _Step(q, kv_cache, req_id[:num_tokens], topk_indices[:num_tokens], m, stages)
    if path == "bf16":
        out, lse = _bf16(step)
    elif path == "fp8_mixed":
        out, lse = _fp8_mixed(step, _decode_stage(m.kv_cache_dtype))
    else:
        threshold = reorder_batch_threshold(m.num_heads, m.arch, max_decode_query_len=m.max_decode_query_len)
        out, lse = _fp8_separate(step, split_decodes_and_prefills(m.query_start_loc, threshold),
                                 m.workspace_size or prefill_workspace_size(m.max_model_len))
    return PipelineResult(out, lse, path, stages)


def _bf16(step: _Step) -> tuple[torch.Tensor, torch.Tensor]:
    """`_forward_bf16_kv`: the BF16 prefill kernel over the cache's flat rows, compacted indices."""
    rows, stride_rows = flat_kv_rows(step.kv_cache)
    idx, counts = step.convert(block_stride_rows=stride_rows, return_valid_counts=True)
    res = step.stages.fn("sparse_prefill")(q=step.q, kv=rows, indices=idx, sm_scale=step.m.sm_scale, topk_length=counts)
    return res[0], res[1]


def _fp8_mixed(step: _Step, decode_stage: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`_forward_fp8_kv_mixed_batch`: every token through the decode kernel as one batch of 1."""
    m = step.m
    if m.dcp_size > 1:
        idx = step.stages.fn("dcp_convert_index")(
            req_id=step.req_id, block_table=m.block_table, topk_indices=step.topk,
            block_size=step.kv_cache.shape[1], dcp_size=m.dcp_size, dcp_rank=m.dcp_rank,
            interleave=m.interleave, compact_valid_to_front=False,
        )
    else:
        idx = step.convert()
    out, lse = step.stages.fn(decode_stage)(
        q=step.q.unsqueeze(0), kv_cache=step.kv_cache, indices=idx.unsqueeze(0), sm_scale=m.sm_scale
    )
    out, lse = out[0], lse[0].transpose(0, 1)  # kernel LSE [1, H, T] -> [T, H]
    if m.dcp_size > 1:
        # A rank that owns none of a row's tokens contributes the merge's identity (0, -inf).
        empty = (idx == -1).all(dim=-1)
        out = out.masked_fill(empty[:, None, None], 0.0)
        lse = lse.masked_fill(empty[:, None], float("-inf"))
    return out, lse


def _fp8_separate(step: _Step, split: BatchSplit, workspace_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_forward_fp8_kv_separate_prefill_decode`: decodes through the decode kernel, prefills
    chunk by chunk through the BF16 prefill kernel over an up-converted workspace."""
    q, stages, m = step.q, step.stages, step.m
    kv_cache_dtype, query_start_loc, seq_lens = m.kv_cache_dtype, m.query_start_loc, m.seq_lens
    num_tokens, num_heads = q.shape[:2]
    num_decode_tokens, num_prefill_tokens = split.num_decode_tokens, num_tokens - split.num_decode_tokens
    if num_prefill_tokens not in (0, split.num_prefill_tokens):
        raise InputError(
            f"q has {num_tokens} rows: expected the {num_decode_tokens} decode tokens or the whole batch "
            f"of {num_decode_tokens + split.num_prefill_tokens}"
        )
    plan = None
    if num_prefill_tokens == 0:
        idx, counts = step.convert(return_valid_counts=True)
    else:
        chunker = stages.fn("split_prefill_chunks")
        plan = plan_prefill(query_start_loc, seq_lens, split, workspace_size, q.device, chunker)
        idx, counts = step.convert(
            prefill_request_ids=plan.request_ids, prefill_workspace_starts=plan.workspace_starts,
            return_valid_counts=True,
        )

    def decode(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        _, active = active_decodes(query_start_loc, split)
        q_d = stages.fn("reshape_query_for_spec_decode")(q=q[rows], num_decodes=active)
        out_d, lse_d = stages.fn(_decode_stage(kv_cache_dtype))(
            q=q_d, kv_cache=step.kv_cache, indices=idx[rows].view(active, q_d.shape[1], -1), sm_scale=m.sm_scale
        )
        # lse [B, H, s] -> token-major [B * s, H], the layout of the output rows.
        return stages.fn("reshape_attn_output_for_spec_decode")(out=out_d), lse_d.transpose(1, 2).reshape(-1, num_heads)

    if num_decode_tokens and plan is None:
        return decode(slice(0, num_tokens))
    out = buffers.empty((num_tokens, num_heads, V_DIM), torch.bfloat16, q.device)
    lse = buffers.empty((num_tokens, num_heads), torch.float32, q.device)
    if num_decode_tokens:
        out[:num_decode_tokens], lse[:num_decode_tokens] = decode(slice(0, num_decode_tokens))
    gather, prefill = stages.fn(_gather_stage(kv_cache_dtype)), stages.fn("sparse_prefill")
    for chunk in plan.chunks if plan else ():
        workspace = gather(
            kv_cache=step.kv_cache, block_table=m.block_table[chunk.requests],
            workspace_starts=chunk.workspace_starts, num_rows=chunk.total_rows,
        )
        rows = chunk.tokens
        res = prefill(q=q[rows], kv=workspace, indices=idx[rows], sm_scale=m.sm_scale, topk_length=counts[rows])
        out[rows], lse[rows] = res[0], res[1]
    return out, lse


def forward_mqa_dcp(
    q: torch.Tensor,
    rank_caches: Sequence[torch.Tensor],
    topk_indices: torch.Tensor,
    rank_metadata: Sequence[MQAMetadata],
    stages: Resolved | None = None,
) -> PipelineResult:
    """Every rank's forward_mqa on its shard, then the `dcp_merge` stage, for all gathered heads.

    q is the head-gathered [T, H * N, 576] query every rank sees; rank r's cache and metadata (its
    block table, dcp_size N, dcp_rank r) hold its shard of each sequence. Rows of no request are
    masked before the merge (`mask_empty_shards`). Returns the merged out [T, H * N, 512] (rank r
    keeps heads [r*H, (r+1)*H) after the reduce-scatter) and LSE, with path "<path>_dcp".
    `optimized.dcp_runtime` runs the same protocol over real processes.
    """
    dcp_size, first = len(rank_caches), rank_metadata[0]
    if [(m.dcp_size, m.dcp_rank) for m in rank_metadata] != [(dcp_size, r) for r in range(dcp_size)]:
        raise InputError(f"rank_metadata must be ranks 0..{dcp_size - 1} of {dcp_size}, one per cache")
    if stages is None:
        needed = needed_stages(first.kv_cache_dtype, first.num_heads, dcp_size, isinstance(q, tuple))
        # dict.fromkeys: the merge is needed even for a single rank, and listed once.
        stages = resolve(dict.fromkeys([*needed, "dcp_merge"]), rank_caches[0].device.type)
    parts = [forward_mqa(q, cache, topk_indices, m, stages) for cache, m in zip(rank_caches, rank_metadata)]
    outs = torch.stack([p.out for p in parts])
    lses = mask_empty_shards(torch.stack([p.lse for p in parts]), first.seq_lens, first.query_start_loc)
    out, lse = stages.fn("dcp_merge")(outs=outs, lses=lses)
    return PipelineResult(out, lse, parts[0].path + "_dcp", stages)
