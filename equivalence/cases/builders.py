"""Versions of the input builders: which draws build a case's tensors from its seed.

A case's tensors are a deterministic function of (case, device type). Changing how a builder draws
would change what every saved case holds, so the params of sparse_prefill, sparse_decode_fp8 and
forward_mqa carry the version of the builder that made them (`inputs`; a file without it was made
by version 1) and each version stays as it was: a saved case replays with its builder forever.
New draws take CURRENT.

    1  the first builders
    2  a permutation is the argsort of uniform keys, not torch.randperm (decode's block order,
       forward_mqa's block shuffle, HiSparse's slots and states, the outlier channels): on the
       H200, n = 8193, 0.078 ms against 0.084 (CUDA events around the call, host time included).
       Top-k entries stay the first k of a whole-row argsort: topk measured slower there (128 rows,
       2048 of 8192: 0.145 ms against 0.123).
"""

from __future__ import annotations

from typing import Any

import torch

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
