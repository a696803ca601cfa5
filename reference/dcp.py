"""Decode context parallelism: merging per-rank partial attention by log-sum-exp.

Each of the N ranks attends over its own shard of the context and returns (out_n, lse_n) for
every gathered head. A rank that owns none of a row's selected tokens returns the merge's
identity (out 0, lse -inf): the backend's "empty-row neutralization" (the kernel alone would say
lse = +inf, which would poison the merge).

The merge (`cp_lse_ag_out_rs` -> `correct_attn_out`), per (token, head):
    x_n = lse_n with NaN and +inf replaced by -inf
    m   = max_n x_n  (0 if every x_n is -inf)
    L   = ln sum_n exp(x_n - m) + m                 (-inf if every x_n is -inf)
    f_n = exp(lse_n - L), with 0 where the exponent is NaN or +inf
    out = sum_n f_n * out_n,  with rank n's term 0 wherever f_n == 0 (kills NaN/inf junk)
The all-gather + reduce-scatter combine stores each rank's scaled term in the output dtype
(bf16) before the sum, and the reduce-scatter hands rank r the heads [r*H, (r+1)*H).

Before the exchange the combine masks rows no request owns (`mask_dcp_empty_shards_`): a row
t >= query_start_loc[-1] (CUDA-graph padding) or of a request with seq_len 0 gets lse -inf on
every rank, so it merges to (0, -inf) whatever the kernel computed for it.
"""

from __future__ import annotations

from typing import Sequence

import torch


def neutralize_empty_rows(out: torch.Tensor, lse: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """out [T, H, D], lse [T, H]: rows whose converted indices are all -1 -> (0, -inf)."""
    empty = (indices == -1).all(dim=-1)
    return out.masked_fill(empty[:, None, None], 0), lse.masked_fill(empty[:, None], float("-inf"))


def mask_empty_shards(lse: torch.Tensor, seq_lens: Sequence[int], query_start_loc: Sequence[int]) -> torch.Tensor:
    """lse [..., T, H] with -inf in the rows of no request (module docstring). Row t belongs to
    the last request r with query_start_loc[r] <= t (zero-length requests own no row); with no
    requests at all every row is masked."""
    num_tokens = lse.shape[-2]
    if not len(seq_lens):
        return torch.full_like(lse, float("-inf"))
    qsl = torch.as_tensor(query_start_loc, dtype=torch.int64)
    rows = torch.arange(num_tokens)
    owner = (torch.searchsorted(qsl, rows, right=True) - 1).clamp(0, len(seq_lens) - 1)
    empty = (rows >= qsl[-1]) | (torch.as_tensor(seq_lens, dtype=torch.int64)[owner] == 0)
    return lse.masked_fill(empty[:, None].to(lse.device), float("-inf"))


def merge_weights(lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """lses [N, ...] -> (L [...], f [N, ...]) as in the module docstring, in float64."""
    raw = lses.double()
    x = torch.where(torch.isnan(raw) | (raw == float("inf")), float("-inf"), raw)
    m = x.amax(dim=0)
    m = torch.where(m == float("-inf"), 0.0, m)
    total = torch.exp(x - m).sum(dim=0)
    merged = torch.log(total) + m  # log(0) = -inf when every rank is empty
    exponent = raw - merged
    f = torch.where(torch.isnan(exponent) | (exponent == float("inf")), 0.0, torch.exp(exponent))
    return merged, f


def _scaled_terms(outs: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    terms = outs.double() * f[..., None]
    return torch.where(f[..., None] == 0, 0.0, terms)


def dcp_merge(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The AG+RS combine of outs [N, T, H, D], lses [N, T, H], for all heads.

    Each rank's scaled term is rounded to bf16 as the combine stores it; the sum over ranks is
    exact here (NCCL's order of bf16 additions is not part of any contract). float64 results.
    """
    merged, f = merge_weights(lses)
    terms = _scaled_terms(outs, f).to(torch.bfloat16).double()
    return terms.sum(dim=0), merged


def dcp_merge_exact(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same merge with no intermediate rounding: what the combine approximates."""
    merged, f = merge_weights(lses)
    return _scaled_terms(outs, f).sum(dim=0), merged
