"""The covering features of the exact ops (`equivalence.coverage.sets`): the fp8_ds_mla codec and cache
writer, the workspace gathers, the layout ops, the DCP index filter and merge.

Each template asks for several features at once; `VARIANTS` seeded copies let the greedy pick
take one whose built tensors show them.
"""

from __future__ import annotations

import random

import torch

from mla_verify import reference
from mla_verify.reference.fp8_ds_mla import FP8_MAX, POW2_FLOOR

from ..cases.profiles import Profile
from .pairs import Factor, Row
from .registry import Coverage, Pairs, laid_out, register

VARIANTS = 3


def _scale_classes(rows: torch.Tensor) -> set[str]:
    """Raw (not a power of two) and power-of-two scales among packed fp8_ds_mla rows [..., 656]."""
    scales = rows[..., 512:528].contiguous().view(torch.float32).reshape(-1)
    scales = scales[scales.isfinite() & (scales > 0)]
    pow2 = torch.frexp(scales).mantissa == 0.5
    return {name for name, yes in (("raw (non-power-of-two) scales", bool((~pow2).any())),
                                   ("power-of-two scales", bool(pow2.any()))) if yes}


# --- quantize / dequantize fp8_ds_mla --------------------------------------------------------------

CODEC = ("raw (non-power-of-two) scales", "power-of-two scales", "a power-of-two scale held at the floor",
         "a zero tile's raw scale", "a tile past the fp8 range before scaling", "> 64 rows")


def _codec_candidates(rng: random.Random, p: Profile) -> list[dict]:
    return [c for _ in range(VARIANTS) for c in (
        {"n": rng.randint(65, 70), "value_regime": "normal", "scale_rule": "raw"},  # raw scales round x / s
        {"n": rng.randint(2, 8), "value_regime": "zero_tiles", "scale_rule": "raw"},
        {"n": rng.randint(2, 8), "value_regime": rng.choice(("tiny", "zero_tiles")), "scale_rule": "pow2"},
        {"n": rng.randint(2, 8), "value_regime": "saturation", "scale_rule": rng.choice(("pow2", "raw"))},
    )]


def _codec_hits(p, kw: dict) -> set[str]:
    """From the packed rows (quantize: the reference's of its kv) and the values they hold: a tile
    whose amax / 448 is below the power-of-two floor yet scaled at or above it, or a zero tile
    scaled below it (the raw rule's FLT_MIN)."""
    rows = kw["rows"] if "rows" in kw else reference.quantize_fp8_ds_mla(kw["kv"], kw["scale_rule"])
    kv = kw["kv"] if "kv" in kw else reference.dequantize_fp8_ds_mla(rows)
    amax = kv[:, :512].float().abs().view(-1, 4, 128).amax(-1)
    scales = rows[:, 512:528].contiguous().view(torch.float32)
    return _scale_classes(rows) | {name for name, yes in (
        ("a power-of-two scale held at the floor", bool(((amax / FP8_MAX < POW2_FLOOR) & (scales >= POW2_FLOOR)).any())),
        ("a zero tile's raw scale", bool(((amax == 0) & (scales < POW2_FLOOR)).any())),
        ("a tile past the fp8 range before scaling", bool((amax > FP8_MAX).any())), ("> 64 rows", rows.shape[0] > 64),
    ) if yes}


for _op in ("quantize_fp8_ds_mla", "dequantize_fp8_ds_mla"):
    register(_op, None, laid_out(_op, Coverage(CODEC, _codec_candidates, _codec_hits)))


# --- write_fp8_ds_mla_cache ----------------------------------------------------------------------

WRITER = ("skipped slots (-1)", "padded block stride", "several blocks", "raw (non-power-of-two) scales",
          "power-of-two scales", "a slot in the last block")


def _writer_candidates(rng: random.Random, p: Profile) -> list[dict]:
    found = []
    for _ in range(VARIANTS):
        bs = rng.choice((16,) + p.block_sizes)
        found += [{"n": 2 * bs, "num_blocks": 3, "block_size": bs, "stride_pad": rng.choice((1, 3)),
                   "value_regime": "normal", "scale_rule": "raw", "skip_frac": 0.2},
                  {"n": rng.randint(1, bs), "num_blocks": 2, "block_size": bs, "stride_pad": 0,
                   "value_regime": rng.choice(("normal", "outliers")), "scale_rule": "pow2", "skip_frac": 0.0}]
    return found


def _writer_hits(p, kw: dict) -> set[str]:
    cache, slots = kw["kv_cache"], kw["slot_mapping"]
    blocks, bs = cache.shape[0], cache.shape[1]
    return _scale_classes(reference.quantize_fp8_ds_mla(kw["kv"], kw["scale_rule"])) | {name for name, yes in (
        ("skipped slots (-1)", bool((slots < 0).any())), ("padded block stride", cache.stride(0) > bs * 656),
        ("several blocks", bool((slots[slots >= 0] // bs).unique().numel() > 1)),
        ("a slot in the last block", bool((slots // bs == blocks - 1).any())),
    ) if yes}


register("write_fp8_ds_mla_cache", None,
         laid_out("write_fp8_ds_mla_cache", Coverage(WRITER, _writer_candidates, _writer_hits)))


# --- gather_upconvert ----------------------------------------------------------------------------

ZERO_LENGTH = "a zero-length request (its workspace start repeated)"
GATHER = ("several requests", "padded block stride", "a partly filled last block", "table columns past the longest",
          "blocks out of order", "> 64 rows", ZERO_LENGTH)


def _gather_candidates(rng: random.Random, p: Profile) -> list[dict]:
    return [c for _ in range(VARIANTS) for c in (
        {"seq_lens": [rng.randint(20, 40), rng.randint(45, 70)], "block_size": 16, "stride_pad": 2, "table_pad": 1,
         "shuffle": True, "value_regime": "normal", "scale_rule": "raw"},
        {"seq_lens": [rng.randint(1, p.max_context)], "block_size": rng.choice(p.block_sizes), "stride_pad": 0,
         "table_pad": 0, "shuffle": False, "value_regime": "zero_tiles", "scale_rule": "pow2"},
        # vLLM pads request slots (#51486): an empty request repeats the next one's start.
        {"seq_lens": [rng.randint(1, 20), 0, rng.randint(1, 20), 0], "block_size": 16, "stride_pad": 0,
         "table_pad": 0, "shuffle": True, "value_regime": "normal", "scale_rule": "pow2"},
    )]


def _gather_hits(p, kw: dict) -> set[str]:
    cache, table, starts, rows = kw["kv_cache"], kw["block_table"], kw["workspace_starts"], kw["num_rows"]
    bs = cache.shape[1]
    lens = torch.diff(torch.cat([starts.long(), torch.tensor([rows], device=starts.device)]))
    used = torch.cat([table[r, : int(-(-n // bs))] for r, n in enumerate(lens.tolist())])
    return {name for name, yes in (
        ("several requests", starts.numel() > 1), ("padded block stride", cache.stride(0) > bs * cache.shape[2]),
        ("a partly filled last block", bool((lens % bs != 0).any())),
        ("table columns past the longest", table.shape[1] > int(-(-lens.max() // bs))),
        ("blocks out of order", bool((used != used.sort().values).any())),
        ("> 64 rows", rows > 64), (ZERO_LENGTH, bool((lens == 0).any())),
    ) if yes}


def _gather_factors(p: Profile) -> tuple[Factor, ...]:
    return (Factor("zero_length", (False, True)), Factor("block_size", tuple(sorted({16, 64, *p.block_sizes}))),
            Factor("shuffle", (False, True)), Factor("stride_pad", (0, 2)))


def _gather_row(rng: random.Random, p: Profile, row: Row) -> dict:
    """A chunk of two or three requests of the row's kind, an empty one among them where asked."""
    lens = [rng.randint(1, 3 * row["block_size"]) for _ in range(rng.randint(2, 3))]
    if row["zero_length"]:
        lens.insert(rng.randint(0, len(lens)), 0)
    return {"seq_lens": lens, "block_size": row["block_size"], "stride_pad": row["stride_pad"],
            "table_pad": rng.randint(0, 1), "shuffle": row["shuffle"], "value_regime": "normal",
            "scale_rule": rng.choice(("pow2", "raw"))}


def _gather_shown(p, kw: dict) -> Row:
    cache, starts = kw["kv_cache"], kw["workspace_starts"].long()
    lens = torch.diff(torch.cat([starts, torch.tensor([kw["num_rows"]], device=starts.device)]))
    return {"zero_length": bool((lens == 0).any()), "block_size": cache.shape[1], "shuffle": bool(p.shuffle),
            "stride_pad": cache.stride(0) // cache.shape[2] - cache.shape[1]}


for _op in ("gather_upconvert_fp8", "gather_upconvert_nvfp4"):
    register(_op, None, laid_out(_op, Coverage(GATHER, _gather_candidates, _gather_hits,
                                               Pairs(_gather_factors, _gather_row, _gather_shown, strength=3))))


# --- split_prefill_chunks ------------------------------------------------------------------------

CHUNKS = ("one chunk", "several chunks", "a chunk of several requests filling the workspace exactly",
          "a request as long as the workspace")


def _chunk_candidates(rng: random.Random, p: Profile) -> list[dict]:
    found = []
    for _ in range(VARIANTS):
        lens = [rng.randint(1, 50) for _ in range(2)]
        lens += [rng.randint(1, sum(lens)) for _ in range(2)]  # the first two fill the workspace exactly
        found += [{"seq_lens": lens, "workspace_size": lens[0] + lens[1]},
                  {"seq_lens": lens[:2], "workspace_size": sum(lens[:2]) + 1},
                  {"seq_lens": [lens[0], 60, lens[1]], "workspace_size": 60}]
    return found


def _chunk_hits(p, kw: dict) -> set[str]:
    chunks = reference.split_prefill_chunks(kw["seq_lens"], kw["workspace_size"])
    lens, ws = kw["seq_lens"], kw["workspace_size"]
    return {name for name, yes in (
        ("one chunk", len(chunks) == 1), ("several chunks", len(chunks) > 1),
        ("a chunk of several requests filling the workspace exactly",
         any(b - a > 1 and sum(lens[a:b]) == ws for a, b in chunks)),
        ("a request as long as the workspace", ws in lens),
    ) if yes}


register("split_prefill_chunks", None, Coverage(CHUNKS, _chunk_candidates, _chunk_hits))


# --- concat_mla_q and the spec-decode reshapes ----------------------------------------------------

LAYOUT = ("several tokens", "several heads", "> 64 tokens")


def _concat_candidates(rng: random.Random, p: Profile) -> list[dict]:
    # The small one: a layout left for the last picks rides on it (the interpreter's seconds grow
    # with the rows: 0.75 s at 70 tokens of 16 heads).
    return [c for _ in range(VARIANTS) for c in ({"tokens": rng.randint(65, 70), "heads": max(p.heads)},
                                                 {"tokens": rng.randint(2, 3), "heads": 2})]


def _concat_hits(p, kw: dict) -> set[str]:
    q = kw["ql_nope"]
    hit = {name for name, yes in (("several tokens", q.shape[0] > 1), ("several heads", q.shape[1] > 1),
                                   ("> 64 tokens", q.shape[0] > 64)) if yes}
    if not kw["ql_nope"].is_contiguous() and not kw["q_pe"].is_contiguous():
        hit.add("strided views of one buffer")
    return hit


register("concat_mla_q", None,
         laid_out("concat_mla_q", Coverage(LAYOUT + ("strided views of one buffer",), _concat_candidates, _concat_hits)))

RESHAPE = ("several decodes", "s > 1", "several heads", "a 4-D output")


def _reshape_candidates(rng: random.Random, p: Profile) -> list[dict]:
    return [c for _ in range(VARIANTS) for c in (
        {"num_decodes": rng.randint(2, 4), "s": rng.randint(2, 4), "heads": max(p.heads), "four_d": True},
        {"num_decodes": rng.randint(2, 4), "s": rng.randint(2, 4), "heads": max(p.heads), "four_d": False})]


def _reshape_hits(p, kw: dict) -> set[str]:
    t = kw["q"] if "q" in kw else kw["out"]
    decodes = kw.get("num_decodes", t.shape[0] if t.ndim == 4 else None)
    tokens = t.shape[0] * t.shape[1] if t.ndim == 4 else t.shape[0]
    s = tokens // decodes if decodes else None  # a 3-D output alone does not say its s
    return {name for name, yes in (
        ("several decodes", bool(decodes) and decodes > 1), ("s > 1", bool(s) and s > 1),
        ("several heads", t.shape[-2] > 1), ("a 4-D output", t.ndim == 4 and "out" in kw),
    ) if yes}


for _op, _features in (("reshape_query_for_spec_decode", RESHAPE[:3]),
                      ("reshape_attn_output_for_spec_decode", ("several decodes", "several heads", "a 4-D output"))):
    register(_op, None, laid_out(_op, Coverage(_features, _reshape_candidates, _reshape_hits)))


# --- dcp_convert_index and dcp_merge --------------------------------------------------------------

DCP_INDEX = ("several ranks", "a rank past the first", "interleave > 1", "compacted to the front",
             "an entry owned elsewhere", "negatives other than -1", "index past the table")


def _dcp_index_candidates(rng: random.Random, p: Profile) -> list[dict]:
    found = []
    for _ in range(VARIANTS):
        size = rng.choice((2, 4))
        found += [{"tokens": rng.randint(3, 8), "requests": 2, "table_width": 3, "topk": rng.choice(p.decode_topk),
                   "block_size": 64, "dcp_size": size, "dcp_rank": rng.randint(1, size - 1),
                   "interleave": rng.choice((2, 4)), "compact": True,
                   "invalid": ["out_of_range", "scattered", "negatives"]},
                  {"tokens": rng.randint(3, 8), "requests": 1, "table_width": 2, "topk": rng.choice(p.decode_topk),
                   "block_size": 16, "dcp_size": size, "dcp_rank": 0, "interleave": 1, "compact": False,
                   "invalid": []}]
    return found


def _dcp_index_hits(p, kw: dict) -> set[str]:
    idx, size, rank = kw["topk_indices"], kw["dcp_size"], kw["dcp_rank"]
    owner = (idx.clamp(min=0) // kw["interleave"]) % size
    return {name for name, yes in (
        ("several ranks", size > 1), ("a rank past the first", rank > 0), ("interleave > 1", kw["interleave"] > 1),
        ("compacted to the front", kw["compact_valid_to_front"]),
        ("an entry owned elsewhere", bool(((idx >= 0) & (owner != rank)).any())),
        ("negatives other than -1", bool((idx < -1).any())),
        ("index past the table", bool((idx >= kw["block_table"].shape[1] * kw["block_size"] * size).any())),
    ) if yes}


def _dcp_index_factors(p: Profile) -> tuple[Factor, ...]:
    """Every rank count 1-8 (3, 5, 6 and 7 leave a rank without a partner in a pairwise tree), the
    interleaves the draws take, compaction."""
    return (Factor("dcp_size", tuple(range(1, 9))), Factor("interleave", (1, 2, 4, 64)),
            Factor("compact", (False, True)))


def _dcp_index_row(rng: random.Random, p: Profile, row: Row) -> dict:
    return {"tokens": rng.randint(3, 6), "requests": 2, "table_width": 3, "topk": rng.choice(p.decode_topk),
            "block_size": 64, "dcp_size": row["dcp_size"], "dcp_rank": rng.randint(0, row["dcp_size"] - 1),
            "interleave": row["interleave"], "compact": row["compact"], "invalid": rng.choice(([], ["scattered"]))}


def _dcp_index_shown(p, kw: dict) -> Row:
    return {"dcp_size": kw["dcp_size"], "interleave": kw["interleave"], "compact": bool(kw["compact_valid_to_front"])}


register("dcp_convert_index", None, laid_out("dcp_convert_index", Coverage(
    DCP_INDEX, _dcp_index_candidates, _dcp_index_hits, Pairs(_dcp_index_factors, _dcp_index_row, _dcp_index_shown))))

MERGE = ("several ranks", "a token empty on every rank", "a NaN LSE", "a +inf LSE", "> 64 tokens")


def _merge_candidates(rng: random.Random, p: Profile) -> list[dict]:
    return [c for _ in range(VARIANTS) for c in (
        {"ranks": rng.choice((2, 4)), "tokens": rng.randint(65, 70), "heads": min(p.heads), "empty_frac": 0.3,
         "junk": True},
        {"ranks": 8, "tokens": rng.randint(2, 6), "heads": max(p.heads), "empty_frac": 0.0, "junk": False},
        # The small one: a layout left for the last picks rides on it (2.5 s interpreted at 69 tokens).
        {"ranks": 2, "tokens": rng.randint(2, 3), "heads": 1, "empty_frac": 0.0, "junk": False})]


def _merge_hits(p, kw: dict) -> set[str]:
    lses = kw["lses"]
    return {name for name, yes in (
        ("several ranks", lses.shape[0] > 1), ("a token empty on every rank", bool((lses == -torch.inf).all(0).any())),
        ("a NaN LSE", bool(lses.isnan().any())), ("a +inf LSE", bool((lses == torch.inf).any())),
        ("> 64 tokens", lses.shape[1] > 64),
    ) if yes}


def _merge_factors(p: Profile) -> tuple[Factor, ...]:
    """Every rank count 1-8, value by value (an odd count leaves a rank without a partner), with and
    without undefined partials and empty ones."""
    return (Factor("ranks", tuple(range(1, 9))), Factor("junk", (False, True)), Factor("empty", (False, True)))


def _merge_row(rng: random.Random, p: Profile, row: Row) -> dict:
    return {"ranks": row["ranks"], "tokens": rng.randint(10, 12), "heads": 2, "empty_frac": 0.3 if row["empty"] else 0.0,
            "junk": row["junk"]}  # 20-24 rows a rank: a junk or empty one among them (three tries: pair_cases)


def _merge_shown(p, kw: dict) -> Row:
    lses = kw["lses"]
    return {"ranks": lses.shape[0], "junk": bool((lses.isnan() | (lses == torch.inf)).any()),
            "empty": bool((lses == -torch.inf).any())}


register("dcp_merge", None, laid_out("dcp_merge", Coverage(MERGE, _merge_candidates, _merge_hits,
                                                           Pairs(_merge_factors, _merge_row, _merge_shown))))
