"""Self-checks of forward_mqa: every path against per-token naive attention over the rows each
token selects, chunking invariance, and DCP merged over ranks against one rank."""

import math

import torch
from hypothesis import given, strategies as st

from mla_verify import reference as R
from mla_verify.equivalence.cases.batch import make_batch
from mla_verify.equivalence.cases.params import ForwardParams
from mla_verify.reference import metadata as M

seeds = st.integers(0, 2**31 - 1)
# Invalid patterns the naive formulation models: every one of them leaves an entry invalid.
SAFE_PATTERNS = ["scattered", "whole_row", "negatives", "out_of_range", "duplicates"]


@st.composite
def batch_params(draw, cache_dtypes=("bfloat16", "fp8_ds_mla", "nvfp4_ds_mla"), heads=(16, 32, 64), dcp=1):
    n_dec = draw(st.integers(0, 3))
    s = draw(st.sampled_from([1, 2]))
    prefill_lens = draw(st.lists(st.integers(1, 9), min_size=0 if n_dec else 1, max_size=3))
    qlens = [s] * n_dec + prefill_lens
    block_size = draw(st.sampled_from([16, 64])) if dcp == 1 else 64
    interleave = draw(st.sampled_from([1, 2, 64])) if dcp > 1 else 1
    return dict(
        cache_dtype=draw(st.sampled_from(cache_dtypes)),
        heads=draw(st.sampled_from(heads)),
        query_lens=qlens,
        context_lens=[draw(st.integers(0, 100)) for _ in qlens],
        block_size=block_size,
        stride_pad=draw(st.sampled_from([0, 2])),
        topk=draw(st.sampled_from([16, 64])),
        sm_scale=draw(st.sampled_from([0.04, 0.1352])),
        value_regime=draw(st.sampled_from(["normal", "outliers", "zero_tiles", "peaked"])),
        scale_rule=draw(st.sampled_from(["pow2", "raw"])),
        invalid=draw(st.lists(st.sampled_from(SAFE_PATTERNS), max_size=3, unique=True)),
        # Under DCP with interleave != 1 nothing counts as a decode (threshold 1): no decode-only batch.
        mqa=draw(st.sampled_from(["all", "decodes"])) if dcp == 1 or interleave == 1 else "all",
        q_form=draw(st.sampled_from(["tensor", "tuple"])) if dcp == 1 else "tensor",
        dcp_size=dcp,
        interleave=interleave,
    )


def naive_forward(batch, params):
    """Per token: gather the source rows its valid logical indices name; attend in float64."""
    q = batch.q if isinstance(batch.q, torch.Tensor) else torch.cat(batch.q, -1)
    qsl, dtype = batch.query_start_loc, params["cache_dtype"]
    threshold = M.reorder_batch_threshold(params["heads"])
    num_decode_tokens = M.split_decodes_and_prefills(qsl, threshold).num_decode_tokens
    separate = dtype != "bfloat16" and not M.use_mixed_batch(params["heads"])
    outs, lses = [], []
    for t in range(q.shape[0]):
        r = max(i for i in range(len(qsl) - 1) if qsl[i] <= t < qsl[i + 1])
        toks = [int(x) for x in batch.topk_indices[t] if 0 <= int(x) < batch.seq_lens[r]]
        rows = batch.kv_source[r][toks]
        if dtype == "bfloat16":
            keys = rows.double()
        elif dtype == "nvfp4_ds_mla":
            keys = R.nvfp4_ds_mla_values(R.quantize_nvfp4_ds_mla(rows))
        else:
            packed = R.quantize_fp8_ds_mla(rows, params["scale_rule"])
            # Prefill rows of the separate path read the bf16 workspace the gather wrote.
            through_workspace = separate and t >= num_decode_tokens
            keys = R.dequantize_fp8_ds_mla(packed).double() if through_workspace else R.fp8_ds_mla_values(packed)
        if not toks:
            outs.append(torch.zeros(q.shape[1], 512, dtype=torch.float64))
            lses.append(torch.full((q.shape[1],), math.inf, dtype=torch.float64))
            continue
        s = params["sm_scale"] * q[t].double() @ keys.T
        lse = torch.logsumexp(s, -1)
        outs.append(torch.exp(s - lse[:, None]) @ keys[:, :512])
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


@given(params=batch_params(), seed=seeds)
def test_every_path_matches_per_token_naive_attention(params, seed):
    batch = make_batch(ForwardParams.of(params), seed)
    res = R.forward_mqa(batch.q, batch.kv_cache, batch.topk_indices, batch.metadata(R.MQAMetadata))
    assert res.path == R.select_path(params["cache_dtype"], params["heads"])
    out, lse = naive_forward(batch, params)
    assert res.out.shape == out.shape and not bool(torch.isnan(res.out).any())
    assert torch.equal(res.lse.isinf(), lse.isinf())
    assert torch.allclose(res.out, out, atol=1e-10, rtol=1e-10)
    finite = lse.isfinite()
    assert torch.allclose(res.lse[finite], lse[finite], atol=1e-10, rtol=0)


@given(params=batch_params(cache_dtypes=("fp8_ds_mla", "nvfp4_ds_mla"), heads=(32, 64)), seed=seeds,
       slack=st.lists(st.integers(0, 40), min_size=3, max_size=3))
def test_chunked_prefill_equals_one_chunk_for_every_workspace_size(params, seed, slack):
    params = dict(params, mqa="all")
    batch = make_batch(ForwardParams.of(params), seed)
    def forward(size):
        metadata = batch.metadata(R.MQAMetadata, workspace_size=size)
        return R.forward_mqa(batch.q, batch.kv_cache, batch.topk_indices, metadata)

    whole = forward(sum(batch.seq_lens))
    longest = max(batch.seq_lens)
    for size in {longest, longest + slack[0], longest * 2 + slack[1], sum(batch.seq_lens) - slack[2]}:
        if size < longest:
            continue
        chunked = forward(size)
        assert torch.allclose(chunked.out, whole.out, atol=1e-12, rtol=0)
        assert torch.equal(chunked.lse.isinf(), whole.lse.isinf())


@given(seed=seeds, data=st.data(), dcp=st.sampled_from([1, 2, 4, 8]))
def test_dcp_merged_over_ranks_equals_one_rank(seed, data, dcp):
    heads = 8 if dcp == 8 else 16  # local x gathered heads must pad to one FP8 envelope
    params = data.draw(batch_params(cache_dtypes=("fp8_ds_mla",), heads=(heads,), dcp=dcp))
    batch = make_batch(ForwardParams.of(params), seed)
    ranks = batch.rank_metadata(R.MQAMetadata)
    exact = R.forward_mqa_dcp(batch.q, batch.rank_caches, batch.topk_indices, ranks, exact_merge=True)
    combined = R.forward_mqa_dcp(batch.q, batch.rank_caches, batch.topk_indices, ranks)
    out, lse = naive_forward(batch, params)
    live = lse.isfinite()
    # No valid index anywhere: every rank neutralized the row, so the merge says (0, -inf).
    assert bool((exact.lse[~live] == -math.inf).all()) and bool((exact.out[~live] == 0).all())
    assert torch.allclose(exact.out, out, atol=1e-10, rtol=1e-10)
    assert torch.allclose(exact.lse[live], lse[live], atol=1e-10, rtol=0)
    # The AG+RS combine rounds each rank's term to bf16: at most 2**-8 (bf16 unit roundoff) of it,
    # and under bf16's smallest subnormal (2**-133) at most half of that (a term of 3e-43 flushes to 0).
    parts = [R.forward_mqa(batch.q, c, batch.topk_indices, m) for c, m in zip(batch.rank_caches, ranks)]
    _, f = R.merge_weights(torch.stack([p.lse for p in parts]))
    terms = torch.stack([p.out for p in parts]) * f[..., None]
    bound = 2.0**-8 * terms.abs().sum(0) + dcp * 2.0**-134
    assert bool(((combined.out - exact.out).abs() <= bound).all())
    assert torch.equal(combined.lse, exact.lse)
