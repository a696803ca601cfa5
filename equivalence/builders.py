"""Versions of the input builders: which draws build a case's tensors from its seed.

A case's tensors are a deterministic function of (case, device type). Changing how a builder draws
would change what every saved case holds, so the params of sparse_prefill, sparse_decode_fp8 and
forward_mqa carry the version of the builder that made them (`inputs`; a file without it was made
by version 1) and each version stays as it was: a saved case replays with its builder forever.
New draws take CURRENT.

    1  the first builders
    2  the same structure drawn with fewer device ops: a permutation is the argsort of uniform keys
       (torch.randperm on CUDA costs a few hundred microseconds of host time a call) and top-k
       distinct entries are the k smallest uniform keys (topk, not a whole-row argsort)
"""

from __future__ import annotations

from typing import Any

import torch

from .patterns import distinct_rows

VERSIONS = (1, 2)
CURRENT = 2


def stamped(params_type: type, drawn: dict[str, Any]) -> dict[str, Any]:
    """`drawn` params with the current builder's version where the op's params record one."""
    return {**drawn, "inputs": CURRENT} if "inputs" in params_type.schema() else drawn


def permutation(gen: torch.Generator, n: int, version: int) -> torch.Tensor:
    """A uniformly random permutation of 0 .. n - 1 (int64) on the generator's device."""
    if version == 1:
        return torch.randperm(n, generator=gen, device=gen.device)
    return torch.rand(n, generator=gen, device=gen.device).argsort()


def distinct(gen: torch.Generator, candidates: torch.Tensor, topk: int, version: int) -> torch.Tensor:
    """Row i: up to `topk` distinct entries of candidates[i] (int64, -1 = padding) in random order,
    then -1 padding (`patterns.distinct_rows` in version 1)."""
    if version == 1:
        return distinct_rows(gen, candidates, topk)
    keys = torch.rand(candidates.shape, generator=gen, device=gen.device).masked_fill_(candidates < 0, 2.0)
    take = min(topk, candidates.shape[1])
    chosen = candidates.gather(1, keys.topk(take, dim=1, largest=False).indices)
    if take < topk:
        chosen = torch.nn.functional.pad(chosen, (0, topk - take), value=-1)
    return chosen
