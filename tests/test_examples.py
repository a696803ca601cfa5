"""examples/ as a kernel developer uses it (README "Verify your kernel in 5 minutes"), copied to a
directory outside this checkout: its pytest file passes, and the walkthrough's steps hold: fuzz
catches the draft kernel with a minimized case and a replay command, which reproduces the failure
as printed and passes on the fixed kernel."""

import importlib.util
import shlex
from pathlib import Path

import pytest


def _script(name: str):
    """scripts/NAME.py as a module (scripts/ is no package)."""
    path = Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def walkthrough():
    """The README walkthrough's commands, run once as scripts/walkthrough.py runs them (in a fresh
    directory outside this checkout with examples/*.py copied in): the script and its runs."""
    script = _script("walkthrough")
    return script, script.runs()


def test_the_walkthrough_catches_the_draft_and_its_replay_command_reproduces_it(walkthrough):
    script, ran = walkthrough
    [(code, _, out)] = ran["fuzz"]
    assert code == 1, out[-3000:]
    assert "DISCREPANCY in sparse_prefill" in out and "minimized case: sparse_prefill(" in out
    command = next(line.split("replay: ", 1)[1] for line in out.splitlines() if "  replay: " in line)
    argv = shlex.split(command)
    assert argv[:2] == ["mla-verify", "replay"] and "my_kernel:sparse_prefill_v0" in argv
    (again, shown, again_out), (passes, fixed_shown, passes_out), _ = ran["replay"]
    shows = script.RUN_DIR.sub("runs/fuzz-...", command)  # as the README shows it
    assert shown == f"$ {shows}\n"   # the very command the fuzz printed, run as printed
    assert again == 1 and "reproduced: same failing tensors and metrics" in again_out, again_out
    assert fixed_shown == f"$ {shows.replace('my_kernel:sparse_prefill_v0', 'my_kernel:sparse_prefill')}\n"
    assert passes == 0 and "did NOT reproduce" in passes_out, passes_out


def test_the_example_test_file_passes_outside_the_repo(walkthrough):
    _, ran = walkthrough
    [(code, shown, out)] = ran["pytest"]
    assert shown == "$ pytest --mla-verify-profile ci\n"   # on CPU: the walkthrough hides any GPU
    assert code == 0 and "2 passed" in out, out[-3000:]


def test_the_readme_walkthrough_shows_what_its_commands_print(walkthrough):
    """README's walkthrough blocks are a real run's output (scripts/walkthrough.py); issue 29 found
    the minimized case, its id, the headroom lines and the replay metrics drifted from them."""
    script, ran = walkthrough
    assert script.stale(script.README.read_text(), script.blocks(ran)) is None
