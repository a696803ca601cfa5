"""Broken forward_mqa compositions: the reference's forward_mqa with one step of the backend's
composition done wrong (patched in for the call), as whole-forward_mqa implementations."""

import dataclasses
from contextlib import contextmanager
from unittest import mock

import torch

import mla_verify.reference.forward as F
from mla_verify.reference.indices import req_id_per_token


@contextmanager
def _patched(**replacements):
    with mock.patch.multiple(F, **replacements):
        yield


def _run(q, kv_cache, kw, **replacements):
    """The reference's forward_mqa on the contract's keywords, with `replacements` patched in."""
    kw = dict(kw)
    topk = kw.pop("topk_indices")
    with _patched(**replacements):
        res = F.forward_mqa(q, kv_cache, topk, F.MQAMetadata(**kw))
    return res.out.float().to(torch.bfloat16), res.lse.float()


def req_id_not_sliced(q, kv_cache, **kw):
    """vLLM #47327: the whole batch's req_id handed to the converter when q holds decodes only."""
    real = F.convert_index
    full = req_id_per_token(kw["query_start_loc"], kw["query_start_loc"][-1])
    return _run(q, kv_cache, kw, convert_index=lambda req_id, *a, **k: real(full, *a, **k))


def padding_counted_as_decodes(q, kv_cache, **kw):
    """Zero-length CUDA-graph padding requests counted as decodes in the decode reshape."""
    return _run(q, kv_cache, kw, active_decodes=lambda qsl, split: (qsl[1] - qsl[0], split.num_decodes))


def _plan_with(change):
    real = F.plan_prefill

    def plan(query_start_loc, seq_lens, split, workspace_size):
        return change(real(query_start_loc, seq_lens, split, workspace_size), query_start_loc, seq_lens, split)

    return plan


def starts_not_rebased(q, kv_cache, **kw):
    """Per-chunk workspace starts left as the global exclusive cumsum (later chunks read past)."""
    def change(plan, qsl, seq_lens, split):
        lens = list(seq_lens[split.num_decodes:])
        starts = torch.tensor([0] + lens[:-1]).cumsum(0).to(torch.int32)
        return dataclasses.replace(plan, workspace_starts=starts)

    return _run(q, kv_cache, kw, plan_prefill=_plan_with(change))


def chunk_tokens_without_decode_offset(q, kv_cache, **kw):
    """Chunk token slices computed from the prefill requests' query starts without the decodes' offset."""
    def change(plan, qsl, seq_lens, split):
        shift = qsl[split.num_decodes]
        chunks = [dataclasses.replace(c, tokens=(c.tokens[0] - shift, c.tokens[1] - shift)) for c in plan.chunks]
        return dataclasses.replace(plan, chunks=chunks)

    return _run(q, kv_cache, kw, plan_prefill=_plan_with(change))


def workspace_sized_by_query_lens(q, kv_cache, **kw):
    """The chunk's workspace sized by the prefills' query lengths, not their full sequence lengths."""
    def change(plan, qsl, seq_lens, split):
        chunks = [dataclasses.replace(c, total_rows=qsl[c.requests[1]] - qsl[c.requests[0]]) for c in plan.chunks]
        return dataclasses.replace(plan, chunks=chunks)

    return _run(q, kv_cache, kw, plan_prefill=_plan_with(change))


def decode_lse_not_transposed(q, kv_cache, **kw):
    """vLLM #46514 class: the mixed path's kernel LSE (1, H, T) squeezed but not transposed."""
    real = F.sparse_decode

    def decode(*a, **k):
        res = real(*a, **k)
        if res.lse.shape[0] != 1:
            return res
        flipped = res.lse[0].reshape(res.lse.shape[2], res.lse.shape[1]).T[None]
        return res._replace(lse=flipped)

    return _run(q, kv_cache, kw, sparse_decode=decode)


def chunk_ending_mid_batch_drops_its_last_request(q, kv_cache, **kw):
    """A chunk of two or more requests that ends mid-batch (more prefills follow it) stops its
    token range at its last request's start: that request's rows are never computed (the output
    buffer's zeros stay). Right for the last chunk and for chunks of one request."""
    def change(plan, qsl, seq_lens, split):
        last = len(plan.chunks) - 1
        chunks = [dataclasses.replace(c, tokens=(c.tokens[0], qsl[c.requests[1] - 1]))
                  if i < last and c.requests[1] - c.requests[0] >= 2 else c for i, c in enumerate(plan.chunks)]
        return dataclasses.replace(plan, chunks=chunks)

    return _run(q, kv_cache, kw, plan_prefill=_plan_with(change))
