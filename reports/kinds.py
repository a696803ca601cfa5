"""Tensor kinds: which metric speaks for each compared tensor in the tables and plots.

A row's *kind* is `exact` for bit-exact contracts (cache bytes, indices, chunk bounds), else its
tensor name when that has a key metric of its own (`out`, `lse`, `max_logits`), else `other`
(a dense float tensor, read like `out`). A DCP rank's tensors are of their base tensor's kind
(`out_rank3`, `partial_out_rank0`: out; `lse_rank1`, `partial_lse_rank2`: lse), a property's
"CHECK.TENSOR" of its TENSOR's kind (`wider_k.out`: out). Every table and plot reads one number
per row, the kind's key metric, so that rows of one kind compare with each other across paths.

Drift is judged on other, normalized metrics with floors of their own (`equivalence.policy.DRIFT_METRICS`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from mla_verify.equivalence.rows import split_rank

# kind -> (column that measures its error, label for axes and tables)
KEY_METRIC: dict[str, str] = {
    "out": "rel_l2",
    "lse": "max_abs",
    "max_logits": "max_abs",
    "exact": "mismatch_frac",
    "other": "rel_l2",
}

# Order in which kinds are listed everywhere.
KIND_ORDER: tuple[str, ...] = tuple(KEY_METRIC)

KNOB_TABLES: tuple[str, ...] = ("topk", "heads", "value_regime", "seq_bucket", "dcp_size")

SEQ_BUCKETS: tuple[tuple[float, str], ...] = (
    (256, "<=256"),
    (2048, "<=2k"),
    (16384, "<=16k"),
    (np.inf, ">16k"),
)


def tensor_kind(tensor: str, exact: bool) -> str:
    if exact:
        return "exact"
    tensor = tensor.rsplit(".", 1)[-1]
    base, rank = split_rank(tensor)
    if rank is not None:
        tensor = base.removeprefix("partial_")
    return tensor if tensor in KEY_METRIC else "other"


def seq_bucket(seq_len: pd.Series) -> pd.Series:
    """Ordered categorical of `seq_len` in SEQ_BUCKETS (missing stays missing)."""
    edges = [-np.inf, *(edge for edge, _ in SEQ_BUCKETS)]
    labels = [label for _, label in SEQ_BUCKETS]
    values = pd.to_numeric(seq_len, errors="coerce").astype("float64")
    return pd.cut(values, bins=edges, labels=labels, right=True, ordered=True)


def annotate(rows: pd.DataFrame) -> pd.DataFrame:
    """`rows` plus the analysis columns: kind, metric (name of the key metric), error (its value),
    seq_bucket. A copy; the stored columns are untouched."""
    out = rows.copy()
    kinds = [tensor_kind(t, e) for t, e in zip(out["tensor"], out["exact"], strict=True)]
    out["kind"] = pd.Categorical(kinds, categories=KIND_ORDER, ordered=True)
    out["metric"] = pd.array([KEY_METRIC[k] for k in kinds], dtype="string")
    error = np.full(len(out), np.nan)
    for kind, column in KEY_METRIC.items():
        mask = (out["kind"] == kind).to_numpy()
        error[mask] = out.loc[mask, column].to_numpy(dtype="float64")
    out["error"] = error
    out["seq_bucket"] = seq_bucket(out["seq_len"])
    return out
