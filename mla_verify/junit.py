"""JUnit XML for CI systems: one test case per (op, implementation), failing with its worst row."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from xml.sax.saxutils import quoteattr, escape

from mla_verify.equivalence.mismatch import line
from mla_verify.equivalence.rows import Row


def write_junit(path: Path, rows: list[Row], suite: str = "mla-verify") -> None:
    groups: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for r in rows:
        groups[(r.op, r.impl)].append(r)
    failures = sum(any(not r.passed for r in rs) for rs in groups.values())
    lines = [f'<testsuite name={quoteattr(suite)} tests="{len(groups)}" failures="{failures}">']
    for (op, impl), rs in sorted(groups.items()):
        cases = len({r.case_id for r in rs})
        lines.append(f'  <testcase classname={quoteattr(op)} name={quoteattr(f"{impl} ({cases} cases)")}>')
        bad = [r for r in rs if not r.passed]
        if bad:
            first = bad[0]
            msg = (f"{len(bad)} failing rows; first: case {first.case_id} seed {first.seed} "
                   + line(first.tensor, first.gate_metric, first.value, first.bound, first.reason))
            lines.append(f"    <failure message={quoteattr(msg)}>{escape(msg)}</failure>")
        lines.append("  </testcase>")
    lines.append("</testsuite>")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n")
