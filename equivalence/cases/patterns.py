"""Invalid-index patterns: how a case spoils the top-k rows it starts from.

Rows start as valid entries followed by -1 padding at the tail (what an indexer emits when the
sequence is shorter than top-k). Each pattern then rewrites a seeded ~15% of the entries:
    scattered     -1 anywhere in the row (entries invalidated, then the row shuffled)
    whole_row     about a quarter of the rows entirely -1 (an empty row: out 0, LSE +inf)
    negatives     -1 padding replaced by other negative values (-2, -7, -123456, -2**31)
    out_of_range  entries replaced by values past the valid range (never read by a correct kernel)
    duplicates    entries replaced by copies of other valid entries of the row (each counts)
    runs          about a quarter of the rows take a run of -1 (up to a quarter of the row) starting
                  anywhere, the front among them: -1 before valid entries, not only after them
    boundaries    entries replaced by the exact edges of the valid range: the first invalid value
                  (prefill: N; a logical position: the block-table width) and the last valid one
                  (N - 1; the table's last slot). Where only -1 is invalid (decode slots: one past
                  the cache is refused before launch) only the last valid slot.
"""

from __future__ import annotations

import torch

PATTERNS = ("scattered", "whole_row", "negatives", "out_of_range", "duplicates", "boundaries", "runs")
FORWARD_PATTERNS = PATTERNS + ("beyond_seq",)  # a forward_mqa batch's: also positions past the token's sequence
OTHER_NEGATIVES = (-2, -7, -123456, -(2**31))


def _rand(gen: torch.Generator, shape) -> torch.Tensor:
    return torch.rand(shape, generator=gen, device=gen.device)


def _randint(gen: torch.Generator, lo: int, hi: int, shape) -> torch.Tensor:
    return torch.randint(lo, hi, shape, generator=gen, device=gen.device)


def apply_patterns(
    gen: torch.Generator, rows: torch.Tensor, patterns, out_of_range: tuple[int, int] | None = None,
    last_valid: int | None = None,
) -> torch.Tensor:
    """Apply `patterns` in order to int64 rows; `out_of_range` is the [lo, hi] of bad values (lo
    the first), `last_valid` the largest valid value where there is no out-of-range one."""
    if rows.numel() == 0:
        return rows
    for pattern in patterns:
        hit = _rand(gen, rows.shape) < 0.15
        if pattern == "scattered":
            rows = torch.where(hit, -1, rows)
            rows = rows.gather(1, torch.argsort(_rand(gen, rows.shape), dim=1))
        elif pattern == "whole_row":
            rows = rows.masked_fill((_rand(gen, rows.shape[0]) < 0.25)[:, None], -1)
        elif pattern == "negatives":
            pick = _randint(gen, 0, len(OTHER_NEGATIVES), rows.shape)
            others = torch.tensor(OTHER_NEGATIVES, device=rows.device)
            rows = torch.where((rows == -1) & hit, others[pick], rows)
        elif pattern == "out_of_range":
            if out_of_range is None:
                raise ValueError("this op has no out-of-range index values: every value but -1 is read")
            lo, hi = out_of_range
            rows = torch.where(hit, _randint(gen, lo, hi + 1, rows.shape), rows)
        elif pattern == "boundaries":
            if out_of_range is not None:
                edge = torch.where(_rand(gen, rows.shape) < 0.5, out_of_range[0], out_of_range[0] - 1)
            elif last_valid is not None:
                edge = torch.full_like(rows, last_valid)
            else:
                raise ValueError("boundaries needs the op's first invalid or last valid value")
            rows = torch.where(hit, edge, rows)
        elif pattern == "runs":
            k = rows.shape[1]
            start = _randint(gen, 0, k, (rows.shape[0], 1))
            length = _randint(gen, 1, max(2, k // 4) + 1, (rows.shape[0], 1))
            pos = torch.arange(k, device=rows.device)[None, :]
            picked = (_rand(gen, rows.shape[0]) < 0.25)[:, None]
            rows = torch.where(picked & (pos >= start) & (pos < start + length), -1, rows)
        elif pattern == "duplicates":
            src = _randint(gen, 0, rows.shape[1], rows.shape)
            copies = rows.gather(1, src)
            rows = torch.where(hit & (copies >= 0), copies, rows)
        else:
            raise ValueError(f"unknown invalid-index pattern {pattern!r}; known: {PATTERNS}")
    return rows


def distinct_rows(gen: torch.Generator, candidates: torch.Tensor, topk: int) -> torch.Tensor:
    """Row i: up to `topk` distinct entries of candidates[i] (int64, -1 = padding) in random
    order, then -1 padding: random keys, padding keyed last, the first `topk` of each row."""
    keys = _rand(gen, candidates.shape).masked_fill_(candidates < 0, 2.0)
    chosen = candidates.gather(1, torch.argsort(keys, dim=1)[:, :topk])
    if chosen.shape[1] < topk:
        chosen = torch.cat([chosen, chosen.new_full((chosen.shape[0], topk - chosen.shape[1]), -1)], dim=1)
    return chosen


def prefix_candidates(lengths: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """[rows, width] int64: row i holds 0 .. lengths[i] - 1, then -1."""
    width = int(lengths.max()) if width is None and lengths.numel() else (width or 0)
    pos = torch.arange(width, device=lengths.device)[None, :]
    return torch.where(pos < lengths[:, None], pos, -1)
