"""The HiSparse reference (reference/hisparse.py) against the plain path on the same logical
cache: equal bit for bit in float64 whatever the residency, hot-slot placement, LRU order, slab
stride, layer count or chunking; and a relocation done wrong selects other rows and shows."""

from unittest import mock

import pytest
import torch

import mla_verify.reference.hisparse as H
from mla_verify import reference
from mla_verify.equivalence.cases.hisparse_batch import make_hisparse_batch
from mla_verify.equivalence.cases.params import ForwardParams


def _params(cache_dtype, qlens, frac, **extra):
    ctx = [30, 100, 70, 5, 200][: len(qlens)]
    return dict(cache_dtype=cache_dtype, heads=16 if cache_dtype == "bfloat16" else 32, query_lens=qlens,
                context_lens=ctx, block_size=64, topk=128, sm_scale=0.1, value_regime="normal",
                max_decode_query_len=qlens[0], layers=2, resident_frac=frac, hot_slack=-1, prior_hits=0.3,
                slot_perm=True, stride_blocks=2, workspace_size=250 if cache_dtype != "bfloat16" else None, **extra)


def _both(p, seed=3):
    hb = make_hisparse_batch(ForwardParams.of(p), seed)
    metadata, topk = hb.plain.metadata(reference.MQAMetadata), hb.plain.topk_indices
    res = reference.forward_mqa_hisparse(hb.q_layers, hb.host_caches, hb.gpu_rows, topk, metadata,
                                         hb.hisparse_tables(reference.HiSparseTables))
    plain = [reference.forward_mqa(q, c, topk, metadata) for q, c in zip(hb.q_layers, hb.plain_caches)]
    return res, plain


CASES = [(d, q, f) for d in ("bfloat16", "fp8_ds_mla") for q in ([1, 1, 1, 5, 9], [2, 2, 7], [3], [40, 12])
         for f in (0.0, 0.5, 1.0)]


@pytest.mark.parametrize("cache_dtype,qlens,frac", CASES)
def test_hisparse_equals_plain_on_the_logical_cache(cache_dtype, qlens, frac):
    # fp8 with pow2 scales: HiSparse's threshold 1 sends short extends through the up-convert and
    # the BF16 kernel where the plain path decodes them; both are exact then.
    res, plain = _both(_params(cache_dtype, qlens, frac))
    for h, p in zip(res, plain):
        assert not torch.isnan(h.out).any()
        assert torch.equal(h.out, p.out) and torch.equal(h.lse, p.lse)


def test_hot_cache_exactly_as_large_as_needed_evicts_prior_rows():
    p = _params("bfloat16", [3, 3], 0.0, spare_state_rows=2)
    p["context_lens"], p["prior_hits"] = [600, 900], 1.0
    hb = make_hisparse_batch(ForwardParams.of(p), 11)
    sw = H.swap_in(torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.int32), hb.plain.topk_indices, hb.plain.block_table,
                   hb.hisparse_tables(H.HiSparseTables), block_size=64, return_valid_counts=True)
    # Every slot held an earlier row: the misses evicted some, the rest were hits.
    assert 0 < len(sw.host_rows) < int(sw.counts.sum())
    res, plain = _both(p, 11)
    assert all(torch.equal(h.out, q.out) for h, q in zip(res, plain))


def test_a_swap_that_skips_a_copy_is_visible():
    real = H.apply_swaps

    def skip_first(host, slab, swaps):
        return real(host, slab, H.Swaps(swaps.physical, swaps.counts, swaps.host_rows[1:], swaps.hot_rows[1:]))

    p = _params("bfloat16", [1, 1, 1], 0.0)
    p["context_lens"], p["prior_hits"] = [300, 400, 500], 0.0  # pages before the resident tail
    with mock.patch.object(H, "apply_swaps", skip_first):
        res, plain = _both(p)
    assert not torch.equal(res[0].out, plain[0].out)
