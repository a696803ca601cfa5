"""split_invariance: attention over a top-k set is the LSE merge of attention over its parts.

Split each token's valid entries V into parts P_1..P_n (part p's row keeps the entries assigned
to it and marks the others invalid: -1 or, for prefill, any invalid form). In exact arithmetic

    lse(V) = ln sum_p e^(lse(P_p)),    out(V) = sum_p e^(lse(P_p) - lse(V)) out(P_p),

where a part with no valid entry (the kernel gives out 0, lse +inf) is neutralized to the merge's
identity (0, -inf) first. It is the identity decode context parallelism rests on, checked on the
kernels themselves: every part runs through the implementation, the merge is exact (float64,
`reference.dcp_merge_exact`) and its answer is held to the implementation's whole-set answer. A
wrong LSE (base 2, a max instead of a log-sum-exp, a dropped key) that one call alone never shows
breaks it. No attention sink: a sink joins every part's normalizer, so the identity needs none.

Entry -> part: "random"; "contiguous" (runs of the row's positions); "residue" (index value mod
n, DCP's ownership of interleaved positions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from mla_verify import reference

from ..cases.draws import decode_params, prefill_params
from ..cases.schema import Int, OneOf, param
from ..spec import register
from .base import PropertySpec, Target
from .common import (
    attention,
    decode,
    decode_knobs,
    decode_problem,
    decode_scale,
    prefill,
    prefill_fill,
    prefill_knobs,
    prefill_problem,
    prefill_scale,
    rewrite_generator,
)

SCHEMES = ("random", "contiguous", "residue")


def _parts(params: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    return st.tuples(params, st.integers(2, 4), st.sampled_from(SCHEMES)).map(
        lambda t: {**t[0], "parts": t[1], "scheme": t[2]})


def _assign(gen: torch.Generator, idx: torch.Tensor, parts: int, scheme: str) -> torch.Tensor:
    """The part of every entry of rows [n, K]."""
    if scheme == "random":
        return torch.randint(0, parts, idx.shape, generator=gen)
    if scheme == "contiguous":
        return (torch.arange(idx.shape[1]) * parts // idx.shape[1]).expand_as(idx)
    if scheme == "residue":
        return idx.long().remainder(parts)
    raise ValueError(f"unknown split scheme {scheme!r}; known: {SCHEMES}")


@dataclass(frozen=True)
class Split:
    parts: int = param(Int(2, 64), kw_only=True)
    scheme: str = param(OneOf(*SCHEMES), kw_only=True)  # how entries are assigned to parts (module docstring)


def _split(p: Split, gen: torch.Generator, kw: dict, idx: torch.Tensor, valid: torch.Tensor,
           fill: torch.Tensor) -> dict:
    """The parts of problem `kw` whose index rows (CPU, [n, K] view) are `idx`, `valid` where live."""
    assign = _assign(gen, idx, p.parts, p.scheme)
    shape, device = kw["indices"].shape, kw["indices"].device
    parts = [{**kw, "indices": torch.where(assign == i, idx, fill).view(shape).to(device)} for i in range(p.parts)]
    nonempty = torch.stack([(valid & (assign == i)).any(dim=1) for i in range(p.parts)])
    return {"whole": kw, "parts": parts, "nonempty": nonempty.to(device)}


def _prefill_inputs(p, seed: int, device: str) -> dict:
    kw = prefill_problem(p, seed, device)
    idx = kw["indices"].cpu()
    valid = (idx >= 0) & (idx < kw["kv"].shape[0])
    if kw["topk_length"] is not None:
        valid &= torch.arange(idx.shape[1])[None, :] < kw["topk_length"].cpu()[:, None]
    gen = rewrite_generator(seed)
    fill = prefill_fill(gen, tuple(idx.shape), kw["kv"].shape[0]).to(idx.dtype)
    return {**_split(p, gen, kw, idx, valid, fill), "run": prefill, "scale": prefill_scale(kw)}


def _decode_inputs(p, seed: int, device: str) -> dict:
    kw = decode_problem(p, seed, device)
    idx = kw["indices"].cpu().reshape(-1, kw["indices"].shape[-1])
    fill = torch.full_like(idx, -1)
    return {**_split(p, rewrite_generator(seed), kw, idx, idx != -1, fill), "run": decode, "scale": decode_scale(kw)}


def _check(inputs: dict, p, stages) -> list:
    run = inputs["run"]
    whole = run(stages, inputs["whole"])
    outs, lses = zip(*(run(stages, kw) for kw in inputs["parts"]))
    nonempty = inputs["nonempty"]  # [parts, rows]
    outs = torch.where(nonempty[..., None, None], torch.stack(outs).double(), 0.0)
    lses = torch.where(nonempty[..., None], torch.stack(lses).double(), -math.inf)
    out, lse = reference.dcp_merge_exact(outs, lses)
    lse = lse.masked_fill(lse == -math.inf, math.inf)  # a token with no valid entry: the kernels' +inf
    return attention("merged", (out, lse), whole, inputs["scale"])


register(PropertySpec(
    short="split_invariance",
    checks=("merged",),
    own_params=Split,
    targets={
        "sparse_prefill": Target("sparse_prefill", lambda p: ["sparse_prefill"], ("sparse_prefill",),
                                 _prefill_inputs, _check, prefill_knobs,
                                 lambda p: _parts(prefill_params(p, sink=st.just("none"))), runs=lambda p: 1 + p.parts),
        "sparse_decode_fp8": Target("sparse_decode_fp8", lambda p: ["sparse_decode_fp8"], ("sparse_decode_fp8",),
                                    _decode_inputs, _check, decode_knobs, lambda p: _parts(decode_params(p)),
                                    runs=lambda p: 1 + p.parts),
    },
    doc="attention over a top-k set equals the exact LSE merge of attention over any partition of it (DCP's identity)",
), priority=101)
