"""A kept corpus (mla_verify.runs.corpus) and `gate --impl` (mla_verify.runs.selection), as a kernel
repository's CI uses them: a finding is kept once, named by its content; the next run replays it
first whatever its seed and says it came from the corpus; once fixed it passes and stays kept.
The pytest plugin's --mla-verify-failures and --mla-verify-corpus, and its summary of saved cases."""

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import mla_verify
from mla_verify.runs.corpus import Corpus, name as corpus_name, summary
from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.errors import UsageError
from mla_verify.fuzz import casefile
from mla_verify.reports import load_run
from mla_verify.reports.stats import counts
from mla_verify.runs.selection import impl_units

# A concat_mla_q of a kernel repository: the RoPE half doubled (a bug in every case), or fixed.
KERNEL = '''import torch


def concat(ql_nope, q_pe):
    return torch.cat([ql_nope, q_pe * {factor}], dim=-1)
'''


def kernel(tmp_path: Path, monkeypatch, factor: int) -> str:
    """`concat` written to a module of its own (rewritten and imported afresh for the fixed one)."""
    (tmp_path / "repo_kernels.py").write_text(KERNEL.format(factor=factor))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("repo_kernels", None)
    return "repo_kernels:concat"


def saved_case(tmp_path: Path, seed: int = 0, impl: tuple[str, ...] = ("k:f",)) -> Path:
    cf = casefile.CaseFile(Case("concat_mla_q", {"tokens": 2, "heads": 1}, seed), impl, note=f"run {seed}")
    return casefile.save(tmp_path / f"case-{seed}-{len(impl)}.json", cf)


def test_a_finding_is_kept_once_named_by_its_content_and_applies_to_its_op_and_implementation(tmp_path):
    corpus = Corpus(tmp_path / "C")
    first = corpus.add(saved_case(tmp_path))
    assert first is not None and first.parent == corpus.directory and first.name.startswith("concat_mla_q-")
    assert corpus.add(saved_case(tmp_path)) is None  # found again: nothing added
    threads = [threading.Thread(target=corpus.add, args=(saved_case(tmp_path, seed=1),)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    third = corpus.add(saved_case(tmp_path, seed=2))
    assert third is not None and len(list(corpus.directory.iterdir())) == 3  # seeds 0, 1 (four writers), 2; no temporary
    assert {k.case.seed for k in corpus.applying("concat_mla_q", ("k:f",))} == {0, 1, 2}
    assert corpus.applying("concat_mla_q", ("other:f",)) == () and corpus.applying("sparse_prefill", ("k:f",)) == ()


def test_a_corpus_file_that_is_no_case_file_is_a_usage_error_naming_it(tmp_path):
    (tmp_path / "C").mkdir()
    (tmp_path / "C" / "junk.json").write_text("[1, 2]")
    with pytest.raises(UsageError, match="junk.json"):
        mla_verify.check("concat_mla_q", "torch-fp32", examples=1, device="cpu", corpus=tmp_path / "C")
    (tmp_path / "F").write_text("")
    with pytest.raises(UsageError, match="not a directory"):
        mla_verify.gate(device="cpu", ops=["concat_mla_q"], corpus=tmp_path / "F", out=tmp_path / "run")


def test_a_squatted_name_never_keeps_a_finding_out_and_a_misnamed_file_is_refused(tmp_path):
    """Issue 45, item 7: a process that wrote the name a finding would take (another finding's
    file, or junk) kept the finding out of the corpus, and the next run passed."""
    corpus = Corpus(tmp_path / "C")
    taken = corpus.directory / corpus_name(casefile.load(saved_case(tmp_path)))
    corpus.directory.mkdir()
    for squatter in (b"not a case", saved_case(tmp_path, seed=7).read_bytes()):
        taken.write_bytes(squatter)
        assert corpus.add(saved_case(tmp_path)) == taken
        assert [k.case.seed for k in Corpus(corpus.directory).cases()] == [0]
    assert corpus.add(saved_case(tmp_path)) is None  # the finding itself: kept once
    (corpus.directory / "concat_mla_q-0000000000000000.json").write_bytes(saved_case(tmp_path, seed=3).read_bytes())
    with pytest.raises(UsageError, match="its name is not the hash of the finding it holds"):
        Corpus(corpus.directory).cases()


def test_check_keeps_the_finding_replays_it_first_under_another_seed_and_keeps_it_once_fixed(tmp_path, monkeypatch):
    buggy = kernel(tmp_path, monkeypatch, 2)
    corpus = tmp_path / "C"
    first = mla_verify.check("concat_mla_q", buggy, examples=3, seed=1, device="cpu", isolate=False, corpus=corpus)
    kept = list(corpus.iterdir())
    assert not first.passed and len(kept) == 1 and f"kept in the corpus: {kept[0]}" in first.report()
    again = mla_verify.check("concat_mla_q", buggy, examples=1, seed=99, device="cpu", isolate=False, corpus=corpus)
    assert again.failures[0].from_corpus and casefile.load(again.failures[0].case_file).case == casefile.load(kept[0]).case
    assert again.failures[0].case_file.parent.name == "failures"  # a finding of this run, saved with its others
    report = again.report()
    assert report.index("from the corpus: 1 still fails, 0 now pass") < report.index(
        "DISCREPANCY in concat_mla_q (repo_kernels:concat) from the corpus")
    # the kept finding is not added again (seed 99's own covering case may be a finding of its own)
    assert (again.rows.source == "kept").any() and kept[0] in list(corpus.iterdir())
    held = sorted(corpus.iterdir())
    mla_verify.check("concat_mla_q", buggy, examples=3, seed=1, device="cpu", isolate=False, corpus=corpus)
    assert sorted(corpus.iterdir()) == held  # a rerun adds no duplicate
    fixed = mla_verify.check("concat_mla_q", kernel(tmp_path, monkeypatch, 1), examples=1, seed=7, device="cpu",
                             isolate=False, corpus=corpus)
    assert fixed.passed and f"from the corpus: 0 still fail, {len(held)} now pass{'es' if len(held) == 1 else ''}" in fixed.report()
    assert sorted(corpus.iterdir()) == held and summary(fixed.rows.itertuples()) is not None


def test_a_kept_case_applies_to_every_unit_that_names_what_it_exercises(tmp_path):
    """Issue 50 item 1, unit by unit: an op's case by its kernel, a pipeline's or a property's by each
    stage it replaced, whatever else the unit replaces; the rest is counted, within the ops judged."""
    from mla_verify.fuzz.production import production_cases
    from mla_verify.fuzz.regressions import corpus as pinned
    from mla_verify.runs.corpus import not_replayed, with_kept

    pipeline = pinned("forward_mqa")[0][0]
    kept = [(Case("concat_mla_q", {"tokens": 2, "heads": 1}, 0), ("torch-fp32",)),
            (pipeline, ("concat_mla_q=torch-fp32",)),
            (production_cases("batch_invariance", ["forward_mqa"])[0], ("convert_index=torch-fp32",)),
            (Case(pipeline.op, pipeline.params, 1), ("sparse_prefill=torch-fp32",)),  # a kernel not named below
            (Case(pipeline.op, pipeline.params, 2), ())]                              # the project's own stages
    corpus = Corpus(tmp_path / "C")
    for n, (case, impl) in enumerate(kept):
        corpus.add(casefile.save(tmp_path / f"{n}.json", casefile.CaseFile(case, impl)))
    units = with_kept(impl_units(["concat_mla_q=torch-fp32", "convert_index=torch-fp32"], "cpu"), corpus)
    replays = {u.op: [k.case for k in u.kept] for u in units if u.kept}
    assert replays == {"concat_mla_q": [kept[0][0]], "forward_mqa": [pipeline],
                       "property:batch_invariance": [kept[2][0]]}
    assert not_replayed(corpus, units) == ["2 kept cases not replayed (they name implementations this gate does not)"]
    assert not_replayed(corpus, units, ["concat_mla_q"]) == []  # --op left forward_mqa out: not this gate's to say


def test_gate_impl_runs_what_the_named_implementations_take_part_in():
    units = impl_units(["sparse_prefill=torch-fp32"], "cpu")
    by_op = {u.op: u for u in units}
    assert by_op["sparse_prefill"].specs == ("torch-fp32",)
    assert by_op["forward_mqa"].specs == ("sparse_prefill=torch-fp32",)
    assert by_op["forward_mqa"].label == "pipeline[sparse_prefill=torch-fp32]"
    assert "property:split_invariance" in by_op and "property:cuda_graph" not in by_op  # no CUDA here
    assert not {"sparse_decode_fp8", "convert_index", "dcp"} & set(by_op)
    assert [u.op for u in impl_units(["sparse_prefill=torch-fp32"], "cpu", ["sparse_prefill"])] == ["sparse_prefill"]
    assert {u.op for u in impl_units(["concat_mla_q=torch-fp32"], "cpu")} >= {"concat_mla_q", "forward_mqa"}
    for bad, says in ((["sparse_prefill"], "expected OP=MODULE:CALLABLE"), (["nope=x:y"], "neither an op nor"),
                      (["sparse_prefill=a:b", "sparse_prefill=c:d"], "given twice"),
                      (["sparse_prefill=no_such_module:fn"], "no_such_module")):
        with pytest.raises(UsageError, match=says):
            impl_units(bad, "cpu")


def test_gate_impl_with_a_corpus_fails_keeps_replays_first_and_passes_once_fixed(tmp_path, monkeypatch):
    """Every finding is one file under the run's failures/, counted once by the report, and kept in
    the corpus: the campaign's and the pinned regression case's (concat_mla_q has one) alike."""
    buggy = kernel(tmp_path, monkeypatch, 2)
    settings = dict(device="cpu", examples=2, isolate=False, ops=["concat_mla_q"], corpus=tmp_path / "C")
    first = mla_verify.gate(impl=[f"concat_mla_q={buggy}"], seed=1, out=tmp_path / "g1", junit=tmp_path / "j.xml",
                            **settings)
    saved = sorted((tmp_path / "g1" / "failures").iterdir())
    kept = sorted((tmp_path / "C").iterdir())
    assert first.failed and len(saved) == len(kept) == 2  # the pinned case's and the campaign's
    assert {r.impl for r in first.rows} == {buggy}  # only the named implementation ran
    pinned = next(r for r in first.rows if r.source == "corpus")
    assert pinned.finding in {p.name for p in saved} and not pinned.passed
    assert "  a pinned regression case: fails" in first.lines()
    assert [line for line in first.lines() if line.startswith("finding saved: ")] == [
        f"finding saved: {p}" for p in sorted(saved, key=lambda p: p.name != pinned.finding)]
    frame, _ = load_run(tmp_path / "g1")
    assert counts(frame).findings == 2 and counts(frame).line().startswith("FAIL: 2 findings in failures/: ")
    junit = (tmp_path / "j.xml").read_text()  # the CI's view counts the same findings, replays the first's file
    assert f'message="2 findings, {counts(frame).failed_cases} failing cases, ' in junit
    assert f"replay: mla-verify replay {tmp_path / 'g1' / 'failures'}" in junit
    second = mla_verify.gate(impl=[f"concat_mla_q={buggy}"], seed=2, out=tmp_path / "g2", **settings)
    lines = second.lines()
    assert second.failed and "note: from the corpus: 2 still fail, 0 now pass" in lines
    assert not any(r.source == "corpus" for r in second.rows)  # the pinned case runs once, as a kept one
    still = [i for i, line in enumerate(lines) if line.startswith("  from the corpus: still fails (kept as ")]
    assert len(still) == 2 and all(lines[i - 1].startswith(f"finding saved: {tmp_path / 'g2' / 'failures'}")
                                   for i in still)
    assert {line.split("kept as ")[1].rstrip(")") for line in (lines[i] for i in still)} == {p.name for p in kept}
    assert any(line.startswith("  replay: mla-verify replay ") and buggy in line for line in lines)
    again = sorted((tmp_path / "C").iterdir())
    rerun = mla_verify.gate(impl=[f"concat_mla_q={buggy}"], seed=1, out=tmp_path / "g1b", **settings)
    assert sorted((tmp_path / "C").iterdir()) == again  # a rerun adds no duplicate
    # and finds its campaign's case again among the kept ones: one finding, one file, named by its rows
    files = {p.name for p in (tmp_path / "g1b" / "failures").iterdir()}
    assert len(files) == len(again) and {r.finding for r in rerun.rows} - {""} == files  # each kept case, once
    assert len([line for line in rerun.lines() if line.startswith("finding saved: ")]) == len(again)
    fixed = mla_verify.gate(impl=[f"concat_mla_q={kernel(tmp_path, monkeypatch, 1)}"], seed=3, out=tmp_path / "g3",
                            **settings)
    held = len(again)  # the second gate's own seed may have kept a finding too
    assert not fixed.failed and f"note: from the corpus: 0 still fail, {held} now pass{'es' if held == 1 else ''}" in fixed.lines()
    assert not any((tmp_path / "g3" / "failures").iterdir())  # made at the start, holding no finding


EPILOGUE = "sparse_prefill=tests.impls.epilogue:sparse_prefill"  # a truncating bf16 epilogue
# Two stages of a kernel repository that only the HiSparse paths call (seconds a gate, where the
# forward_mqa paths through concat_mla_q or sparse_prefill take half a minute each): the valid counts
# one short (both HiSparse paths), and every prefill chunk gathered as the first (fp8 HiSparse only).
PLACE = "hisparse_place=tests.zoo.hisparse:counts_off_by_one"
GATHER = "gather_fp8_prefill=tests.zoo.hisparse:request_start_ignored"


@pytest.fixture(scope="module")
def epilogue_gate(tmp_path_factory):
    """A kernel repository's sparse_prefill (a bf16 epilogue that truncates) gated alone (seed 1,
    one example a campaign), writing JUnit."""
    root = tmp_path_factory.mktemp("epilogue")
    epilogue = mla_verify.gate(impl=[EPILOGUE], ops=["sparse_prefill", "forward_mqa"], out=root / "epilogue",
                               junit=root / "epilogue.xml", device="cpu", examples=1, seed=1, isolate=False,
                               corpus=root / "C")
    return root, epilogue


def test_kept_cases_are_replayed_whenever_the_gate_names_their_implementations(tmp_path):
    """Issue 50 item 1: a case kept by a gate of one kernel (its forward_mqa finding names that one
    stage) was matched by the exact --impl strings, so a gate naming both kernels replayed none of
    them and said nothing. Now it is keyed by what it exercises and replayed; a gate that names
    another kernel says how many it left. One corpus keeps the findings of two stages, each gated
    alone (seed 1, one example a campaign), then both together."""
    settings = dict(device="cpu", examples=1, isolate=False, corpus=tmp_path / "C", ops=["forward_mqa"])
    alone = mla_verify.gate(impl=[PLACE], seed=1, out=tmp_path / "place", **settings)
    kept = sorted((tmp_path / "C").iterdir())
    other = mla_verify.gate(impl=[GATHER], seed=1, out=tmp_path / "gather", **settings)
    assert alone.failed and other.failed
    pipeline = [k for k in kept if casefile.load(k).case.op == "forward_mqa"]
    assert pipeline and all(casefile.load(k).impl == (PLACE,) for k in pipeline)
    # the gather's gate judges forward_mqa but not hisparse_place: it leaves the kept forward_mqa cases
    left = len(pipeline)
    assert (f"note: {left} kept case{'s' * (left != 1)} not replayed ({'they name' if left != 1 else 'it names'} "
            "implementations this gate does not)") in other.lines()
    every = sorted((tmp_path / "C").iterdir())
    assert len(every) > len(kept)  # the gather's findings kept too
    both = mla_verify.gate(impl=[PLACE, GATHER], seed=2, out=tmp_path / "both", **settings)
    cases = {casefile.load(k).case.case_id for k in every}  # a case both gates kept is one case
    kept_rows = [(r.case_id, r.tensor) for r in both.rows if r.source == "kept"]
    assert {c for c, _ in kept_rows} == cases and len(kept_rows) == len(set(kept_rows))  # every kept case, once
    assert f"note: from the corpus: {len(cases)} still fail, 0 now pass" in both.lines()
    assert not any("not replayed" in line for line in both.lines())


def test_one_bug_found_ten_ways_reads_as_one_group(epilogue_gate, capsys):
    """Issue 50 item 2: a truncating bf16 epilogue failed the op, the forward_mqa paths through it
    (HiSparse's too, whose stages are not traced) and read `FAIL: 9 findings`, one line each. The
    gate's summary, its JUnit and its report put them down to the one kernel, the files under it."""
    root, epilogue = epilogue_gate
    frame, _ = load_run(root / "epilogue")
    found = counts(frame).findings
    group = f"stage sparse_prefill (tests.impls.epilogue:sparse_prefill): {found} findings, first "
    assert found >= 6 and {r.op for r in epilogue.rows if r.finding} == {"sparse_prefill", "forward_mqa"}
    mla_verify.reports.run_report(root / "epilogue", markdown=root / "report.md")
    summary = capsys.readouterr().out.splitlines()
    at = summary.index(counts(frame).line())
    assert summary[at + 1].startswith(f"  {group}") and len(summary[at + 2:at + 2 + found]) == found
    assert {line.split()[0] for line in summary[at + 2:at + 2 + found]} == set(frame.finding) - {""}
    junit = (root / "epilogue.xml").read_text()
    assert junit.count(group) == 2  # the op's test case and forward_mqa's each name the one group
    report = (root / "report.md").read_text()
    assert "### Findings by cause" in report and report.count(f"| stage sparse_prefill (tests.impls.epilogue:") == found


USER_TESTS = '''
import torch

import mla_verify


def wrong_concat(ql_nope, q_pe):
    return torch.cat([ql_nope, q_pe * 2], dim=-1)


def test_concat():
    mla_verify.assert_equivalent("concat_mla_q", wrong_concat, examples=2, device="cpu", isolate=False)
'''


def test_the_plugin_saves_failing_cases_where_told_keeps_them_and_lists_them_in_the_summary(tmp_path):
    (tmp_path / "test_user.py").write_text(USER_TESTS)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--mla-verify-seed", "3",
                           "--mla-verify-failures", "saved", "--mla-verify-corpus", "C"], cwd=tmp_path,
                          env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    saved = list((tmp_path / "saved").iterdir())
    summary_text = done.stdout.split("mla-verify: cases saved by failing tests")[1]
    assert len(saved) == 1 and str(saved[0]) in summary_text and "replay: mla-verify replay" in summary_text
    assert len(list((tmp_path / "C").iterdir())) == 1


def test_a_gate_records_its_impl_and_a_baseline_that_gated_other_kernels_says_so(tmp_path, monkeypatch, capsys):
    """meta.json records the --impl strings; `gate --baseline` gates the baseline's again unless told
    otherwise, and a comparison with a run of other --impl says so instead of comparing silently."""
    from mla_verify.cli import main

    mine = kernel(tmp_path, monkeypatch, 1)
    (tmp_path / "other_kernels.py").write_text(KERNEL.format(factor=1))
    gate = ["gate", "--device", "cpu", "--examples", "1", "--op", "concat_mla_q", "--no-isolate"]
    assert main([*gate, "--impl", f"concat_mla_q={mine}", "--seed", "1", "--out", str(tmp_path / "g1")]) == 0
    _, meta = load_run(tmp_path / "g1")
    assert meta["extra"]["impls"] == [f"concat_mla_q={mine}"]
    capsys.readouterr()
    assert main([*gate, "--baseline", str(tmp_path / "g1"), "--out", str(tmp_path / "g2")]) == 0
    out = capsys.readouterr().out
    assert f"its cases again (seed 1, profile ci, ops concat_mla_q, --impl concat_mla_q={mine})" in out
    assert load_run(tmp_path / "g2")[1]["extra"]["impls"] == [f"concat_mla_q={mine}"] and "different" not in out
    other = ["--impl", "concat_mla_q=other_kernels:concat", "--baseline", str(tmp_path / "g1")]
    assert main([*gate, *other, "--out", str(tmp_path / "g3")]) == 0
    out = capsys.readouterr().out
    assert (f"note: different implementations: this run gated --impl concat_mla_q=other_kernels:concat, the "
            f"baseline gated --impl concat_mla_q={mine}: what is compared with the baseline is another kernel's "
            "rows") in out
    assert out.index("note: different implementations") < out.index("baseline drift:")
    assert main(["report", str(tmp_path / "g1"), "--baseline", str(tmp_path / "g3"), "--markdown",
                 str(tmp_path / "m.md")]) == 0
    assert "note: different implementations: this run gated --impl concat_mla_q=repo_kernels" in (tmp_path / "m.md").read_text()
