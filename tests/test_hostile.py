"""Never lose a finding (issue 13): every way an unfinished kernel misbehaves (tests/hostile/) is a
failing case with its reason, a saved case file that replays, rows on disk, and an exit code a CI
can use: never a traceback, a pass, or lost rows. Bad invocations and bad case files exit 2 with
one line."""

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mla_verify.cli import main
from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.catalog import evaluate, resolve_subject
from mla_verify.equivalence.blocks import Judging
from mla_verify.equivalence.cases.profiles import get_profile
from mla_verify.fuzz.campaign import first_cases
from tests.hostile import CPU
from tests.isolated import judged

REPO = Path(__file__).resolve().parent.parent

# One small valid case per op the hostile kernels implement.
CASES = {
    "sparse_prefill": {"tokens": 2, "heads": 8, "kv_rows": 40, "topk": 128, "value_regime": "normal", "sm_scale": 0.1,
                       "invalid": [], "topk_length": "none", "sink": "none"},
    "convert_index": {"tokens": 3, "requests": 2, "table_width": 2, "topk": 64, "block_size": 16, "stride_extra": 0,
                      "prefill": False, "counts": False, "invalid": []},
    "dcp_merge": {"ranks": 1, "tokens": 2, "heads": 8, "empty_frac": 0.0, "junk": False},
    "sparse_decode_fp8": {"batch": 1, "s_q": 1, "heads": 8, "topk": 64, "seq_lens": [40], "page_size": 16,
                          "stride_pad": 0, "value_regime": "normal", "scale_rule": "pow2", "sm_scale": 0.1,
                          "invalid": []},
    "write_fp8_ds_mla_cache": {"n": 4, "num_blocks": 2, "block_size": 16, "stride_pad": 1, "value_regime": "normal",
                               "scale_rule": "pow2", "skip_frac": 0.0},
    "quantize_fp8_ds_mla": {"n": 2, "value_regime": "normal", "scale_rule": "pow2"},
    "gather_upconvert_fp8": {"seq_lens": [5, 9], "block_size": 16, "stride_pad": 0, "table_pad": 0, "shuffle": True,
                             "value_regime": "normal", "scale_rule": "pow2"},
}
IN_PROCESS = [h for h in CPU if not h.isolate]


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out + out.err


def saved_case(text: str) -> str:
    return next(line.split("case saved: ")[1] for line in text.splitlines() if "case saved: " in line)


def cli(*argv, cwd=REPO, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "mla_verify.cli", *map(str, argv)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)


@pytest.mark.parametrize("h", IN_PROCESS, ids=[h.impl.split(":")[1] for h in IN_PROCESS])
def test_each_hostile_kernel_fails_its_case_with_its_reason(h):
    rows = evaluate(Case(h.op, CASES[h.op], 3), resolve_subject(h.op, [h.impl], "cpu"), "cpu")
    failing = [(r.tensor, r.gate_metric, r.reason) for r in rows if not r.passed]
    assert any(metric == h.metric and h.says in reason for _, metric, reason in failing), failing


@pytest.fixture(scope="module")
def worker():
    w = Judging("cpu", isolate=True, timeout=3.0)
    yield w
    w.close()


@pytest.mark.parametrize("h", CPU, ids=[h.impl.split(":")[1] for h in CPU])
def test_each_hostile_kernel_fails_its_case_isolated_where_the_parent_judges(worker, h):
    """Every hostile kernel, in an isolation worker: the worker runs the call, the parent builds the
    reference and judges, out of reach of what the kernel did to its own process."""
    rows = judged(worker, Case(h.op, CASES[h.op], 3), [h.impl], h.impl)
    failing = [(r.tensor, r.gate_metric, r.reason) for r in rows if not r.passed]
    want, says = h.outcome(isolated=True)
    assert any(metric == want and says in reason for _, metric, reason in failing), failing


@pytest.mark.parametrize("impl", ["tests.hostile.cpu:zeroes_q", "tests.hostile.cpu:scribbles_kv_cache",
                                  "tests.hostile.cpu:lse_float64", "tests.hostile.cpu:system_exit"])
def test_a_finding_exits_1_with_its_case_saved_its_rows_on_disk_and_no_traceback(capsys, tmp_path, impl):
    op = next(h.op for h in CPU if h.impl == impl)
    code, text = run(capsys, "fuzz", "--op", op, "--impl", impl, "--examples", 3, "--seed", 1, "--device", "cpu",
                     "--profile", "ci", "--no-shrink", "--out", tmp_path / "run")
    assert code == 1 and "Traceback" not in text and "DISCREPANCY" in text
    case = json.loads(Path(saved_case(text)).read_text())
    assert case["impl"] == [impl] and case["failure"]
    from mla_verify import reports

    rows, _ = reports.load_run(tmp_path / "run")
    assert (~rows.passed).any() and not (tmp_path / "run" / "journal.jsonl").exists()


def test_stages_of_a_pipeline_and_of_a_property_get_the_same_checks():
    from mla_verify import check, property_check

    pipeline = check("forward_mqa", {"sparse_prefill": "tests.hostile.cpu:zeroes_kv"}, examples=2, seed=1,
                     profile="ci", path="bf16", device="cpu", shrink=False)
    assert not pipeline.passed and "stage sparse_prefill (tests.hostile.cpu:zeroes_kv): kv: input written" in \
        pipeline.failure.reason
    prop = property_check("determinism", {"sparse_prefill": "tests.hostile.cpu:zeroes_q"}, examples=2, seed=1,
                          profile="ci", path="sparse_prefill", device="cpu", shrink=False)
    assert not prop.passed and "q: input written" in prop.failure.reason


# ----------------------------------------------------------------------------- flakiness


def test_a_flaky_failure_is_a_finding_with_its_case_not_a_traceback(capsys, tmp_path):
    code, text = run(capsys, "fuzz", "--op", "sparse_prefill", "--impl", "tests.hostile.cpu:wrong_every_other_call",
                     "--examples", 6, "--seed", 2, "--device", "cpu", "--profile", "ci", "--out", tmp_path)
    assert code == 1 and "Traceback" not in text
    assert "FLAKY DISCREPANCY (failed 1 of 3 re-runs)" in text
    case = json.loads(Path(saved_case(text)).read_text())
    assert case["flaky"] == [1, 3] and case["failure"][0]["tensor"] == "out"


def test_a_kernel_that_flips_a_real_coin_is_found_without_a_traceback(capsys, tmp_path):
    code, text = run(capsys, "fuzz", "--op", "quantize_fp8_ds_mla", "--impl", "tests.hostile.cpu:wrong_on_a_coin_flip",
                     "--examples", 20, "--device", "cpu", "--profile", "ci", "--out", tmp_path)
    assert code == 1 and "Traceback" not in text and Path(saved_case(text)).exists()


@pytest.mark.parametrize("impl", ["tests.hostile.cpu:python_random", "tests.hostile.cpu:numpy_random"])
def test_python_and_numpy_generators_are_seeded_from_the_case_so_replays_agree(impl):
    from mla_verify import check, replay

    result = check("quantize_fp8_ds_mla", impl, examples=20, seed=3, profile="ci", device="cpu")
    assert not result.passed and result.failure.flaky is None  # deterministic per case: 3 of 3 re-runs failed
    replays = [replay(result.failure.case_file, impl, device="cpu") for _ in range(6)]
    assert all(r.reproduced and not r.passed for r in replays), [r.notes for r in replays]


# ----------------------------------------------------------------------------- crashes and hangs


def test_start_up_and_imports_never_count_against_a_case():
    worker = Judging("cpu", isolate=True, timeout=1.0)  # tests.hostile.slow_start takes 3 s to import
    try:
        case = Case("quantize_fp8_ds_mla", CASES["quantize_fp8_ds_mla"], 1)
        first = judged(worker, case, ["tests.hostile.slow_start:quantize"], "slow")
        crashed = judged(worker, case, ["tests.hostile.cpu:aborts"], "aborts")
        after = judged(worker, case, ["tests.hostile.slow_start:quantize"], "slow")  # a fresh worker imports it again
        assert all(r.passed for r in first + after) and crashed[0].gate_metric == "crashed" and worker.worker.restarts == 1
    finally:
        worker.close()


def test_a_crash_on_some_shapes_shrinks_to_the_smallest_and_correct_cases_are_never_hung(capsys, tmp_path):
    code, text = run(capsys, "fuzz", "--op", "quantize_fp8_ds_mla", "--impl", "tests.hostile.cpu:aborts_on_three_rows",
                     "--isolate", "--timeout", 3, "--examples", 12, "--seed", 4, "--device", "cpu", "--profile", "ci",
                     "--out", tmp_path)
    assert code == 1 and "Traceback" not in text
    case = json.loads(Path(saved_case(text)).read_text())
    assert case["case"]["params"]["n"] == 3 and "SIGABRT" in case["failure"][0]["reason"]
    assert "--isolate --timeout 3" in text  # the printed replay command is isolated like the run
    from mla_verify import reports

    rows, _ = reports.load_run(tmp_path)
    assert (rows.gate_metric != "hung").all()
    assert rows[rows.passed].num_tokens.max() < 3 <= rows[~rows.passed].num_tokens.min()
    code, text = run(capsys, "replay", saved_case(text), "--isolate", "--timeout", 3, "--device", "cpu",
                     "--impl", "tests.hostile.cpu:aborts_on_three_rows")
    assert code == 1 and "reproduced" in text and "SIGABRT" in text


def test_the_gpu_lanes_hostile_campaign_script_holds_on_cpu(tmp_path):
    """scripts/hostile_gpu.py (`scripts/gpu_lane.sh hostile`) against the CPU stand-in of a device-side assert."""
    done = subprocess.run([sys.executable, "scripts/hostile_gpu.py", "--out", str(tmp_path), "--device", "cpu",
                           "--op", "quantize_fp8_ds_mla", "--impl", "tests.hostile.cpu:aborts_on_three_rows",
                           "--param", "n", "--timeouts", "3", "--profile", "ci", "--examples", "12"],
                          cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    table = done.stdout.strip().splitlines()
    assert done.returncode == 0 and table[-1].split()[-1] == "ok", done.stdout + done.stderr
    assert table[-1].split()[3:7] == ["1", "3", "1", "True"]  # exit 1, n = 3, replay exits 1, reproduced


@pytest.mark.parametrize("impl, says", [("tests.impls.misbehaving:hangs", "hung: no answer within 2 s"),
                                        ("tests.hostile.cpu:aborts", "killed by SIGABRT")])
def test_replay_is_isolated_too_a_hang_or_an_abort_returns(capsys, tmp_path, impl, says):
    from mla_verify.fuzz import casefile

    path = casefile.save(tmp_path / "c.json", casefile.CaseFile(Case("quantize_fp8_ds_mla", CASES["quantize_fp8_ds_mla"], 1)))
    code, text = run(capsys, "replay", path, "--isolate", "--timeout", 2, "--device", "cpu", "--impl", impl)
    assert code == 1 and says in text and "Traceback" not in text


# ----------------------------------------------------------------------------- interrupted runs


def test_ctrl_c_finishes_the_case_writes_the_run_prints_the_replay_and_exits_130(tmp_path):
    # --no-isolate: the kernel stands in for a Ctrl-C reaching the harness's own process mid-case
    proc = cli("fuzz", "--op", "quantize_fp8_ds_mla", "--impl", "tests.hostile.cpu:interrupted_on_third_call",
               "--examples", 10, "--seed", 1, "--device", "cpu", "--profile", "ci", "--out", tmp_path / "run",
               "--no-isolate")
    text, _ = proc.communicate(timeout=600)
    assert proc.returncode == 130, text
    assert "Traceback" not in text and "INTERRUPTED" in text and "replay: mla-verify replay" in text
    assert Path(saved_case(text)).exists() and (tmp_path / "run" / "rows.parquet").exists()


def test_after_sigkill_the_journal_keeps_the_rows_and_report_reads_them(capsys, tmp_path):
    # --no-isolate: the harness's own process is the one killed (isolated, only a worker dies)
    proc = cli("fuzz", "--op", "quantize_fp8_ds_mla", "--impl", "tests.hostile.cpu:killed_on_third_call",
               "--examples", 10, "--seed", 1, "--device", "cpu", "--profile", "ci", "--out", tmp_path / "run",
               "--no-isolate")
    proc.communicate(timeout=600)
    assert proc.returncode == -signal.SIGKILL
    assert (tmp_path / "run" / "journal.jsonl").exists() and list((tmp_path / "run" / "failures").glob("*.json"))
    code, text = run(capsys, "report", tmp_path / "run")
    assert code == 1 and "did not finish" in text  # the failing rows were on disk before the kill


# ----------------------------------------------------------------------------- run directories


def test_out_is_checked_before_the_first_case(capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    fuzz = ["fuzz", "--op", "convert_index", "--examples", 1, "--device", "cpu", "--profile", "ci"]
    code, text = run(capsys, *fuzz, "--out", tmp_path / "file")
    assert code == 2 and "a file, not a directory" in text and len(text.strip().splitlines()) == 1
    code, text = run(capsys, *fuzz, "--out", "/proc/mla-verify-cannot-be-here")
    assert code == 2 and "cannot create it" in text
    assert run(capsys, *fuzz, "--out", tmp_path / "run")[0] == 0
    code, text = run(capsys, *fuzz, "--out", tmp_path / "run")  # never overwritten
    assert code == 2 and "already holds a run" in text
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / ".lock").write_text(str(os.getpid()))  # a live process writes it
    code, text = run(capsys, *fuzz, "--out", tmp_path / "busy")
    assert code == 2 and "being written by another run" in text


def test_default_run_directories_are_new_for_every_run(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fuzz = ["fuzz", "--op", "convert_index", "--impl", "torch-fp32", "--examples", 1, "--device", "cpu", "--profile", "ci"]
    assert run(capsys, *fuzz)[0] == 0 and run(capsys, *fuzz)[0] == 0
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert len(runs) == 2 and all(name.startswith("fuzz-convert_index-torch-fp32-") for name in runs)


# ----------------------------------------------------------------------------- case files are data


@pytest.mark.parametrize("body, says", [
    ([1, 2], "a JSON list"),
    ({"format": "mla-verify-case/1", "case": {"op": "nosuch", "params": {}, "seed": 1}}, "unknown op 'nosuch'"),
    ({"format": "mla-verify-case/1", "case": {"op": "sparse_prefill", "seed": 1,
                                              "params": {**CASES["sparse_prefill"], "topk": 10**9}}},
     "parameter topk: 1000000000 is outside"),
    ({"format": "mla-verify-case/1", "case": {"op": "sparse_prefill", "seed": 1,
                                              "params": {**CASES["sparse_prefill"], "tokens": 60000, "kv_rows": 4000000}}},
     "over the budget"),
    ({"format": "mla-verify-case/1", "case": {"op": "quantize_fp8_ds_mla", "seed": 1,
                                              "params": {**CASES["quantize_fp8_ds_mla"], "n": "2"}}}, "is not an integer"),
    ({"format": "mla-verify-case/1", "case": {"op": "quantize_fp8_ds_mla", "seed": 1,
                                              "params": {**CASES["quantize_fp8_ds_mla"], "extra": 1}}}, "unknown parameter"),
])
def test_a_bad_case_file_exits_2_with_the_reason(capsys, tmp_path, body, says):
    (tmp_path / "c.json").write_text(json.dumps(body))
    code, text = run(capsys, "replay", tmp_path / "c.json", "--device", "cpu")
    assert code == 2 and says in text and len(text.strip().splitlines()) == 1


def test_replay_never_imports_what_a_case_file_names(capsys, tmp_path, monkeypatch):
    marker = tmp_path / "imported"
    (tmp_path / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n\ndef fn(kv, scale_rule='pow2'):\n    return kv\n")
    case = Case("quantize_fp8_ds_mla", CASES["quantize_fp8_ds_mla"], 1)
    (tmp_path / "c.json").write_text(json.dumps({"format": "mla-verify-case/1", "case": case.to_dict(), "impl": ["evil:fn"]}))
    monkeypatch.chdir(tmp_path)
    code, text = run(capsys, "replay", tmp_path / "c.json", "--device", "cpu")
    assert code == 2 and "--impl evil:fn" in text and not marker.exists()


def test_every_case_a_profile_draws_is_within_its_op_schema():
    from hypothesis import HealthCheck, given, settings

    from mla_verify.equivalence.catalog import specs, validate_case
    from mla_verify.equivalence.cases.profiles import PROFILES

    for profile in PROFILES.values():
        for spec in specs():
            @settings(max_examples=8, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            @given(case=spec.strategy(profile))
            def within(case):
                validate_case(case.to_dict())

            within()


# ----------------------------------------------------------------------------- exit codes


@pytest.mark.parametrize("argv, says", [
    (["fuzz", "--op", "convert_index", "--examples", "0"], "--examples: must be a positive integer"),
    (["fuzz", "--op", "convert_index", "--examples", "-1"], "--examples: must be a positive integer"),
    (["fuzz", "--op", "convert_index", "--timeout", "-1"], "--timeout: must be a positive number"),
    (["replay", "c.json", "--timeout", "0"], "--timeout: must be a positive number"),
    (["gate", "--op", "nosuch"], "--op 'nosuch': unknown"),
    (["report", "no/such/run"], "not a readable run"),
])
def test_bad_invocations_exit_2_with_one_line(capsys, argv, says):
    code, text = run(capsys, *argv, *(["--device", "cpu"] if argv[0] != "report" else []))
    assert code == 2 and says in text and len(text.strip().splitlines()) == 1 and "Traceback" not in text


def test_report_on_an_empty_or_truncated_run_or_an_unrelated_baseline_exits_2(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    code, text = run(capsys, "report", tmp_path / "empty")
    assert code == 2 and "not a readable run" in text
    for op in ("convert_index", "concat_mla_q"):
        assert run(capsys, "fuzz", "--op", op, "--impl", "torch-fp32", "--examples", 1, "--device", "cpu",
                   "--profile", "ci", "--out", tmp_path / op)[0] == 0
    code, text = run(capsys, "report", tmp_path / "convert_index", "--baseline", tmp_path / "concat_mla_q")
    assert code == 2 and text == "mla-verify: nothing comparable: the runs share no op\n"
    parquet = tmp_path / "convert_index" / "rows.parquet"
    parquet.write_bytes(parquet.read_bytes()[:100])
    code, text = run(capsys, "report", tmp_path / "convert_index")
    assert code == 2 and "not a readable run" in text and len(text.strip().splitlines()) == 1


# ----------------------------------------------------------------------------- the library API


USER_KERNELS = '''
import torch

from mla_verify import reference


def quantize(kv, scale_rule="pow2"):
    return reference.quantize_fp8_ds_mla(kv, scale_rule)


def quantize_off_by_one(kv, scale_rule="pow2"):
    rows = reference.quantize_fp8_ds_mla(kv, scale_rule)
    rows[:, 0] ^= 1
    return rows


def concat(ql_nope, q_pe):
    return torch.cat([ql_nope, q_pe], dim=-1)
'''

USER_TESTS = '''
import pytest

import mla_verify
from my_kernels import concat, quantize, quantize_off_by_one

FAST = dict(profile="ci", device="cpu", seed=1)


def test_a_correct_kernel_passes():
    mla_verify.assert_equivalent("quantize_fp8_ds_mla", quantize, examples=5, **FAST)


def test_a_broken_kernel_fails_with_its_minimized_case_and_replay_command():
    with pytest.raises(AssertionError) as failed:
        mla_verify.assert_equivalent("quantize_fp8_ds_mla", quantize_off_by_one, examples=10, **FAST)
    message = str(failed.value)
    assert "minimized case: quantize_fp8_ds_mla(layout=contiguous, n=1," in message  # shrunk to the dense layout
    assert "mla-verify replay " in message and "--impl my_kernels:quantize_off_by_one" in message
    result = mla_verify.check("quantize_fp8_ds_mla", quantize_off_by_one, examples=10, **FAST)
    assert result.failure.metric == "mismatch_frac" and result.failure.replay_command.startswith("mla-verify replay")
    again = mla_verify.replay(result.failure.case_file, quantize_off_by_one, device="cpu")
    assert not again.passed and again.reproduced


def test_a_stage_of_a_pipeline():
    result = mla_verify.check("forward_mqa", {"concat_mla_q": concat}, examples=2, path="bf16", **FAST)
    assert result.passed, result.report()
    assert set(result.rows.tensor) == {"out", "lse"} and result.rows.impl.iloc[0].startswith("pipeline[concat_mla_q=")


def test_strategies_draw_cases():
    from hypothesis import given, settings

    @settings(max_examples=3, deadline=None)
    @given(case=mla_verify.strategies.cases("convert_index", profile="ci"))
    def drawn(case):
        assert case.op == "convert_index" and case.params["tokens"] >= 1

    drawn()
'''


def test_a_kernel_repos_own_pytest_file_uses_the_api_from_outside_the_repo(tmp_path):
    (tmp_path / "my_kernels.py").write_text(USER_KERNELS)
    (tmp_path / "test_my_kernels.py").write_text(USER_TESTS)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_my_kernels.py"],
                          cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "4 passed" in done.stdout


# ----------------------------------------------------------------------------- a PASS means the kernel is right (issue 24)


def test_a_racy_kernel_returning_its_static_buffer_fails_determinism_and_a_correct_one_passes(capsys, tmp_path):
    racy = "sparse_prefill=tests.hostile.cpu:static_prefill_racy"
    code, text = run(capsys, "fuzz", "--op", "property:determinism", "--impl", racy, "--path", "sparse_prefill",
                     "--examples", 4, "--seed", 1, "--device", "cpu", "--profile", "ci", "--no-shrink",
                     "--out", tmp_path / "racy")
    assert code == 1 and "rerun.out" in text and Path(saved_case(text)).exists()
    from mla_verify import check

    for op in ("property:determinism", "property:padding_and_order"):
        result = check(op, {"sparse_prefill": "tests.hostile.cpu:static_prefill"}, examples=4, seed=1, profile="ci",
                       device="cpu", path="sparse_prefill")
        assert result.passed, result.report()
    result = check(op, {"sparse_prefill": "tests.hostile.cpu:static_prefill_racy"}, examples=4, seed=1,
                   profile="ci", device="cpu", path="sparse_prefill", shrink=False)
    assert not result.passed  # padding_and_order's permuted call no longer compares a buffer with itself
    # fp8_separate calls the prefill once a workspace chunk, each into the same buffer (fp8_mixed_dcp,
    # tried here before, never calls it: NO VERDICT since issue 47)
    result = check("forward_mqa", {"sparse_prefill": "tests.hostile.cpu:static_prefill"}, examples=2, seed=1,
                   profile="ci", device="cpu", path="fp8_separate")
    assert result.passed, result.report()


def test_isolation_is_the_default_on_cpu_and_an_in_process_pass_says_so(capsys, tmp_path):
    """A kernel that loosens the exact bound in place fools any judge in its own process: by
    default (isolated, on CPU too) it fails; with --no-isolate its PASS, and `report`'s, say
    in-process. Subprocesses: in this one the mutation would reach later tests."""
    from mla_verify.reports.meta import IN_PROCESS

    fuzz = ["fuzz", "--op", "quantize_fp8_ds_mla", "--impl", "tests.hostile.cpu:loosens_the_bounds", "--examples", 3,
            "--seed", 1, "--device", "cpu", "--profile", "ci", "--no-shrink"]
    for flags, out, code in (([], "isolated", 1), (["--no-isolate"], "in-process", 0)):
        text, _ = (proc := cli(*fuzz, *flags, "--out", tmp_path / out)).communicate(timeout=600)
        assert proc.returncode == code, text
        assert json.loads((tmp_path / out / "meta.json").read_text())["extra"]["isolated"] is (not flags)
    assert "differ bit for bit" in (tmp_path / "isolated" / "rows.csv").read_text()
    cover = first_cases("quantize_fp8_ds_mla", get_profile("ci"), None, None, ("tests.hostile.cpu:loosens_the_bounds",),
                        "cpu", 1)  # runs whole, the draws fill the rest of 3
    assert f"PASS ({IN_PROCESS}): {max(3, len(cover))} examples" in text
    code, text = run(capsys, "report", tmp_path / "in-process")
    assert code == 0 and f"PASS ({IN_PROCESS}): " in text and "PASS: " not in text
    code, text = run(capsys, "report", _finished_run(capsys, tmp_path / "named"))  # isolated by default
    assert code == 0 and "PASS: " in text and IN_PROCESS not in text
    from mla_verify.fuzz import casefile

    path = casefile.save(tmp_path / "c.json", casefile.CaseFile(Case("quantize_fp8_ds_mla", CASES["quantize_fp8_ds_mla"], 1)))
    for flags in ([], ["--no-isolate"]):
        code, text = run(capsys, "replay", path, "--device", "cpu", *flags)
        assert code == 0 and (text.strip().splitlines()[-1].strip() == IN_PROCESS) is bool(flags), text


def test_check_isolates_a_named_implementation_and_says_when_it_judged_a_callable_in_process():
    from mla_verify import check
    from mla_verify.reports.meta import IN_PROCESS
    from tests.hostile import cpu

    named = check("quantize_fp8_ds_mla", "tests.hostile.cpu:loosens_the_bounds", examples=2, seed=1, profile="ci",
                  device="cpu", shrink=False)
    assert not named.passed and not named.in_process  # judged in this process, the kernel in a worker
    local = check("quantize_fp8_ds_mla", lambda kv, scale_rule="pow2": cpu.eager.quantize_fp8_ds_mla(kv, scale_rule),
                  examples=2, seed=1, profile="ci", device="cpu")
    cover = first_cases("quantize_fp8_ds_mla", get_profile("ci"), None, None, ("local",), "cpu", 1)
    assert local.passed and local.in_process and f"PASS ({IN_PROCESS}): {max(2, len(cover))} examples" in local.report()


def test_a_kernel_changing_global_state_fails_its_case_and_nothing_after_it_inherits_the_change(tmp_path,
                                                                                               monkeypatch):
    import torch

    from mla_verify import check

    monkeypatch.chdir(tmp_path)
    for impl in ("sets_default_dtype", "changes_directory", "turns_off_grad"):
        result = check("quantize_fp8_ds_mla", f"tests.hostile.cpu:{impl}", examples=3, seed=1, profile="ci",
                       device="cpu", out="run-" + impl, shrink=False)
        assert not result.passed and result.failure.metric == "contract"
        assert torch.get_default_dtype() == torch.float32 and torch.is_grad_enabled()
        assert Path.cwd() == tmp_path and (tmp_path / f"run-{impl}" / "rows.parquet").exists()  # --out did not move


def test_a_module_that_exits_at_import_is_a_usage_error_in_one_line(capsys, tmp_path):
    from mla_verify import UsageError, check
    from mla_verify.fuzz import casefile

    impl = "tests.hostile.exits_at_import:quantize"
    path = casefile.save(tmp_path / "c.json", casefile.CaseFile(Case("quantize_fp8_ds_mla", CASES["quantize_fp8_ds_mla"], 1)))
    for argv in (["fuzz", "--op", "quantize_fp8_ds_mla"], ["replay", path]):
        code, text = run(capsys, *argv, "--impl", impl, "--device", "cpu")
        assert code == 2 and len(text.strip().splitlines()) == 1
        assert "cannot import 'tests.hostile.exits_at_import': exited (SystemExit(0))" in text
    with pytest.raises(UsageError, match="SystemExit"):
        check("quantize_fp8_ds_mla", impl, device="cpu")


def test_a_keyboard_interrupt_the_kernel_raises_is_its_failure_not_the_users_ctrl_c(capsys, tmp_path):
    from mla_verify import check

    code, text = run(capsys, "fuzz", "--op", "quantize_fp8_ds_mla", "--impl", "tests.hostile.cpu:raises_keyboard_interrupt",
                     "--examples", 3, "--device", "cpu", "--profile", "ci", "--out", tmp_path / "run")
    assert code == 1 and "INTERRUPTED" not in text and "raised KeyboardInterrupt" in text
    result = check("quantize_fp8_ds_mla", "tests.hostile.cpu:raises_keyboard_interrupt", examples=2, device="cpu",
                   profile="ci")  # in pytest: a failing result, not the end of the session
    assert not result.passed and not result.interrupted and result.failure.metric == "raised"


@pytest.mark.parametrize("impl, says", [("tests.hostile.cpu:exits_on_third_call", "exit code 0"),
                                        ("tests.hostile.cpu:segfaults_on_third_call", "SIGSEGV")])
def test_a_kernel_that_ends_the_process_mid_run_is_a_saved_crashed_finding_never_a_pass(capsys, tmp_path, impl, says):
    fuzz = ["fuzz", "--op", "quantize_fp8_ds_mla", "--impl", impl, "--examples", 10, "--seed", 1, "--device", "cpu",
            "--profile", "ci"]
    code, text = run(capsys, *fuzz, "--out", tmp_path / "isolated")  # the default: only a worker dies
    assert code == 1 and "crashed" in text and "PASS" not in text, text
    # --no-isolate: the kernel ends the harness's own process; the journal and `report` keep the finding
    proc = cli(*fuzz, "--out", tmp_path / "run", "--no-isolate")
    proc.communicate(timeout=600)
    assert says in (f"exit code {proc.returncode}" if proc.returncode >= 0 else signal.Signals(-proc.returncode).name)
    for _ in range(2):  # a second report finds the same finding, saved once
        code, text = run(capsys, "report", tmp_path / "run")
        assert code == 1 and "PASS" not in text and "crashed: quantize_fp8_ds_mla(" in text, text
        assert "replay: mla-verify replay" in text and "--isolate" in text
    saved = list((tmp_path / "run" / "failures").glob("*-crashed.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["failure"][0]["metric"] == "crashed"
    # its journaled row names the file `report` saves: one finding, counted as the file it is
    assert "FAIL: 1 finding in failures/: 1 of " in text and list((tmp_path / "run" / "failures").iterdir()) == saved
    code, text = run(capsys, "replay", saved[0], "--device", "cpu", "--impl", impl)
    assert "Traceback" not in text and code in (0, 1)  # the replayed call is its first: no crash, and no traceback


def test_sigterm_is_handled_as_ctrl_c_and_report_never_says_pass_for_the_stopped_run(capsys, tmp_path):
    # --no-isolate: the kernel stands in for a CI runner's SIGTERM reaching the harness's own process
    proc = cli("fuzz", "--op", "quantize_fp8_ds_mla", "--impl", "tests.hostile.cpu:sigterm_on_third_call",
               "--examples", 10, "--seed", 1, "--device", "cpu", "--profile", "ci", "--out", tmp_path / "run",
               "--no-isolate")
    text, _ = proc.communicate(timeout=600)
    assert proc.returncode == 130 and "interrupted (SIGTERM)" in text and "INTERRUPTED" in text, text
    assert (tmp_path / "run" / "rows.parquet").exists()
    code, text = run(capsys, "report", tmp_path / "run")
    assert code == 1 and "INCOMPLETE" in text and "PASS" not in text


def test_an_interrupted_gate_prints_the_command_that_runs_the_rest_and_it_does(tmp_path):
    """Issue 50 item 7: the gate stops in its first unit; the command it prints runs that unit and the
    one it never reached, with the run's seed and settings, and passes (the kernel stops only once)."""
    proc = cli("gate", "--impl", "sparse_prefill=tests.hostile.cpu:prefill_sigterm_once_on_third_call", "--op",
               "sparse_prefill", "--op", "property:determinism", "--examples", 3, "--seed", 1, "--device", "cpu",
               "--out", tmp_path / "run", "--no-isolate", cwd=tmp_path)
    text, _ = proc.communicate(timeout=600)
    assert proc.returncode == 130 and "INTERRUPTED" in text, text
    said = next(line for line in text.splitlines() if line.startswith("  the rest (2 ops not finished"))
    argv = shlex.split(said.split("): ", 1)[1])
    assert argv[:2] == ["mla-verify", "gate"] and argv[argv.index("--seed") + 1] == "1"
    assert argv[-2:] == ["--out", str(tmp_path / "run-rest")]
    rest = cli(*argv[1:], cwd=tmp_path)
    text, _ = rest.communicate(timeout=600)
    assert rest.returncode == 0, text
    from mla_verify import reports

    rows, _ = reports.load_run(tmp_path / "run-rest")
    assert set(rows["op"]) == {"sparse_prefill", "property"}


def test_a_sigterm_to_the_whole_process_group_stops_the_run_without_blaming_the_kernel(capsys, tmp_path):
    # Isolated (the default): the signal is the parent's to handle, as Ctrl-C is (the worker, in a
    # session of its own behind its sandbox, does not receive it), never a `crashed` finding.
    proc = cli("fuzz", "--op", "quantize_fp8_ds_mla", "--impl", "tests.hostile.cpu:says_each_call",
               "--examples", 10, "--seed", 1, "--device", "cpu", "--profile", "ci", "--out", tmp_path / "run",
               start_new_session=True)  # its own group: the signal reaches the harness, not pytest
    said = []
    while not said or said[-1] != "call 3\n":  # cases are running: the kernel said so
        said.append(proc.stdout.readline())
        assert said[-1], "".join(said)
    os.killpg(proc.pid, signal.SIGTERM)
    text, _ = proc.communicate(timeout=600)
    text = "".join(said) + text
    assert proc.returncode == 130 and "interrupted (SIGTERM)" in text and "INTERRUPTED" in text, text
    assert "crashed" not in text and not list((tmp_path / "run").glob("failures/*.json")), text


def test_an_odd_output_layout_is_a_contract_failure_with_a_saved_case_that_replays(capsys, tmp_path):
    impl = "tests.hostile.cpu:sparse_out"
    code, text = run(capsys, "fuzz", "--op", "quantize_fp8_ds_mla", "--impl", impl, "--examples", 3, "--seed", 1,
                     "--device", "cpu", "--profile", "ci", "--out", tmp_path / "run")
    assert code == 1 and "layout sparse_coo" in text and "Traceback" not in text
    code, text = run(capsys, "replay", saved_case(text), "--device", "cpu", "--impl", impl)
    assert code == 1 and "reproduced" in text and "Traceback" not in text


# --no-isolate on purpose: a timeout is refused only where the call cannot be stopped (in process).
@pytest.mark.parametrize("argv, says", [
    (["fuzz", "--op", "quantize_fp8_ds_mla", "--impl", "tests.hostile.cpu:sleeps", "--timeout", "2", "--no-isolate"],
     "--timeout needs isolation"),
    (["replay", "c.json", "--impl", "tests.hostile.cpu:sleeps", "--timeout", "2", "--no-isolate"],
     "--timeout needs isolation"),
    (["gate", "--timeout", "2", "--op", "convert_index", "--no-isolate"], "--timeout needs isolation"),
    (["fuzz", "--op", "forward_mqa", "--impl", "sparse_prefill=torch-fp32", "--impl", "sparse_prefill=triton"],
     "both replace stage sparse_prefill"),
    (["fuzz", "--op", "property:determinism", "--impl", "triton", "--impl", "torch-fp32"], "both choose stage"),
])
def test_an_option_that_would_be_ignored_is_refused(capsys, tmp_path, argv, says):
    from mla_verify.fuzz import casefile

    casefile.save(tmp_path / "c.json", casefile.CaseFile(Case("quantize_fp8_ds_mla", CASES["quantize_fp8_ds_mla"], 1)))
    argv = [str(tmp_path / a) if a == "c.json" else a for a in argv]
    code, text = run(capsys, *argv, "--device", "cpu")
    assert code == 2 and says in text and len(text.strip().splitlines()) == 1


def _finished_run(capsys, path: Path) -> Path:
    assert run(capsys, "fuzz", "--op", "convert_index", "--impl", "torch-fp32", "--examples", 1, "--device", "cpu",
               "--profile", "ci", "--out", path)[0] == 0
    return path


def test_report_and_junit_files_never_replace_a_runs_own(capsys, tmp_path):
    done = _finished_run(capsys, tmp_path / "done")
    before = {p.name: p.read_bytes() for p in done.iterdir() if p.is_file()}
    for flag, name in (("--html", "rows.parquet"), ("--markdown", "meta.json"), ("--html", "rows.csv")):
        code, text = run(capsys, "report", done, flag, done / name)
        assert code == 2 and "is a file of the run in" in text and len(text.strip().splitlines()) == 1
    code, text = run(capsys, "fuzz", "--op", "convert_index", "--examples", 1, "--device", "cpu", "--profile", "ci",
                     "--junit", done / "rows.csv", "--out", tmp_path / "other")
    assert code == 2 and "is a file of the run in" in text
    assert all(before[p.name] == p.read_bytes() for p in done.iterdir() if p.name in before)


@pytest.mark.parametrize("spoil, says", [
    (lambda f: f.drop(columns=["passed"]), "lack the required column 'passed'"),
    (lambda f: f.assign(passed=f.passed.map({True: "True", False: "False"})), "column 'passed' holds 'True'"),
    (lambda f: f.assign(passed=1), "column 'passed' holds 1"),
])
def test_a_run_whose_verdict_column_is_missing_or_mistyped_exits_2(capsys, tmp_path, spoil, says):
    import pandas as pd

    done = _finished_run(capsys, tmp_path / "done")
    spoil(pd.read_parquet(done / "rows.parquet")).to_parquet(done / "rows.parquet")
    code, text = run(capsys, "report", done)
    assert code == 2 and says in text and len(text.strip().splitlines()) == 1


def _case(**changes) -> dict:
    body = {"format": "mla-verify-case/1", "case": Case("quantize_fp8_ds_mla", CASES["quantize_fp8_ds_mla"], 1).to_dict()}
    return {**body, **changes}


@pytest.mark.parametrize("make, says", [
    (lambda p: p.write_text("[" * 100000 + "]" * 100000), "nested too deeply"),
    (lambda p: p.write_text(json.dumps(_case(failure=[{"tensor": "rows", "metric": "m", "value": 1, "bound": "0"}]))),
     "its 'failure' is not a list of saved rows"),
    (lambda p: p.write_text(json.dumps(_case(case={"op": "property:determinism", "seed": 1, "params": {"target": ["x"]}}))),
     "target ['x'] is not one of"),
    (lambda p: p.write_text(json.dumps(_case(flaky="yes"))), "its 'flaky' is not"),
    (lambda p: p.symlink_to("/dev/zero"), "is a device, not a regular file"),
    (lambda p: os.mkfifo(p), "is a FIFO, not a regular file"),
    (lambda p: p.write_bytes(b" " * (2**20 + 1)), "over the 1048576"),
])
def test_a_hostile_case_file_exits_2_in_one_line_without_reading_it_whole(capsys, tmp_path, make, says):
    make(tmp_path / "c.json")
    code, text = run(capsys, "replay", tmp_path / "c.json", "--device", "cpu")
    assert code == 2 and says in text and len(text.strip().splitlines()) == 1, text


@pytest.mark.parametrize("make, says", [
    (lambda d: (d / "meta.json").write_text("[1, 2]"), "a JSON list, not an object"),
    (lambda d: ((d / "meta.json").unlink(), (d / "meta.json").symlink_to("/dev/zero")), "is a device"),
    (lambda d: ((d / "rows.parquet").unlink(), os.mkfifo(d / "rows.parquet")), "is a FIFO"),
    (lambda d: (d / "meta.json").write_text("[" * 100000 + "]" * 100000), "nested too deeply"),
])
def test_a_hostile_run_directory_exits_2_in_one_line(capsys, tmp_path, make, says):
    done = _finished_run(capsys, tmp_path / "done")
    make(done)
    code, text = run(capsys, "report", done)
    assert code == 2 and says in text and len(text.strip().splitlines()) == 1, text
