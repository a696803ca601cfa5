"""examples/ as a kernel developer uses it (README "Verify your kernel in 5 minutes"), copied to a
directory outside this checkout: its pytest file passes, and the walkthrough's steps hold: fuzz
catches the draft kernel with a minimized case and a replay command, which reproduces the failure
as printed and passes on the fixed kernel."""

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ENV = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "OMP_NUM_THREADS": "1"}


def in_copy(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    for name in ("my_kernel.py", "test_my_kernel.py"):
        shutil.copy(EXAMPLES / name, tmp_path / name)
    return subprocess.run(argv, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)


def mla_verify(*argv: str) -> list[str]:
    return [sys.executable, "-m", "mla_verify.cli", *argv]


def test_the_example_test_file_passes_outside_the_repo(tmp_path):
    done = in_copy(tmp_path, sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--mla-verify-profile", "ci",
                   "--mla-verify-device", "cpu")
    assert done.returncode == 0 and "2 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]


def test_the_walkthrough_catches_the_draft_and_its_replay_command_reproduces_it(tmp_path):
    done = in_copy(tmp_path, *mla_verify("fuzz", "--op", "sparse_prefill", "--impl", "my_kernel:sparse_prefill_v0",
                                         "--profile", "ci", "--examples", "20", "--seed", "1", "--device", "cpu",
                                         "--out", "run"))
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    assert "DISCREPANCY in sparse_prefill" in done.stdout and "minimized case: sparse_prefill(" in done.stdout
    command = next(line.split("replay: ", 1)[1] for line in done.stdout.splitlines() if "  replay: " in line)
    argv = shlex.split(command)
    assert argv[:2] == ["mla-verify", "replay"] and "my_kernel:sparse_prefill_v0" in argv
    again = subprocess.run(mla_verify(*argv[1:]), cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert again.returncode == 1 and "reproduced: same failing tensors and metrics" in again.stdout, again.stdout
    fixed = ["my_kernel:sparse_prefill" if a == "my_kernel:sparse_prefill_v0" else a for a in argv[1:]]
    passes = subprocess.run(mla_verify(*fixed), cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert passes.returncode == 0 and "did NOT reproduce" in passes.stdout, passes.stdout


def test_the_readme_walkthrough_shows_what_its_commands_print():
    """README's walkthrough blocks are a real run's output (scripts/walkthrough.py); issue 29 found
    the minimized case, its id, the headroom lines and the replay metrics drifted from them."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "walkthrough.py"
    done = subprocess.run([sys.executable, str(script), "--check"], env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
