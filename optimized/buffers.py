"""Output allocation: every optimized op allocates its outputs here.

Under `poisoned()` (the harness turns it on around every call it checks) new buffers are filled
so that an element a kernel forgets to write shows up instead of passing as stale zeros: floats
with NaN, uint8 (cache bytes) with 0xFF (NaN in e4m3, fp32 scales and bf16 RoPE), other integers
with 0x5A bytes (0x5A5A5A5A: never a valid index, count or the -1 sentinel). Outside it, `empty`
is plain `torch.empty`.

Under `red_zones()` (the harness turns it on around every call too) each buffer is the middle of a
larger byte allocation: GUARD_BYTES of GUARD before and after it, which `breached` compares as
bytes after the call (a NaN written there shows as well as any value). A kernel writing past the
extent it was handed (the prefill workspace, the q_concat buffer, any output) changes them.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Iterator

import torch

_state = threading.local()


def poisoning() -> bool:
    return getattr(_state, "on", False)


@contextlib.contextmanager
def poisoned(on: bool = True) -> Iterator[None]:
    previous = poisoning()
    _state.on = on
    try:
        yield
    finally:
        _state.on = previous


GUARD_BYTES = 256  # each side; a multiple of every alignment a kernel may assume of its buffer
GUARD = 0xA5


@contextlib.contextmanager
def red_zones() -> Iterator[list[torch.Tensor]]:
    """Buffers allocated inside are guarded; yields the guarded allocations (`breached` reads them)."""
    previous = getattr(_state, "zones", None)
    _state.zones = zones = []
    try:
        yield zones
    finally:
        _state.zones = previous


def breached(zones: list[torch.Tensor]) -> list[str]:
    """Each guarded allocation whose guard bytes changed, said in words."""
    if not zones:
        return []
    guards = torch.stack([torch.cat([raw[:GUARD_BYTES], raw[-GUARD_BYTES:]]) for raw in zones])
    broken = (guards != GUARD).any(1).nonzero().flatten().tolist()  # one read back for every zone
    found = []
    for i in broken:
        raw = zones[i]
        before = int((raw[:GUARD_BYTES] != GUARD).sum())
        after = int((raw[-GUARD_BYTES:] != GUARD).sum())
        found.append(f"{before} guard bytes before and {after} after a {raw.numel() - 2 * GUARD_BYTES}-byte buffer")
    return found


def _guarded(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    size = math.prod(shape) * dtype.itemsize
    raw = torch.full((size + 2 * GUARD_BYTES,), GUARD, dtype=torch.uint8, device=device)
    _state.zones.append(raw)
    return raw[GUARD_BYTES:GUARD_BYTES + size].view(dtype).view(shape)


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    zoned = getattr(_state, "zones", None) is not None
    t = _guarded(shape, dtype, device) if zoned else torch.empty(shape, dtype=dtype, device=device)
    if poisoning():
        if t.is_floating_point():
            t.fill_(float("nan"))
        else:
            t.view(torch.uint8).fill_(0xFF if t.dtype == torch.uint8 else 0x5A)
    return t
