"""Drift (issue 18): paired cases judged by per-case ratios, unpaired runs by a rank test that
knows its sample size, normalized metrics with floors, "no longer bitwise", implementations paired
across names, nothing comparable; and a real kernel inside its bounds but worse, flagged.

Synthetic runs come from tests.test_reports.synthetic_rows: one seed draws one set of cases, so
two runs of the same seed pair case for case and runs of different seeds do not.
"""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_verify import api
from mla_verify.cli import main
from mla_verify.equivalence.errors import UsageError
from mla_verify.equivalence.judge.policy import DRIFT_MIN_CASES
from mla_verify.reports import rows_frame, write_run
from mla_verify.reports.drift import IMPROVED, NOT_BITWISE, PAIRED, TOO_FEW, UNPAIRED, compare
from mla_verify.reports.pairing import NothingComparable
from mla_verify.reports.significance import exceeds, more_often_nonzero, smallest_p

from .test_reports import _meta, changed, synthetic_rows


def _frame(seed: int, cases: int = 24, **plants) -> pd.DataFrame:
    return rows_frame(synthetic_rows(seed, run_id=f"s{seed}", cases_per_group=cases, **plants))


@pytest.fixture(scope="module")
def baseline() -> pd.DataFrame:
    return _frame(100)


def _group(drift, path: str, tensor: str) -> pd.Series:
    g = drift.groups
    return g[(g["path"] == path) & (g["tensor"] == tensor)].iloc[0]


def _metric(drift, path: str, tensor: str, metric: str) -> pd.Series:
    m = drift.metrics
    return m[(m["path"] == path) & (m["tensor"] == tensor) & (m["metric"] == metric)].iloc[0]


# ---------------------------------------------------------------- the tests' statistics


def test_rank_test_knows_its_sample_size():
    rng = np.random.default_rng(0)
    same = rng.lognormal(0, 0.3, 40), rng.lognormal(0, 0.3, 40)
    assert exceeds(*same, factor=2.0, floor=0.1) > 0.5                  # one distribution: far inside H0
    assert exceeds(4 * same[0], same[1], factor=2.0, floor=0.1) < 1e-6   # four times larger: certain
    # below the floor nothing grows: every value is raised to it first
    assert exceeds(same[0] * 1e-3, same[1] * 1e-4, factor=2.0, floor=1.0) == 1.0
    # the smallest p at n + n cases: 1 / C(2n, n), reached when every new value ranks above every old
    assert smallest_p(5, 5) == pytest.approx(1 / 252)
    assert exceeds([10.0] * 5, [1.0, 1.1, 1.2, 1.3, 1.4], factor=2.0, floor=0.1) == pytest.approx(1 / 252)
    assert exceeds([10.0] * 4, [1.0, 1.1, 1.2, 1.3], factor=2.0, floor=0.1) == pytest.approx(1 / 70)


def test_fisher_exact_test_of_lost_bitwise_equality():
    assert more_often_nonzero(5, 5, 0, 5) == pytest.approx(1 / 252)
    assert more_often_nonzero(1, 5, 0, 5) == pytest.approx(0.5)
    assert more_often_nonzero(0, 5, 0, 5) == 1.0


# ---------------------------------------------------------------- paired


def test_the_same_cases_pair_and_an_unchanged_kernel_does_not_drift(baseline):
    drift = compare(_frame(100), baseline)
    assert drift.exit_code == 0 and not drift.drifted, drift.lines()
    assert (drift.groups["mode"] == PAIRED).all()
    assert (drift.groups["paired_cases"] == drift.groups["cur_cases"]).all()
    judged = drift.metrics[drift.metrics["ratio"].notna()]
    assert len(judged) and (judged["ratio"] == 1.0).all() and (judged["worst_ratio"] == 1.0).all()
    n = len(drift.groups)
    assert f"no drift in {n} groups compared ({n} paired, 0 unpaired" in drift.verdict


def test_paired_growth_is_flagged_with_its_median_and_worst_case(baseline):
    drift = compare(_frame(100, scale={("fp8_mixed", "out"): 3.0}), baseline)
    assert drift.exit_code == 1
    assert list(zip(drift.flagged["path"], drift.flagged["tensor"])) == [("fp8_mixed", "out")]
    units = _metric(drift, "fp8_mixed", "out", "bf16_units")
    assert units["finding"] == "drift" and units["mode"] == PAIRED
    assert units["ratio"] == pytest.approx(3.0) and units["worst_ratio"] >= units["ratio"]
    assert units["worst_case"] in set(baseline["case_id"])
    assert any(ln.startswith("  DRIFT forward_mqa/fp8_mixed out [pipeline]: bf16_units median x3 over 24 paired")
               for ln in drift.lines())
    assert drift.worst.case_id == _group(drift, "fp8_mixed", "out")["worst_case"]


def test_paired_bias_is_flagged(baseline):
    drift = compare(_frame(100, bias={("bf16", "out"): 5e-4}), baseline)
    assert list(zip(drift.flagged["path"], drift.flagged["tensor"])) == [("bf16", "out")]
    assert _metric(drift, "bf16", "out", "abs_bias")["finding"] == "drift"


def test_growth_below_the_floors_is_rounding_residue(baseline):
    # lse 0.4 -> 1.0 fp32 units and out bias 3e-6 -> 3e-5: both grow beyond the factor, below their floors
    current = _frame(100, scale={("sparse_prefill", "lse"): 2.5}, bias={("fp8_separate", "out"): 3e-5})
    drift = compare(current, baseline)
    assert not drift.drifted, drift.lines()
    raw = current.merge(baseline, on=["case_id", "tensor", "impl"], suffixes=("", "_base"))
    lse = raw[(raw["path"] == "sparse_prefill") & (raw["tensor"] == "lse")]
    assert (lse["lse_fp32_units"] / lse["lse_fp32_units_base"]).median() == pytest.approx(2.5)
    assert _metric(drift, "sparse_prefill", "lse", "lse_fp32_units")["ratio"] < 2.0


def test_improvement_is_reported_and_never_fails(baseline):
    worse = _frame(100, scale={("fp8_mixed_dcp", "out"): 5.0})
    drift = compare(baseline, worse)
    assert not drift.drifted and drift.exit_code == 0
    assert list(drift.improvements["path"]) == ["fp8_mixed_dcp"]
    assert _group(drift, "fp8_mixed_dcp", "out")["finding"] == IMPROVED
    assert any(ln.startswith("  improved forward_mqa/fp8_mixed_dcp out") for ln in drift.lines())


def _bitwise(rows: list, nonzero: int = 0) -> list:
    """The rows with bf16 out equal to the reference bit for bit, but for its first `nonzero`
    cases, which differ far below every floor (0.01 rounding units): a change of kind, not size."""
    out, seen = [], 0
    for r in rows:
        if (r.path, r.tensor) == ("bf16", "out"):
            seen += 1
            tiny = seen <= nonzero
            r = changed(r, bf16_units=0.01 if tiny else 0.0, elem_bf16_units=0.0, mean_err=1e-9 if tiny else 0.0,
                        rel_l2=0.0, max_abs=0.0, headroom=float("inf"), value=0.0)
        out.append(r)
    return out


def test_a_bitwise_group_that_is_not_any_more_is_its_own_finding():
    base = rows_frame(_bitwise(synthetic_rows(100, "b")))
    drift = compare(rows_frame(_bitwise(synthetic_rows(100, "n"), nonzero=6)), base)
    g = _group(drift, "bf16", "out")
    assert g["finding"] == NOT_BITWISE and drift.exit_code == 1
    assert _metric(drift, "bf16", "out", "bf16_units")["bitwise_lost"] == 6
    assert any("NO LONGER BITWISE forward_mqa/bf16 out [pipeline]: bf16_units was 0 (bitwise) and is not in 6 of 24"
               in ln for ln in drift.lines())
    # unpaired: Fisher's exact test, 6 of 24 nonzero against 0 of 24 (p = 0.011): not at 0.99, at 0.95
    other = rows_frame(_bitwise(synthetic_rows(7, "o"), nonzero=6))
    assert more_often_nonzero(6, 24, 0, 24) == pytest.approx(0.011, abs=1e-3)
    assert _group(compare(other, base), "bf16", "out")["finding"] == ""
    assert _group(compare(other, base, confidence=0.95), "bf16", "out")["finding"] == NOT_BITWISE


# ---------------------------------------------------------------- unpaired


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31).filter(lambda s: s != 100))  # the baseline's own seed draws its cases: paired
def test_other_cases_of_an_unchanged_kernel_are_compared_unpaired_and_not_flagged(baseline, seed):
    drift = compare(_frame(seed), baseline)
    assert not drift.drifted, drift.lines()
    assert (drift.groups["mode"] == UNPAIRED).all() and drift.improvements.empty
    judged = drift.metrics[drift.metrics["kind"] != "exact"]
    assert judged["p_value"].notna().all()      # not vacuous: every float metric was tested


def test_unpaired_growth_is_flagged_by_the_rank_test(baseline):
    drift = compare(_frame(101, scale={("fp8_mixed", "out"): 5.0}), baseline)
    assert list(zip(drift.flagged["path"], drift.flagged["tensor"])) == [("fp8_mixed", "out")]
    units = _metric(drift, "fp8_mixed", "out", "bf16_units")
    assert units["mode"] == UNPAIRED and units["p_value"] < 0.01 and units["ratio"] > 4.0
    assert any("bf16_units p99" in ln and "rank test p = " in ln for ln in drift.lines())


def test_too_few_cases_are_not_judged_and_say_so():
    base, new = _frame(100, cases=3), _frame(101, cases=3, scale={("fp8_mixed", "out"): 6.0})  # inside its bound
    drift = compare(new, base)
    assert not drift.drifted and (drift.groups["mode"] == TOO_FEW).all()
    assert f"{TOO_FEW}: {len(drift.groups)} groups" in "\n".join(drift.lines())
    assert f"min {DRIFT_MIN_CASES} cases" in drift.verdict
    # nothing compared is said so (issue 47: it read "no drift in 0 groups compared"); under
    # --fail-on, `fuzz --baseline` exits 4 (NO VERDICT) on it
    assert drift.compared == 0 and drift.verdict.startswith("NO VERDICT: nothing compared with the baseline")
    # with 3 cases a side the test can reach p = 1/20 at best: flagged only at a confidence below 0.95
    assert not compare(new, base, min_cases=3).drifted
    loose = compare(new, base, min_cases=3, confidence=0.9)
    assert list(zip(loose.flagged["path"], loose.flagged["tensor"])) == [("fp8_mixed", "out")]


# ---------------------------------------------------------------- implementations and runs


def _decode_only(rows: pd.DataFrame, impl: str) -> pd.DataFrame:
    one = rows[(rows["op"] == "sparse_decode_fp8") & (rows["impl"] == "triton")].copy()
    one["impl"] = impl
    return one


def test_versions_pair_across_names_when_each_run_holds_one_per_op(baseline):
    v1 = _decode_only(baseline, "mykern_v1:decode")
    v2 = _decode_only(_frame(100, scale={("sparse_decode_fp8", "out"): 3.0}), "mykern_v2:decode")
    drift = compare(v2, v1)
    assert drift.pairs[["impl", "base_impl", "how"]].values.tolist() == [
        ["mykern_v2:decode", "mykern_v1:decode", "one per op"]]
    assert "sparse_decode_fp8: mykern_v2:decode with mykern_v1:decode (one per op)" in drift.pairing_line()
    assert list(drift.flagged["tensor"]) == ["out"] and drift.exit_code == 1
    assert "[mykern_v2:decode vs mykern_v1:decode]" in drift.lines()[1]


def test_several_implementations_need_explicit_pairs(baseline):
    both = baseline[baseline["op"] == "sparse_decode_fp8"]
    renamed = both.assign(impl=both["impl"].map({"triton": "triton_v2", "flash_mla": "flash_mla_v2"}))
    with pytest.raises(NothingComparable, match="no implementation pairs .*--pair NEW=OLD"):
        compare(renamed, both)
    drift = compare(renamed, both, pairs={"triton_v2": "triton"})
    assert drift.pairs["how"].tolist() == ["--pair"]
    assert drift.unpaired == (["sparse_decode_fp8 flash_mla_v2"], ["sparse_decode_fp8 flash_mla"])
    assert any("compared with nothing (run; pair them with --pair NEW=OLD): sparse_decode_fp8 flash_mla_v2" in ln
               for ln in drift.lines())


def test_runs_that_share_no_op_are_nothing_comparable(baseline, tmp_path, capsys):
    prefill, decode = baseline[baseline["op"] == "sparse_prefill"], baseline[baseline["op"] == "sparse_decode_fp8"]
    with pytest.raises(NothingComparable, match="share no op"):
        compare(prefill, decode)
    write_run(tmp_path / "a", prefill, _meta(1))
    write_run(tmp_path / "b", decode, _meta(2))
    assert main(["report", str(tmp_path / "a"), "--baseline", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err == "mla-verify: nothing comparable: the runs share no op\n"
    assert main(["report", str(tmp_path / "a"), "--baseline", str(tmp_path / "a"), "--pair", "x=y"]) == 2
    assert "--pair x=y: no implementation 'x' in the run" in capsys.readouterr().err


def test_reports_lead_with_the_drift_and_draw_it(baseline):
    from mla_verify.reports import build_report, render_html, render_markdown
    from mla_verify.reports.drift_plots import drift_figure

    meta = _meta(1)
    report = build_report(_frame(100, scale={("fp8_mixed", "out"): 3.0}), meta, (baseline, meta))
    md = render_markdown(report)
    lines = [ln for ln in md.splitlines() if ln]
    assert lines[1].startswith("**Baseline: DRIFT in 1 group, 23 compared (23 paired")
    assert lines[2].startswith("- **drift** forward_mqa/fp8_mixed out [pipeline]: bf16_units median x3")
    assert lines[3].startswith(f"Drifted most: case {report.drift.worst.case_id} of forward_mqa/fp8_mixed out")
    figure = drift_figure(report.drift)
    assert figure.png.startswith(b"\x89PNG") and "Paired: one dot per case" in figure.caption
    page = render_html(report)
    assert page.index('id="drift"') < page.index('id="plot-drift"') < page.index('id="drift-metrics"')  # in its section
    assert drift_figure(compare(_frame(101), baseline)) is not None       # unpaired groups draw too


# ---------------------------------------------------------------- a real kernel, the CLI


@pytest.fixture(scope="module")
def v1_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("drift") / "v1"
    assert api.check("sparse_prefill", "tests.impls.drifted:v1", examples=6, seed=3, device="cpu", profile="ci",
                     out=out).passed
    return out


def test_a_kernel_inside_its_bounds_but_worse_is_flagged_case_for_case(v1_run):
    """tests.impls.drifted:v2 is v1 with its output gain off by 2**-11: it passes, and drifts."""
    v2 = api.check("sparse_prefill", "tests.impls.drifted:v2", device="cpu", baseline=v1_run)
    assert v2.passed and v2.seed == 3 and v2.examples >= 6  # the covering set runs whole: its pairs pass 6
    drift = api.drift(v2, v1_run)
    assert drift.exit_code == 1
    g = drift.flagged.iloc[0]
    assert (g["tensor"], g["finding"], g["metric"], g["mode"]) == ("out", "drift", "abs_bias", PAIRED)
    assert g["paired_cases"] == v2.examples and g["ratio"] > 2.0
    again = api.check("sparse_prefill", "tests.impls.drifted:v1", device="cpu", baseline=v1_run)
    assert api.drift(again, v1_run).exit_code == 0


def test_fuzz_baseline_prints_the_drift_and_a_replay_that_runs(v1_run, tmp_path, capsys):
    argv = ["fuzz", "--op", "sparse_prefill", "--impl", "tests.impls.drifted:v2", "--device", "cpu",
            "--baseline", str(v1_run), "--out", str(tmp_path / "v2")]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert re.search(r"PASS: \d+ examples", out) and "the cases of baseline" in out
    assert "DRIFT sparse_prefill out [tests.impls.drifted:v2 vs tests.impls.drifted:v1]: abs_bias median x" in out
    command = "mla-verify replay" + next(ln for ln in out.splitlines() if "drifted most" in ln).split("mla-verify replay")[1]
    assert command.startswith(f"mla-verify replay {tmp_path / 'v2' / 'drift'}") and "--impl tests.impls.drifted:v2" in command
    case_file = command.split()[2]
    replayed = api.replay(case_file, "tests.impls.drifted:v2", device="cpu")
    out_row = replayed.rows[replayed.rows["tensor"] == "out"].iloc[0]
    assert replayed.passed and out_row["mean_err"] > 2.0**-13   # the bias the report named, inside its bound


def test_gate_baseline_reruns_its_cases_and_reports_paired(tmp_path, capsys):
    first = ["gate", "--device", "cpu", "--op", "convert_index", "--examples", "3", "--out", str(tmp_path / "a")]
    assert main(first) == 0
    capsys.readouterr()
    assert main(["gate", "--device", "cpu", "--baseline", str(tmp_path / "a"), "--out", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    (a, meta_a), (b, meta_b) = api.load_run(tmp_path / "a"), api.load_run(tmp_path / "b")
    assert meta_b["seeds"] == meta_a["seeds"]
    assert meta_b["extra"].pop("sandbox") == meta_a["extra"].pop("sandbox")  # what this host's workers stood behind
    assert meta_b["extra"] == meta_a["extra"] == {"examples": 3, "ops": ["convert_index"], "impls": None, "isolated": True}
    assert set(b["case_id"]) == set(a["case_id"])
    assert "no drift in 4 groups compared (4 paired, 0 unpaired" in out


def test_the_worst_drifted_case_keeps_what_its_run_declared(tmp_path):
    """A fuzz run records its declared deviations and conventions (meta.json); the case that
    drifted most is saved with them, and its replay command names them."""
    from mla_verify.equivalence.cases.case import Case
    from mla_verify.fuzz import casefile
    from mla_verify.reports.drift import Worst

    run = api.check("sparse_prefill", "tests.impls.drifted:v1", device="cpu", examples=2, seed=1,
                    deviations=["bf16_dequant"], out=tmp_path / "run")
    extra = api.load_run(run.out)[1]["extra"]
    assert extra["deviations"] == ["bf16_dequant"] and extra["conventions"] == []
    case = Case("sparse_prefill", {"tokens": 2, "heads": 8, "kv_rows": 40, "topk": 128, "value_regime": "normal",
                                   "sm_scale": 0.1, "invalid": [], "topk_length": "none", "sink": "none"}, 4)
    worst = Worst("sparse_prefill out", "abs_bias", 3.0, case.case_id, case.dumps(), ("tests.impls.conventions:prefill_base2",), "cpu")
    command = api.save_worst_case(worst, tmp_path / "drift", ["bf16_dequant"], ["lse_base=2"])
    saved = casefile.load(next((tmp_path / "drift").glob("*.json")))
    assert saved.deviations == ("bf16_dequant",) and saved.conventions == ("lse_base=2",)
    assert "--deviation bf16_dequant" in command and "--convention lse_base=2" in command


def test_a_baseline_names_the_specs_it_ran_from_its_rows(v1_run, tmp_path):
    """A baseline serves the op it ran: each row's spec is read from its op and path columns (a
    property's row: op "property", path NAME), never parsed back out of its case."""
    with pytest.raises(UsageError, match="holds no rows of property:determinism .it ran sparse_prefill."):
        api.property_check("determinism", device="cpu", baseline=v1_run)
    prop = tmp_path / "prop"
    assert api.property_check("determinism", "torch-fp32", examples=2, seed=3, device="cpu", profile="ci", out=prop).passed
    assert api.property_check("determinism", "torch-fp32", device="cpu", baseline=prop).examples == 2
