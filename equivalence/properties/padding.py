"""padding_and_order: what pads or reorders a problem without changing it changes nothing.

Checks (each against the plain problem's answer, on the rows and heads it has):
    wider_k        extra invalid entries at random places in every row (prefill: -1, other
                   negatives, rows past the end; decode: -1), K grown by a multiple of 128 / 64
    permuted       every row's entries shuffled (prefill: within its topk_length)
    padded_heads   extra query heads of zeros (what the FlashMLA wrappers add up to 64 / 128)
    padded_tokens  extra query rows after the real ones: live rows, or all-invalid ones (CUDA-graph
                   padding of a decode batch)
    topk_length    prefill: topk_length = n against the row with its tail past n set to -1 and no
                   topk_length (FlashMLA's tests compare these bit for bit)
    block_table    forward_mqa: extra block-table columns (the null block or any block) that no
                   index reaches
All but the last two hold to rounding: they regroup or reorder the same sums (decode: another
split of the top-k list). topk_length and block_table hand the kernels identical work and are
held bit for bit (equivalence.judge.policy.PROPERTY_RULES).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from hypothesis import strategies as st

from mla_verify.equivalence.cases.batch import make_batch

from ..cases.draws import decode_params, forward_params, prefill_params
from ..cases.profiles import Profile
from ..cases.schema import Int, OneOf, param
from ..spec import register
from .base import PropertySpec, Target
from .common import (
    PIPELINE_STAGES,
    attention,
    decode,
    decode_knobs,
    decode_problem,
    decode_scale,
    forward,
    forward_knobs,
    forward_scale,
    forward_stages,
    insert_entries,
    on,
    permute_entries,
    prefill,
    prefill_fill,
    prefill_knobs,
    prefill_problem,
    prefill_scale,
    rewrite_generator,
)


class Variant(NamedTuple):
    check: str
    kw: dict                          # the padded or reordered problem
    rows: int | None = None           # compare only its first rows ...
    heads: int | None = None          # ... and heads
    against: dict | None = None       # the problem it must equal, when not the plain one
    scale: torch.Tensor | None = None  # the logit scale of `against`


def _zero_heads(x: torch.Tensor, extra: int) -> torch.Tensor:
    """x [..., H, D] with `extra` zero heads appended."""
    return torch.cat([x, x.new_zeros((*x.shape[:-2], extra, x.shape[-1]))], dim=-2)


@dataclass(frozen=True)
class Padding:
    """The padding: extra tokens (live or all-invalid rows), heads, top-k width, table columns."""

    pad_tokens: int = param(Int(1, 1024), 1)
    # the padded tokens' top-k rows: live ones, or all invalid (ForwardParams.pad_rows is a count)
    pad_token_rows: str = param(OneOf("live", "empty"), "live")
    pad_heads: int = param(Int(0, 128), 0)
    wider: int = param(Int(1, 2**14), 128)               # extra top-k entries, a multiple of FlashMLA's unit
    pad_columns: int = param(Int(1, 64), 1)              # forward_mqa: extra block-table columns ...
    pad_fill: str = param(OneOf("null", "blocks"), "null")  # ... holding the null block or any block

    @property
    def requests(self) -> int:
        """decode: the padded batch's requests, which seq_lens holds one length each of."""
        return self.batch + self.pad_tokens


def _prefill_inputs(p, seed: int, device: str) -> dict:
    tokens, extra_tokens = p.tokens, p.pad_tokens
    full = prefill_problem(p.replace(tokens=tokens + extra_tokens), seed, device)
    gen = rewrite_generator(seed)
    rows = full["kv"].shape[0]
    if p.pad_token_rows == "empty":
        full["indices"][tokens:] = prefill_fill(gen, (extra_tokens, full["indices"].shape[1]), rows).to(full["indices"].device)
    base = {**full, "q": full["q"][:tokens], "indices": full["indices"][:tokens],
            "topk_length": None if full["topk_length"] is None else full["topk_length"][:tokens]}
    idx = base["indices"].cpu()
    lengths = None if base["topk_length"] is None else base["topk_length"].cpu()
    topk = idx.shape[1]
    wider, wider_lengths = insert_entries(gen, idx, prefill_fill(gen, (tokens, p.wider), rows), lengths)
    variants = [
        Variant("wider_k", {**base, **on(device, indices=wider, topk_length=wider_lengths)}),
        Variant("permuted", {**base, **on(device, indices=permute_entries(gen, idx, lengths))}),
        Variant("padded_tokens", full, rows=tokens),
    ]
    if p.pad_heads:
        sink = base["attn_sink"]
        padded = {**base, "q": _zero_heads(base["q"], p.pad_heads),
                  "attn_sink": None if sink is None else torch.cat([sink, sink.new_zeros(p.pad_heads)])}
        variants.append(Variant("padded_heads", padded, heads=p.heads))
    # topk_length = n against -1 past n: the plain problem's lengths, or lengths drawn here.
    if lengths is None:
        cut = torch.randint(0, topk + 1, (tokens,), generator=gen, dtype=torch.int32)
        with_lengths = {**base, **on(device, topk_length=cut)}
        against = {"against": with_lengths, "scale": prefill_scale(with_lengths)}
    else:
        cut, against = lengths, {}
    tail = torch.where(torch.arange(topk)[None, :] < cut[:, None].long(), idx, -1)
    variants.append(Variant("topk_length", {**base, **on(device, indices=tail, topk_length=None)}, **against))
    return {"run": prefill, "base": base, "variants": variants, "scale": prefill_scale(base)}


def _decode_inputs(p, seed: int, device: str) -> dict:
    batch, extra = p.batch, p.pad_tokens
    full = decode_problem(p.replace(batch=batch + extra), seed, device)
    if p.pad_token_rows == "empty":
        full["indices"][batch:] = -1
    base = {**full, "q": full["q"][:batch], "indices": full["indices"][:batch]}
    gen = rewrite_generator(seed)
    shape = base["indices"].shape
    idx = base["indices"].cpu().reshape(-1, shape[-1])
    wider, _ = insert_entries(gen, idx, torch.full((idx.shape[0], p.wider), -1), None)
    variants = [
        Variant("wider_k", {**base, **on(device, indices=wider.view(*shape[:2], -1))}),
        Variant("permuted", {**base, **on(device, indices=permute_entries(gen, idx).view(shape))}),
        Variant("padded_tokens", full, rows=batch * p.s_q),
    ]
    if p.pad_heads:
        variants.append(Variant("padded_heads", {**base, "q": _zero_heads(base["q"], p.pad_heads)}, heads=p.heads))
    return {"run": decode, "base": base, "variants": variants, "scale": decode_scale(base)}


def _forward_inputs(p, seed: int, device: str) -> dict:
    if {"out_of_range", "boundaries"} & set(p.invalid):
        raise ValueError("block_table: out_of_range / boundaries top-k entries would reach the added columns")
    batch = make_batch(p, seed, device)
    gen = rewrite_generator(seed)
    table = batch.block_table
    shape = (table.shape[0], p.pad_columns)
    fill = (torch.zeros(shape, dtype=table.dtype) if p.pad_fill == "null"
            else torch.randint(0, batch.kv_cache.shape[0], shape, generator=gen, dtype=table.dtype))
    padded = torch.cat([table, fill.to(table.device)], dim=1)

    def run(stages, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return forward(stages, batch, **config)

    return {"run": run, "base": {}, "variants": [Variant("block_table", {"block_table": padded})],
            "scale": forward_scale(batch, p.sm_scale)}


def _check(inputs: dict, p, stages) -> list:
    run = inputs["run"]
    plain = run(stages, inputs["base"])
    compared = []
    for v in inputs["variants"]:
        got = tuple(t[: v.rows, : v.heads] for t in run(stages, v.kw))
        want, scale = (plain, inputs["scale"]) if v.against is None else (run(stages, v.against), v.scale)
        compared += attention(v.check, got, want, scale)
    return compared


MAX_HEADS = 128              # FlashMLA's largest head count (the wrappers pad to 64 or 128)
TOPK_UNIT = {"sparse_prefill": 128, "sparse_decode_fp8": 64}  # FlashMLA's top-k granularity


@st.composite
def _padding(draw, params: st.SearchStrategy[dict], target: str) -> dict:
    """Base problem plus padding knobs; decode draws the padded batch and keeps its first rows."""
    d = draw(params)
    if target == "sparse_decode_fp8":
        extra = draw(st.integers(1, d["batch"] - 1))
        d = {**d, "batch": d["batch"] - extra, "pad_tokens": extra}
    else:
        d = {**d, "pad_tokens": draw(st.integers(1, 3))}
    return {**d, "pad_token_rows": draw(st.sampled_from(("live", "empty"))),
            "pad_heads": draw(st.integers(min(1, MAX_HEADS - d["heads"]), min(16, MAX_HEADS - d["heads"]))),
            "wider": TOPK_UNIT[target] * draw(st.integers(1, 2))}


def _block_table(p: Profile) -> st.SearchStrategy[dict]:
    batches = st.sampled_from(("bf16", "fp8_mixed", "fp8_separate")).flatmap(lambda path: forward_params(p, path))
    # Top-k entries past the table would reach the added columns: no out_of_range or boundaries pattern.
    return st.tuples(batches, st.integers(1, 3), st.sampled_from(("null", "blocks"))).map(lambda t: {
        **t[0], "invalid": [i for i in t[0]["invalid"] if i not in ("out_of_range", "boundaries")], "pad_columns": t[1],
        "pad_fill": t[2]})


register(PropertySpec(
    short="padding_and_order",
    checks=("wider_k", "permuted", "padded_heads", "padded_tokens", "topk_length", "block_table"),
    own_params=Padding,
    targets={
        "sparse_prefill": Target("sparse_prefill", lambda p: ["sparse_prefill"], ("sparse_prefill",),
                                 _prefill_inputs, _check, prefill_knobs,
                                 lambda p: _padding(prefill_params(p), "sparse_prefill"),
                                 # plain, wider_k (up to 3x the entries), permuted, padded tokens and heads, topk_length twice
                                 runs=lambda p: 8),
        "sparse_decode_fp8": Target("sparse_decode_fp8", lambda p: ["sparse_decode_fp8"], ("sparse_decode_fp8",),
                                    _decode_inputs, _check, decode_knobs,
                                    lambda p: _padding(decode_params(p, batch=st.integers(2, max(2, p.max_tokens // 2 + 1))),
                                                       "sparse_decode_fp8"),
                                    runs=lambda p: 6),  # plain, wider_k (up to 3x), permuted, padded tokens and heads
        "forward_mqa": Target("forward_mqa", forward_stages, PIPELINE_STAGES, _forward_inputs, _check, forward_knobs,
                              _block_table),
    },
    doc="wider K with invalid entries, permuted entries, padded heads / tokens / block table change nothing "
        "beyond rounding; topk_length = n equals -1 past n bit for bit",
), priority=103)
