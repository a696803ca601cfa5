"""A correct kernel at fp32's range limit: FlashMLA's prefill normalizes by the max logit in float32,
out = sum_j e^(s_j - m) V_j / (sum_j e^(s_j - m) + e^(sink - m)), and where e^(sink - m) overflows
float32 (sink - m > 88.7) the row comes out 0, though the exact answer (a normal float32 number
there) is not. Measured on the H100 at main 5fb709e for flash_mla and our Triton prefill (issue 48)."""

import torch

from mla_verify.optimized import eager


def flushes_sink_rows(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """The eager float32 prefill, each row whose e^(sink - max_logit) overflows float32 set to 0."""
    out, lse, max_logits = eager.sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink)
    if attn_sink is not None:
        overflows = torch.isinf(torch.exp(attn_sink.float()[None, :] - max_logits))
        out = out.masked_fill(overflows[..., None], 0)
    return out, lse, max_logits
