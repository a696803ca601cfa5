"""Rewrite the contract tables of docs/reference/contracts.md (every op) and docs/v4.md (DeepSeek
V4's ops) from the declared contracts (equivalence/contracts.py).

Each table sits between `<!-- contracts:begin -->` and `<!-- contracts:end -->` in its page and
holds exactly `contract_table(ops)`'s output; tests/test_contracts.py fails when they drift.

    .venv/bin/python scripts/contract_table.py           # from the repository root: rewrite the page
    .venv/bin/python scripts/contract_table.py --check   # exit 1 if the page is out of date
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reference" / "contracts.md"
V4_PAGE = ROOT / "docs" / "v4.md"
BEGIN, END = "<!-- contracts:begin -->\n", "<!-- contracts:end -->\n"
COMMAND = ".venv/bin/python scripts/contract_table.py"


def region(text: str) -> str:
    """What a page holds between the markers (each on a line of its own)."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {BEGIN.strip()} ... {END.strip()} region")
    return text[start + len(BEGIN): end]


def rewritten(text: str, table: str) -> str:
    """`text` with its region replaced by `table`."""
    old = region(text)
    start = text.find(BEGIN) + len(BEGIN)
    return text[:start] + table + text[start + len(old):]


def tables() -> dict[Path, str]:
    """Each page and the table it must hold."""
    from mla_verify.equivalence.contracts import V4_OPS, contract_table

    return {PAGE: contract_table(), V4_PAGE: contract_table(V4_OPS)}


def main(argv: list[str]) -> int:
    stale = 0
    for page, table in tables().items():
        text = page.read_text()
        if region(text) == table:
            continue
        if "--check" in argv:
            print(f"{page.relative_to(ROOT)}'s contract table is out of date: run {COMMAND}", file=sys.stderr)
            stale = 1
            continue
        page.write_text(rewritten(text, table))
        print(f"{page.relative_to(ROOT)}: contract table rewritten")
    return stale


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
