"""Implementations that look right call by call but are inconsistent with themselves: what the
properties (equivalence.properties) exist to catch, without a reference. Each wraps the float32
eager implementation (optimized.eager) and breaks one thing."""

import math

import torch

from mla_verify.optimized import eager


def noisy_prefill(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """Nondeterministic: about 2% of the outputs move by one bf16 ulp, differently every call
    (the global generator is never reseeded), as a racy reduction would."""
    out, lse, max_logits = eager.sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink)
    ulp_up = torch.where(torch.rand(out.shape, device=out.device) < 0.02, 1 + 2.0**-7, 1.0)
    return (out.float() * ulp_up).to(torch.bfloat16), lse, max_logits


def lse_is_max_logit(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """Right output, but the LSE it reports is the largest logit: one call's output never shows
    it, and a merge of partial results weighs the parts wrongly."""
    out, lse, max_logits = eager.sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink)
    return out, torch.where(lse == math.inf, lse, max_logits), max_logits


def split_kv_with_bf16_partials(q, kv_cache, indices, sm_scale):
    """Batch-dependent: a batch of more than one request splits each top-k list in two (its even
    and its odd entries) and merges their bf16-rounded outputs (a sloppy split-KV); a request
    alone runs unsplit, whatever its tokens. Split by parity, not into halves: a short request's
    entries all sit in the first half of its list (ci draws many), where halves leave one part
    empty and the merge exact; and keyed on the requests, not the rows: a request of 2-4 tokens
    alone was split too, the same as in its batch (the property then saw nothing: s_q > 1 is 3 in
    4 of its draws; escaped 40 examples at seed 1977612511)."""
    if q.shape[0] == 1 or indices.shape[-1] < 2:
        return eager.sparse_decode_fp8(q, kv_cache, indices, sm_scale)
    half = torch.arange(indices.shape[-1], device=indices.device) % 2 == 0
    parts = [eager.sparse_decode_fp8(q, kv_cache, torch.where(mask, indices, -1), sm_scale) for mask in (half, ~half)]
    outs = torch.stack([o.float() for o, _ in parts])                                 # [2, B, S, H, D]
    lses = torch.stack([s.transpose(1, 2) for _, s in parts])                         # [2, B, S, H]
    lses = lses.masked_fill(lses == math.inf, -math.inf)                              # empty half: no weight
    merged = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - merged).nan_to_num(0.0)
    out = (weights[..., None] * outs).sum(dim=0).to(torch.bfloat16)
    lse = merged.masked_fill(merged == -math.inf, math.inf)
    return out, lse.transpose(1, 2)


def decode_without_rope(q, kv_cache, indices, sm_scale):
    """Reads only the 512 NoPE dims of the query (the RoPE dot is lost): the prefill kernel,
    reading the same rows, disagrees."""
    nope = torch.cat([q[..., :512], torch.zeros_like(q[..., 512:])], dim=-1)
    return eager.sparse_decode_fp8(nope, kv_cache, indices, sm_scale)


def prefill_first_128(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """Attends to the first 128 entries of each row only (one kernel tile of the list)."""
    head = indices.clone()
    head[:, 128:] = -1
    return eager.sparse_prefill(q, kv, head, sm_scale, topk_length, attn_sink)


def decode_first_token_indices(q, kv_cache, indices, sm_scale):
    """Spec decode layout bug: every query token of a request reads its first token's top-k row."""
    return eager.sparse_decode_fp8(q, kv_cache, indices[:, :1].expand_as(indices).contiguous(), sm_scale)


def merge_lse_in_bf16(outs, lses):
    """Keeps the merged LSE in the output's dtype (bf16), as a combine that stores it beside the
    output would."""
    out, lse = eager.dcp_merge(outs, lses)
    return out, lse.to(torch.bfloat16).float()


# ---------------------------------------------------------------------------------------------
# DeepSeek V4's union decode: the reference with one inconsistency each (one call alone cannot
# show it; a property can).


def _union(q, kv_cache, indices, sm_scale, topk_length=None, extra_kv_cache=None, extra_indices=None,
           extra_topk_length=None, attn_sink=None):
    from mla_verify import reference

    res = reference.sparse_decode_v4(q, kv_cache, indices, sm_scale, topk_length, extra_kv_cache, extra_indices,
                                        extra_topk_length, attn_sink)
    return res.out.float().to(torch.bfloat16), res.lse.float()


def union_lse_of_main_only(q, kv_cache, indices, sm_scale, topk_length=None, extra_kv_cache=None, extra_indices=None,
                           extra_topk_length=None, attn_sink=None):
    """Right output, but the LSE it reports is the main list's alone: a merge of the two lists
    weighs the extra one wrongly (to nothing)."""
    out, _ = _union(q, kv_cache, indices, sm_scale, topk_length, extra_kv_cache, extra_indices, extra_topk_length,
                    attn_sink)
    _, lse = _union(q, kv_cache, indices, sm_scale, topk_length, None, None, None, attn_sink)
    return out, lse


def union_ignores_extra_length(q, kv_cache, indices, sm_scale, topk_length=None, extra_kv_cache=None,
                               extra_indices=None, extra_topk_length=None, attn_sink=None):
    """The extra list read whole whatever its length: an extra list of length 0 still counts."""
    return _union(q, kv_cache, indices, sm_scale, topk_length, extra_kv_cache, extra_indices, None, attn_sink)


def union_rope_from_the_nope_offset(q, kv_cache, indices, sm_scale, topk_length=None, extra_kv_cache=None,
                                    extra_indices=None, extra_topk_length=None, attn_sink=None):
    """q's RoPE dims read from 64 dims too early (dims 384..447): K's RoPE reaches the logits even
    when q's own RoPE dims are zero."""
    shifted = q.clone()
    shifted[..., 448:] = q[..., 384:448]
    return _union(shifted, kv_cache, indices, sm_scale, topk_length, extra_kv_cache, extra_indices, extra_topk_length,
                  attn_sink)
