"""Input layouts: the same values in every memory layout an op's contract allows.

A kernel that assumes its inputs dense passes every contiguous case and reads the wrong elements
of a production tensor (a view of a wider buffer, a transposed allocation, a slice past a storage
offset). FlashMLA's own tests make every input non-contiguous; a case here draws its `layout`:

    contiguous  as built
    padded      each last-dim row inside a wider row (its tail poisoned: NaN, or 0xFF bytes)
    permuted    allocated with the leading dims in reverse order, viewed back (3-D and more)
    offset      at a storage offset within a larger, poisoned allocation

`ALLOWED` says per op which inputs may take which layouts (the last dim stays contiguous
throughout: FlashMLA's rule, and what the Triton kernels read); an input listed with no layout,
and every input of an op not listed, is drawn as its case builds it. `BUILT` names the inputs
whose layout the case builds itself (a cache's block stride, views of one buffer). `mla-verify
list --op OP` prints both and which inputs must be contiguous.

Per op, from the upstream contracts: the attention kernels read every tensor through its strides,
topk_length and attn_sink dense; the index converters make their inputs contiguous, asserting
it only of the prefill workspace tensors (a storage offset keeps a tensor contiguous); the codec,
the cache writer and the workspace gathers read rows through their row stride; the query concat
reads both halves through their strides (the MLA layer's ql_nope is a transposed bmm output); the
merge reads the ranks' partials through their strides; the spec-decode reshapes are views
(`view`), which a transposed attention output cannot take.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

LAYOUTS = ("contiguous", "padded", "permuted", "offset")
PAD = 8        # elements past each last-dim row in the padded layout (16 bytes at least)
OFFSET = 64    # elements before the tensor in the offset layout

ROWS, ALL = ("padded", "offset"), ("padded", "permuted", "offset")
_INDEX = {"req_id": ("offset",), "block_table": ROWS, "topk_indices": ROWS}
_GATHER = {"block_table": ROWS, "workspace_starts": ("offset",)}
ALLOWED: dict[str, dict[str, tuple[str, ...]]] = {
    "sparse_prefill": {"q": ALL, "kv": ROWS, "indices": ROWS, "topk_length": (), "attn_sink": ()},
    "sparse_decode_fp8": {"q": ALL, "indices": ALL},
    "convert_index": {**_INDEX, "idx_mapping": ("offset",), "prefill_request_ids": ("offset",),
                      "prefill_workspace_starts": ("offset",)},
    "dcp_convert_index": _INDEX,
    "concat_mla_q": {"ql_nope": ALL, "q_pe": ALL},
    "quantize_fp8_ds_mla": {"kv": ROWS},
    "dequantize_fp8_ds_mla": {"rows": ROWS},
    "write_fp8_ds_mla_cache": {"kv": ROWS, "slot_mapping": ("offset",)},
    "gather_upconvert_fp8": _GATHER,
    "gather_upconvert_nvfp4": _GATHER,
    "dcp_merge": {"outs": ALL, "lses": ("permuted", "offset")},
    "reshape_query_for_spec_decode": {"q": ALL},
    "reshape_attn_output_for_spec_decode": {"out": ROWS},
}
_CACHE = "blocks at a drawn stride (stride_pad)"
BUILT: dict[str, dict[str, str]] = {
    "sparse_decode_fp8": {"kv_cache": _CACHE},
    "write_fp8_ds_mla_cache": {"kv_cache": _CACHE},
    "gather_upconvert_fp8": {"kv_cache": _CACHE},
    "gather_upconvert_nvfp4": {"kv_cache": _CACHE},
    "concat_mla_q": {"ql_nope": "as built (layout contiguous), a view of a [T, H, 640] buffer",
                     "q_pe": "another view of it"},
}
FEATURES = {"padded": "an input in padded rows", "permuted": "an input permuted (leading dims reversed)",
            "offset": "an input at a storage offset"}


def drawn(op: str) -> tuple[str, ...]:
    """The layouts a draw of `op` picks from: contiguous and those some input of it may take."""
    kinds = {kind for kinds in ALLOWED.get(op, {}).values() for kind in kinds}
    return tuple(layout for layout in LAYOUTS if layout == "contiguous" or layout in kinds)


def _poisoned(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    t = torch.empty(shape, dtype=like.dtype, device=like.device)
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.view(torch.uint8).fill_(0xFF).view(t.dtype)


def relaid(t: torch.Tensor, layout: str) -> torch.Tensor:
    """`t`'s values in `layout` (module docstring); "permuted" on fewer than 3 dims leaves it as is."""
    if layout == "padded":
        wide = _poisoned((*t.shape[:-1], t.shape[-1] + max(PAD, 16 // t.element_size())), t)
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


def shown(op: str, kwargs: Mapping[str, Any]) -> set[str]:
    """The layout FEATURES the tensors of `kwargs` that `op` lets take one show, read from their
    strides and offsets: the first dim not the outermost (3-D and more); else not contiguous (with
    the last dim contiguous throughout: rows at a stride past their length); a storage offset."""
    found = set()
    for name in ALLOWED.get(op, {}):
        t = kwargs.get(name)
        if not isinstance(t, torch.Tensor) or not t.numel():
            continue
        permuted = t.dim() >= 3 and t.shape[0] > 1 and t.shape[1] > 1 and t.stride(0) < t.stride(1)
        if permuted:
            found.add(FEATURES["permuted"])
        elif not t.is_contiguous():
            found.add(FEATURES["padded"])
        if t.storage_offset() > 0:
            found.add(FEATURES["offset"])
    return found


def features(op: str) -> tuple[str, ...]:
    """The layout FEATURES an op's covering set must show: those of the layouts it draws."""
    return tuple(FEATURES[layout] for layout in drawn(op) if layout != "contiguous")


def layout_line(op: str) -> str | None:
    """What `list --op` says of `op`'s input layouts, or None where every input is drawn as built."""
    allowed: Mapping[str, tuple[str, ...]] = ALLOWED.get(op, {})
    built = BUILT.get(op, {})
    if not allowed and not built:
        return None
    strided = [f"{name} ({', '.join(kinds)})" for name, kinds in allowed.items() if set(kinds) - {"offset"}]
    offset = [name for name, kinds in allowed.items() if kinds == ("offset",)]
    dense = [name for name, kinds in allowed.items() if not kinds and name not in built]
    parts = [f"layouts drawn: {'; '.join(strided)}; last dim contiguous throughout" if strided else "",
             f"must be contiguous: {', '.join(dense)}" if dense else "",
             f"must be contiguous, drawn at a storage offset too: {', '.join(offset)}" if offset else "",
             "; ".join(f"{name}: {how}" for name, how in built.items())]
    return "; ".join(p for p in parts if p)
