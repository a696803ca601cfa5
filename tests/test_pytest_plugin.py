"""The pytest plugin, as a kernel repository meets it: a pytest run in a directory outside this
checkout, the plugin found through its `pytest11` entry point, its options filling the arguments
a test leaves unset (explicit ones win)."""

import os
import subprocess
import sys

from mla_verify.equivalence.profiles import get_profile

USER_TESTS = '''
import mla_verify


def test_unset_arguments_take_the_command_lines():
    result = mla_verify.check("concat_mla_q", "torch-fp32", seed=1)
    print("examples", result.examples, "device", result.rows.device.iloc[0])


def test_explicit_arguments_win():
    result = mla_verify.check("concat_mla_q", "torch-fp32", seed=1, examples=2, device="cpu")
    assert result.examples == 2
'''


def pytest_in(tmp_path, *options: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_kernels.py").write_text(USER_TESTS)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-m", "pytest", "-s", "-p", "no:cacheprovider", *options],
                          cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)


def test_the_options_set_the_defaults_of_check(tmp_path):
    done = pytest_in(tmp_path, "--mla-verify-examples", "3", "--mla-verify-device", "cpu", "--mla-verify-profile", "ci")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "examples 3 device cpu" in done.stdout and "2 passed" in done.stdout
    assert "mla-verify defaults: profile ci, examples 3, device cpu" in done.stdout  # the report header


def test_the_profile_option_sets_the_budget(tmp_path):
    done = pytest_in(tmp_path, "--mla-verify-profile", "ci", "--mla-verify-device", "cpu", "-k", "unset")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert f"examples {get_profile('ci').examples} device cpu" in done.stdout


def test_bad_option_values_stop_pytest_before_any_test(tmp_path):
    for option, value, message in (("--mla-verify-examples", "0", "must be a positive integer"),
                                   ("--mla-verify-profile", "huge", "unknown; known: ci")):
        done = pytest_in(tmp_path, option, value)
        assert done.returncode == 4 and message in done.stderr, done.stdout[-2000:] + done.stderr[-2000:]
