"""DeepSeek V4's serving index builders: the index rows the attention kernels read, built from
positions, block tables and the indexer's top-k.

A request r's query tokens are the last query_len_r = qsl[r+1] - qsl[r] of its seq_len_r tokens,
so its i-th query token sits at position pos = seq_len_r - query_len_r + i. The sliding window
of a token at `pos` holds the last min(pos + 1, window) raw tokens, positions pos - len + 1 .. pos;
the compressed cache holds one entry per `compress_ratio` raw tokens, so a token sees
min((pos + 1) // compress_ratio, topk) of the indexer's picks.

    window_indices           decode's main list (FlashMLA, vLLM): the window's cache slots
    v4_prefill_indices       vLLM's prefill rows over the gathered bf16 buffer
                             (combine_topk_swa_indices)
    flashinfer_decode_table  FlashInfer's one table for a decode token: window, then compressed
    flashinfer_table_as_union  what FlashInfer reads in its table, in FlashMLA's union form

Two conventions meet here (their union attention must agree): FlashMLA takes the window and the
compressed entries as two lists with a length each; FlashInfer takes one table whose first
`window` columns are the window, with a length per token that counts all `window` of them
(whatever the token's position) and a window whose validity it derives from the position.
"""

from __future__ import annotations

import torch

PREFILL_ALIGN = 128  # FlashMLA's prefill walks its list in blocks of 64 or 128
TABLE_ALIGN = 4      # FlashInfer loads the compressed columns 16 bytes at a time


def _slots(block_table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """block_table[rows, p // block_size] * block_size + p % block_size, elementwise."""
    return block_table[rows, positions // block_size].long() * block_size + positions % block_size


def window_indices(
    positions: torch.Tensor,
    req_of_token: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's window as cache slots: (indices [T, window] int32, lengths [T] int32).

    lengths[t] = min(pos_t + 1, window); indices[t, i] = slot of position pos_t - lengths[t] + 1 + i
    for i < lengths[t] (oldest first), -1 after; slot(p) = block_table[r, p // bs] * bs + p % bs.
    """
    pos = positions.long()[:, None]
    lengths = torch.clamp(pos + 1, max=window)
    i = torch.arange(window, device=pos.device)[None, :]
    live = i < lengths
    p = torch.where(live, pos - lengths + 1 + i, 0)
    slots = _slots(block_table, req_of_token.long()[:, None].expand_as(p), p, block_size)
    return torch.where(live, slots, -1).to(torch.int32), lengths[:, 0].to(torch.int32)


def v4_prefill_indices(
    topk_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    gather_lens: torch.Tensor,
    window: int,
    compress_ratio: int,
    topk: int,
    m: int,
    n: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's prefill rows over the gathered buffer, request r owning rows [M r, M r + M): its N
    compressed entries, then its last gather_len_r raw tokens (positions seq_len_r - gather_len_r
    onward). For the token at `pos` of request r (query_start_loc rebased to its first entry):

        k      = min((pos + 1) // compress_ratio, topk)     picks it sees
        w      = min(pos + 1, window)                         its window
        row[j]     = topk_indices[t, j] + M r                  j < k   (local picks, trusted valid)
        row[k + i] = M r + N + pos - w + 1 - (seq_len_r - gather_len_r) + i        i < w
        row[...]   = -1 after;  width ceil((topk + window) / 128) * 128;  lengths[t] = k + w

    Returns (rows [T, width] int32, lengths [T] int32). A pick within k outside [0, N) is refused.
    """
    qsl = query_start_loc.long() - query_start_loc[0].long()
    reqs = seq_lens.shape[0]
    query_lens = qsl[1:] - qsl[:-1]
    tokens = int(qsl[-1])
    req = torch.repeat_interleave(torch.arange(reqs, device=qsl.device), query_lens, output_size=tokens)
    pos = seq_lens.long()[req] - query_lens[req] + torch.arange(tokens, device=qsl.device) - qsl[req]
    k = torch.clamp((pos + 1) // compress_ratio, max=topk)
    w = torch.clamp(pos + 1, max=window)
    width = -(-(topk + window) // PREFILL_ALIGN) * PREFILL_ALIGN
    j = torch.arange(width, device=qsl.device)[None, :]
    picks = topk_indices[:tokens, :topk].long()  # no token sees more than topk picks
    in_picks = j[:, :picks.shape[1]] < k[:, None]
    bad = in_picks & ((picks < 0) | (picks >= n))
    if bool(bad.any()):
        t, col = bad.nonzero()[0].tolist()
        raise ValueError(f"token {t}'s pick {col} is {int(picks[t, col])}: within its {int(k[t])} picks, "
                         f"outside the request's {n} compressed entries")
    base = (m * req)[:, None]
    rows = torch.full((tokens, width), -1, dtype=torch.long, device=qsl.device)
    rows[:, :picks.shape[1]] = torch.where(in_picks, picks + base, -1)
    first = base + n + pos[:, None] - w[:, None] + 1 - (seq_lens.long() - gather_lens.long())[req][:, None]
    i = j - k[:, None]
    rows = torch.where((i >= 0) & (i < w[:, None]), first + i, rows)
    return rows.to(torch.int32), (k + w).to(torch.int32)


def flashinfer_decode_table(
    window_slots: torch.Tensor,
    compressed_slots: torch.Tensor,
    compressed_lens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's table for decode tokens: window_slots [T, W] (`window_indices`), compressed
    slots [T, K] (global, -1 invalid), compressed_lens [T] (None: all K count).

        table[t, :W]         = window_slots[t]
        table[t, W + j]      = compressed_slots[t, j]        j < K;  -1 for K <= j < ceil4(K)
        lengths[t]           = W + compressed_lens[t]        the window counted whole
    """
    tokens, window = window_slots.shape
    k = compressed_slots.shape[1]
    table = torch.full((tokens, window + -(-k // TABLE_ALIGN) * TABLE_ALIGN), -1, dtype=torch.int32,
                       device=window_slots.device)
    table[:, :window] = window_slots
    table[:, window:window + k] = compressed_slots
    counted = torch.full((tokens,), k, device=table.device) if compressed_lens is None else compressed_lens.long()
    return table, (window + counted).to(torch.int32)


def flashinfer_table_as_union(
    table: torch.Tensor, lengths: torch.Tensor, positions: torch.Tensor, window: int
) -> dict[str, torch.Tensor]:
    """What FlashInfer's decode attends to, as FlashMLA's union with each token its own request
    (B = T, S = 1): the window columns i < min(pos_t + 1, window) (validity from the position),
    then the compressed columns j < lengths[t] - window.

    Returns the `sparse_decode_v4` keyword arguments indices [T, 1, W], topk_length [T],
    extra_indices [T, 1, K'], extra_topk_length [T]."""
    return {
        "indices": table[:, None, :window],
        "topk_length": torch.clamp(positions.long() + 1, max=window).to(torch.int32),
        "extra_indices": table[:, None, window:],
        "extra_topk_length": (lengths.long() - window).to(torch.int32),
    }
