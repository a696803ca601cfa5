"""Addressing and prefetching of the KV rows the sparse attention kernels gather.

`offset` widens a row offset to 64 bits unless the launcher has found 32 bits enough (a 32-bit
offset is one IMAD per row; a 64-bit one several, and more registers).

`prefetch_rows` asks L2 for rows ahead of the copies that will read them. The attention kernels copy a block of gathered rows into shared memory one loop iteration before
its dots (Triton's pipeliner issues the copy at the end of the previous iteration), so a row that
is not in L2 costs each iteration an HBM round trip on top of the L2 one. `prefetch_rows` issues
`prefetch.global.L2` for every 128-byte line of the rows of a later block: those lines travel
from HBM while this block computes, and the copy finds them in L2. A prefetch is only a hint: it
reads nothing into registers or shared memory, so it cannot change a result, and it never faults
(it is only ever given addresses inside the KV array or the index array).

The interpreter cannot run PTX, so callers pass NATIVE and the CPU path skips the hint.
"""

import triton
import triton.language as tl

LINE_BYTES = tl.constexpr(128)


@triton.jit
def offset(x, OFFSETS32: tl.constexpr):
    """x as an address offset: int32 when OFFSETS32 (the caller knows it cannot overflow), else int64."""
    if OFFSETS32:
        return x
    else:
        return x.to(tl.int64)


@triton.jit
def _prefetch_l2(ptrs):
    tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_rows(rows, ok, fallback, ROW_BYTES: tl.constexpr, NATIVE: tl.constexpr):
    """Prefetch bytes [0, ROW_BYTES) from each of `rows` (uint8 pointers [BN]) where `ok`.

    One address per 128-byte step plus the last byte, so every line a row touches gets one (rows
    need not be line aligned). Rows that are not `ok` prefetch `fallback`, a valid address.
    """
    if NATIVE:
        steps: tl.constexpr = triton.next_power_of_2(ROW_BYTES // LINE_BYTES + 2)
        offsets = tl.minimum(tl.arange(0, steps) * LINE_BYTES, ROW_BYTES - 1)
        _prefetch_l2(tl.where(ok[:, None], rows[:, None] + offsets[None, :], fallback))
