"""The MLA decode query: [ql_nope | q_pe] per head (concat_mla_q, spec §7.2)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_verify.optimized import buffers
from mla_verify.optimized.kernels.kv_formats import HEAD_DIM, NOPE, ROPE
from mla_verify.optimized.kernels.launch import check_launchable
from mla_verify.optimized.registry import TRITON, register
from mla_verify.optimized.validation import check_same_device, check_tensor

_MAX_HEADS_PER_PROGRAM = 16


@triton.jit
def _copy_part(src, s_t, s_h, s_d, dst, t, h, hmask, AT: tl.constexpr, WIDTH: tl.constexpr, H):
    d = tl.arange(0, WIDTH)[None, :]
    bits = tl.load(src + t * s_t + h[:, None] * s_h + d * s_d, mask=hmask[:, None])
    tl.store(dst + (t * H + h[:, None]) * HEAD_DIM + AT + d, bits, mask=hmask[:, None])


@triton.jit
def _concat_kernel(
    nope, sn_t, sn_h, sn_d, pe, sp_t, sp_h, sp_d, q, H, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    _copy_part(nope, sn_t, sn_h, sn_d, q, t, h, hmask, 0, NOPE, H)
    _copy_part(pe, sp_t, sp_h, sp_d, q, t, h, hmask, NOPE, ROPE, H)


@register("concat_mla_q", "triton", priority=TRITON, devices=("cpu", "cuda"), interpreted_on=("cpu",))
def concat_mla_q(ql_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
    """q[t, h] = [ql_nope[t, h] (512) | q_pe[t, h] (64)] -> [T, H, 576] bf16, bit for bit.

    Inputs may be any strided views; the copy moves int16 bit patterns, so NaN payloads survive.
    """
    check_tensor("ql_nope", ql_nope, dtype=torch.bfloat16, shape=(None, None, NOPE.value))
    tokens, heads = ql_nope.shape[:2]
    check_tensor("q_pe", q_pe, dtype=torch.bfloat16, shape=(tokens, heads, ROPE.value))
    check_same_device(ql_nope=ql_nope, q_pe=q_pe)
    q = buffers.empty((tokens, heads, HEAD_DIM.value), torch.bfloat16, ql_nope.device)
    if q.numel():
        check_launchable(q.device)
        block_h = min(triton.next_power_of_2(heads), _MAX_HEADS_PER_PROGRAM)
        _concat_kernel[(tokens, triton.cdiv(heads, block_h))](
            ql_nope.view(torch.int16), *ql_nope.stride(), q_pe.view(torch.int16), *q_pe.stride(),
            q.view(torch.int16), heads, BLOCK_H=block_h,
        )
    return q
