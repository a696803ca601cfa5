"""Tensor kinds: which metric speaks for each compared tensor in the tables and plots.

A row's kind is stored with it (`equivalence.judge.rows`: exact, out, lse, max_logits, other; "" for a
row of no tensor, a case that failed as a whole, which the tables list with other). Every table
and plot reads one number per row, its kind's key metric, so that rows of one kind compare with
each other across paths.

Drift is judged on other, normalized metrics with floors of their own (`equivalence.judge.policy.DRIFT_METRICS`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from mla_verify.equivalence.judge.rows import KINDS

# kind (every one of equivalence.judge.rows.KINDS) -> the column that measures its error
KEY_METRIC: dict[str, str] = {
    "out": "rel_l2",
    "lse": "max_abs",
    "max_logits": "max_abs",
    "exact": "mismatch_frac",
    "other": "rel_l2",
}

KNOB_TABLES: tuple[str, ...] = ("topk", "heads", "value_regime", "seq_bucket", "dcp_size")

SEQ_BUCKETS: tuple[tuple[float, str], ...] = (
    (256, "<=256"),
    (2048, "<=2k"),
    (16384, "<=16k"),
    (np.inf, ">16k"),
)


def seq_bucket(seq_len: pd.Series) -> pd.Series:
    """Ordered categorical of `seq_len` in SEQ_BUCKETS (missing stays missing)."""
    edges = [-np.inf, *(edge for edge, _ in SEQ_BUCKETS)]
    labels = [label for _, label in SEQ_BUCKETS]
    values = pd.to_numeric(seq_len, errors="coerce").astype("float64")
    return pd.cut(values, bins=edges, labels=labels, right=True, ordered=True)


def annotate(rows: pd.DataFrame) -> pd.DataFrame:
    """`rows` with kind as an ordered categorical ("" read as other) and the analysis columns:
    metric (name of the key metric), error (its value), seq_bucket. A copy."""
    out = rows.copy()
    kinds = [kind or "other" for kind in out["kind"]]
    out["kind"] = pd.Categorical(kinds, categories=KINDS, ordered=True)  # listed in this order everywhere
    out["metric"] = pd.array([KEY_METRIC[k] for k in kinds], dtype="string")
    error = np.full(len(out), np.nan)
    for kind, column in KEY_METRIC.items():
        mask = (out["kind"] == kind).to_numpy()
        error[mask] = out.loc[mask, column].to_numpy(dtype="float64")
    out["error"] = error
    out["seq_bucket"] = seq_bucket(out["seq_len"])
    return out
