"""Broken DCP combines."""

import torch

from mla_verify import reference


def no_sanitize(outs, lses):
    """vLLM #46514 (empty-row test): NaN / +inf LSEs from undefined partials are not dropped."""
    raw = lses.double()
    m = torch.where(torch.isnan(raw).any(0), 0.0, raw.nan_to_num(nan=0.0).amax(0))
    merged = torch.log(torch.exp(raw - m).sum(0)) + m
    f = torch.exp(raw - merged)
    out = (outs.double() * f[..., None]).to(torch.bfloat16).double().sum(0)
    return out.to(torch.bfloat16), merged.float()


def ignores_weights(outs, lses):
    """Partials summed without their softmax-mass weights."""
    out, merged = reference.dcp_merge(outs, lses)
    return outs.double().nan_to_num(0.0).sum(0).to(torch.bfloat16), merged.float()


def pairwise_tree_drops_the_odd_rank(outs, lses):
    """A pairwise tree combine (ranks 0+1, 2+3, ..., then the pairs' results): a level of an odd
    count leaves its last partial without a partner, and this tree drops it. Right at 1, 2, 4 and 8
    ranks (the powers of two drawn before), wrong at 3, 5, 6 and 7."""
    parts = [reference.dcp_merge_exact(o[None], s[None]) for o, s in zip(outs, lses)]  # each partial sanitized
    while len(parts) > 1:
        parts = [reference.dcp_merge_exact(torch.stack([parts[i][0], parts[i + 1][0]]),
                                           torch.stack([parts[i][1], parts[i + 1][1]]))
                 for i in range(0, len(parts) - 1, 2)]
    out, lse = parts[0]
    return out.to(torch.bfloat16), lse.float()

