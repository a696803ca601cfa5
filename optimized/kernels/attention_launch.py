"""Launch configuration of the sparse attention kernels: the one place the tile shapes are chosen.

Why these defaults (H200 = SM90: 132 SMs, 227 KiB shared memory and 64K registers per SM;
numbers from compiling for sm_90a with triton 3.6, see ATTENTION_NOTES.md):
- block_h = 64 heads: one wgmma M tile, so a block of gathered rows is reused by 64 heads (the
  tile of FlashMLA's SM90 kernels). TP shards of 16/32 heads get a 16/32 tile instead of padding.
- block_n = 64 gathered rows: q's [64, 576] bf16 tile (72 KiB) plus two [64, 576] row buffers
  (144 KiB) is 216 KiB of the 227; prefill compiles to 221 KiB of shared memory. 32 rows would
  allow deeper copy pipelines but make the score dot 64x16 instructions (run 5: 40% slower).
- num_warps = 8: the [64, 512] fp32 accumulator is 128 registers a thread over 8 warps (two
  warpgroups split its 512 columns); with 4 warps it is 256 and spills ~2 KiB a thread.
- num_stages = 3: the index block is fetched one iteration before the rows it addresses, which
  are fetched one before their dots (the pipeliner's schedule for an indirect load); 2 stages
  load the indices synchronously; run 5 measured the two within 3% of each other.
- Decode splits the top-k list of a (token, head block) across programs when that shortens the
  critical path (see `split_plan`), and merges the partial results in a combine kernel.
- lean_addressing is on: the H200 sweep (scripts/sweep_attention.py, run 7 in
  ATTENTION_NOTES.md) measured it never slower and 4-16% faster (prefill H=128 246 -> 260
  TFLOP/s, decode B=128 s_q=2 163 -> 189). l2_prefetch stays off: within +-4% either way.

Every entry point takes `config=` so variants can be timed side by side in one GPU run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from mla_verify.optimized.validation import InputError

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
    # decode only: programs the top-k list is split over; None = `split_plan` decides
    num_splits: int | None = None
    # row addresses in fewer instructions where the layout allows: 32-bit offsets when the KV
    # array spans < 2**31 elements, and (decode) slot * 656 when pages are packed instead of a
    # division by the page size; the launchers fall back per call
    lean_addressing: bool = True
    # prefetch into L2 the rows of the block this many blocks ahead (0: none); see gathered_rows.py
    l2_prefetch: int = 0

    def resolve(self, heads: int, topk: int) -> "AttentionConfig":
        """Fill `block_h` from the head count and shrink `block_n` for short top-k lists."""
        block_h = self.block_h or min(64, max(16, triton_next_pow2(heads)))
        block_n = min(self.block_n, max(16, triton_next_pow2(topk)))
        for name, value in (("block_h", block_h), ("block_n", block_n)):
            if value not in (16, 32, 64, 128):
                raise InputError(f"config.{name}={value} must be 16, 32, 64 or 128 (tl.dot tile)")
        if self.l2_prefetch < 0:
            raise InputError(f"config.l2_prefetch={self.l2_prefetch} must be >= 0 (blocks ahead)")
        return replace(self, block_h=block_h, block_n=block_n)


# The candidates an H200 sweep times against FlashMLA before any becomes a default
# (scripts/sweep_attention.py; scripts/kernel_resources.py shows what each compiles to). Names say
# what differs from the default: wide = 64-bit addressing (lean_addressing off); pfN = l2_prefetch N
# blocks ahead, one more than the pipeliner's copy distance; sN = num_stages; nN = block_n.
_DEFAULT = AttentionConfig()
PREFILL_VARIANTS = {
    "default": _DEFAULT,
    "wide": replace(_DEFAULT, lean_addressing=False),
    "pf2": replace(_DEFAULT, l2_prefetch=2),
    "pf4 n32s7": replace(_DEFAULT, l2_prefetch=4, block_n=32, num_stages=7),
}
DECODE_VARIANTS = {
    "default": _DEFAULT,
    "wide": replace(_DEFAULT, lean_addressing=False),
    "pf2": replace(_DEFAULT, l2_prefetch=2),
    "pf4 n32s7": replace(_DEFAULT, l2_prefetch=4, block_n=32, num_stages=7),
}
VARIANTS = {"prefill": PREFILL_VARIANTS, "decode": DECODE_VARIANTS}


def fits_int32(elements: int) -> bool:
    """Whether every element offset into an array spanning `elements` fits a signed 32-bit int."""
    return elements < 2**31


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return NOMINAL_SMS


def split_plan(topk: int, block_n: int, programs: int, sms: int, requested: int | None) -> tuple[int, int]:
    """(splits, entries per split) for one top-k list of the decode.

    `programs` = B*S*head-blocks. A full machine is not split (splitting costs a combine pass and
    fp32 partials); fewer programs than SMs split to minimise the critical path, waves x blocks
    per program = ceil(programs * s / sms) * ceil(blocks / s), ties going to fewer splits. (The
    H200 sweep: at B=64, H=128 the old rule, as many splits as fill one wave, split 128 programs
    in two and ran 10% slower than not splitting.) Every split gets a whole number of blocks and
    none is left empty.
    """
    blocks = -(-topk // block_n)
    if requested is not None:
        splits = requested
    elif programs >= sms:
        splits = 1
    else:
        splits = min(range(1, blocks + 1), key=lambda s: (-(-programs * s // sms)) * (-(-blocks // s)))
    splits = min(max(1, splits), blocks)
    split_len = -(-blocks // splits) * block_n
    return -(-topk // split_len), split_len
