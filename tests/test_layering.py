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
    module (the worker once prepared and judged through the catalog), the cases reaching the judge."""
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
    assert [b.split(" imports ")[0] for b in breaches] == [f"{e}.cases.draws", f"{e}.sandbox.wire",
                                                           f"{e}.sandbox.worker"], breaches


PACKAGE = ("mla_verify", "reference", "optimized", "equivalence", "fuzz", "reports")


def _definitions():
    """(lines, parameters, where) of every function of the package but Triton's kernels (a
    @triton.jit signature is the kernel's launch grid of pointers and constants)."""
    import ast

    found = []
    for folder in PACKAGE:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                if any("jit" in ast.unparse(d) for d in node.decorator_list):
                    continue
                a = node.args
                named = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls")]
                params = len(named) + (a.vararg is not None) + (a.kwarg is not None)
                found.append((node.end_lineno - node.lineno + 1, params, f"{path.relative_to(ROOT)}:{node.name}"))
    return found


def test_the_package_keeps_functions_short_and_signatures_narrow():
    """Issue 49: no function over 80 lines in the package (there were 5: the HiSparse pipelines
    and batch builder, the reference's forward_mqa, build_report) and at most 5 signatures of 10 or
    more parameters (there were 16: the forward_mqa family took vLLM's metadata one keyword each;
    it takes the backend's metadata dataclass now). The 5: check() and gate() (the public API, tied
    to Options by the test below), the whole forward_mqa and DCP rank contracts (a user's callable
    is called with those keywords) and ops/base.py's `_calls` (the row context, issue 49 step 3)."""
    found = _definitions()
    long = sorted((n, where) for n, _, where in found if n > 80)
    assert not long, long
    wide = sorted((p, where) for _, p, where in found if p >= 10)
    assert len(wide) <= 5, wide


def test_check_and_gate_name_only_options_fields():
    """`check()` and `gate()` hand their arguments to `Options.asked` by name, which keeps only the
    names Options has: a parameter misspelled or added without its field would be dropped silently.
    Every parameter is a field, but those translated on the way (op -> ops, impl -> specs and
    named, or impls; log is the run's callback, not an option)."""
    import dataclasses
    import inspect

    from mla_verify import api
    from mla_verify.runs.plan import Options

    fields = {f.name for f in dataclasses.fields(Options)}
    for fn, translated, into in ((api.check, {"op", "impl", "log"}, {"ops", "specs", "named"}),
                                 (api.gate, {"impl", "log"}, {"impls"})):
        params = set(inspect.signature(fn).parameters)
        assert translated <= params and into <= fields, fn.__name__
        assert params - translated <= fields, (fn.__name__, sorted(params - translated - fields))


def test_device_strings_are_read_in_one_place():
    """Issue 49: "cuda:1" was parsed in 33 places (startswith("cuda") 14, split(":")[0] 19); now
    `equivalence.sandbox.device.device_type` / `is_cuda` read it. Left: the pytest plugin (it
    imports no torch, device.py does)."""
    pending = {"mla_verify/pytest_plugin.py", "equivalence/sandbox/device.py"}
    found = []
    for folder in PACKAGE:
        for path in sorted((ROOT / folder).rglob("*.py")):
            where = str(path.relative_to(ROOT))
            text = path.read_text()
            if where not in pending and ('startswith("cuda")' in text or 'split(":")[0]' in text):
                found.append(where)
    assert not found, found
