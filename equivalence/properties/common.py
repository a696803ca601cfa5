"""What the properties share: base problems, the stages called in token-major form, the logit
scale of LSE rows, and the rewrites of top-k rows.

Base problems come from the ops' own input builders (equivalence.ops, equivalence.cases.batch): rows
and cache slots no valid index selects are poisoned with NaN, invalid entries take every form the
contract allows. A property's rewrites of them draw from `rewrite_generator(seed)`, a stream apart
from the base problem's, and happen before any implementation runs.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from mla_verify.equivalence.cases.batch import Batch
from mla_verify.equivalence.judge.policy import LSE, OUT
from mla_verify.optimized import pipeline
from mla_verify.optimized.registry import Resolved
from mla_verify.reference.attention import cache_row_values

from ..cases.params import DecodeParams, ForwardParams, PrefillParams
from ..ops.attention import SPARSE_DECODE_FP8, SPARSE_PREFILL
from ..ops.forward import FORWARD_MQA
from ..sandbox.produced import Compared

D_V = 512
ATTENTION_STAGES = ("sparse_prefill", "sparse_decode_fp8")
# Stages a forward_mqa target exercises (the spec-decode reshapes and the chunker have one
# implementation each and are not listed).
PIPELINE_STAGES = ("concat_mla_q", "convert_index", "dcp_convert_index", "sparse_prefill", "sparse_decode_fp8",
                   "gather_upconvert_fp8", "dcp_merge")
# Invalid prefill entries: -1, other negatives, and rows past the end (offsets from N).
PREFILL_INVALID_NEGATIVES = (-1, -2, -123456, -(2**31))
PREFILL_INVALID_PAST_END = (0, 7, 1000)


def rewrite_generator(seed: int) -> torch.Generator:
    """The generator of a property's rewrites: seeded apart from the base problem's (seed)."""
    return torch.Generator().manual_seed(seed + 1)


def prefill_problem(params: PrefillParams, seed: int, device: str) -> dict[str, Any]:
    return SPARSE_PREFILL.inputs(params, seed, device)


def decode_problem(params: DecodeParams, seed: int, device: str) -> dict[str, Any]:
    return SPARSE_DECODE_FP8.inputs(params, seed, device)


def prefill_knobs(params: PrefillParams) -> dict[str, Any]:
    return SPARSE_PREFILL.knobs(params)


def decode_knobs(params: DecodeParams) -> dict[str, Any]:
    return SPARSE_DECODE_FP8.knobs(params)


def forward_knobs(params: ForwardParams) -> dict[str, Any]:
    return FORWARD_MQA.knobs(params)


def forward_stages(params: ForwardParams) -> list[str]:
    return pipeline.needed_stages(params.cache_dtype, params.heads, params.dcp_size, params.q_form == "tuple")


# ----------------------------------------------------------------------------- calling the stages


def prefill(stages: Resolved, kw: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """sparse_prefill -> (out [T, H, 512], lse [T, H])."""
    res = stages.fn("sparse_prefill")(**kw)
    return res[0], res[1]


def decode(stages: Resolved, kw: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """sparse_decode_fp8 in token-major form: (out [B*S, H, 512], lse [B*S, H])."""
    out, lse = stages.fn("sparse_decode_fp8")(**kw)
    batch, seq, heads = out.shape[:3]
    return out.reshape(batch * seq, heads, D_V), lse.transpose(1, 2).reshape(batch * seq, heads)


def forward(stages: Resolved, batch: Batch, **config: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The pipeline on `batch` (every rank and the merge under DCP); `config` replaces metadata fields."""
    if len(batch.rank_caches) > 1:
        ranks = batch.rank_metadata(pipeline.MQAMetadata, **config)
        res = pipeline.forward_mqa_dcp(batch.q, batch.rank_caches, batch.topk_indices, ranks, stages)
    else:
        res = pipeline.forward_mqa(batch.q, batch.kv_cache, batch.topk_indices,
                                   batch.metadata(pipeline.MQAMetadata, **config), stages)
    return res.out, res.lse


# ----------------------------------------------------------------------------- logit scales


def logit_scale(q: torch.Tensor, key_norm: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """[n, H]: sm_scale * ||q[t, h]|| * key_norm[t] for q [n, H, 576], key_norm [n] (the largest
    norm of a key row t attends to). By Cauchy-Schwarz it bounds the oracle's logit_l1,
    max_j sm_scale * sum_d |q_d K_jd|, from above, without the [n, H, K] product."""
    return sm_scale * q.double().norm(dim=-1) * key_norm.double()[:, None]


def _max_norm(norms: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, norms, 0.0).amax(dim=-1)


def prefill_scale(kw: Mapping[str, Any]) -> torch.Tensor:
    """The logit scale of every (token, head) of a sparse_prefill problem, [T, H]."""
    idx, kv = kw["indices"].long(), kw["kv"]
    valid = (idx >= 0) & (idx < kv.shape[0])
    if kw.get("topk_length") is not None:
        valid &= torch.arange(idx.shape[1], device=idx.device)[None, :] < kw["topk_length"][:, None]
    norms = kv.double().norm(dim=-1)[torch.where(valid, idx, 0)]
    return logit_scale(kw["q"], _max_norm(norms, valid), kw["sm_scale"])


def decode_scale(kw: Mapping[str, Any]) -> torch.Tensor:
    """The logit scale of every (token, head) of a sparse_decode_fp8 problem, token-major [B*S, H]."""
    q, idx = kw["q"], kw["indices"]
    rows = idx.reshape(-1, idx.shape[-1]).long()
    valid = rows != -1
    slots, inverse = torch.unique(rows[valid], return_inverse=True)
    norms = torch.zeros(rows.shape, dtype=torch.float64, device=rows.device)
    norms[valid] = cache_row_values(kw["kv_cache"], slots, torch.float64).norm(dim=-1)[inverse]
    return logit_scale(q.reshape(-1, *q.shape[2:]), _max_norm(norms, valid), kw["sm_scale"])


def forward_scale(batch: Batch, sm_scale: float) -> torch.Tensor:
    """The logit scale of every (token, head) of a forward_mqa batch, the key norm taken as the
    largest of any latent row of the batch (a looser bound than per token, fine as a unit)."""
    q = torch.cat(batch.q, dim=-1) if isinstance(batch.q, tuple) else batch.q
    key_norm = max((src.double().norm(dim=-1).max() for src in batch.kv_source if len(src)), default=torch.tensor(0.0))
    return logit_scale(q, key_norm.to(q.device).expand(q.shape[0]), sm_scale)


def attention(check: str, got: tuple[torch.Tensor, torch.Tensor], base: tuple[torch.Tensor, torch.Tensor],
              scale: torch.Tensor) -> list[Compared]:
    """The out and lse of two attention answers, as a check's comparisons."""
    return [Compared(check, "out", OUT, got[0], base[0]), Compared(check, "lse", LSE, got[1], base[1], scale)]


# ----------------------------------------------------------------------------- rewriting top-k rows


def prefill_fill(gen: torch.Generator, shape: tuple[int, ...], num_rows: int) -> torch.Tensor:
    """Invalid prefill entries of every form: -1, other negatives, rows at or past the end."""
    forms = torch.tensor(PREFILL_INVALID_NEGATIVES + tuple(num_rows + d for d in PREFILL_INVALID_PAST_END))
    return forms[torch.randint(0, len(forms), shape, generator=gen)]


def insert_entries(gen: torch.Generator, idx: torch.Tensor, fill: torch.Tensor,
                   lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows [n, K] (CPU) -> [n, K + E]: the E entries of fill [n, E] at random positions, the
    original entries in their order; `lengths` (topk_length) then count the same originals."""
    n, k = idx.shape
    width = k + fill.shape[1]
    at = torch.rand((n, width), generator=gen).argsort(dim=1)[:, : fill.shape[1]]
    inserted = torch.zeros((n, width), dtype=torch.bool).scatter_(1, at, True)
    out = torch.empty((n, width), dtype=idx.dtype)
    out[inserted] = fill.flatten().to(idx.dtype)  # boolean indexing walks rows in order
    out[~inserted] = idx.flatten()
    if lengths is None:
        return out, None
    # The L-th original sits after every position holding fewer than L originals.
    originals_so_far = (~inserted).long().cumsum(dim=1)
    at_last = (originals_so_far < lengths.long()[:, None]).sum(dim=1)
    return out, torch.where(lengths > 0, at_last + 1, 0).to(lengths.dtype)


def permute_entries(gen: torch.Generator, idx: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Each row [n, K] (CPU) shuffled; with `lengths`, only the first lengths[i] entries move."""
    n, k = idx.shape
    keys = torch.rand((n, k), generator=gen)
    if lengths is not None:
        pos = torch.arange(k)[None, :]
        keys = torch.where(pos < lengths.long()[:, None], keys, 1.0 + pos)  # the tail keeps its place
    return idx.gather(1, keys.argsort(dim=1))


def on(device: str, **tensors: torch.Tensor | None) -> dict[str, torch.Tensor | None]:
    """Keyword updates of a problem, the rewritten (CPU) tensors moved to `device`; None stays None."""
    return {k: None if v is None else v.to(device) for k, v in tensors.items()}
