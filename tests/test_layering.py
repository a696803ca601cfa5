"""The modules' import graph has no cycle and keeps the folders' layering (scripts/import_cycles.py:
the reference shares nothing with the optimized side, nothing below the CLI reaches up into it)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_import_cycle_and_one_way_layers():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "import_cycles.py")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_checker_finds_a_cycle(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import import_cycles
    finally:
        sys.path.pop(0)
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles.cycles(graph) == [["a", "b", "c"]]
    assert import_cycles.cycles({"a": {"b"}, "b": set()}) == []
