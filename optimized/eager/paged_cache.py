"""The paged quantized cache [NB, BS, W]: its checks, slot coordinates, the fp8 writer, and the
up-convert of its rows (either format, told apart by width) that attention and the workspace read.

Slot s lives at cache[s // BS, s % BS]; blocks may lie further apart than BS rows (stride(0) is
free), but the rows of one block are contiguous.
"""

from __future__ import annotations

import torch

from ..validation import InputError, check_index_range, check_same_device, check_tensor
from .common import HEAD, NOPE, stage
from .fp8_ds_mla import FP8_ROW, fp8_nope, fp8_rope, quantize_fp8_ds_mla
from .nvfp4_ds_mla import NVFP4_ROW, nvfp4_nope, nvfp4_rope

# Row width -> (NoPE, RoPE) readers.
ROW_FORMATS = {FP8_ROW: (fp8_nope, fp8_rope), NVFP4_ROW: (nvfp4_nope, nvfp4_rope)}
# Intermediates of decoding one cache row: its bytes, int64 table indices, float32 values.
DECODE_BYTES_PER_ROW = FP8_ROW + 8 * NOPE + 8 * HEAD


def check_paged_cache(kv_cache: object, width: int) -> None:
    """[NB, BS, width] uint8 whose rows are contiguous within a block (stride(0) is free)."""
    check_tensor("kv_cache", kv_cache, dtype=torch.uint8, shape=(None, None, width))
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != width:
        raise InputError(f"kv_cache: rows of a block must be contiguous, got strides {kv_cache.stride()}")


def slot_coords(kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical slots (block * BS + offset) -> (block, offset) indices into the paged cache."""
    slots = slots.long()
    return slots // kv_cache.shape[1], slots % kv_cache.shape[1]


def row_values(rows: torch.Tensor) -> torch.Tensor:
    """Quantized rows [..., W] -> their float32 values [..., 576], what attention reads."""
    nope, rope = ROW_FORMATS[rows.shape[-1]]
    return torch.cat([nope(rows), rope(rows).float()], dim=-1)


def write_bf16(out: torch.Tensor, rows: torch.Tensor) -> None:
    """out [n, 576] bf16 <- quantized rows [n, W] as the readers up-convert them: NoPE rounded to
    bf16 from float32, RoPE exact."""
    nope, rope = ROW_FORMATS[rows.shape[-1]]
    out[:, :NOPE] = nope(rows)
    out[:, NOPE:] = rope(rows)


@stage("write_fp8_ds_mla_cache")
def write_fp8_ds_mla_cache(
    kv: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, scale_rule: str = "pow2"
) -> None:
    """cache[slot // BS, slot % BS] = quantize(kv[i]) for every slot_mapping[i] >= 0 (in place)."""
    check_tensor("kv", kv, dtype=torch.bfloat16, shape=(None, HEAD))
    check_paged_cache(kv_cache, FP8_ROW)
    check_tensor("slot_mapping", slot_mapping, dtype=(torch.int32, torch.int64), shape=(kv.shape[0],))
    check_same_device(kv=kv, kv_cache=kv_cache, slot_mapping=slot_mapping)
    written = slot_mapping >= 0  # negative slots: tokens that are not cached (CUDA-graph padding)
    slots = slot_mapping[written]
    check_index_range("slot_mapping", slots, kv_cache.shape[0] * kv_cache.shape[1])
    kv_cache[slot_coords(kv_cache, slots)] = quantize_fp8_ds_mla(kv[written], scale_rule)
