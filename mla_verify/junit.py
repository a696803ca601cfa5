"""JUnit XML for CI systems: one test case per (op, implementation), failing with its findings and
failing cases counted as the report counts them (`reports.stats.Counts`), its first finding's
failing row and the command that replays that finding's case file; the failure's text adds the
groups its findings belong to, by cause over the whole run (`reports.causes`), their files under
each: a case of forward_mqa says it is the same kernel's fault as the op's."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Mapping
from xml.sax.saxutils import quoteattr, escape

from mla_verify.equivalence.judge.rows import Row
from mla_verify.reports.causes import by_cause, lines as cause_lines


def write_junit(path: Path, rows: list[Row], suite: str = "mla-verify", replays: Mapping[str, str] | None = None) -> None:
    """`replays`: a finding's case file name (`Row.finding`) -> the `mla-verify replay` command of it."""
    replays = replays or {}
    groups: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for r in rows:
        groups[(r.op, r.impl)].append(r)
    failures = sum(any(not r.passed for r in rs) for rs in groups.values())
    causes = by_cause(rows)
    causes = causes if sum(len(g.findings) for g in causes) > 1 else []  # a finding alone is its own cause
    lines = [f'<testsuite name={quoteattr(suite)} tests="{len(groups)}" failures="{failures}">']
    for (op, impl), rs in sorted(groups.items()):
        cases = len({r.case_id for r in rs})
        lines.append(f'  <testcase classname={quoteattr(op)} name={quoteattr(f"{impl} ({cases} cases)")}>')
        bad = [r for r in rs if not r.passed]
        if bad:
            first = next((r for r in bad if r.finding), bad[0])
            found = len({r.finding for r in rs if r.finding})
            msg = (f"{found} finding{'s' * (found != 1)}, {len({r.case_id for r in bad})} failing cases, {len(bad)} "
                   f"failing rows; first: case {first.case_id} seed {first.seed} "
                   + first.line())
            if first.finding in replays:
                msg += f"; replay: {replays[first.finding]}"
            named = {r.finding for r in bad}
            text = "\n".join([msg, *cause_lines(g for g in causes if named & {f.name for f in g.findings})])
            lines.append(f"    <failure message={quoteattr(msg)}>{escape(text)}</failure>")
        lines.append("  </testcase>")
    lines.append("</testsuite>")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n")


def saved_replays(failures: Path) -> dict[str, str]:
    """File name -> `mla-verify replay FILE --device D` for every case file saved under `failures`."""
    from mla_verify.fuzz import casefile

    replays = {}
    for f in sorted(Path(failures).glob("*.json")):
        saved = casefile.load(f)
        impls = "".join(f" --impl {spec}" for spec in saved.impl if ":" in spec)  # a callable is never imported unasked
        replays[f.name] = f"mla-verify replay {f}{impls} --device {saved.device}"
    return replays
