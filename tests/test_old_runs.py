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
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mla_verify import api
from mla_verify.cli import main
from mla_verify.reports import load_run

OLD = Path(__file__).parent / "data" / "run-before-36"


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
    assert "input_written" in capsys.readouterr().out


def test_an_old_run_is_a_baseline_of_itself_without_drift(old, capsys):
    assert main(["report", str(old / "gate"), "--baseline", str(old / "gate")]) == 0
    assert "no drift" in capsys.readouterr().out
    report = api.drift(old / "gate", old / "gate")
    assert report.exit_code == 0


def test_a_new_run_takes_an_old_run_as_its_baseline(old, tmp_path, capsys):
    """`fuzz --baseline` reads the old gate's seed, profile and budget, draws its cases again and
    pairs them with the old rows: the same decode cases, no drift."""
    code = main(["fuzz", "--op", "sparse_decode_fp8", "--impl", "torch-fp32", "--device", "cpu",
                 "--baseline", str(old / "gate"), "--out", str(tmp_path / "new")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "seed 1" in out and "profile ci" in out
    assert "baseline drift: no drift in 2 groups compared (2 paired, 0 unpaired" in out
