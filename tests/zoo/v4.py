"""Broken DeepSeek V4 kernels and index builders: the reference with one defect each, of the kinds
upstream's V4 plumbing has met, returning what a kernel returns (bf16 output, fp32 LSE; int32
index rows)."""

from __future__ import annotations

import torch

from mla_verify import reference
from mla_verify.reference import v4_pages


def _as_kernel(res):
    return res.out.float().to(torch.bfloat16), res.lse.float()


def _decode(q, kv_cache, indices, sm_scale, topk_length=None, extra_kv_cache=None, extra_indices=None,
            extra_topk_length=None, attn_sink=None):
    return _as_kernel(reference.sparse_decode_v4(q, kv_cache, indices, sm_scale, topk_length, extra_kv_cache,
                                                    extra_indices, extra_topk_length, attn_sink))


def lengths_per_token(q, kv_cache, indices, sm_scale, topk_length=None, extra_kv_cache=None, extra_indices=None,
                      extra_topk_length=None, attn_sink=None):
    """The per-request lengths read per query token: row b*S + s takes lengths[b*S + s] (the last
    request's past the end), as a kernel written for FlashInfer's per-token lengths would."""
    batch, s_q = q.shape[:2]
    rows = torch.arange(batch * s_q, device=q.device).clamp(max=batch - 1)

    def per_token(length):
        return None if length is None else length[rows]

    flat = lambda t: None if t is None else t.reshape(batch * s_q, 1, *t.shape[2:])  # noqa: E731
    out, lse = _decode(flat(q), kv_cache, flat(indices), sm_scale, per_token(topk_length), extra_kv_cache,
                       flat(extra_indices), per_token(extra_topk_length), attn_sink)
    return out.view(q.shape), lse.view(batch, s_q, -1).transpose(1, 2)


def extra_walked_to_main_topk(q, kv_cache, indices, sm_scale, topk_length=None, extra_kv_cache=None,
                              extra_indices=None, extra_topk_length=None, attn_sink=None):
    """Dispatch keyed on the main top-k: the extra list is walked for as many entries as the
    main list has, so extra entries past the main top-k are dropped."""
    if extra_indices is not None and extra_indices.shape[2] > indices.shape[2]:
        extra_indices = extra_indices.clone()
        extra_indices[..., indices.shape[2]:] = -1
    return _decode(q, kv_cache, indices, sm_scale, topk_length, extra_kv_cache, extra_indices, extra_topk_length,
                   attn_sink)


def drops_partial_extra_block(q, kv_cache, indices, sm_scale, topk_length=None, extra_kv_cache=None,
                              extra_indices=None, extra_topk_length=None, attn_sink=None):
    """The extra list walked in whole 64-entry blocks, rounding down: a partial last block is lost."""
    if extra_indices is not None and extra_indices.shape[2] % 64:
        extra_indices = extra_indices.clone()
        extra_indices[..., extra_indices.shape[2] // 64 * 64:] = -1
    return _decode(q, kv_cache, indices, sm_scale, topk_length, extra_kv_cache, extra_indices, extra_topk_length,
                   attn_sink)


def _rewritten(cache: torch.Tensor, rewrite) -> torch.Tensor:
    """A copy of `cache` whose every row is rewritten by `rewrite(data, scales) -> (data, scales)`."""
    fmt = v4_pages.page_format(cache)
    slots = torch.arange(cache.shape[0] * cache.shape[1], device=cache.device)
    data, scales = v4_pages.slot_parts(cache, fmt, slots)
    data, scales = rewrite(data, scales)
    copy = torch.empty_strided(cache.shape, cache.stride(), dtype=cache.dtype, device=cache.device).copy_(cache)
    flat = v4_pages.flat_bytes(copy)
    data_at, scale_at = v4_pages.byte_offsets(copy, fmt, slots)
    flat[data_at[:, None] + torch.arange(fmt.data_bytes, device=cache.device)] = data
    flat[scale_at[:, None] + torch.arange(fmt.scale_bytes, device=cache.device)] = scales
    return copy


def fp4_nibbles_swapped(q, kv_cache, indices, sm_scale, topk_length=None, extra_kv_cache=None, extra_indices=None,
                        extra_topk_length=None, attn_sink=None):
    """The FP4 extra cache read with the even element in the high nibble."""
    if extra_kv_cache is not None and v4_pages.page_format(extra_kv_cache).fp8 is None:
        extra_kv_cache = _rewritten(extra_kv_cache, lambda d, s: ((d >> 4) | (d << 4), s))
    return _decode(q, kv_cache, indices, sm_scale, topk_length, extra_kv_cache, extra_indices, extra_topk_length,
                   attn_sink)


def scale_tile_off_by_one(q, kv_cache, indices, sm_scale, topk_length=None, extra_kv_cache=None, extra_indices=None,
                          extra_topk_length=None, attn_sink=None):
    """Each tile dequantized with the next tile's scale (the last keeps its own): tile index
    d // tile + 1 where the row's layout says d // tile."""
    def shifted(cache):
        fmt = v4_pages.page_format(cache)
        tiles = fmt.fp8.quantized // fmt.fp8.tile if fmt.fp8 is not None else fmt.scale_bytes

        def rewrite(d, s):
            s = s.clone()
            s[:, :tiles - 1] = s[:, 1:tiles].clone()
            return d, s

        return _rewritten(cache, rewrite)

    extra = None if extra_kv_cache is None else shifted(extra_kv_cache)
    return _decode(q, shifted(kv_cache), indices, sm_scale, topk_length, extra, extra_indices, extra_topk_length,
                   attn_sink)


def window_forced_full(topk_indices, query_start_loc, seq_lens, gather_lens, window, compress_ratio, topk, m, n):
    """The window's length taken as `window` for every token, short sequences too: rows hold
    positions before the sequence's first token (the previous request's buffer rows)."""
    rows, lengths = reference.v4_prefill_indices(topk_indices, query_start_loc, seq_lens, gather_lens, window,
                                                 compress_ratio, topk, m, n)
    qsl = query_start_loc.long() - query_start_loc[0].long()
    query_lens = qsl[1:] - qsl[:-1]
    req = torch.repeat_interleave(torch.arange(seq_lens.shape[0], device=qsl.device), query_lens)
    pos = seq_lens.long()[req] - query_lens[req] + torch.arange(req.shape[0], device=qsl.device) - qsl[req]
    k = torch.clamp((pos + 1) // compress_ratio, max=topk)
    short = (pos + 1 < window)
    first = m * req + n + pos - window + 1 - (seq_lens.long() - gather_lens.long())[req]
    j = torch.arange(rows.shape[1], device=rows.device)[None, :] - k[:, None]
    forced = (j >= 0) & (j < window) & short[:, None]
    rows = torch.where(forced, (first[:, None] + j).to(rows.dtype), rows)
    return rows, torch.where(short, k + window, lengths.long()).to(torch.int32)


def lengths_exclude_window(window_slots, compressed_slots, compressed_lens):
    """FlashInfer's table with lengths that leave out the window (the compressed count alone):
    the kernel then reads the window and drops the compressed entries."""
    table, lengths = reference.flashinfer_decode_table(window_slots, compressed_slots, compressed_lens)
    return table, lengths - window_slots.shape[1]


def window_unclamped(positions, req_of_token, block_table, block_size, window):
    """The window taken whole for every token, its start never clamped at position 0: a short
    sequence's window repeats position 0 (an eager stand-in for reading before the sequence)."""
    pos = positions.long()[:, None]
    p = (pos - window + 1 + torch.arange(window, device=pos.device)[None, :]).clamp(min=0)
    slots = block_table[req_of_token.long()[:, None].expand_as(p), p // block_size].long() * block_size + p % block_size
    return slots.to(torch.int32), torch.full_like(positions, window, dtype=torch.int32)
