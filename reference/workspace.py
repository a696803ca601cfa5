"""Gather + up-convert: the quantized cache of a prefill chunk into the BF16 workspace.

`cp_gather_and_upconvert_fp8_kv_cache` (and its nvfp4 twin) fill `num_rows` workspace rows; the
request of row w is found from the chunk's workspace starts, not from its sequence lengths:
    r   = max{i : workspace_starts[i] <= w}
    tok = w - workspace_starts[r]
    row = kv_cache[block_table[r, tok // BS], tok % BS]   ->  dequantized to bf16
so request r's rows [starts[r], starts[r] + seq_len_r) hold its tokens 0 .. seq_len_r - 1 (the
whole sequence, context and this step's tokens). The kernel has no guard on `tok`: callers size
the workspace to exactly the chunk's total length.
"""

from __future__ import annotations

import torch

from .fp8_ds_mla import ROW_BYTES as FP8_ROW_BYTES, dequantize_fp8_ds_mla
from .nvfp4_ds_mla import ROW_BYTES as NVFP4_ROW_BYTES, dequantize_nvfp4_ds_mla


def workspace_rows_to_cache(
    kv_cache: torch.Tensor, block_table: torch.Tensor, workspace_starts: torch.Tensor, num_rows: int
) -> torch.Tensor:
    """The cache row each of the `num_rows` workspace rows is gathered from, as [num_rows, W]."""
    starts = workspace_starts.long()
    if starts.numel() == 0 or int(starts[0]) != 0 or bool((starts[1:] < starts[:-1]).any()):
        raise ValueError(f"workspace_starts must be ascending from 0, got {starts.tolist()}")
    block_size = kv_cache.shape[1]
    w = torch.arange(num_rows, device=starts.device)
    r = torch.searchsorted(starts, w, right=True) - 1
    tok = w - starts[r]
    blocks = tok // block_size
    if bool((blocks >= block_table.shape[1]).any()):
        raise ValueError("a workspace row maps past its request's block table: num_rows is too large")
    block_ids = block_table.long()[r, blocks]
    if bool(((block_ids < 0) | (block_ids >= kv_cache.shape[0])).any()):
        raise ValueError(f"block_table entries used by the chunk must be in [0, {kv_cache.shape[0]})")
    return kv_cache[block_ids, tok % block_size]


def gather_upconvert_fp8(
    kv_cache: torch.Tensor, block_table: torch.Tensor, workspace_starts: torch.Tensor, num_rows: int
) -> torch.Tensor:
    """[NB, BS, 656] fp8_ds_mla cache -> [num_rows, 576] bf16 workspace (readers' dequantization)."""
    if kv_cache.dtype != torch.uint8 or kv_cache.shape[-1] != FP8_ROW_BYTES:
        raise ValueError(f"kv_cache must be [NB, BS, {FP8_ROW_BYTES}] uint8, got {tuple(kv_cache.shape)} {kv_cache.dtype}")
    return dequantize_fp8_ds_mla(workspace_rows_to_cache(kv_cache, block_table, workspace_starts, num_rows))


def gather_upconvert_nvfp4(
    kv_cache: torch.Tensor, block_table: torch.Tensor, workspace_starts: torch.Tensor, num_rows: int
) -> torch.Tensor:
    """[NB, BS, 352] nvfp4_ds_mla cache -> [num_rows, 576] bf16 workspace."""
    if kv_cache.dtype != torch.uint8 or kv_cache.shape[-1] != NVFP4_ROW_BYTES:
        raise ValueError(f"kv_cache must be [NB, BS, {NVFP4_ROW_BYTES}] uint8, got {tuple(kv_cache.shape)} {kv_cache.dtype}")
    return dequantize_nvfp4_ds_mla(workspace_rows_to_cache(kv_cache, block_table, workspace_starts, num_rows))
