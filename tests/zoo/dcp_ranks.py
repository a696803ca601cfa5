"""Broken DCP rank bodies: `optimized.dcp_runtime.forward_mqa_dcp_rank` with one step of the
protocol done wrong (patched in for the call), given to the `dcp` op as whole replacements
(`--impl tests.zoo.dcp_ranks:NAME`), and rank bodies that hang or die, for the group's timeouts."""

import os
import time
from unittest import mock

import torch

from mla_verify.optimized import dcp_runtime, pipeline


def _body(kw):
    """The project's rank body on the contract's keywords."""
    kw = dict(kw)
    q, kv_cache, topk, group, combine = (kw.pop(k) for k in ("q", "kv_cache", "topk_indices", "group", "combine"))
    return dcp_runtime.forward_mqa_dcp_rank(q, kv_cache, topk, pipeline.MQAMetadata(**kw), group=group, combine=combine)


def _run(kw, **replacements):
    with mock.patch.multiple(dcp_runtime, **replacements):
        return _body(kw)


class _ReversedQueryGather(dcp_runtime.Collectives):
    def all_gather(self, t, dim):
        gathered = super().all_gather(t, dim)
        if dim != 1:
            return gathered
        return torch.cat(gathered.chunk(self.size, dim)[::-1], dim)


class _ShiftedReduceScatter(dcp_runtime.Collectives):
    def reduce_scatter(self, t, dim):
        chunks = t.chunk(self.size, dim)
        return super().reduce_scatter(torch.cat(chunks[1:] + chunks[:1], dim), dim)


def reversed_query_gather(**kw):
    """The all-gathered query heads concatenated in reverse rank order."""
    return _run(kw, Collectives=_ReversedQueryGather)


def shifted_reduce_scatter(**kw):
    """The reduce-scatter hands rank r the heads of rank r + 1 (mod N)."""
    return _run(kw, Collectives=_ShiftedReduceScatter)


def no_padding_mask(**kw):
    """`mask_dcp_empty_shards_` skipped: padding rows merge whatever their stale indices read."""
    return _run(kw, mask_empty_shards=lambda lse, seq_lens, query_start_loc: lse)


def lse_halves_swapped(**kw):
    """The all-to-all payload carries each LSE's high half in the first lane."""
    real = dcp_runtime.pack_a2a

    def pack(out, lse, size):
        packed = real(out, lse, size)
        dim = out.shape[-1]
        return torch.cat([packed[..., :dim], packed[..., dim + 1 :], packed[..., dim : dim + 1]], dim=-1)

    return _run(kw, pack_a2a=pack)


def _mixed_without_neutralization(step, decode_stage):
    m = step.m
    idx = step.stages.fn("dcp_convert_index")(
        req_id=step.req_id, block_table=m.block_table, topk_indices=step.topk,
        block_size=step.kv_cache.shape[1], dcp_size=m.dcp_size, dcp_rank=m.dcp_rank,
        interleave=m.interleave, compact_valid_to_front=False,
    )
    out, lse = step.stages.fn(decode_stage)(
        q=step.q.unsqueeze(0), kv_cache=step.kv_cache, indices=idx.unsqueeze(0), sm_scale=m.sm_scale
    )
    return out[0], lse[0].transpose(0, 1)


def no_empty_row_neutralization(**kw):
    """Rows this rank owns none of keep the decode kernel's (0, +inf) instead of (0, -inf)."""
    with mock.patch.object(pipeline, "_fp8_mixed", _mixed_without_neutralization):
        return _body(kw)


def _is_last_rank(group) -> bool:
    return torch.distributed.get_rank(group) == torch.distributed.get_world_size(group) - 1


def last_rank_hangs(**kw):
    """The last rank never reaches the first collective: its peers block in it."""
    if _is_last_rank(kw["group"]):
        time.sleep(3600)
    return _body(kw)


def last_rank_dies(**kw):
    """The last rank's process exits the way a CUDA illegal address takes it down."""
    if _is_last_rank(kw["group"]):
        os._exit(3)
    return _body(kw)
