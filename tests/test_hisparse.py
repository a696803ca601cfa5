"""The optimized HiSparse pipeline (optimized/hisparse.py, optimized/index_group.py): against the
reference through the fuzzer, bitwise against the plain path, the index group's convert-once and
fallback rules, the drawn knobs, and idx_mapping / dcp_size 1 in every converter."""

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import mla_verify
from mla_verify import reference
from mla_verify.equivalence.catalog import get_spec
from mla_verify.equivalence.cases.hisparse_batch import make_hisparse_batch
from mla_verify.equivalence.cases.params import ForwardParams
from mla_verify.equivalence.cases.profiles import get_profile
from mla_verify.optimized import eager
from mla_verify.optimized.index_group import IndexGroup
from mla_verify.optimized.kernels import indices as triton_indices


@pytest.mark.parametrize("path", ["bf16_hisparse", "fp8_separate_hisparse"])
def test_pipeline_matches_the_reference(path):
    result = mla_verify.check("forward_mqa", "torch-fp32", path=path, examples=25, seed=4, profile="ci", device="cpu")
    assert result.passed, result.report()


def test_triton_stages_match_the_reference():
    """Each path with the Triton stages it calls (a replaced stage a path never calls is no verdict)."""
    plain = {"convert_index": "triton", "hisparse_swap_in": "triton"}
    for path, impl in (("bf16_hisparse", plain), ("fp8_separate_hisparse", {**plain, "gather_fp8_prefill": "triton"})):
        result = mla_verify.check("forward_mqa", impl, path=path, examples=3, seed=5, profile="ci", device="cpu")
        assert result.passed, result.report()


@pytest.mark.parametrize("impl,examples", [("torch-fp32", 12), ("triton", 2)])
def test_hisparse_equals_plain_bitwise(impl, examples):
    """The property on CPU for both implementations (tests/test_properties.py's grid leaves it
    here): bit for bit, on bf16 and FP8 groups alike (the FP8 one, 32 heads past the plain
    decode threshold, costs the interpreter ~10 s: one of the two Triton cases)."""
    result = mla_verify.property_check("hisparse_equals_plain", impl, examples=examples, seed=6, profile="ci", device="cpu")
    assert result.passed, result.report()
    rows = result.rows
    assert len(rows) and (rows["mismatch_frac"] == 0).all()
    assert set(rows["cache_dtype"]) == {"bfloat16", "fp8_ds_mla"}


def _draws(path, n=150):
    seen = []

    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(get_spec("forward_mqa").strategy(get_profile("ci"), path))
    def collect(case):
        seen.append(case.params)

    collect()
    return seen


def test_hisparse_draws_every_knob():
    drawn = _draws("bf16_hisparse") + _draws("fp8_separate_hisparse")
    assert Counter(d["layers"] for d in drawn).keys() == {1, 2, 3, 4}
    assert any(d["buffer_rows"] < sum(d["query_lens"]) for d in drawn)          # the fallback
    assert any(d["swap_rows"] == "below" for d in drawn)                         # resident route for decodes
    assert any(d["hot_slack"] == -1 for d in drawn) and any(d["slot_perm"] for d in drawn)
    assert any(d["max_decode_query_len"] > 1 and d["query_lens"][0] == d["max_decode_query_len"] for d in drawn)
    assert {d["resident_frac"] for d in drawn} == {0.0, 0.3, 0.7, 1.0}
    chunks = [reference.split_prefill_chunks([c + n for c, n in zip(d["context_lens"], d["query_lens"])
                                              if n != d["max_decode_query_len"]], d["workspace_size"])
              for d in drawn if d["cache_dtype"] == "fp8_ds_mla" and d["workspace_size"]
              and any(n != d["max_decode_query_len"] for n in d["query_lens"])]
    assert any(len(c) >= 2 for c in chunks)


def test_group_converts_once_and_falls_back_past_its_buffer():
    calls = []

    def convert(return_valid_counts, **kw):
        calls.append(kw["topk_indices"].shape[0])
        idx = kw["topk_indices"] + 1000
        return (idx, torch.full((idx.shape[0],), 7, dtype=torch.int32)) if return_valid_counts else idx

    stale = torch.full((4, 8), -5, dtype=torch.int32)
    group = IndexGroup(stale, torch.zeros(4, dtype=torch.int32))
    topk = torch.arange(24, dtype=torch.int32).view(3, 8)
    outs = [group.convert_once(layer, convert, True, topk_indices=topk) for layer in range(3)]
    assert calls == [3]                                   # layer 0 only
    for idx, counts in outs:
        assert torch.equal(idx, topk + 1000) and torch.equal(counts, torch.full((3,), 7, dtype=torch.int32))
    big = torch.arange(48, dtype=torch.int32).view(6, 8)  # 6 rows > 4: every layer converts afresh
    for layer in range(2):
        idx, _ = group.convert_once(layer, convert, True, topk_indices=big)
        assert torch.equal(idx, big + 1000)
    assert calls == [3, 6, 6]


CONVERTERS = [reference.convert_index, eager.convert_index, triton_indices.convert_index]


@pytest.mark.parametrize("convert", CONVERTERS, ids=["reference", "torch-fp32", "triton"])
def test_idx_mapping_picks_the_state_row(convert):
    gen = torch.Generator().manual_seed(0)
    table = torch.randint(1, 50, (5, 4), generator=gen, dtype=torch.int32)
    req_id = torch.tensor([0, 1, 2, 2], dtype=torch.int32)
    mapping = torch.tensor([3, -1, 1], dtype=torch.int32)    # request 1 has no state row: row 0
    topk = torch.randint(-1, 4 * 16, (4, 128), generator=gen, dtype=torch.int32)
    got = convert(req_id, table, topk, 16, 32, idx_mapping=mapping, return_valid_counts=True)
    want = reference.convert_index(torch.tensor([3, 0, 1, 1], dtype=torch.int32), table, topk, 16, 32,
                                   return_valid_counts=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("convert", [reference.dcp_convert_index, eager.dcp_convert_index,
                                     triton_indices.dcp_convert_index], ids=["reference", "torch-fp32", "triton"])
def test_dcp_size_one_never_compacts(convert):
    gen = torch.Generator().manual_seed(1)
    table = torch.randint(1, 50, (2, 4), generator=gen, dtype=torch.int32)
    topk = torch.randint(-1, 64, (3, 128), generator=gen, dtype=torch.int32)
    req_id = torch.tensor([0, 1, 1], dtype=torch.int32)
    got = convert(req_id, table, topk, 16, 1, 0, 1, True)
    assert (got[topk < 0] == -1).all() and torch.equal(got, reference.convert_index(req_id, table, topk, 16))


@pytest.mark.gpu
def test_cuda_host_tier_is_pinned():
    """On CUDA the host tier is pinned CPU memory, as HiSparse's source cache is (conftest skips it without a GPU)."""
    p = dict(cache_dtype="bfloat16", heads=16, query_lens=[1, 1], context_lens=[300, 200], block_size=64, topk=128,
             sm_scale=0.1, value_regime="normal")
    hb = make_hisparse_batch(ForwardParams.of(p), 0, "cuda")
    assert all(h.device.type == "cpu" and h.is_pinned() for h in hb.host_caches)
