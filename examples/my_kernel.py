"""A sparse MLA prefill kernel as a kernel developer might first write one: float32 PyTorch, one
gather and two einsums, before porting it to Triton or CUDA. It follows mla-verify's contract for
`sparse_prefill` (`mla-verify list --op sparse_prefill`), which is FlashMLA's
`flash_mla_sparse_fwd` with 2-D kv and indices:

    q [T, H, 576] bf16, kv [N, 576] bf16, indices [T, K] int32, sm_scale,
    topk_length [T] int32 or None, attn_sink [H] fp32 or None
    -> out [T, H, 512] bf16, lse [T, H] fp32 (natural log; +inf for a token with no valid key)

An index is valid when 0 <= index < N and its position j < topk_length[t].
"""

import torch


def sparse_prefill(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    valid = (indices >= 0) & (indices < kv.shape[0])
    if topk_length is not None:
        valid &= torch.arange(indices.shape[1], device=q.device) < topk_length[:, None]
    # Invalid entries gather row 0 and are zeroed: rows no valid index selects may hold anything (NaN).
    keys = kv[torch.where(valid, indices, 0).long()].float().masked_fill(~valid[..., None], 0.0)  # [T, K, 576]
    logits = torch.einsum("thd,tkd->thk", q.float(), keys) * sm_scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)                                 # [T, H]
    probs = torch.exp(logits - lse[..., None]).nan_to_num(0.0)            # a token with no key: all 0
    out = torch.einsum("thk,tkd->thd", probs, keys[..., :512])            # V is the first 512 of K
    empty = ~valid.any(dim=-1)[:, None]                                   # [T, 1]
    if attn_sink is not None:  # the sink takes weight exp(sink) in the softmax's denominator only
        out = out * torch.sigmoid(lse - attn_sink).masked_fill(empty, 0.0)[..., None]
    return out.to(torch.bfloat16), lse.masked_fill(empty, float("inf"))


def sparse_prefill_v0(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """The first draft, kept for the README's walkthrough: it ignores topk_length (the bug of vLLM
    #36616), so the entries past a token's length are attended too."""
    return sparse_prefill(q, kv, indices, sm_scale, None, attn_sink)
