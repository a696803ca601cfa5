"""What a user's module declares, read from its source without running any of it: the judge
resolves `--impl MODULE:CALLABLE` this way and never imports the module (its import-time code
runs in the worker only, behind the sandbox).

`deviations(spec)` finds MODULE's source the way an import would (the import system's finders,
never the module itself nor its packages' `__init__`), parses it, and reads the literal of a
top-level `CALLABLE.__mla_verify_deviations__ = (...)` (a tuple, list or string of names). A
declaration made any other way (computed, inside an `if`, through a decorator) is not read: declare
it with `--deviation NAME` / `deviations=` instead; the worker's own reading of the attribute is
compared with this one, and a difference fails each case it answered (never a looser bound).
"""

from __future__ import annotations

import ast
import importlib.machinery
import os
import sys
from pathlib import Path

SOURCE_LIMIT = 16 << 20  # a module's source read for its declaration (bytes)
ATTRIBUTE = "__mla_verify_deviations__"


class Undeclared(LookupError):
    """The module's source cannot be read (a compiled extension, a file that does not parse)."""


class NotFound(Undeclared):
    """No module of that name on the path: its import would fail too."""


def _spec_of(name: str):
    """The import system's spec of module `name` without importing it or its parents: each level
    is looked up with the finders already installed (sys.meta_path), given the last level's
    search locations; a package already imported here gives its live `__path__` (which its own
    import may have extended), and importing nothing more runs nothing."""
    path, found = None, None
    parts = name.split(".")
    for i in range(len(parts)):
        prefix = ".".join(parts[:i + 1])
        found = _find(prefix, path)
        if found is None and i == 0:
            raise NotFound(f"no module named {prefix!r} on the path")
        if found is None:  # maybe where its package's own import would look: the worker will tell
            raise Undeclared(f"{prefix!r} is not found without importing {'.'.join(parts[:i])!r}")
        loaded = sys.modules.get(prefix)
        path = getattr(loaded, "__path__", None) if loaded is not None else found.submodule_search_locations
        if i < len(parts) - 1 and path is None:
            raise NotFound(f"{prefix!r} is not a package")
    return found


def _find(name: str, path):
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            found = find(name, path)
        except (ImportError, ValueError, AttributeError):
            continue
        if found is not None:
            return found
    return None


def source_of(module: str) -> Path:
    """The .py file an import of `module` would run (Undeclared where it is not Python source)."""
    if os.getcwd() not in sys.path:  # the working directory is importable, as for the worker
        sys.path.insert(0, os.getcwd())
    spec = _spec_of(module)
    origin = getattr(spec, "origin", None)
    if not origin or not isinstance(spec.loader, importlib.machinery.SourceFileLoader) or not origin.endswith(".py"):
        raise Undeclared(f"module {module!r} is not Python source ({origin or 'no file'})")
    return Path(origin)


def _literal(node: ast.expr) -> tuple[str, ...] | None:
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    return None


def _target(node: ast.expr) -> str | None:
    """"a.b" for an assignment target `a.b.__mla_verify_deviations__`."""
    if not (isinstance(node, ast.Attribute) and node.attr == ATTRIBUTE):
        return None
    parts, at = [], node.value
    while isinstance(at, ast.Attribute):
        parts.append(at.attr)
        at = at.value
    if not isinstance(at, ast.Name):
        return None
    return ".".join([at.id, *reversed(parts)])


def deviations(spec: str) -> tuple[str, ...]:
    """The deviations `MODULE:CALLABLE` declares in its module's source, as a literal (the last
    top-level assignment wins, as it would at import); () where it declares none that way.
    Undeclared where the source cannot be read."""
    module, _, attr = spec.partition(":")
    path = source_of(module)
    try:
        with open(path, "rb") as f:
            text = f.read(SOURCE_LIMIT + 1)
    except OSError as exc:
        raise Undeclared(f"{path}: {exc.strerror or exc}") from None
    if len(text) > SOURCE_LIMIT:
        raise Undeclared(f"{path}: over {SOURCE_LIMIT >> 20} MiB of source")
    try:
        tree = ast.parse(text, filename=str(path))
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise Undeclared(f"{path}: not parsable Python ({type(exc).__name__})") from None
    declared: tuple[str, ...] = ()
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(_target(t) == attr for t in targets) and node.value is not None:
            declared = _literal(node.value) or ()
    return declared
