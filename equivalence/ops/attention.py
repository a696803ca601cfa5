"""The two attention kernels' contracts: BF16 sparse prefill and FP8 sparse decode.

Inputs keep the kernels honest: rows and cache slots that no valid index selects are poisoned
(NaN), so a kernel that reads one shows it; invalid entries take every form the contract allows
(prefill: any negative or >= N; decode: -1 only).
"""

from __future__ import annotations

import itertools
import math
from typing import Callable

import torch
from hypothesis import strategies as st

from mla_verify import reference
from mla_verify.equivalence.sandbox.call_guards import returned
from mla_verify.equivalence.cases.patterns import apply_patterns, distinct_rows
from mla_verify.equivalence.judge import bounds
from mla_verify.equivalence.judge.policy import DEVIATIONS, LSE, OUT
from mla_verify.equivalence.judge.rows import RowKind
from mla_verify.equivalence.cases.values import fill_selected_slots, kv_values, q_values

from ..cases.builders import permutation
from ..cases.draws import decode_params, prefill_params
from ..cases.layouts import LAYOUTS, relayout
from ..cases.params import DecodeParams, PrefillParams
from ..spec import register
from .base import BoundKey, Check, ImplOutput, OpSpec
from .common import generator, host_values, knobs, rand, randint


def returning(names: tuple[str, ...], required: int):
    def call(subject, kwargs, params) -> ImplOutput:
        return ImplOutput(returned(subject.fn(**kwargs), names, required), deviations=subject.deviations)

    return call


def _prefill_inputs(p: PrefillParams, seed: int, device: str) -> dict:
    g = generator(seed, device)
    tokens, heads, rows, topk = p.tokens, p.heads, p.kv_rows, p.topk
    q = q_values(g, (tokens, heads, 576), p.value_regime, p.inputs)
    kv = kv_values(g, rows, p.value_regime, p.inputs)
    idx = distinct_rows(g, torch.arange(rows, device=device).expand(tokens, rows), topk)  # every row a candidate
    idx = apply_patterns(g, idx, p.invalid, out_of_range=(rows, 2**31 - 1))
    length = None
    if p.topk_length in ("random", "garbage"):
        length = randint(g, 0, topk + 1, tokens)
    elif p.topk_length == "edges":  # 0, 1, K - 1 and K
        length = host_values([0, 1, max(topk - 1, 0), topk], device)[randint(g, 0, 4, tokens)]
    if p.topk_length == "garbage":  # past a token's length anything (what a converter may leave there), not -1
        past = torch.arange(topk, device=device)[None, :] >= length[:, None]
        idx = torch.where(past, randint(g, -(2**31), 2**31 - 1, tokens, topk), idx)
    sink = None
    if p.sink != "none":
        sink = torch.randn(heads, generator=g, device=device)
        if p.sink == "inf":
            sink.masked_fill_(rand(g, heads) < 0.3, math.inf)
            sink.masked_fill_(rand(g, heads) < 0.3, -math.inf)
    # Poison every kv row no valid entry selects (the invalid ones mark a spare last flag).
    live = (idx >= 0) & (idx < rows)
    if length is not None:
        live &= torch.arange(topk, device=device)[None, :] < length[:, None]
    used = torch.zeros(rows + 1, dtype=torch.bool, device=device)
    used[torch.where(live, idx, rows)] = True
    kv.masked_fill_(~used[:rows, None], float("nan"))
    return relayout("sparse_prefill", {"q": q, "kv": kv, "indices": idx.to(torch.int32), "sm_scale": p.sm_scale,
                                       "topk_length": None if length is None else length.to(torch.int32),
                                       "attn_sink": sink}, p.layout)


def _read_past_length(kw: dict, tensor: str, got: torch.Tensor, want: torch.Tensor) -> str:
    """Where the kernel's NaN comes from when a token's entry past its topk_length points at a
    poisoned kv row (no valid entry selects it): the token, its drawn length and the first such
    position, the one a kernel reading past the length reads first."""
    length, idx, kv = kw["topk_length"], kw["indices"], kw["kv"]
    if length is None or not kv.shape[0]:
        return ""
    nan = (torch.isnan(got.to(want.device)) & ~torch.isnan(want)).reshape(want.shape[0], -1).any(-1)  # [T]
    poisoned_rows = torch.isnan(kv).any(-1)
    in_range = (idx >= 0) & (idx < kv.shape[0])
    past = torch.arange(idx.shape[1], device=idx.device)[None, :] >= length[:, None]
    suspect = in_range & poisoned_rows[idx.long().clamp(0, kv.shape[0] - 1)] & past  # [T, K]
    tokens = nan & suspect.any(-1)
    if not bool(tokens.any()):
        return ""
    t = int(tokens.nonzero()[0])
    j = int(suspect[t].nonzero()[0])
    return (f"token {t} has topk_length {int(length[t])} and its position {j}, past that length, holds kv row "
            f"{int(idx[t, j])}, which no valid entry selects (NaN): the kernel read past topk_length "
            f"({int(tokens.sum())} of {len(tokens)} tokens)")


def _read_invalid(kw: dict, tensor: str, got: torch.Tensor, want: torch.Tensor) -> str:
    """Where the kernel's NaN comes from when an invalid entry, read as the row a clamp makes of it
    (a negative one: row 0; one past the end: the last row), points at a poisoned row (no valid
    entry selects it): the token, the position and the value it holds."""
    idx, kv = kw["indices"].long(), kw["kv"]
    rows = kv.shape[0]
    if not rows:
        return ""
    valid = (idx >= 0) & (idx < rows)
    if kw["topk_length"] is not None:  # past a token's length is `_read_past_length`'s account
        valid |= torch.arange(idx.shape[1], device=idx.device)[None, :] >= kw["topk_length"][:, None]
    read = idx.clamp(0, rows - 1)
    return _nan_reads(got, want, ~valid & torch.isnan(kv).any(-1)[read], idx, read, "kv row", lambda t: f"token {t}", "tokens")


def _read_invalid_slot(kw: dict, tensor: str, got: torch.Tensor, want: torch.Tensor) -> str:
    """The decode form of `_read_invalid`: a -1 entry read as slot 0 (a clamp), a poisoned slot."""
    cache, idx = kw["kv_cache"], kw["indices"].long()
    batch, s_q, topk = idx.shape
    if not cache.numel():
        return ""
    poisoned = (cache == 0xFF).all(-1).reshape(-1)  # never-written slots: every byte 0xFF (NaN)
    flat, read = idx.reshape(-1, topk), idx.reshape(-1, topk).clamp(min=0)
    out = got.reshape(batch * s_q, -1) if tensor == "out" else got.transpose(1, 2).reshape(batch * s_q, -1)
    ref = want.reshape(batch * s_q, -1) if tensor == "out" else want.transpose(1, 2).reshape(batch * s_q, -1)
    return _nan_reads(out, ref, (flat == -1) & poisoned[read], flat, read, "slot",
                      lambda t: f"batch entry {t // s_q}" + (f", query position {t % s_q}," if s_q > 1 else ""),
                      "query rows")


def _nan_reads(got: torch.Tensor, want: torch.Tensor, suspect: torch.Tensor, idx: torch.Tensor, read: torch.Tensor,
               row: str, name_of: Callable[[int], str], rows_are: str) -> str:
    """The first row of `got` [R, ...] with NaN the reference lacks and an entry of `suspect` [R, K]
    (`idx` its value, `read` what the kernel read for it, both [R, K])."""
    nan = (torch.isnan(got.to(want.device)) & ~torch.isnan(want)).reshape(want.shape[0], -1).any(-1)
    rows = nan & suspect.any(-1)
    if not bool(rows.any()):
        return ""
    t = int(rows.nonzero()[0])
    j = int(suspect[t].nonzero()[0])
    return (f"{name_of(t)}'s position {j} holds {int(idx[t, j])}, read as {row} {int(read[t, j])}, which no valid entry "
            f"selects (NaN): the kernel reads invalid entries ({int(rows.sum())} of {len(rows)} {rows_are} read one)")


def _nan_sources(*explainers):
    def explain(kw: dict, tensor: str, got: torch.Tensor, want: torch.Tensor) -> str:
        return "; ".join(filter(None, (e(kw, tensor, got, want) for e in explainers)))
    return explain


def elem_bounds(res, topk, p, lse_of=lambda x: x, sink=None) -> dict[str, torch.Tensor]:
    """The derived per-element bounds (equivalence.judge.bounds) of out, lse and max_logits from a
    reference result with its magnitudes: BoundKey("NAME_bound"), and BoundKey("NAME_bound",
    DEVIATION) for each deviation whose kernels round the rows (DEQUANT_REL) and that applies to the case. `lse_of`
    lays an [.., H, ..] result out as the output's [..., H]; its inverse is a transpose as well."""
    exact = bounds.Exact(res.out, lse_of(res.lse), lse_of(res.max_logits), lse_of(res.logit_l1), res.out_abs,
                         res.value_abs)
    found = {}
    rels = {"": 0.0, **{name: rel for name, rel in bounds.DEQUANT_REL.items() if DEVIATIONS[name].applies(p.numerics())}}
    for deviation, rel in rels.items():
        b = bounds.attention_bounds(exact, topk, dequant_rel=rel, sink=sink)
        found.update({BoundKey("out_bound", deviation): b.out, BoundKey("lse_bound", deviation): lse_of(b.lse),
                      BoundKey("max_logits_bound", deviation): lse_of(b.max_logits)})
    return found


def _answer(res) -> dict[str, torch.Tensor]:
    """A reference result's compared tensors and scales (its magnitudes become the bounds)."""
    return {"out": res.out, "lse": res.lse, "max_logits": res.max_logits, "logit_l1": res.logit_l1}


def _prefill_reference(kw, p):
    res = reference.sparse_prefill(kw["q"], kw["kv"], kw["indices"], kw["sm_scale"], kw["topk_length"], kw["attn_sink"],
                                   magnitudes=True)
    # With a sink far above the logits an fp32 kernel's normalizer flushes to zero and the row may
    # come out 0: 1 / (1 + e^(sink - lse)) < 2**-126, or, normalizing by the max logit as FlashMLA
    # does (1 / (L + e^(sink - max_logit)), H200: rows with sink - max_logit > 126 ln 2 came out 0),
    # up to e^(lse - max_logit) <= K times sooner. The oracle tolerates that below 2**-126 of the
    # largest |V| (any |V| averaged is <= the cache's) times e^(lse - max_logit).
    # Per case: a stacked block's kv holds its cases' kv one after another, its tokens likewise.
    cases = kw["q"].shape[0] // p.tokens
    kv = kw["kv"][:, :512].float().nan_to_num(0.0).abs().reshape(cases, -1)
    value_max = (kv.amax(dim=1) if kv.shape[1] else kv.new_zeros(cases)).repeat_interleave(p.tokens)[:, None]
    spread = torch.where(torch.isfinite(res.lse), res.lse - res.max_logits, 0.0).exp()
    found = elem_bounds(res, kw["indices"].shape[-1], p, sink=kw["attn_sink"])
    return {**_answer(res), "value_max": value_max * spread, **found}


# Stacking saves launches, which small cases spend most on: a block whose float64 outputs would
# pass this is answered case by case (the stacked answer and its bounds are a few times as large).
STACK_BYTES = 512 << 20


def _worth_stacking(kwargs: list[dict]) -> bool:
    """Whether the cases' float64 outputs (512 values a query row of 576) fit STACK_BYTES."""
    return sum(kw["q"].numel() for kw in kwargs) // 576 * 512 * 8 <= STACK_BYTES


def _prefill_stack(kwargs: list[dict]) -> dict | None:
    """The prefill cases of a block as one: their tokens one after another, each case's kv rows
    after the previous case's and its valid entries moved with them (every invalid one -1). None
    with attention sinks (each case draws its own, and the reference takes one) or past
    STACK_BYTES."""
    if kwargs[0]["attn_sink"] is not None or not _worth_stacking(kwargs):
        return None
    rows = kwargs[0]["kv"].shape[0]
    indices = [torch.where((kw["indices"] >= 0) & (kw["indices"] < rows), kw["indices"].long() + i * rows, -1)
               for i, kw in enumerate(kwargs)]
    lengths = None if kwargs[0]["topk_length"] is None else torch.cat([kw["topk_length"] for kw in kwargs])
    return {"q": torch.cat([kw["q"] for kw in kwargs]), "kv": torch.cat([kw["kv"] for kw in kwargs]),
            "indices": torch.cat(indices), "sm_scale": kwargs[0]["sm_scale"], "topk_length": lengths, "attn_sink": None}


SPARSE_PREFILL = register(OpSpec(
    name="sparse_prefill",
    stage="sparse_prefill",
    params=PrefillParams,
    draw=lambda p: prefill_params(p, layout=st.sampled_from(LAYOUTS)),
    inputs=_prefill_inputs,
    reference=_prefill_reference,
    stack=_prefill_stack,
    call=returning(("out", "lse", "max_logits"), 2),
    checks=(Check("out", OUT, "value_max", dtype=torch.bfloat16, bound="out_bound"),
            Check("lse", LSE, "logit_l1", dtype=torch.float32, bound="lse_bound"),
            Check("max_logits", LSE, "logit_l1", optional=True, dtype=torch.float32, row_kind=RowKind.MAX_LOGITS,
                  bound="max_logits_bound")),
    knobs=lambda p: knobs(p, num_tokens=p.tokens, seq_len=p.kv_rows, cache_dtype="bfloat16"),
    explain_nan=_nan_sources(_read_past_length, _read_invalid),
    doc="flash_mla_sparse_fwd: bf16 q/kv rows, top-k row indices (invalid: <0 or >=N), topk_length, sink",
), priority=0)


def _decode_inputs(p: DecodeParams, seed: int, device: str) -> dict:
    # Shapes come from the params on the host: drawing the case reads nothing back from the device.
    g = generator(seed, device)
    batch, s_q, heads, topk, page = p.batch, p.s_q, p.heads, p.topk, p.page_size
    blocks = [-(-n // page) for n in p.seq_lens]
    num_blocks = sum(blocks) + 1
    # Each sequence's positions live in its own run of shuffled blocks: position p of the
    # sequence whose run starts at block f is physical slot slot[f * page + p].
    order = permutation(g, num_blocks, p.inputs)
    slot = (order[:, None] * page + torch.arange(page, device=device)).reshape(-1)
    start, length = host_values([[f * page for f in itertools.accumulate([0, *blocks[:-1]])], list(p.seq_lens)],
                                device)
    pos = torch.arange(max(p.seq_lens), device=device)
    at = (start[:, None] + pos).clamp_(max=slot.numel() - 1)  # past a sequence's end: any slot, masked next
    slots_of = torch.where(pos < length[:, None], slot[at], -1)
    idx = distinct_rows(g, slots_of.repeat_interleave(s_q, dim=0) if s_q > 1 else slots_of, topk)
    idx = apply_patterns(g, idx, p.invalid, last_valid=num_blocks * page - 1)
    storage = torch.full((num_blocks + 1, page + p.stride_pad, 656), 0xFF, dtype=torch.uint8, device=device)
    cache = storage[:-1, :page]  # the padded stride stays; the last block is fill_selected_slots' scratch
    # Write only the selected slots: every other byte stays NaN.
    fill_selected_slots(g, storage, page, idx, p.value_regime, "fp8_ds_mla", p.scale_rule)
    q = q_values(g, (batch, s_q, heads, 576), p.value_regime, p.inputs)
    return relayout("sparse_decode_fp8", {"q": q, "kv_cache": cache, "indices": idx.view(batch, s_q, topk).to(torch.int32),
                                          "sm_scale": p.sm_scale}, p.layout)


def _decode_reference(kw, p):
    res = reference.sparse_decode_fp8(kw["q"], kw["kv_cache"], kw["indices"], kw["sm_scale"], magnitudes=True)
    found = elem_bounds(res, kw["indices"].shape[-1], p, lse_of=lambda x: x.transpose(1, 2))  # [B, H, S] <-> [B, S, H]
    found = {key: t for key, t in found.items() if key.name != "max_logits_bound"}  # not compared: the op returns none
    return {**_answer(res), **found}


def _decode_stack(kwargs: list[dict]) -> dict | None:
    """The decode cases of a block as one batch: their requests one after another, over one cache
    of the rows their entries select, in entry order (page size 1: entry j of the stacked indices
    reads row j, and stays -1 where the case's is -1). The same problems, byte for byte; only the
    selected rows move, not each case's whole, mostly poisoned cache. None past STACK_BYTES."""
    if not _worth_stacking(kwargs):
        return None
    rows, indices, start = [], [], 0
    for kw in kwargs:
        cache, idx = kw["kv_cache"], kw["indices"].long()
        blocks, page, width = cache.shape
        stride = cache.stride(0) // cache.stride(1)  # rows from one block to the next, padding included
        words = cache.view(torch.int64).as_strided((blocks * stride, width // 8), (width // 8, 1))
        slot = idx.reshape(-1).clamp(min=0)
        rows.append(words[slot + slot.div(page, rounding_mode="floor") * (stride - page)])
        entries = torch.arange(start, start + idx.numel(), device=idx.device).view(idx.shape)
        indices.append(torch.where(idx >= 0, entries, -1))
        start += idx.numel()
    stacked = torch.cat(rows).view(torch.uint8)
    return {"q": torch.cat([kw["q"] for kw in kwargs]), "kv_cache": stacked.view(-1, 1, stacked.shape[-1]),
            "indices": torch.cat(indices), "sm_scale": kwargs[0]["sm_scale"]}


SPARSE_DECODE_FP8 = register(OpSpec(
    name="sparse_decode_fp8",
    stage="sparse_decode_fp8",
    params=DecodeParams,
    draw=lambda p: decode_params(p, layout=st.sampled_from(LAYOUTS)),
    inputs=_decode_inputs,
    reference=_decode_reference,
    stack=_decode_stack,
    call=returning(("out", "lse"), 2),
    checks=(Check("out", OUT, dtype=torch.bfloat16, bound="out_bound"),
            Check("lse", LSE, "logit_l1", dtype=torch.float32, bound="lse_bound")),
    knobs=lambda p: knobs(p, num_tokens=p.batch * p.s_q, seq_len=max(p.seq_lens), block_size=p.page_size,
                          cache_dtype="fp8_ds_mla"),
    explain_nan=_read_invalid_slot,
    doc="flash_mla_with_kvcache sparse decode on 656-byte fp8_ds_mla pages; indices are physical slots, -1 only invalid",
), priority=0)
