"""Where DeepSeek V4's caches keep a token's row in a page, and writing them by slot mapping.

A layer's cache is `[num_blocks, block_size, W]` uint8 (W = data + scale bytes of one token:
584, 528 or 288); slot s is token s % block_size of block s // block_size, and block b's bytes
start at byte b * stride(0) (>= block_size * W: pages may be padded or interleaved with other
layers'). Within a block, two layouts:

    block-major   data rows of all block_size tokens, then their scale rows:
                  data of offset o at o * D, its scales at block_size * D + o * S
    per token     row of offset o at o * W: its D data bytes, then its S scale bytes

    format          W    D    S    layout        who reads it
    V4            584  576    8    block-major   FlashMLA legacy (SM90, SM100), vLLM, FlashInfer
    V41           528  512   16    per token     FlashMLA 2026.09.30 (SM100)
    V41_FP4       288  256   32    per token     the same, extra cache only
    V41_BLOCK     528  512   16    block-major   FlashMLA legacy (SM100)
    V41_FP4_BLOCK 288  256   32    block-major   the same, extra cache only

The two V4.1 layouts hold the same rows and are not interchangeable: a reader of one reads the
other's bytes as other tokens. Allocation pads a block-major block to a multiple of 576 (V4) or
512 bytes, as FlashMLA's tests and vLLM's allocator do. Valid (main, extra) cache pairs for one
attention call: the same format, or V4.1 with V4.1 FP4 (the layouts matching).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .v41_fp4 import DATA_BYTES as FP4_DATA, SCALE_BYTES as FP4_SCALES, fp4_row_values, quantize_fp4_rows
from .v4_rows import D_QK, V4, V41, RowFormat, quantize_rows, row_values


class PageFormat(NamedTuple):
    name: str
    data_bytes: int
    scale_bytes: int
    block_major: bool
    pad_to: int           # an allocated block-major block is padded to a multiple of this
    fp8: RowFormat | None  # the FP8 row format; None: FP4

    @property
    def width(self) -> int:
        return self.data_bytes + self.scale_bytes


FORMATS = {f.name: f for f in (
    PageFormat("V4", V4.data_bytes, V4.scale_bytes, True, 576, V4),
    PageFormat("V41", V41.data_bytes, V41.scale_bytes, False, 1, V41),
    PageFormat("V41_FP4", FP4_DATA, FP4_SCALES, False, 1, None),
    PageFormat("V41_BLOCK", V41.data_bytes, V41.scale_bytes, True, 512, V41),
    PageFormat("V41_FP4_BLOCK", FP4_DATA, FP4_SCALES, True, 512, None),
)}
# The format a cache's width names when none is given: FlashMLA's detection by bytes per token.
BY_WIDTH = {584: "V4", 528: "V41", 288: "V41_FP4"}
VALID_PAIRS = {("V4", "V4"), ("V41", "V41"), ("V41", "V41_FP4"), ("V41_BLOCK", "V41_BLOCK"),
               ("V41_BLOCK", "V41_FP4_BLOCK")}


def page_format(cache: torch.Tensor, name: str | None = None) -> PageFormat:
    """The format of a [NB, BS, W] uint8 cache: `name`, else the one its width W names."""
    if cache.dtype != torch.uint8 or cache.dim() != 3:
        raise ValueError(f"a V4 cache is [num_blocks, block_size, W] uint8, got {tuple(cache.shape)} {cache.dtype}")
    name = name or BY_WIDTH.get(cache.shape[2])
    fmt = FORMATS.get(name or "")
    if fmt is None or fmt.width != cache.shape[2]:
        raise ValueError(f"cache width {cache.shape[2]} with format {name!r}: known {sorted(FORMATS)} "
                         f"(widths {sorted(BY_WIDTH)})")
    if cache.stride(2) != 1 or cache.stride(1) != fmt.width or cache.stride(0) < cache.shape[1] * fmt.width:
        raise ValueError(f"a V4 cache's token rows are packed within a block (strides {cache.stride()})")
    return fmt


def block_bytes(block_size: int, fmt: PageFormat) -> int:
    """The allocated bytes of one block: block_size rows, padded for the block-major layouts."""
    return -(-block_size * fmt.width // fmt.pad_to) * fmt.pad_to


def allocate_cache(num_blocks: int, block_size: int, name: str, fill: int = 0xFF, device="cpu") -> torch.Tensor:
    """A [num_blocks, block_size, W] view of padded blocks, every byte `fill` (0xFF: every value NaN)."""
    fmt = FORMATS[name]
    storage = torch.full((num_blocks, block_bytes(block_size, fmt)), fill, dtype=torch.uint8, device=device)
    return storage.as_strided((num_blocks, block_size, fmt.width), (storage.stride(0), fmt.width, 1))


def byte_offsets(cache: torch.Tensor, fmt: PageFormat, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The byte offsets (from the cache's first byte) of the data and scale parts of `slots`."""
    block_size = cache.shape[1]
    block, offset = slots // block_size, slots % block_size
    base = block * cache.stride(0)
    if fmt.block_major:
        return base + offset * fmt.data_bytes, base + block_size * fmt.data_bytes + offset * fmt.scale_bytes
    row = base + offset * fmt.width
    return row, row + fmt.data_bytes


def flat_bytes(cache: torch.Tensor) -> torch.Tensor:
    """Every byte from the cache's first to its last, as one dimension."""
    last = (cache.shape[0] - 1) * cache.stride(0) + cache.shape[1] * cache.shape[2]
    return cache.as_strided((last,), (1,))


def slot_parts(cache: torch.Tensor, fmt: PageFormat, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(data [..., D], scales [..., S]) uint8 of physical `slots` [...]; a negative slot reads as
    zero bytes (a zero row in every format)."""
    safe = slots.long().clamp(min=0)
    data_at, scale_at = byte_offsets(cache, fmt, safe)
    flat = flat_bytes(cache)
    data = flat[data_at[..., None] + torch.arange(fmt.data_bytes, device=slots.device)]
    scales = flat[scale_at[..., None] + torch.arange(fmt.scale_bytes, device=slots.device)]
    dead = (slots < 0)[..., None]
    return data.masked_fill_(dead, 0), scales.masked_fill_(dead, 0)


def slot_values(cache: torch.Tensor, fmt: PageFormat, slots: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The exact values [..., 512] of the rows at `slots` (zero rows at negative slots)."""
    data, scales = slot_parts(cache, fmt, slots)
    if fmt.fp8 is None:
        return fp4_row_values(data, scales, dtype)
    return row_values(data, scales, fmt.fp8, dtype)


def read_bytes_per_row(fmt: PageFormat) -> int:
    """Temporary bytes `slot_values` holds per row besides the values: the byte offsets (int64)
    and the bytes gathered, the scales' values."""
    return 9 * fmt.width + 8 * 64 + 64


def quantize(kv: torch.Tensor, fmt: PageFormat, scale_rule: str = "pow2") -> tuple[torch.Tensor, torch.Tensor]:
    """[N, 512] bf16 rows -> (data, scales) in `fmt`'s codec (`scale_rule`: the FP8 formats'
    ue8m0 rule; the FP4 scale is e4m3 and has one rule)."""
    if fmt.fp8 is None:
        return quantize_fp4_rows(kv)
    return quantize_rows(kv, fmt.fp8, scale_rule)


def write_v4_cache(
    kv: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale_rule: str = "pow2",
    kv_format: str | None = None,
) -> None:
    """Quantize kv [N, 512] bf16 in the cache's format and write row i at slot slot_mapping[i]
    (in place; a negative slot is a token not written, as CUDA-graph padding)."""
    fmt = page_format(kv_cache, kv_format)
    if kv.dim() != 2 or kv.shape[1] != D_QK or slot_mapping.shape != kv.shape[:1]:
        raise ValueError(f"kv [N, {D_QK}] and slot_mapping [N] expected, got {tuple(kv.shape)}, {tuple(slot_mapping.shape)}")
    slots = slot_mapping.long()
    capacity = kv_cache.shape[0] * kv_cache.shape[1]
    if bool((slots >= capacity).any()):
        raise ValueError(f"slot_mapping has slots >= num_blocks * block_size = {capacity}")
    keep = slots >= 0
    data, scales = quantize(kv[keep], fmt, scale_rule)
    data_at, scale_at = byte_offsets(kv_cache, fmt, slots[keep])
    flat = flat_bytes(kv_cache)
    flat[data_at[:, None] + torch.arange(fmt.data_bytes, device=slots.device)] = data
    flat[scale_at[:, None] + torch.arange(fmt.scale_bytes, device=slots.device)] = scales
