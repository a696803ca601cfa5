"""Invalid-index patterns: how a case spoils the top-k rows it starts from.

Rows start as valid entries followed by -1 padding at the tail (what an indexer emits when the
sequence is shorter than top-k). Each pattern then rewrites a seeded ~15% of the entries:
    scattered     -1 anywhere in the row (entries invalidated, then the row shuffled)
    whole_row     about a quarter of the rows entirely -1 (an empty row: out 0, LSE +inf)
    negatives     -1 padding replaced by other negative values (-2, -7, -123456, -2**31)
    out_of_range  entries replaced by values past the valid range (never read by a correct kernel)
    duplicates    entries replaced by copies of other valid entries of the row (each counts)
"""

from __future__ import annotations

import torch

PATTERNS = ("scattered", "whole_row", "negatives", "out_of_range", "duplicates")
OTHER_NEGATIVES = (-2, -7, -123456, -(2**31))


def apply_patterns(
    gen: torch.Generator, rows: torch.Tensor, patterns, out_of_range: tuple[int, int] | None = None
) -> torch.Tensor:
    """Apply `patterns` in order to int64 rows; `out_of_range` is the [lo, hi] of bad values."""
    if rows.numel() == 0:
        return rows
    for pattern in patterns:
        hit = torch.rand(rows.shape, generator=gen) < 0.15
        if pattern == "scattered":
            rows = torch.where(hit, -1, rows)
            rows = rows.gather(1, torch.argsort(torch.rand(rows.shape, generator=gen), dim=1))
        elif pattern == "whole_row":
            rows = rows.clone()
            rows[torch.rand(rows.shape[0], generator=gen) < 0.25] = -1
        elif pattern == "negatives":
            pick = torch.randint(0, len(OTHER_NEGATIVES), rows.shape, generator=gen)
            rows = torch.where((rows == -1) & hit, torch.tensor(OTHER_NEGATIVES)[pick], rows)
        elif pattern == "out_of_range":
            if out_of_range is None:
                raise ValueError("this op has no out-of-range index values: every value but -1 is read")
            lo, hi = out_of_range
            bad = torch.randint(lo, hi + 1, rows.shape, generator=gen)
            rows = torch.where(hit, bad, rows)
        elif pattern == "duplicates":
            src = torch.randint(0, rows.shape[1], rows.shape, generator=gen)
            copies = rows.gather(1, src)
            rows = torch.where(hit & (copies >= 0), copies, rows)
        else:
            raise ValueError(f"unknown invalid-index pattern {pattern!r}; known: {PATTERNS}")
    return rows


def distinct_rows(gen: torch.Generator, pools: list[torch.Tensor], topk: int) -> torch.Tensor:
    """Row i: up to `topk` distinct entries of pools[i] in random order, then -1 padding."""
    rows = torch.full((len(pools), topk), -1, dtype=torch.int64)
    for i, pool in enumerate(pools):
        chosen = pool[torch.randperm(len(pool), generator=gen)[:topk]]
        rows[i, : len(chosen)] = chosen
    return rows
