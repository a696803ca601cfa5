"""Output allocation: every optimized op allocates its outputs here.

Under `poisoned()` (the harness turns it on around every call it checks) new buffers are filled
with NaN (floats) or all-ones bytes (integers: -1 / 0xFF), so an element a kernel forgets to
write shows up instead of passing as stale zeros. Outside it, `empty` is plain `torch.empty`.
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
            t.view(torch.uint8).fill_(0xFF)
    return t
