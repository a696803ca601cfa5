"""Input layouts: the same values in every memory layout an op's contract allows.

A kernel that assumes its inputs dense passes every contiguous case and reads the wrong elements
of a production tensor (a view of a wider buffer, a transposed allocation, a slice past a storage
offset). FlashMLA's own tests make every input non-contiguous; a case here draws its `layout`:

    contiguous  as built
    padded      each last-dim row inside a wider row (its tail poisoned: NaN, or 0xFF bytes)
    permuted    allocated with the leading dims in reverse order, viewed back (3-D and more)
    offset      at a storage offset within a larger, poisoned allocation

`ALLOWED` says per op which inputs may take which layouts: every other input the contract
requires contiguous (`mla-verify list --op OP` prints it). The attention kernels read every
tensor through its strides with the last dim contiguous (FlashMLA's rule): q, kv and the indices
may be padded or at an offset, q permuted; topk_length and attn_sink must be dense.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

LAYOUTS = ("contiguous", "padded", "permuted", "offset")
PAD = 8        # elements past each last-dim row in the padded layout
OFFSET = 64    # elements before the tensor in the offset layout

ALLOWED: dict[str, dict[str, tuple[str, ...]]] = {
    "sparse_prefill": {"q": ("padded", "permuted", "offset"), "kv": ("padded", "offset"),
                       "indices": ("padded", "offset"), "topk_length": (), "attn_sink": ()},
    "sparse_decode_fp8": {"q": ("padded", "permuted", "offset"), "indices": ("padded", "permuted", "offset")},
}


def _poisoned(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    t = torch.empty(shape, dtype=like.dtype, device=like.device)
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.view(torch.uint8).fill_(0xFF).view(t.dtype)


def relaid(t: torch.Tensor, layout: str) -> torch.Tensor:
    """`t`'s values in `layout` (module docstring); "permuted" on fewer than 3 dims leaves it as is."""
    if layout == "padded":
        wide = _poisoned((*t.shape[:-1], t.shape[-1] + PAD), t)
        wide[..., : t.shape[-1]] = t
        return wide[..., : t.shape[-1]]
    if layout == "permuted" and t.dim() >= 3:
        order = (*reversed(range(t.dim() - 1)), t.dim() - 1)  # the leading dims reversed, the last kept
        return t.permute(order).contiguous().permute(order)
    if layout == "offset":
        flat = _poisoned((OFFSET + t.numel(),), t)
        flat[OFFSET:] = t.reshape(-1)
        return flat[OFFSET:].view(t.shape)
    return t


def relayout(op: str, kwargs: dict[str, Any], layout: str) -> dict[str, Any]:
    """`kwargs` with every tensor `ALLOWED[op]` lets take `layout` in it."""
    allowed = ALLOWED.get(op, {})
    return {name: relaid(value, layout) if isinstance(value, torch.Tensor) and layout in allowed.get(name, ()) else value
            for name, value in kwargs.items()}


def layout_line(op: str) -> str | None:
    """What `list --op` says of `op`'s input layouts, or None where every input is drawn dense."""
    allowed: Mapping[str, tuple[str, ...]] = ALLOWED.get(op, {})
    if not allowed:
        return None
    free = [f"{name} ({', '.join(kinds)})" for name, kinds in allowed.items() if kinds]
    dense = [name for name, kinds in allowed.items() if not kinds]
    return (f"layouts drawn: {'; '.join(free)}; last dim contiguous throughout"
            + (f"; must be contiguous: {', '.join(dense)}" if dense else ""))
