"""Hypothesis strategies for the properties: per property and target, the base problem (the op
strategies' params, `fuzz.strategies`) plus the property's own knobs, and an integer seed.

Every drawn case stays inside what every registered implementation accepts (FlashMLA: at most 128
heads, prefill top-k a multiple of 128 and decode top-k of 64), so the padded and widened
problems are valid too.
"""

from __future__ import annotations

from typing import Callable

from hypothesis import strategies as st

from mla_verify.equivalence.case import Case
from mla_verify.equivalence.properties import PREFIX, get_property
from mla_verify.equivalence.properties.split import SCHEMES
from mla_verify.reference.metadata import reorder_batch_threshold, split_decodes_and_prefills

from .profiles import Profile
from .strategies import dcp_index_params, decode_params, forward_params, hisparse_params, merge_params, prefill_params, seeds

MAX_HEADS = 128              # FlashMLA's largest head count (the wrappers pad to 64 or 128)
TOPK_UNIT = {"sparse_prefill": 128, "sparse_decode_fp8": 64}  # FlashMLA's top-k granularity
MIN_BATCH = 8                # batch invariance: "in a batch of 8 or more"


def _parts(params: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    return st.tuples(params, st.integers(2, 4), st.sampled_from(SCHEMES)).map(
        lambda t: {**t[0], "parts": t[1], "scheme": t[2]})


@st.composite
def _padding(draw, params: st.SearchStrategy[dict], target: str) -> dict:
    """Base problem plus padding knobs; decode draws the padded batch and keeps its first rows."""
    d = draw(params)
    if target == "sparse_decode_fp8":
        extra = draw(st.integers(1, d["batch"] - 1))
        d = {**d, "batch": d["batch"] - extra, "pad_tokens": extra}
    else:
        d = {**d, "pad_tokens": draw(st.integers(1, 3))}
    return {**d, "pad_rows": draw(st.sampled_from(("live", "empty"))),
            "pad_heads": draw(st.integers(min(1, MAX_HEADS - d["heads"]), min(16, MAX_HEADS - d["heads"]))),
            "wider": TOPK_UNIT[target] * draw(st.integers(1, 2))}


def _block_table(p: Profile) -> st.SearchStrategy[dict]:
    batches = st.sampled_from(("bf16", "fp8_mixed", "fp8_separate")).flatmap(lambda path: forward_params(p, path))
    # Top-k entries past the table would reach the added columns: no out_of_range or boundaries pattern.
    return st.tuples(batches, st.integers(1, 3), st.sampled_from(("null", "blocks"))).map(lambda t: {
        **t[0], "invalid": [i for i in t[0]["invalid"] if i not in ("out_of_range", "boundaries")], "pad_columns": t[1],
        "pad_fill": t[2]})


def _prefill_seq_lens(params: dict) -> list[int]:
    """Sequence lengths of the requests the batch treats as prefills."""
    qsl = [0]
    for n in params["query_lens"]:
        qsl.append(qsl[-1] + n)
    threshold = reorder_batch_threshold(params["heads"], params["arch"], max_decode_query_len=params["max_decode_query_len"])
    first = split_decodes_and_prefills(qsl, threshold).num_decodes
    return [c + n for c, n in zip(params["context_lens"][first:], params["query_lens"][first:])]


@st.composite
def _chunked(draw, p: Profile) -> dict:
    """fp8_separate batches with two or more prefills and a workspace that splits them into chunks.

    No beyond_seq or boundaries pattern: a prefill's entry past its own sequence (the table's
    last slot is one) reads whichever workspace row sits there (the next request's, or none past
    the chunk), garbage that moves with the layout."""
    d = draw(forward_params(p, "fp8_separate", min_prefills=2).filter(lambda d: len(_prefill_seq_lens(d)) >= 2))
    lens = _prefill_seq_lens(d)
    return {**d, "invalid": [i for i in d["invalid"] if i not in ("beyond_seq", "boundaries")],
            "workspace_size": draw(st.integers(max(lens), sum(lens) - 1))}


@st.composite
def _alone(draw, p: Profile) -> dict:
    """Decode batches of 8 or more single-token requests (spec_decode covers s > 1), and the
    requests to run alone."""
    batch = st.integers(MIN_BATCH, max(MIN_BATCH, min(64, p.max_tokens)))
    d = draw(decode_params(p, batch=batch, s_q=st.just(1)))
    return {**d, "alone": draw(st.lists(st.integers(0, d["batch"] - 1), min_size=1, max_size=2, unique=True))}


@st.composite
def _fp8_hisparse_like_plain(draw, p: Profile) -> dict:
    """fp8 HiSparse batches the plain separate path splits the same way: 32 heads on sm90, prefills
    longer than its threshold, and -1 only at the tail of a top-k row (no invalid-index patterns:
    each of them, duplicates too, leaves -1 or an out-of-range entry between valid ones)."""
    d = draw(hisparse_params(p, "fp8_separate_hisparse", heads=(32,)))
    s = d["max_decode_query_len"]
    longer = reorder_batch_threshold(32, "sm90", max_decode_query_len=s) + draw(st.integers(0, 8))
    qlens = [n if n == s else longer + n for n in d["query_lens"]]
    seq_max = max(c + n for c, n in zip(d["context_lens"], qlens))
    ws = d["workspace_size"]
    return {**d, "query_lens": qlens, "arch": "sm90", "invalid": [],
            "max_model_len": seq_max, "buffer_rows": min(d["buffer_rows"], sum(qlens) + 2),
            "workspace_size": None if ws is None else max(ws, seq_max)}


PARAMS: dict[str, dict[str, Callable[[Profile], st.SearchStrategy[dict]]]] = {
    "split_invariance": {
        "sparse_prefill": lambda p: _parts(prefill_params(p, sink=st.just("none"))),
        "sparse_decode_fp8": lambda p: _parts(decode_params(p)),
    },
    "decode_equals_prefill": {
        "sparse_decode_fp8": lambda p: decode_params(p, scale_rule=st.just("pow2")),
    },
    "padding_and_order": {
        "sparse_prefill": lambda p: _padding(prefill_params(p), "sparse_prefill"),
        "sparse_decode_fp8": lambda p: _padding(decode_params(p, batch=st.integers(2, max(2, p.max_tokens // 2 + 1))),
                                                "sparse_decode_fp8"),
        "forward_mqa": _block_table,
    },
    "batch_invariance": {
        "sparse_decode_fp8": _alone,
        "forward_mqa": _chunked,
    },
    "spec_decode": {
        "sparse_decode_fp8": lambda p: decode_params(p, s_q=st.integers(2, 4)),
        "forward_mqa": lambda p: forward_params(p, "fp8_separate", decodes_only=True),
    },
    "dcp_size_one": {
        "dcp_convert_index": lambda p: dcp_index_params(p, sizes=(1,)),
        "forward_mqa": lambda p: forward_params(p, "fp8_mixed"),
        "dcp_merge": lambda p: merge_params(p, ranks=st.just(1), junk=st.just(False)),
    },
    "hisparse_equals_plain": {
        "forward_mqa": lambda p: st.one_of(hisparse_params(p, "bf16_hisparse"), _fp8_hisparse_like_plain(p)),
    },
    "determinism": {
        "sparse_prefill": prefill_params,
        "sparse_decode_fp8": decode_params,
        "forward_mqa": forward_params,
        "dcp_merge": merge_params,
    },
}


def property_cases(op: str, profile: Profile, target: str | None = None) -> st.SearchStrategy[Case]:
    """Cases of property `op` ("property:NAME") on `target`, or on any of its targets."""
    prop = get_property(op)
    targets = [target] if target is not None else list(prop.targets)
    unknown = [t for t in targets if t not in prop.targets]
    if unknown:
        raise KeyError(f"{op} has no target {unknown[0]!r}; targets: {', '.join(prop.targets)}")
    params = st.one_of(*(PARAMS[prop.name][t](profile).map(lambda d, t=t: {"target": t, **d}) for t in targets))
    return st.builds(lambda d, seed: Case(PREFIX + prop.name, d, seed), params, seeds)
