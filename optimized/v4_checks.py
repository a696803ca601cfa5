"""Input checks of the DeepSeek V4 / V4.1 sparse decode contract, shared by every implementation.

The contract: q [B,S,H,512] bf16; kv_cache [NB,BS,W] uint8 with packed token rows; indices
[B,S,K] int32 physical slots; topk_length [B] int32 in [0, K], per request; the extra cache,
extra_indices [B,S,K2] and extra_topk_length [B] likewise (the extra cache and its indices come
together); attn_sink [H] f32. An entry within its request's length is -1 or a slot of its cache
(nothing else: the kernels read it unchecked); an entry past the length is never read and may
hold anything. Each implementation adds its own kernel limits on top.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mla_verify.optimized.v4_formats import BY_WIDTH, D_QK, FORMATS, CacheFormat
from mla_verify.optimized.validation import InputError, check_index_range, check_same_device, check_sm_scale, check_tensor


class ListArgs(NamedTuple):
    """One list of the union as the contract passes it: its cache, its slots, its lengths."""

    cache: torch.Tensor | None
    indices: torch.Tensor | None
    length: torch.Tensor | None = None


def cache_format(name: str, cache: torch.Tensor, allowed: tuple[str, ...]) -> CacheFormat:
    """The format a [NB,BS,W] uint8 cache's width W names, one of `allowed`."""
    check_tensor(name, cache, dtype=torch.uint8, ndim=3, last_dim_contiguous=True)
    fmt = BY_WIDTH.get(cache.shape[2])
    if fmt is None or fmt.name not in allowed or fmt.width != cache.shape[2]:
        widths = ", ".join(f"{FORMATS[a].width} ({a})" for a in allowed)
        raise InputError(f"{name}: rows of {cache.shape[2]} bytes; this op reads {widths}")
    if cache.stride(1) != fmt.width or cache.stride(0) < cache.shape[1] * fmt.width:
        raise InputError(f"{name}: a block's token rows must be packed (stride(1) == {fmt.width}, stride(0) >= "
                         f"{cache.shape[1] * fmt.width}), got strides {cache.stride()}")
    return fmt


def _check_list(name: str, idx: torch.Tensor, length_name: str, length: torch.Tensor | None, cache: torch.Tensor,
                batch: int, seq: int) -> None:
    """indices [B,S,K] int32 with length [B]: every entry within its request's length is -1 or a
    slot of `cache` (past the length: anything)."""
    check_tensor(name, idx, dtype=torch.int32, shape=(batch, seq, None), last_dim_contiguous=True)
    width = idx.shape[2]
    if width < 1:
        raise InputError(f"{name}: top-k width must be >= 1, got shape {tuple(idx.shape)}")
    counted = idx
    if length is not None:
        check_index_range(length_name, length, width + 1)
        past = torch.arange(width, device=idx.device)[None, None, :] >= length[:, None, None]
        counted = idx.masked_fill(past, -1)
    check_index_range(name, counted, cache.shape[0] * cache.shape[1], sentinels=(-1,))


def check_union_decode_contract(
    q: torch.Tensor,
    main: ListArgs,
    extra: ListArgs,
    sm_scale: float,
    attn_sink: torch.Tensor | None,
    pairs: tuple[tuple[str, str | None], ...],
) -> tuple[float, CacheFormat, CacheFormat | None]:
    """The contract (module docstring) with the (main, extra) format pairs the op reads (extra
    None: no extra cache); returns (sm_scale, main format, extra format or None)."""
    check_tensor("q", q, dtype=torch.bfloat16, shape=(None, None, None, D_QK), last_dim_contiguous=True)
    batch, seq, heads, _ = q.shape
    if min(batch, seq, heads) < 1:
        raise InputError(f"q: batch, query tokens and heads must all be >= 1, got shape {tuple(q.shape)}")
    if (extra.cache is None) != (extra.indices is None):
        raise InputError("extra_kv_cache and extra_indices come together (one without the other)")
    if extra.cache is None and extra.length is not None:
        raise InputError("extra_topk_length without an extra cache")
    main_fmt = cache_format("kv_cache", main.cache, tuple({m for m, _ in pairs}))
    extra_fmt = None
    if extra.cache is not None:
        extra_fmt = cache_format("extra_kv_cache", extra.cache,
                                 tuple({e for m, e in pairs if m == main_fmt.name and e}))
    elif (main_fmt.name, None) not in pairs:
        raise InputError(f"kv_cache in {main_fmt.name}: this op needs an extra cache beside it")
    for name, length in (("topk_length", main.length), ("extra_topk_length", extra.length)):
        if length is not None:
            check_tensor(name, length, dtype=torch.int32, shape=(batch,), contiguous=True)
    if attn_sink is not None:
        check_tensor("attn_sink", attn_sink, dtype=torch.float32, shape=(heads,), contiguous=True)
    check_same_device(q=q, kv_cache=main.cache, indices=main.indices, topk_length=main.length,
                      extra_kv_cache=extra.cache, extra_indices=extra.indices, extra_topk_length=extra.length,
                      attn_sink=attn_sink)
    sm_scale = check_sm_scale(sm_scale)
    _check_list("indices", main.indices, "topk_length", main.length, main.cache, batch, seq)
    if extra.cache is not None:
        _check_list("extra_indices", extra.indices, "extra_topk_length", extra.length, extra.cache, batch, seq)
    return sm_scale, main_fmt, extra_fmt


# The (main, extra) pairs of each op: the same format, or V4.1 with the FP4 extra; None: no extra.
V4_PAIRS = (("V4", None), ("V4", "V4"))
V41_PAIRS = (("V41", None), ("V41", "V41"), ("V41", "V41_FP4"))
