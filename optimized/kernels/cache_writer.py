"""The fp8_ds_mla cache writer and reader (spec §3.2): quantize rows, dequantize rows, and write
tokens into a paged cache by slot.

Scale rule per 128-element NoPE tile j, amax_j = max |x| (fp32 from bf16):
    "pow2" (v0.33.0): s_j = 2 ** ceil(log2(max(amax_j / 448, 1e-4)))   e.g. amax 336 -> 1.0,
                      an all-zero tile -> 2**-13
    "raw"  (older):   s_j = max(amax_j / 448, FLT_MIN)
q_i = e4m3fn_rn_satfinite(x_i / s_j), an IEEE fp32 division; RoPE copied verbatim. Every byte
is defined exactly, so these kernels are compared bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_verify.optimized import buffers
from mla_verify.optimized.kernels.kv_formats import (
    FP8_ROW_BYTES,
    HEAD_DIM,
    dequantize_fp8_ds_mla_rows,
    quantize_fp8_ds_mla_rows,
)
from mla_verify.optimized.kernels.launch import native, rows_per_program
from mla_verify.optimized.registry import TRITON, register
from mla_verify.optimized.validation import InputError, check_choice, check_index_range, check_same_device, check_tensor

SCALE_RULES = ("pow2", "raw")


@triton.jit
def _quantize_kernel(
    kv, kv_row_stride, cache, block_stride, slots, n_tokens, block_size,
    HAS_SLOTS: tl.constexpr, POW2: tl.constexpr, NATIVE: tl.constexpr, ROWS: tl.constexpr,
):
    n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    mask = n < n_tokens
    if HAS_SLOTS:
        slot = tl.load(slots + n, mask=mask, other=-1).to(tl.int64)
        mask &= slot >= 0
        dst = cache + (slot // block_size) * block_stride + (slot % block_size) * FP8_ROW_BYTES
    else:
        dst = cache + n.to(tl.int64) * FP8_ROW_BYTES
    quantize_fp8_ds_mla_rows(kv + n.to(tl.int64) * kv_row_stride, dst, mask, POW2, NATIVE)


@triton.jit
def _dequantize_kernel(rows, row_stride, out, n_rows, NATIVE: tl.constexpr, ROWS: tl.constexpr):
    n = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    dequantize_fp8_ds_mla_rows(rows + n * row_stride, out + n * HEAD_DIM, n < n_rows, NATIVE)


def _check_kv(kv: torch.Tensor) -> None:
    check_tensor("kv", kv, dtype=torch.bfloat16, shape=(None, HEAD_DIM.value), last_dim_contiguous=True)


def _launch_quantize(
    kv: torch.Tensor,
    cache: torch.Tensor,
    block_stride: int,
    slots: torch.Tensor | None,
    block_size: int,
    scale_rule: str,
) -> None:
    rows = rows_per_program()
    n_tokens = kv.shape[0]
    _quantize_kernel[(triton.cdiv(n_tokens, rows),)](
        kv, kv.stride(0), cache, block_stride, slots, n_tokens, block_size,
        HAS_SLOTS=slots is not None, POW2=scale_rule == "pow2", NATIVE=native(kv.device), ROWS=rows,
    )


@register("quantize_fp8_ds_mla", "triton", priority=TRITON, devices=("cpu", "cuda"), interpreted_on=("cpu",))
def quantize_fp8_ds_mla(kv: torch.Tensor, scale_rule: str = "pow2") -> torch.Tensor:
    """kv [N, 576] bf16 -> fp8_ds_mla rows [N, 656] uint8 (module docstring: layout and formula).

    kv's rows may be strided; its last dim must be contiguous.
    """
    _check_kv(kv)
    check_choice("scale_rule", scale_rule, SCALE_RULES, "the fp8_ds_mla scale contract")
    out = buffers.empty((kv.shape[0], FP8_ROW_BYTES.value), torch.uint8, kv.device)
    if kv.shape[0]:
        _launch_quantize(kv, out, 0, None, 1, scale_rule)
    return out


@register("dequantize_fp8_ds_mla", "triton", priority=TRITON, devices=("cpu", "cuda"), interpreted_on=("cpu",))
def dequantize_fp8_ds_mla(rows: torch.Tensor) -> torch.Tensor:
    """fp8_ds_mla rows [N, 656] uint8 -> [N, 576] bf16.

    NoPE_i = bf16_rn(float(e4m3 byte i) * scale_{i // 128}) (fp32 multiply, one rounding);
    RoPE = bytes [528, 656) as 64 bf16, bit for bit. rows' last dim must be contiguous.
    """
    check_tensor("rows", rows, dtype=torch.uint8, shape=(None, FP8_ROW_BYTES.value), last_dim_contiguous=True)
    out = buffers.empty((rows.shape[0], HEAD_DIM.value), torch.bfloat16, rows.device)
    if rows.shape[0]:
        n = rows_per_program()
        _dequantize_kernel[(triton.cdiv(rows.shape[0], n),)](
            rows, rows.stride(0), out, rows.shape[0], NATIVE=native(rows.device), ROWS=n
        )
    return out


@register("write_fp8_ds_mla_cache", "triton", priority=TRITON, devices=("cpu", "cuda"), interpreted_on=("cpu",))
def write_fp8_ds_mla_cache(
    kv: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale_rule: str = "pow2",
) -> None:
    """Quantize kv [N, 576] bf16 into kv_cache [NB, BS, 656] uint8 in place (concat_and_cache_mla).

    Token n goes to kv_cache[slot // BS, slot % BS] with slot = slot_mapping[n]; slot < 0 is
    skipped; other rows are untouched. kv_cache.stride(0) may exceed BS * 656 (other layers'
    pages between blocks); stride(1) must be 656. Two tokens with one slot race, as upstream.
    """
    _check_kv(kv)
    check_choice("scale_rule", scale_rule, SCALE_RULES, "the fp8_ds_mla scale contract")
    check_tensor("kv_cache", kv_cache, dtype=torch.uint8, shape=(None, None, FP8_ROW_BYTES.value))
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != FP8_ROW_BYTES.value:
        raise InputError(
            f"kv_cache: token rows must be packed 656-byte rows (stride(1) == 656, stride(2) == 1), "
            f"got strides {kv_cache.stride()}"
        )
    check_tensor("slot_mapping", slot_mapping, dtype=(torch.int32, torch.int64), shape=(kv.shape[0],))
    check_same_device(kv=kv, kv_cache=kv_cache, slot_mapping=slot_mapping)
    num_blocks, block_size = kv_cache.shape[0], kv_cache.shape[1]
    slots = slot_mapping.contiguous()
    # Negative slots are skipped; every other slot must address a cache row.
    check_index_range(
        "slot_mapping", slots, num_blocks * block_size, lower=torch.iinfo(slots.dtype).min
    )
    if kv.shape[0]:
        _launch_quantize(kv, kv_cache, kv_cache.stride(0), slots, block_size, scale_rule)
