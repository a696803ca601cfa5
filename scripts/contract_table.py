"""Rewrite the README's contract table from the declared contracts (equivalence/contracts.py).

The table sits between `<!-- contracts:begin -->` and `<!-- contracts:end -->` in README.md and
holds exactly `contract_table()`'s output; tests/test_contracts.py fails when the two drift.

    .venv/bin/python scripts/contract_table.py           # from the repository root: rewrite README.md
    .venv/bin/python scripts/contract_table.py --check   # exit 1 if README.md is out of date
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BEGIN, END = "<!-- contracts:begin -->\n", "<!-- contracts:end -->\n"
COMMAND = ".venv/bin/python scripts/contract_table.py"


def region(text: str) -> str:
    """What the README holds between the markers (each on a line of its own)."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README.md: no {BEGIN.strip()} ... {END.strip()} region")
    return text[start + len(BEGIN): end]


def rewritten(text: str, table: str) -> str:
    """`text` with its region replaced by `table`."""
    old = region(text)
    start = text.find(BEGIN) + len(BEGIN)
    return text[:start] + table + text[start + len(old):]


def main(argv: list[str]) -> int:
    from mla_verify.equivalence.contracts import contract_table

    text, table = README.read_text(), contract_table()
    if region(text) == table:
        return 0
    if "--check" in argv:
        print(f"README.md's contract table is out of date: run {COMMAND}", file=sys.stderr)
        return 1
    README.write_text(rewritten(text, table))
    print("README.md: contract table rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
