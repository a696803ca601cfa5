"""The covering sets (equivalence.coverage.sets): each profile's first cases hit every feature an op
lists, as their built tensors show; a campaign runs them first; a feature is read from tensors,
not claimed by params."""

import dataclasses
import math

import pytest
import torch

from mla_verify import reference
from mla_verify.reference.fp8_ds_mla import unpack_fp8_ds_mla
from mla_verify.equivalence.coverage import sets as coverage
from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.catalog import evaluate, get_spec, names, resolve_subject
from mla_verify.equivalence.coverage.features import DEGENERATE
from mla_verify.equivalence.cases.params import WORLD_SIZES
from mla_verify.equivalence.cases.numerics import Numerics
from mla_verify.equivalence.cases.profiles import PROFILES, get_profile
from mla_verify.equivalence.cases.values import REGIMES, q_values
from mla_verify.fuzz.campaign import Campaign, each, first_cases, fuzz

SINGLE = sorted({op for op, path in coverage.covered() if op != "forward_mqa" and not op.startswith("property:")})
FORWARD = [path for op, path in coverage.covered() if op == "forward_mqa"]


def _hits_all(op: str, profile: str, seed: int, path: str | None = None) -> list[Case]:
    """The feature cases of the covering set, checked to hit every feature."""
    cases = coverage.feature_set(op, get_profile(profile), seed, path)
    hit = set().union(*(coverage.features_of(c, path=path) for c in cases))
    missed = set(coverage.coverage_of(op, path).features) - hit
    assert not missed, f"{op} {path} at {profile}, seed {seed}: the covering set of {len(cases)} misses {sorted(missed)}"
    return cases


def test_every_op_lists_features():
    """Every op has a covering set (the multi-process dcp op's at the campaign's world size)."""
    assert set(SINGLE) | {"forward_mqa"} == set(names("op"))
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
    assert len(cases) <= get_profile("ci").examples, "every path's set (the unrestricted one too) fits ci's budget"


@pytest.mark.parametrize("profile", ["dev", "nightly"])
def test_the_unrestricted_forward_set_fits_every_profiles_budget(profile):
    """Six cases reach every path's features (ci's budget of 6 holds them: its campaign is the set)."""
    assert len(_hits_all("forward_mqa", profile, 1)) <= get_profile("ci").examples


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_the_dcp_covering_set_takes_the_campaigns_world_size(world_size):
    cases = coverage.covering_set("dcp", get_profile("ci"), 3, world_size=world_size)
    hit = set().union(*(coverage.features_of(c) for c in cases))
    assert hit == set(coverage.coverage_of("dcp").features) and len(cases) <= get_profile("ci").examples
    spec = get_spec("dcp")
    for c in cases:  # within the FP8 envelope the draws keep (local heads * ranks <= 64)
        p = spec.params_of(c.params)
        assert p.dcp_size == world_size and p.heads * world_size <= 64


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
    # The whole set runs (its routing pairs pass ci's budget of 6), then nothing is drawn.
    assert len(first) > ci.examples and result.failure is None and result.examples == len(first)
    assert seen == [c.to_dict() for c in first]


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


def test_coverage_table_lists_every_feature_and_pair():
    lines = coverage.table("sparse_decode_fp8", [get_profile("ci")], draws=20, seed=0)
    features = len(coverage.coverage_of("sparse_decode_fp8").features)
    assert all("MISSED" not in line for line in lines) and "ci: first" in lines[0]
    assert lines[2 + features] == "" and lines[3 + features].startswith("ci: 155 of 155 pairs of s_q x topk x heads")
    assert "  s_q x topk: 24/24: 1 x 64, 1 x 128, 1 x 192, 1 x 256" in "\n".join(lines)
    dcp = coverage.table("dcp", [get_profile("ci")], draws=1)
    assert len(dcp) == 2 + len(coverage.coverage_of("dcp").features) and all("MISSED" not in line for line in dcp)
    assert "lists no features" in coverage.table("property:singleton", [get_profile("ci")], draws=1)[0]


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


# --- the degenerate value regime: zero q rows, tied logits --------------------------------------

PREFILL_CASE = {"tokens": 4, "heads": 8, "kv_rows": 60, "topk": 128, "sm_scale": 0.1352, "invalid": ["scattered"],
                "topk_length": "random", "sink": "none"}
DECODE_CASE = {"batch": 3, "s_q": 2, "heads": 8, "topk": 64, "seq_lens": [30, 50, 90], "page_size": 16,
               "sm_scale": 0.1352, "scale_rule": "raw", "invalid": ["scattered"], "stride_pad": 0}
FORWARD_CASE = {"cache_dtype": "fp8_ds_mla", "heads": 16, "query_lens": [1, 1, 3, 70], "context_lens": [20, 9, 30, 5],
                "block_size": 16, "topk": 128, "sm_scale": 0.1352, "scale_rule": "raw", "arch": "sm100"}


def test_degenerate_q_mixes_zero_rows_with_random_ones_and_leaves_the_drawn_regimes_alone():
    q = q_values(torch.Generator().manual_seed(3), (40, 8, 576), "degenerate").view(-1, 576)
    zero = (q == 0).all(-1)
    assert 0.1 < zero.float().mean() < 0.4 and bool(zero[0]) and not bool(zero[-1])
    assert not bool((q[~zero] == 0).all(-1).any()), "a row is zero or random, never partly zero"
    assert not bool((q_values(torch.Generator().manual_seed(3), (1, 1, 576), "degenerate") == 0).all())
    assert "degenerate" not in REGIMES  # the random draws (and their pinned seeds) never draw it


@pytest.mark.parametrize("op, params", [("sparse_prefill", PREFILL_CASE), ("sparse_decode_fp8", DECODE_CASE),
                                        ("forward_mqa", FORWARD_CASE)], ids=["prefill", "decode", "forward"])
def test_degenerate_features_are_read_from_tensors(op, params):
    assert set(DEGENERATE) <= coverage.features_of(Case(op, {**params, "value_regime": "degenerate"}, 4))
    assert not set(DEGENERATE) & coverage.features_of(Case(op, {**params, "value_regime": "normal"}, 4))


def test_the_reference_answers_a_tied_row_with_the_mean_of_its_v_rows():
    """All-equal logits (a zero q row): out = the mean of the selected V rows, lse = 0 + ln(k valid)."""
    spec = get_spec("sparse_prefill")
    kw = spec.inputs(spec.params_of({**PREFILL_CASE, "value_regime": "degenerate"}), 6, "cpu")
    q, kv, idx, length = kw["q"], kw["kv"], kw["indices"].long(), kw["topk_length"]
    res = reference.sparse_prefill(q, kv, kw["indices"], kw["sm_scale"], length)
    checked = 0
    for t, h in (q == 0).all(-1).nonzero().tolist():
        live = idx[t, :int(length[t])]
        live = live[(live >= 0) & (live < kv.shape[0])]
        if live.numel() < 2:
            continue
        torch.testing.assert_close(res.out[t, h], kv[live, :512].double().mean(0), rtol=1e-12, atol=1e-12)
        assert abs(float(res.lse[t, h]) - math.log(live.numel())) < 1e-12
        checked += 1
    assert checked >= 2


def test_the_reference_decode_answers_a_tied_row_with_the_mean_of_its_v_rows():
    spec = get_spec("sparse_decode_fp8")
    kw = spec.inputs(spec.params_of({**DECODE_CASE, "value_regime": "degenerate"}), 6, "cpu")
    q, cache, idx = kw["q"], kw["kv_cache"], kw["indices"].long()
    res = reference.sparse_decode_fp8(q, cache, kw["indices"], kw["sm_scale"])
    nope, scales, _ = unpack_fp8_ds_mla(cache.reshape(-1, cache.shape[-1]))
    rows = (nope.double().view(-1, 4, 128) * scales.double()[..., None]).view(-1, 512)  # exact, no bf16 rounding
    zero = (q == 0).all(-1).nonzero().tolist()
    assert zero
    for b, s, h in zero:
        live = idx[b, s][idx[b, s] >= 0]
        torch.testing.assert_close(res.out[b, s, h], rows[live].mean(0), rtol=1e-12, atol=1e-12)
        assert abs(float(res.lse[b, h, s]) - math.log(live.numel())) < 1e-12  # lse: [B, H, S]


@pytest.mark.parametrize("op, params, impl", [
    *((op, params, impl) for op, params in (("sparse_prefill", {**PREFILL_CASE, "sink": "finite"}),
                                            ("sparse_decode_fp8", DECODE_CASE)) for impl in ("triton", "torch-fp32")),
    ("forward_mqa", FORWARD_CASE, None)], ids=["prefill-triton", "prefill-torch", "decode-triton", "decode-torch", "forward"])
def test_the_implementations_pass_degenerate_cases_under_the_same_bounds(op, params, impl):
    """The implementations here (on CPU; the pipeline for forward_mqa) pass tied rows; the policy
    reads nothing of the value regime (Numerics holds no such field), so a degenerate case is held
    to a normal case's bounds."""
    assert "value_regime" not in {f.name for f in dataclasses.fields(Numerics)}
    subject = resolve_subject(op, [impl] if impl else [], "cpu")
    case = Case(op, {**params, "value_regime": "degenerate"}, 8)
    assert set(DEGENERATE) <= coverage.features_of(case)
    rows = evaluate(case, subject, "cpu")
    assert rows and all(r.passed and not math.isnan(r.value) for r in rows), [(r.tensor, r.reason) for r in rows]
    spec = get_spec(op)
    assert spec.params_of(case.params).numerics() == spec.params_of({**params, "value_regime": "normal"}).numerics()
