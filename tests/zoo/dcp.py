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
