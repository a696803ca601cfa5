"""Gather a prefill chunk's KV rows out of the paged quantized cache into a bf16 workspace and
dequantize them (cp_gather_and_upconvert_{fp8,nvfp4}_kv_cache, spec §4).

Workspace row w belongs to request r = max{i : workspace_starts[i] <= w} and holds its token
tok = w - workspace_starts[r], read from kv_cache[block_table[r, tok // BS], tok % BS]. Every
output value is defined exactly (kv_formats), so these kernels are compared bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mla_verify.optimized import buffers
from mla_verify.optimized.kernels.kv_formats import (
    FP8_ROW_BYTES,
    HEAD_DIM,
    NVFP4_ROW_BYTES,
    dequantize_fp8_ds_mla_rows,
    dequantize_nvfp4_ds_mla_rows,
)
from mla_verify.optimized.kernels.launch import native, rows_per_program
from mla_verify.optimized.registry import TRITON, register
from mla_verify.optimized.validation import InputError, check_index_range, check_same_device, check_tensor


@triton.jit
def _gather_kernel(
    cache, block_stride, block_table, bt_stride, starts, out, num_rows, num_requests, block_size,
    SEARCH_STEPS: tl.constexpr, NVFP4: tl.constexpr, NATIVE: tl.constexpr, ROWS: tl.constexpr,
):
    w = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    mask = w < num_rows
    # Binary search for the last start <= w. Invariant: starts[lo] <= w (starts[0] == 0) and
    # hi == num_requests or starts[hi] > w; SEARCH_STEPS = ceil(log2(num_requests)) halvings
    # leave hi == lo + 1.
    lo = tl.zeros([ROWS], tl.int32)
    hi = tl.full([ROWS], num_requests, tl.int32)
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        go = tl.load(starts + mid, mask=mask, other=0) <= w
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    tok = w - tl.load(starts + lo, mask=mask, other=0)
    blk = tl.load(block_table + lo.to(tl.int64) * bt_stride + tok // block_size, mask=mask, other=0)
    if NVFP4:
        row_bytes = NVFP4_ROW_BYTES
    else:
        row_bytes = FP8_ROW_BYTES
    src = cache + blk.to(tl.int64) * block_stride + (tok % block_size) * row_bytes
    dst = out + w.to(tl.int64) * HEAD_DIM
    if NVFP4:
        dequantize_nvfp4_ds_mla_rows(src, dst, mask, NATIVE)
    else:
        dequantize_fp8_ds_mla_rows(src, dst, mask, NATIVE)


def _check_gather(
    kv_cache: torch.Tensor,
    row_bytes: int,
    block_table: torch.Tensor,
    workspace_starts: torch.Tensor,
    num_rows: int,
) -> None:
    """Everything the kernel would otherwise read out of bounds, checked before the launch."""
    check_tensor("kv_cache", kv_cache, dtype=torch.uint8, shape=(None, None, row_bytes))
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != row_bytes:
        raise InputError(
            f"kv_cache: token rows must be packed {row_bytes}-byte rows "
            f"(stride(1) == {row_bytes}, stride(2) == 1), got strides {kv_cache.stride()}"
        )
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2)
    check_tensor("workspace_starts", workspace_starts, dtype=torch.int32, shape=(block_table.shape[0],))
    check_same_device(kv_cache=kv_cache, block_table=block_table, workspace_starts=workspace_starts)
    if not isinstance(num_rows, int) or num_rows < 0:
        raise InputError(f"num_rows must be a non-negative int, got {num_rows!r}")
    if num_rows == 0:
        return
    num_requests, max_blocks = block_table.shape
    if num_requests == 0:
        raise InputError(f"num_rows={num_rows} workspace rows need at least one request in block_table")
    starts = workspace_starts.to(torch.int64)
    if int(starts[0]) != 0:
        raise InputError(f"workspace_starts[0] must be 0 (row 0 belongs to request 0), got {int(starts[0])}")
    drops = (starts[1:] < starts[:-1]).nonzero()
    if len(drops):
        i = int(drops[0])
        raise InputError(
            f"workspace_starts must be ascending: entry {i + 1} is {int(starts[i + 1])} after {int(starts[i])}"
        )
    # Request r's rows are [starts[r], starts[r + 1]) (the last one runs to num_rows), cut at
    # num_rows; it reads its first ceil(rows / BS) blocks.
    ends = torch.cat([starts[1:], starts.new_tensor([num_rows])]).clamp(max=num_rows)
    rows = (ends - starts.clamp(max=num_rows)).clamp(min=0)
    blocks = (rows + kv_cache.shape[1] - 1) // kv_cache.shape[1]
    too_long = (blocks > max_blocks).nonzero()
    if len(too_long):
        r = int(too_long[0])
        raise InputError(
            f"workspace rows of request {r} reach token {int(rows[r]) - 1}, block {int(blocks[r]) - 1}, "
            f"but block_table has {max_blocks} columns"
        )
    read = torch.arange(max_blocks, device=block_table.device)[None, :] < blocks[:, None]
    check_index_range(
        "block_table (entries the workspace rows read)",
        torch.where(read, block_table, 0),
        kv_cache.shape[0],
    )


def _gather(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    workspace_starts: torch.Tensor,
    num_rows: int,
    nvfp4: bool,
) -> torch.Tensor:
    row_bytes = (NVFP4_ROW_BYTES if nvfp4 else FP8_ROW_BYTES).value
    _check_gather(kv_cache, row_bytes, block_table, workspace_starts, num_rows)
    out = buffers.empty((num_rows, HEAD_DIM.value), torch.bfloat16, kv_cache.device)
    if num_rows == 0:
        return out
    rows = rows_per_program()
    num_requests = block_table.shape[0]
    _gather_kernel[(triton.cdiv(num_rows, rows),)](
        kv_cache, kv_cache.stride(0), block_table, block_table.stride(0), workspace_starts.contiguous(), out,
        num_rows, num_requests, kv_cache.shape[1],
        SEARCH_STEPS=(num_requests - 1).bit_length(), NVFP4=nvfp4, NATIVE=native(kv_cache.device), ROWS=rows,
    )
    return out


@register("gather_upconvert_fp8", "triton", priority=TRITON, devices=("cpu", "cuda"), interpreted_on=("cpu",))
def gather_upconvert_fp8(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    workspace_starts: torch.Tensor,
    num_rows: int,
) -> torch.Tensor:
    """fp8_ds_mla cache [NB, BS, 656] uint8 -> bf16 workspace [num_rows, 576] (spec §4.1).

    Row w = dequantized kv_cache[block_table[r, tok // BS], tok % BS] with
    r = max{i : workspace_starts[i] <= w}, tok = w - workspace_starts[r]:
    NoPE_i = bf16_rn(float(e4m3 byte i) * scale_{i // 128}), RoPE bits copied.
    kv_cache.stride(0) may exceed BS * 656; stride(1) must be 656. Checked before the launch:
    workspace_starts ascending from 0, every row's block inside block_table, every block id it
    reads inside [0, NB).
    """
    return _gather(kv_cache, block_table, workspace_starts, num_rows, nvfp4=False)


@register("gather_upconvert_nvfp4", "triton", priority=TRITON, devices=("cpu", "cuda"), interpreted_on=("cpu",))
def gather_upconvert_nvfp4(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    workspace_starts: torch.Tensor,
    num_rows: int,
) -> torch.Tensor:
    """nvfp4_ds_mla cache [NB, BS, 352] uint8 -> bf16 workspace [num_rows, 576] (spec §4.2).

    Same row -> (request, token) mapping and checks as gather_upconvert_fp8;
    NoPE_i = bf16(e2m1(nibble i) * float(e4m3 scale of block i // 16)) with the permuted scale
    bytes of kv_formats, RoPE_d = bf16(float(e4m3 byte 256 + d)).
    """
    return _gather(kv_cache, block_table, workspace_starts, num_rows, nvfp4=True)
