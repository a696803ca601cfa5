"""The DCP combine op: per-rank partial outputs and LSEs merged by log-sum-exp (AG+RS semantics)."""

from __future__ import annotations

import math

import torch

import reference
from equivalence.policy import LSE, OUT

from . import Check, ImplOutput, OpSpec, register_op
from .common import generator, knobs, rand


def _merge_inputs(p, seed, device):
    g = generator(seed, device)
    ranks, tokens, heads = p["ranks"], p["tokens"], p["heads"]
    outs = torch.randn((ranks, tokens, heads, 512), generator=g, device=device)
    lses = 4 + 3 * torch.randn((ranks, tokens, heads), generator=g, device=device)
    # Neutralized rows (a rank owning none of a token's keys) are the merge's identity (0, -inf).
    empty = rand(g, ranks, tokens) < p.get("empty_frac", 0.0)
    empty[:, rand(g, tokens) < p.get("empty_frac", 0.0) / 2] = True  # some tokens empty on every rank
    outs[empty] = 0.0
    lses[empty] = -math.inf
    if p.get("junk"):
        # Undefined partials the combine must drop: NaN or +inf LSE with a NaN output.
        junk = (rand(g, ranks, tokens, heads) < 0.1) & ~empty[..., None]
        lses[junk] = torch.where(rand(g, int(junk.sum())) < 0.5, math.nan, math.inf)
        outs[junk] = math.nan
    return {"outs": outs.to(torch.bfloat16), "lses": lses}


def _merge_reference(kw, p):
    out, lse = reference.dcp_merge(kw["outs"], kw["lses"])
    return {"out": out, "lse": lse, "logit_l1": torch.zeros_like(lse)}


register_op(OpSpec(
    name="dcp_merge",
    stage="dcp_merge",
    arguments=("outs", "lses"),
    inputs=_merge_inputs,
    reference=_merge_reference,
    call=lambda subject, kw, p: ImplOutput(dict(zip(("out", "lse"), subject.fn(**kw))), deviations=subject.deviations),
    checks=(Check("out", OUT), Check("lse", LSE, "logit_l1")),
    knobs=lambda p: knobs(p, num_tokens=p["tokens"], dcp_size=p["ranks"]),
    doc="cp_lse_ag_out_rs: sanitize NaN/+inf LSEs, merge by log-sum-exp, bf16 per-rank terms, sum",
))
