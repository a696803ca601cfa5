"""The row: one compared tensor of one case, as the drift report stores it.

Every gate, fuzz, property and replay run emits rows; `reports` turns them into a DataFrame. The
columns are fixed here so that runs made months apart compare column by column.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

# Knobs every op reports where it has them (None elsewhere): the axes of the report's tables.
KNOB_COLUMNS = (
    "topk",          # width of the top-k index rows
    "heads",         # query heads the caller asked for (before any padding)
    "num_tokens",    # query tokens (T, or B*S for decode)
    "seq_len",       # longest context a query attends into
    "block_size",    # tokens per KV page
    "dcp_size",      # decode-context-parallel world size (1 = none)
    "cache_dtype",   # bfloat16 | fp8_ds_mla | nvfp4_ds_mla
    "scale_rule",    # pow2 | raw (fp8_ds_mla tile scales)
    "value_regime",  # normal | saturation | outliers | zero_tiles | tiny | peaked
    "sm_scale",
)

METRIC_COLUMNS = (
    "numel",          # elements compared
    "ref_rms",        # rms of the reference over finite positions: the magnitude the error sits on
    "rel_l2",         # ||impl - ref|| / ||ref|| over finite positions
    "cos_dist",       # 1 - cos(impl, ref)
    "max_abs",        # max |impl - ref| over finite positions
    "max_abs_at",     # index of that element, as "i,j,k"
    "mismatch_frac",  # fraction failing the per-element abs-or-rel check (exact ops: not bit-equal)
    "mean_err",       # signed relative bias, mean (impl - ref) / ref: a bug biases, rounding does not
    "bf16_units",     # ||impl - ref|| / ||bf16(ref) - ref||: error in units of bf16 rounding
    "elem_bf16_units",  # worst element, in bf16 rounding steps of its row's magnitude
    "lse_fp32_units",   # worst LSE error, in fp32 rounding steps of its row's logit scale
    "nan_count",      # NaN in the implementation's output
    "inf_mismatch",   # positions whose +inf / -inf / NaN pattern differs from the reference
)


@dataclass
class Row:
    # identity
    run_id: str
    case_id: str
    op: str            # public-contract op, or "forward_mqa"
    path: str          # forward_mqa path (bf16 | fp8_mixed | fp8_separate | fp8_mixed_dcp), else the op
    tensor: str        # out | lse | max_logits | rows | indices | valid_counts | ...
    impl: str          # implementation that ran ("pipeline" for forward_mqa)
    stages: str        # "stage=impl,..." for pipelines, "" otherwise
    device: str
    seed: int
    source: str        # corpus | fuzz | property | replay | bench
    case: str = ""     # the Case as JSON (op, params, seed): what replays this row's case
    # knobs
    topk: int | None = None
    heads: int | None = None
    num_tokens: int | None = None
    seq_len: int | None = None
    block_size: int | None = None
    dcp_size: int | None = None
    cache_dtype: str | None = None
    scale_rule: str | None = None
    value_regime: str | None = None
    sm_scale: float | None = None
    # metrics
    exact: bool = False
    numel: int = 0
    ref_rms: float = math.nan
    rel_l2: float = math.nan
    cos_dist: float = math.nan
    max_abs: float = math.nan
    max_abs_at: str = ""
    mismatch_frac: float = math.nan
    mean_err: float = math.nan
    bf16_units: float = math.nan
    elem_bf16_units: float = math.nan
    lse_fp32_units: float = math.nan
    nan_count: int = 0
    inf_mismatch: int = 0
    # verdict: the gated metric with the least headroom, its value and bound
    gate_metric: str = ""
    value: float = math.nan
    bound: float = math.nan
    headroom: float = math.nan   # bound / value (inf when value is 0); < 1 fails
    deviation: str = ""          # the implementation's known deviation that set the bound, if any
    passed: bool = True
    reason: str = ""
    # timings (seconds)
    time_ref_s: float = math.nan
    time_impl_s: float = math.nan

    def to_record(self) -> dict:
        return asdict(self)


COLUMNS = tuple(f.name for f in fields(Row))


def split_rank(tensor: str) -> tuple[str, int | None]:
    """A multi-process DCP row's tensor names the rank it came from: "partial_lse_rank3" ->
    ("partial_lse", 3); any other name -> (name, None)."""
    base, sep, rank = tensor.rpartition("_rank")
    return (base, int(rank)) if sep and rank.isdigit() else (tensor, None)
