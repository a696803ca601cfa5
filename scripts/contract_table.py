"""Rewrite the contract table of docs/reference/contracts.md from the declared contracts (equivalence/contracts.py).

The table sits between `<!-- contracts:begin -->` and `<!-- contracts:end -->` in that page and
holds exactly `contract_table()`'s output; tests/test_contracts.py fails when the two drift.

    .venv/bin/python scripts/contract_table.py           # from the repository root: rewrite the page
    .venv/bin/python scripts/contract_table.py --check   # exit 1 if the page is out of date
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "reference" / "contracts.md"
BEGIN, END = "<!-- contracts:begin -->\n", "<!-- contracts:end -->\n"
COMMAND = ".venv/bin/python scripts/contract_table.py"


def region(text: str) -> str:
    """What the page holds between the markers (each on a line of its own)."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{PAGE.relative_to(ROOT)}: no {BEGIN.strip()} ... {END.strip()} region")
    return text[start + len(BEGIN): end]


def rewritten(text: str, table: str) -> str:
    """`text` with its region replaced by `table`."""
    old = region(text)
    start = text.find(BEGIN) + len(BEGIN)
    return text[:start] + table + text[start + len(old):]


def main(argv: list[str]) -> int:
    from mla_verify.equivalence.contracts import contract_table

    text, table = PAGE.read_text(), contract_table()
    if region(text) == table:
        return 0
    if "--check" in argv:
        print(f"{PAGE.relative_to(ROOT)}'s contract table is out of date: run {COMMAND}", file=sys.stderr)
        return 1
    PAGE.write_text(rewritten(text, table))
    print(f"{PAGE.relative_to(ROOT)}: contract table rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
