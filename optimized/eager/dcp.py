"""Decode context parallelism: per-rank partial attention merged by log-sum-exp, as the AG+RS
combine stores it (each rank's term in bf16, then summed) and as the all-to-all combine does
(summed in float32, rounded once).
"""

from __future__ import annotations

import torch

from .. import buffers
from ..validation import InputError, check_same_device, check_tensor
from .common import stage


def _merge_weights(lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """lses [N, T, H] -> (L [T, H], f [N, T, H]) of the LSE merge: L = logsumexp_n x_n with
    x = lse where NaN / +inf become -inf (-inf where every rank is empty); f_n = exp(lse_n - L),
    0 where that exponent is NaN or +inf."""
    inf = float("inf")
    merged = torch.logsumexp(lses.masked_fill(torch.isnan(lses) | (lses == inf), -inf), dim=0)
    exponent = lses - merged
    return merged, torch.exp(exponent).masked_fill_(torch.isnan(exponent) | (exponent == inf), 0.0)


def _scaled_terms(outs: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """bf16(f * out), as each rank stores its term before the reduce-scatter; exactly 0 where
    f = 0, which drops whatever junk (NaN, inf) an empty rank's output holds."""
    terms = (outs.float() * f[..., None]).to(torch.bfloat16)
    return terms.masked_fill_(f[..., None] == 0, 0.0)


@stage("dcp_lse_correct")
def dcp_lse_correct(out_r: torch.Tensor, lses: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's share of the AG+RS combine (`correct_attn_out`): out_r [T, H, D] bf16 and every
    rank's lses [N, T, H] f32 -> (bf16(f_rank * out_r) [T, H, D], L [T, H] f32)."""
    check_tensor("lses", lses, dtype=torch.float32, ndim=3)
    check_tensor("out_r", out_r, dtype=torch.bfloat16, shape=(*lses.shape[1:], None))
    check_same_device(out_r=out_r, lses=lses)
    if not 0 <= rank < lses.shape[0]:
        raise InputError(f"rank={rank} is outside [0, {lses.shape[0]}) (lses has {lses.shape[0]} ranks)")
    merged, f = _merge_weights(lses)
    partial = buffers.empty(tuple(out_r.shape), torch.bfloat16, out_r.device)
    lse = buffers.empty(tuple(merged.shape), torch.float32, out_r.device)
    partial.copy_(_scaled_terms(out_r, f[rank]))
    lse.copy_(merged)
    return partial, lse


def _checked_weights(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The merge contract's input checks, then (L, the ranks' weights) of `_merge_weights`."""
    check_tensor("lses", lses, dtype=torch.float32, ndim=3)
    check_tensor("outs", outs, dtype=torch.bfloat16, shape=(*lses.shape, None))
    check_same_device(outs=outs, lses=lses)
    return _merge_weights(lses)


def _merged(outs: torch.Tensor, total: torch.Tensor, merged: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16(total), L) in fresh output buffers (poisoned under the harness)."""
    out = buffers.empty(tuple(outs.shape[1:]), torch.bfloat16, outs.device)
    lse = buffers.empty(tuple(merged.shape), torch.float32, outs.device)
    out.copy_(total)
    lse.copy_(merged)
    return out, lse


@stage("dcp_merge")
def dcp_merge(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's `dcp_lse_correct` share, summed (in float32) and rounded to bf16:
    outs [N, T, H, D] bf16, lses [N, T, H] f32 -> (out [T, H, D] bf16, L [T, H] f32)."""
    merged, f = _checked_weights(outs, lses)
    return _merged(outs, _scaled_terms(outs, f).float().sum(dim=0), merged)


@stage("dcp_a2a_merge")
def dcp_a2a_merge(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The all-to-all combine's merge (`dcp_a2a_lse_reduce` after the exchange), for the heads
    one rank received from every rank: outs [N, T, H, D] bf16, lses [N, T, H] f32 ->
    (bf16(sum_n w_n * out_n) [T, H, D], L [T, H] f32), w_n = exp(lse_n - L) as in `dcp_merge`
    (0 for -inf, +inf and NaN LSEs, and the partial dropped there), summed in float32 and rounded
    once: unlike the reduce-scatter, no term is stored in bf16 first."""
    merged, w = _checked_weights(outs, lses)
    terms = (outs.float() * w[..., None]).masked_fill_(w[..., None] == 0, 0.0)
    return _merged(outs, terms.sum(dim=0), merged)
