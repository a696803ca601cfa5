"""Launch configuration of the sparse attention kernels: the one place the tile shapes are chosen.

Why these defaults (targets: H200 = SM90, 132 SMs, 227 KiB shared memory per block):
- block_h = 64 heads: one wgmma M tile; a block of gathered rows is then reused by 64 heads, the
  same tile as FlashMLA's SM90 kernels. Fewer heads (TP shards of 16/32) use a 16/32 tile rather
  than padding to 64: the padded rows would cost tensor-core time and registers for nothing.
- block_n = 64 gathered rows: a [64, 576] bf16 tile is 72 KiB; with q's [64, 576] tile (72 KiB)
  and two pipeline stages this is the largest tile that fits in shared memory.
- num_warps = 8: the [64, 512] fp32 output accumulator is 128 registers a thread over 8 warps (two
  warpgroups share the wgmma N dimension); with 4 warps it would be 256 and spill.
- num_stages = 2: double-buffer the gathered rows (cp.async) so the next block's loads run under
  this block's dots; a third stage does not fit next to q.
- Decode splits the top-k list of a (token, head block) across programs when B*S*head-blocks
  leaves SMs idle (see `decode_splits`), and merges the partial results in a combine kernel.

Every entry point takes `config=` so variants can be timed side by side in one GPU run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from optimized.kernels import interpreting
from optimized.validation import InputError

# H200 multiprocessors; also the nominal count under the CPU interpreter, so the CPU runs the
# same split plan as the GPU it stands in for.
NOMINAL_SMS = 132


@dataclass(frozen=True)
class AttentionConfig:
    """Tile shapes and launch parameters; None fields are chosen per call by `resolve`."""

    block_h: int | None = None    # query heads per program (16, 32 or 64)
    block_n: int = 64             # gathered KV rows per inner-loop step (16, 32 or 64)
    num_warps: int = 8
    num_stages: int = 3
    # decode only: programs the top-k list is split over; None = `decode_splits`
    num_splits: int | None = None

    def resolve(self, heads: int, topk: int) -> "AttentionConfig":
        """Fill `block_h` from the head count and shrink `block_n` for short top-k lists."""
        block_h = self.block_h or min(64, max(16, triton_next_pow2(heads)))
        block_n = min(self.block_n, max(16, triton_next_pow2(topk)))
        for name, value in (("block_h", block_h), ("block_n", block_n)):
            if value not in (16, 32, 64, 128):
                raise InputError(f"config.{name}={value} must be 16, 32, 64 or 128 (tl.dot tile)")
        return replace(self, block_h=block_h, block_n=block_n)


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return NOMINAL_SMS


def decode_splits(programs: int, blocks: int, sms: int) -> int:
    """How many programs share one top-k list so that `programs` fill the GPU.

    `programs` = B*S*head-blocks, `blocks` = top-k blocks of one list. Splitting costs a combine
    pass and partial results in fp32, so split only when fewer programs than SMs exist, and only
    as far as one wave: splits = ceil(sms / programs), at most one block per split.
    """
    if programs >= sms:
        return 1
    return max(1, min(blocks, -(-sms // programs)))


def check_launch_device(device: torch.device) -> None:
    """Compiled kernels need CUDA tensors; CPU tensors run only under the interpreter."""
    if device.type == "cuda":
        return
    if device.type != "cpu":
        raise InputError(f"tensors on {device}: the Triton kernels run on cuda (or cpu when interpreting)")
    if not interpreting():
        raise InputError("CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before importing triton")
