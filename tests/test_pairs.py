"""Covering arrays of the ops' routing parameters (equivalence.coverage.pairs): every pair (triple
where the profile's budget holds them) of values held by some case, read back from the built
tensors; production sizes and every value of a small discrete parameter in every profile."""

import itertools
import random

import pytest

from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.cases.profiles import OFF_TABLE_TOPK, PRODUCTION_HEADS, PRODUCTION_TOPK, PROFILES, get_profile
from mla_verify.equivalence.coverage import sets as coverage
from mla_verify.equivalence.coverage.features import FLAT
from mla_verify.equivalence.coverage.pairs import Factor, covering_array, tuples, universe

PAIRED = [(op, path) for op, path in coverage.covered() if coverage.coverage_of(op, path).pairs is not None]


def _held(op, path, profile, cases):
    pairs = coverage.coverage_of(op, path).pairs
    return coverage.held(pairs, profile, [coverage.shown_of(c, path=path) for c in cases])


def test_a_covering_array_holds_every_tuple_and_is_the_generators():
    factors = [Factor("a", (1, 2, 3, 4)), Factor("b", tuple("wxyz")), Factor("c", (0, 1)), Factor("d", (5, 6, 7))]
    names = [f.name for f in factors]
    for t in (1, 2, 3):
        rows = covering_array(factors, t, random.Random(4))
        assert set().union(*(tuples(r, names, t) for r in rows)) == universe(factors, t)
        assert rows == covering_array(factors, t, random.Random(4))
    pairs = covering_array(factors, 2, random.Random(4))
    assert 16 <= len(pairs) < 4 * 4 * 2, "pairs take about the two largest domains' product, far below every row"


def test_allowed_rows_only_and_what_no_row_may_hold_is_not_asked():
    factors = [Factor("path", ("mixed", "separate")), Factor("dcp", (1, 2, 3)), Factor("s", (1, 2))]

    def allowed(row):
        return not (row.get("path") == "separate" and row.get("dcp", 1) > 1)

    rows = covering_array(factors, 2, random.Random(1), allowed)
    assert all(allowed(r) for r in rows)
    assert set().union(*(tuples(r, ["path", "dcp", "s"], 2) for r in rows)) == universe(factors, 2, allowed)
    assert (("path", "separate"), ("dcp", 2)) not in universe(factors, 2, allowed)


def test_a_cost_cap_leaves_out_the_tuples_no_cheap_row_holds():
    factors = [Factor("k", (64, 256, 2048)), Factor("s", (1, 2, 3, 4))]
    cost = lambda row: row["k"] * row["s"] / 1000  # noqa: E731
    rows = covering_array(factors, 2, random.Random(2), cost=cost, cap=2.1)
    assert all(cost(r) <= 2.1 for r in rows)
    held = set().union(*(tuples(r, ["k", "s"], 2) for r in rows))
    assert (("k", 2048), ("s", 1)) in held and (("k", 2048), ("s", 2)) not in held and (("k", 256), ("s", 4)) in held


@pytest.mark.parametrize("op, path", PAIRED, ids=[f"{op}-{path}" for op, path in PAIRED])
def test_the_covering_set_holds_every_pair_its_tensors_show(op, path):
    """At ci (eager kernels: every tuple; interpreted: those within ci's budget a case) and a
    profile of triples (the attention ops' at dev: their triples at gpu are 120-odd cases)."""
    pairs = coverage.coverage_of(op, path).pairs
    wide = "dev" if op in ("sparse_prefill", "sparse_decode_fp8") else "gpu"
    for name, interpreted in (("ci", False), ("ci", True), (wide, False)):
        profile = get_profile(name)
        every, within = coverage.wanted(op, pairs, profile)
        want = within if interpreted else every
        missing = want - _held(op, path, profile, coverage.covering_set(op, profile, 3, path, interpreted=interpreted))
        assert not missing, f"{op} {path} at {name} (interpreted: {interpreted}): {sorted(missing)[:5]}"


def test_production_sizes_and_every_small_value_in_every_profile():
    for profile in PROFILES.values():
        prefill = {f.name: f.values for f in coverage.coverage_of("sparse_prefill").pairs.factors(profile)}
        decode = {f.name: f.values for f in coverage.coverage_of("sparse_decode_fp8").pairs.factors(profile)}
        assert set(PRODUCTION_HEADS) <= set(prefill["heads"]) & set(decode["heads"]) and "finite" in prefill["sink"]
        assert PRODUCTION_TOPK in prefill["topk"] and {PRODUCTION_TOPK, *OFF_TABLE_TOPK} <= set(decode["topk"])
        assert decode["s_q"] == (1, 2, 3, 4)
        merge = {f.name: f.values for f in coverage.coverage_of("dcp_merge").pairs.factors(profile)}
        assert merge["ranks"] == tuple(range(1, 9))
    # The heads 64 and 128 with a finite sink, held at ci by the prefill's pairs
    ci = get_profile("ci")
    held = _held("sparse_prefill", None, ci, coverage.covering_set("sparse_prefill", ci, 1))
    assert {(("heads", h), ("sink", "finite")) for h in PRODUCTION_HEADS} <= held


@pytest.mark.parametrize("op, params", [
    ("sparse_prefill", {"tokens": 2, "heads": 8, "kv_rows": 300, "topk": 256, "sm_scale": 0.1352, "invalid": []}),
    ("sparse_decode_fp8", {"batch": 1, "s_q": 1, "heads": 8, "topk": 256, "seq_lens": [300], "page_size": 64,
                           "sm_scale": 0.1352, "scale_rule": "pow2", "invalid": []})], ids=["prefill", "decode"])
def test_flat_rows_are_read_from_the_logits(op, params):
    assert FLAT in coverage.features_of(Case(op, {**params, "value_regime": "flat"}, 5))
    assert FLAT not in coverage.features_of(Case(op, {**params, "value_regime": "normal"}, 5))


def test_pairs_are_read_from_tensors():
    """A decode case shows the s_q, top-k, heads and page size its tensors have, and the scale
    rule its scales follow."""
    case = Case("sparse_decode_fp8", {"batch": 2, "s_q": 3, "heads": 8, "topk": 192, "seq_lens": [100, 200],
                                      "page_size": 64, "sm_scale": 0.1, "value_regime": "normal",
                                      "scale_rule": "raw", "invalid": []}, 2)
    assert coverage.shown_of(case) == {"s_q": 3, "topk": 192, "heads": 8, "page_size": 64, "scale_rule": "raw"}
    names = ["s_q", "topk", "heads", "page_size", "scale_rule"]
    assert len(tuples(coverage.shown_of(case), names, 2)) == len(list(itertools.combinations(names, 2)))
