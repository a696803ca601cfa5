"""The short fixed-width summary a gate prints at its end (about 25 lines for a full run):
per path the rows of each tensor kind, failures and the row closest to its bound; per kind the
key error metric; the deviations; the verdict, and a failing run's findings by cause
(`reports.causes`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from mla_verify.reports import causes
from mla_verify.reports.fmt import MISSING, number
from mla_verify.reports.kinds import annotate
from mla_verify.reports.meta import describe, judged_where
from mla_verify.reports.stats import counts, expected, grouped, run_ids, summarize

_KIND_HEADER = {"out": "out", "lse": "lse", "max_logits": "mxlog", "exact": "exact",
                "other": "other"}


def fixed_width(headers: Sequence[str], rows: Sequence[Sequence[str]], align: str) -> list[str]:
    """Columns padded to their widest cell; align[i] is "l" or "r" for column i."""
    widths = [max(len(c) for c in col) for col in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w)
                         for c, w, a in zip(cells, widths, align, strict=True)).rstrip()

    return [line(headers), *(line(r) for r in rows)]


def _worst(rows: pd.DataFrame) -> tuple[str, str]:
    """(tensor metric value / bound, headroom) of the row with the least headroom."""
    gated = rows[rows["headroom"].notna()]
    if gated.empty:
        return MISSING, MISSING
    r = gated.loc[gated["headroom"].idxmin()]
    return (f"{r['tensor']} {r['gate_metric']} {number(r['value'])} / {number(r['bound'])}",
            number(r["headroom"]))


def _header(meta: Mapping[str, Any], frame: pd.DataFrame, name: str) -> str:
    facts = describe(meta)
    git = meta.get("git") or {}
    rev = (git.get("revision") or "")[:10] + ("+dirty" if git.get("dirty") else "")
    parts = [f"run {run_ids(frame)}", f"profile {facts['profile']}", facts["device"]]
    return f"mla-verify report: {f'{name} | ' if name else ''}" + " | ".join(parts + ([f"git {rev}"] if rev else []))


def terminal_summary(rows: pd.DataFrame, meta: Mapping[str, Any] | None = None, name: str = "") -> str:
    """The summary as text (stored rows, as `load_run` returns them), titled by `name` (the run
    directory's) where given."""
    frame = annotate(rows)
    kinds = [k for k in frame["kind"].cat.categories if (frame["kind"] == k).any()]
    path_rows = []
    for (path,), g in grouped(frame, ("path",)):
        per_kind = g["kind"].value_counts()
        path_rows.append([path, *(str(per_kind.get(k, 0) or "") for k in kinds),
                          str(int((~g["passed"]).sum())), *_worst(g)])
    lines = [_header(meta or {}, frame, name), ""]
    lines += fixed_width(["path", *(_KIND_HEADER[k] for k in kinds), "fail",
                          "closest to bound", "headroom"],
                         path_rows, "l" + "r" * (len(kinds) + 1) + "lr")
    by_kind = summarize(frame, ("kind",))
    lines += [""] + fixed_width(
        ["kind", "rows", "fail", "metric", "p50", "p99", "max"],
        [[str(r.kind), str(r.rows), str(r.failed), r.metric, number(r.p50), number(r.p99),
          number(r.max)] for r in by_kind.itertuples()],
        "lrrlrrr",
    )
    c = counts(frame, bool((meta or {}).get("incomplete")), judged_where(meta or {}))
    if c.deviation_rows:
        dev = frame[expected(frame)]
        per_name = dev["deviation"].value_counts().sort_index()
        names = ", ".join(f"{d} ({n})" for d, n in per_name.items())
        lines += ["", f"documented deviations (expected, not regressions): "
                      f"{c.deviation_rows} rows: {names}"]
    lines += ["", c.line()]
    if (c.findings or 0) > 1:  # several findings: by cause, their files under each
        lines += causes.lines(causes.of_frame(frame))
    return "\n".join(lines)
