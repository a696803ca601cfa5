"""The Hypothesis draws the specs share: the params of the attention ops, of forward_mqa's
batches (plain, DCP, HiSparse), of the index conversions and of the DCP merge, within a profile.

Hypothesis draws the structure (shapes, knobs, patterns) and each spec adds an integer seed; the
tensors come from a generator seeded with it (each spec's `inputs`), so a failure shrinks to a
small structure and replays from its JSON. Every drawn case is valid by the op's contract: what a
correct implementation must accept. Draws only one spec uses live in its module.
"""

from __future__ import annotations

import functools
import random

from hypothesis import assume, strategies as st

from mla_verify.reference.metadata import reorder_batch_threshold, split_decodes_and_prefills

from .params import DECODE_PATTERNS, ForwardParams
from .patterns import FORWARD_PATTERNS, PATTERNS
from .profiles import Profile
from .schema import MAX_ELEMENTS
from .values import REGIMES

SEEDS = st.integers(0, 2**31 - 1)  # a case's seed: its tensors come from a generator seeded with it
DRAWN_LENGTHS = 8
regimes = st.sampled_from(REGIMES)
scale_rules = st.sampled_from(("pow2", "raw"))
sm_scales = st.sampled_from((0.0417, 0.1, 0.1352, 0.3))  # 576**-0.5, ..., DeepSeek's 192**-0.5 * mscale**2


def patterns(options) -> st.SearchStrategy[list[str]]:
    return st.lists(st.sampled_from(options), max_size=3, unique=True)


def prefill_params(p: Profile, **fields: st.SearchStrategy) -> st.SearchStrategy[dict]:
    """sparse_prefill params within `p`; `fields` replaces the strategy of any of them."""
    return st.fixed_dictionaries({
        "tokens": st.integers(1, p.max_tokens), "heads": st.sampled_from(p.heads),
        "kv_rows": st.integers(1, max(2, p.max_context)), "topk": st.sampled_from(p.prefill_topk),
        "value_regime": regimes, "sm_scale": sm_scales, "invalid": patterns(PATTERNS),
        "topk_length": st.sampled_from(("none", "random", "edges", "garbage")),
        "sink": st.sampled_from(("none", "finite", "inf")), **fields})


def lengths(size: int, longest: int) -> st.SearchStrategy[list[int]]:
    """`size` sequence lengths in [1, longest]: Hypothesis draws the first DRAWN_LENGTHS itself (its
    edge values and shrinking), the rest come uniformly from a drawn seed. Each Hypothesis draw
    costs tens of microseconds: 128 of them were a GPU-sized decode case's largest cost."""
    drawn = st.lists(st.integers(1, longest), min_size=min(size, DRAWN_LENGTHS), max_size=min(size, DRAWN_LENGTHS))
    if size <= DRAWN_LENGTHS:
        return drawn

    def extend(first: list[int], seed: int) -> list[int]:
        rng = random.Random(seed)
        return first + [rng.randint(1, longest) for _ in range(size - DRAWN_LENGTHS)]

    return st.builds(extend, drawn, SEEDS)


def decode_params(p: Profile, batch: st.SearchStrategy[int] | None = None, **fields: st.SearchStrategy) -> st.SearchStrategy[dict]:
    """sparse_decode_fp8 params within `p` (one seq_len per request of the drawn batch); `batch` and
    `fields` replace the default strategies."""
    def params(size: int) -> st.SearchStrategy[dict]:
        return st.fixed_dictionaries({
            "batch": st.just(size), "s_q": st.integers(1, 4), "heads": st.sampled_from(p.heads),
            "topk": st.sampled_from(p.decode_topk),
            "seq_lens": lengths(size, p.max_context),
            "page_size": st.sampled_from((1, 16) + p.block_sizes), "stride_pad": st.sampled_from((0, 1)),
            "value_regime": regimes, "scale_rule": scale_rules, "sm_scale": sm_scales,
            "invalid": patterns(DECODE_PATTERNS), **fields})

    # One strategy object per batch size: Hypothesis re-derives a new strategy's properties on
    # every draw, which cost more than the draws themselves.
    return (batch if batch is not None else st.integers(1, max(1, p.max_tokens // 2))).flatmap(functools.lru_cache(params))


def dcp_index_params(p: Profile, sizes: tuple[int, ...] = tuple(range(1, 9)),
                     layout: st.SearchStrategy[str] = st.just("contiguous")) -> st.SearchStrategy[dict]:
    """dcp_convert_index params within `p`, the world size drawn from `sizes`, the inputs' layout
    from `layout` (equivalence.cases.layouts)."""
    @st.composite
    def params(draw):
        size = draw(st.sampled_from(sizes))
        block_size = draw(st.sampled_from(p.block_sizes))
        return {"tokens": draw(st.integers(1, p.max_tokens * 2)), "requests": draw(st.integers(1, p.max_requests)),
                "table_width": draw(st.integers(1, 4)), "topk": draw(st.sampled_from(p.decode_topk)),
                "block_size": block_size, "dcp_size": size, "dcp_rank": draw(st.integers(0, size - 1)),
                "interleave": draw(st.sampled_from((1, 2, 4, 64))), "compact": draw(st.booleans()),
                "invalid": draw(patterns(PATTERNS)), "layout": draw(layout)}

    return params()


def merge_params(p: Profile, **fields: st.SearchStrategy) -> st.SearchStrategy[dict]:
    """dcp_merge params within `p`; `fields` replaces the strategy of any of them."""
    return st.fixed_dictionaries({
        "ranks": st.integers(1, 8), "tokens": st.integers(1, p.max_tokens * 2),
        "heads": st.sampled_from(p.heads), "empty_frac": st.sampled_from((0.0, 0.3)), "junk": st.booleans(), **fields})


FORWARD_PATHS = ("bf16", "fp8_mixed", "fp8_separate", "fp8_mixed_dcp", "bf16_hisparse", "fp8_separate_hisparse")
HISPARSE_PATHS = ("bf16_hisparse", "fp8_separate_hisparse")


def batch_params(draw, p: Profile, cache_dtype: str, heads: int, dcp: int, short_contexts: bool = False,
                  decodes_only: bool = False, min_prefills: int = 0) -> dict:
    """A forward_mqa batch for `heads` local heads over `dcp` ranks (make_batch's params).

    `short_contexts` draws contexts of a few tokens half the time: sequences shorter than one
    run of N * interleave tokens leave some ranks' shards empty. `decodes_only`: a uniform batch
    of spec decodes (2-4 tokens each), nothing else; `min_prefills`: at least that many
    prefills, every token through forward_mqa.
    """
    mixed = cache_dtype == "fp8_ds_mla" and heads < 32
    block_size = draw(st.sampled_from(p.block_sizes))
    interleave = draw(st.sampled_from([i for i in (1, 2, 4, 64) if block_size % i == 0])) if dcp > 1 else 1
    s = draw(st.integers(2, 4) if decodes_only else st.integers(1, 3))
    n_dec = draw(st.integers(1 if decodes_only else 0, p.max_requests))
    padding = draw(st.integers(0, 2)) if n_dec and not decodes_only else 0  # zero-length CUDA-graph padding requests
    prefills = [] if decodes_only else draw(st.lists(
        st.integers(1, p.max_query), min_size=max(min_prefills, 0 if n_dec else 1), max_size=max(min_prefills, p.max_requests)))
    qlens = [s] * n_dec + [0] * padding + prefills
    contexts = st.one_of(st.integers(0, 3), st.integers(0, p.max_context)) if short_contexts else st.integers(0, p.max_context)
    ctx = [draw(contexts) for _ in qlens]
    # The FP8 decode kernel's 64-entry unit wherever no BF16 prefill kernel (128) reads the lists.
    topk = draw(st.sampled_from(p.decode_topk if mixed or not prefills else p.prefill_topk))
    seq_max = max(c + n for c, n in zip(ctx, qlens))
    arch = draw(st.sampled_from(("sm90", "sm100")))
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    first = split_decodes_and_prefills(qsl, reorder_batch_threshold(heads, arch, max_decode_query_len=s)).num_decodes
    prefill_seqs = [c + n for c, n in zip(ctx[first:], qlens[first:])]
    # Chunked: with two or more prefills a workspace below their total (at least two chunks, at
    # every profile's lengths), else one little larger than the longest sequence.
    chunked = draw(st.sampled_from((True, True, False))) and cache_dtype == "fp8_ds_mla" and not mixed
    if chunked and len(prefill_seqs) >= 2:
        # Half the time as tight as the longest sequence: as many chunks as the batch allows.
        longest = max(prefill_seqs)
        workspace = draw(st.one_of(st.just(longest), st.integers(longest, max(longest, sum(prefill_seqs) - 1))))
    elif chunked:
        workspace = draw(st.integers(seq_max, seq_max + seq_max // 2))
    return {
        "cache_dtype": cache_dtype, "heads": heads, "query_lens": qlens, "context_lens": ctx,
        "block_size": block_size, "stride_pad": draw(st.sampled_from((0, 1, 64))),
        "spare_blocks": draw(st.integers(0, 2)), "shuffle": draw(st.booleans()), "table_pad": draw(st.integers(0, 2)),
        "topk": topk, "sm_scale": draw(sm_scales), "value_regime": draw(regimes), "scale_rule": draw(scale_rules),
        "invalid": draw(patterns(FORWARD_PATTERNS)),
        # Only decode tokens reach forward_mqa when dense MHA takes the prefills; under DCP with
        # interleave != 1 nothing counts as a decode (threshold 1), so that case has no rows.
        "mqa": draw(st.sampled_from(("all", "decodes"))) if n_dec and interleave == 1 and not min_prefills else "all",
        "q_form": draw(st.sampled_from(("tensor", "tuple"))) if dcp == 1 else "tensor",
        "arch": arch, "max_decode_query_len": s,
        "max_model_len": seq_max,
        "workspace_size": workspace if chunked else None,
        "dcp_size": dcp, "interleave": interleave,
    }


def forward_params(p: Profile, path: str | None = None, *, decodes_only: bool = False,
                   min_prefills: int = 0) -> st.SearchStrategy[dict]:
    """forward_mqa batches; `path` restricts them to one of FORWARD_PATHS. `decodes_only`: a
    uniform batch of spec decodes (2-4 tokens each), nothing else; `min_prefills`: at least that
    many prefills, every token through forward_mqa."""
    if path is not None and (path not in FORWARD_PATHS or path in HISPARSE_PATHS):
        raise KeyError(f"unknown plain forward_mqa path {path!r}; known: {', '.join(FORWARD_PATHS)} (HiSparse: hisparse_params)")
    small = [h for h in p.mqa_heads if h < 32] or [16]
    large = [h for h in p.mqa_heads if h >= 32] or [32]

    @st.composite
    def params(draw):
        if path is None:
            heads = draw(st.sampled_from(p.mqa_heads))
            cache_dtype = draw(st.sampled_from(("bfloat16", "fp8_ds_mla")))
        else:
            heads = draw(st.sampled_from(large if path == "fp8_separate" else small if path.startswith("fp8_mixed") else p.mqa_heads))
            cache_dtype = "bfloat16" if path == "bf16" else "fp8_ds_mla"
        mixed = cache_dtype == "fp8_ds_mla" and heads < 32
        # DCP runs on the mixed path only, with local and gathered heads in one FP8 envelope.
        dcp = 1
        if mixed and path != "fp8_mixed":
            sizes = [n for n in (1, 2, 3, 4, 8) if (heads * n <= 64) == (heads <= 64)]
            dcp = draw(st.sampled_from([n for n in sizes if n > 1] if path == "fp8_mixed_dcp" else sizes))
        return batch_params(draw, p, cache_dtype, heads, dcp, decodes_only=decodes_only, min_prefills=min_prefills)

    return params()


def hisparse_params(p: Profile, path: str, heads: tuple[int, ...] | None = None) -> st.SearchStrategy[dict]:
    """HiSparse forward_mqa batches (equivalence.cases.hisparse_batch): decodes of 1 + spec tokens, prefills
    longer than that (the builder's threshold), contexts that leave pages before the resident
    tail, a hot cache from exactly the rows needed to (q_len + 1) * K slots, prior hot rows, slot
    permutations, 1-4 layers, a persistent buffer smaller than the batch (the fallback), a swap
    budget below the decodes (the resident route), and FP8 prefills over 1-4 workspace chunks."""
    cache_dtype = "bfloat16" if path == "bf16_hisparse" else "fp8_ds_mla"

    @st.composite
    def params(draw):
        s = draw(st.integers(1, 3))
        n_dec = draw(st.integers(0, p.max_requests))
        prefills = draw(st.lists(st.integers(s + 1, s + p.max_query), min_size=0 if n_dec else 1, max_size=p.max_requests))
        qlens = [s] * n_dec + prefills
        ctx = [draw(st.integers(0, p.max_context)) for _ in qlens]
        seq_max = max(c + n for c, n in zip(ctx, qlens))
        topk = draw(st.sampled_from(p.prefill_topk))
        frac = draw(st.sampled_from((0.0, 0.3, 0.7, 1.0)))
        chunked = cache_dtype == "fp8_ds_mla" and draw(st.sampled_from((True, True, False)))
        d = {
            "cache_dtype": cache_dtype, "heads": draw(st.sampled_from(heads or p.mqa_heads)), "query_lens": qlens,
            "context_lens": ctx, "block_size": draw(st.sampled_from(p.block_sizes)),
            "spare_blocks": draw(st.integers(0, 2)), "shuffle": draw(st.booleans()), "table_pad": draw(st.integers(0, 2)),
            "topk": topk, "sm_scale": draw(sm_scales), "value_regime": draw(regimes), "scale_rule": draw(scale_rules),
            # No boundaries: the table's last slot may lie in a page with no host block (undefined upstream).
            "invalid": draw(patterns(tuple(x for x in PATTERNS if x != "boundaries"))),
            "max_decode_query_len": s, "max_model_len": seq_max,
            "workspace_size": draw(st.integers(seq_max, seq_max + seq_max // 2)) if chunked else None,
            "hisparse": True, "layers": draw(st.integers(1, 4)), "resident_frac": frac,
            "hot_slack": draw(st.sampled_from((-1, 0, 1, 37, topk))), "prior_hits": draw(st.sampled_from((0.0, 0.3, 0.9))),
            "slot_perm": draw(st.booleans()), "stride_blocks": draw(st.sampled_from((1, 2))),
            "spare_state_rows": draw(st.integers(0, 2)),
            "swap_rows": draw(st.sampled_from(("fit", "below"))) if frac == 1.0 and n_dec else "fit",
            # Usually as large as a decode batch (max_rows + 1), sometimes below the batch (the fallback).
            "buffer_rows": draw(st.one_of(st.just(sum(qlens) + 1), st.integers(1, sum(qlens) + 2))),
        }
        return within_budget(d)

    return params()


def within_budget(d: dict) -> dict:
    """`d`, a forward_mqa batch's params, unless its inputs exceed the case budget (a rare draw of
    1-4 HiSparse layers over the longest contexts): then Hypothesis draws another."""
    assume(ForwardParams.of(d).elements() <= MAX_ELEMENTS)
    return d
