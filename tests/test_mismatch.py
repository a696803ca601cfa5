"""Failure messages that show the bug (issue 29 item 3), as torch.testing.assert_close's do: how
many elements failed of how many, the worst one's index with the kernel's value, the reference's
and the allowed difference; +inf/-inf/NaN patterns counted so the counts add up to inf_mismatch;
an LSE's convention or offset named; a read past topk_length traced to its token. One method
(`Row.line`) prints a failing row for fuzz, replay, check()'s report and JUnit."""

import math
import re

import pytest
import torch

from mla_verify import api
from mla_verify.cli import main
from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.catalog import evaluate, resolve_subject
from mla_verify.equivalence.judge.oracle import judge
from mla_verify.equivalence.judge.policy import EXACT, LSE, OUT
from mla_verify.equivalence.judge.rows import Row
from mla_verify.equivalence.cases.numerics import Numerics


def test_an_output_failure_counts_the_elements_and_shows_the_worst_one():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(2, 4, 512, generator=g, dtype=torch.float64)
    impl = ref.to(torch.bfloat16)
    impl[1, 2, 7] += 0.5
    impl[0, 3, 100] -= 0.25
    impl[0, 0, 0] += 0.375
    v = judge(OUT, impl, ref, Numerics())
    assert not v.passed
    allowed = 12 * 2**-8 * ref[1, 2].abs().max()  # elem_bf16_units' 12 steps of the row's largest
    assert v.reason.startswith("3 / 4096 elements (0.0732%) outside their allowed difference; worst at [1,2,7]: "
                               f"kernel {float(impl[1, 2, 7]):.6g}, reference {float(ref[1, 2, 7]):.6g}, ")
    assert f"allowed {float(allowed):.3g}" in v.reason


def test_a_spread_error_says_every_element_is_within_and_names_the_gain():
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(4, 8, 512, generator=g, dtype=torch.float64)
    v = judge(OUT, (ref * 1.01).to(torch.bfloat16), ref, Numerics())
    assert not v.passed and v.gate_metric in ("bf16_units", "abs_mean_err")
    assert "every element within its allowed difference" in v.reason
    assert re.search(r"out is the reference times 1\.01\d* everywhere", v.reason), v.reason


def test_inf_and_nan_patterns_are_counted_each_with_its_first_position():
    ref = torch.tensor([[1.0, 2.0, math.inf, 3.0], [4.0, math.inf, 5.0, 6.0]], dtype=torch.float64)
    impl = ref.clone()
    impl[0, 1] = impl[1, 3] = math.nan
    impl[1, 1] = -math.inf
    v = judge(LSE, impl, ref, Numerics(), name="lse")
    assert v.gate_metric == "inf_mismatch" and v.value == 3
    assert v.reason.startswith("3 of 8 positions (37.5%) differ in +inf/-inf/NaN: ")
    assert "2 NaN where the reference is finite (first at [0,1], reference 2)" in v.reason
    assert "1 -inf where the reference is +inf (first at [1,1])" in v.reason
    assert "declare --convention empty_lse=-inf" in v.reason
    counts = [int(n) for n in re.findall(r"(\d+) (?:NaN|[+-]inf|finite) where", v.reason)]
    assert sum(counts) == v.value


@pytest.mark.parametrize("transform, says", [
    (lambda r: r / math.log(2), "LSE matches the reference in base 2: declare --convention lse_base=2 if that is "
                                "your kernel's convention"),
    (lambda r: r * math.log(2), "LSE matches the reference times ln 2"),
    (lambda r: r + math.log(2), "LSE is the reference + 0.693147 (ln 2) everywhere: a constant offset"),
    (lambda r: r - 0.25, "LSE is the reference - 0.25 everywhere: a constant offset"),
])
def test_an_lse_off_by_a_recognisable_convention_says_which(transform, says):
    g = torch.Generator().manual_seed(2)
    ref = torch.rand(3, 16, generator=g, dtype=torch.float64) * 8 + 1
    v = judge(LSE, transform(ref).float(), ref, Numerics(), scale=torch.full_like(ref, 4.0), name="lse")
    assert not v.passed and says in v.reason, v.reason


def test_a_single_value_is_not_called_a_constant_offset():
    ref = torch.tensor([3.0], dtype=torch.float64)
    v = judge(LSE, torch.tensor([3.5]), ref, Numerics(), scale=torch.full_like(ref, 4.0), name="lse")
    assert not v.passed and "offset" not in v.reason and "times" not in v.reason


def test_an_exact_mismatch_counts_and_shows_the_first():
    ref = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    impl = ref.clone()
    impl[1, 2] = -1
    impl[2, 0] = 99
    v = judge(EXACT, impl, ref, Numerics())
    assert v.reason == "2 / 12 elements (16.7%) differ bit for bit; first at [1,2]: kernel -1, reference 6"


def test_a_read_past_topk_length_names_the_token_its_length_and_the_position():
    case = Case("sparse_prefill", {"tokens": 4, "heads": 2, "kv_rows": 200, "topk": 128, "value_regime": "normal",
                                   "sm_scale": 0.1, "invalid": [], "topk_length": "random", "sink": "none"}, 5)
    rows = evaluate(case, resolve_subject("sparse_prefill", ["tests.zoo.attention:ignores_topk_length"], "cpu"), "cpu")
    out = next(r for r in rows if r.tensor == "out")
    assert not out.passed and out.gate_metric == "inf_mismatch"
    found = re.search(r"token (\d+) has topk_length (\d+) and its position (\d+), past that length, holds kv row (\d+)",
                      out.reason)
    assert found, out.reason
    t, length, j, row = map(int, found.groups())
    assert j >= length and "the kernel read past topk_length" in out.reason
    # the position is the first past the length that points at a row no valid entry selects (NaN)
    from mla_verify.equivalence.catalog import get_spec
    spec = get_spec("sparse_prefill")
    kw = spec.inputs(spec.params_of(case.params), case.seed, "cpu")
    assert int(kw["topk_length"][t]) == length and int(kw["indices"][t, j]) == row
    assert bool(torch.isnan(kw["kv"][row]).all())
    assert not any(torch.isnan(kw["kv"][int(i)]).any() for i in kw["indices"][t, length:j] if 0 <= int(i) < 200)


def test_fuzz_replay_check_and_junit_print_a_failing_row_the_same_way(tmp_path, capsys):
    impl = "tests.zoo.attention:lse_base_2"
    result = api.check("sparse_prefill", impl, examples=3, seed=1, profile="ci", device="cpu", out=tmp_path / "run",
                       junit=tmp_path / "junit.xml")
    failure = result.failure
    row = failure.rows[0]
    line = Row.from_record(row).line()
    assert "LSE matches the reference in base 2" in line
    assert f"  {line}" in result.report().splitlines()
    junit = (tmp_path / "junit.xml").read_text()
    from xml.sax.saxutils import escape
    assert escape(line) in junit
    assert main(["replay", str(failure.case_file), "--impl", impl, "--device", "cpu"]) == 1
    assert f"  FAIL {line}" in capsys.readouterr().out.splitlines()
    # the bound's own reason is not repeated in the failure, only pointed at
    assert "fp32 dot product errs" not in result.report() and "list --tolerances --long" in result.report()


def _merge_case(params: dict, seed: int) -> list:
    case = Case("dcp_merge", {"layout": "contiguous", "empty_frac": 0.0, "junk": False, **params}, seed)
    return evaluate(case, resolve_subject("dcp_merge", ["tests.zoo.dcp:no_sanitize"], "cpu"), "cpu")


@pytest.mark.parametrize("params, says", [
    ({"ranks": 2, "tokens": 3, "heads": 2, "empty_frac": 1.0},
     r"the ranks' LSEs are \[-inf, -inf\]: every rank's LSE is -inf \(no rank holds a key of it"),
    ({"ranks": 4, "tokens": 8, "heads": 4, "junk": True},
     r"the ranks' LSEs are \[[^\]]*\]: rank \d+'s LSE is (\+inf|NaN) and its out NaN \(an undefined partial"),
])
def test_a_merge_nan_quotes_the_ranks_lses_at_its_position(params, says):
    """Issue 50 item 6: the combine that does not sanitize (vLLM #46514) makes NaN from every rank
    -inf (-inf - -inf) and from a rank's +inf or NaN; the message quotes the inputs there."""
    rows = _merge_case(params, 3)
    failing = [r for r in rows if not r.passed]
    assert failing and all(re.search(says, r.reason) for r in failing), [r.reason for r in failing]
    at = re.search(r"at token (\d+), head (\d+) the ranks' LSEs are \[([^\]]*)\]", failing[0].reason)
    from mla_verify.equivalence.catalog import get_spec
    spec = get_spec("dcp_merge")
    kw = spec.inputs(spec.params_of({"layout": "contiguous", "empty_frac": 0.0, "junk": False, **params}), 3, "cpu")
    lses = kw["lses"][:, int(at.group(1)), int(at.group(2))].tolist()
    quoted = [float(v.replace("+inf", "inf")) for v in at.group(3).split(", ")]
    assert all((math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-3) for a, b in zip(quoted, lses))
    assert "usually" not in failing[0].reason and "inf - inf" in failing[0].reason   # no claim of a read


def decode_lse_in_bsh(q, kv_cache, indices, sm_scale):
    """The decode LSE returned as (B, S, H): a shape the contract's (B, H, S) names."""
    from mla_verify import reference

    res = reference.sparse_decode_fp8(q, kv_cache, indices, sm_scale)
    return res.out.float().to(torch.bfloat16), res.lse.transpose(1, 2).contiguous().float()


def test_a_wrong_shape_is_said_in_the_contracts_dimension_names():
    result = api.check("sparse_decode_fp8", decode_lse_in_bsh, examples=1, device="cpu", profile="ci", seed=1,
                       isolate=False, shrink=False)
    row = next(r for r in result.failure.rows if r["tensor"] == "lse")
    b, s, h = re.search(r"lse: shape \((\d+), (\d+), (\d+)\)", row["reason"]).groups()
    assert f"the contract says (B={b}, H={h}, S={s})" in row["reason"], row["reason"]


def concat_doubles_rope(ql_nope, q_pe):
    return torch.cat([ql_nope, q_pe * 2], dim=-1)


def concat_doubles_rope_past_64_tokens(ql_nope, q_pe):
    return torch.cat([ql_nope, torch.cat([q_pe[:64], q_pe[64:] * 2])], dim=-1)


def test_a_finding_left_unminimized_says_how_to_minimize_it(tmp_path):
    """A failure only a covering case shows (its 65 tokens; ci draws at most a few) is never shrunk:
    the draws after it find none to shrink. The failure says so, and how many examples draw on."""
    result = api.check("concat_mla_q", "tests.test_mismatch:concat_doubles_rope_past_64_tokens", examples=2,
                       device="cpu", profile="ci", seed=1, out=tmp_path / "run")
    assert not result.passed and not result.failure.minimized
    report = result.report()
    assert "case (as found, not minimized)" in report and "not minimized: it is a covering case" in report
    assert "the 2 examples drawn after it found no failure to shrink" in report, report
    assert "(--examples 10) draw on until one fails, and minimize it" in report, report
