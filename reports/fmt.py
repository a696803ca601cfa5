"""Text for table cells, shared by the terminal, HTML and markdown renderings so that all three
print the same number the same way."""

from __future__ import annotations

import math
from numbers import Integral, Real

import pandas as pd

MISSING = "—"

_HEADERS = {
    "case_id": "case_id",          # as replay and the case files spell it
    "units_p50": "bf16u p50",
    "units_p99": "bf16u p99",
    "bias": "bias (mean)",
    "bias_absmean": "|bias| mean",
    "bias_absmax": "|bias| max",
    "headroom_min": "min headroom",
    "seq_bucket": "seq_len",
    "p99_ratio": "p99 ×",
    "max_ratio": "max ×",
    "bias_ratio": "|bias| ×",
    "base_bias": "base |bias|",
    "cur_bias": "cur |bias|",
}


def number(x: object) -> str:
    """A cell's text. Numbers: 3 significant digits, scientific below 0.1 (every error metric,
    so a column reads at a glance) and from 1e4; NaN and missing as a dash; else str()."""
    if x is None or x is pd.NA:
        return MISSING
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, Integral):
        return str(int(x))
    if isinstance(x, Real):
        v = float(x)
        if math.isnan(v):
            return MISSING
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        if v == 0:
            return "0"
        return f"{v:.2e}" if abs(v) < 0.1 or abs(v) >= 1e4 else f"{v:.3g}"
    return str(x)


def header(column: str) -> str:
    return _HEADERS.get(column, column.replace("_", " "))


def cells(frame: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    """(headers, rows of text) of a table."""
    rows = [[number(v) for v in record] for record in frame.itertuples(index=False, name=None)]
    return [header(c) for c in frame.columns], rows
