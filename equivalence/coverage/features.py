"""The features each op lists for its covering set (`equivalence.coverage.sets`), the candidates it
proposes, and how its built inputs show what a case hits.

Candidates are small on purpose (a covering case runs in every CI campaign): each template asks
for several features at once, at the profile's smallest head count and top-k where the feature
allows, and comes in a few seeded variants, since a feature is only counted where the tensors
built show it (a drawn start may repeat, a drawn length may miss 0).
"""

from __future__ import annotations

import random

import torch

from mla_verify import reference
from mla_verify.reference.attention import cache_row_values

from ..cases.layouts import LAYOUTS
from ..cases.profiles import OFF_TABLE_TOPK, PRODUCTION_HEADS, PRODUCTION_TOPK, Profile
from .pairs import Factor, Row
from .registry import Coverage, Pairs, laid_out, register

VARIANTS = 4  # seeded variants of each template: the greedy pick takes one whose tensors hit
LAYOUT = ("q and indices in padded rows", "q permuted (leading dims reversed)", "inputs at a storage offset")


def _layout_hits(kw: dict) -> set[str]:
    """The non-contiguous layouts (equivalence.cases.layouts) q and the indices show."""
    q, idx = kw["q"], kw["indices"]
    return {name for name, yes in (
        ("q and indices in padded rows", q.stride(-2) > q.shape[-1] and idx.stride(-2) > idx.shape[-1]),
        ("q permuted (leading dims reversed)", q.stride(0) < q.stride(1)),
        ("inputs at a storage offset", q.storage_offset() > 0 and idx.storage_offset() > 0),
    ) if yes}


def _units(topks: tuple[int, ...], odd: bool) -> list[int]:
    """The top-k values of `topks` ending on half a 128 unit (`odd`) or on a whole one."""
    return [k for k in topks if (k % 128 == 64) == odd]


def _duplicates(idx: torch.Tensor) -> bool:
    """Whether a row of `idx` repeats a non-negative entry."""
    if idx.shape[-1] < 2:
        return False
    rows = idx.reshape(-1, idx.shape[-1]).sort(dim=1).values
    return bool(((rows[:, 1:] == rows[:, :-1]) & (rows[:, 1:] >= 0)).any())


DEGENERATE = ("tied logits (a zero q row over two or more valid entries)", "an all-zero q row")


def degenerate_hits(q: torch.Tensor, valid: torch.Tensor) -> set[str]:
    """From q [..., rows sharing an index row, 576] and the valid entries per index row [..., k]
    (the leading dims equal): a zero q row, and one whose index row has two or more valid entries
    (every logit of it 0: all equal)."""
    zero = (q == 0).all(-1)
    tied = zero & (valid.sum(-1) >= 2)[..., None]
    return {name for name, yes in ((DEGENERATE[0], bool(tied.any())), (DEGENERATE[1], bool(zero.any()))) if yes}


FLAT = "flat softmax rows (128 or more near-equal logits)"
FLAT_SPREAD = 1.0   # a row's logits within this of each other (every e^(s - max) above 1/e) ...
FLAT_KEYS = 128     # ... over at least this many valid entries


def flat_hit(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sm_scale: float) -> set[str]:
    """{FLAT} where a query row of q [R, H, 576] has FLAT_KEYS or more valid keys (keys [R, K, 576],
    valid [R, K]) whose logits lie within FLAT_SPREAD of each other (its first head)."""
    logits = sm_scale * torch.einsum("rd,rkd->rk", q[:, 0].double(), torch.where(valid[..., None], keys, 0).double())
    spread = logits.masked_fill(~valid, -torch.inf).amax(1) - logits.masked_fill(~valid, torch.inf).amin(1)
    return {FLAT} if bool(((valid.sum(1) >= FLAT_KEYS) & (spread <= FLAT_SPREAD)).any()) else set()


RUN = "a run of -1 before a valid entry (leading or inside a row)"
GARBAGE = "out-of-range values, not -1, past topk_length"


def run_hit(rows: torch.Tensor) -> set[str]:
    """{RUN} where an index row [..., K] holds two -1 in a row before a valid (non-negative) entry:
    -1 not only trailing, as an indexer pads."""
    rows = rows.reshape(-1, rows.shape[-1])
    k = rows.shape[1]
    if k < 3:
        return set()
    pos = torch.arange(k, device=rows.device)
    pair = (rows[:, :-1] == -1) & (rows[:, 1:] == -1)
    start = torch.where(pair, pos[:-1], k).amin(1)
    last = torch.where(rows >= 0, pos, -1).amax(1)
    return {RUN} if bool((start < last).any()) else set()


def _heads(p: Profile) -> tuple[int, ...]:
    """The head counts a profile's pairs cover: its own and production's."""
    return tuple(sorted({*p.heads, *PRODUCTION_HEADS}))


# --- convert_index -------------------------------------------------------------------------------

CONVERT = ("batch > 1", "> 64 tokens", "row with no valid index", "negatives other than -1", "index past the table",
           "duplicate indices", "two prefill requests, distinct workspace starts", "decode and prefill tokens",
           "block stride != block size", "valid counts of a partial row", "idx_mapping with an unmapped request",
           "top-k % 128 == 64", "top-k % 128 == 0", "top-k past one tile", RUN)


def _convert_candidates(rng: random.Random, p: Profile) -> list[dict]:
    odd, even = _units(p.decode_topk, True), _units(p.decode_topk, False) or [128]
    found = []
    for _ in range(VARIANTS):
        found += [
            # Two or more prefill requests (the converter's num_prefills = requests // 2), counts.
            {"tokens": rng.randint(8, 12), "requests": rng.randint(4, 5), "table_width": rng.randint(2, 4),
             "topk": rng.choice(odd or even), "block_size": rng.choice(p.block_sizes), "stride_extra": 1,
             "prefill": True, "counts": True, "mapping": False,
             "invalid": ["out_of_range", "whole_row", "runs", "negatives"]},  # -1s first: negatives replaces some
            # Past 64 tokens, several requests through an idx_mapping, duplicates.
            {"tokens": rng.randint(65, 72), "requests": 3, "table_width": rng.randint(1, 3),
             "topk": rng.choice(even), "block_size": 16, "stride_extra": 0, "prefill": False, "counts": False,
             "mapping": True, "invalid": ["duplicates", "boundaries"]},
            # A row over several tiles (not a power of two past upstream's single-tile limit).
            {"tokens": 2, "requests": 1, "table_width": 2, "topk": 4224, "block_size": 64, "stride_extra": 64,
             "prefill": False, "counts": True, "mapping": False, "invalid": ["scattered"]},
        ]
    return found


def _convert_hits(p, kw: dict) -> set[str]:
    req, idx, table, bs = kw["req_id"], kw["topk_indices"], kw["block_table"], kw["block_size"]
    out = reference.convert_index(**{**kw, "return_valid_counts": False})
    k = idx.shape[1]
    hit = run_hit(idx) | {name for name, yes in (
        ("batch > 1", req.unique().numel() > 1), ("> 64 tokens", req.numel() > 64),
        ("row with no valid index", bool((out < 0).all(1).any())),
        ("negatives other than -1", bool((idx < -1).any())),
        ("index past the table", bool((idx >= table.shape[1] * bs).any())),
        ("duplicate indices", _duplicates(idx)),
        ("block stride != block size", kw["block_stride_rows"] not in (None, bs)),
        ("top-k % 128 == 64", k % 128 == 64), ("top-k % 128 == 0", k % 128 == 0),
        ("top-k past one tile", k & (k - 1) != 0 and 1 << (k - 1).bit_length() > 4096),
    ) if yes}
    valid = (out >= 0).sum(1)
    if kw["return_valid_counts"] and bool(((valid > 0) & (valid < k)).any()):
        hit.add("valid counts of a partial row")
    mapping = kw["idx_mapping"]
    if mapping is not None and bool((mapping[req.long()] < 0).any()):
        hit.add("idx_mapping with an unmapped request")
    ids, starts = kw["prefill_request_ids"], kw["prefill_workspace_starts"]
    if ids is not None:
        if bool((ids < 0).any()) and bool((ids >= 0).any()):
            hit.add("decode and prefill tokens")
        # A token of a later prefill request, with a valid entry, whose start is not the first's.
        later = (ids > 0) & (starts[ids.long().clamp(min=0)] != starts[0]) & (out >= 0).any(1)
        if bool(later.any()):
            hit.add("two prefill requests, distinct workspace starts")
    return hit


def _convert_factors(p: Profile) -> tuple[Factor, ...]:
    """The converter's paths: prefill rows, valid counts (compaction), an idx_mapping, a block
    stride, and a top-k ending on half a 128 unit or a whole one."""
    return (Factor("prefill", (False, True)), Factor("counts", (False, True)), Factor("mapping", (False, True)),
            Factor("block_stride", ("none", "given")), Factor("topk_unit", ("64", "128")))


def _convert_row(rng: random.Random, p: Profile, row: Row) -> dict:
    """A converter case of the row's paths: a few requests, several prefill ones where asked."""
    topks = _units(p.decode_topk, row["topk_unit"] == "64") or ([64] if row["topk_unit"] == "64" else [128])
    return {"tokens": rng.randint(8, 12), "requests": rng.randint(4, 5), "table_width": rng.randint(2, 4),
            "topk": rng.choice(topks), "block_size": rng.choice(p.block_sizes),
            "stride_extra": rng.choice((1, 64)) if row["block_stride"] == "given" else 0, "prefill": row["prefill"],
            "counts": row["counts"], "mapping": row["mapping"], "invalid": rng.choice(([], ["scattered"], ["negatives"]))}


def _convert_shown(p, kw: dict) -> Row:
    stride = kw["block_stride_rows"]
    return {"prefill": kw["prefill_request_ids"] is not None, "counts": bool(kw["return_valid_counts"]),
            "mapping": kw["idx_mapping"] is not None,
            "block_stride": "none" if stride is None else "given",
            "topk_unit": "64" if kw["topk_indices"].shape[1] % 128 == 64 else "128"}


register("convert_index", None, laid_out("convert_index", Coverage(
    CONVERT, _convert_candidates, _convert_hits, Pairs(_convert_factors, _convert_row, _convert_shown, strength=3))))


# --- sparse_prefill ------------------------------------------------------------------------------

PREFILL = ("several tokens", "> 64 tokens", "several heads", "row with no valid index", "topk_length 0",
           "topk_length 1", "topk_length K", "no topk_length", "no sink", "finite sink", "+inf sink", "-inf sink",
           "top-k of one 128 unit", "top-k of several 128 units", "negatives other than -1", "index past N", "index N",
           "duplicate indices", "NaN kv row 0 beside an invalid entry", "fewer kv rows than top-k", FLAT, RUN,
           GARBAGE) + LAYOUT + DEGENERATE


def _prefill_candidates(rng: random.Random, p: Profile) -> list[dict]:
    small, large = 128, max(p.prefill_topk)  # 128: one unit, at every profile
    multi = [h for h in p.heads if h > 1] or [8]
    found = []
    for variant in range(VARIANTS):
        layout = {"layout": LAYOUTS[variant % len(LAYOUTS)]}
        found += [
            # Past 64 tokens, every topk_length edge, the sinks of every kind, invalid entries.
            {"tokens": rng.randint(65, 70), "heads": rng.choice(multi), "kv_rows": rng.randint(small, 2 * small),
             "topk": small, "value_regime": rng.choice(("degenerate", "peaked")), "sm_scale": 0.1352,
             "invalid": ["out_of_range", "boundaries", "whole_row", "duplicates", "negatives"], "topk_length": "edges",
             "sink": "inf", **layout},
            # Fewer kv rows than top-k over several 128 units; row 0 left unselected (NaN) often.
            {"tokens": rng.randint(2, 4), "heads": rng.choice(multi), "kv_rows": rng.randint(8, 40),
             "topk": large if large > 128 else 256, "value_regime": rng.choice(("saturation", "outliers")),
             "sm_scale": 0.0417, "invalid": ["scattered"], "topk_length": "none", "sink": "finite", **layout},
            {"tokens": rng.randint(2, 4), "heads": min(p.heads), "kv_rows": rng.randint(4 * small, 8 * small),
             "topk": small, "value_regime": rng.choice(("degenerate", "tiny")), "sm_scale": 0.3,
             "invalid": ["scattered", "runs", "negatives"], "topk_length": "garbage", "sink": "none", **layout},
            # Flat rows: every entry valid, near-equal logits.
            {"tokens": 2, "heads": min(p.heads), "kv_rows": rng.randint(2 * small, 3 * small), "topk": 2 * small,
             "value_regime": "flat", "sm_scale": 0.1352, "invalid": [], "topk_length": "none", "sink": "none"},
        ]
    return found


def _prefill_hits(p, kw: dict) -> set[str]:
    q, kv, idx, length, sink = kw["q"], kw["kv"], kw["indices"], kw["topk_length"], kw["attn_sink"]
    tokens, heads, k, n = q.shape[0], q.shape[1], idx.shape[1], kv.shape[0]
    live = (idx >= 0) & (idx < n)
    if length is not None:
        live &= torch.arange(k, device=idx.device)[None, :] < length[:, None]
    rows = kv[idx.long().clamp(0, max(n - 1, 0))] if n else kv.new_zeros((tokens, k, 576))
    hit = _layout_hits(kw) | degenerate_hits(q, live) | flat_hit(q, rows, live, kw["sm_scale"]) | run_hit(idx)
    hit |= {name for name, yes in (
        ("several tokens", tokens > 1), ("> 64 tokens", tokens > 64), ("several heads", heads > 1),
        ("row with no valid index", bool((~live).all(1).any())), ("no topk_length", length is None),
        ("no sink", sink is None), ("top-k of one 128 unit", k == 128), ("top-k of several 128 units", k > 128),
        ("negatives other than -1", bool((idx < -1).any())), ("index past N", bool((idx > n).any())),
        ("index N", bool((idx == n).any())),
        ("duplicate indices", _duplicates(idx)), ("fewer kv rows than top-k", n < k),
        ("NaN kv row 0 beside an invalid entry", n > 0 and bool(kv[0].isnan().any()) and bool((~live).any())),
    ) if yes}
    if length is not None:
        hit |= {name for name, value in (("topk_length 0", 0), ("topk_length 1", 1), ("topk_length K", k))
                if bool((length == value).any())}
        past = torch.arange(k, device=idx.device)[None, :] >= length[:, None]
        hit |= {GARBAGE} if bool((past & ((idx < -1) | (idx >= n))).any()) else set()
    if sink is not None:
        hit |= {name for name, yes in (("finite sink", sink.isfinite().any()), ("+inf sink", (sink == torch.inf).any()),
                                       ("-inf sink", (sink == -torch.inf).any())) if bool(yes)}
    return hit


def _prefill_factors(p: Profile) -> tuple[Factor, ...]:
    """Heads (production's among them), top-k (128-units: the profile's, two off the power-of-two
    table, production's 2048), the sink, a per-token length or none."""
    return (Factor("heads", _heads(p)),
            Factor("topk", tuple(sorted({128, *p.prefill_topk, 3 * 128, 9 * 128, PRODUCTION_TOPK}))),
            Factor("sink", ("none", "finite", "inf")), Factor("topk_length", ("none", "given")))


def _prefill_row(rng: random.Random, p: Profile, row: Row) -> dict:
    """A cheap prefill case of the row's values: two tokens over about top-k kv rows, most entries valid."""
    return {"tokens": 2, "heads": row["heads"], "kv_rows": row["topk"] + rng.randint(0, 64), "topk": row["topk"],
            "value_regime": rng.choice(("normal", "peaked", "flat")), "sm_scale": 0.1352,
            "invalid": rng.choice(([], ["scattered"], ["negatives"])), "sink": row["sink"],
            "topk_length": "none" if row["topk_length"] == "none" else rng.choice(("random", "edges"))}


def _prefill_shown(p, kw: dict) -> Row:
    sink = kw["attn_sink"]
    return {"heads": kw["q"].shape[1], "topk": kw["indices"].shape[1],
            "sink": "none" if sink is None else "finite" if bool(sink.isfinite().all()) else "inf",
            "topk_length": "none" if kw["topk_length"] is None else "given"}


register("sparse_prefill", None, Coverage(PREFILL, _prefill_candidates, _prefill_hits,
                                          Pairs(_prefill_factors, _prefill_row, _prefill_shown)))


# --- sparse_decode_fp8 ---------------------------------------------------------------------------

DECODE = ("batch > 1", "s_q > 1 with several requests", "s_q > 1 with several heads", "> 64 query rows",
          "top-k % 128 == 64", "top-k % 128 == 0",
          "raw (non-power-of-two) scales", "power-of-two scales", "row with no valid index",
          "NaN slot 0 beside a -1 entry", "padded page stride", "duplicate indices", "a row partly -1", FLAT, RUN) + LAYOUT \
    + DEGENERATE


def _decode_candidates(rng: random.Random, p: Profile) -> list[dict]:
    odd, even = _units(p.decode_topk, True) or [64], _units(p.decode_topk, False) or [128]
    found = []
    for variant in range(VARIANTS):
        batch = rng.randint(33, 36)
        layout = LAYOUTS[variant % len(LAYOUTS)]
        found += [
            # Past 64 query rows of two tokens each, raw scales, whole -1 rows, padded pages.
            {"batch": batch, "s_q": 2, "heads": min(h for h in p.heads if h > 1), "topk": rng.choice(odd),
             "seq_lens": [rng.randint(1, min(p.max_context, 300)) for _ in range(batch)],
             "page_size": rng.choice(p.block_sizes),
             "sm_scale": 0.1352, "value_regime": "degenerate", "scale_rule": "raw",
             "invalid": ["whole_row", "duplicates", "runs"], "stride_pad": 1, "layout": layout},
            {"batch": 2, "s_q": 1, "heads": max(p.heads), "topk": rng.choice(even),
             "seq_lens": [rng.randint(1, 40), rng.randint(1, min(p.max_context, 2000))], "page_size": 1,
             "sm_scale": 0.0417, "value_regime": rng.choice(("saturation", "zero_tiles")), "scale_rule": "pow2",
             "invalid": ["scattered"], "stride_pad": 0, "layout": LAYOUTS[(variant + 1) % len(LAYOUTS)]},
            # One long sequence: most slots, slot 0 among them likely, left unselected (NaN).
            {"batch": 1, "s_q": 1, "heads": min(p.heads), "topk": rng.choice(even), "seq_lens": [rng.randint(1000, 2000)],
             "page_size": rng.choice(p.block_sizes), "sm_scale": 0.1, "value_regime": "normal", "scale_rule": "pow2",
             "invalid": ["scattered"], "stride_pad": 0},
            # Flat rows: sequences longer than top-k, no invalid entry.
            {"batch": 1, "s_q": 1, "heads": min(p.heads), "topk": 256, "seq_lens": [rng.randint(300, 400)],
             "page_size": rng.choice(p.block_sizes), "sm_scale": 0.1352, "value_regime": "flat", "scale_rule": "pow2",
             "invalid": [], "stride_pad": 0},
        ]
    return found


def tile_scales(cache: torch.Tensor) -> torch.Tensor:
    """The fp32 tile scales of every written slot of an fp8_ds_mla cache (poisoned slots: NaN)."""
    rows = cache[..., 512:528].contiguous().view(torch.float32)
    return rows[rows.isfinite()]


def _decode_hits(p, kw: dict) -> set[str]:
    q, cache, idx = kw["q"], kw["kv_cache"], kw["indices"]
    batch, s_q, k = q.shape[0], q.shape[1], idx.shape[-1]
    scales = tile_scales(cache)
    pow2 = scales > 0
    pow2 &= torch.frexp(scales).mantissa == 0.5
    rows = idx.reshape(-1, k)
    first = slice(0, 4)  # the first query rows show a flat row if the case has one
    keys = cache_row_values(cache, rows[first].long(), torch.float64)
    flat = flat_hit(q.reshape(-1, *q.shape[2:])[first], keys, rows[first] >= 0, kw["sm_scale"])
    return _layout_hits(kw) | degenerate_hits(q, idx >= 0) | flat | run_hit(rows) | {name for name, yes in (
        ("batch > 1", batch > 1), ("s_q > 1 with several requests", s_q > 1 and batch > 1),
        ("s_q > 1 with several heads", s_q > 1 and q.shape[2] > 1),
        ("> 64 query rows", batch * s_q > 64), ("top-k % 128 == 64", k % 128 == 64), ("top-k % 128 == 0", k % 128 == 0),
        ("raw (non-power-of-two) scales", bool(((scales > 0) & ~pow2).any())),
        ("power-of-two scales", bool(pow2.any()) and bool((pow2 | (scales == 0)).all())),
        ("row with no valid index", bool((rows < 0).all(1).any())),
        ("NaN slot 0 beside a -1 entry", bool((cache[0, 0] == 0xFF).all()) and bool((rows < 0).any())),
        ("padded page stride", cache.stride(0) > cache.shape[1] * cache.shape[2]),
        ("duplicate indices", _duplicates(rows)),
        ("a row partly -1", bool(((rows >= 0).any(1) & (rows < 0).any(1)).any())),
    ) if yes}


def _decode_factors(p: Profile) -> tuple[Factor, ...]:
    """s_q 1-4 value by value, top-k (64-units up to 256 each, the profile's, 1152 off the table,
    production's 2048), heads (production's among them), page sizes (1, serving's 64, the
    profile's), the scale rule."""
    return (Factor("s_q", (1, 2, 3, 4)),
            Factor("topk", tuple(sorted({64, 128, *OFF_TABLE_TOPK, *p.decode_topk, PRODUCTION_TOPK}))),
            Factor("heads", _heads(p)), Factor("page_size", tuple(sorted({1, 64, *p.block_sizes}))),
            Factor("scale_rule", ("pow2", "raw")))


def _decode_row(rng: random.Random, p: Profile, row: Row) -> dict:
    """A cheap decode case of the row's values: two requests (one at 64 heads or more, or past
    top-k 256, where the interpreter's cost is) whose sequences about fill top-k."""
    k = row["topk"]
    batch = 2 if k <= 256 and row["heads"] < 64 else 1
    return {"batch": batch, "s_q": row["s_q"], "heads": row["heads"], "topk": k,
            "seq_lens": [rng.randint(k // 2, k + 32) for _ in range(batch)], "page_size": row["page_size"],
            "sm_scale": 0.1352, "value_regime": rng.choice(("normal", "peaked", "flat")),
            "scale_rule": row["scale_rule"], "invalid": rng.choice(([], ["scattered"], ["whole_row"])),
            "stride_pad": rng.choice((0, 1))}


def _decode_shown(p, kw: dict) -> Row:
    scales = tile_scales(kw["kv_cache"])
    raw = bool(((scales > 0) & (torch.frexp(scales).mantissa != 0.5)).any())
    q = kw["q"]
    return {"s_q": q.shape[1], "topk": kw["indices"].shape[-1], "heads": q.shape[2],
            "page_size": kw["kv_cache"].shape[1], "scale_rule": "raw" if raw else "pow2"}


register("sparse_decode_fp8", None, Coverage(DECODE, _decode_candidates, _decode_hits,
                                             Pairs(_decode_factors, _decode_row, _decode_shown)))
