"""Stand-ins with the native signatures of FlashMLA's (sgl-flash-mla 1.0.0) and vLLM's (0.33.0)
functions, computed by the project's torch-fp32 implementations, to test `mla_verify.adapters`
on CPU. Each asserts what its upstream asserts about layouts and arguments, so an adapter that
passes the wrong shape or keyword fails here as it would there, and each returns its results in
upstream's order.

The module-level `prefill`, `decode`, ... are the adapted stand-ins, for `--impl` and for tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mla_verify import adapters
from mla_verify.optimized import eager

# ----------------------------------------------------------------------------- FlashMLA


@dataclass
class FlashMLASchedMeta:
    """The plan `get_mla_metadata` returns: filled by the first decode call, asserted after."""

    have_initialized: bool = False
    config: Any = None


METADATA_CALLS = []  # one entry per get_mla_metadata call, to count plans


def get_mla_metadata(*args, **kwargs) -> tuple[FlashMLASchedMeta, None]:
    METADATA_CALLS.append(1)
    return FlashMLASchedMeta(), None


def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    use_legacy: bool = False,
    return_log2_lse: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [s_q, h_q, 576] with h_q 64 or 128, kv [s_kv, 1, 576], indices [s_q, 1, topk] ->
    (out, max_logits, lse)."""
    s_q, h_q, _ = q.shape
    assert h_q in (64, 128), f"h_q must be 64 or 128, got {h_q}"
    assert kv.dim() == 3 and kv.shape[1] == 1, f"kv must be [s_kv, h_kv=1, d_qk], got {tuple(kv.shape)}"
    assert indices.dim() == 3 and indices.shape[:2] == (s_q, 1), f"indices must be [s_q, 1, topk]: {indices.shape}"
    assert d_v == 512 and return_log2_lse is None
    assert attn_sink is None or attn_sink.shape == (h_q,)
    out, lse, max_logits = eager.sparse_prefill(q, kv[:, 0], indices[:, 0], sm_scale, topk_length, attn_sink)
    return out, max_logits, lse


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    head_dim_v: int,
    tile_scheduler_metadata: FlashMLASchedMeta,
    num_splits: None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    is_fp8_kvcache: bool | None = None,
    indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    enable_batch_invariant: bool = False,
    use_legacy: bool = False,
    kv_format: str | None = None,
    descale_q: torch.Tensor | None = None,
    descale_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse FP8 decode: q [b, s_q, h_q, 576] with h_q 64 or 128, k_cache [blocks, page, 1, 656],
    indices [b, s_q, topk] -> (out [b, s_q, h_q, 512], lse [b, h_q, s_q])."""
    assert isinstance(tile_scheduler_metadata, FlashMLASchedMeta), "tile_scheduler_metadata must be a FlashMLASchedMeta"
    assert num_splits is None and not causal and is_fp8_kvcache and indices is not None and head_dim_v == 512
    assert q.shape[2] in (64, 128), f"h_q must be 64 or 128, got {q.shape[2]}"
    assert k_cache.dim() == 4 and k_cache.shape[2] == 1, f"k_cache must be [blocks, page, 1, bytes]: {k_cache.shape}"
    shapes = (tuple(q.shape[:3]), k_cache.shape[1], indices.shape[-1])
    plan = tile_scheduler_metadata
    if not plan.have_initialized:
        plan.have_initialized, plan.config = True, shapes
    assert plan.config == shapes, "Your input arguments are inconsistent with sched_meta"
    return eager.sparse_decode_fp8(q, k_cache[:, :, 0], indices, softmax_scale)


# ----------------------------------------------------------------------------- vLLM


def _check_tiling(token_indices: torch.Tensor, num_topk_tokens: int, block_n: int) -> None:
    assert token_indices.shape[1] == num_topk_tokens
    assert num_topk_tokens % block_n == 0 and block_n & (block_n - 1) == 0  # a Triton tile divides the row


def triton_convert_req_index_to_global_index(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    token_indices: torch.Tensor,
    BLOCK_SIZE: int = 64,
    BLOCK_STRIDE_ROWS: int | None = None,
    NUM_TOPK_TOKENS: int = 2048,
    BLOCK_N: int = 128,
    HAS_PREFILL_WORKSPACE: bool = False,
    prefill_workspace_request_ids: torch.Tensor | None = None,
    prefill_workspace_starts: torch.Tensor | None = None,
    prefill_workspace_rank_stride: int | None = None,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    cp_kv_cache_interleave_size: int = 1,
    return_valid_counts: bool = False,
    out: torch.Tensor | None = None,
    valid_counts_out: torch.Tensor | None = None,
    idx_mapping: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    _check_tiling(token_indices, NUM_TOPK_TOKENS, BLOCK_N)
    assert req_id.shape[0] == token_indices.shape[0]
    assert dcp_size == 1 and out is None and valid_counts_out is None  # not modelled here
    if HAS_PREFILL_WORKSPACE:
        assert prefill_workspace_request_ids is not None and prefill_workspace_starts is not None
    else:  # upstream never reads them without the flag
        prefill_workspace_request_ids = prefill_workspace_starts = None
    return eager.convert_index(req_id, block_table, token_indices, BLOCK_SIZE, BLOCK_STRIDE_ROWS,
                               prefill_workspace_request_ids, prefill_workspace_starts, return_valid_counts,
                               idx_mapping=idx_mapping)


def triton_filter_and_convert_dcp_index(
    req_id: torch.Tensor,
    block_table: torch.Tensor,
    token_indices: torch.Tensor,
    dcp_size: int,
    dcp_rank: int,
    cp_kv_cache_interleave_size: int = 1,
    BLOCK_SIZE: int = 64,
    BLOCK_STRIDE_ROWS: int | None = None,
    NUM_TOPK_TOKENS: int = 2048,
    BLOCK_N: int = 128,
    return_valid_counts: bool = False,
    compact_valid_to_front: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    assert dcp_size >= 1 and 0 <= dcp_rank < dcp_size and BLOCK_SIZE % cp_kv_cache_interleave_size == 0
    _check_tiling(token_indices, NUM_TOPK_TOKENS, BLOCK_N)
    if dcp_size == 1:  # upstream hands over to the plain conversion, which compacts only with counts
        return triton_convert_req_index_to_global_index(
            req_id, block_table, token_indices, BLOCK_SIZE=BLOCK_SIZE, BLOCK_STRIDE_ROWS=BLOCK_STRIDE_ROWS,
            NUM_TOPK_TOKENS=NUM_TOPK_TOKENS, BLOCK_N=BLOCK_N, return_valid_counts=return_valid_counts)
    assert BLOCK_STRIDE_ROWS is None  # not modelled here
    out = eager.dcp_convert_index(req_id, block_table, token_indices, BLOCK_SIZE, dcp_size, dcp_rank,
                                  cp_kv_cache_interleave_size, compact_valid_to_front)
    if return_valid_counts:
        return out, (out >= 0).sum(dim=1, dtype=torch.int32)
    return out


def correct_attn_out(
    out: torch.Tensor, lses: torch.Tensor, cp_rank: int, ctx: Any, is_lse_base_on_e: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, H, D] rescaled in place by this rank's merge weight; (out, merged lse [B, H])."""
    assert is_lse_base_on_e
    partial, lse = eager.dcp_lse_correct(out, lses, cp_rank)
    out.copy_(partial)
    return out, lse


def _cp_lse_common(cp_attn_out, cp_attn_lse, cp_group, ctx=None, is_lse_base_on_e=True):
    if cp_group.world_size == 1:
        return cp_attn_out  # as upstream: its callers unpack (out, lse) from this
    lses = cp_group.all_gather(cp_attn_lse.contiguous(), dim=0).reshape((cp_group.world_size,) + cp_attn_lse.shape)
    return correct_attn_out(cp_attn_out, lses, cp_group.rank_in_group, ctx, is_lse_base_on_e=is_lse_base_on_e)


def cp_lse_ag_out_rs(
    cp_attn_out: torch.Tensor,
    cp_attn_lse: torch.Tensor,
    cp_group: Any,
    ctx: Any = None,
    return_lse: bool = False,
    is_lse_base_on_e: bool = True,
    seq_lens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
):
    """cp_attn_out [B, H, D], cp_attn_lse [B, H] -> this rank's heads of the merge."""
    out, lse = _cp_lse_common(cp_attn_out, cp_attn_lse, cp_group, ctx=ctx, is_lse_base_on_e=is_lse_base_on_e)
    out = cp_group.reduce_scatter(out, dim=1)
    if return_lse:
        heads = lse.shape[1] // cp_group.world_size
        return out, lse[:, heads * cp_group.rank_in_group : heads * (cp_group.rank_in_group + 1)]
    return out


# ----------------------------------------------------------------------------- adapted

prefill = adapters.flash_mla_sparse_fwd(flash_mla_sparse_fwd, use_legacy=True)
decode = adapters.flash_mla_with_kvcache(flash_mla_with_kvcache, get_mla_metadata, use_legacy=True)
convert_index = adapters.triton_convert_req_index_to_global_index(triton_convert_req_index_to_global_index)
dcp_convert_index = adapters.triton_filter_and_convert_dcp_index(triton_filter_and_convert_dcp_index)
lse_correct = adapters.correct_attn_out(correct_attn_out)
merge = adapters.cp_lse_ag_out_rs(cp_lse_ag_out_rs)
