"""A DeepSeek V4 decode step composed of the registry's stages, as serving composes them:
`window_indices` builds each token's window of WINDOW = 128 raw tokens from the positions and the
block table, then `sparse_decode_v4` attends over that window and the compressed picks
(`reference.v4_forward` is the same step, exactly). Replacing a stage is a dictionary update
(`registry.resolve(..., overrides=...)`)."""

from __future__ import annotations

from typing import Callable

import torch

from mla_verify.optimized import registry
from mla_verify.optimized.registry import Resolved

STAGES = ("window_indices", "sparse_decode_v4")
WINDOW = 128  # DeepSeek V4's sliding window


def v4_step(stages: Resolved | None = None) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The decode step with `stages` (default: the registry's preferred ones on the inputs' device)."""

    def v4_decode(
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        positions: torch.Tensor,
        block_table: torch.Tensor,
        sm_scale: float,
        extra_kv_cache: torch.Tensor | None = None,
        extra_indices: torch.Tensor | None = None,
        extra_topk_length: torch.Tensor | None = None,
        attn_sink: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B,S,H,512] bf16; kv_cache [NB,BS,584] the window's cache; positions [B] int32 each
        request's last query position; block_table [B,M] int32; the extra cache, its [B,S,K2]
        slots and [B] lengths; attn_sink [H]. Returns (out [B,S,H,512] bf16, lse [B,H,S] f32)."""
        chosen = stages or registry.resolve(STAGES, q.device.type)
        batch, s_q = q.shape[:2]
        token_pos = (positions.long()[:, None] - (s_q - 1) + torch.arange(s_q, device=q.device)).reshape(-1)
        requests = torch.arange(batch, device=q.device).repeat_interleave(s_q)
        indices, lengths = chosen.fn("window_indices")(positions=token_pos, req_of_token=requests,
                                                       block_table=block_table, block_size=kv_cache.shape[1],
                                                       window=WINDOW)
        # FlashMLA's lengths are per request: the last token's window, the longest of the request's.
        return chosen.fn("sparse_decode_v4")(
            q=q, kv_cache=kv_cache, indices=indices.view(batch, s_q, WINDOW), sm_scale=sm_scale,
            topk_length=lengths.view(batch, s_q)[:, -1].contiguous(), extra_kv_cache=extra_kv_cache,
            extra_indices=extra_indices, extra_topk_length=extra_topk_length, attn_sink=attn_sink)

    return v4_decode


v4_decode = v4_step()
