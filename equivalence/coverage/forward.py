"""The covering features of forward_mqa (each plain path, the unrestricted draw, the HiSparse
paths) and of the multi-process dcp op (`equivalence.coverage.sets`): the routing sides of
`equivalence.cases.routing` and the edge classes of a batch, read from the batch each case builds.

A batch takes longer to build than a single op's inputs: `FORWARD_VARIANTS` seeded copies of each
template.
"""

from __future__ import annotations

import random

import torch

from mla_verify.reference.metadata import (
    prefill_workspace_size,
    reorder_batch_threshold,
    split_decodes_and_prefills,
    split_prefill_chunks,
    use_mixed_batch,
)

from ..cases.hisparse_batch import ACTIVE_TAIL_PAGES
from ..cases.profiles import Profile
from ..cases.routing import SIDES, sides
from .features import DEGENERATE, degenerate_hits, tile_scales
from .pairs import Factor, Row
from .registry import Coverage, Pairs, register

# --- forward_mqa ---------------------------------------------------------------------------------

SPLIT = tuple(f"split: {side}" for side in SIDES["split"])
BATCH = ("batch > 1", "> 64 tokens", "two or more prefill requests", "spec decodes (s_q > 1) of several requests",
         "row with no valid index", "only the decodes of a mixed batch through forward_mqa") + DEGENERATE
DECODE_TOPK = tuple(f"decode_topk: {side}" for side in SIDES["decode_topk"])
# concat_mla_q is a stage of forward_mqa only where q comes as its two halves: a campaign replacing
# it is judged on these cases (without one, NO VERDICT: the stage was never called)
Q_TUPLE = "q handed as (ql_nope, q_pe): concat_mla_q called"
CHUNKED = ("two or more prefill requests in one workspace chunk", "a chunk of two or more requests ending mid-batch",
           "a zero-length request among the prefills (its workspace start repeated)")
PATH_FEATURES = {
    "bf16": SPLIT + BATCH + (Q_TUPLE,),
    "fp8_mixed": SPLIT + BATCH + DECODE_TOPK + ("raw (non-power-of-two) scales", Q_TUPLE),
    "fp8_separate": SPLIT + BATCH + DECODE_TOPK + tuple(f"chunks: {side}" for side in SIDES["chunks"]) + CHUNKED
    + ("raw (non-power-of-two) scales", Q_TUPLE),
    "fp8_mixed_dcp": ("split: all decodes", "split: all prefills", "split: decodes + prefills") + BATCH + DECODE_TOPK
    + tuple(f"dcp_empty: {side}" for side in SIDES["dcp_empty"]) + ("raw (non-power-of-two) scales",),
}


FORWARD_VARIANTS = 2  # a batch takes longer to build than a single op's inputs


def _batch(rng: random.Random, p: Profile, dtype: str, heads: int, qlens: list[int], topk: int, **extra) -> dict:
    """forward_mqa params of one batch: contexts drawn within the profile, sm100's thresholds
    (128 tokens at 8-32 heads), every other field at its default unless `extra` sets it."""
    ctx = [rng.randint(1, min(p.max_context, 200)) for _ in qlens]
    return {"cache_dtype": dtype, "heads": heads, "query_lens": qlens, "context_lens": ctx,
            "block_size": rng.choice(p.block_sizes), "topk": topk, "sm_scale": 0.1352,
            "value_regime": rng.choice(("normal", "peaked", "outliers")), "arch": "sm100", **extra}


def _forward_templates(rng: random.Random, p: Profile, path: str) -> list[dict]:
    """A path's templates: decodes with padding requests, decodes with a merged and a short
    prefill past 64 tokens, all prefills (the first past the threshold; q as its two halves off the DCP
    path, which takes it whole), and on the separate path
    prefills in one, two and three or more workspace chunks."""
    dtype = "bfloat16" if path == "bf16" else "fp8_ds_mla"
    low = [h for h in p.mqa_heads if h in (8, 16)] or [16]
    heads = 32 if path == "fp8_separate" else rng.choice(low)
    odd = 64 if path != "bf16" else 128
    s = rng.choice((1, 2))  # the merged prefill's decodes; the padded decodes are spec decodes
    dcp = {"dcp_size": rng.choice((2, 4)), "interleave": 1} if path == "fp8_mixed_dcp" else {}
    quant = {"scale_rule": "raw", "invalid": ["whole_row", "scattered"]}
    found = [
        _batch(rng, p, dtype, heads, [2] * 3 + [0, 0], odd, max_decode_query_len=2, **quant, **dcp),
        # Zero q rows (tied logits) among random ones, in decodes and prefills alike.
        _batch(rng, p, dtype, heads, [s, s, 0, s, s + 2, 66], 128, max_decode_query_len=s, **quant, **dcp,
               value_regime="degenerate"),
        _batch(rng, p, dtype, heads, [129, 3], 128, **dcp, **({} if dcp else {"q_form": "tuple"})),
        # Dense MHA takes the prefills: q holds the decodes alone.
        _batch(rng, p, dtype, heads, [1, 1, 3, 2], 128, mqa="decodes", **dcp),
    ]
    if path == "fp8_mixed_dcp":  # contexts of a few tokens leave some ranks' shards empty
        found.append({**found[0], "context_lens": [0, 1, 2, 0, 0], "query_lens": [1, 1, 1, 0, 0],
                      "max_decode_query_len": 1})
    if path == "fp8_separate":
        for chunks in (1, 2, 3):
            seqs = [rng.randint(20, 40) for _ in range(chunks + 1)]
            qlens = [n // 2 + 2 for n in seqs]
            padded = [0, 0] if chunks == 2 else []  # vLLM pads request slots (#51486): an empty one among them
            found.append(_batch(rng, p, dtype, heads, [1] + qlens[:1] + padded[:1] + qlens[1:], 128,
                                context_lens=[5] + [n - q for n, q in zip(seqs, qlens)][:1] + padded[1:]
                                + [n - q for n, q in zip(seqs, qlens)][1:],
                                workspace_size=None if chunks == 1 else max(seqs) + (40 if chunks == 2 else 0)))
    return found


def _unrestricted_templates(rng: random.Random, p: Profile) -> list[dict]:
    """The unrestricted draw's six, each holding what the others cannot (the fewest that reach
    every path's features: the separate path's 1, 2 and >= 3 chunks are three batches, an empty
    and a full DCP shard two on the mixed path, the BF16 cache one): spec decodes, a merged and a
    short prefill and three more past 64 tokens in >= 3 chunks, the first chunk the short one, an
    empty request slot and a long one (three requests in a chunk that ends mid-batch); DCP decodes of a few tokens with
    padding requests (a rank empty); BF16 and DCP decodes alone through forward_mqa; all prefills
    in two chunks; one chunk."""
    low = [h for h in p.mqa_heads if h in (8, 16)] or [16]
    quant = {"scale_rule": "raw", "invalid": ["whole_row", "scattered"]}
    seq = rng.randint(80, 100)  # the three long prefills' sequences: one workspace each, the short one's beside
    long = [seq // 2 + rng.randint(0, 8) for _ in range(3)]
    short = rng.randint(0, 8)   # the short prefill's context
    spec = _batch(rng, p, "fp8_ds_mla", 32, [2, 2, 0, 2, 4, 0] + long, 128, max_decode_query_len=2,
                  **quant, value_regime="degenerate", workspace_size=seq + short + 4)
    # an empty request slot among the prefills (vLLM pads them, #51486): its workspace start repeated
    spec["context_lens"] = spec["context_lens"][:4] + [short, 0] + [seq - n for n in long]
    dcp = {"dcp_size": rng.choice((2, 4)), "interleave": 1}
    empty = _batch(rng, p, "fp8_ds_mla", rng.choice(low), [2, 2, 2, 0, 0], 64, max_decode_query_len=2, **quant, **dcp,
                   value_regime="degenerate")
    empty["context_lens"] = [rng.randint(0, 1) for _ in range(5)]
    prefills = _batch(rng, p, "fp8_ds_mla", 32, [129, 3], 128, q_form="tuple")
    prefills["workspace_size"] = max(c + n for c, n in zip(prefills["context_lens"], [129, 3]))
    return [spec, empty, prefills,
            _batch(rng, p, "bfloat16", rng.choice(low), [1, 1, 3, 2], 128, mqa="decodes"),
            {**_batch(rng, p, "fp8_ds_mla", rng.choice(low), [1, 1, 3, 2], 128, mqa="decodes", **dcp),
             "context_lens": [rng.randint(40, 80) for _ in range(4)]},
            _batch(rng, p, "fp8_ds_mla", 32, [1, 5], 128)]


def _forward_candidates(path: str | None):
    def candidates(rng: random.Random, p: Profile) -> list[dict]:
        if path is None:
            return [c for _ in range(FORWARD_VARIANTS) for c in _unrestricted_templates(rng, p)]
        return [c for _ in range(FORWARD_VARIANTS) for c in _forward_templates(rng, p, path)]

    return candidates


def _rows(q) -> int:
    """Query rows handed to forward_mqa (q whole, or as (ql_nope, q_pe))."""
    return (q[0] if isinstance(q, tuple) else q).shape[0]


def _forward_degenerate(b) -> set[str]:
    """The zero q rows of a batch's tokens (not its padding rows), tied where the token's entries
    name two or more positions inside its own sequence."""
    q = torch.cat(b.q, -1) if isinstance(b.q, tuple) else b.q
    n = min(q.shape[0], b.query_start_loc[-1])
    request = torch.bucketize(torch.arange(n), torch.tensor(list(b.query_start_loc[1:])), right=True)
    idx = b.topk_indices[:n].cpu()
    valid = (idx >= 0) & (idx < torch.tensor(list(b.seq_lens))[request][:, None])
    return degenerate_hits(q[:n].cpu(), valid)


def _forward_hits(p, kw: dict) -> set[str]:
    b = kw["batch"]
    if getattr(b, "plain", None) is not None:  # HiSparse: layer 0 as the plain path sees it
        b = b.plain
    qsl, seqs, idx = list(b.query_start_loc), list(b.seq_lens), b.topk_indices
    lens = [y - x for x, y in zip(qsl, qsl[1:])]
    cfg = b.config
    routed = sides({"heads": cfg["num_heads"], "query_lens": lens, "context_lens": [s - n for s, n in zip(seqs, lens)],
                    "cache_dtype": cfg["kv_cache_dtype"], "dcp_size": len(b.rank_caches),
                    "interleave": cfg.get("interleave", 1), "arch": cfg["arch"], "topk": idx.shape[-1],
                    "max_decode_query_len": cfg["max_decode_query_len"], "workspace_size": cfg["workspace_size"],
                    "max_model_len": cfg["max_model_len"], "mqa": p.mqa})
    hit = {f"{boundary}: {side}" for boundary, found in routed.items() for side in found} | _forward_degenerate(b)
    threshold = reorder_batch_threshold(cfg["num_heads"], cfg["arch"], max_decode_query_len=cfg["max_decode_query_len"],
                                        dcp_size=len(b.rank_caches), interleave=cfg.get("interleave", 1))
    num_decodes = split_decodes_and_prefills(qsl, threshold).num_decodes
    hit |= {name for name, yes in (
        ("batch > 1", sum(n > 0 for n in lens) > 1), ("> 64 tokens", qsl[-1] > 64),
        ("two or more prefill requests", len(lens) - num_decodes >= 2),
        ("spec decodes (s_q > 1) of several requests", sum(1 < n for n in lens[:num_decodes]) > 1),
        ("row with no valid index", bool((idx[:qsl[-1]] < 0).all(-1).any())),
        ("only the decodes of a mixed batch through forward_mqa", _rows(b.q) < qsl[-1] and num_decodes < len(lens)),
        (Q_TUPLE, isinstance(b.q, tuple)),
    ) if yes}
    if "only the decodes of a mixed batch through forward_mqa" in hit:  # the unrestricted draw asks it of both caches
        hit.add(f"only the decodes of a mixed batch through forward_mqa: {cfg['kv_cache_dtype']} cache")
    if cfg["kv_cache_dtype"] == "fp8_ds_mla":
        scales = tile_scales(b.rank_caches[0])
        if bool(((scales > 0) & (torch.frexp(scales).mantissa != 0.5)).any()):
            hit.add("raw (non-power-of-two) scales")
    chunks = _chunks(cfg, seqs[num_decodes:], p.mqa)
    shared = [(start, end) for start, end in chunks if end - start >= 2]
    return hit | {name for name, yes in zip(CHUNKED, (bool(shared), any(end < chunks[-1][1] for _, end in shared),
                                                      bool(chunks) and 0 in seqs[num_decodes:])) if yes}


def _chunks(cfg: dict, prefill_seqs: list[int], mqa: str) -> list[tuple[int, int]]:
    """The separate path's workspace chunks of a batch's prefills (requests from 0), [] where the
    batch has none (another path, no prefill, the prefills through dense MHA)."""
    if (cfg["kv_cache_dtype"] == "bfloat16" or use_mixed_batch(cfg["num_heads"]) or mqa != "all"
            or not prefill_seqs):
        return []
    return split_prefill_chunks(prefill_seqs, cfg["workspace_size"] or prefill_workspace_size(cfg["max_model_len"]))


# --- forward_mqa's routing parameters in pairs (`coverage.pairs`) ---------------------------------

ROUTES = ("bf16", "fp8_mixed", "fp8_separate", "fp8_mixed_dcp")
CHUNKINGS = ("1", "2", ">=3")        # the separate path's workspace chunks ("-": another path)
DCP_SIZES = (2, 3, 4, 8)             # every rank count the draws take, and 3: a rank left without a partner
SPEC = (1, 2, 3, 4)                  # the decodes' query length: 1 + speculative tokens


def _forward_factors(path: str | None):
    """The path (unrestricted only), its chunking, the DCP ranks and the spec-decode length; a path
    holds what it can vary."""
    def factors(p: Profile) -> tuple[Factor, ...]:
        spec = Factor("s", SPEC)
        if path is None:
            return (Factor("route", ROUTES), Factor("chunks", ("-",) + CHUNKINGS), Factor("dcp", (1,) + DCP_SIZES), spec)
        return {"fp8_separate": (Factor("chunks", CHUNKINGS), spec),
                "fp8_mixed_dcp": (Factor("dcp", DCP_SIZES), spec)}.get(path, (spec,))

    return factors


def _forward_allowed(row: Row) -> bool:
    """Chunks on the separate path only, DCP on the mixed path only."""
    route, chunks, dcp = row.get("route"), row.get("chunks"), row.get("dcp")
    if route is not None and chunks is not None and (chunks != "-") != (route == "fp8_separate"):
        return False
    if route is not None and dcp is not None and (dcp > 1) != (route == "fp8_mixed_dcp"):
        return False
    return not (chunks not in (None, "-") and dcp is not None and dcp > 1)


def _prefill_seqs(rng: random.Random, chunks: str | None) -> tuple[list[int], int | None]:
    """Prefill sequence lengths and a workspace making `chunks` chunks of them, the first holding
    two requests (ending mid-batch where more follow); None: one prefill, the default workspace."""
    if chunks is None:
        return [rng.randint(20, 60)], None
    first = [rng.randint(20, 30), rng.randint(20, 30)]
    workspace = sum(first)
    later = {"1": [], "2": [rng.randint(first[0] + 1, workspace)],
             ">=3": [rng.randint(workspace // 2 + 1, workspace) for _ in range(2)]}[chunks]
    return first + later, workspace if later else None


def _forward_row(path: str | None):
    def realize(rng: random.Random, p: Profile, row: Row) -> dict:
        """Two decodes of the row's length, then prefills chunked as asked, on the row's path."""
        route, s = row.get("route", path), row["s"]
        dcp = row.get("dcp", 2 if route == "fp8_mixed_dcp" else 1)
        low = [h for h in p.mqa_heads if h in (8, 16)] or [16]
        heads = 32 if route == "fp8_separate" else 8 if dcp > 1 else rng.choice(low)
        seqs, workspace = _prefill_seqs(rng, row.get("chunks", "1") if route == "fp8_separate" else None)
        queries = [min(n, s + rng.randint(1, 8)) for n in seqs]  # never s: a prefill, not one more decode
        b = _batch(rng, p, "bfloat16" if route == "bf16" else "fp8_ds_mla", heads, [s, s] + queries, 128,
                   max_decode_query_len=s, scale_rule=rng.choice(("pow2", "raw")),
                   invalid=rng.choice(([], ["scattered"], ["whole_row"])), workspace_size=workspace)
        b["context_lens"] = b["context_lens"][:2] + [n - q for n, q in zip(seqs, queries)]
        return {**b, "dcp_size": dcp, "interleave": 1} if dcp > 1 else b

    return realize


def _whole_batch(p: Profile) -> float | None:
    """A forward_mqa case is a whole batch: its pairs' cases are held to what its draws are."""
    return p.interpreter_s


def _forward_shown(p, kw: dict) -> Row:
    """The path a batch takes, its chunks, ranks and decode length (none without decodes)."""
    b = kw["batch"]
    cfg, dcp = b.config, len(b.rank_caches)
    qsl, seqs = list(b.query_start_loc), list(b.seq_lens)
    lens = [y - x for x, y in zip(qsl, qsl[1:])]
    mixed = use_mixed_batch(cfg["num_heads"])
    route = ("bf16" if cfg["kv_cache_dtype"] == "bfloat16" else "fp8_separate" if not mixed
             else "fp8_mixed_dcp" if dcp > 1 else "fp8_mixed")
    threshold = reorder_batch_threshold(cfg["num_heads"], cfg["arch"], max_decode_query_len=cfg["max_decode_query_len"],
                                        dcp_size=dcp, interleave=cfg.get("interleave", 1))
    num_decodes = split_decodes_and_prefills(qsl, threshold).num_decodes
    chunks = len(_chunks(cfg, seqs[num_decodes:], p.mqa))
    row = {"route": route, "dcp": dcp, "chunks": CHUNKINGS[min(chunks, 3) - 1] if chunks else "-"}
    return {**row, "s": lens[0]} if num_decodes and lens[0] > 0 else row


for _path, _features in PATH_FEATURES.items():
    register("forward_mqa", _path, Coverage(_features, _forward_candidates(_path), _forward_hits,
                                            Pairs(_forward_factors(_path), _forward_row(_path), _forward_shown,
                                                  _forward_allowed, cap=_whole_batch)))
register("forward_mqa", None, Coverage(
    tuple(dict.fromkeys(f for features in PATH_FEATURES.values() for f in features))
    + tuple(f"fp8_path: {side}" for side in SIDES["fp8_path"])
    + tuple(f"only the decodes of a mixed batch through forward_mqa: {cache} cache" for cache in ("bfloat16", "fp8_ds_mla")),
    _forward_candidates(None), _forward_hits,
    Pairs(_forward_factors(None), _forward_row(None), _forward_shown, _forward_allowed, cap=_whole_batch)))


# --- the multi-process dcp op ----------------------------------------------------------------------

DCP = ("combine: ag_rs", "combine: a2a", "dcp_empty: a rank empty for a request",
       "dcp_empty: every rank holds every request", "split: all decodes", "split: with padding requests", "split: decodes + prefills", "interleave > 1",
       "CUDA-graph padding rows past the last request", "spec decodes (s_q > 1) of several requests",
       "decode_topk: K % 128 == 64", "decode_topk: K % 128 == 0", "raw (non-power-of-two) scales",
       "row with no valid index", "only the decodes of a mixed batch through forward_mqa") + DEGENERATE


def _dcp_candidates(rng: random.Random, p: Profile) -> list[dict]:
    """Batches of 2 ranks (`coverage.covering_set` sets the campaign's world size) at 1 or 8 local
    heads, in every world size's FP8 envelope (8 ranks * 8 heads = 64): spec decodes over contexts
    of 0-1 tokens (ranks empty) with padding requests and rows, combined all-to-all; decodes and
    prefills at interleave 2, and the decodes alone through forward_mqa, over contexts every rank
    holds a shard of, combined by all-gather and reduce-scatter."""
    found = []
    for _ in range(FORWARD_VARIANTS):
        base = {"dcp_size": 2, "interleave": 1, "combine": "ag_rs"}
        ctx = [rng.randint(40, 80) for _ in range(4)]
        found += [
            {**_batch(rng, p, "fp8_ds_mla", rng.choice((1, 8)), [2, 2, 2, 0, 0], 64, max_decode_query_len=2,
                      scale_rule="raw", invalid=["whole_row", "scattered"], value_regime="degenerate", **base),
             "context_lens": [rng.randint(0, 1) for _ in range(5)], "combine": "a2a", "pad_rows": rng.randint(1, 3)},
            {**_batch(rng, p, "fp8_ds_mla", rng.choice((1, 8)), [1, 1, 3, 2], 128, value_regime="degenerate", **base),
             "context_lens": ctx, "interleave": 2},
            {**_batch(rng, p, "fp8_ds_mla", rng.choice((1, 8)), [1, 1, 3, 2], 128, mqa="decodes", **base),
             "context_lens": ctx},
        ]
    return found


def _dcp_hits(p, kw: dict) -> set[str]:
    """forward_mqa's features of the batch every rank builds, its padding rows and interleave, and
    the combine (a protocol the case runs, not a tensor: read from its params)."""
    b = kw["batch"]
    hit = _forward_hits(p, kw) | {f"combine: {p.combine}"}
    return hit | {name for name, yes in (
        ("interleave > 1", b.config.get("interleave", 1) > 1),
        ("CUDA-graph padding rows past the last request", _rows(b.q) > b.query_start_loc[-1]),
    ) if yes}


register("dcp", None, Coverage(DCP, _dcp_candidates, _dcp_hits))


# --- forward_mqa's HiSparse paths ---------------------------------------------------------------

HISPARSE = ("split: all decodes", "split: decodes + prefills", "batch > 1", "two or more prefill requests",
            "row with no valid index", "pages missing from the hot cache", "a decode's page missing from the hot cache",
            "decodes alone, every context page but the tail swapped in",
            "a swap budget below the decodes (the resident route)",
            "several layers on the resident route, the persistent buffer holding its rows",
            "several layers on the resident route, the persistent buffer below its rows (the fallback)")
HISPARSE_FEATURES = {"bf16_hisparse": HISPARSE,
                     "fp8_separate_hisparse": HISPARSE + ("chunks: 2 chunks", "chunks: >= 3 chunks",
                                                          "raw (non-power-of-two) scales")}


def _hisparse_candidates(path: str):
    dtype = "bfloat16" if path == "bf16_hisparse" else "fp8_ds_mla"

    def batch(rng: random.Random, p: Profile, qlens: list[int], s: int, **extra) -> dict:
        # Pages before the resident tail: contexts of several of the smallest blocks.
        bs = min(p.block_sizes)
        ctx = [rng.randint(2 * bs, 4 * bs) for _ in qlens]
        return {"cache_dtype": dtype, "heads": rng.choice(p.mqa_heads), "query_lens": qlens, "context_lens": ctx,
                "block_size": bs, "topk": 128, "sm_scale": 0.1352,
                "value_regime": rng.choice(("normal", "peaked")), "scale_rule": "raw", "invalid": ["whole_row"],
                "max_decode_query_len": s, "max_model_len": max(c + n for c, n in zip(ctx, qlens)),
                "hisparse": True, "layers": 1, "resident_frac": 0.3, "slot_perm": True, **extra}

    def candidates(rng: random.Random, p: Profile) -> list[dict]:
        found = []
        for _ in range(FORWARD_VARIANTS):
            found += [
                batch(rng, p, [1, 1, 3, 5], 1),
                # Decodes alone, every page swapped in; broad softmaxes: one stale key of K shows.
                batch(rng, p, [1, 1, 1], 1, resident_frac=0.0, value_regime="normal"),
                # The resident route (the persistent group buffer's): every page resident, the swap
                # budget below the decodes; the buffer as large as the batch, or below it.
                batch(rng, p, [2, 2, 2], 2, resident_frac=1.0, swap_rows="below", layers=2),
                batch(rng, p, [2, 2, 2], 2, resident_frac=1.0, swap_rows="below", layers=2,
                      buffer_rows=rng.randint(1, 5)),
            ]
            if dtype == "fp8_ds_mla":
                for chunks in (2, 3):  # prefills of one length, a workspace as long: one chunk each
                    n = rng.randint(10, 20)
                    b = batch(rng, p, [1] + [n] * chunks, 1, heads=32)  # routing's chunks: the separate heads
                    b["context_lens"] = b["context_lens"][:1] + [b["context_lens"][1]] * chunks
                    b["max_model_len"] = b["workspace_size"] = max(c + q for c, q in zip(b["context_lens"], b["query_lens"]))
                    found.append(b)
        return found

    return candidates


def _swapped_in(residency: torch.Tensor, seq_len: int, bs: int) -> bool:
    """Whether a request's state row holds none of its pages but the always-resident tail."""
    return bool((residency[: max(0, -(-seq_len // bs) - ACTIVE_TAIL_PAGES)] == 0).all())


def _hisparse_hits(p, kw: dict) -> set[str]:
    hb = kw["batch"]
    b, tables = hb.plain, hb.tables
    hit = _forward_hits(p, kw)
    qsl, seqs, bs = b.query_start_loc, b.seq_lens, b.config.get("block_size", p.block_size)
    states = tables["request_state_indices"].long()
    absent = [bool((tables["residency"][int(states[r]), : -(-n // bs)] == 0).any()) for r, n in enumerate(seqs)]
    missing = any(absent)
    split = split_decodes_and_prefills(qsl, b.config["max_decode_query_len"])
    num_decode_tokens = split.num_decode_tokens
    # The resident route converts through the group's buffer: every token (BF16 with prefills) or the decodes.
    prefills = num_decode_tokens < qsl[-1]
    resident = not missing and (hb.config["max_swap_rows"] < num_decode_tokens or prefills)
    rows = qsl[-1] if prefills and b.config["kv_cache_dtype"] == "bfloat16" else num_decode_tokens
    layers, buffer = len(hb.q_layers), hb.group_buffer[0].shape[0]
    return hit | {name for name, yes in (
        ("pages missing from the hot cache", missing),
        ("a decode's page missing from the hot cache", any(absent[:split.num_decodes])),
        ("decodes alone, every context page but the tail swapped in",
         split.num_prefills == 0 and all(_swapped_in(tables["residency"][int(states[r])], n, bs) for r, n in enumerate(seqs))),
        ("a swap budget below the decodes (the resident route)", hb.config["max_swap_rows"] < num_decode_tokens),
        ("several layers on the resident route, the persistent buffer holding its rows",
         resident and layers > 1 and 0 < rows <= buffer),
        ("several layers on the resident route, the persistent buffer below its rows (the fallback)",
         resident and layers > 1 and buffer < rows),
    ) if yes}


for _path, _features in HISPARSE_FEATURES.items():
    register("forward_mqa", _path, Coverage(_features, _hisparse_candidates(_path), _hisparse_hits))
