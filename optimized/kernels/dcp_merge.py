"""Combining decode-context-parallel partial attention outputs by their LSEs (spec §8.3, the
all-gather + reduce-scatter path: cp_lse_ag_out_rs -> correct_attn_out).

Per (t, h), over ranks n = 0..N-1 with x_n = lses[n, t, h]:
    x_n <- -inf where NaN or +inf;   m = max_n x_n (0 if -inf);   L = log(sum_n exp(x_n - m)) + m
    f_r = exp(lses[r, t, h] - L), and 0 where that exponent is NaN or +inf
    partial_r = bf16(out_r * f_r), exactly 0 where f_r == 0 (drops NaN/inf junk of empty ranks)
The merged output is sum_r partial_r: each partial rounded to bf16 first (a real DCP stores it in
the output dtype before the reduce-scatter), then summed in fp32 and rounded once. exp and log
run in fp32 (fast approximations on the GPU), so outputs match a float64 reference to within the
rounding bound the tests derive, not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_verify.optimized import buffers
from mla_verify.optimized.kernels.bits import bf16_to_f32, to_bf16
from mla_verify.optimized.kernels.launch import native
from mla_verify.optimized.registry import TRITON, register
from mla_verify.optimized.validation import InputError, check_same_device, check_tensor

# Elements of the [heads, D] tile one program combines.
_TILE_ELEMENTS = 4096


@triton.jit
def _merged_lse(lse_th, stride_n, hmask, N: tl.constexpr, BLOCK_N: tl.constexpr):
    """L for a vector of heads; lse_th = pointers to lses[0, t, h]."""
    n = tl.arange(0, BLOCK_N)[None, :]
    x = tl.load(lse_th[:, None] + n * stride_n, mask=hmask[:, None] & (n < N), other=float("-inf"))
    x = tl.where((x != x) | (x == float("inf")), float("-inf"), x)
    m = tl.max(x, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)
    return tl.log(tl.sum(tl.exp(x - m[:, None]), axis=1)) + m


@triton.jit
def _scaled_partial(out_rank, lse_rank, L, mask, NATIVE: tl.constexpr):
    """bf16(out_r * f_r) for a [heads, D] tile, 0 where f_r == 0; lse_rank = raw lses[r, t, h]."""
    e = lse_rank - L
    f = tl.where((e != e) | (e == float("inf")), 0.0, tl.exp(e))[:, None]
    o = bf16_to_f32(tl.load(out_rank, mask=mask, other=0.0), NATIVE)
    return to_bf16(tl.where(f == 0.0, 0.0, o * f), NATIVE)


@triton.jit
def _lse_correct_kernel(
    out_r, so_t, so_h, so_d, lses, sl_n, sl_t, sl_h, rank, scaled, lse_out, H, D,
    N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    NATIVE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)[None, :]
    hmask = h < H
    mask = hmask[:, None] & (d < D)
    lse_th = lses + t * sl_t + h * sl_h
    L = _merged_lse(lse_th, sl_n, hmask, N, BLOCK_N)
    raw = tl.load(lse_th + rank * sl_n, mask=hmask, other=0.0)
    part = _scaled_partial(out_r + t * so_t + h[:, None] * so_h + d * so_d, raw, L, mask, NATIVE)
    tl.store(scaled + (t * H + h[:, None]) * D + d, part, mask=mask)
    tl.store(lse_out + t * H + h, L, mask=hmask)


@triton.jit
def _merge_kernel(
    outs, so_n, so_t, so_h, so_d, lses, sl_n, sl_t, sl_h, merged, lse_out, H, D,
    N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    NATIVE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)[None, :]
    hmask = h < H
    mask = hmask[:, None] & (d < D)
    lse_th = lses + t * sl_t + h * sl_h
    L = _merged_lse(lse_th, sl_n, hmask, N, BLOCK_N)
    out_th = outs + t * so_t + h[:, None] * so_h + d * so_d
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n in tl.static_range(N):
        raw = tl.load(lse_th + n * sl_n, mask=hmask, other=0.0)
        acc += bf16_to_f32(_scaled_partial(out_th + n * so_n, raw, L, mask, NATIVE), NATIVE)
    tl.store(merged + (t * H + h[:, None]) * D + d, to_bf16(acc, NATIVE), mask=mask)
    tl.store(lse_out + t * H + h, L, mask=hmask)


def _check_dim(out: torch.Tensor) -> int:
    if out.shape[-1] == 0:
        raise InputError("attention outputs need a positive head dim (last dim is 0)")
    return out.shape[-1]


def _tiles(num_ranks: int, heads: int, dim: int) -> dict[str, int]:
    block_d = triton.next_power_of_2(dim)
    block_h = max(1, min(triton.next_power_of_2(heads), _TILE_ELEMENTS // block_d))
    return {"N": num_ranks, "BLOCK_N": triton.next_power_of_2(num_ranks), "BLOCK_H": block_h, "BLOCK_D": block_d}


@register("dcp_lse_correct", "triton", priority=TRITON, devices=("cpu", "cuda"), interpreted_on=("cpu",))
def dcp_lse_correct(out_r: torch.Tensor, lses: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's share of the merge (correct_attn_out): (partial_r [T, H, D] bf16, L [T, H] f32).

    out_r [T, H, D] bf16 is this rank's output, lses [N, T, H] f32 every rank's LSE (after the
    all-gather); formulas in the module docstring. A multi-process DCP reduce-scatters the
    partials. Any strides.
    """
    check_tensor("lses", lses, dtype=torch.float32, ndim=3)
    num_ranks, tokens, heads = lses.shape
    check_tensor("out_r", out_r, dtype=torch.bfloat16, shape=(tokens, heads, None))
    check_same_device(out_r=out_r, lses=lses)
    if not 0 <= rank < num_ranks:
        raise InputError(f"rank={rank} is outside [0, N={num_ranks}) (lses has {num_ranks} ranks)")
    dim = _check_dim(out_r)
    scaled = buffers.empty((tokens, heads, dim), torch.bfloat16, out_r.device)
    lse = buffers.empty((tokens, heads), torch.float32, out_r.device)
    if lse.numel():
        tiles = _tiles(num_ranks, heads, dim)
        _lse_correct_kernel[(tokens, triton.cdiv(heads, tiles["BLOCK_H"]))](
            out_r, *out_r.stride(), lses, *lses.stride(), rank, scaled, lse, heads, dim,
            **tiles, NATIVE=native(out_r.device),
        )
    return scaled, lse


@register("dcp_merge", "triton", priority=TRITON, devices=("cpu", "cuda"), interpreted_on=("cpu",))
def dcp_merge(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In-process combine of N ranks: (bf16(sum_r partial_r) [T, H, D] bf16, L [T, H] f32).

    outs [N, T, H, D] bf16, lses [N, T, H] f32, any strides; one kernel loops over the ranks,
    accumulating the bf16 partials of the module docstring in fp32 in rank order.
    """
    check_tensor("outs", outs, dtype=torch.bfloat16, ndim=4)
    num_ranks, tokens, heads, dim = outs.shape
    check_tensor("lses", lses, dtype=torch.float32, shape=(num_ranks, tokens, heads))
    check_same_device(outs=outs, lses=lses)
    if num_ranks == 0:
        raise InputError("outs: need at least one rank (dim 0 is 0)")
    _check_dim(outs)
    merged = buffers.empty((tokens, heads, dim), torch.bfloat16, outs.device)
    lse = buffers.empty((tokens, heads), torch.float32, outs.device)
    if lse.numel():
        tiles = _tiles(num_ranks, heads, dim)
        _merge_kernel[(tokens, triton.cdiv(heads, tiles["BLOCK_H"]))](
            outs, *outs.stride(), lses, *lses.stride(), merged, lse, heads, dim,
            **tiles, NATIVE=native(outs.device),
        )
    return merged, lse
