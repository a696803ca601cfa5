"""decode_equals_prefill: the FP8 decode kernel on a cache equals the BF16 prefill kernel on the
same rows up-converted.

sparse_decode_fp8 reads 656-byte fp8_ds_mla rows by physical slot; the implementation's own
`dequantize_fp8_ds_mla` turns the slots a batch selects into bf16 rows (exactly, with the
power-of-two scales vLLM writes: these cases use no others), the slots become row numbers of that
array (-1 stays -1, the row padded with -1 to a multiple of 128 for FlashMLA's prefill), and
sparse_prefill runs over it with the [B*S, H, 576] query. Both kernels then attend over the same
bf16 keys; their answers differ only by their own roundings.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from ..cases.draws import decode_params
from ..cases.params import DecodeParams
from ..spec import register
from .base import PropertySpec, Target
from .common import ATTENTION_STAGES, attention, decode, decode_knobs, decode_problem, decode_scale, prefill

PREFILL_TOPK_MULTIPLE = 128


def _inputs(p: DecodeParams, seed: int, device: str) -> dict:
    if p.scale_rule != "pow2":
        raise ValueError("decode_equals_prefill needs power-of-two scales: raw ones do not dequantize to bf16 exactly")
    kw = decode_problem(p, seed, device)
    return {"decode": kw, "scale": decode_scale(kw)}


def _check(inputs: dict, p: DecodeParams, stages) -> list:
    kw = inputs["decode"]
    got_decode = decode(stages, kw)
    cache, idx, q = kw["kv_cache"], kw["indices"], kw["q"]
    rows = idx.reshape(-1, idx.shape[-1])
    # The selected slots, ascending; a batch that selects none still gets one (unread) row.
    slots = rows[rows >= 0].unique()
    if not len(slots):
        slots = torch.zeros(1, dtype=rows.dtype, device=rows.device)
    block = cache.shape[1]
    kv = stages.fn("dequantize_fp8_ds_mla")(rows=cache[slots // block, slots % block])
    flat = torch.where(rows >= 0, torch.searchsorted(slots, rows.clamp(min=0)).to(rows.dtype), -1)
    flat = torch.nn.functional.pad(flat, (0, -flat.shape[1] % PREFILL_TOPK_MULTIPLE), value=-1)
    got_prefill = prefill(stages, {"q": q.reshape(-1, *q.shape[2:]), "kv": kv, "indices": flat,
                                   "sm_scale": kw["sm_scale"]})
    return attention("prefill", got_prefill, got_decode, inputs["scale"])


register(PropertySpec(
    short="decode_equals_prefill",
    checks=("prefill",),
    targets={
        "sparse_decode_fp8": Target(
            "sparse_decode_fp8", lambda p: ["sparse_decode_fp8", "sparse_prefill", "dequantize_fp8_ds_mla"],
            ATTENTION_STAGES, _inputs, _check, decode_knobs, lambda p: decode_params(p, scale_rule=st.just("pow2"))),
    },
    doc="sparse_decode_fp8 on an fp8_ds_mla cache equals sparse_prefill on its rows up-converted to bf16",
), priority=102)
