"""The MQA query: absorbed NoPE part and RoPE part side by side, and its spec-decode layouts.

`concat_mla_q`: q[t, h] = [ql_nope[t, h] (512) | q_pe[t, h] (64)] (576 = the cache row width, so
one dot product covers both parts).

Spec decode: a uniform decode batch of B requests with s query tokens each is laid out
token-major (request b's tokens are rows b*s .. b*s + s - 1); the FP8 decode kernel wants
[B, s, H, D], and its output goes back to [B*s, H, D].
"""

from __future__ import annotations

import torch


def concat_mla_q(ql_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
    """[T, H, 512] and [T, H, 64] -> [T, H, 576] bf16."""
    if ql_nope.shape[:2] != q_pe.shape[:2] or ql_nope.shape[-1] != 512 or q_pe.shape[-1] != 64:
        raise ValueError(f"ql_nope [T, H, 512] and q_pe [T, H, 64] expected, got {tuple(ql_nope.shape)}, {tuple(q_pe.shape)}")
    return torch.cat([ql_nope, q_pe], dim=-1).to(torch.bfloat16)


def reshape_query_for_spec_decode(q: torch.Tensor, num_decodes: int) -> torch.Tensor:
    """[B*s, H, D] -> [B, s, H, D]."""
    if q.dim() != 3 or num_decodes <= 0 or q.shape[0] % num_decodes:
        raise ValueError(f"cannot split {tuple(q.shape)} query rows into {num_decodes} uniform decodes")
    return q.view(num_decodes, q.shape[0] // num_decodes, *q.shape[1:])


def reshape_attn_output_for_spec_decode(out: torch.Tensor) -> torch.Tensor:
    """[B, s, H, D] -> [B*s, H, D]; a 3-D output is returned unchanged."""
    if out.dim() == 3:
        return out
    if out.dim() != 4:
        raise ValueError(f"expected a 3-D or 4-D output, got {tuple(out.shape)}")
    return out.reshape(out.shape[0] * out.shape[1], *out.shape[2:])
