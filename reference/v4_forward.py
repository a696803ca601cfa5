"""A DeepSeek V4 decode step end to end: the window's slots built from the positions and the block
table (`v4_indices.window_indices`), then the union attention over the window and the compressed
picks (`union.sparse_decode_union`).

For B requests of S query tokens, request b's tokens at positions[b] - S + 1 .. positions[b], and
V4's window of WINDOW = 128 raw tokens:
    indices[b, s]     = window_indices(token positions, requests, block_table, block_size, WINDOW)
    topk_length[b]    = min(positions[b] + 1, WINDOW)      the request's last token's window
    out, lse          = sparse_decode_union(q, (kv_cache, indices, topk_length), extra list, sink)
An earlier token's shorter window ends in -1 entries within its request's length.
"""

from __future__ import annotations

import torch

from .attention import AttentionResult
from .union import Paged, sparse_decode_union
from .v4_indices import window_indices

WINDOW = 128  # DeepSeek V4's sliding window (its configuration's sliding_window)


def v4_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    positions: torch.Tensor,
    block_table: torch.Tensor,
    sm_scale: float,
    extra: Paged | None = None,
    attn_sink: torch.Tensor | None = None,
    *,
    magnitudes: bool = False,
) -> AttentionResult:
    """q [B, S, H, 512], kv_cache the window's V4 cache, positions [B] each request's last query
    position, block_table [B, M], the extra list (`Paged`). Returns out [B, S, H, 512] and
    lse / max_logits / logit_l1 [B, H, S], in float64."""
    batch, s_q = q.shape[:2]
    token_pos = (positions.long()[:, None] - (s_q - 1) + torch.arange(s_q, device=q.device)).reshape(-1)
    requests = torch.arange(batch, device=q.device).repeat_interleave(s_q)
    indices, lengths = window_indices(token_pos, requests, block_table, kv_cache.shape[1], WINDOW)
    main = Paged(kv_cache, indices.view(batch, s_q, WINDOW), lengths.view(batch, s_q)[:, -1].contiguous())
    return sparse_decode_union(q, main, sm_scale, extra, attn_sink, magnitudes=magnitudes)
