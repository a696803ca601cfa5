"""Self-checks of index conversion and metadata against element-by-element formulations and the
worked examples of the spec."""

import pytest
import torch
from hypothesis import given, strategies as st

from mla_verify import reference as R
from mla_verify.reference import metadata as M
from mla_verify.reference.indices import compact_rows

seeds = st.integers(0, 2**31 - 1)


def convert_one(tok, r, table, bs, stride, prefill_id=-1, starts=None):
    """The conversion of one entry, written as the spec's step list."""
    if tok < 0 or tok // bs >= table.shape[1]:
        return -1
    if prefill_id >= 0:
        return int(starts[prefill_id]) + tok
    return int(table[r, tok // bs]) * stride + tok % bs


@given(seed=seeds, tokens=st.integers(1, 8), topk=st.integers(1, 70), bs=st.sampled_from([16, 64, 128]),
       extra_stride=st.sampled_from([0, 3]), with_prefill=st.booleans(), counts=st.booleans())
def test_convert_index_matches_the_per_entry_rule(seed, tokens, topk, bs, extra_stride, with_prefill, counts):
    g = torch.Generator().manual_seed(seed)
    reqs, width = 3, 4
    table = torch.randint(0, 50, (reqs, width), generator=g, dtype=torch.int32)
    req_id = torch.randint(0, reqs, (tokens,), generator=g, dtype=torch.int32)
    topk_idx = torch.randint(-4, width * bs + 40, (tokens, topk), generator=g, dtype=torch.int32)
    pids = starts = None
    if with_prefill:
        pids = torch.randint(-1, 2, (tokens,), generator=g, dtype=torch.int32)
        starts = torch.tensor([0, 1000], dtype=torch.int32)
    got = R.convert_index(req_id, table, topk_idx, bs, bs + extra_stride or None, pids, starts, counts)
    want = torch.tensor([[convert_one(int(topk_idx[t, k]), int(req_id[t]), table, bs, bs + extra_stride,
                                      -1 if pids is None else int(pids[t]), starts)
                          for k in range(topk)] for t in range(tokens)], dtype=torch.int32)
    if counts:
        out, n = got
        for t in range(tokens):
            valid = want[t][want[t] >= 0]
            assert int(n[t]) == len(valid)
            assert torch.equal(out[t, : len(valid)], valid)  # stable: the original order
            assert bool((out[t, len(valid):] == -1).all())
    else:
        assert got.dtype == torch.int32 and torch.equal(got, want)


def test_convert_index_rejects_a_full_batch_req_id():
    # vLLM bug #47327: dense-MHA prefills left forward_mqa decode rows only.
    with pytest.raises(ValueError, match="req_id has 5 rows"):
        R.convert_index(torch.zeros(5, dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
                        torch.zeros(3, 8, dtype=torch.int32), 64)


def test_dcp_ownership_examples():
    tok = torch.arange(12)
    owner, local = R.dcp_owner_and_local(tok, 2, 1)
    assert owner.tolist()[:4] == [0, 1, 0, 1] and local.tolist()[:4] == [0, 0, 1, 1]
    owner, local = R.dcp_owner_and_local(tok, 2, 4)
    assert owner.tolist() == [0] * 4 + [1] * 4 + [0] * 4
    assert local.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]
    # Local lengths add up and match the ownership count.
    for n in (0, 1, 7, 64, 129):
        for size, inter in ((2, 1), (4, 2), (8, 64), (3, 4)):
            lens = [R.dcp_local_seq_lens(n, size, r, inter) for r in range(size)]
            owners = R.dcp_owner_and_local(torch.arange(n), size, inter)[0]
            assert lens == [int((owners == r).sum()) for r in range(size)]


@given(seed=seeds, size=st.sampled_from([1, 2, 4, 8]), inter=st.sampled_from([1, 2, 64]), compact=st.booleans())
def test_dcp_convert_index_partitions_the_valid_entries(seed, size, inter, compact):
    g = torch.Generator().manual_seed(seed)
    bs, width, tokens, topk = 64, 3, 5, 96
    tables = [torch.randint(0, 40, (2, width), generator=g, dtype=torch.int32) for _ in range(size)]
    req_id = torch.randint(0, 2, (tokens,), generator=g, dtype=torch.int32)
    topk_idx = torch.randint(-2, size * width * bs + 64, (tokens, topk), generator=g, dtype=torch.int32)
    owned = torch.zeros(tokens, topk, dtype=torch.int32)
    for r in range(size):
        got = R.dcp_convert_index(req_id, tables[r], topk_idx, bs, size, r, inter, compact)
        owner, local = R.dcp_owner_and_local(topk_idx.long().clamp(min=0), size, inter)
        mine = (topk_idx >= 0) & (owner == r) & (local // bs < width)
        want = torch.where(mine, tables[r].long()[req_id.long()[:, None], (local // bs).clamp(max=width - 1)] * bs + local % bs, -1)
        # At dcp_size 1 upstream delegates to the plain converter, which never compacts here.
        assert torch.equal(got, compact_rows(want.int())[0] if compact and size > 1 else want.int())
        owned += mine
    # Every valid global entry is owned by exactly one rank.
    assert bool((owned <= 1).all())


def test_req_id_per_token_skips_padding_requests():
    assert R.req_id_per_token([0, 2, 2, 5], 7).tolist() == [0, 0, 2, 2, 2, 0, 0]


def test_split_examples_from_the_spec():
    assert M.split_decodes_and_prefills([0, 1, 3, 6], 128) == M.BatchSplit(1, 2, 1, 5)
    assert M.split_decodes_and_prefills([0, 1, 2], 1) == M.BatchSplit(2, 0, 2, 0)
    assert M.split_decodes_and_prefills([0, 200, 201], 128) == M.BatchSplit(0, 2, 0, 201)
    assert M.split_decodes_and_prefills([0, 4, 8, 12], 128) == M.BatchSplit(3, 0, 12, 0)  # uniform short prefills
    # 7 requests of 110 tokens, the 7th empty (CUDA-graph padding): all decodes, 6 active.
    qsl = [110 * i for i in range(7)] + [660]
    split = M.split_decodes_and_prefills(qsl, 256)
    assert split == M.BatchSplit(7, 0, 660, 0)
    assert M.active_decodes(qsl, split) == (110, 6)


def test_reorder_thresholds():
    assert M.reorder_batch_threshold(128, "sm90") == 256 and M.reorder_batch_threshold(128, "sm100") == 1024
    assert M.reorder_batch_threshold(16, "sm90") == 128 and M.reorder_batch_threshold(24, "sm90") == 256
    assert M.reorder_batch_threshold(8, "sm100") == 128 and M.reorder_batch_threshold(8, "sm90") == 256
    assert M.reorder_batch_threshold(64, "sm90", max_decode_query_len=300) == 300
    assert M.reorder_batch_threshold(16, "sm90", dcp_size=2, interleave=2) == 1
    assert M.reorder_batch_threshold(16, "sm90", dcp_size=2, interleave=1) == 128


def test_prefill_chunks_and_rebased_starts():
    assert M.split_prefill_chunks([2, 3, 4, 2], 5) == [(0, 2), (2, 3), (3, 4)]
    assert M.split_prefill_chunks([5, 5, 5], 5) == [(0, 1), (1, 2), (2, 3)]
    assert M.split_prefill_chunks([1, 1, 1], 10) == [(0, 3)]
    with pytest.raises(ValueError):
        M.split_prefill_chunks([6], 5)
    # seq_lens [10, 15, 20, 5] after one 3-token decode, chunks [(0,2), (2,4)]: starts [0,10,0,20].
    qsl = [0, 3, 5, 9, 10, 11]
    split = M.BatchSplit(1, 4, 3, 8)
    plan = M.plan_prefill(qsl, [7, 10, 15, 20, 5], split, 25)
    assert plan.workspace_starts.tolist() == [0, 10, 0, 20]
    assert [c.tokens for c in plan.chunks] == [(3, 9), (9, 11)]
    assert [c.requests for c in plan.chunks] == [(1, 3), (3, 5)]
    assert [c.total_rows for c in plan.chunks] == [25, 25]
    assert plan.request_ids.tolist() == [-1, -1, -1, 0, 0, 1, 1, 1, 1, 2, 3]


def test_dcp_guards():
    M.check_dcp_supported(16, 4, "fp8_ds_mla")
    M.check_dcp_supported(16, 1, "bfloat16")
    for heads, size, dtype in ((16, 8, "fp8_ds_mla"), (24, 4, "fp8_ds_mla"), (64, 2, "fp8_ds_mla"), (16, 2, "bfloat16")):
        with pytest.raises(NotImplementedError):
            M.check_dcp_supported(heads, size, dtype)
    assert M.use_mixed_batch(31) and not M.use_mixed_batch(32)
    assert (M.decode_padded_heads(16), M.decode_padded_heads(65)) == (64, 128)
    assert (M.prefill_padded_heads(16, "sm90"), M.prefill_padded_heads(16, "sm100")) == (64, 128)
