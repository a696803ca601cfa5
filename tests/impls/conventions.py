"""Kernels of another convention (issue 25): an LSE in base 2, -inf for a row with no valid key and
max_logits in log2 units, as kernels whose softmax runs in exp2 return them (FlashMLA before its
PR #150, SGLang's older copy; FlashInfer's empty rows). Correct under `--convention lse_base=2
--convention empty_lse=-inf --convention max_logits_base=2` (decode: the first two), failing
without, with the convention named in the failure (tests/test_conventions.py).
"""

from __future__ import annotations

import math

import torch

from mla_verify.optimized import eager

LOG2E = 1.0 / math.log(2.0)


def _base2(lse: torch.Tensor) -> torch.Tensor:
    """lse / ln 2, rounded once to fp32; an empty row (+inf) -inf."""
    return (lse.double() * LOG2E).float().masked_fill(lse == math.inf, -math.inf)


def prefill_base2(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    out, lse, max_logits = eager.sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink)
    return out, _base2(lse), (max_logits.double() * LOG2E).float()


def decode_base2(q, kv_cache, indices, sm_scale):
    out, lse = eager.sparse_decode_fp8(q, kv_cache, indices, sm_scale)
    return out, _base2(lse)


def prefill_base2_ignores_topk_length(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """prefill_base2 with vLLM #36616's bug (topk_length ignored): fails whatever is declared."""
    return prefill_base2(q, kv, indices, sm_scale, None, attn_sink)


def flash_mla_prefill_base2(q, kv, indices, sm_scale, topk_length=None, attn_sink=None):
    """FlashMLA's sparse prefill (a GPU with sgl-flash-mla) returning base 2 and -inf: the H200 case."""
    from mla_verify.optimized import flashmla

    out, lse, *rest = flashmla.sparse_prefill(q, kv, indices, sm_scale, topk_length, attn_sink)
    return (out, _base2(lse), *((m.double() * LOG2E).float() for m in rest))


def flash_mla_decode_base2(q, kv_cache, indices, sm_scale):
    """FlashMLA's FP8 sparse decode returning base 2 and -inf, with the registered kernel's deviations."""
    from mla_verify.optimized import flashmla

    out, lse = flashmla.sparse_decode_fp8(q, kv_cache, indices, sm_scale)
    return out, _base2(lse)


flash_mla_decode_base2.__mla_verify_deviations__ = ("bf16_cache_scale", "bf16_dequant", "split_kv")
