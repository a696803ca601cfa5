"""The MQA query: the absorbed NoPE part and the RoPE part side by side (576 = the cache row's
width, so one dot product covers both). The spec-decode reshapes live in `optimized.spec_decode`.
"""

from __future__ import annotations

import torch

from .. import buffers
from ..validation import check_same_device, check_tensor
from .common import HEAD, NOPE, ROPE, stage


@stage("concat_mla_q")
def concat_mla_q(ql_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
    """[T, H, 512] and [T, H, 64] bf16 -> [T, H, 576] bf16: NoPE then RoPE."""
    check_tensor("ql_nope", ql_nope, dtype=torch.bfloat16, shape=(None, None, NOPE), last_dim_contiguous=True)
    check_tensor("q_pe", q_pe, dtype=torch.bfloat16, shape=(ql_nope.shape[0], ql_nope.shape[1], ROPE),
                 last_dim_contiguous=True)
    check_same_device(ql_nope=ql_nope, q_pe=q_pe)
    q = buffers.empty((*ql_nope.shape[:2], HEAD), torch.bfloat16, ql_nope.device)
    q[..., :NOPE] = ql_nope
    q[..., NOPE:] = q_pe
    return q

