"""Broken gather/up-convert kernels."""

import torch

from mla_verify import reference
from mla_verify.reference import fp8_ds_mla as F8
from mla_verify.reference.workspace import workspace_rows_to_cache


def one_scale_per_row(kv_cache, block_table, workspace_starts, num_rows):
    """vLLM #48611: the 656-byte row dequantized with one scale (tile 0's) for all 512 values."""
    rows = workspace_rows_to_cache(kv_cache, block_table, workspace_starts, num_rows).clone()
    scales = rows[:, F8.SCALE_OFFSET:F8.ROPE_OFFSET].contiguous().view(torch.float32)
    rows[:, F8.SCALE_OFFSET:F8.ROPE_OFFSET] = scales[:, :1].expand(-1, 4).contiguous().view(torch.uint8)
    return F8.dequantize_fp8_ds_mla(rows)


def request_by_strict_start(kv_cache, block_table, workspace_starts, num_rows):
    """Row -> request by the last start strictly below the row: a request's first row goes to the
    previous request (at token seq_len of that request)."""
    starts = workspace_starts.long()
    w = torch.arange(num_rows, device=starts.device)
    r = (torch.searchsorted(starts, w, right=False) - 1).clamp(min=0)
    tok = w - starts[r]
    bs = kv_cache.shape[1]
    blocks = block_table.long()[r, (tok // bs).clamp(max=block_table.shape[1] - 1)]
    return F8.dequantize_fp8_ds_mla(kv_cache[blocks, tok % bs])


def ignores_block_stride(kv_cache, block_table, workspace_starts, num_rows):
    """vLLM #47493 class: a flat-row reader that assumes blocks are block_size rows apart."""
    starts = workspace_starts.long()
    w = torch.arange(num_rows, device=starts.device)
    r = torch.searchsorted(starts, w, right=True) - 1
    tok = w - starts[r]
    bs = kv_cache.shape[1]
    flat = kv_cache.as_strided((kv_cache.shape[0] * bs, kv_cache.shape[2]), (kv_cache.shape[2], 1))
    return F8.dequantize_fp8_ds_mla(flat[block_table.long()[r, tok // bs] * bs + tok % bs])


def request_by_first_equal_start(kv_cache, block_table, workspace_starts, num_rows):
    """Row -> request by a binary search for the leftmost start <= the row: where a zero-length
    request repeats the next one's start (vLLM pads request slots so, #51486), that request's
    first row goes to the empty request, read through its (unused) block-table row. Right while
    every request holds a row."""
    starts = workspace_starts.long()
    w = torch.arange(num_rows, device=starts.device)
    r = torch.searchsorted(starts, w, right=False)
    r = torch.where((r < len(starts)) & (starts[r.clamp(max=len(starts) - 1)] == w), r, r - 1)
    tok = w - starts[r]
    bs = kv_cache.shape[1]
    return F8.dequantize_fp8_ds_mla(kv_cache[block_table.long()[r, tok // bs], tok % bs])
