"""One finding, one file: a campaign that shrinks its first failing case keeps one case file under
failures/ (the minimized case, holding the case as found under `unshrunk`), prints that file, and
`report` counts one finding, not the two failing cases (found and minimized)."""

import json
from pathlib import Path

import pytest

import mla_verify
from mla_verify.equivalence.cases.case import Case
from mla_verify.fuzz import casefile
from mla_verify.reports import load_run
from mla_verify.reports.stats import counts

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_a_shrunk_finding_is_one_case_file_holding_the_case_as_found(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    result = mla_verify.check("sparse_prefill", "my_kernel:sparse_prefill_v0", profile="ci", examples=6, seed=1,
                              device="cpu", isolate=False, out=tmp_path / "run")
    failure, = result.failures
    assert failure.minimized and list((tmp_path / "run" / "failures").iterdir()) == [failure.case_file]
    assert f"case saved: {failure.case_file}" in result.report()
    saved = casefile.load(failure.case_file)
    assert saved.case == failure.case and saved.unshrunk is not None and saved.unshrunk != saved.case
    replayed = mla_verify.replay(failure.case_file, "my_kernel:sparse_prefill_v0", device="cpu", isolate=False)
    assert not replayed.passed and replayed.reproduced


def test_report_counts_one_finding_for_one_case_file(tmp_path, monkeypatch):
    """Seed 1 fails on covering cases and on the draw Hypothesis shrinks: one finding (its file,
    named by the rows of its case), the other failing cases counted as failing cases, not findings."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    result = mla_verify.check("sparse_prefill", "my_kernel:sparse_prefill_v0", profile="ci", examples=6, seed=1,
                              device="cpu", isolate=False, out=tmp_path / "run")
    frame, _ = load_run(tmp_path / "run")
    files = [p.name for p in (tmp_path / "run" / "failures").iterdir()]
    tally = counts(frame)
    assert tally.failed_cases > 1  # the point: several failing cases, one finding
    assert tally.findings == 1 and tally.minimized_cases == 1 and set(frame.finding) == {"", *files}
    named = frame[frame.finding != ""]
    assert set(named.case_id) == {result.failure.case.case_id} and set(named.source) == {"shrink"}
    assert tally.line().startswith(f"FAIL: 1 finding in failures/: {tally.failed_rows} of {tally.rows} rows failed "
                                   f"in {tally.failed_cases} failing cases of {tally.cases} (1 of them a finding's "
                                   "minimized case)")
    saved = casefile.load(tmp_path / "run" / "failures" / files[0])
    drawn = frame[(frame.case_id == saved.unshrunk.case_id) & ~frame.passed]
    assert len(drawn) and set(drawn.source) == {"fuzz"}  # the case it was shrunk from, a failing case of the run


def test_a_case_file_s_unshrunk_case_is_validated_as_its_case_is(tmp_path):
    cf = casefile.CaseFile(Case("concat_mla_q", {"tokens": 1, "heads": 1}, 0))
    data = cf.to_dict() | {"unshrunk": {"op": "concat_mla_q", "params": {"tokens": -5, "heads": 1}, "seed": 0}}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="tokens"):
        casefile.load(bad)


def test_a_run_killed_before_its_end_names_the_same_finding_from_its_journal(tmp_path, monkeypatch):
    """The journal says which case became the finding, and that the covering case saved first no
    longer is one (its file went when the minimized one was written)."""
    from mla_verify.runs.rundir import RunDir

    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.setattr(RunDir, "finish", lambda self, rows, meta: self.release())  # as if killed at the end
    mla_verify.check("sparse_prefill", "my_kernel:sparse_prefill_v0", profile="ci", examples=6, seed=1,
                     device="cpu", isolate=False, out=tmp_path / "run")
    frame, meta = load_run(tmp_path / "run")
    assert meta["incomplete"] and (tmp_path / "run" / "journal.jsonl").exists()
    files = {p.name for p in (tmp_path / "run" / "failures").iterdir()}
    assert counts(frame, True).findings == 1 and set(frame.finding) - {""} == files


def test_the_findings_store_saves_replaces_and_drops_and_the_rows_and_journal_follow(tmp_path):
    """The store the campaign, the replayed cases and the driver are handed (issue 49 step 4): a
    new file never replaces one, the rows name the finding, the journal hears of it (not where the
    rows are journaled after), and a dropped finding's rows name another or none."""
    from mla_verify.equivalence.judge.rows import Row
    from mla_verify.fuzz.findings import Findings, UnderTest

    class Journal:
        def __init__(self):
            self.told = []

        def found(self, rows, name):
            self.told.append(([r.case_id for r in rows], name))

    journal, case = Journal(), Case("concat_mla_q", {"tokens": 1, "heads": 1}, 0)
    store, tested = Findings(tmp_path, journal), UnderTest(("k:f",), "mine")
    rows = [Row("run", case.case_id, "concat_mla_q", "concat_mla_q", "q", "mine", (), "cpu", 0, "fuzz",
                gate_metric="mismatch_frac", value=0.5, bound=0.0, passed=False) for _ in range(2)]
    first = store.save(tested, case, rows, "found at example 1")
    again = store.save(tested, case, rows[1:], "found again", journaled=False)
    assert (first.name, again.name) == (f"concat_mla_q-mine-{case.case_id}.json", f"concat_mla_q-mine-{case.case_id}-2.json")
    assert [r.finding for r in rows] == [first.name, again.name] and journal.told == [([case.case_id] * 2, first.name)]
    saved = casefile.load(first)
    assert saved.impl == ("k:f",) and saved.note == "found at example 1" and saved.failure[0]["metric"] == "mismatch_frac"
    store.replace(first, "flaky: failed 1 of 3 re-runs", (1, 3))
    assert casefile.load(first).flaky == (1, 3) and casefile.load(first).note.startswith("flaky")
    store.drop(again, rows[1:], instead=first)
    store.drop(first, rows[:1])
    assert not list((tmp_path / "failures").iterdir()) and [r.finding for r in rows] == ["", first.name]
    assert journal.told[1:] == [([case.case_id], first.name), ([case.case_id], "")]
