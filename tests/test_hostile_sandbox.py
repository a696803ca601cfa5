"""The judge runs none of the kernel's code, and the worker sits behind an OS boundary (issue 45):
each kernel of tests/hostile/sandbox.py reaching outside its worker, and of in_the_worker.py
declaring its bounds where only the worker sees it, gets its outcome isolated; a user's module is
imported by the worker only; whatever the user's code does before its call is a one-line usage
error or the kernel's finding; the run records what its workers stood behind."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mla_verify.equivalence.cases.case import Case
from mla_verify.equivalence.judge import oracle
from mla_verify.equivalence.sandbox import worker as worker_module
from mla_verify.equivalence.blocks import Judging
from tests.isolated import judged
from mla_verify.equivalence.errors import UsageError
from tests.hostile import SANDBOX
from tests.test_hostile import CASES, REPO, run

QUANTIZE = Case("quantize_fp8_ds_mla", CASES["quantize_fp8_ds_mla"], 3)
LINUX = sys.platform.startswith("linux")


def _traced(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith("TracerPid:")))


@pytest.fixture(scope="module")
def worker():
    w = Judging("cpu", isolate=True, timeout=10.0)
    w.start()
    yield w
    w.close()


@pytest.mark.skipif(not LINUX, reason="the sandbox's layers are Linux's")
@pytest.mark.parametrize("h", SANDBOX, ids=[h.impl.split(":")[1] for h in SANDBOX])
def test_each_kernel_that_reaches_outside_its_worker_fails_its_case_and_the_judge_is_untouched(worker, h):
    if worker.worker.fence.missing and "in_the_worker" not in h.impl:
        pytest.skip(f"this host does not offer every layer: {worker.summary()}")
    rows = judged(worker, QUANTIZE, [h.impl], h.impl)
    failing = [(r.gate_metric, r.reason) for r in rows if not r.passed]
    assert any(metric == h.metric and h.says in reason for metric, reason in failing), failing
    assert _traced(os.getpid()) == 0
    assert not [p for p in os.listdir(REPO / "mla_verify") if p.startswith(".planted")]


def test_a_run_records_what_its_workers_stood_behind_and_its_pass_line_says_it(capsys, tmp_path):
    impl = "tests.hostile.in_the_worker:declares_in_its_source"
    code, text = run(capsys, "fuzz", "--op", "quantize_fp8_ds_mla", "--impl", impl, "--examples", 2, "--seed", 1,
                     "--device", "cpu", "--profile", "ci", "--out", tmp_path / "run")
    extra = json.loads((tmp_path / "run" / "meta.json").read_text())["extra"]
    assert code == 0 and extra["resolved"] == {impl: {"op": "quantize_fp8_ds_mla", "deviations": ["bf16_dequant"]}}
    fence = extra["sandbox"]
    assert fence["mode"] == "auto" and set(fence["held"]) | set(fence["missing"]) == {
        "session", "user namespace", "pid namespace", "no_new_privs", "landlock", "seccomp"}
    pass_line = next(line for line in text.splitlines() if line.startswith("PASS"))
    assert pass_line.endswith("; sandbox auto: " + ", ".join(fence["held"])
                              + ("; missing: " + ", ".join(f"{k} ({v})" for k, v in fence["missing"].items())
                                 if fence["missing"] else "")), pass_line


@pytest.fixture
def judge_kept():
    """The judge's oracle and modules as they were: a failure before the fix must not leak the patch."""
    verdict, before = oracle.verdict, set(sys.modules)
    yield
    oracle.verdict = verdict
    for name in set(sys.modules) - before:
        if name.startswith("tests.hostile."):
            del sys.modules[name]


def test_fuzz_impl_never_runs_a_modules_import_time_code_in_the_judge(capsys, tmp_path, judge_kept):
    """Item 1: a module whose import patches the row judge turned every failing case into a pass
    where the judge imported it to check its signature (fails before the fix: PASS, exit 0)."""
    module = "tests.hostile.patches_at_import"
    verdict = oracle.verdict
    code, text = run(capsys, "fuzz", "--op", "quantize_fp8_ds_mla", "--impl", f"{module}:quantize", "--examples", 3,
                     "--seed", 1, "--device", "cpu", "--profile", "ci", "--no-shrink", "--out", tmp_path / "run")
    assert module not in sys.modules and oracle.verdict is verdict
    assert code == 1 and "DISCREPANCY" in text and "PASS" not in text, text


def test_check_never_imports_a_named_implementation_in_the_judge(judge_kept):
    from mla_verify import check

    result = check("quantize_fp8_ds_mla", "tests.hostile.patches_at_import:quantize", examples=2, seed=1,
                   device="cpu", profile="ci", shrink=False)
    assert "tests.hostile.patches_at_import" not in sys.modules and not result.passed


@pytest.mark.parametrize("impl, says", [
    ("tests.hostile.raises_in_the_worker:quantize",
     "cannot import 'tests.hostile.raises_in_the_worker': RuntimeError: this module refuses to be imported in a worker"),
    ("tests.hostile.in_the_worker:signature_raises", "reading its signature raised RuntimeError"),
    ("tests.hostile.in_the_worker:deviations_raise", "reading its __mla_verify_deviations__ raised RuntimeError"),
    ("tests.hostile.in_the_worker:no_such_callable", "has no attribute 'no_such_callable'"),
    ("tests.hostile.no_such_module:quantize", "cannot import 'tests.hostile.no_such_module'"),
])
def test_the_users_code_before_the_call_is_a_usage_error_in_one_line_never_exit_3(capsys, tmp_path, impl, says):
    """Item 6: today's `harness error ... an mla-verify bug`, exit 3, for what the user's module does."""
    code, text = run(capsys, "fuzz", "--op", "quantize_fp8_ds_mla", "--impl", impl, "--examples", 2, "--device", "cpu",
                     "--profile", "ci", "--out", tmp_path / "run")
    assert code == 2 and len(text.strip().splitlines()) == 1 and says in text, text


def test_an_import_that_never_ends_is_a_usage_error_once_it_had_its_time(monkeypatch):
    monkeypatch.setattr(worker_module, "RESOLVE_FLOOR_S", 0.5)
    w = Judging("cpu", isolate=True, timeout=1.0)
    try:
        w.start()
        start = time.monotonic()
        with pytest.raises(UsageError, match="did not finish within 1 s"):
            w.resolve(QUANTIZE.op, ["tests.hostile.hangs_at_import:quantize"])
        assert time.monotonic() - start < 10
    finally:
        w.close()


@pytest.mark.skipif(not LINUX, reason="the sandbox's layers are Linux's")
def test_a_kernel_that_kills_its_judge_only_fails_its_case(tmp_path):
    """Item 4 on CPU (the GPU lane runs it on CUDA, where the worker is the judge's own child): a
    kernel that sends SIGKILL to its parent and to the judge. Behind the sandbox both are refused:
    its wrong answer is the run's finding, saved, and the judge ends as it would."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    argv = ["fuzz", "--op", "quantize_fp8_ds_mla", "--impl", "tests.hostile.sandbox:kills_its_judge", "--examples", 2,
            "--seed", 1, "--device", "cpu", "--profile", "ci", "--no-shrink", "--out", tmp_path / "run"]
    done = subprocess.run([sys.executable, "-m", "mla_verify.cli", *map(str, argv)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    text = done.stdout + done.stderr
    assert done.returncode == 1 and "DISCREPANCY" in text and done.returncode != -signal.SIGKILL, text
    assert list((tmp_path / "run" / "failures").glob("*.json"))


def test_strict_runs_where_every_layer_holds_and_off_says_so(capsys, tmp_path):
    w = Judging("cpu", isolate=True, timeout=10.0, sandbox="strict")
    try:
        fence = w.start()
        assert not fence.missing  # else start() raised UsageError, naming what is missing
    except UsageError as exc:
        assert str(exc).startswith("--sandbox strict: ")
    finally:
        w.close()
    code, text = run(capsys, "fuzz", "--op", "quantize_fp8_ds_mla", "--impl", "torch-fp32", "--examples", 1,
                     "--device", "cpu", "--profile", "ci", "--sandbox", "off", "--out", tmp_path / "run")
    assert code == 0 and "; sandbox off" in text


def test_a_run_whose_every_case_was_declined_is_no_verdict_never_a_pass(capsys, tmp_path):
    """Item 5: it was `PASS: 10 examples, no discrepancy`, exit 0."""
    code, text = run(capsys, "fuzz", "--op", "quantize_fp8_ds_mla", "--impl", "tests.hostile.cpu:declines_every_case",
                     "--examples", 4, "--seed", 1, "--device", "cpu", "--profile", "ci", "--out", tmp_path / "run")
    assert code == 4 and "PASS" not in text, text
    assert any(line.startswith("NO VERDICT: quantize_fp8_ds_mla") and "every one of its" in line
               for line in text.splitlines()), text


def test_a_decline_that_depends_on_the_values_fails_where_the_same_params_were_answered(capsys, tmp_path):
    """Item 5: a kernel that declines the cases it would get wrong (here: a positive first value)
    is asked again under another seed; answered there, its decline here is its case's failure."""
    code, text = run(capsys, "fuzz", "--op", "quantize_fp8_ds_mla", "--impl", "tests.hostile.cpu:declines_by_value",
                     "--examples", 8, "--seed", 1, "--device", "cpu", "--profile", "ci", "--no-shrink",
                     "--out", tmp_path / "run")
    assert code == 1 and "a decline must depend on the params, not the values" in text, text


def test_report_expect_holds_a_run_to_the_record_digest_it_printed(capsys, tmp_path):
    """Item 7: a process that outlived the judge rewrote the rows as passed, deleted failures/ and
    recomputed meta.json's digests: `report` said PASS. The digest the run printed, kept by a CI,
    is not recomputed with them."""
    import pandas as pd

    from mla_verify.runs import record

    done = tmp_path / "run"
    code, text = run(capsys, "fuzz", "--op", "quantize_fp8_ds_mla", "--impl", "tests.hostile.cpu:system_exit",
                     "--examples", 2, "--seed", 1, "--device", "cpu", "--profile", "ci", "--no-shrink", "--out", done)
    digest = next(line for line in text.splitlines() if line.startswith("record sha256:")).split()[1]
    assert code == 1 and run(capsys, "report", done, "--expect", digest)[0] == 1  # its discrepancy, not TAMPERED
    pd.read_parquet(done / "rows.parquet").assign(passed=True).to_parquet(done / "rows.parquet")
    for f in (done / "failures").glob("*.json"):
        f.unlink()
    (done / "rows.csv").unlink()
    record.seal(done, len(pd.read_parquet(done / "rows.parquet")))  # the survivor's recomputed record
    code, text = run(capsys, "report", done)
    assert code == 0 and "TAMPERED" not in text  # what the unkeyed digests cannot tell
    code, text = run(capsys, "report", done, "--expect", digest)
    assert code == 1 and "TAMPERED" in text and f"not the {digest} expected" in text, text


def test_a_case_that_cannot_be_saved_is_printed_whole_and_the_run_still_fails(capsys, tmp_path, monkeypatch):
    """Item 7: DIR/failures made a regular file (the run directory now makes it at its start; a
    disk that is full does the same): exit 3, the finding lost. Now the case is on stderr, whole."""
    from mla_verify.fuzz import casefile

    def refused(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(casefile, "save_new", refused)
    code, text = run(capsys, "fuzz", "--op", "quantize_fp8_ds_mla", "--impl", "tests.hostile.cpu:system_exit",
                     "--examples", 2, "--seed", 1, "--device", "cpu", "--profile", "ci", "--no-shrink",
                     "--out", tmp_path / "run")
    assert code == 1 and "could not be saved" in text and "No space left on device" in text, text
    whole = text[text.index("here it is whole"):].split("\n", 1)[1]
    assert json.loads(whole[:whole.index("\n}\n") + 2])["case"]["op"] == "quantize_fp8_ds_mla"


@pytest.mark.skipif(not LINUX, reason="the sandbox's layers are Linux's")
def test_a_process_that_outlives_the_judge_cannot_rewrite_the_run(capsys, tmp_path):
    """Item 7: the survivor left the worker's tree and its mark, waited for the judge to exit and
    rewrote the run. Behind a PID namespace it dies with its worker; where there is none, the
    rest of the sandbox (inherited across its exec) refuses its writes."""
    done = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    argv = ["fuzz", "--op", "quantize_fp8_ds_mla", "--impl", "tests.hostile.sandbox:survives_the_judge",
            "--examples", 1, "--seed", 1, "--device", "cpu", "--profile", "ci", "--no-shrink", "--out", done]
    finished = subprocess.run([sys.executable, "-m", "mla_verify.cli", *map(str, argv)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=300)  # until the survivor lets go of stdout
    text = finished.stdout + finished.stderr
    said = next((line for line in text.splitlines() if line.startswith("survivor: ")), "")
    assert finished.returncode == 1 and "done" not in said and (not said or said.count("refused") == 2), text
    code, text = run(capsys, "report", done)
    assert code == 1 and "TAMPERED" not in text and list((done / "failures").glob("*.json"))
