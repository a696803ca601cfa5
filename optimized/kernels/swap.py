"""hisparse_gather_compact: copy listed host rows into hot-cache rows, byte for byte.

One program per listed row: dst[dst_rows[i], :] = src[src_rows[i], :], over the row's bytes (a
bf16 row of 576 elements or an fp8_ds_mla row of 656 bytes alike). On CUDA the host cache is in
pinned memory the kernel cannot address, so only the listed host rows are copied to the device
first (asynchronously, through a pinned staging buffer) and the kernel scatters them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_verify.optimized.kernels.launch import check_launchable
from mla_verify.optimized.registry import TRITON, register
from mla_verify.optimized.validation import InputError, check_index_range, check_tensor


@triton.jit
def _copy_rows_kernel(src, src_rows, dst, dst_rows, ROW_BYTES: tl.constexpr, TILE: tl.constexpr):
    i = tl.program_id(0)
    s = tl.load(src_rows + i).to(tl.int64) * ROW_BYTES
    d = tl.load(dst_rows + i).to(tl.int64) * ROW_BYTES
    b = tl.arange(0, TILE)
    tl.store(dst + d + b, tl.load(src + s + b, mask=b < ROW_BYTES), mask=b < ROW_BYTES)


@register("hisparse_swap_in", "triton", priority=TRITON, devices=("cpu", "cuda"), interpreted_on=("cpu",))
def hisparse_swap_in(host_rows: torch.Tensor, gpu_rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """A copy of the slab [G, W] with host_rows[src[i]] written to row dst[i] (one program per row)."""
    check_tensor("gpu_rows", gpu_rows, dtype=(torch.bfloat16, torch.uint8), ndim=2)
    check_tensor("host_rows", host_rows, dtype=gpu_rows.dtype, ndim=2)
    if host_rows.shape[1] != gpu_rows.shape[1] or src.shape != dst.shape:
        raise InputError(f"rows of {host_rows.shape[1]} and {gpu_rows.shape[1]} elements, or {src.shape} sources for {dst.shape} rows")
    check_index_range("src", src, host_rows.shape[0])
    check_index_range("dst", dst, gpu_rows.shape[0])
    out = gpu_rows.contiguous().clone()
    if not len(src):
        return out
    if host_rows.device != gpu_rows.device:
        picked = torch.empty((len(src), host_rows.shape[1]), dtype=host_rows.dtype, pin_memory=True)
        torch.index_select(host_rows, 0, src.cpu(), out=picked)
        host_rows, src = picked.to(gpu_rows.device, non_blocking=True), torch.arange(len(src), device=gpu_rows.device)
    check_launchable(out.device)
    row_bytes = out.shape[1] * out.element_size()
    _copy_rows_kernel[(len(src),)](host_rows.contiguous().view(torch.uint8), src.contiguous(), out.view(torch.uint8),
                                   dst.contiguous(), ROW_BYTES=row_bytes, TILE=triton.next_power_of_2(row_bytes))
    return out
