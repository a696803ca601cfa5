"""Output allocation: every optimized op allocates its outputs here.

Under `poisoned()` (the harness turns it on around every call it checks) new buffers are filled
so that an element a kernel forgets to write shows up instead of passing as stale zeros: floats
with NaN, uint8 (cache bytes) with 0xFF (NaN in e4m3, fp32 scales and bf16 RoPE), other integers
with 0x5A bytes (0x5A5A5A5A: never a valid index, count or the -1 sentinel). Outside it, `empty`
is plain `torch.empty`.
"""

from __future__ import annotations

import contextlib
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


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    if poisoning():
        if t.is_floating_point():
            t.fill_(float("nan"))
        else:
            t.view(torch.uint8).fill_(0xFF if t.dtype == torch.uint8 else 0x5A)
    return t
