"""singleton: a token whose every top-k slot names one kv row attends to that row alone.

    value   every even token with a valid entry gets all K slots set to its first valid row r
            (the odd ones keep their random rows, in the same launch): its softmax is K copies of
            one logit s = sm_scale * q . kv[r], so out = V[r] (times the sink factor
            1 / (1 + e^(sink - lse)), 1 without one) and lse = s + ln(k valid), k valid being its
            topk_length where it has one, else K: duplicates all count.

Reference-free: the expected tensors are computed here from the inputs, in float64, with no code
of `reference/`. A kernel that deduplicates indices, normalizes by another count, folds the sink
into the LSE or reads a slot other than the one named fails it. Where the sink is so far above
the LSE that an fp32 kernel's sink factor (or its normalizer, taken at the max logit) overflows or
flushes, the row may come out 0: the out check keeps the main oracle's floor there (2**-126 of
the row's value_max, `judge.metrics` elem_bf16_units), measured so on the H100 for Triton and
flash_mla.
"""

from __future__ import annotations

import torch

from mla_verify.equivalence.judge.policy import LSE, OUT

from ..cases.draws import prefill_params
from ..spec import register
from ..sandbox.produced import Compared
from .base import PropertySpec, Target
from .common import prefill_knobs, prefill_problem


def singletons(kw: dict) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(the problem with every even token's slots set to its first valid row, which tokens are
    singletons, each token's row)."""
    idx, length, rows = kw["indices"].long(), kw["topk_length"], kw["kv"].shape[0]
    tokens, k = idx.shape
    live = (idx >= 0) & (idx < rows)
    if length is not None:
        live &= torch.arange(k, device=idx.device)[None, :] < length.long()[:, None]
    single = live.any(1) & (torch.arange(tokens, device=idx.device) % 2 == 0)
    row = torch.where(single, idx.gather(1, live.to(torch.int8).argmax(1, keepdim=True))[:, 0], 0)
    indices = torch.where(single[:, None], row[:, None].expand(tokens, k), idx).to(torch.int32)
    return {**kw, "indices": indices}, single, row


def expected(kw: dict, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, the logit scale, value_max) a singleton token of row `row` must give, float64.
    value_max is the oracle's (`ops.attention`): the largest |V| the row averages, times
    e^(lse - max_logit) = k valid, what an fp32 kernel's flushed sink factor multiplies."""
    q, kv = kw["q"].double(), kw["kv"].double()[row]                        # [T, H, 576], [T, 576]
    products = q * kv[:, None, :] * kw["sm_scale"]
    score = products.sum(-1)                                                  # [T, H]
    length = kw["topk_length"]
    k = torch.full_like(score[:, 0], kw["indices"].shape[1]) if length is None else length.double()
    lse = score + k.log()[:, None]
    factor = torch.ones_like(lse)
    if kw["attn_sink"] is not None:
        factor = 1 / (1 + torch.exp(kw["attn_sink"].double()[None, :] - lse))
    value_max = kv[:, :512].abs().amax(-1)[:, None] * k[:, None]
    return kv[:, None, :512] * factor[..., None], lse, products.abs().sum(-1), value_max.expand_as(lse)


def _check(kw: dict, p, stages) -> list[Compared]:
    problem, single, row = singletons(kw)
    out, lse = tuple(stages.fn("sparse_prefill")(**problem))[:2]
    want_out, want_lse, scale, value_max = expected(problem, row)
    at = single.nonzero().flatten()
    return [Compared("value", "out", OUT, out[at], want_out[at], value_max[at]),
            Compared("value", "lse", LSE, lse[at], want_lse[at], scale[at])]


register(PropertySpec(
    short="singleton",
    checks=("value",),
    targets={"sparse_prefill": Target("sparse_prefill", lambda p: ["sparse_prefill"], ("sparse_prefill",),
                                      prefill_problem, _check, prefill_knobs, prefill_params, runs=lambda p: 1)},
    doc="a token whose every top-k slot names one row: out = that row's V (sink factor), lse = its score + ln(k valid)",
), priority=108)
