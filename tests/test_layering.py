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


def _functions_and_calls():
    """(lines, where) of every function, and (keywords, where) of every call, in mla_verify/ and fuzz/."""
    import ast

    functions, calls = [], []
    for folder in ("mla_verify", "fuzz"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            where = path.relative_to(ROOT)
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    functions.append((node.end_lineno - node.lineno + 1, f"{where}:{node.name}"))
                # dict(...) spells data (a pinned case's kernel arguments), not a call's signature
                elif isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id == "dict"):
                    calls.append((sum(1 for k in node.keywords if k.arg), f"{where}:{node.lineno}"))
    return functions, calls


def test_the_run_wing_keeps_functions_short_and_calls_small():
    """Issue 36: at most 2 functions over 80 lines (they were 6: build_parser 204, fuzz 161, check
    139, run_units 97, bench_guards 89, gate 85) and no call of 15 keywords or more (fuzz() took
    22 parameters, run_units() 17, and calls passed 15-18 keywords)."""
    functions, calls = _functions_and_calls()
    long = sorted(f for f in functions if f[0] > 80)
    assert len(long) <= 2, long
    wide = [c for c in calls if c[0] >= 15]
    assert not wide, wide


def test_the_run_is_one_wing():
    """Issue 36: the run lives in mla_verify/runs/, fuzz/ keeps the Hypothesis search only."""
    assert not (ROOT / "fuzz" / "gate.py").exists() and not (ROOT / "fuzz" / "shard.py").exists()
    for name in ("run", "parallel", "rundir", "merge", "results", "interrupt", "bench", "guard_bench"):
        assert not (ROOT / "mla_verify" / f"{name}.py").exists(), name
    assert {p.stem for p in (ROOT / "mla_verify" / "runs").glob("*.py")} >= {
        "plan", "units", "driver", "sink", "parts", "rundir", "merge", "interrupt", "outcome"}


def test_equivalence_is_four_wings_and_the_specs_face():
    """Issue 49: equivalence/ was 43 flat modules; its top level keeps the specs' face and the
    leaves (at most 15 modules), the rest lives in its wings."""
    top = sorted(p.stem for p in (ROOT / "equivalence").glob("*.py") if p.stem != "__init__")
    assert len(top) <= 15, top
    for wing in ("cases", "coverage", "judge", "sandbox", "ops", "properties"):
        assert (ROOT / "equivalence" / wing / "__init__.py").is_file(), wing
    assert not (ROOT / "equivalence" / "contract.py").exists()  # contract.py beside contracts.py ended


def test_the_wings_rules_catch_a_crossing():
    """A wing that imports a room its row does not list is a breach: the sandbox reaching a spec's
    module beyond the pending three, the cases reaching the judge."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import import_cycles
    finally:
        sys.path.pop(0)
    e = "mla_verify.equivalence"
    known = {f"{e}.sandbox.wire": (None, "equivalence/sandbox"), f"{e}.catalog": (None, "equivalence"),
             f"{e}.cases.draws": (None, "equivalence/cases"), f"{e}.judge.policy": (None, "equivalence/judge"),
             f"{e}.sandbox.worker": (None, "equivalence/sandbox")}
    graph = {f"{e}.sandbox.wire": {f"{e}.catalog"}, f"{e}.cases.draws": {f"{e}.judge.policy"},
             f"{e}.judge.policy": set(), f"{e}.catalog": set(), f"{e}.sandbox.worker": {f"{e}.catalog"}}
    breaches = import_cycles.layering(graph, known)
    assert [b.split(" imports ")[0] for b in breaches] == [f"{e}.cases.draws", f"{e}.sandbox.wire"], breaches
