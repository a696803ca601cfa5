"""The paged KV cache: writing rows by slot mapping, and the flat row view the kernels index.

A layer's cache is `[num_blocks, block_size, W]` (W = 576 bf16 elements, or 656 / 352 bytes).
A token's slot is `block * block_size + offset`; it lives at `cache[block, offset]`. Blocks may be
further apart than `block_size * W` (`stride(0)` larger: other layers' pages sit in between), so
the flat row of slot (block, offset) is `block * block_stride_rows + offset`, with
`block_stride_rows = stride(0) // W`.
"""

from __future__ import annotations

import torch

from .fp8_ds_mla import quantize_fp8_ds_mla
from .nvfp4_ds_mla import quantize_nvfp4_ds_mla


def scatter_rows(rows: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache[slot // BS, slot % BS] = rows[i] for every i with slot_mapping[i] >= 0 (in place).

    Negative slots are tokens that are not written (CUDA-graph padding).
    """
    block_size = kv_cache.shape[1]
    slots = slot_mapping.long()
    capacity = kv_cache.shape[0] * block_size
    if bool((slots >= capacity).any()):
        raise ValueError(f"slot_mapping has slots >= num_blocks * block_size = {capacity}")
    keep = slots >= 0
    kv_cache[slots[keep] // block_size, slots[keep] % block_size] = rows[keep]


def write_fp8_ds_mla_cache(
    kv: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, scale_rule: str = "pow2"
) -> None:
    """fp8_ds_mla cache: quantize each row (`reference.fp8_ds_mla`), then scatter."""
    scatter_rows(quantize_fp8_ds_mla(kv, scale_rule), kv_cache, slot_mapping)


def write_nvfp4_ds_mla_cache(
    kv: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, scale_rounding: str = "up"
) -> None:
    """nvfp4_ds_mla cache: quantize each row (`reference.nvfp4_ds_mla`), then scatter."""
    scatter_rows(quantize_nvfp4_ds_mla(kv, scale_rounding), kv_cache, slot_mapping)


def flat_kv_row_view(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`[num_blocks, BS, W]` -> (`[(num_blocks - 1) * stride_rows + BS, W]` rows, stride_rows).

    Rows between blocks belong to other layers: they are in the view but never addressed.
    """
    num_blocks, block_size, width = kv_cache.shape
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != width or kv_cache.stride(0) % width:
        raise ValueError(
            f"a paged cache must have contiguous rows and whole-row block strides, got strides "
            f"{kv_cache.stride()} for shape {tuple(kv_cache.shape)}"
        )
    stride_rows = kv_cache.stride(0) // width
    num_rows = (num_blocks - 1) * stride_rows + block_size
    rows = kv_cache.as_strided((num_rows, width), (width, 1))
    return rows, stride_rows
