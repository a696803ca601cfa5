"""Bias (issue 27): the signed statistics every float row carries (gain with its standard error,
the mean signed error in rounding units), the t intervals that judge them with cases as the
samples, and the kernels the magnitude ratios could not see: an output gain of 2**-10 and an LSE
4 fp32 steps high, flagged against their correct twin at 60 cases, while a reseeded rerun of the
same code stays clean and a correct kernel alone raises no warning.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd
import pytest
import torch

from mla_verify import api, reports
from mla_verify.cli import main
from mla_verify.equivalence.judge import metrics
from mla_verify.equivalence.judge.policy import BIAS_METRICS
from mla_verify.reports.bias import BIASED, bias_of
from mla_verify.reports.drift import DRIFT, IMPROVED, PAIRED, UNPAIRED, compare
from mla_verify.reports.significance import mean_interval, shift_interval, t_quantile, t_two_sided

CASES, SEED = 60, 27
# The draws alone (no covering set): gain10 sits at 0.98 of abs_mean_err's 1e-3 on the drawn regimes,
# inside every bound; a flat-regime 128-head covering case adds its rounding lean and fails it (1.13e-3),
# which is the bound doing its job, not what these tests are about.
DRAWN = dict(covering=False)
GAIN_FLOOR = next(m for m in BIAS_METRICS if m.name == "gain").floors["out"]


# ---------------------------------------------------------------- the row's statistics


def test_gain_and_offset_are_measured_with_their_noise():
    torch.manual_seed(0)
    r = torch.randn(64, 16, 512, dtype=torch.float64)
    rounded = metrics.output(r.to(torch.bfloat16), r, 12.0)
    assert abs(rounded.gain) < 4 * rounded.gain_se and rounded.gain_se < 2.0**-16   # rounding: noise around 0
    assert abs(rounded.bias_units) < 0.01                                           # ulps, both signs
    gained = metrics.output((r * (1 + 2.0**-10)).to(torch.bfloat16), r, 12.0)
    assert abs(gained.gain - 2.0**-10) < 4 * gained.gain_se
    assert abs(gained.bias_units) < 0.01          # a gain moves each element with the sign of r: no offset
    shifted = metrics.output((r + 2.0**-9).to(torch.bfloat16), r, 12.0)
    assert shifted.bias_units > 0.5 and abs(shifted.gain) < 4 * shifted.gain_se     # an offset: no gain
    one_row = metrics.output(r[0, 0].to(torch.bfloat16), r[0, 0], 12.0)
    assert math.isfinite(one_row.gain) and math.isnan(one_row.gain_se)             # one cluster: no interval


def test_a_reference_flushed_to_zero_has_no_gain():
    r = torch.full((2, 512), 1e-50, dtype=torch.float64)
    m = metrics.output(torch.zeros(2, 512, dtype=torch.bfloat16), r, 12.0)
    assert math.isnan(m.gain) and m.bias_units == 0.0


def test_lse_bias_is_counted_in_fp32_steps_of_the_logit_scale():
    torch.manual_seed(1)
    ref = torch.rand(64, 16, dtype=torch.float64) * 10
    logit_l1 = torch.full_like(ref, 30.0)
    step = 2.0**-24 * (logit_l1 + ref.abs() + 1)
    assert abs(metrics.lse(ref.float(), ref, logit_l1).bias_units) < 0.05
    assert metrics.lse((ref + 4 * step).float(), ref, logit_l1).bias_units == pytest.approx(4.0, abs=0.05)


# ---------------------------------------------------------------- the intervals


def test_t_intervals_match_the_tables():
    assert t_quantile(0.99, 1) == pytest.approx(63.657, abs=1e-3)
    assert t_quantile(0.95, 5) == pytest.approx(2.5706, abs=1e-4)
    assert t_quantile(0.99, 59) == pytest.approx(2.6618, abs=1e-4)
    assert t_two_sided(2.0, 1) == pytest.approx(0.29517, abs=1e-5)
    rng = np.random.default_rng(0)
    mean, ci, p = mean_interval(rng.normal(1.0, 1.0, 60), 0.99)
    assert abs(mean - 1.0) < ci and p < 1e-6
    assert mean_interval([0.0, 0.0, 0.0], 0.99) == (0.0, 0.0, 1.0)     # identical reruns: no shift at all
    assert math.isnan(mean_interval([1.0], 0.99)[1])                   # one case: no interval
    shift, ci, p = shift_interval(rng.normal(0, 1, 30), rng.normal(0, 2, 40), 0.99)
    assert abs(shift) < ci and p > 0.01


# ---------------------------------------------------------------- kernels at 60 cases


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    """The correct kernel's run: sparse_prefill, 60 drawn cases of profile ci (its reruns against it
    as a baseline draw alone too: meta.json says the covering set was skipped)."""
    out = tmp_path_factory.mktemp("bias") / "v1"
    assert api.check("sparse_prefill", "tests.impls.drifted:v1", examples=CASES, seed=SEED, device="cpu",
                     profile="ci", out=out, **DRAWN).passed
    return out


def _metric(drift, tensor: str, metric: str) -> pd.Series:
    m = drift.metrics
    return m[(m["tensor"] == tensor) & (m["metric"] == metric)].iloc[0]


@pytest.mark.parametrize("kernel, tensor, metric", [("gain10", "out", "gain"), ("lse_offset", "lse", "bias_units")])
def test_a_biased_kernel_is_flagged_against_its_correct_twin(twin, kernel, tensor, metric):
    run = api.check("sparse_prefill", f"tests.impls.drifted:{kernel}", device="cpu", baseline=twin)
    assert run.passed and run.examples == CASES and not run.covering   # inside every bound, the twin's draws
    drift = api.drift(run, twin)
    assert drift.exit_code == 1
    m = _metric(drift, tensor, metric)
    assert (m["mode"], m["finding"], m["paired_cases"]) == (PAIRED, DRIFT, CASES)
    assert abs(m["shift"]) - m["shift_ci"] > m["floor"]                # the whole interval past the floor
    expected = {"gain": (2.0**-12, 2.0**-10), "bias_units": (3.9, 4.1)}[metric]
    assert expected[0] < m["shift"] < expected[1]
    others = drift.metrics[drift.metrics["metric"].isin(["gain", "bias_units"]) & (drift.metrics["tensor"] != tensor)]
    assert (others["finding"] == "").all() and (others["shift"] == 0).all()   # the rest untouched, bit for bit
    assert any(f"{metric} shift +" in line and "paired cases, floor" in line for line in drift.lines())
    alone = bias_of(run.rows)
    assert list(alone.warnings[["tensor", "metric"]].itertuples(index=False, name=None)) == [(tensor, metric)]


def test_a_reseeded_rerun_of_the_same_code_is_clean(twin):
    again = api.check("sparse_prefill", "tests.impls.drifted:v1", examples=CASES, seed=SEED + 1, device="cpu",
                      profile="ci", **DRAWN)
    base, _ = api.load_run(twin)
    assert not api.drift(again, twin).drifted
    # with no case in common every group is judged unpaired, Welch's test on the bias metrics
    rows = again.rows[~again.rows["case_id"].isin(base["case_id"])]
    drift = compare(rows, base)
    assert not drift.drifted, drift.lines()
    signed = drift.metrics[drift.metrics["metric"].isin(["gain", "bias_units"])]
    assert len(signed) == 4 and (signed["mode"] == UNPAIRED).all() and signed["p_value"].notna().all()
    assert bias_of(again.rows).warnings.empty and bias_of(base).warnings.empty


def test_a_significant_shift_below_the_floor_is_not_drift(twin):
    base, _ = api.load_run(twin)
    out = base["tensor"] == "out"

    def gained(by: float) -> pd.DataFrame:
        return base.assign(gain=base["gain"].where(~out, base["gain"] + by))

    small = _metric(compare(gained(GAIN_FLOOR / 2), base), "out", "gain")
    assert small["p_value"] < 1e-6 and small["finding"] == ""       # certain, and too small to matter
    assert _metric(compare(gained(2 * GAIN_FLOOR), base), "out", "gain")["finding"] == DRIFT
    fixed = compare(base, gained(2 * GAIN_FLOOR))                      # the bias removed: an improvement
    assert _metric(fixed, "out", "gain")["finding"] == IMPROVED and fixed.exit_code == 0
    # a group that only the gain flags: named by its shift, drawn in the bias figure
    meta = {"profile": "ci", "seeds": [SEED], "device": "cpu"}
    report = reports.build_report(gained(2 * GAIN_FLOOR), meta, (base, meta))
    assert report.drift.worst.what().startswith("gain shift +2.4")
    assert report.exit_code == 1 and 'id="plot-bias"' in reports.render_html(report)


def test_a_single_run_warns_of_bias_and_still_passes(twin, tmp_path, capsys):
    out = tmp_path / "gain10"
    assert main(["fuzz", "--op", "sparse_prefill", "--impl", "tests.impls.drifted:gain10", "--device", "cpu",
                 "--examples", str(CASES), "--seed", str(SEED), "--profile", "ci", "--no-covering-set",
                 "--out", str(out)]) == 0
    assert "\nwarning: BIAS sparse_prefill out [tests.impls.drifted:gain10]: gain +" in capsys.readouterr().out
    assert main(["report", str(out)]) == 0
    text = capsys.readouterr().out
    line = next(ln for ln in text.splitlines() if ln.startswith("warning: BIAS"))
    assert line.startswith("warning: BIAS sparse_prefill out [tests.impls.drifted:gain10]: gain +")
    over = re.search(r"± \S+ \(t interval at 0.99\) over (\d+) cases, floor 1.22e-04$", line)
    page = (out / "report.html").read_text()
    assert 'class="banner warn"' in page and 'id="plot-bias"' in page and 'id="bias"' in page
    assert main(["report", str(twin)]) == 0
    assert "warning: BIAS" not in capsys.readouterr().out
    frame, _ = reports.load_run(out)
    assert frame[["gain", "gain_se", "bias_units"]].notna().any().all()   # stored in the run's rows
    gained = frame[(frame["tensor"] == "out") & frame["gain"].notna()]
    assert over and int(over.group(1)) == gained["case_id"].nunique()    # the cases with a gain, no others
    table = bias_of(frame).table
    assert set(table.loc[table["finding"] == BIASED, "metric"]) == {"gain"}


def test_the_gpu_lanes_bias_table_runs_on_cpu(tmp_path, capsys):
    """scripts/bias_gpu.py (`scripts/gpu_lane.sh bias`) on CPU: the implementations here, one table."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    try:
        import bias_gpu
    finally:
        sys.path.pop(0)
    assert bias_gpu.main(["--device", "cpu", "--op", "sparse_prefill", "--impl", "torch-fp32", "--impl", "triton",
                          "--examples", "6", "--no-covering-set", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "bias.md").read_text()
    assert table in capsys.readouterr().out                                   # printed, and written
    lines = table.splitlines()
    assert lines[2].startswith("| op | implementation | deviation | cases | out gain |")
    assert sum(ln.startswith("| sparse_prefill | ") for ln in lines) == 2 + 4   # two kernels; triton paired on out gain and bias_units, lse and max_logits bias_units
    assert "| sparse_prefill | triton | - | out | gain | 6 | " in table


def test_sm90s_bf16_scale_rounding_emulated_shows_as_spread_not_bias():
    """tests.impls.drifted:scale_bf16 rounds each fp32 tile scale to bf16 (the declared deviation
    bf16_cache_scale): round to nearest leans neither way, so its raw-scale cases spread wider and
    raise no warning (the H200 measurement, scripts/bias_gpu.py, answers for the real kernel)."""
    run = api.check("sparse_decode_fp8", "tests.impls.drifted:scale_bf16", examples=CASES, seed=SEED, device="cpu",
                    profile="ci", deviations=["bf16_cache_scale"])
    table = bias_of(run.rows).table
    rounded = table[table["deviation"] == "bf16_cache_scale"]
    exact = table[(table["deviation"] == "") & (table["metric"] == "gain")]
    assert run.passed and len(rounded) == 3 and (table["finding"] == "").all()
    assert rounded.loc[rounded["metric"] == "gain", "ci"].iloc[0] > 2 * exact["ci"].iloc[0]   # wider, not off-centre
