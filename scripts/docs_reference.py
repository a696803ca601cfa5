"""The documentation site's reference pages, generated from the code as the site builds (an MkDocs
hook named in mkdocs.yml), so neither can drift from what it documents:

* `<!-- generated:cli -->` in a page becomes every command's `--help`, from `mla_verify.cli`'s parser;
* `<!-- generated:api -->` becomes the signature and docstring of every public name of the Python API;
* `<!-- generated:pytest -->` becomes the table of the pytest plugin's options, from the plugin.

    .venv/bin/python scripts/docs_reference.py cli   # print what a marker becomes (cli or api)
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys

# (module, names): the public Python API, in the order the page shows it.
API = [
    ("mla_verify", ["check", "assert_equivalent", "replay", "property_check", "gate", "drift", "history", "CheckResult",
                    "Failure", "UsageError", "HarnessError", "Unsupported", "unsupported"]),
    ("mla_verify.runs.merge", ["merge"]),
    ("mla_verify.strategies", ["cases"]),
    ("mla_verify.reports", ["bias_of"]),
    ("mla_verify.reports.causes", ["by_cause", "of_frame"]),
    ("mla_verify.equivalence.catalog", ["inputs"]),
    ("mla_verify.reference", ["memory_limit"]),
]


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def cli_reference() -> str:
    """Every command's help as `mla-verify COMMAND --help` prints it, at a fixed width of 100 columns."""
    from mla_verify.cli import build_parser

    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        parser = build_parser()
        parts = [f"## mla-verify\n\n```\n{parser.format_help()}```\n"]
        for name, sub in _subcommands(parser).items():
            parts.append(f"## mla-verify {name}\n\n```\n{sub.format_help()}```\n")
    finally:
        if columns is None:
            os.environ.pop("COLUMNS")
        else:
            os.environ["COLUMNS"] = columns
    return "\n".join(parts)


def _signature(obj) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""


def _entry(qualified: str, obj, level: str = "###") -> str:
    """A name's heading, its signature and its docstring as written (its layout kept)."""
    doc = inspect.getdoc(obj) or "(no docstring)"
    kind = "class " if inspect.isclass(obj) else ""
    text = f"{level} `{kind}{qualified}`\n\n```python\n{kind}{qualified}{_signature(obj)}\n```\n\n```text\n{doc}\n```\n"
    if inspect.isclass(obj):
        for name, member in vars(obj).items():
            if name.startswith("_") or not (inspect.isfunction(member) or isinstance(member, property)):
                continue
            member_doc = inspect.getdoc(member)
            if member_doc:
                shown = name if isinstance(member, property) else f"{name}{_signature(member)}"
                text += f"\n`{shown}`\n\n```text\n{member_doc}\n```\n"
    return text


def api_reference() -> str:
    """The signature and docstring of each name in API (a class with its documented methods)."""
    parts = []
    for module_name, names in API:
        module = importlib.import_module(module_name)
        parts.append(f"## `{module_name}`\n")
        parts += [_entry(f"{module_name}.{name}", getattr(module, name)) for name in names]
    return "\n".join(parts)


def pytest_options() -> str:
    """The pytest plugin's options as a table: each option, its value and what it sets."""
    from mla_verify import pytest_plugin

    rows = [f"| `--mla-verify-{name} {pytest_plugin.METAVARS[name]}` | {text} |"
            for name, text in pytest_plugin._OPTIONS.items()]
    return "\n".join(["| option | sets |", "|---|---|", *rows]) + "\n"


GENERATED = {"<!-- generated:cli -->": cli_reference, "<!-- generated:api -->": api_reference,
             "<!-- generated:pytest -->": pytest_options}


def on_page_markdown(markdown: str, **_) -> str:
    """MkDocs hook: a page's markers replaced by what they generate."""
    for marker, generate in GENERATED.items():
        if marker in markdown:
            markdown = markdown.replace(marker, generate())
    return markdown


if __name__ == "__main__":
    print(GENERATED[f"<!-- generated:{sys.argv[1]} -->"]())
