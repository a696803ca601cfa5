"""DeepSeek V4's sparse attention: one softmax over a union of two top-k lists and a sink, in
float64 (or float32).

For query token t (decode: request b, query position s), head h, the valid entries of the main
list M_t and of the extra list E_t select latent rows K_j of 512 dims (d_qk = d_v = 512: V is the
whole row, RoPE dims included):
    s_j        = sm_scale * <q[t, h], K_j>                          j in M_t u E_t
    lse        = ln sum_j exp(s_j)                                  natural log, over the union
    max_logits = max_j s_j
    out        = sum_j exp(s_j - lse) K_j * 1 / (1 + exp(sink_h - lse))   (the sink never moves lse)
An empty union gives out = 0, lse = +inf, max_logits = -inf. Entries count once per occurrence
(a slot in both lists, or twice in one, counts twice). In serving, the main list is the sliding
window over the last raw tokens and the extra list the compressed entries the indexer picked (or
every compressed entry, for the ratio-128 layers).

Decode (`flash_mla_with_kvcache` with the V4 caches): indices [B, S, K] and extra_indices
[B, S, K2] are physical slots of their own caches; topk_length [B] and extra_topk_length [B] are
per request: entry j of request b counts when j < length[b] and its value is not -1. Past a
length an entry is never read, whatever it holds; within it, -1 is the only invalid value and
anything else outside the cache is refused (the kernels read it unchecked).
Prefill (`flash_mla_sparse_fwd` with d_qk = 512): each list's indices [T, K] are rows of a flat
bf16 array [N, 512]; lengths are per token; an entry counts when j < length[t] and
0 <= value < rows (any other value is invalid).

A list is a `Paged` (decode: cache, slots, lengths, format) or `Rows` (prefill);
`sparse_decode_v4` takes the kernels' keywords.

Memory as `reference.attention`: chunks of query rows within the budget.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, NamedTuple

import torch

from .attention import AttentionResult, attend_chunks, collect
from .v4_pages import page_format, read_bytes_per_row, slot_values
from .v4_rows import D_QK


def _lengths_mask(width: int, lengths: torch.Tensor | None, rows_per_length: int, device) -> torch.Tensor | None:
    """[R, width] bool: position j < the length of its row (lengths repeat over `rows_per_length`
    consecutive rows: the query positions of one request), or None without lengths."""
    if lengths is None:
        return None
    if bool(((lengths < 0) | (lengths > width)).any()):
        raise ValueError(f"lengths must be in [0, {width}] (the list's width), got {lengths.tolist()}")
    per_row = lengths.long().repeat_interleave(rows_per_length)
    return torch.arange(width, device=device)[None, :] < per_row[:, None]


def _live_slots(indices: torch.Tensor, lengths: torch.Tensor | None, rows_per_length: int, capacity: int,
                name: str) -> torch.Tensor:
    """[R, K] int64 slots of a decode list with every entry that does not count set to -1; a
    counted entry that is neither -1 nor a slot of the cache is refused."""
    idx = indices.reshape(-1, indices.shape[-1]).long()
    within = _lengths_mask(idx.shape[1], lengths, rows_per_length, idx.device)
    if within is not None:
        idx = idx.masked_fill(~within, -1)
    bad = (idx != -1) & ((idx < 0) | (idx >= capacity))
    if bool(bad.any()):
        where = tuple(bad.nonzero()[0].tolist())
        raise ValueError(f"{name} entry {int(idx[where])} at row {where[0]}, position {where[1]} counts (within "
                         f"its length) and is neither -1 nor a slot in [0, {capacity})")
    return idx


class Paged(NamedTuple):
    """One list of a decode union: its cache, its slots, its lengths, the cache's format."""

    cache: torch.Tensor                 # [NB, BS, W] uint8 (`reference.v4_pages`)
    indices: torch.Tensor               # [B, S, K] int32 physical slots
    length: torch.Tensor | None = None  # [B] int32, per request
    kv_format: str | None = None        # None: the format the width names


class Rows(NamedTuple):
    """One list of a prefill union: flat bf16 rows, the rows each token selects, its lengths."""

    rows: torch.Tensor                  # [N, 512] bf16
    indices: torch.Tensor               # [T, K] int32
    length: torch.Tensor | None = None  # [T] int32, per token


def lists_of(kw: Mapping[str, Any]) -> tuple[Paged, Paged | None]:
    """(main, extra) from the decode contract's keywords (kv_cache, indices, topk_length and their
    extra_ counterparts)."""
    extra = None
    if kw.get("extra_kv_cache") is not None:
        extra = Paged(kw["extra_kv_cache"], kw["extra_indices"], kw.get("extra_topk_length"))
    return Paged(kw["kv_cache"], kw["indices"], kw.get("topk_length")), extra


def _check_decode(q: torch.Tensor, lists: list[Paged]) -> None:
    if q.dim() != 4 or q.shape[3] != D_QK:
        raise ValueError(f"q must be [B, S, H, {D_QK}], got {tuple(q.shape)}")
    for name, part in zip(("main", "extra"), lists):
        if part.indices.dim() != 3 or part.indices.shape[:2] != q.shape[:2]:
            raise ValueError(f"the {name} list's indices must be [B={q.shape[0]}, S={q.shape[1]}, K], got "
                             f"{tuple(part.indices.shape)}")
        if part.length is not None and part.length.shape != (q.shape[0],):
            raise ValueError(f"the {name} list's lengths are per request: [B={q.shape[0]}], got {tuple(part.length.shape)}")


def sparse_decode_union_chunks(
    q: torch.Tensor,
    main: Paged,
    sm_scale: float,
    extra: Paged | None = None,
    attn_sink: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float64,
    budget_bytes: int | None = None,
    magnitudes: bool = False,
) -> Iterator[tuple[slice, AttentionResult]]:
    """`sparse_decode_union` one chunk of the B*S query rows (b-major) at a time."""
    parts = [part for part in (main, extra) if part is not None]
    _check_decode(q, parts)
    batch, s_q, heads, _ = q.shape
    lists = [(part.cache, page_format(part.cache, part.kv_format),
              _live_slots(part.indices, part.length, s_q, part.cache.shape[0] * part.cache.shape[1], name))
             for name, part in zip(("indices", "extra_indices"), parts)]

    def chunk_keys(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        keys = [slot_values(cache, fmt, slots[rows], dtype) for cache, fmt, slots in lists]
        return torch.cat(keys, dim=1), torch.cat([slots[rows] != -1 for _, _, slots in lists], dim=1)

    width = sum(slots.shape[1] for _, _, slots in lists)
    build = max(read_bytes_per_row(fmt) for _, fmt, _ in lists)
    return attend_chunks(q.reshape(batch * s_q, heads, D_QK), width, chunk_keys, build, sm_scale, attn_sink,
                         dtype, budget_bytes, magnitudes)


def sparse_decode_union(
    q: torch.Tensor,
    main: Paged,
    sm_scale: float,
    extra: Paged | None = None,
    attn_sink: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float64,
    budget_bytes: int | None = None,
    magnitudes: bool = False,
) -> AttentionResult:
    """The V4 / V4.1 sparse decode: q [B, S, H, 512] bf16, the main list and the extra list
    (`Paged`: a [NB, BS, W] uint8 cache whose width names its format, or `kv_format`, its
    [B, S, K] int32 slots and [B] lengths), attn_sink [H] f32.

    Returns out [B, S, H, 512] (and with `magnitudes` out_abs, value_abs so laid out) and
    lse / max_logits / logit_l1 [B, H, S], as the kernels lay out their lse.
    """
    chunks = sparse_decode_union_chunks(q, main, sm_scale, extra, attn_sink, dtype=dtype, budget_bytes=budget_bytes,
                                        magnitudes=magnitudes)
    batch, s_q, heads, _ = q.shape
    flat = collect(chunks, q.reshape(batch * s_q, heads, D_QK), dtype)

    def heads_major(x: torch.Tensor) -> torch.Tensor:
        return x.view(batch, s_q, heads).transpose(1, 2)

    def like_out(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.view(batch, s_q, heads, D_QK)

    return AttentionResult(like_out(flat.out), heads_major(flat.lse), heads_major(flat.max_logits),
                           heads_major(flat.logit_l1), like_out(flat.out_abs), like_out(flat.value_abs))


def sparse_decode_v4(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    topk_length: torch.Tensor | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
) -> AttentionResult:
    """`sparse_decode_union` called as the kernels' contract is (`sparse_decode_v4` and
    `sparse_decode_v41` alike), in float64."""
    if (extra_kv_cache is None) != (extra_indices is None):
        raise ValueError("extra_kv_cache and extra_indices come together")
    main, extra = lists_of({"kv_cache": kv_cache, "indices": indices, "topk_length": topk_length,
                            "extra_kv_cache": extra_kv_cache, "extra_indices": extra_indices,
                            "extra_topk_length": extra_topk_length})
    return sparse_decode_union(q, main, sm_scale, extra, attn_sink)


def _prefill_rows(indices: torch.Tensor, lengths: torch.Tensor | None, rows: int) -> torch.Tensor:
    """[T, K] int64 rows of a prefill list, -1 wherever an entry does not count."""
    idx = indices.long()
    valid = (idx >= 0) & (idx < rows)
    within = _lengths_mask(idx.shape[1], lengths, 1, idx.device)
    if within is not None:
        valid &= within
    return idx.masked_fill(~valid, -1)


def sparse_prefill_union(
    q: torch.Tensor,
    main: Rows,
    sm_scale: float,
    extra: Rows | None = None,
    attn_sink: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float64,
    budget_bytes: int | None = None,
    magnitudes: bool = False,
) -> AttentionResult:
    """The union over flat bf16 rows: q [T, H, 512], each list `Rows` (rows [N, 512], indices
    [T, K], lengths [T]). Returns out [T, H, 512] and lse / max_logits / logit_l1 [T, H]."""
    if q.dim() != 3 or q.shape[2] != D_QK:
        raise ValueError(f"q must be [T, H, {D_QK}], got {tuple(q.shape)}")
    lists = [(part.rows, _prefill_rows(part.indices, part.length, part.rows.shape[0]))
             for part in (main, extra) if part is not None]
    for rows, idx in lists:
        if rows.dim() != 2 or rows.shape[1] != D_QK or idx.shape[0] != q.shape[0]:
            raise ValueError(f"rows [N, {D_QK}] and indices [T={q.shape[0]}, K] expected, got "
                             f"{tuple(rows.shape)}, {tuple(idx.shape)}")

    def chunk_keys(chunk: slice) -> tuple[torch.Tensor, torch.Tensor]:
        keys = [rows[idx[chunk].clamp(min=0)].masked_fill_((idx[chunk] < 0)[..., None], 0).to(dtype)
                for rows, idx in lists]
        return torch.cat(keys, dim=1), torch.cat([idx[chunk] >= 0 for _, idx in lists], dim=1)

    width = sum(idx.shape[1] for _, idx in lists)
    chunks = attend_chunks(q, width, chunk_keys, 2 * D_QK + 64, sm_scale, attn_sink, dtype, budget_bytes, magnitudes)
    return collect(chunks, q, dtype)
