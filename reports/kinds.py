"""Tensor kinds: which metric speaks for each compared tensor, and where its noise floor lies.

A row's *kind* is `exact` for bit-exact contracts (cache bytes, indices, chunk bounds), else its
tensor name when that has a key metric of its own (`out`, `lse`, `max_logits`), else `other`
(a dense float tensor, read like `out`). A DCP rank's tensors are of their base tensor's kind
(`out_rank3`, `partial_out_rank0`: out; `lse_rank1`, `partial_lse_rank2`: lse), a property's
"CHECK.TENSOR" of its TENSOR's kind (`wider_k.out`: out). Every table, plot and drift test reads one number per row,
the kind's key metric, so that rows of one kind compare with each other across paths and runs.

Noise floors (used by `reports.drift` only): below them a ratio of two values compares rounding
residue, not kernel behaviour, so drift is tested as `current > factor * max(baseline, floor)`.
  out rel_l2:      2^-10. One bf16 rounding of Gaussian data has rel_l2 = 1.66e-3 (measured,
                   2^20 samples), so a bf16 output cannot sit below ~1.7e-3; a p99 under 2^-10
                   (0.6 of one rounding) is rounding residue where doubling means ties broke
                   differently. A real doubling of a bf16 kernel's error (2e-3 -> 4e-3) still flags.
  out |bias|:      2^-13 of rms(ref). The mean of n unbiased bf16 roundings is ~1.7e-3/sqrt(n):
                   1.8e-5 at 8192 elements, the smallest out tensor we compare. Truncation instead
                   of round-to-nearest shifts the mean by ~1e-3, eight times above the floor.
  lse, max_logits max_abs: 2^-18 (3.8e-6). fp32 carries these statistics; |lse| is log(topk)
                   plus the largest logit, a few units to a few tens, where one fp32 ulp is
                   2^-21..2^-18, and a reduction over topk terms moves the last few ulps. Measured
                   on the H200: prefill lse relative 5e-8 (~5e-7 absolute), decode max_abs ~1e-5,
                   so a decode regression flags and prefill ulp jitter does not.
  lse, max_logits |bias|: 2^-20 of rms(ref): eight fp32 unit roundoffs (2^-23) of systematic
                   shift; raw fp8 scales rounded to bf16 biased decode lse by ~4e-3 relative.
  exact mismatch_frac: 0. Any mismatch in a bit-exact contract is real (and a failure anyway).
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

# kind -> (floor of the key error metric, floor of mean |mean_err|); reasons in the docstring.
NOISE_FLOOR: dict[str, tuple[float, float]] = {
    "out": (2.0**-10, 2.0**-13),
    "lse": (2.0**-18, 2.0**-20),
    "max_logits": (2.0**-18, 2.0**-20),
    "exact": (0.0, 0.0),
    "other": (2.0**-10, 2.0**-13),
}

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
