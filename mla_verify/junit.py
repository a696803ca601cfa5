"""JUnit XML for CI systems: one test case per (op, implementation), failing with its first failing
row and, where its case was saved, the command that replays it."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Mapping
from xml.sax.saxutils import quoteattr, escape

from mla_verify.equivalence.mismatch import line
from mla_verify.equivalence.rows import Row


def write_junit(path: Path, rows: list[Row], suite: str = "mla-verify", replays: Mapping[str, str] | None = None) -> None:
    """`replays`: case id -> the `mla-verify replay` command of its saved case file."""
    replays = replays or {}
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
            first = next((r for r in bad if r.case_id in replays), bad[0])
            msg = (f"{len(bad)} failing rows; first: case {first.case_id} seed {first.seed} "
                   + line(first.tensor, first.gate_metric, first.value, first.bound, first.reason))
            if first.case_id in replays:
                msg += f"; replay: {replays[first.case_id]}"
            lines.append(f"    <failure message={quoteattr(msg)}>{escape(msg)}</failure>")
        lines.append("  </testcase>")
    lines.append("</testsuite>")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n")


def saved_replays(failures: Path) -> dict[str, str]:
    """Case id -> `mla-verify replay FILE --device D` for every case file saved under `failures`."""
    from mla_verify.fuzz import casefile

    replays = {}
    for f in sorted(Path(failures).glob("*.json")):
        saved = casefile.load(f)
        impls = "".join(f" --impl {spec}" for spec in saved.impl if ":" in spec)  # a callable is never imported unasked
        replays[saved.case.case_id] = f"mla-verify replay {f}{impls} --device {saved.device}"
    return replays
