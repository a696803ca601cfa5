"""The params several specs share, typed: the attention ops' problems and forward_mqa's batches.

The properties pose these same problems (their knobs extend these classes) and the batch builders
(`equivalence.cases.batch`, `equivalence.cases.hisparse_batch`) read them; params only one op has live in its
module (`equivalence.ops`). A field's comment says what it sets; its Param what a case file may hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from .builders import VERSIONS as BUILDERS
from .layouts import LAYOUTS
from .patterns import FORWARD_PATTERNS, PATTERNS
from .schema import (
    BLOCK,
    HEADS,
    PAD,
    ROWS,
    SEQ_LENS,
    SM_SCALE,
    TOKENS,
    TOPK,
    Flag,
    Int,
    Ints,
    OneOf,
    Params,
    Real,
    SubsetOf,
    blocks,
    param,
)
from .values import COVERING_REGIMES, REGIMES

REGIME = OneOf(*REGIMES, *COVERING_REGIMES)
SCALE_RULE = OneOf("pow2", "raw")  # fp8_ds_mla tile scales: amax / 448 rounded up to a power of two, or raw
DECODE_PATTERNS = ("scattered", "whole_row", "duplicates", "boundaries", "runs")  # only -1 is invalid for the decode kernel
WORLD_SIZES = (2, 4, 8)              # the multi-process DCP op's rank counts
COMBINES = ("ag_rs", "a2a")          # ... and its combines: all-gather + reduce-scatter, all-to-all


@dataclass(frozen=True)
class PrefillParams(Params):
    """A sparse_prefill problem: T tokens of H heads over N kv rows, K top-k entries each."""

    tokens: int = param(TOKENS)
    heads: int = param(HEADS)
    kv_rows: int = param(ROWS)
    topk: int = param(TOPK)
    value_regime: str = param(REGIME)
    sm_scale: float = param(SM_SCALE)
    invalid: tuple[str, ...] = param(SubsetOf(*PATTERNS), ())      # invalid-index patterns (equivalence.cases.patterns)
    # per-token lengths: none, drawn, 0/1/K-1/K, drawn with anything past them (out-of-range values, not -1)
    topk_length: str = param(OneOf("none", "random", "edges", "garbage"), "none")
    sink: str = param(OneOf("none", "finite", "inf"), "none")         # attention sink per head
    layout: str = param(OneOf(*LAYOUTS), "contiguous")                # of the inputs that may take one (equivalence.cases.layouts)
    inputs: int = param(OneOf(*BUILDERS), 1)                      # the input builder's version (equivalence.cases.builders)

    def elements(self) -> int:
        return self.tokens * (self.heads * 1088 + self.kv_rows + self.topk) + self.kv_rows * 576


@dataclass(frozen=True)
class DecodeParams(Params):
    """A sparse_decode_fp8 problem: B requests of S query tokens over fp8_ds_mla pages."""

    batch: int = param(Int(1, 4096))
    s_q: int = param(Int(1, 64))
    heads: int = param(HEADS)
    topk: int = param(TOPK)
    seq_lens: tuple[int, ...] = param(SEQ_LENS)  # one per request (`requests`)
    page_size: int = param(BLOCK)
    sm_scale: float = param(SM_SCALE)
    value_regime: str = param(REGIME)
    scale_rule: str = param(SCALE_RULE)
    invalid: tuple[str, ...] = param(SubsetOf(*DECODE_PATTERNS), ())
    stride_pad: int = param(PAD, 0)              # slots between pages past the page size
    layout: str = param(OneOf(*LAYOUTS), "contiguous")  # of q and the indices (equivalence.cases.layouts)
    inputs: int = param(OneOf(*BUILDERS), 1)                      # the input builder's version (equivalence.cases.builders)

    @property
    def requests(self) -> int:
        """The requests `seq_lens` holds lengths of."""
        return self.batch

    def elements(self) -> int:
        tokens = self.batch * self.s_q
        cache = blocks(self.seq_lens, self.page_size) * (self.page_size + self.stride_pad) * 656
        return cache + tokens * (self.heads * 1088 + self.topk + max(self.seq_lens))

    def problem(self) -> str | None:
        return None if len(self.seq_lens) == self.requests else "seq_lens must hold one length per request (batch)"


@dataclass(frozen=True)
class ForwardParams(Params):
    """A forward_mqa batch (`equivalence.cases.batch`; HiSparse: `equivalence.cases.hisparse_batch`)."""

    cache_dtype: str = param(OneOf("bfloat16", "fp8_ds_mla", "nvfp4_ds_mla"))
    heads: int = param(HEADS)
    query_lens: tuple[int, ...] = param(Ints(0, 2**20, 4096))   # per request, decodes first
    context_lens: tuple[int, ...] = param(Ints(0, 2**22, 4096))
    block_size: int = param(BLOCK)
    topk: int = param(TOPK)
    sm_scale: float = param(SM_SCALE)
    value_regime: str = param(REGIME)
    invalid: tuple[str, ...] = param(SubsetOf(*FORWARD_PATTERNS), ())
    scale_rule: str = param(SCALE_RULE, "pow2")
    stride_pad: int = param(PAD, 0)
    spare_blocks: int = param(Int(0, 1024), 1)                   # blocks no request owns (poisoned)
    shuffle: bool = param(Flag(), True)                          # blocks allocated in random order
    table_pad: int = param(Int(0, 64), 0)                        # block-table columns past the longest request
    mqa: str = param(OneOf("all", "decodes"), "all")             # which tokens reach forward_mqa
    q_form: str = param(OneOf("tensor", "tuple"), "tensor")      # q whole, or (ql_nope, q_pe)
    arch: str = param(OneOf("sm90", "sm100"), "sm90")
    max_decode_query_len: int = param(Int(1, 64), 1)
    max_model_len: int | None = param(Int(1, 2**23, nullable=True), None)  # None: the longest sequence
    workspace_size: int | None = param(Int(1, 2**23, nullable=True), None)  # prefill chunking; None: one chunk
    dcp_size: int = param(Int(1, 8), 1)
    interleave: int = param(Int(1, 1024), 1)                     # DCP: tokens per run on one rank
    pad_rows: int = param(Int(0, 64), 0)                         # CUDA-graph padding rows past the last request
    # HiSparse (equivalence.cases.hisparse_batch)
    hisparse: bool = param(Flag(), False)
    layers: int = param(Int(1, 4), 1)
    resident_frac: float = param(Real(0, 1), 0.5)                # pages already in the hot cache
    hot_slack: int | None = param(Int(-1, 2**15, nullable=True), None)  # hot rows past the need; None: topk
    prior_hits: float = param(Real(0, 1), 0.0)
    slot_perm: bool = param(Flag(), False)
    stride_blocks: int = param(Int(1, 8), 1)
    spare_state_rows: int = param(Int(0, 64), 0)
    swap_rows: str = param(OneOf("fit", "below"), "fit")         # swap-in budget: the decodes, or one below
    buffer_rows: int | None = param(Int(1, 2**20, nullable=True), None)  # persistent buffer; None: tokens + 1
    inputs: int = param(OneOf(*BUILDERS), 1)                      # the input builder's version (equivalence.cases.builders)

    @property
    def seq_lens(self) -> list[int]:
        return [c + n for c, n in zip(self.context_lens, self.query_lens)]

    def elements(self) -> int:
        seqs, dcp, tokens = self.seq_lens, self.dcp_size, sum(self.query_lens) + self.pad_rows
        cache = (blocks(seqs, self.block_size) + self.spare_blocks) * (self.block_size + self.stride_pad)
        copies = 3 * self.layers if self.hisparse else 1  # HiSparse: per layer a host cache, a slab, the logical cache
        return copies * (dcp * cache * 656 + sum(seqs) * 576 + tokens * self.heads * dcp * 1088
                         + tokens * (max(seqs, default=0) + self.topk))

    def problem(self) -> str | None:
        if len(self.query_lens) != len(self.context_lens) or not self.query_lens:
            return "query_lens and context_lens must be non-empty lists of one length"
        if self.hisparse:
            if self.cache_dtype == "nvfp4_ds_mla" or self.dcp_size > 1 or self.mqa != "all":
                return "hisparse needs a bfloat16 or fp8_ds_mla cache, no DCP and every token through forward_mqa"
            if "beyond_seq" in self.invalid or self.pad_rows or 0 in self.query_lens:
                return "hisparse cases have no indices past the sequence, padding rows or zero-length requests (undefined upstream)"
            if self.swap_rows == "below" and self.resident_frac < 1:
                return "swap_rows 'below' takes the resident path, which needs every page resident (resident_frac 1)"
        return None


@dataclass(frozen=True)
class DcpParams(ForwardParams):
    """A forward_mqa batch run by `dcp_size` rank processes, combined by `combine`."""

    dcp_size: int = param(OneOf(*WORLD_SIZES), kw_only=True)
    combine: str = param(OneOf(*COMBINES), kw_only=True)
