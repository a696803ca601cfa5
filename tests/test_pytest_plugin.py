"""The pytest plugin, as a kernel repository meets it: a pytest run in a directory outside this
checkout, the plugin found through its `pytest11` entry point, its options filling the arguments
a test leaves unset (explicit ones win)."""

import os
import subprocess
import sys

from mla_verify.equivalence.cases.profiles import get_profile

USER_TESTS = '''
import mla_verify


def test_unset_arguments_take_the_command_lines():
    result = mla_verify.check("concat_mla_q", "torch-fp32", seed=1)
    print("examples", result.examples, "device", result.rows.device.iloc[0])


def test_explicit_arguments_win():
    result = mla_verify.check("concat_mla_q", "torch-fp32", seed=1, examples=5, device="cpu")
    assert result.examples == 5  # past its 3 covering cases: the draws fill the rest
'''


def pytest_in(tmp_path, *options: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_kernels.py").write_text(USER_TESTS)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", "pytest", "-s", "-p", "no:cacheprovider", *options],
                          cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)


def test_the_options_set_the_defaults_of_check(tmp_path):
    done = pytest_in(tmp_path, "--mla-verify-examples", "7", "--mla-verify-device", "cpu", "--mla-verify-profile", "ci")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "examples 7 device cpu" in done.stdout and "2 passed" in done.stdout
    assert "mla-verify defaults: profile ci, examples 7, device cpu" in done.stdout  # the report header


def test_the_profile_option_sets_the_budget(tmp_path):
    done = pytest_in(tmp_path, "--mla-verify-profile", "ci", "--mla-verify-device", "cpu", "-k", "unset")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert f"examples {get_profile('ci').examples} device cpu" in done.stdout


def test_bad_option_values_stop_pytest_before_any_test(tmp_path):
    for option, value, message in (("--mla-verify-examples", "0", "must be a positive integer"),
                                   ("--mla-verify-profile", "huge", "unknown; known: ci")):
        done = pytest_in(tmp_path, option, value)
        assert done.returncode == 4 and message in done.stderr, done.stdout[-2000:] + done.stderr[-2000:]


NEWCOMER_TESTS = '''
import pytest
import torch

import mla_verify


def wrong_concat(ql_nope, q_pe):
    return torch.cat([ql_nope, q_pe * 2], dim=-1)


def declining_concat(ql_nope, q_pe):
    if ql_nope.shape[1] > 1:
        mla_verify.unsupported("one head only, for now")
    return torch.cat([ql_nope, q_pe], dim=-1)


def test_seed(tmp_path):
    assert mla_verify.check("concat_mla_q", "torch-fp32", examples=2, device="cpu").seed == 7


def test_failing_case_saved_under_this_sessions_basetemp():
    result = mla_verify.check("concat_mla_q", wrong_concat, examples=3, device="cpu")
    print("saved", result.failure.case_file)


def test_traceback_ends_at_the_call():
    mla_verify.assert_equivalent("concat_mla_q", wrong_concat, examples=2, device="cpu", shrink=False)


def test_declined_cases_are_counted_not_failed():
    result = mla_verify.check("concat_mla_q", declining_concat, examples=8, device="cpu")
    assert result.passed and 0 < result.unsupported < 8, result.report()
    print(result.report())


def test_on_a_device_that_is_not_there():
    mla_verify.check("concat_mla_q", "torch-fp32", examples=1)
'''


def test_seed_saved_cases_tracebacks_declined_cases_and_a_missing_device(tmp_path):
    """Issue 29 item 6, as a kernel repository's pytest run meets it."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_newcomer.py").write_text(NEWCOMER_TESTS)
    basetemp = tmp_path / "basetemp"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    device = [] if __import__("torch").cuda.is_available() else ["--mla-verify-device", "cuda"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-s", "-rs", "-p", "no:cacheprovider", "--basetemp", str(basetemp),
                           "--mla-verify-seed", "7", "--mla-verify-profile", "ci", *device, "tests"],
                          cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    out = done.stdout
    saved = next(line.split("saved ")[1] for line in out.splitlines() if ".saved " in line)
    assert saved.startswith(str(tmp_path / ".mla-verify" / "failures")), saved  # not under basetemp: kept
    # the summary lists the case of the test that failed, not the one a passing test saved (expected there)
    listed = out.split("mla-verify: cases saved by failing tests")[1]
    assert saved not in listed and listed.count("replay: mla-verify replay") == 1, listed
    assert "mla-verify: 1 more case saved by tests that passed" in listed
    failure = out.split("test_traceback_ends_at_the_call")[-1]
    assert "DISCREPANCY in concat_mla_q" in failure and "mla_verify/api.py" not in failure, failure[-3000:]
    assert "declined by the implementation (mla_verify.unsupported), not checked: one head only, for now" in out
    if device:
        assert "SKIPPED" in out and "--mla-verify-device cuda: no CUDA GPU is visible" in out, out[-3000:]
    assert "1 failed" in out and "passed" in out, out[-3000:]


TEAM_TESTS = '''
import torch

import mla_verify


def wrong_concat(ql_nope, q_pe):
    return torch.cat([ql_nope, q_pe * 2], dim=-1)


def test_a_check_naming_no_seed_draws_the_commits():
    print("seed", mla_verify.check("concat_mla_q", "torch-fp32", examples=1, device="cpu").seed)


def test_mla_check_fails_with_the_report_and_keeps_the_finding(mla_check, mla_corpus):
    print("corpus", mla_corpus)
    mla_check("concat_mla_q", wrong_concat, examples=2, device="cpu", shrink=False)
'''


def test_under_ci_the_seed_comes_from_the_commit_and_findings_are_kept_beside_pytest_cache(tmp_path):
    """Issue 50 item 5: a CI run draws the commit's cases (printed), its failing cases and corpus stay
    under ROOTDIR/.mla-verify (pytest deletes all but its last three basetemps), and the fixtures."""
    (tmp_path / "test_team.py").write_text(TEAM_TESTS)
    commit = "abcdef0123456789abcdef0123456789abcdef01"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CI_COMMIT_SHA", "BUILDKITE_COMMIT")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-s", "-p", "no:cacheprovider", "--basetemp",
                           str(tmp_path / "basetemp")], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**env, "OMP_NUM_THREADS": "1", "CI": "true", "GITHUB_SHA": commit})
    out = done.stdout
    seed = int(commit[:7], 16)
    assert f"mla-verify defaults: seed {seed} (CI=true: from commit {commit[:12]}" in out, out[-3000:]
    assert f"seed {seed}\n" in out
    assert "1 failed, 1 passed" in out and "DISCREPANCY in concat_mla_q" in out, out[-3000:]
    kept = tmp_path / ".mla-verify"
    assert (kept / ".gitignore").read_text().splitlines()[-1] == "*"
    assert f"corpus {kept / 'corpus'}" in out and len(list((kept / "corpus").glob("*.json"))) == 1
    listed = out.split("mla-verify: cases saved by failing tests")[1]
    assert str(kept / "failures") in listed and "replay: mla-verify replay" in listed
    # outside CI a fresh seed each call, and no seed in the header
    done = subprocess.run([sys.executable, "-m", "pytest", "-s", "-p", "no:cacheprovider", "-k", "commits"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**env, "OMP_NUM_THREADS": "1", "CI": "false", "GITHUB_SHA": commit})
    assert "mla-verify defaults" not in done.stdout and f"seed {seed}\n" not in done.stdout, done.stdout[-2000:]
