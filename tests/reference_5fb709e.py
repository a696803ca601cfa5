"""The reference's attention as main had it at 5fb709e (before issue 48 trimmed its passes over the
keys), kept verbatim where it computes: today's reference must give its results bit for bit on the
same inputs (tests/test_reference_bits.py, and `scripts/reference_probe.py` on a GPU). Whole
problems, one chunk: the chunking itself is tested separately (tests/test_reference_attention.py)."""

from __future__ import annotations

import torch

from mla_verify.reference.attention import AttentionResult, _gather
from mla_verify.reference.fp8_ds_mla import HEAD_DIM, NOPE_DIM, NUM_TILES, ROW_BYTES, TILE, unpack_fp8_ds_mla
from mla_verify.reference.nvfp4_ds_mla import ROW_BYTES as NVFP4_ROW_BYTES, nvfp4_ds_mla_values


def attend(q, keys, valid, sm_scale, attn_sink=None, magnitudes=False) -> AttentionResult:
    abs_keys = torch.empty(keys.shape, dtype=torch.float32, device=keys.device).copy_(keys).abs_()
    l1 = torch.einsum("thd,tkd->thk", q.abs().float(), abs_keys)
    del abs_keys
    logit_l1 = (sm_scale * l1.amax(dim=-1)).to(q.dtype)
    del l1
    logits = torch.einsum("thd,tkd->thk", q, keys).mul_(sm_scale)
    logits.masked_fill_(~valid[:, None, :], float("-inf"))
    max_logits = logits.amax(dim=-1)
    empty = max_logits == float("-inf")
    shift = max_logits.masked_fill(empty, 0)
    probs = logits.sub_(shift[..., None]).exp_()
    total = probs.sum(dim=-1)
    lse = shift + torch.log(total)
    out = torch.einsum("thk,tkd->thd", probs.div_(total[..., None]), keys[..., :NOPE_DIM])
    found = [out]
    if magnitudes:
        values = keys[..., :NOPE_DIM].abs_()
        found += [torch.einsum("thk,tkd->thd", probs, values), values.sum(dim=1)[:, None, :].expand_as(out).clone()]
    for t in found:
        if attn_sink is not None:
            t.div_((1 + torch.exp(attn_sink.to(t.dtype)[None, :] - lse))[..., None])
        t.masked_fill_(empty[..., None], 0)
    lse.masked_fill_(empty, float("inf"))
    return AttentionResult(out, lse, max_logits, logit_l1, *found[1:])


def fp8_ds_mla_values(rows, dtype):
    nope, scales, rope = unpack_fp8_ds_mla(rows)
    lead = nope.shape[:-1]
    values = torch.empty(*lead, HEAD_DIM, dtype=dtype, device=rows.device)
    values[..., :NOPE_DIM] = nope
    values[..., :NOPE_DIM].view(*lead, NUM_TILES, TILE).mul_(scales.to(dtype)[..., None])
    values[..., NOPE_DIM:] = rope
    return values


def cache_row_values(kv_cache, slots, dtype):
    block_size = kv_cache.shape[1]
    safe = slots.clamp(min=0)
    rows = _gather(kv_cache, safe // block_size, safe % block_size)
    rows.masked_fill_((slots < 0)[..., None], 0)
    width = kv_cache.shape[-1]
    if kv_cache.dtype == torch.uint8 and width == ROW_BYTES:
        return fp8_ds_mla_values(rows, dtype)
    if kv_cache.dtype == torch.uint8 and width == NVFP4_ROW_BYTES:
        return nvfp4_ds_mla_values(rows, dtype)
    return rows.to(dtype)


def sparse_prefill(q, kv, indices, sm_scale, topk_length=None, attn_sink=None, *, dtype=torch.float64,
                   magnitudes=False) -> AttentionResult:
    idx = indices.long()
    valid = (idx >= 0) & (idx < kv.shape[0])
    if topk_length is not None:
        valid &= torch.arange(idx.shape[1], device=idx.device)[None, :] < topk_length.long()[:, None]
    keys = kv[torch.where(valid, idx, 0)].masked_fill_(~valid[..., None], 0).to(dtype)
    return attend(q.to(dtype), keys, valid, sm_scale, attn_sink, magnitudes)


def sparse_decode(q, kv_cache, indices, sm_scale, attn_sink=None, *, dtype=torch.float64,
                  magnitudes=False) -> AttentionResult:
    """Laid out as the prefill's: out [B*S, H, 512], the rest [B*S, H]."""
    slots = indices.reshape(-1, indices.shape[-1]).long()
    keys = cache_row_values(kv_cache, slots, dtype)
    return attend(q.reshape(-1, *q.shape[2:]).to(dtype), keys, slots != -1, sm_scale, attn_sink, magnitudes)
