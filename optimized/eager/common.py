"""What the eager modules share: their registration, the row's widths, the work budget that
chunks them, IEEE float32 matmuls, little-endian byte packing and the e4m3 decode table (both
cache row formats store e4m3 codes)."""

from __future__ import annotations

import contextlib
import functools
from typing import Iterable, Iterator

import torch

from ..registry import EAGER, register

IMPL = "torch-fp32"
NOPE, ROPE, HEAD = 512, 64, 576
# Bytes a chunk of work may hold in intermediates (gathered rows, logits): bounds memory on a GPU.
BUDGET_BYTES = 256 << 20


def stage(name: str, deviations: Iterable[str] = ()):
    """Register the decorated function as stage `name`'s torch-fp32 implementation."""
    return register(name, IMPL, priority=EAGER, devices=("cpu", "cuda"), deviations=deviations)


def chunks(n: int, bytes_per_item: int) -> Iterator[slice]:
    """Slices of range(n) whose items' intermediates fit BUDGET_BYTES (at least one item each)."""
    step = max(1, BUDGET_BYTES // max(bytes_per_item, 1))
    for start in range(0, n, step):
        yield slice(start, min(start + step, n))


@contextlib.contextmanager
def full_fp32_matmul() -> Iterator[None]:
    """TF32 would drop 13 mantissa bits from every dot product; keep IEEE fp32 here."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def le_bytes(words: torch.Tensor, nbytes: int) -> torch.Tensor:
    """Integer words [..., n] -> their little-endian bytes [..., n * nbytes] uint8."""
    w = words.long()
    parts = [(w >> (8 * k)) & 0xFF for k in range(nbytes)]
    return torch.stack(parts, dim=-1).flatten(-2).to(torch.uint8)


def from_le_bytes(raw: torch.Tensor, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """Bytes [..., n * nbytes] uint8 -> [..., n] words reinterpreted as `dtype` (f32 or bf16)."""
    groups = raw.long().unflatten(-1, (-1, nbytes))
    word = sum(groups[..., k] << (8 * k) for k in range(nbytes))
    bits = 8 * nbytes
    word = torch.where(word >= 2 ** (bits - 1), word - 2**bits, word)  # two's complement
    return word.to(torch.int32 if nbytes == 4 else torch.int16).view(dtype)


@functools.lru_cache(maxsize=None)
def e4m3_table(device: str) -> torch.Tensor:
    """float32 value of each e4m3fn byte: (-1)^s * 2^(e-7) * (1 + m/8), subnormal 2^-6 * m/8,
    NaN for 0x7F / 0xFF (no infinities)."""
    code = torch.arange(256)
    e, m = (code >> 3) & 0xF, code & 7
    mag = torch.where(e == 0, m * 2.0**-9, (8 + m) * torch.exp2((e - 10).double()))
    mag = torch.where((code & 0x7F) == 0x7F, float("nan"), mag)
    return torch.where(code >= 128, -mag, mag).float().to(device)


def decode(table_fn, codes: torch.Tensor) -> torch.Tensor:
    """Codes -> float32 values through `table_fn`'s table for their device."""
    return table_fn(str(codes.device))[codes.long()]
