"""The optimized pipeline with its float32 eager stages against the float64 reference, every path:
bf16 / fp8_mixed / fp8_separate, DCP merged over ranks, and stage overrides and fallbacks.
Tolerances: the fp32 error model of `mla_verify.equivalence.judge.bounds` (section 2)."""

import math

import pytest
import torch
from hypothesis import given, strategies as st

from mla_verify import reference as R
from mla_verify.equivalence.cases.batch import make_batch
from mla_verify.equivalence.cases.params import ForwardParams
from mla_verify.equivalence.cases.patterns import FORWARD_PATTERNS
from mla_verify.equivalence.judge.bounds import ErrorModel
from mla_verify.equivalence.cases.values import REGIMES
from mla_verify.optimized import buffers, forward_mqa, forward_mqa_dcp, needed_stages, registry
from mla_verify.optimized.pipeline import MQAMetadata
from tests.bound_checks import check_against_reference, fp32_stages

seeds = st.integers(0, 2**31 - 1)
CACHE_DTYPES = ("bfloat16", "fp8_ds_mla", "nvfp4_ds_mla")


@st.composite
def batch_params(draw, cache_dtypes=CACHE_DTYPES, heads=(16, 32, 64), dcp=1):
    n_dec = draw(st.integers(0, 3))
    s = draw(st.sampled_from([1, 2]))  # spec decode: 2 query tokens per decode
    prefill_lens = draw(st.lists(st.integers(1, 9), min_size=0 if n_dec else 1, max_size=3))
    qlens = [s] * n_dec + prefill_lens
    ctx = draw(st.lists(st.integers(0, 100), min_size=len(qlens), max_size=len(qlens)))
    longest = max(c + n for c, n in zip(ctx, qlens))
    return dict(
        cache_dtype=draw(st.sampled_from(cache_dtypes)),
        heads=draw(st.sampled_from(heads)),
        query_lens=qlens,
        context_lens=ctx,
        block_size=draw(st.sampled_from([16, 64])) if dcp == 1 else 64,
        stride_pad=draw(st.sampled_from([0, 2])),
        table_pad=draw(st.sampled_from([0, 2])),
        topk=draw(st.sampled_from([16, 64])),
        sm_scale=draw(st.sampled_from([0.04, 0.1352])),
        value_regime=draw(st.sampled_from(REGIMES)),
        scale_rule=draw(st.sampled_from(["pow2", "raw"])),
        invalid=draw(st.lists(st.sampled_from(FORWARD_PATTERNS), max_size=3, unique=True)),
        mqa=draw(st.sampled_from(["all", "decodes"])),
        q_form=draw(st.sampled_from(["tensor", "tuple"])) if dcp == 1 else "tensor",
        arch=draw(st.sampled_from(["sm90", "sm100"])),
        max_decode_query_len=s,
        # Small workspaces split the prefills into several chunks; None is the backend's size.
        workspace_size=draw(st.one_of(st.none(), st.integers(0, 60).map(lambda slack: longest + slack))),
        dcp_size=dcp,
        interleave=draw(st.sampled_from([1, 2, 64])) if dcp > 1 else 1,
    )


def run_both(batch, stages, **extra):
    ref = R.forward_mqa(batch.q, batch.kv_cache, batch.topk_indices, batch.metadata(R.MQAMetadata, **extra))
    with buffers.poisoned():
        got = forward_mqa(batch.q, batch.kv_cache, batch.topk_indices, batch.metadata(MQAMetadata, **extra), stages)
    return got, ref


@given(params=batch_params(), seed=seeds)
def test_every_path_matches_the_reference(params, seed):
    batch = make_batch(ForwardParams.of(params), seed)
    dtype, heads = params["cache_dtype"], params["heads"]
    stages = fp32_stages(needed_stages(dtype, heads, 1, params["q_form"] == "tuple"))
    got, ref = run_both(batch, stages)
    assert got.path == ref.path == R.select_path(dtype, heads)
    model = ErrorModel(batch.q, [batch.kv_cache], dtype, params["sm_scale"], params["topk"])
    check_against_reference(got.out, got.lse, ref.out, ref.lse, model)
    assert not got.stages.fallbacks


@given(seed=seeds, dcp=st.sampled_from([2, 4]), data=st.data())
def test_dcp_ranks_and_merge_match_the_reference(seed, dcp, data):
    params = data.draw(batch_params(cache_dtypes=("fp8_ds_mla", "nvfp4_ds_mla"), heads=(16,), dcp=dcp))
    batch = make_batch(ForwardParams.of(params), seed)
    ref_ranks, ranks = batch.rank_metadata(R.MQAMetadata), batch.rank_metadata(MQAMetadata)
    dtype, topk = params["cache_dtype"], batch.topk_indices
    stages = fp32_stages(needed_stages(dtype, 16, dcp, False))
    model = ErrorModel(batch.q, batch.rank_caches, dtype, params["sm_scale"], params["topk"])
    ref_parts = []
    for cache, ref_metadata, metadata in zip(batch.rank_caches, ref_ranks, ranks):
        ref = R.forward_mqa(batch.q, cache, topk, ref_metadata)
        with buffers.poisoned():
            got = forward_mqa(batch.q, cache, topk, metadata, stages)
        check_against_reference(got.out, got.lse, ref.out, ref.lse, model)  # -inf: neutralized rows
        ref_parts.append(ref)

    ref = R.forward_mqa_dcp(batch.q, batch.rank_caches, topk, ref_ranks)
    with buffers.poisoned():
        got = forward_mqa_dcp(batch.q, batch.rank_caches, topk, ranks, stages)
    assert got.path == ref.path == "fp8_mixed_dcp"
    assert not bool(got.out.isnan().any()) and not bool(got.lse.isnan().any())
    assert torch.equal(got.lse == -math.inf, ref.lse == -math.inf) and not bool((got.lse == math.inf).any())
    assert bool((got.out[ref.lse == -math.inf] == 0).all())
    # Four bf16 roundings, the fp32 weights and each rank's own error (bounds section 2, the DCP
    # merge). Measured: up to 0.66 of this bound.
    bound = model.merged_out(torch.stack([p.out for p in ref_parts]), torch.stack([p.lse for p in ref_parts]))
    assert bool(((got.out.double() - ref.out).abs() <= bound).all())
    live = ref.lse.isfinite()
    lse_bound = model.merged_lse(ref.lse, dcp)
    assert bool(((got.lse.double() - ref.lse).abs() <= lse_bound)[live].all())


def test_an_index_past_a_prefill_reads_the_next_workspace_rows_or_nothing():
    # No `tok < seq_len` check: one past a prefill's sequence is the next prefill's first workspace
    # row, one past the chunk's last prefill is past the workspace (invalid), and one past the
    # decode (the 3-token request) reads its block's stale slot through the block table.
    params = dict(cache_dtype="fp8_ds_mla", heads=64, query_lens=[3, 4, 2], context_lens=[20, 33, 7], block_size=16,
                  table_pad=1, topk=16, sm_scale=0.1352, value_regime="normal")
    batch = make_batch(ForwardParams.of(params), 11)
    qsl = batch.query_start_loc
    for r, seq_len in enumerate(batch.seq_lens):
        batch.topk_indices[qsl[r]:qsl[r + 1], 0] = seq_len
    got, ref = run_both(batch, fp32_stages(needed_stages("fp8_ds_mla", 64)))
    check_against_reference(got.out, got.lse, ref.out, ref.lse,
                            ErrorModel(batch.q, [batch.kv_cache], "fp8_ds_mla", params["sm_scale"], params["topk"]))


def test_dcp_neutralizes_whatever_the_decode_kernel_leaves_in_empty_rows():
    # The kernel's out / lse of a row with no valid index are undefined: junk must not reach the merge.
    params = dict(cache_dtype="fp8_ds_mla", heads=16, query_lens=[1, 1, 3], context_lens=[0, 2, 1], block_size=64,
                  topk=16, sm_scale=0.1352, value_regime="normal", dcp_size=4, invalid=["whole_row"])
    batch = make_batch(ForwardParams.of(params), 5)
    eager = registry.select("sparse_decode_fp8", "cpu", "torch-fp32")

    def junk_on_empty_rows(**kwargs):
        out, lse = eager.fn(**kwargs)
        empty = (kwargs["indices"] == -1).all(dim=-1)  # [B, S]
        return out.masked_fill(empty[..., None, None], math.nan), lse.masked_fill(empty[:, None, :], math.nan)

    needed = needed_stages("fp8_ds_mla", 16, 4)
    junk = registry.Implementation("sparse_decode_fp8", "junk", junk_on_empty_rows, frozenset({"cpu"}))
    stages = registry.resolve(needed, "cpu", {**fp32_stages(needed).chosen, "sparse_decode_fp8": junk})
    model = ErrorModel(batch.q, batch.rank_caches, "fp8_ds_mla", params["sm_scale"], params["topk"])
    neutralized = 0
    for cache, ref_metadata, metadata in zip(batch.rank_caches, batch.rank_metadata(R.MQAMetadata),
                                             batch.rank_metadata(MQAMetadata)):
        ref = R.forward_mqa(batch.q, cache, batch.topk_indices, ref_metadata)
        got = forward_mqa(batch.q, cache, batch.topk_indices, metadata, stages)
        check_against_reference(got.out, got.lse, ref.out, ref.lse, model)
        neutralized += int((ref.lse == -math.inf).all(dim=1).sum())
    assert neutralized > 0  # the batch does exercise empty rows


def small_separate_batch(seed=7):
    params = dict(cache_dtype="fp8_ds_mla", heads=32, query_lens=[1, 1, 6, 4, 5], context_lens=[20, 9, 30, 40, 12],
                  block_size=16, topk=16, sm_scale=0.1352, value_regime="normal", workspace_size=50)
    return make_batch(ForwardParams.of(params), seed), params


def test_a_stage_override_is_the_one_that_runs():
    batch, params = small_separate_batch()
    fallback = registry.select("sparse_prefill", "cpu", "torch-fp32")
    calls = []

    def counting_prefill(**kwargs):
        calls.append(kwargs["q"].shape[0])
        return fallback.fn(**kwargs)

    needed = needed_stages("fp8_ds_mla", 32)
    stages = fp32_stages(needed)
    counting = registry.Implementation("sparse_prefill", "counting", counting_prefill, frozenset({"cpu"}))
    stages = registry.resolve(needed, "cpu", {**stages.chosen, "sparse_prefill": counting})
    got, ref = run_both(batch, stages)
    # Prefill seq_lens 36, 44, 17 in a 50-row workspace: three chunks of 6, 4 and 5 query rows.
    assert calls == [6, 4, 5]
    assert ("sparse_prefill", "counting") in got.stages.pairs()
    check_against_reference(got.out, got.lse, ref.out, ref.lse,
                            ErrorModel(batch.q, [batch.kv_cache], "fp8_ds_mla", params["sm_scale"], params["topk"]))


def test_a_preferred_implementation_that_cannot_run_here_is_reported(monkeypatch):
    eager = registry.select("sparse_prefill", "cpu", "torch-fp32")
    gpu_only = registry.Implementation("sparse_prefill", "gpu-only", eager.fn, frozenset({"cuda"}))
    monkeypatch.setitem(registry._REGISTRY, "sparse_prefill", [gpu_only, eager])
    batch, _ = small_separate_batch()
    got = forward_mqa(batch.q, batch.kv_cache, batch.topk_indices, batch.metadata(MQAMetadata))
    assert got.stages.fallbacks["sparse_prefill"] == "gpu-only: runs on cuda, not cpu"
    assert got.stages.chosen["sparse_prefill"].name == "torch-fp32"


@pytest.mark.parametrize("heads, dcp, dtype", [(16, 8, "fp8_ds_mla"), (24, 4, "fp8_ds_mla"), (32, 2, "fp8_ds_mla"),
                                               (16, 2, "bfloat16")])
def test_unsupported_dcp_raises_as_the_backend_does(heads, dcp, dtype):
    batch, _ = small_separate_batch()
    metadata = batch.metadata(MQAMetadata, num_heads=heads, kv_cache_dtype=dtype, dcp_size=dcp)
    with pytest.raises(NotImplementedError):
        forward_mqa(batch.q, batch.kv_cache, batch.topk_indices, metadata)


def test_stage_defaults_never_run_an_interpreter_unless_named(monkeypatch):
    """On CPU our Triton kernels run interpreted (10-1000x slower than torch-fp32): every stage
    defaults to an implementation that runs natively; Triton stays available by name."""
    for stage in registry.stages():
        impls = registry.implementations(stage)
        default = registry.select(stage, "cpu")
        if any(i.why_not("cpu") is None and "cpu" not in i.interpreted_on for i in impls):
            assert "cpu" not in default.interpreted_on, stage
    assert registry.select("convert_index", "cpu").name == "torch-fp32"
    assert registry.select("convert_index", "cpu", "triton").name == "triton"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the preference on a GPU machine
    assert registry.select("convert_index", "cuda").name == "triton"  # compiled there: preferred
    monkeypatch.undo()
    needed = needed_stages("fp8_ds_mla", 64)
    user = registry.Implementation("split_prefill_chunks", "mine", lambda **kw: None, frozenset({"cpu"}))
    resolved = registry.resolve(needed, "cpu", overrides={"split_prefill_chunks": user})
    assert resolved.chosen["split_prefill_chunks"] is user
    assert all("cpu" not in i.interpreted_on for i in resolved.chosen.values())
    assert set(resolved.fallbacks) == {"sparse_decode_fp8", "sparse_prefill"}  # flash_mla: cuda only


def test_both_sides_spell_the_same_metadata():
    """reference/ and optimized/ share no code: each writes forward_mqa's metadata and HiSparse's
    tables itself, with the same fields and defaults (the optimized metadata adds the builder's
    persistent req_id buffer)."""
    from dataclasses import fields

    from mla_verify.optimized import hisparse

    def spelled(cls, skip=()):
        return [(f.name, f.default) for f in fields(cls) if f.name not in skip]

    assert spelled(MQAMetadata, ("req_id",)) == spelled(R.MQAMetadata)
    assert spelled(hisparse.HiSparseTables) == spelled(R.HiSparseTables)
