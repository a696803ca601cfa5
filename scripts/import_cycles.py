"""The import graph of the package's modules, its cycles and its layering: exit 1 on either.

Every import counts, at module level or inside a function: a lazy import that closes a loop is
still two modules that cannot be understood, tested or replaced one without the other. An edge
goes to the module imported (`from a.b import c` reaches `a.b.c` when that is a module, else
`a.b`), not to its parent packages (pylint's `cyclic-import` model).

Layers, lowest first: a folder may import only folders listed before it in its own row of
`MAY_IMPORT` (the reference shares no code with the optimized side; nothing below the CLI reaches
up into it). Inside equivalence/ the wings are rooms of their own (`WINGS`): what a case is (cases/)
knows no judge, the judge knows no kernel process, the sandbox that runs the kernel (and carries
what it produced back, `sandbox/produced.py`) knows no spec, and the errors and the contracts'
Protocols are leaves every wing may read.

    python3 scripts/import_cycles.py            # from the repository root; tests/test_layering.py runs it
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"mla_verify": "mla_verify", "reference": "mla_verify.reference", "optimized": "mla_verify.optimized",
           "equivalence": "mla_verify.equivalence", "fuzz": "mla_verify.fuzz", "reports": "mla_verify.reports"}
# equivalence/'s wings and leaves: module path under equivalence/ -> the room it counts as
WINGS = {"cases": "equivalence/cases", "coverage": "equivalence/coverage", "judge": "equivalence/judge",
         "sandbox": "equivalence/sandbox", "errors": "equivalence/errors", "contracts": "equivalence/contracts"}
_LEAVES = {"equivalence/errors", "equivalence/contracts"}
# folder -> the folders its modules may import (its own always)
MAY_IMPORT = {
    "reference": set(),
    "optimized": set(),
    "equivalence/errors": set(),
    "equivalence/contracts": {"optimized"},
    "equivalence/cases": {"reference", "optimized", *_LEAVES},
    "equivalence/judge": {"reference", "optimized", "equivalence/cases", *_LEAVES},
    "equivalence/sandbox": {"optimized", "equivalence/cases", "equivalence/judge", *_LEAVES},
    # the specs' face (spec, catalog, subject), the block's judge and the worker's own side (blocks,
    # serve), ops/ and properties/ put the wings together
    "equivalence": {"reference", "optimized", "equivalence/cases", "equivalence/judge", "equivalence/sandbox",
                    *_LEAVES},
    # the covering sets sit on top: they ask each spec for its features
    "equivalence/coverage": {"reference", "optimized", "equivalence", "equivalence/cases", "equivalence/judge",
                             *_LEAVES},
}
_EQUIVALENCE = {"equivalence", *WINGS.values()}
MAY_IMPORT |= {
    "fuzz": {"reference", "optimized", *_EQUIVALENCE},
    "reports": _EQUIVALENCE,
    "mla_verify": {"reference", "optimized", *_EQUIVALENCE, "fuzz", "reports"},
}
def modules() -> dict[str, tuple[Path, str]]:
    """module name -> (its file, the folder it lives in)."""
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            if folder == "mla_verify" and parts and parts[0] in FOLDERS:
                continue
            name = ".".join([package, *parts])
            found[name] = (path, WINGS.get(parts[0], folder) if folder == "equivalence" and parts else folder)
    return found


def imports(name: str, path: Path, known: dict) -> set[str]:
    """The known modules `name` (in file `path`) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            # `from a import b`: a.b when b is a module, else a (its attribute)
            candidates = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        for c in candidates:
            while c and c not in known:
                c = c.rpartition(".")[0]
            if c and c != name:
                targets.add(c)
    return targets


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, edges = work[-1]
            for w in edges:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def layering(graph: dict[str, set[str]], known: dict) -> list[str]:
    """Each import that reaches a folder its own may not import."""
    return [f"{name} imports {dep} ({known[name][1]}/ may not import {known[dep][1]}/)"
            for name, deps in sorted(graph.items()) for dep in sorted(deps)
            if known[dep][1] != known[name][1] and known[dep][1] not in MAY_IMPORT[known[name][1]]]


def main() -> int:
    known = modules()
    graph = {name: imports(name, path, known) for name, (path, _) in known.items()}
    loops, breaches = cycles(graph), layering(graph, known)
    for loop in loops:
        print(f"cycle of {len(loop)} modules: {' '.join(loop)}")
    for breach in breaches:
        print(f"layering: {breach}")
    print(f"{len(known)} modules, {sum(map(len, graph.values()))} imports: "
          f"{len(loops)} cycle(s), {len(breaches)} layering breach(es)")
    return 1 if loops or breaches else 0


if __name__ == "__main__":
    sys.exit(main())
