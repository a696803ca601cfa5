"""DeepSeek V4 / V4.1's union decode contracts: one softmax over the main list (serving: the
sliding window) and the extra list (the compressed entries), with a sink.

A case poses what serving poses: request b's query tokens sit at positions positions[b] - S + 1
.. positions[b]; a token at `pos` has a window of min(pos + 1, topk) slots and sees
min((pos + 1) // compress_ratio, extra_topk) compressed entries (ratio 4: the indexer's random
picks; ratio 128: every entry, dense). Lengths are per request (`lengths`: "exact" as serving
sets them, "edges" drawn from 0, 1 and the full width, "none": -1 tails only); entries past a
length hold slots never written, so a kernel that reads one shows NaN. Invalid entries are -1
only (`invalid`: scattered inside rows, whole rows, duplicates). Every slot no counted entry
selects is poisoned (all bytes 0xFF: NaN in every format). `special_tiles` writes the first
counted row of each cache with its first 128 dims -0 (NaN tiles are the writers' cases: a NaN in
a counted row is NaN in every output it reaches).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from mla_verify import reference
from mla_verify.equivalence.judge.policy import LSE, OUT
from mla_verify.equivalence.cases.values import kv_values, q_values

from ..cases.draws import lengths as drawn_lengths, patterns, regimes, sm_scales
from ..cases.params import DECODE_PATTERNS, REGIME
from ..cases.patterns import apply_patterns
from ..cases.profiles import Profile
from ..cases.schema import BLOCK, HEADS, SM_SCALE, TOPK, Flag, Int, Ints, OneOf, Params, SubsetOf, param
from ..spec import register
from .attention import elem_bounds, returning
from .base import Check, OpSpec
from .common import generator, host_values, knobs, rand, randint

FP8_FORMATS = ("V4", "V41")
EXTRA_FORMATS = ("V4", "V41", "V41_FP4")
SCALE_RULES = ("pow2", "pow2_amax")
WIDTH = {"V4": 584, "V41": 528, "V41_FP4": 288}
# Each union decode op's main cache format and the extra formats it reads.
FORMATS_OF = {"sparse_decode_v4": ("V4", ("V4",)), "sparse_decode_v41": ("V41", ("V41", "V41_FP4"))}
ROW_DIM = 512


@dataclass(frozen=True)
class UnionDecodeParams(Params):
    """B requests of S query tokens over a main cache and (extra_topk > 0) an extra cache."""

    batch: int = param(Int(1, 4096))
    s_q: int = param(Int(1, 64))
    heads: int = param(HEADS)
    topk: int = param(TOPK)                        # the main list's width (serving: the window, 128)
    extra_topk: int = param(Int(0, 2**14))         # the extra list's width; 0: no extra cache
    positions: tuple[int, ...] = param(Ints(0, 2**22, 4096))  # each request's last query position
    block_size: int = param(BLOCK)
    extra_block_size: int = param(BLOCK)
    kv_format: str = param(OneOf(*FP8_FORMATS))
    extra_format: str = param(OneOf(*EXTRA_FORMATS))
    compress_ratio: int = param(OneOf(4, 128))     # 4: the indexer's picks; 128: every entry (dense)
    lengths: str = param(OneOf("exact", "edges", "none"))
    sm_scale: float = param(SM_SCALE)
    value_regime: str = param(REGIME)
    scale_rule: str = param(OneOf(*SCALE_RULES))
    invalid: tuple[str, ...] = param(SubsetOf(*DECODE_PATTERNS), ())
    sink: str = param(OneOf("none", "finite", "inf"), "none")
    special_tiles: bool = param(Flag(), False)     # tiles of -0 in a counted row
    page_gap: int = param(Int(0, 64), 0)           # 16-byte units between blocks past the allocation

    def elements(self) -> int:
        rows = self.batch * self.s_q
        caches = (rows + 1) * (self.topk * WIDTH[self.kv_format] + self.extra_topk * WIDTH[self.extra_format])
        return caches + rows * (self.heads * 1024 + 2 * (self.topk + self.extra_topk))

    def problem(self) -> str | None:
        if len(self.positions) != self.batch:
            return "positions must hold one position per request (batch)"
        if (self.kv_format, self.extra_format) not in (("V4", "V4"), ("V41", "V41"), ("V41", "V41_FP4")):
            return f"{self.kv_format} with an extra cache in {self.extra_format}: not a valid pair"
        if min(self.positions) < self.s_q - 1:
            return "a request's first query token would sit before position 0"
        return None


def union_decode_params(p: Profile, kv_format: str, extra_formats: tuple[str, ...],
                        s_q: tuple[int, ...] = (1, 2, 4), min_batch: int = 1) -> st.SearchStrategy[dict]:
    """Union decode params within `p`: the window of 64 or 128, the extra list any of the profile's
    decode widths, a partial 64-entry block or none; `s_q` the query tokens a request may have,
    `min_batch` the fewest requests."""
    def params(batch: int) -> st.SearchStrategy[dict]:
        return st.fixed_dictionaries({
            "batch": st.just(batch), "s_q": st.sampled_from(s_q), "heads": st.sampled_from(p.heads),
            "topk": st.sampled_from((64, 128)), "extra_topk": st.sampled_from((0, 100) + p.decode_topk),
            "positions": drawn_lengths(batch, p.max_context).map(lambda ps: [x + 3 for x in ps]),
            "block_size": st.sampled_from((1, 5, 61) + p.block_sizes),
            "extra_block_size": st.sampled_from((2, 53) + p.block_sizes),
            "kv_format": st.just(kv_format), "extra_format": st.sampled_from(extra_formats),
            "compress_ratio": st.sampled_from((4, 128)), "lengths": st.sampled_from(("exact", "edges", "none")),
            "sm_scale": sm_scales, "value_regime": regimes, "scale_rule": st.sampled_from(SCALE_RULES),
            "invalid": patterns(DECODE_PATTERNS), "sink": st.sampled_from(("none", "finite", "inf")),
            "special_tiles": st.booleans(), "page_gap": st.sampled_from((0, 1))})

    return st.integers(min_batch, max(min_batch, 2, p.max_tokens // 8)).flatmap(params)


def latent_rows(g: torch.Generator, n: int, p: UnionDecodeParams) -> torch.Tensor:
    """[n, 512] bf16 rows in the case's regime, every 16-dim tile of half the rows scaled by its own
    power of two (tile scales that differ show a kernel reading a neighbour's)."""
    x = kv_values(g, n, p.value_regime)[:, :ROW_DIM].float()
    power = randint(g, -1, 2, n, ROW_DIM // 16).float() * (rand(g, n, 1) < 0.5)
    x = (x.view(n, ROW_DIM // 16, 16) * torch.exp2(power)[..., None]).view(n, ROW_DIM)
    if p.special_tiles and n:
        x[0, :128] = -0.0  # whole tiles of signed zeros in every format
    return x.to(torch.bfloat16)


def _list(g, p: UnionDecodeParams, width: int, counts: torch.Tensor, lengths: torch.Tensor | None,
          dense: bool) -> tuple[torch.Tensor, int]:
    """([B*S, width] int64 slots, the first never-written slot): row r's first counts[r] entries
    distinct slots (dense: in order), then -1; the `invalid` patterns; past its request's length,
    never-written slots."""
    rows = counts.shape[0]
    live = torch.arange(width, device=counts.device)[None, :] < counts[:, None]
    used = int(counts.sum())
    slots = torch.arange(used, device=counts.device) if dense else torch.argsort(rand(g, used))
    idx = torch.full((rows, width), -1, dtype=torch.long, device=counts.device)
    idx[live] = slots
    idx = apply_patterns(g, idx, p.invalid, last_valid=max(used - 1, 0))
    if lengths is not None:
        past = torch.arange(width, device=counts.device)[None, :] >= lengths.repeat_interleave(p.s_q)[:, None]
        idx = torch.where(past, used + randint(g, 0, width, rows, width), idx)
    return idx, used


def _lengths(g, p: UnionDecodeParams, counts: torch.Tensor, width: int) -> torch.Tensor | None:
    """Per request: its last row's count ("exact"), 0 / 1 / width ("edges"), or none."""
    if p.lengths == "none":
        return None
    if p.lengths == "edges":
        return host_values([0, 1, width], counts.device)[randint(g, 0, 3, p.batch)]
    return counts.view(p.batch, p.s_q)[:, -1]


def _cache(g, p: UnionDecodeParams, fmt: str, block: int, idx: torch.Tensor, used: int, lengths,
           width: int) -> torch.Tensor:
    """A cache of the `used` slots the lists may count and `width` never-written ones after them
    (the garbage past lengths), blocks `page_gap` 16-byte units apart beyond the allocation; only
    counted slots written."""
    capacity = used + width
    blocks = -(-capacity // block)
    alloc = reference.allocate_cache(1, block, fmt).stride(0) + 16 * p.page_gap
    storage = torch.full((blocks * alloc,), 0xFF, dtype=torch.uint8, device=idx.device)
    cache = storage.as_strided((blocks, block, WIDTH[fmt]), (alloc, WIDTH[fmt], 1))
    counted = idx
    if lengths is not None:
        past = torch.arange(width, device=idx.device)[None, :] >= lengths.repeat_interleave(p.s_q)[:, None]
        counted = idx.masked_fill(past, -1)
    slots = counted[counted >= 0].unique()
    reference.write_v4_cache(latent_rows(g, slots.numel(), p), cache, slots, p.scale_rule, kv_format=fmt)
    return cache


def _counts(p: UnionDecodeParams, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(window, compressed entries seen) of every query row, b-major."""
    last = host_values(list(p.positions), device).repeat_interleave(p.s_q)
    pos = last - (p.s_q - 1) + torch.arange(p.s_q, device=last.device).repeat(p.batch)
    return (pos + 1).clamp(max=p.topk), ((pos + 1) // p.compress_ratio).clamp(max=p.extra_topk)


def union_decode_inputs(p: UnionDecodeParams, seed: int, device: str) -> dict:
    g = generator(seed, device)
    window, seen = _counts(p, device)
    length = _lengths(g, p, window, p.topk)
    idx, used = _list(g, p, p.topk, window, length, dense=False)
    kw = {"q": q_values(g, (p.batch, p.s_q, p.heads, 576), p.value_regime)[..., :ROW_DIM].contiguous(),
          "kv_cache": _cache(g, p, p.kv_format, p.block_size, idx, used, length, p.topk),
          "indices": idx.view(p.batch, p.s_q, p.topk).to(torch.int32), "sm_scale": p.sm_scale,
          "topk_length": None if length is None else length.to(torch.int32),
          "extra_kv_cache": None, "extra_indices": None, "extra_topk_length": None, "attn_sink": None}
    if p.extra_topk:
        xlength = _lengths(g, p, seen, p.extra_topk)
        xidx, xused = _list(g, p, p.extra_topk, seen, xlength, dense=p.compress_ratio == 128)
        kw.update(extra_kv_cache=_cache(g, p, p.extra_format, p.extra_block_size, xidx, xused, xlength, p.extra_topk),
                  extra_indices=xidx.view(p.batch, p.s_q, p.extra_topk).to(torch.int32),
                  extra_topk_length=None if xlength is None else xlength.to(torch.int32))
    if p.sink != "none":
        sink = torch.randn(p.heads, generator=g, device=device)
        if p.sink == "inf":
            sink.masked_fill_(rand(g, p.heads) < 0.3, float("inf"))
            sink.masked_fill_(rand(g, p.heads) < 0.3, float("-inf"))
        kw["attn_sink"] = sink
    return kw


def _largest_counted(kw: dict, cache: str, indices: str, length: str) -> float:
    """The largest |value| of the rows a list counts (0 without the list)."""
    if kw[cache] is None:
        return 0.0
    idx = kw[indices].long()
    if kw[length] is not None:
        idx = idx.masked_fill(torch.arange(idx.shape[-1], device=idx.device) >= kw[length][:, None, None], -1)
    slots = idx[idx >= 0].unique()
    values = reference.slot_values(kw[cache], reference.page_format(kw[cache]), slots)
    return float(values.nan_to_num(0.0).abs().max()) if values.numel() else 0.0


def union_decode_reference(kw: dict, p: UnionDecodeParams) -> dict:
    main, extra = reference.lists_of(kw)
    res = reference.sparse_decode_union(kw["q"], main, kw["sm_scale"], extra, kw["attn_sink"], magnitudes=True)
    width = kw["indices"].shape[-1] + (0 if kw["extra_indices"] is None else kw["extra_indices"].shape[-1])
    to_rows = lambda x: x.transpose(1, 2)  # noqa: E731  [B, H, S] <-> [B, S, H]
    found = elem_bounds(res, width, p, lse_of=to_rows, sink=kw["attn_sink"])
    # A sink far above the logits flushes an fp32 kernel's normalizer (see ops.attention's prefill):
    # tolerated below 2**-126 of the largest |V| the rows hold, times e^(lse - max_logit).
    largest = max(_largest_counted(kw, "kv_cache", "indices", "topk_length"),
                  _largest_counted(kw, "extra_kv_cache", "extra_indices", "extra_topk_length"))
    spread = torch.where(torch.isfinite(res.lse), res.lse - res.max_logits, 0.0).exp()
    return {"out": res.out, "lse": res.lse, "max_logits": res.max_logits, "logit_l1": res.logit_l1,
            "value_max": largest * to_rows(spread),
            **{key: t for key, t in found.items() if key.name != "max_logits_bound"}}


def _explain_past_length(kw: dict, tensor: str, got: torch.Tensor, want: torch.Tensor) -> str:
    """A NaN the reference lacks, when a request's entry past its length names a never-written
    slot: the request, the list and the first such position."""
    batch, s_q = kw["q"].shape[:2]
    nan = (torch.isnan(got.to(want.device)) & ~torch.isnan(want))
    nan = nan.reshape(batch, -1).any(-1)
    for name, length in (("indices", "topk_length"), ("extra_indices", "extra_topk_length")):
        if kw[length] is None or not bool(nan.any()):
            continue
        past = torch.arange(kw[name].shape[-1], device=nan.device)[None, :] >= kw[length][:, None]
        hit = nan & past.any(-1)
        if bool(hit.any()):
            b = int(hit.nonzero()[0])
            j = int(kw[length][b])
            return (f"request {b} has {length} {j}; its {name} past that hold never-written slots (NaN): the "
                    f"kernel read past the length ({int(hit.sum())} of {batch} requests)")
    return ""


def _spec(name: str, doc: str) -> OpSpec:
    return OpSpec(
        name=name, stage=name, params=UnionDecodeParams,
        draw=lambda p: union_decode_params(p, *FORMATS_OF[name]),
        inputs=union_decode_inputs, reference=union_decode_reference,
        call=returning(("out", "lse"), 2),
        checks=(Check("out", OUT, "value_max", dtype=torch.bfloat16, bound="out_bound"),
                Check("lse", LSE, "logit_l1", dtype=torch.float32, bound="lse_bound")),
        knobs=lambda p: knobs(p, num_tokens=p.batch * p.s_q, seq_len=max(p.positions) + 1, block_size=p.block_size,
                              cache_dtype=f"{p.kv_format}+{p.extra_format if p.extra_topk else 'none'}"),
        explain_nan=_explain_past_length, doc=doc)


SPARSE_DECODE_V4 = register(_spec(
    "sparse_decode_v4",
    "DeepSeek V4 decode: one softmax over the main (window) and extra (compressed) lists of 584-byte V4 pages, "
    "lengths per request, -1 only invalid, a sink"), priority=0)
SPARSE_DECODE_V41 = register(_spec(
    "sparse_decode_v41",
    "DeepSeek V4.1 decode: the union over 528-byte V4.1 pages, the extra cache V4.1 or 288-byte FP4 (SM100 kernels)"),
    priority=0)
