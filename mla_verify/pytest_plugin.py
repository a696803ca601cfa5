"""The pytest plugin (installed with the package, entry point `pytest11`): options that set the
defaults of `mla_verify.check` / `assert_equivalent` / `property_check` (and `replay`'s device)
for one pytest run, so a CI can raise the budget or move to the GPU without editing tests:

    pytest --mla-verify-profile nightly --mla-verify-examples 500 --mla-verify-device cuda --mla-verify-seed 7

An argument a test passes explicitly still wins. A device the option names that is not there
skips the tests that would run on it, with the reason.

Defaults a team keeps (as Hypothesis keeps `.hypothesis/` and derandomizes under CI):

* under `CI=true`, a check that names no seed (and no baseline, whose seed it re-draws) takes one
  derived from the commit being tested (`commit_seed`: the first 7 hex digits of GITHUB_SHA, or
  another CI's commit variable, or `git rev-parse HEAD`), printed in the session's header, so a CI
  run draws the same cases until the code changes; elsewhere a fresh seed each call, printed;
* failing cases a call saves outside a run directory go under `--mla-verify-failures DIR`, by
  default ROOTDIR/.mla-verify/failures (KEPT: beside .pytest_cache, which pytest's temporary
  directories are not: it deletes all but the last three sessions'); the session's summary lists
  those of the tests that failed, each with its replay command, and counts the ones saved by tests
  that passed (a test that expects a kernel to fail saves its case too: not a failure of the suite);
* fixtures (`mla_verify.pytest_fixtures`): `mla_corpus`, the kept corpus (`--mla-verify-corpus
  DIR`, default ROOTDIR/.mla-verify/corpus), and `mla_check`, `assert_equivalent` with that corpus
  and a run directory under the test's tmp_path.

The plugin imports nothing heavy: it is loaded by every pytest run in an environment where
mla-verify is installed.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

# Read by mla_verify.api for every argument left as None; empty outside a pytest run with the options.
DEFAULTS: dict[str, Any] = {}

_OPTIONS = {
    "profile": "fuzz profile for calls that name none: ci | dev | nightly | gpu",
    "examples": "cases per check for calls that pass no examples= (default: the profile's budget)",
    "device": "device for calls that pass no device=: cpu, cuda or cuda:N (default: cuda when present); "
              "one that is not there skips their tests",
    "seed": "campaign seed for calls that pass no seed= (default: under CI=true one derived from the "
            "commit, printed in the header; else a fresh one each call, printed)",
    "failures": "directory where calls without out= save failing cases (default: ROOTDIR/.mla-verify/failures, "
                "kept across sessions); the summary lists each saved case",
    "corpus": "kept corpus for calls that pass no corpus=, and the mla_corpus fixture's: every finding added, "
              "its cases replayed first (the fixtures' default: ROOTDIR/.mla-verify/corpus)",
}
METAVARS = {"profile": "NAME", "examples": "N", "device": "DEVICE", "seed": "S", "failures": "DIR", "corpus": "DIR"}
SAVED: list[tuple[str, str, str]] = []  # (test node id, case file, replay command) of each case saved this session
FAILED: set[str] = set()  # the node ids of the tests that failed this session
KEPT = ".mla-verify"  # under pytest's rootdir: what a team keeps between sessions (failures/, corpus/)
# Where a CI names the commit it tests: GitHub Actions, GitLab, Buildkite, CircleCI, Jenkins, Travis.
COMMIT_ENV = ("GITHUB_SHA", "CI_COMMIT_SHA", "BUILDKITE_COMMIT", "CIRCLE_SHA1", "GIT_COMMIT", "TRAVIS_COMMIT")


def pytest_addoption(parser) -> None:
    group = parser.getgroup("mla-verify", "mla-verify defaults (explicit arguments in a test win)")
    for name, help_text in _OPTIONS.items():
        group.addoption(f"--mla-verify-{name}", dest=f"mla_verify_{name}", default=None,
                        type=int if name in ("examples", "seed") else str, help=help_text, metavar=METAVARS[name])


def pytest_configure(config) -> None:
    import pytest

    from mla_verify.equivalence.cases.profiles import PROFILES  # a table of numbers: no torch

    chosen = {name: config.getoption(f"mla_verify_{name}") for name in _OPTIONS}
    if chosen["examples"] is not None and chosen["examples"] <= 0:
        raise pytest.UsageError(f"--mla-verify-examples must be a positive integer, got {chosen['examples']}")
    if chosen["profile"] is not None and chosen["profile"] not in PROFILES:
        raise pytest.UsageError(f"--mla-verify-profile {chosen['profile']!r}: unknown; known: {', '.join(PROFILES)}")
    DEFAULTS.clear()
    DEFAULTS.update({name: value for name, value in chosen.items() if value is not None})
    if "seed" not in DEFAULTS and (derived := commit_seed(config.rootpath)) is not None:
        DEFAULTS["commit_seed"], DEFAULTS["commit"] = derived
    # Loaded by name, as `-p NAME` loads a plugin: the fixtures import pytest and mla_verify.api, which
    # imports this module (for DEFAULTS) outside pytest too.
    config.pluginmanager.import_plugin("mla_verify.pytest_fixtures")


def commit_seed(root: Path) -> tuple[int, str] | None:
    """Under CI=true: (seed, commit), the seed being the commit's first 7 hex digits read as a number
    (`--mla-verify-seed` that number reproduces the session's draws); None elsewhere, or where no
    commit is named (COMMIT_ENV) and `git rev-parse HEAD` in `root` gives none."""
    if os.environ.get("CI", "").lower() not in ("true", "1", "yes"):
        return None
    commit = next((os.environ[name] for name in COMMIT_ENV if os.environ.get(name)), "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                    timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
    return (int(commit[:7], 16), commit[:12]) if re.fullmatch(r"[0-9a-fA-F]{7,64}", commit) else None


def kept(root: Path, name: str) -> Path:
    """ROOTDIR/.mla-verify/NAME, made with a .gitignore of everything (as .pytest_cache has): a
    repository keeps the directory only where it chooses to (`git add -f`)."""
    base = Path(root) / KEPT
    (base / name).mkdir(parents=True, exist_ok=True)
    if not (base / ".gitignore").exists():
        (base / ".gitignore").write_text("# made by mla-verify's pytest plugin\n*\n")
    return base / name


def pytest_sessionstart(session) -> None:
    SAVED.clear()
    FAILED.clear()
    if "failures" in DEFAULTS:  # --mla-verify-failures, relative to where pytest started
        DEFAULTS["failures"] = Path(DEFAULTS["failures"]).absolute()
    else:  # kept across sessions: pytest's own temporary directories go after three
        DEFAULTS["failures"] = kept(session.config.rootpath, "failures")


def saved(failures) -> None:
    """Note the case files a call saved (`results.Failure`s), for the session's summary (in a
    pytest session only)."""
    if "failures" in DEFAULTS:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]  # "NODEID (call)" while a test runs
        SAVED.extend((test, str(f.case_file), f.replay_command) for f in failures if f.case_file is not None)


def pytest_runtest_logreport(report) -> None:
    if report.failed:  # setup, call or teardown; an expected failure (xfail) is not failed
        FAILED.add(report.nodeid)


def pytest_terminal_summary(terminalreporter) -> None:
    failing = [(case_file, command) for test, case_file, command in SAVED if test in FAILED or not test]
    if failing:
        terminalreporter.section("mla-verify: cases saved by failing tests")
        for case_file, command in failing:
            terminalreporter.write_line(f"{case_file}\n  replay: {command}")
    if passed := len(SAVED) - len(failing):
        terminalreporter.write_line(f"mla-verify: {passed} more case{'s' * (passed != 1)} saved by tests that passed "
                                    "(a test expecting a kernel to fail saves its case too): not listed")


def pytest_unconfigure(config) -> None:
    DEFAULTS.clear()


def pytest_report_header(config) -> str | None:
    chosen = [f"{name} {value}" for name, value in DEFAULTS.items()
              if name in _OPTIONS and config.getoption(f"mla_verify_{name}")]  # not the session's default folder
    if "commit_seed" in DEFAULTS:
        chosen.append(f"seed {DEFAULTS['commit_seed']} (CI=true: from commit {DEFAULTS['commit']}, its first 7 hex "
                      "digits; checks naming no seed draw it, --mla-verify-seed N draws another)")
    return "mla-verify defaults: " + ", ".join(chosen) if chosen else None


def default_device(device: str | None) -> str | None:
    """`device`, or the --mla-verify-device one; that one not there skips the test calling."""
    if device is not None or "device" not in DEFAULTS:
        return device
    chosen = DEFAULTS["device"]
    if chosen.startswith("cuda"):
        import pytest
        import torch

        # A suite asked to check on a GPU, on a machine without one, skips with the reason printed
        # (docs/fuzz.md, "In pytest": a CPU CI runs the same suite); it never passes on another device.
        if not torch.cuda.is_available():
            pytest.skip(f"--mla-verify-device {chosen}: no CUDA GPU is visible")
    return chosen
