"""DeepSeek V4 / V4.1 decode cases for the tests: caches where every slot that no counted entry
selects is poisoned (all bytes 0xFF: NaN in every format), so a kernel reading one shows NaN."""

from __future__ import annotations

import math

import torch

from mla_verify import reference as R


def _lengths(g: torch.Generator, kind: str, batch: int, width: int) -> torch.Tensor | None:
    if kind == "none":
        return None
    if kind == "edges":  # 0, 1 and the full width
        return torch.tensor([0, 1, width], dtype=torch.int32)[torch.randint(0, 3, (batch,), generator=g)]
    return torch.randint(0, width + 1, (batch,), generator=g, dtype=torch.int32)


def _list(g, batch, s_q, width, capacity, lengths, invalid_rate):
    """Distinct slots per query row (fewer than `width` slots: -1 tails), -1 at random positions,
    and past each request's length: slots of the cache's spare last block (poisoned, never counted)."""
    rows = []
    for _ in range(batch * s_q):
        perm = torch.randperm(capacity, generator=g)[:width]
        rows.append(torch.cat([perm, torch.full((width - perm.numel(),), -1)]))
    idx = torch.stack(rows).view(batch, s_q, width)
    idx = idx.masked_fill(torch.rand(idx.shape, generator=g) < invalid_rate, -1)
    if lengths is not None:
        past = torch.arange(width)[None, None, :] >= lengths.long()[:, None, None]
        idx = idx.masked_fill(past, capacity)  # the spare block's first slot
    return idx.to(torch.int32)


def _cache(g, fmt, blocks, block, idx, lengths, scale_rule, gap):
    """A cache of `blocks` + 1 blocks (the last spare, poisoned) where only counted slots hold
    rows; `gap` more bytes between blocks than the allocation's padding (other layers' pages)."""
    width = R.page_format(R.allocate_cache(1, 1, fmt)).width
    stride = R.allocate_cache(1, block, fmt).stride(0) + gap
    storage = torch.full(((blocks + 1) * stride,), 0xFF, dtype=torch.uint8)
    cache = storage.as_strided((blocks + 1, block, width), (stride, width, 1))
    counted = idx.long()
    if lengths is not None:
        counted = counted.masked_fill(torch.arange(idx.shape[2])[None, None, :] >= lengths.long()[:, None, None], -1)
    slots = counted[counted >= 0].unique()
    values = (torch.randn(slots.numel(), 512, generator=g) * torch.exp(torch.randn(slots.numel(), 1, generator=g)))
    R.write_v4_cache(values.bfloat16(), cache, slots, scale_rule, kv_format=fmt)
    return cache


def decode_case(seed: int, *, fmt="V4", extra_fmt="V4", batch=2, s_q=1, heads=16, topk=32, extra_topk=24,
                block=16, extra_block=5, lengths="random", extra_lengths="random", invalid_rate=0.1,
                sink="finite", scale_rule="pow2", sm_scale=512**-0.5, gap=0) -> dict:
    """The keyword arguments of a union decode call (`extra_fmt` None: no extra cache)."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-topk // block) + 1
    length = _lengths(g, lengths, batch, topk)
    idx = _list(g, batch, s_q, topk, blocks * block, length, invalid_rate)
    kw = {"q": torch.randn(batch, s_q, heads, 512, generator=g).bfloat16(),
          "kv_cache": _cache(g, fmt, blocks, block, idx, length, scale_rule, gap),
          "indices": idx, "sm_scale": sm_scale, "topk_length": length,
          "extra_kv_cache": None, "extra_indices": None, "extra_topk_length": None, "attn_sink": None}
    if extra_fmt is not None:
        xblocks = -(-extra_topk // extra_block) + 1
        xlength = _lengths(g, extra_lengths, batch, extra_topk)
        xidx = _list(g, batch, s_q, extra_topk, xblocks * extra_block, xlength, invalid_rate)
        kw.update(extra_kv_cache=_cache(g, extra_fmt, xblocks, extra_block, xidx, xlength, scale_rule, gap),
                  extra_indices=xidx, extra_topk_length=xlength)
    if sink != "none":
        s = torch.randn(heads, generator=g)
        if sink == "inf":
            s[0], s[-1] = math.inf, -math.inf
        kw["attn_sink"] = s
    return kw
