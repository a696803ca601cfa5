"""The reference's working memory: a budget, and query tokens streamed through it in chunks.

A reference attention call holds, besides its inputs and its result, at most a budget of working
memory: the innermost `memory_limit`, else MLA_VERIFY_REFERENCE_MEMORY (bytes), else 4 GiB; on a
GPU never more than this process may still allocate there (`device_headroom`: what its share of
the card leaves, and what the other processes on the card leave), less an eighth for the
libraries' own workspaces. Query tokens go through in chunks of as many tokens as the budget holds
(`token_bytes` each); a budget that holds no token is refused before anything is computed, unless
only the card's headroom is short: then the call waits for the other processes to give memory back
(and then fails as an allocation would, with torch.OutOfMemoryError).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import time
from typing import Callable, Iterator, NamedTuple, TypeVar

import torch

HEAD_DIM, NOPE_DIM = 576, 512
DEFAULT_MEMORY_BYTES = 4 << 30
WAIT_S, WAIT_STEP_S = 15.0, 0.5  # how long a call waits for room on a GPU the other processes fill, and how often it looks
MEMORY_ENV = "MLA_VERIFY_REFERENCE_MEMORY"  # bytes; how `--reference-memory` reaches child processes
_memory_limit: contextvars.ContextVar[int | None] = contextvars.ContextVar("reference_memory", default=None)

R = TypeVar("R", bound=NamedTuple)


def memory_budget() -> int:
    """Working memory a reference attention call may hold, in bytes: the innermost
    `memory_limit`, else the MLA_VERIFY_REFERENCE_MEMORY environment variable, else 4 GiB."""
    limit = _memory_limit.get()
    if limit is not None:
        return limit
    return int(os.environ.get(MEMORY_ENV, DEFAULT_MEMORY_BYTES))


@contextlib.contextmanager
def memory_limit(nbytes: int) -> Iterator[None]:
    """Within the block, reference attention calls hold at most `nbytes` of working memory."""
    if nbytes <= 0:
        raise ValueError(f"a memory budget must be positive, got {nbytes}")
    token = _memory_limit.set(int(nbytes))
    try:
        yield
    finally:
        _memory_limit.reset(token)


def device_headroom(device: torch.device) -> int | None:
    """Bytes this process may still allocate on `device` (None off a GPU): the lesser of what its
    memory fraction (`torch.cuda.set_per_process_memory_fraction`, a part's share of a shared card)
    leaves and what the card has free, counting the blocks this process caches but does not use."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _device: 1.0)(device)
    return max(0, min(int(fraction * total) - allocated, free + reserved - allocated))


def working_budget(device: torch.device, budget_bytes: int | None = None) -> int:
    """The budget of a call on `device`: `budget_bytes` (default `memory_budget()`), on a GPU
    at most seven eighths of its headroom."""
    budget = budget_bytes or memory_budget()
    headroom = device_headroom(device)
    return budget if headroom is None else min(budget, headroom - headroom // 8)


def tokens_per_chunk(device: torch.device, num_heads: int, topk: int, itemsize: int, budget_bytes: int | None,
                     build_bytes: int) -> int:
    """`chunk_tokens` under the working budget of `device`. Where the budget would hold a token but
    the GPU's headroom (what the other processes on the card hold) does not, the call waits for
    room, up to WAIT_S, its own cached blocks given back first; then torch.OutOfMemoryError, as an
    allocation would raise it (a budget too small itself: ValueError at once)."""
    budget = budget_bytes or memory_budget()
    one = token_bytes(num_heads, topk, itemsize, build_bytes)
    deadline = time.monotonic() + WAIT_S
    while (working := working_budget(device, budget)) < budget and working - working // 16 < one \
            and budget - budget // 16 >= one:
        if time.monotonic() >= deadline:
            raise torch.OutOfMemoryError(f"no room for one query token of the reference on {device} ({one / 2**20:.1f} "
                                         f"MiB) after {WAIT_S:g} s: {working / 2**20:.1f} MiB of headroom")
        torch.cuda.empty_cache()
        time.sleep(WAIT_STEP_S)
    return chunk_tokens(num_heads, topk, itemsize, working, build_bytes)


def token_bytes(num_heads: int, topk: int, itemsize: int, build_bytes: int = 2 * HEAD_DIM + 64) -> int:
    """Peak working bytes of one query token, everything it holds at once counted: its K rows
    [topk, 576] in the compute dtype; while they are built, `build_bytes` per row (the gathered
    source row, its index, a format's decoding temporaries: `row_build_bytes`); then either |K|
    and its logit sizes [H, topk] in float32, or the logits [H, topk] in the compute dtype; its
    query (compute dtype and |q| in float32) and two results [H, 512] of three tensors each (the
    one being handed on and the next: out and the magnitudes, whether asked for or not)."""
    per_row = HEAD_DIM * itemsize + max(build_bytes, 4 * (HEAD_DIM + num_heads), itemsize * num_heads) + 16
    per_head = HEAD_DIM * (itemsize + 4) + 6 * NOPE_DIM * itemsize + 64
    return topk * per_row + num_heads * per_head


def chunk_tokens(num_heads: int, topk: int, itemsize: int, budget_bytes: int, build_bytes: int = 2 * HEAD_DIM + 64) -> int:
    """Query tokens per chunk: as many as `budget_bytes` holds (`token_bytes` each), less a
    sixteenth kept for the libraries' own workspaces (BLAS packing buffers, allocator rounding)."""
    one, usable = token_bytes(num_heads, topk, itemsize, build_bytes), budget_bytes - budget_bytes // 16
    if usable < one:
        raise ValueError(f"a reference memory budget of {budget_bytes / 2**20:.1f} MiB holds no query token: one "
                         f"with {num_heads} heads and top-k {topk} needs {one / 2**20:.1f} MiB")
    return usable // one


def stream(count: int, chunk: int, compute: Callable[[slice], R]) -> Iterator[tuple[slice, R]]:
    """(rows, compute(rows)) for consecutive slices of `count` rows, `chunk` at a time. No local
    holds a chunk's result past its yield: the next chunk's working memory takes its place."""
    for start in range(0, count, chunk):
        rows = slice(start, min(start + chunk, count))
        yield rows, compute(rows)


def collect(chunks: Iterator[tuple[slice, R]], count: int) -> R | None:
    """The chunks' results as one of `count` rows: each tensor field [rows, ...] of a chunk
    written into the whole [count, ...] (None fields stay None); None when no chunk came."""
    result = None
    for rows, part in chunks:
        if result is None:
            result = type(part)(*(None if t is None else t.new_empty((count, *t.shape[1:])) for t in part))
        for whole, piece in zip(result, part):
            if piece is not None:
                whole[rows] = piece
    return result
