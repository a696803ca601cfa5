"""Gather + up-convert: a prefill chunk's rows of the quantized cache into the bf16 workspace.

Workspace row w belongs to request r = #{i : starts[i] <= w} - 1, found with a cumsum of markers
(not a binary search), and holds that request's token w - starts[r].
"""

from __future__ import annotations

import torch

from .. import buffers
from ..validation import InputError, check_index_range, check_same_device, check_tensor
from .common import HEAD, chunks, stage
from .fp8_ds_mla import FP8_ROW
from .nvfp4_ds_mla import NVFP4_ROW
from .paged_cache import DECODE_BYTES_PER_ROW, check_paged_cache, write_bf16


def _gather_upconvert(
    kv_cache: torch.Tensor, block_table: torch.Tensor, workspace_starts: torch.Tensor, num_rows: int, width: int
) -> torch.Tensor:
    """Workspace row w <- cache row of token w - starts[r] of request r = #{i: starts[i] <= w} - 1."""
    check_paged_cache(kv_cache, width)
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2)
    num_reqs, width_blocks = block_table.shape
    check_tensor("workspace_starts", workspace_starts, dtype=torch.int32, shape=(num_reqs,))
    check_same_device(kv_cache=kv_cache, block_table=block_table, workspace_starts=workspace_starts)
    if num_rows < 0 or (num_rows and num_reqs == 0):
        raise InputError(f"num_rows={num_rows}: need num_rows >= 0, and a request to fill any row")
    starts = workspace_starts.long()
    if num_reqs and (int(starts[0]) != 0 or bool((starts[1:] < starts[:-1]).any())):
        raise InputError(f"workspace_starts must ascend from 0, got {starts.tolist()}")
    device, block_size = kv_cache.device, kv_cache.shape[1]
    marks = torch.zeros(num_rows + 1, dtype=torch.long, device=device)
    marks.index_add_(0, starts.clamp(max=num_rows), torch.ones_like(starts))
    req = marks.cumsum(0)[:num_rows] - 1
    tok = torch.arange(num_rows, device=device) - starts[req]
    cols = tok // block_size
    if bool((cols >= width_blocks).any()):
        raise InputError(
            f"num_rows={num_rows} maps row {int((cols >= width_blocks).nonzero()[0])} past its "
            f"request's {width_blocks}-block table"
        )
    blocks = block_table.long()[req, cols]
    check_index_range("block_table (entries the chunk reads)", blocks, kv_cache.shape[0])
    out = buffers.empty((num_rows, HEAD), torch.bfloat16, device)
    for part in chunks(num_rows, DECODE_BYTES_PER_ROW):
        write_bf16(out[part], kv_cache[blocks[part], tok[part] % block_size])
    return out


@stage("gather_upconvert_fp8")
def gather_upconvert_fp8(
    kv_cache: torch.Tensor, block_table: torch.Tensor, workspace_starts: torch.Tensor, num_rows: int
) -> torch.Tensor:
    """[NB, BS, 656] fp8_ds_mla cache -> [num_rows, 576] bf16 workspace, bf16(float32(q) * scale)."""
    return _gather_upconvert(kv_cache, block_table, workspace_starts, num_rows, FP8_ROW)


@stage("gather_upconvert_nvfp4")
def gather_upconvert_nvfp4(
    kv_cache: torch.Tensor, block_table: torch.Tensor, workspace_starts: torch.Tensor, num_rows: int
) -> torch.Tensor:
    """[NB, BS, 352] nvfp4_ds_mla cache -> [num_rows, 576] bf16 workspace (exact in bf16)."""
    return _gather_upconvert(kv_cache, block_table, workspace_starts, num_rows, NVFP4_ROW)
