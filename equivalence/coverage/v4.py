"""The covering features of DeepSeek V4's ops (`equivalence.coverage.sets`): the union decodes'
routing and edges, the cache writers' tiles, the index builders' window and ratio edges. Each is
read from the tensors a case builds.

Templates ask for several features at once and come in `VARIANTS` seeded copies: a feature
counts only where the built tensors show it (a drawn length may miss 0).
"""

from __future__ import annotations

import random

import torch

from mla_verify.reference import v4_pages
from mla_verify.reference.v4_forward import WINDOW as V4_WINDOW

from ..cases.profiles import Profile
from .registry import Coverage, register

VARIANTS = 4
FLOOR_BYTE = 127 - 13  # ue8m0 2^-13: FlashMLA's floor, 2^ceil(log2(1e-4))

# --- sparse_decode_v4 / sparse_decode_v41 --------------------------------------------------------

UNION = ("batch > 1", "s_q 1", "s_q > 1 (MTP)", "several heads", "main length 0", "main length 1", "main length full",
         "no main lengths", "extra length 0", "extra length 1", "extra length full", "no extra lengths", "no extra cache",
         "a counted extra entry in a partial 64-entry block", "a counted extra entry past the main top-k", "an empty union",
         "-1 before a counted entry", "past a length: a never-written slot, not -1", "odd block size",
         "pages further apart than allocated", "extra list dense (ratio 128: slots in order)",
         "extra list of picks (ratio 4: slots out of order)", "no sink", "finite sink", "+inf sink", "-inf sink",
         "ue8m0 scale at FlashMLA's 2^-13 floor", "ue8m0 scale below 2^-13 (vLLM's amax floor)",
         "a tile of -0 in a counted row")
UNION_V41 = UNION + ("counted rows of a V4.1 FP8 extra cache", "counted rows of a V4.1 FP4 extra cache")


def _union_candidates(extra_formats: tuple[str, ...]):
    def candidates(rng: random.Random, p: Profile) -> list[dict]:
        small = min(h for h in p.heads if h > 1) if any(h > 1 for h in p.heads) else p.heads[0]
        found = []
        for variant in range(VARIANTS):
            fmt = "V4" if extra_formats == ("V4",) else "V41"
            extra = extra_formats[variant % len(extra_formats)]
            base = {"kv_format": fmt, "extra_format": extra, "sm_scale": 0.1, "page_gap": 0, "special_tiles": False,
                    "invalid": [], "value_regime": "normal", "scale_rule": "pow2"}
            found += [
                # MTP rows: a short window and a full one, an extra length of 1 and one of 70-75 of a
                # partial block's 100 (entries past the main top-k counted), every sink.
                {**base, "batch": 2, "s_q": 4, "heads": small, "topk": 64, "extra_topk": 100,
                 "positions": [rng.randint(3, 6), rng.randint(280, 300)], "block_size": 5, "extra_block_size": 53,
                 "compress_ratio": 4, "lengths": "exact", "sink": "inf", "invalid": ["scattered"],
                 # tiny values: every FP4 code 0 (the e4m3 scale floor is 2^-9), so only beside FP8 extras
                 "value_regime": "tiny" if extra != "V41_FP4" else "normal", "page_gap": 1, "special_tiles": True},
                # No extra cache, lengths 0 / 1 / full, a whole row -1 (an empty union), vLLM's scale floor.
                {**base, "batch": 3, "s_q": 1, "heads": 1, "topk": 128, "extra_topk": 0,
                 "positions": [rng.randint(0, 60), rng.randint(130, 300), rng.randint(0, 300)], "block_size": 61,
                 "extra_block_size": 2, "compress_ratio": 4, "lengths": "edges", "sink": "none",
                 "invalid": ["whole_row"], "value_regime": "zero_tiles", "scale_rule": "pow2_amax"},
                # No lengths (-1 tails): a dense extra list (ratio 128), a short and a full window.
                {**base, "batch": 2, "s_q": 2, "heads": small, "topk": 64, "extra_topk": 64,
                 "positions": [rng.randint(2, 20), rng.randint(300, 400)], "block_size": 16, "extra_block_size": 2,
                 "compress_ratio": 128, "lengths": "none", "sink": "finite", "scale_rule": "pow2_amax",
                 "value_regime": "zero_tiles"},
                # Exact lengths: a window of 1 and a full one, extra lengths 0 and full, picks of ratio 4.
                {**base, "batch": 2, "s_q": 1, "heads": 1, "topk": 64, "extra_topk": 64,
                 "positions": [0, rng.randint(280, 300)], "block_size": 64, "extra_block_size": 5,
                 "compress_ratio": 4, "lengths": "exact", "sink": "finite", "value_regime": "zero_tiles"},
            ]
        return found

    return candidates


def _lengths(kw: dict, name: str, width: int, label: str) -> set[str]:
    length = kw[name]
    if length is None:
        return {f"no {label} lengths"}
    return {f"{label} length {text}" for text, value in (("0", 0), ("1", 1), ("full", width)) if bool((length == value).any())}


def _within(idx: torch.Tensor, length: torch.Tensor | None) -> torch.Tensor:
    """[B, S, K] bool: the positions within their request's length."""
    if length is None:
        return torch.ones_like(idx, dtype=torch.bool)
    return torch.arange(idx.shape[-1], device=idx.device) < length[:, None, None]


def _counted(idx: torch.Tensor, length: torch.Tensor | None) -> torch.Tensor:
    """[B, S, K] bool: the entries that count (within the request's length, not -1)."""
    return _within(idx, length) & (idx != -1)


def _scale_hits(cache: torch.Tensor, idx: torch.Tensor, counted: torch.Tensor) -> set[str]:
    fmt = v4_pages.page_format(cache)
    if fmt.fp8 is None:
        return set()
    data, scales = v4_pages.slot_parts(cache, fmt, idx[counted].long())
    tiles = scales[:, :fmt.fp8.quantized // fmt.fp8.tile]
    zero_tile = (data[:, :fmt.fp8.quantized].view(-1, fmt.fp8.quantized // fmt.fp8.tile, fmt.fp8.tile) == 0x80).all(-1)
    return {name for name, yes in (("ue8m0 scale at FlashMLA's 2^-13 floor", bool((tiles == FLOOR_BYTE).any())),
                                   ("ue8m0 scale below 2^-13 (vLLM's amax floor)", bool((tiles < FLOOR_BYTE).any())),
                                   ("a tile of -0 in a counted row", bool(zero_tile.any()))) if yes}


def _order_hits(idx: torch.Tensor, counted: torch.Tensor) -> set[str]:
    """Whether some extra row counts two or more slots all in order (dense), or out of order."""
    found = set()
    for row, live in zip(idx.reshape(-1, idx.shape[-1]), counted.reshape(-1, idx.shape[-1])):
        slots = row[live]
        if slots.numel() >= 2:
            steps = slots[1:] - slots[:-1]
            found.add("extra list dense (ratio 128: slots in order)" if bool((steps == 1).all())
                      else "extra list of picks (ratio 4: slots out of order)")
    return found


def _union_hits(p, kw: dict) -> set[str]:
    q, idx, sink = kw["q"], kw["indices"], kw["attn_sink"]
    batch, s_q, heads = q.shape[:3]
    main = _counted(idx, kw["topk_length"])
    hit = _lengths(kw, "topk_length", idx.shape[-1], "main") | _scale_hits(kw["kv_cache"], idx, main)
    union = main.any(-1)
    caches = [kw["kv_cache"]]
    lists = [(idx, kw["topk_length"], main)]
    if kw["extra_kv_cache"] is None:
        hit.add("no extra cache")
    else:
        xidx = kw["extra_indices"]
        extra = _counted(xidx, kw["extra_topk_length"])
        union |= extra.any(-1)
        caches.append(kw["extra_kv_cache"])
        lists.append((xidx, kw["extra_topk_length"], extra))
        fmt = v4_pages.page_format(kw["extra_kv_cache"])
        hit |= _lengths(kw, "extra_topk_length", xidx.shape[-1], "extra") | _scale_hits(kw["extra_kv_cache"], xidx, extra)
        hit |= _order_hits(xidx, extra)
        if bool(extra.any()):
            hit.add(f"counted rows of a V4.1 {'FP4' if fmt.fp8 is None else 'FP8'} extra cache")
        hit |= {name for name, yes in (("a counted extra entry in a partial 64-entry block",
                                        bool(extra[..., xidx.shape[-1] // 64 * 64:].any())),
                                       ("a counted extra entry past the main top-k",
                                        bool(extra[..., idx.shape[-1]:].any()))) if yes}
    for entries, length, counted in lists:
        later = counted.flip(-1).cumsum(-1).flip(-1) - counted.long()  # counted entries after each position
        if bool(((entries == -1) & (later > 0) & _within(entries, length)).any()):
            hit.add("-1 before a counted entry")
        if length is not None:
            past = torch.arange(entries.shape[-1], device=entries.device) >= length[:, None, None]
            if bool((past & (entries != -1)).any()):
                hit.add("past a length: a never-written slot, not -1")
    if any(c.shape[1] & (c.shape[1] - 1) for c in caches):
        hit.add("odd block size")
    if any(c.stride(0) > v4_pages.allocate_cache(1, c.shape[1], v4_pages.page_format(c).name).stride(0) for c in caches):
        hit.add("pages further apart than allocated")
    if sink is None:
        hit.add("no sink")
    else:
        hit |= {name for name, yes in (("finite sink", sink.isfinite().any()), ("+inf sink", (sink == torch.inf).any()),
                                       ("-inf sink", (sink == -torch.inf).any())) if bool(yes)}
    return hit | {name for name, yes in (("batch > 1", batch > 1), ("s_q 1", s_q == 1), ("s_q > 1 (MTP)", s_q > 1),
                                         ("several heads", heads > 1), ("an empty union", bool((~union).any()))) if yes}


register("sparse_decode_v4", None, Coverage(UNION, _union_candidates(("V4",)), _union_hits))
register("sparse_decode_v41", None, Coverage(UNION_V41, _union_candidates(("V41_FP4", "V41")), _union_hits))


# --- write_v4_cache / write_v41_cache ------------------------------------------------------------

WRITER = ("skipped slots (-1)", "several blocks", "odd block size", "pages further apart than allocated",
          "a zero tile", "a tile of -0", "a NaN tile", "an infinite tile", "bf16 subnormals")
SCALES = ("ue8m0 scale at FlashMLA's 2^-13 floor", "ue8m0 scale below 2^-13 (vLLM's amax floor)")
FP4 = ("an FP4 scale at its 2^-9 floor",)


def _writer_candidates(formats: tuple[str, ...]):
    def candidates(rng: random.Random, p: Profile) -> list[dict]:
        found = []
        for variant in range(VARIANTS):
            bs = rng.choice((5, 61) + p.block_sizes)
            fmt = formats[variant % len(formats)]
            found += [{"n": 2 * bs, "num_blocks": 3, "block_size": bs, "kv_format": fmt, "value_regime": "normal",
                       "scale_rule": "pow2", "special_tiles": True, "page_gap": 1, "skip_frac": 0.2},
                      {"n": rng.randint(1, 5), "num_blocks": 1, "block_size": 5, "kv_format": formats[0],
                       "value_regime": "zero_tiles", "scale_rule": "pow2_amax", "special_tiles": False, "page_gap": 0,
                       "skip_frac": 0.0}]
        return found

    return candidates


def _writer_hits(p, kw: dict) -> set[str]:
    cache, slots, kv = kw["kv_cache"], kw["slot_mapping"], kw["kv"]
    fmt = v4_pages.page_format(cache)
    written = slots >= 0
    x = kv[written].float()
    tiles = x.view(x.shape[0], -1, 16)
    hit = {name for name, yes in (
        ("skipped slots (-1)", bool((~written).any())),
        ("several blocks", bool((slots[written] // cache.shape[1]).unique().numel() > 1)),
        ("odd block size", bool(cache.shape[1] & (cache.shape[1] - 1))),
        ("pages further apart than allocated", cache.stride(0) > v4_pages.allocate_cache(1, cache.shape[1], fmt.name).stride(0)),
        ("a zero tile", bool(((tiles == 0) & ~torch.signbit(tiles)).all(-1).any())),
        ("a tile of -0", bool(((tiles == 0) & torch.signbit(tiles)).all(-1).any())),
        ("a NaN tile", bool(tiles.isnan().any())), ("an infinite tile", bool(tiles.isinf().any())),
        ("bf16 subnormals", bool(((x != 0) & (x.abs() < 2.0**-126)).any())),
    ) if yes}
    _, scales = v4_pages.quantize(kv[written], fmt, kw["scale_rule"])
    if fmt.fp8 is None:
        return hit | ({FP4[0]} if bool((scales == 0x01).any()) else set())
    tiles_used = scales[:, :fmt.fp8.quantized // fmt.fp8.tile]
    return hit | {name for name, yes in ((SCALES[0], bool((tiles_used == FLOOR_BYTE).any())),
                                         (SCALES[1], bool((tiles_used < FLOOR_BYTE).any()))) if yes}


register("write_v4_cache", None, Coverage(WRITER + SCALES, _writer_candidates(("V4",)), _writer_hits))
register("write_v41_cache", None, Coverage(WRITER + SCALES + FP4, _writer_candidates(("V41", "V41_FP4")), _writer_hits))


# --- window_indices / flashinfer_decode_table ----------------------------------------------------

WINDOW = ("pos + 1 < window", "pos + 1 = window", "pos + 1 = window + 1", "pos + 1 > window + 1", "window of 1",
          "several requests", "a window across blocks", "block size 1", "odd block size")
TABLE = WINDOW + ("compressed width not a multiple of 4", "no compressed entries", "compressed lengths",
                  "no compressed lengths", "a compressed length 0", "-1 among the compressed slots")


def _window_candidates(compressed: bool):
    def candidates(rng: random.Random, p: Profile) -> list[dict]:
        found = []
        for _ in range(VARIANTS):
            for window in (128, 4, 1):
                found.append({"requests": rng.randint(2, 3), "window": window,
                              "positions": [window - 2, window - 1, window, window + 3, rng.randint(0, p.max_context)],
                              "block_size": rng.choice((1, 5, 61)),
                              "compressed_topk": rng.choice((13, 0, 1)) if compressed else 0,
                              "compressed_lens": rng.random() < 0.5})
        return [{**c, "positions": [max(x, 0) for x in c["positions"]]} for c in found]

    return candidates


def _window_hits(p, kw: dict) -> set[str]:
    return _window_features(kw["positions"].long(), kw["req_of_token"], kw["window"], kw["block_size"])


def _window_features(pos: torch.Tensor, req: torch.Tensor, window: int, bs: int) -> set[str]:
    w = torch.clamp(pos + 1, max=window)
    return {name for name, yes in (
        ("pos + 1 < window", bool((pos + 1 < window).any())), ("pos + 1 = window", bool((pos + 1 == window).any())),
        ("pos + 1 = window + 1", bool((pos == window).any())), ("pos + 1 > window + 1", bool((pos > window).any())),
        ("window of 1", window == 1), ("several requests", bool(req.unique().numel() > 1)),
        ("a window across blocks", bool(((pos - w + 1) // bs != pos // bs).any())),
        ("block size 1", bs == 1), ("odd block size", bool(bs & (bs - 1))),
    ) if yes}


def _table_hits(p, kw: dict) -> set[str]:
    """The window's features from the positions the window columns were built from (a case's
    params hold them), the compressed part's from the tensors."""
    pos = torch.tensor(p.positions)
    k, lens = kw["compressed_slots"].shape[1], kw["compressed_lens"]
    hit = _window_features(pos, torch.arange(pos.shape[0]) % p.requests, p.window, p.block_size) | {name for name, yes in (
        ("compressed width not a multiple of 4", k % 4 != 0), ("no compressed entries", k == 0),
        ("compressed lengths", lens is not None), ("no compressed lengths", lens is None),
        ("a compressed length 0", lens is not None and bool((lens == 0).any())),
        ("-1 among the compressed slots", bool((kw["compressed_slots"] == -1).any())),
    ) if yes}
    return hit


register("window_indices", None, Coverage(WINDOW, _window_candidates(False), _window_hits))
register("flashinfer_decode_table", None, Coverage(TABLE, _window_candidates(True), _table_hits))


# --- v4_prefill_indices --------------------------------------------------------------------------

PREFILL_ROWS = ("a request with no query tokens", "k = 0 (pos + 1 below the ratio)", "k = topk", "0 < k < topk",
                "w < window", "w = window", "query_start_loc rebased (first entry > 0)",
                "a prefix past the window (gather_len < seq_len)", "junk past k in the picks", "topk 0",
                "several requests", "ratio 128")


def _prefill_rows_candidates(rng: random.Random, p: Profile) -> list[dict]:
    found = []
    for _ in range(VARIANTS):
        found += [{"query_lens": [0, rng.randint(2, 5), rng.randint(1, 3)],
                   "seq_lens": [rng.randint(1, 9), rng.randint(130, 300), rng.randint(5, 9)], "window": 128,
                   "compress_ratio": 4, "topk": 16 if 16 <= p.max_context else 5, "picks_width": 19, "start": 7},
                  {"query_lens": [rng.randint(1, 3)], "seq_lens": [rng.randint(260, 400)], "window": 4,
                   "compress_ratio": 128, "topk": 0, "picks_width": 0, "start": 0}]
    return found


def _prefill_rows_hits(p, kw: dict) -> set[str]:
    qsl, seq, gather = kw["query_start_loc"].long(), kw["seq_lens"].long(), kw["gather_lens"].long()
    queries = qsl[1:] - qsl[:-1]
    req = torch.repeat_interleave(torch.arange(seq.shape[0], device=qsl.device), queries)
    pos = seq[req] - queries[req] + torch.arange(req.shape[0], device=qsl.device) - (qsl[:-1] - qsl[0])[req]
    k = torch.clamp((pos + 1) // kw["compress_ratio"], max=kw["topk"])
    w = torch.clamp(pos + 1, max=kw["window"])
    picks = kw["topk_indices"].long()
    junk = torch.arange(picks.shape[1], device=picks.device)[None, :] >= k[:, None]
    return {name for name, yes in (
        ("a request with no query tokens", bool((queries == 0).any())), ("k = 0 (pos + 1 below the ratio)", bool((k == 0).any())),
        ("k = topk", kw["topk"] > 0 and bool((k == kw["topk"]).any())), ("0 < k < topk", bool(((k > 0) & (k < kw["topk"])).any())),
        ("w < window", bool((w < kw["window"]).any())), ("w = window", bool((w == kw["window"]).any())),
        ("query_start_loc rebased (first entry > 0)", int(qsl[0]) > 0),
        ("a prefix past the window (gather_len < seq_len)", bool((gather < seq).any())),
        ("junk past k in the picks", bool(junk[: picks.shape[0]].any()) and picks.shape[1] > 0),
        ("topk 0", kw["topk"] == 0), ("several requests", seq.shape[0] > 1), ("ratio 128", kw["compress_ratio"] == 128),
    ) if yes}


register("v4_prefill_indices", None, Coverage(PREFILL_ROWS, _prefill_rows_candidates, _prefill_rows_hits))


# --- v4_decode (the decode step) -----------------------------------------------------------------

STEP = ("a short sequence (pos + 1 < window)", "a full window", "s_q > 1 (MTP)", "s_q 1", "batch > 1",
        "block size 1", "odd block size", "an extra list", "no extra cache", "a sink", "no sink")


def _step_candidates(rng: random.Random, p: Profile) -> list[dict]:
    base = {"kv_format": "V4", "extra_format": "V4", "compress_ratio": 4, "lengths": "exact", "sm_scale": 0.1,
            "value_regime": "normal", "scale_rule": "pow2", "invalid": [], "page_gap": 0, "special_tiles": False}
    found = []
    for _ in range(VARIANTS):
        found += [{**base, "batch": 2, "s_q": 2, "heads": p.heads[0], "topk": V4_WINDOW, "extra_topk": 64,
                   "positions": [rng.randint(1, 20), rng.randint(100, 300)], "block_size": rng.choice((5, 61)),
                   "extra_block_size": 16, "sink": "finite"},
                  {**base, "batch": 1, "s_q": 1, "heads": p.heads[0], "topk": V4_WINDOW, "extra_topk": 0,
                   "positions": [rng.randint(0, 300)], "block_size": 1, "extra_block_size": 2, "sink": "none"}]
    return found


def _step_hits(p, kw: dict) -> set[str]:
    pos, window, q = kw["positions"].long(), V4_WINDOW, kw["q"]
    bs = kw["kv_cache"].shape[1]
    return {name for name, yes in (
        ("a short sequence (pos + 1 < window)", bool((pos + 1 < window).any())),
        ("a full window", bool((pos + 1 >= window).any())), ("s_q > 1 (MTP)", q.shape[1] > 1), ("s_q 1", q.shape[1] == 1),
        ("batch > 1", q.shape[0] > 1), ("block size 1", bs == 1), ("odd block size", bool(bs & (bs - 1))),
        ("an extra list", kw["extra_kv_cache"] is not None), ("no extra cache", kw["extra_kv_cache"] is None),
        ("a sink", kw["attn_sink"] is not None), ("no sink", kw["attn_sink"] is None),
    ) if yes}


register("v4_decode", None, Coverage(STEP, _step_candidates, _step_hits))
