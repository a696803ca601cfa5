"""Spec-decode layouts of the FP8 decode kernel (vLLM `backends/utils.py`), as views.

A uniform decode batch of B requests with s query tokens each is token-major: request b's
tokens are rows b*s .. b*s + s - 1. The kernel wants [B, s, H, D]; its output goes back to
[B*s, H, D]. Both are views, as upstream: no copy, and writes through them land in place.
"""

from __future__ import annotations

import torch

from .registry import register
from .validation import InputError


@register("reshape_query_for_spec_decode", "torch")
def reshape_query_for_spec_decode(q: torch.Tensor, num_decodes: int) -> torch.Tensor:
    """[B*s, H, D] -> [B, s, H, D] with B = num_decodes."""
    if q.dim() != 3 or num_decodes <= 0 or q.shape[0] % num_decodes:
        raise InputError(f"q: cannot split {tuple(q.shape)} rows into {num_decodes} uniform decodes")
    return q.view(num_decodes, q.shape[0] // num_decodes, *q.shape[1:])


@register("reshape_attn_output_for_spec_decode", "torch")
def reshape_attn_output_for_spec_decode(out: torch.Tensor) -> torch.Tensor:
    """[B, s, H, D] -> [B*s, H, D]; a 3-D output is already in that layout."""
    if out.dim() == 3:
        return out
    if out.dim() != 4:
        raise InputError(f"out: expected 3 or 4 dims, got shape {tuple(out.shape)}")
    return out.flatten(0, 1)
