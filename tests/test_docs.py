"""The documentation: README.md stays a short entry (set-up, the walkthrough, links), every page of
docs/ is in the site's navigation and every link of the README reaches a page; the generated
reference pages (scripts/docs_reference.py, run as the site builds) cover every command and
option of the parser, every public name of the API and every option of the pytest plugin.
`make docs` (in .ci/run) builds the site itself with warnings as errors."""

import argparse
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import docs_reference  # noqa: E402  (a script of this repository, not a package)

sys.path.pop(0)


def test_the_readme_is_short_and_its_links_reach_pages():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    links = re.findall(r"\]\((docs/[^)#]+)", text)
    assert links and all((ROOT / link).is_file() for link in links), [l for l in links if not (ROOT / l).is_file()]


def test_every_page_is_in_the_navigation_and_every_entry_is_a_page():
    yaml = pytest.importorskip("yaml", reason="pyyaml is a test extra")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def pages(nav):
        for entry in nav:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            yield from (pages(value) if isinstance(value, list) else [value])

    listed = set(pages(config["nav"]))
    held = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")
            if p.parent.name != "_incoming"}  # notes waiting to be placed in a page (mkdocs.yml exclude_docs)
    assert listed == held


def test_the_cli_reference_shows_every_command_and_option():
    from mla_verify.cli import build_parser

    page = docs_reference.cli_reference()
    for name, sub in docs_reference._subcommands(build_parser()).items():
        assert f"## mla-verify {name}\n" in page
        section = page.split(f"## mla-verify {name}\n", 1)[1].split("\n## mla-verify ", 1)[0]
        options = [o for a in sub._actions if not isinstance(a, argparse._HelpAction) for o in a.option_strings]
        assert options and all(o in section for o in options if o.startswith("--")), name


def test_the_api_reference_shows_every_public_name_with_its_docstring():
    import mla_verify

    shown = {name for module, names in docs_reference.API if module == "mla_verify" for name in names}
    assert set(mla_verify.__all__) - {"__version__", "strategies"} <= shown
    page = docs_reference.api_reference()
    assert "### `mla_verify.check`" in page and mla_verify.check.__doc__.splitlines()[0].strip() in page
    assert "(no docstring)" not in page


def test_the_pytest_options_table_lists_every_option_of_the_plugin():
    from mla_verify import pytest_plugin

    table = docs_reference.pytest_options()
    assert all(f"`--mla-verify-{name} " in table for name in pytest_plugin._OPTIONS)
    assert "--mla-verify-seed" in table
