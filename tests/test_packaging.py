"""The project installs under one namespace: the design's folders are `mla_verify.reference`,
`mla_verify.optimized`, ... and never claim generic top-level names in a user's environment (a
user's own `reports/` package once broke `mla-verify fuzz`)."""

import os
import subprocess
import sys

import pytest

FOLDERS = ("reference", "optimized", "equivalence", "fuzz", "reports")


def _import(name: str, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", f"import {name}"], cwd=cwd, env=env, capture_output=True, text=True)


@pytest.mark.parametrize("folder", FOLDERS)
def test_folders_import_only_under_the_namespace(folder, tmp_path):
    assert _import(f"mla_verify.{folder}", tmp_path).returncode == 0
    plain = _import(folder, tmp_path)
    assert plain.returncode != 0 and "ModuleNotFoundError" in plain.stderr


def test_a_users_own_packages_do_not_shadow_ours(tmp_path):
    for folder in FOLDERS:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("raise ImportError('the user package was imported')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-m", "mla_verify.cli", "report", str(tmp_path / "no-run")],
                          cwd=tmp_path, env=env, capture_output=True, text=True)
    assert "the user package was imported" not in done.stderr, done.stderr


def test_every_folder_of_a_package_is_a_listed_package():
    """setuptools warns "Package 'mla_verify.fuzz.corpus' is absent from the packages configuration"
    on install for any importable folder (a directory under a package) the list leaves out (issue 29)."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages, dirs = set(config["packages"]), config["package-dir"]
    for top, folder in dirs.items():
        for sub in (root / folder).rglob("*"):
            if sub.is_dir() and sub.name != "__pycache__" and any(sub.iterdir()):
                name = ".".join([top, *sub.relative_to(root / folder).parts])
                assert name in packages, f"{sub} installs as {name}, which pyproject.toml's packages leaves out"
