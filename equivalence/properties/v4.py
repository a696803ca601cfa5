"""DeepSeek V4's union decode held to itself (targets: sparse_decode_v4, sparse_decode_v41).

    v4_union_merge    merged: one softmax over main u extra, against the LSE merge (through the
                      dcp_merge stage) of the main list alone and the extra list alone (each the
                      other's length set to 0); no sink, whose factor is the union's. An empty
                      union merges to lse -inf, the kernels' +inf: compared as +inf.
    v4_extra_empty    no_extra: the extra cache given with every length 0, against no extra cache
                      (a kernel that plans its split by the lists' widths declares `split_kv`);
                      all_invalid: every extra entry -1, against every length 0 (one plan, the
                      same arithmetic: bit for bit, unless the kernel plans by the lengths' values,
                      `length_plan`).
    v4_zero_rope      rope_unseen: q's RoPE dims (448..511) zero, the caches' RoPE values of every
                      row rewritten: the logits never see K's RoPE, so the lse and out's NoPE dims
                      (0..447) do not move, bit for bit (V's RoPE dims do: V is the whole row).
    v4_row_alone      alone: request 0 run alone against its rows of the batch (`split_kv` kernels
                      to its bound); drawn with 2 requests or more (a batch of one compares a
                      request with itself).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from mla_verify.equivalence.judge.policy import EXACT, LSE, OUT
from mla_verify.optimized.registry import Resolved
from mla_verify.reference import v4_pages

from ..ops.v4 import FORMATS_OF, SPARSE_DECODE_V4, SPARSE_DECODE_V41, union_decode_params
from ..spec import register
from ..sandbox.produced import Compared
from .base import PropertySpec, Target
from .common import logit_scale, rewrite_generator

ROPE = slice(448, 512)
UNION_OPS = (SPARSE_DECODE_V4, SPARSE_DECODE_V41)


def union(stages: Resolved, op: str, kw: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The union decode in token-major form: (out [B*S, H, 512], lse [B*S, H])."""
    out, lse = stages.fn(op)(**kw)
    batch, seq, heads = out.shape[:3]
    return out.reshape(batch * seq, heads, -1), lse.transpose(1, 2).reshape(batch * seq, heads)


def union_scale(kw: Mapping[str, Any]) -> torch.Tensor:
    """[B*S, H]: the logit scale sm_scale * ||q|| * the largest norm of a row either list counts."""
    largest = torch.zeros(kw["q"].shape[0] * kw["q"].shape[1], dtype=torch.float64, device=kw["q"].device)
    for cache, idx, length in (("kv_cache", "indices", "topk_length"),
                               ("extra_kv_cache", "extra_indices", "extra_topk_length")):
        if kw[cache] is None:
            continue
        rows = kw[idx].long()
        if kw[length] is not None:
            rows = rows.masked_fill(torch.arange(rows.shape[-1], device=rows.device) >= kw[length][:, None, None], -1)
        rows = rows.reshape(largest.shape[0], -1)
        slots, inverse = torch.unique(rows.clamp(min=0), return_inverse=True)
        norms = v4_pages.slot_values(kw[cache], v4_pages.page_format(kw[cache]), slots).nan_to_num(0.0).norm(dim=-1)
        largest = torch.maximum(largest, torch.where(rows >= 0, norms[inverse], 0.0).amax(dim=-1))
    q = kw["q"]
    return logit_scale(q.reshape(-1, *q.shape[2:]), largest, kw["sm_scale"])


def _zeros(kw: Mapping[str, Any]) -> torch.Tensor:
    """Every request's length 0."""
    return torch.zeros(kw["q"].shape[0], dtype=torch.int32, device=kw["q"].device)


def _merge_problem(p, seed: int, device: str, op) -> dict:
    kw = {**op.inputs(p, seed, device), "attn_sink": None}
    return {"kw": kw, "scale": union_scale(kw)}


def _merge_check(op: str):
    def check(inputs: dict, p, stages: Resolved) -> list[Compared]:
        kw = inputs["kw"]
        out, lse = union(stages, op, kw)
        if kw["extra_kv_cache"] is None:  # no extra list: the merge of the main list with nothing
            return []
        main = union(stages, op, {**kw, "extra_topk_length": _zeros(kw)})
        extra = union(stages, op, {**kw, "topk_length": _zeros(kw)})
        merged, merged_lse = stages.fn("dcp_merge")(torch.stack([main[0], extra[0]]), torch.stack([main[1], extra[1]]))
        merged_lse = torch.where(merged_lse == float("-inf"), float("inf"), merged_lse)
        return [Compared("merged", "out", OUT, merged, out), Compared("merged", "lse", LSE, merged_lse, lse, inputs["scale"])]

    return check


def _extra_empty_check(op: str):
    def check(inputs: dict, p, stages: Resolved) -> list[Compared]:
        kw = inputs["kw"]
        if kw["extra_kv_cache"] is None:
            return []
        zero = {**kw, "extra_topk_length": _zeros(kw)}
        silent = union(stages, op, zero)
        alone = union(stages, op, {**kw, "extra_kv_cache": None, "extra_indices": None, "extra_topk_length": None})
        minus_one = union(stages, op, {**kw, "extra_indices": torch.full_like(kw["extra_indices"], -1)})
        scale = inputs["scale"]
        return [Compared("no_extra", "out", OUT, silent[0], alone[0]),
                Compared("no_extra", "lse", LSE, silent[1], alone[1], scale),
                Compared("all_invalid", "out", OUT, minus_one[0], silent[0]),
                Compared("all_invalid", "lse", LSE, minus_one[1], silent[1], scale)]

    return check


def _rope_rewritten(cache: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A copy of `cache` whose every row holds other finite RoPE values (dims 448..511): V4's bf16
    bytes, V4.1's e4m3 codes, FP4's nibbles, each drawn anew; scales and NoPE bytes kept."""
    fmt = v4_pages.page_format(cache)
    copy = torch.empty_strided(cache.shape, cache.stride(), dtype=cache.dtype, device=cache.device).copy_(cache)
    slots = torch.arange(cache.shape[0] * cache.shape[1], device=cache.device)
    data_at, _ = v4_pages.byte_offsets(copy, fmt, slots)
    if fmt.data_bytes == 576:    # V4: 64 bf16 values
        values = (torch.rand((slots.numel(), 64), generator=gen) * 4 - 2).to(torch.bfloat16).view(torch.uint8)
        first = 448
    elif fmt.data_bytes == 512:  # V4.1: 64 e4m3 codes, NaN (0x7F, 0xFF) avoided
        values = torch.randint(0, 0x7F, (slots.numel(), 64), generator=gen, dtype=torch.uint8)
        values |= torch.randint(0, 2, (slots.numel(), 64), generator=gen, dtype=torch.uint8) << 7
        first = 448
    else:                        # FP4: 32 bytes of two e2m1 codes each (every code finite)
        values = torch.randint(0, 256, (slots.numel(), 32), generator=gen, dtype=torch.uint8)
        first = 224
    flat = v4_pages.flat_bytes(copy)
    flat[data_at[:, None] + first + torch.arange(values.shape[1], device=cache.device)] = values.to(cache.device)
    return copy


def _rope_problem(p, seed: int, device: str, op) -> dict:
    kw = dict(op.inputs(p, seed, device))
    kw["q"] = kw["q"].clone()
    kw["q"][..., ROPE] = 0
    gen = rewrite_generator(seed)
    moved = {name: _rope_rewritten(kw[name], gen) for name in ("kv_cache", "extra_kv_cache") if kw[name] is not None}
    return {"kw": kw, "moved": {**kw, **moved}, "scale": union_scale(kw)}


def _rope_check(op: str):
    def check(inputs: dict, p, stages: Resolved) -> list[Compared]:
        out, lse = union(stages, op, inputs["kw"])
        moved_out, moved_lse = union(stages, op, inputs["moved"])
        return [Compared("rope_unseen", "out_nope", EXACT, moved_out[..., :448], out[..., :448]),
                Compared("rope_unseen", "lse", EXACT, moved_lse, lse)]

    return check


def _alone_problem(p, seed: int, device: str, op) -> dict:
    kw = op.inputs(p, seed, device)
    first = {k: (v[:1] if k in ("q", "indices", "extra_indices", "topk_length", "extra_topk_length") and v is not None
                 else v) for k, v in kw.items()}
    return {"kw": kw, "first": first, "scale": union_scale(kw)[: p.s_q]}


def _alone_check(op: str):
    def check(inputs: dict, p, stages: Resolved) -> list[Compared]:
        out, lse = union(stages, op, inputs["kw"])
        alone_out, alone_lse = union(stages, op, inputs["first"])
        rows = slice(0, alone_out.shape[0])
        return [Compared("alone", "out", OUT, alone_out, out[rows]),
                Compared("alone", "lse", LSE, alone_lse, lse[rows], inputs["scale"])]

    return check


def _targets(problem, check, runs: int, extra_only: bool = False, more: tuple[str, ...] = (),
             min_batch: int = 1) -> dict[str, Target]:
    """One target per union decode op, drawn as the op draws but with 1 or 2 query tokens a request
    (the op's own campaigns cover MTP; a property runs its problem several times), `extra_only`:
    with an extra list; at least `min_batch` requests; calling the op's stage and `more`."""
    def draw(op):
        return lambda prof: union_decode_params(prof, *FORMATS_OF[op.name], s_q=(1, 2), min_batch=min_batch).filter(
            lambda d: d["extra_topk"] > 0 or not extra_only)

    return {op.name: Target(op.name, lambda p, op=op: [op.name, *more], (op.name,),
                            lambda p, seed, device, op=op: problem(p, seed, device, op), check(op.name),
                            op.knobs, draw(op), runs=lambda p: runs)
            for op in UNION_OPS}


register(PropertySpec(
    short="v4_union_merge", checks=("merged",), targets=_targets(_merge_problem, _merge_check, 3, extra_only=True, more=("dcp_merge",)),
    doc="the union of main and extra lists = the LSE merge (dcp_merge) of each list alone",
), priority=120)
register(PropertySpec(
    short="v4_extra_empty", checks=("no_extra", "all_invalid"),
    targets=_targets(_merge_problem, _extra_empty_check, 3, extra_only=True),
    doc="an extra list of length 0 = no extra cache; every extra entry -1 = length 0 (bitwise where claimed)",
), priority=121)
register(PropertySpec(
    short="v4_zero_rope", checks=("rope_unseen",), targets=_targets(_rope_problem, _rope_check, 2),
    doc="with q's RoPE dims zero, K's RoPE values never reach the lse or out's NoPE dims (bitwise)",
), priority=122)
register(PropertySpec(
    short="v4_row_alone", checks=("alone",), targets=_targets(_alone_problem, _alone_check, 2, min_batch=2),
    doc="request 0 alone = its rows of the batch (split-KV kernels: within a rounding)",
), priority=123)
