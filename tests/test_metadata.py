"""optimized/metadata.py against reference/metadata.py (written independently): thresholds,
splits, active decodes, prefill chunking and workspace starts must agree exactly."""

import dataclasses

import pytest
import torch
from hypothesis import assume, given, strategies as st

from mla_verify import reference as R
from mla_verify.optimized import metadata as M
from mla_verify.reference import metadata as RM


def outcome(fn, *args, **kwargs):
    """The value, or the exception type (both sides must raise alike)."""
    try:
        return fn(*args, **kwargs)
    except (ValueError, NotImplementedError) as e:
        return NotImplementedError if isinstance(e, NotImplementedError) else ValueError


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_reorder_threshold_agrees_on_every_configuration(arch):
    for heads in (1, 8, 16, 24, 32, 64, 96, 128, 256):
        for mdql in (1, 2, 4, 300, 2000):
            for dcp, interleave in ((1, 1), (2, 1), (2, 2), (4, 64)):
                knobs = dict(max_decode_query_len=mdql, dcp_size=dcp, interleave=interleave)
                want = RM.reorder_batch_threshold(heads, arch, **knobs)
                assert M.reorder_batch_threshold(heads, arch, **knobs) == want, (heads, knobs)


query_lens = st.lists(st.one_of(st.integers(0, 3), st.integers(1, 300)), min_size=0, max_size=8)


@given(lens=query_lens, threshold=st.sampled_from([1, 2, 128, 256, 1024]))
def test_split_and_active_decodes_agree(lens, threshold):
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    got, want = M.split_decodes_and_prefills(qsl, threshold), RM.split_decodes_and_prefills(qsl, threshold)
    assert dataclasses.astuple(got) == dataclasses.astuple(want)
    assert outcome(M.active_decodes, qsl, got) == outcome(RM.active_decodes, qsl, want)


def test_split_and_active_decodes_worked_examples():
    # The spec's examples: a uniform-decode split, and zero-length CUDA-graph padding dropped.
    assert dataclasses.astuple(M.split_decodes_and_prefills([0, 1, 3, 6], 128)) == (1, 2, 1, 5)
    qsl = [110 * i for i in range(7)] + [660]
    assert M.active_decodes(qsl, M.split_decodes_and_prefills(qsl, 128)) == (110, 6)


@given(lens=st.lists(st.integers(0, 50), max_size=10), size=st.integers(1, 120))
def test_split_prefill_chunks_agrees(lens, size):
    assert outcome(M.split_prefill_chunks, lens, size) == outcome(RM.split_prefill_chunks, lens, size)


def test_split_prefill_chunks_worked_examples():
    assert M.split_prefill_chunks([2, 3, 4, 2], 5) == [(0, 2), (2, 3), (3, 4)]
    assert M.split_prefill_chunks([5, 5, 5], 5) == [(0, 1), (1, 2), (2, 3)]
    assert M.split_prefill_chunks([1, 1, 1], 10) == [(0, 3)]


@given(n_dec=st.integers(0, 4), s=st.sampled_from([1, 2, 4]),
       prefill_q=st.lists(st.integers(1, 20), min_size=1, max_size=6),
       ctx=st.lists(st.integers(0, 200), min_size=10, max_size=10), slack=st.integers(0, 300))
def test_prefill_plan_agrees(n_dec, s, prefill_q, ctx, slack):
    qlens = [s] * n_dec + prefill_q
    seq_lens = [c + n for c, n in zip(ctx, qlens)]
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    split = RM.split_decodes_and_prefills(qsl, 128)
    assume(split.num_prefills > 0)
    size = max(seq_lens[split.num_decodes:]) + slack
    want = RM.plan_prefill(qsl, seq_lens, split, size)
    got = M.plan_prefill(qsl, seq_lens, M.split_decodes_and_prefills(qsl, 128), size, "cpu")
    assert torch.equal(got.request_ids, want.request_ids)
    assert torch.equal(got.workspace_starts, want.workspace_starts)
    assert len(got.chunks) == len(want.chunks)
    for g, w in zip(got.chunks, want.chunks):
        assert (g.tokens.start, g.tokens.stop) == w.tokens
        assert (g.requests.start, g.requests.stop) == w.requests
        assert g.workspace_starts.tolist() == w.workspace_starts
        assert g.total_rows == w.total_rows


def test_prefill_plan_rebases_starts_per_chunk():
    # The backend's comment: seq_lens [10, 15, 20, 5] in chunks [(0, 2), (2, 4)] -> [0, 10, 0, 20].
    split = M.BatchSplit(0, 4, 0, 4)
    plan = M.plan_prefill([0, 1, 2, 3, 4], [10, 15, 20, 5], split, 25, "cpu")
    assert plan.workspace_starts.tolist() == [0, 10, 0, 20]
    assert [(c.tokens.start, c.tokens.stop, c.total_rows) for c in plan.chunks] == [(0, 2, 25), (2, 4, 25)]


def test_workspace_size_agrees_across_the_long_context_switch():
    for n in (1, 4096, 163840, 256 * 1024, 256 * 1024 + 1, 10**6):
        assert M.prefill_workspace_size(n) == RM.prefill_workspace_size(n)


def test_path_and_dcp_guards_agree():
    for dtype in ("bfloat16", "fp8_ds_mla", "nvfp4_ds_mla"):
        for heads in (1, 8, 16, 24, 31, 32, 64, 128):
            assert M.select_path(dtype, heads) == R.select_path(dtype, heads)
            for dcp in (1, 2, 4, 8):
                want = outcome(RM.check_dcp_supported, heads, dcp, dtype)
                assert outcome(M.check_dcp_supported, heads, dcp, dtype) == want


@given(lens=query_lens, extra=st.integers(0, 3))
def test_req_id_per_token_agrees(lens, extra):
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    # Tokens past the last request (CUDA-graph padding) map to request 0.
    assert torch.equal(M.req_id_per_token(qsl, qsl[-1] + extra, "cpu"), R.req_id_per_token(qsl, qsl[-1] + extra))
