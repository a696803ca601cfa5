"""The row: one compared tensor of one case, as the drift report stores it.

Every gate, fuzz, property and replay run emits rows; `reports` turns them into a DataFrame. The
columns are fixed here so that runs made months apart compare column by column. A Row holds the
tensor's `Metrics` (equivalence.judge.metrics) and is stored flat (`to_record`, COLUMNS): each metric a
column of its own, so a metric added to Metrics is a column, and `from_record` reads one back.

A row's *kind* says which key metric speaks for it in the report's tables and plots (reports.kinds):

    exact       compared bit for bit (cache bytes, indices, a property the kernels keep bitwise)
    out         an attention output (a DCP rank's, a partial one, a property's "CHECK.out")
    lse         a log-sum-exp (likewise)
    max_logits  each row's largest logit (compared as an LSE)
    other       another float tensor (read like out)
    ""          none: the case failed as a whole (tensor "*") or wrote an input ("input:NAME")

It is set where the row is made, from the check that compared the tensor. That is not the
policy's exact | out | lse (`equivalence.judge.policy`: how a tensor is measured and which bounds hold
it; `Check.kind`): max_logits is measured as an LSE and other as an output, and a row is of kind
exact exactly when its tensor was compared bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Callable

from .metrics import Metrics

if TYPE_CHECKING:
    from ..cases.case import Case


class RowKind(StrEnum):
    """Which key metric speaks for a row (the module's docstring); stored as its value."""

    OUT = "out"
    LSE = "lse"
    MAX_LOGITS = "max_logits"
    EXACT = "exact"
    OTHER = "other"


KINDS = tuple(RowKind)


class FailureKind(StrEnum):
    """The gate_metric of a row that compared no values: how its case failed as a whole, or a
    tensor it did not hand back (UNSUPPORTED: a case the implementation declined, which passes)."""

    RAISED = "raised"                # the implementation raised (reason: what and where)
    CRASHED = "crashed"              # its process died (or its CUDA context)
    HUNG = "hung"                    # no answer within the timeout
    CONTRACT = "contract"            # broke the contract beyond values (arity, dtype, shape, device, ...)
    MISSING = "missing"              # an output the contract names was not returned
    INPUT_WRITTEN = "input_written"  # wrote an input it may not write (tensor "input:NAME")
    UNSUPPORTED = "unsupported"      # declined by `unsupported(reason)`: counted, not failed
    NOT_JUDGED = "not_judged"        # the judge ran out of device memory for it, waits and retries: counted, not failed

# Failing rows with no measured value: their reason says it all.
QUIET_METRICS = frozenset({*FailureKind} - {FailureKind.UNSUPPORTED} | {"shape"})


def line(tensor: str, metric: str, value: float, bound: float, reason: str) -> str:
    """A failing verdict in one line: `out: bf16_units = 20.8 > 6: 312 / 512 elements ...`."""
    if metric in QUIET_METRICS:
        return f"{tensor}: {metric} -- {reason}"
    return f"{tensor}: {metric} = {value:.4g} > {bound:.4g}: {reason}"


# Metrics' fields that serve the oracle's verdict and are not stored: the rows an output's bound
# grows with, the shape and first mismatch.
_UNSTORED_METRICS = frozenset({"rows", "shape", "extra"})
_METRIC_FIELDS: tuple[Field, ...] = tuple(f for f in fields(Metrics) if f.name not in _UNSTORED_METRICS)
_METRIC_NAMES = frozenset(f.name for f in _METRIC_FIELDS)

# A pipeline's stages as (stage, implementation) pairs, sorted by stage: what ran, as data.
Stages = tuple[tuple[str, str], ...]


@dataclass
class Row:
    # identity
    run_id: str
    case_id: str
    op: str            # public-contract op, or "forward_mqa"
    path: str          # forward_mqa path (bf16 | fp8_mixed | fp8_separate | fp8_mixed_dcp), else the op
    tensor: str        # out | lse | max_logits | rows | indices | valid_counts | ...
    impl: str          # implementation that ran ("pipeline" for forward_mqa)
    stages: Stages     # (stage, impl) pairs of a pipeline, () otherwise
    device: str
    seed: int
    source: str        # corpus | fuzz | property | replay | bench
    case: str = ""     # the Case as JSON (op, params, seed): what replays this row's case
    rank: int | None = None  # the DCP rank whose tensor it is ("out_rank1": 1)
    check: str = ""    # the property check that compared it ("merged.out": "merged")
    written: str = ""  # the input the implementation wrote ("input:kv": "kv")
    # knobs every op reports where it has them (None elsewhere): the axes of the report's tables
    topk: int | None = None          # width of the top-k index rows
    heads: int | None = None         # query heads the caller asked for (before any padding)
    num_tokens: int | None = None    # query tokens (T, or B*S for decode)
    seq_len: int | None = None       # longest context a query attends into
    block_size: int | None = None    # tokens per KV page
    dcp_size: int | None = None      # decode-context-parallel world size (1 = none)
    cache_dtype: str | None = None   # bfloat16 | fp8_ds_mla | nvfp4_ds_mla
    scale_rule: str | None = None    # pow2 | raw (fp8_ds_mla tile scales)
    value_regime: str | None = None  # normal | saturation | outliers | zero_tiles | tiny | peaked | degenerate
    sm_scale: float | None = None
    # what was compared, and how far apart
    kind: str = ""                   # a RowKind, or "" (see the module's docstring)
    exact: bool = field(init=False, default=False)  # kind == "exact" (a column before kind was one)
    metrics: Metrics = field(default_factory=Metrics)
    # verdict: the gated metric with the least headroom, its value and bound
    gate_metric: str = ""
    value: float = math.nan
    bound: float = math.nan
    headroom: float = math.nan   # bound / value (inf when value is 0); < 1 fails
    deviation: str = ""          # the implementation's known deviation that set the bound, if any
    passed: bool = True
    reason: str = ""
    # the finding this row's case is: the name of its case file under the run's failures/ ("" for
    # every other case, failing ones included: a campaign saves one finding, the rest is evidence)
    finding: str = ""
    # a failing pipeline case's first stage whose output differs from the reference's stage on the
    # same inputs (`equivalence.ops.stages`): where its cause lies; the pipeline's own name (its op)
    # where every stage matches on its own inputs (how they are put together differs); "" elsewhere,
    # or where its stages were not traced
    differing_stage: str = ""
    # timings (seconds)
    time_ref_s: float = math.nan
    time_impl_s: float = math.nan
    # Not stored: the process that made the row must know it, a report need not. The case left a
    # CUDA error (its implementation's, or the device's right after it), which poisons the context
    # (`equivalence.sandbox.device`).
    device_error: bool = field(default=False, metadata={"stored": False})

    def __post_init__(self) -> None:
        if self.kind and self.kind not in KINDS:
            raise ValueError(f"row kind {self.kind!r} is none of {', '.join(KINDS)}")
        # stored and shown as the plain strings they are (a `FailureKind`, `policy.Kind` or a
        # replay's source is one)
        self.kind, self.gate_metric, self.source = str(self.kind), str(self.gate_metric), str(self.source)
        self.exact = self.kind == RowKind.EXACT

    def line(self) -> str:
        """The row as a failure is printed: `out: bf16_units = 20.8 > 6: 312 / 512 elements ...`."""
        return line(self.tensor, self.gate_metric, self.value, self.bound, self.reason)

    def to_record(self) -> dict[str, Any]:
        """The row flat, COLUMNS in order: the metrics' stored fields in the place of `metrics`."""
        record: dict[str, Any] = {}
        for f in _STORED_OWN:
            if f.name == "metrics":
                record.update((m.name, getattr(self.metrics, m.name)) for m in _METRIC_FIELDS)
            else:
                record[f.name] = getattr(self, f.name)
        return record

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Row:
        """The Row of a record (`to_record`'s, or a stored row's): absent fields take their defaults,
        and `exact` follows from kind."""
        own = {k: v for k, v in record.items() if k not in _METRIC_NAMES and k != "exact"}
        return cls(**own, metrics=Metrics(**{k: v for k, v in record.items() if k in _METRIC_NAMES}))


# The stored columns, in order, as dataclass fields (name, annotation, default): Row's own, with
# the stored metrics in the place of `metrics`.
_STORED_OWN: tuple[Field, ...] = tuple(f for f in fields(Row) if f.metadata.get("stored", True))
STORED_FIELDS: tuple[Field, ...] = tuple(
    g for f in _STORED_OWN for g in (_METRIC_FIELDS if f.name == "metrics" else (f,)))
COLUMNS = tuple(f.name for f in STORED_FIELDS)



@dataclass(frozen=True)
class RowContext:
    """What every row of a block says besides its case and tensor, and what its caller hears while
    the block runs: one per run and source (`dataclasses.replace` for another source). `base` is
    the one place a row's identity is written."""

    run_id: str = ""
    source: str = "fuzz"       # corpus | kept | fuzz | rerun | shrink | replay | bench | ...
    label: str = ""            # what the rows call the implementation
    device: str = "cpu"
    # collects what the implementation's side reported (a stage that fell back to a portable one)
    notes: set[str] | None = field(default=None, compare=False)
    on_call: Callable[[], None] | None = field(default=None, compare=False)  # before each case's call

    def base(self, case: Case, identity: Mapping[str, Any], stages: Stages = ()) -> dict[str, Any]:
        """The identity columns of `case`'s rows: this context's, the case's, and its spec's
        `identity(case)` (op, path, case, knobs)."""
        return dict(run_id=self.run_id, case_id=case.case_id, impl=self.label, stages=stages, device=self.device,
                    seed=case.seed, source=self.source, **identity)
