"""The covering sets (equivalence.coverage): each profile's first cases hit every feature an op
lists, as their built tensors show; a campaign runs them first; a feature is read from tensors,
not claimed by params."""

import pytest

from mla_verify.equivalence import coverage
from mla_verify.equivalence.case import Case
from mla_verify.equivalence.catalog import evaluate, get_spec, names, resolve_subject
from mla_verify.equivalence.profiles import PROFILES, get_profile
from mla_verify.fuzz.campaign import Campaign, each, first_cases, fuzz

SINGLE = sorted({op for op, path in coverage.covered() if op != "forward_mqa"})
FORWARD = [path for op, path in coverage.covered() if op == "forward_mqa"]


def _hits_all(op: str, profile: str, seed: int, path: str | None = None) -> list[Case]:
    cases = coverage.covering_set(op, get_profile(profile), seed, path)
    hit = set().union(*(coverage.features_of(c, path=path) for c in cases))
    missed = set(coverage.coverage_of(op, path).features) - hit
    assert not missed, f"{op} {path} at {profile}, seed {seed}: the covering set of {len(cases)} misses {sorted(missed)}"
    return cases


def test_every_op_lists_features():
    """Every op of one process has a covering set (the multi-process dcp op draws per world size)."""
    assert set(SINGLE) | {"forward_mqa", "dcp"} == set(names("op"))
    assert set(FORWARD) == {None, *get_spec("forward_mqa").paths}


@pytest.mark.parametrize("profile", list(PROFILES))
@pytest.mark.parametrize("op", SINGLE)
def test_covering_set_hits_every_feature(op, profile):
    for seed in (1, 2):
        cases = _hits_all(op, profile, seed)
        assert len(cases) <= get_profile(profile).examples, "a ci campaign's budget holds the whole set"


@pytest.mark.parametrize("path", FORWARD, ids=str)
@pytest.mark.parametrize("profile", ["ci", "gpu"])
def test_forward_covering_set_hits_every_feature(path, profile):
    cases = _hits_all("forward_mqa", profile, 7, path)
    assert len(cases) <= 8


def test_covering_set_is_the_seeds():
    ci = get_profile("ci")
    first = coverage.covering_set("sparse_prefill", ci, 5)
    assert [c.to_dict() for c in first] == [c.to_dict() for c in coverage.covering_set("sparse_prefill", ci, 5)]
    assert [c.to_dict() for c in first] != [c.to_dict() for c in coverage.covering_set("sparse_prefill", ci, 6)]


def test_features_are_read_from_tensors_not_params():
    base = {"batch": 2, "s_q": 1, "heads": 1, "topk": 64, "seq_lens": [30, 50], "page_size": 16, "sm_scale": 0.1,
            "value_regime": "normal", "invalid": [], "stride_pad": 0}
    raw = coverage.features_of(Case("sparse_decode_fp8", {**base, "scale_rule": "raw"}, 3))
    pow2 = coverage.features_of(Case("sparse_decode_fp8", {**base, "scale_rule": "pow2"}, 3))
    assert "raw (non-power-of-two) scales" in raw and "raw (non-power-of-two) scales" not in pow2
    assert "power-of-two scales" in pow2
    # prefill=True with two requests builds one prefill request: no claim of two.
    convert = {"tokens": 12, "requests": 2, "table_width": 2, "topk": 64, "block_size": 16, "prefill": True,
               "counts": False, "mapping": False, "invalid": []}
    assert "two prefill requests, distinct workspace starts" not in coverage.features_of(Case("convert_index", convert, 1))
    assert "two prefill requests, distinct workspace starts" in coverage.features_of(
        Case("convert_index", {**convert, "requests": 4}, 1))


def test_campaign_runs_the_covering_set_first():
    seen = []
    subject = resolve_subject("convert_index", [], "cpu")

    def run(case, source):
        seen.append(case.to_dict())
        return evaluate(case, subject, "cpu", source=source)

    ci = get_profile("ci")
    first = first_cases("convert_index", ci, None, None, (), "cpu", 11)
    result = fuzz(Campaign("convert_index", ci, ci.examples, 11), each(run))
    assert result.failure is None and result.examples == ci.examples
    assert seen[:len(first)] == [c.to_dict() for c in first] and len(seen) == ci.examples


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_first_request_workspace_bug_caught_at_ci(seed):
    """Issue 37: every prefill request reading the first one's workspace start passed `ci` on every
    seed tried (ci never drew two prefill requests); the covering set holds two."""
    ci = get_profile("ci")
    subject = resolve_subject("convert_index", ["tests.zoo.indices:first_request_workspace"], "cpu")
    result = fuzz(Campaign("convert_index", ci, ci.examples, seed, shrink=False),
                  each(lambda case, source: evaluate(case, subject, "cpu", source=source)))
    assert result.failure is not None and result.first_failure_at <= ci.examples
    assert any(r.tensor == "indices" and not r.passed for r in result.failure.rows)


def test_coverage_table_lists_every_feature():
    lines = coverage.table("sparse_decode_fp8", [get_profile("ci")], draws=20, seed=0)
    assert len(lines) == 2 + len(coverage.coverage_of("sparse_decode_fp8").features)
    assert all("MISSED" not in line for line in lines) and "ci: first" in lines[0]
    assert "lists no features" in coverage.table("dcp", [get_profile("ci")], draws=1)[0]


def _campaign(op, impl, seed, shrink=True):
    ci = get_profile("ci")
    subject = resolve_subject(op, [impl], "cpu")
    return fuzz(Campaign(op, ci, ci.examples, seed, shrink=shrink),
                each(lambda case, source: evaluate(case, subject, "cpu", source=source)))


def test_a_failing_covering_case_is_shrunk_through_the_draws_when_they_fail_too():
    """Hypothesis shrinks only its draws: after a covering case fails, the draws go on to a failure
    it shrinks; where none fails (ci draws one prefill request at most), the covering case stands."""
    result = _campaign("quantize_fp8_ds_mla", "tests.zoo.formats:divisor_224", 1)
    assert result.first_failure_at == 1 and result.shrunk and result.failure.case.params["n"] == 1
    result = _campaign("convert_index", "tests.zoo.indices:first_request_workspace", 1)
    assert result.first_failure_at == 1 and not result.shrunk and result.failure.case.params["requests"] >= 4
