"""A run directory written before rows had fields of their own (rank, check, written input,
stages as a tuple: issue 36) still loads, reports and serves as a baseline.

tests/data/run-before-36/ holds two runs written by the code of that time (rows.parquet and
meta.json as they were; report.html and rows.csv left out to keep it small):

    gate/      `mla-verify gate --device cpu --profile ci --examples 2 --seed 1 --op forward_mqa
               --op dcp --op property:split_invariance --op sparse_decode_fp8`: pipelines with
               their stages, DCP ranks' rows ("out_rank1"), property rows ("merged.out" under
               op "property"), rows held to a deviation
    written/   `mla-verify fuzz --op sparse_prefill --impl tests.hostile.cpu:zeroes_kv --examples 3
               --seed 1 --profile ci --no-shrink`: a failing case whose kernel wrote its input

tests/data/run-stages-as-text/forward/ is a run written by main just before rows' stages became
pairs (rows.parquet, rows.csv and meta.json as written, the stages "convert_index=torch-fp32,..."
text): `mla-verify fuzz --op forward_mqa --impl convert_index=torch-fp32 --device cpu --profile ci
--examples 3 --seed 1 --no-shrink`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from mla_verify import api
from mla_verify.cli import main
from mla_verify.reports import load_run
from mla_verify.reports.store import position

OLD = Path(__file__).parent / "data" / "run-before-36"
STAGES_AS_TEXT = Path(__file__).parent / "data" / "run-stages-as-text" / "forward"


@pytest.fixture
def old(tmp_path):
    """A copy of the stored runs (a report writes report.html into its run)."""
    shutil.copytree(OLD, tmp_path / "old")
    return tmp_path / "old"


def test_an_old_gate_run_loads_with_every_row(old):
    rows, meta = load_run(old / "gate")
    assert len(rows) == meta["rows"] == 80
    assert rows.passed.all()
    assert set(rows.op) == {"forward_mqa", "dcp", "property", "sparse_decode_fp8"}


def test_an_old_run_is_reported_and_its_failure_counted(old, capsys):
    assert main(["report", str(old / "gate")]) == 0
    out = capsys.readouterr().out
    assert "PASS: 80 rows in 22 cases, none failed" in out
    assert (old / "gate" / "report.html").stat().st_size > 0
    assert main(["report", str(old / "written")]) == 1
    out = capsys.readouterr().out
    assert "input_written" in out  # its rows name no finding: counted as failing cases, no finding count made up
    assert "FAIL: 1 of 4 rows failed in 1 failing case of 1 (rows written before they named their finding)" in out


def test_an_old_run_is_a_baseline_of_itself_without_drift(old, capsys):
    assert main(["report", str(old / "gate"), "--baseline", str(old / "gate")]) == 0
    assert "no drift" in capsys.readouterr().out
    report = api.drift(old / "gate", old / "gate")
    assert report.exit_code == 0


def test_a_new_run_takes_an_old_run_as_its_baseline(old, tmp_path, capsys):
    """`fuzz --baseline` reads the old gate's seed, profile and budget, draws its cases again and
    pairs their implementations with the old rows. They no longer pair case for case (new draws
    record input builder 2, the old cases were built by builder 1) and the old gate holds 2 cases
    a group, too few to compare unpaired: nothing is compared, and the drift says so (it said "no
    drift in 0 groups compared" before issue 47), failing only under --fail-on (NO VERDICT, 4)."""
    argv = ["fuzz", "--op", "sparse_decode_fp8", "--impl", "torch-fp32", "--device", "cpu",
            "--baseline", str(old / "gate"), "--out", str(tmp_path / "new")]
    code = main(argv)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "seed 1" in out and "profile ci" in out
    assert "baseline drift: NO VERDICT: nothing compared with the baseline" in out
    assert "implementations paired: 1 by the same name" in out
    assert main(argv[:-1] + [str(tmp_path / "strict"), "--fail-on", "drifted"]) == 4


def test_rows_carry_their_rank_check_and_written_input_as_fields(old):
    """What the names "out_rank1", "merged.out" and "input:kv" said is a field of the row now (nothing
    parses the names back); the old rows load with the fields' defaults."""
    from mla_verify.equivalence.catalog import evaluate, resolve_subject
    from mla_verify.equivalence.cases.profiles import get_profile
    from mla_verify.fuzz.campaign import Campaign, each, fuzz

    def rows_of(op, specs, examples=1):
        subject = resolve_subject(op, specs, "cpu")
        campaign = Campaign(op, get_profile("ci"), examples, 1, shrink=False)
        return fuzz(campaign, each(lambda case, source: evaluate(case, subject, "cpu", source=source))).rows

    written = [r for r in rows_of("sparse_prefill", ["tests.hostile.cpu:zeroes_kv"]) if r.gate_metric == "input_written"]
    assert [(r.tensor, r.written) for r in written] == [("input:kv", "kv")]
    isolated = api.check("sparse_prefill", "tests.hostile.cpu:zeroes_kv", examples=1, seed=1, profile="ci",
                         device="cpu", shrink=False).rows  # the worker's finding, made a row by the parent
    assert isolated.loc[isolated.gate_metric == "input_written", "written"].tolist() == ["kv"]
    merged = rows_of("property:split_invariance", ["torch-fp32"])
    assert {(r.tensor, r.check) for r in merged} == {("merged.out", "merged"), ("merged.lse", "merged")}
    ranks = {(r.tensor, r.rank) for r in rows_of("dcp", [])}
    assert {("out_rank0", 0), ("out_rank1", 1), ("partial_lse_rank1", 1)} <= ranks
    rows, _ = load_run(old / "gate")
    assert rows["rank"].isna().all() and (rows["check"] == "").all() and (rows["written"] == "").all()


def test_stages_stored_as_text_load_as_pairs_from_parquet_and_csv(tmp_path):
    """The loader reads the old "stage=impl,..." text into (stage, impl) pairs, from rows.parquet and
    rows.csv alike; written again, the run stores them as pairs (a list of structs) and loads the same."""
    from mla_verify.reports.store import ROWS_PARQUET, STAGES_TYPE, write_run
    from pyarrow import parquet

    rows, _ = load_run(STAGES_AS_TEXT)
    assert set(rows.stages.map(type)) == {tuple}
    assert rows.stages[0][:2] == (("convert_index", "torch-fp32"), ("gather_upconvert_fp8", "torch-fp32"))
    shutil.copytree(STAGES_AS_TEXT, tmp_path / "csv")
    (tmp_path / "csv" / ROWS_PARQUET).unlink()
    pd.testing.assert_frame_equal(load_run(tmp_path / "csv")[0], rows)
    write_run(tmp_path / "again", rows, {})
    assert parquet.read_schema(tmp_path / "again" / ROWS_PARQUET).field("stages").type == STAGES_TYPE
    pd.testing.assert_frame_equal(load_run(tmp_path / "again")[0], rows)
    (tmp_path / "again" / ROWS_PARQUET).unlink()
    pd.testing.assert_frame_equal(load_run(tmp_path / "again")[0], rows)


def test_a_run_with_stages_as_text_is_reported_and_a_baseline(tmp_path, capsys):
    """Reported as it was; `fuzz --baseline` takes its seed, profile and budget and pairs the new
    rows' implementation with it (the draws of a seed change with the covering sets, so the cases
    need not pair, and too few to compare unpaired: nothing compared, said so);
    the new rows' stages (pairs from the start) equal the old text's; drift's replay specs rebuild
    the --impl arguments from the pairs."""
    from mla_verify.reports.drift import replay_specs

    old = tmp_path / "old"
    shutil.copytree(STAGES_AS_TEXT, old)
    assert main(["report", str(old)]) == 0
    assert "PASS: 6 rows in 3 cases, none failed" in capsys.readouterr().out
    code = main(["fuzz", "--op", "forward_mqa", "--impl", "convert_index=torch-fp32", "--device", "cpu",
                 "--baseline", str(old), "--out", str(tmp_path / "new")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "seed 1" in out and "profile ci" in out
    # 3 cases, too few a group to compare unpaired: nothing compared, and said so
    assert "baseline drift: NO VERDICT: nothing compared" in out and "implementations paired: 1 by the same name" in out
    before, after = load_run(old)[0], load_run(tmp_path / "new")[0]
    assert (("convert_index", "torch-fp32"), ("sparse_prefill", "torch-fp32")) in set(before.stages)
    assert set(before.stages) <= set(after.stages)  # the paths drawn again (and the pairs' others) pass the same stages
    assert replay_specs(before.iloc[-1]) == ("convert_index=torch-fp32", "sparse_prefill=torch-fp32")


@pytest.mark.parametrize("stored", ['[["convert_index"]]', '[["convert_index", 1]]', "[1]", "[convert_index"])
def test_stages_that_are_not_pairs_make_the_run_unreadable(tmp_path, stored):
    from mla_verify.reports.store import ROWS_CSV

    text = pd.read_csv(STAGES_AS_TEXT / ROWS_CSV, dtype=str, keep_default_na=False)
    (tmp_path / ROWS_CSV).write_text(text.assign(stages=stored).to_csv(index=False))
    with pytest.raises(ValueError):
        load_run(tmp_path)


def test_max_abs_at_stored_as_text_loads_as_a_position(old):
    """Runs before positions were tuples stored max_abs_at as "i,j,k"; it loads as ints, and text that
    is no position makes the run unreadable."""
    frame, _ = load_run(old / "gate")
    assert all(isinstance(at, tuple) and all(type(c) is int for c in at) for at in frame["max_abs_at"])
    assert any(len(at) > 1 for at in frame["max_abs_at"])
    assert position("3,2,7") == position("[3, 2, 7]") == position(np.array([3, 2, 7])) == (3, 2, 7)
    assert position("") == ()
    for bad in ("3,x", '["q"]', "[true]", '"q"'):
        with pytest.raises(ValueError, match="not a position"):
            position(bad)


def test_rows_without_a_max_abs_at_column_take_the_empty_position(old):
    """Rows a tool wrote without the column (the history benchmark's) load with () in each row."""
    from mla_verify.reports.store import conform

    frame, _ = load_run(old / "gate")
    assert conform(frame.drop(columns="max_abs_at"))["max_abs_at"].tolist() == [()] * len(frame)
