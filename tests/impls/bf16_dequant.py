"""A user's SM90-style sparse FP8 decode: it dequantizes the fp8_ds_mla rows to bf16, as
FlashMLA's SM90 kernel does before its bf16 tensor-core dot, then attends in fp32.

That rounding is FlashMLA's documented `bf16_dequant` deviation: exact with power-of-two scales,
far outside the exact bounds with raw amax/448 scales. `sparse_decode_fp8` does not declare it;
`declared` is the same kernel declaring it the way a kernel repo would.
"""

from __future__ import annotations

import torch

from mla_verify.optimized import eager


def sparse_decode_fp8(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, s_q, heads, dim = q.shape
    rows = eager.dequantize_fp8_ds_mla(kv_cache.reshape(-1, kv_cache.shape[-1]))  # slot = block * BS + offset
    out, lse, _ = eager.sparse_prefill(q.reshape(batch * s_q, heads, dim), rows, indices.reshape(batch * s_q, -1),
                                       sm_scale)
    return out.view(batch, s_q, heads, -1), lse.view(batch, s_q, heads).transpose(1, 2)


def declared(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float):
    return sparse_decode_fp8(q, kv_cache, indices, sm_scale)


declared.__mla_verify_deviations__ = ("bf16_dequant",)


def misdeclared(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, sm_scale: float):
    return sparse_decode_fp8(q, kv_cache, indices, sm_scale)


misdeclared.__mla_verify_deviations__ = ("bf16_dequantize",)  # not a documented deviation: a usage error


def whole_forward_mqa(q: torch.Tensor, kv_cache: torch.Tensor, **kwargs):
    """A whole forward_mqa (the reference's answer in the contract's dtypes), for declaring a
    deviation on a whole pipeline."""
    from mla_verify import reference

    topk = kwargs.pop("topk_indices")
    result = reference.forward_mqa(q, kv_cache, topk, reference.MQAMetadata(**kwargs))
    return result.out.bfloat16(), None if result.lse is None else result.lse.float()
