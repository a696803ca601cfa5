"""Input builder versions (equivalence.cases.builders): a saved case replays with the builder that made
it, byte for byte, forever. Each op's tensors from a version-1 case (a file from before versions:
no `inputs` field) and a version-2 case are pinned by digest on the CPU; new draws take the current
version; version 2 keeps what the draws must cover (poison where no valid entry reads, distinct
entries, the edges of the valid range)."""

import dataclasses
import hashlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from mla_verify.equivalence.cases import builders
from mla_verify.equivalence import catalog
from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.cases.profiles import get_profile
from mla_verify.fuzz import casefile

CASES = {
    "sparse_decode_fp8": dict(batch=3, s_q=2, heads=16, topk=64, seq_lens=[70, 5, 130], page_size=16,
                              value_regime="outliers", scale_rule="pow2", sm_scale=0.1,
                              invalid=["scattered", "boundaries"], stride_pad=1),
    "sparse_prefill": dict(tokens=5, heads=4, kv_rows=300, topk=128, value_regime="outliers", sm_scale=0.1,
                           invalid=["negatives", "out_of_range"], topk_length="random", sink="finite"),
    "forward_mqa": dict(cache_dtype="fp8_ds_mla", heads=16, query_lens=[1, 1, 5], context_lens=[40, 90, 20],
                        block_size=16, topk=64, sm_scale=0.1, value_regime="outliers",
                        invalid=["scattered", "beyond_seq"], spare_blocks=2),
}
# sha256 of every tensor's dtype, shape and bytes (tests/test_builders.py: _digest), first 16 hex
# digits; version 1's are those of the builders before versions existed (main at 05708a0).
PINNED = {
    ("sparse_decode_fp8", 1): "3665e929c2d74071", ("sparse_decode_fp8", 2): "10a22a2604934b62",
    ("sparse_prefill", 1): "17d94eacf5b3b73c", ("sparse_prefill", 2): "e844fabd91ed644d",
    ("forward_mqa", 1): "ea3f5aee3d36361d", ("forward_mqa", 2): "efa5f32ec05a96db",
}


def _feed(h, x) -> None:
    if isinstance(x, torch.Tensor):
        h.update(f"{x.dtype}{tuple(x.shape)}".encode())
        h.update(x.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    elif dataclasses.is_dataclass(x):
        for f in dataclasses.fields(x):
            _feed(h, getattr(x, f.name))
    elif isinstance(x, dict):
        for k in sorted(x):
            h.update(k.encode())
            _feed(h, x[k])
    elif isinstance(x, (list, tuple)):
        for v in x:
            _feed(h, v)
    else:
        h.update(repr(x).encode())


def _digest(kwargs: dict) -> str:
    h = hashlib.sha256()
    _feed(h, kwargs)
    return h.hexdigest()[:16]


def _saved(tmp_path, op: str, version: int) -> Case:
    """The pinned case of `op` as saved and loaded back: version 1 as a file from before versions."""
    params = CASES[op] if version == 1 else {**CASES[op], "inputs": version}
    path = casefile.save(tmp_path / f"{op}.json", casefile.CaseFile(Case(op, params, 7)))
    return casefile.load(path).case


@pytest.mark.parametrize("version", builders.VERSIONS)
@pytest.mark.parametrize("op", sorted(CASES))
def test_a_saved_case_replays_with_the_builder_that_made_it(tmp_path, op, version):
    case = _saved(tmp_path, op, version)
    assert catalog.get_spec(op).params_of(case.params).inputs == version
    assert _digest(catalog.inputs(op, case.params, case.seed)) == PINNED[op, version]


@pytest.mark.parametrize("op", sorted(CASES))
def test_new_draws_take_the_current_builder(op):
    drawn = []

    @settings(max_examples=5, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(catalog.get_spec(op).strategy(get_profile("ci")))
    def draw(case):
        drawn.append(case.params["inputs"])

    draw()
    assert drawn and set(drawn) == {builders.CURRENT}


def test_an_unknown_builder_version_is_refused():
    with pytest.raises(ValueError, match="inputs"):
        catalog.validate_case({"op": "sparse_prefill", "params": {**CASES["sparse_prefill"], "inputs": 3}, "seed": 1})


@pytest.mark.parametrize("version", builders.VERSIONS)
def test_prefill_poisons_every_row_no_valid_entry_reads_and_draws_distinct_entries(version):
    p = dict(CASES["sparse_prefill"], invalid=["boundaries"], inputs=version)
    kw = catalog.inputs("sparse_prefill", p, 3)
    idx, length = kw["indices"].long(), kw["topk_length"].long()
    live = (idx >= 0) & (idx < 300) & (torch.arange(idx.shape[1])[None, :] < length[:, None])
    read = torch.zeros(300, dtype=torch.bool)
    read[idx[live]] = True
    assert torch.isnan(kw["kv"].float()).any(-1).equal(~read) and read.any()
    assert {300, 299} <= set(idx.flatten().tolist())
    drawn = catalog.inputs("sparse_prefill", dict(p, invalid=[]), 3)["indices"]
    assert all(len(set(row.tolist())) == 128 for row in drawn)  # 128 distinct of 300 rows


@pytest.mark.parametrize("version", builders.VERSIONS)
def test_decode_writes_exactly_the_selected_slots_and_draws_distinct_ones(version):
    p = dict(CASES["sparse_decode_fp8"], invalid=[], inputs=version)
    kw = catalog.inputs("sparse_decode_fp8", p, 5)
    cache, idx = kw["kv_cache"], kw["indices"].long()
    written = (cache != 0xFF).any(-1).reshape(-1)
    selected = torch.zeros_like(written)
    selected[idx[idx >= 0]] = True
    assert written.equal(selected) and selected.any()
    for b, n in enumerate(p["seq_lens"]):
        for row in idx[b]:
            valid = row[row >= 0].tolist()
            assert len(valid) == min(n, 64) == len(set(valid))
    edge = catalog.inputs("sparse_decode_fp8", dict(p, invalid=["boundaries"]), 5)
    assert cache.shape[0] * cache.shape[1] - 1 in set(edge["indices"].flatten().tolist())


def test_version_2_permutes_without_randperm(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("version 2 draws no torch.randperm")

    monkeypatch.setattr(torch, "randperm", refused)
    for op, p in CASES.items():
        catalog.inputs(op, {**p, "inputs": 2}, 7)
    perm = builders.permutation(torch.Generator().manual_seed(1), 1000, 2)
    assert sorted(perm.tolist()) == list(range(1000))
