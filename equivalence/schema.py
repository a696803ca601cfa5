"""What a Case may hold: the parameter types and ranges each spec's schema is made of, the groups
of them several specs share, and a budget on the elements a case's inputs allocate (`MAX_ELEMENTS`).

Replay checks a case file here before anything is built: a hand-edited or corrupted file (topk
10**9, a string where a count goes, an op that does not exist) is a usage error with the reason,
not gigabytes of allocation or a traceback. The ranges are wider than any fuzz profile draws
(every drawn case validates: tests/test_hostile.py) and as wide as the kernels' contracts allow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .batch import INVALID_PATTERNS
from .patterns import PATTERNS
from .values import REGIMES

MAX_ELEMENTS = 2**31  # tensor elements a case's inputs (and their index candidates) may hold in all
DECODE_PATTERNS = ("scattered", "whole_row", "duplicates", "boundaries")


@dataclass(frozen=True)
class Param:
    kind: type                         # int | float | bool | str | list
    lo: float | None = None
    hi: float | None = None
    choices: tuple = ()
    item: "Param | None" = None        # a list's elements
    max_len: int = 0
    optional: bool = False
    nullable: bool = False             # JSON null allowed

    def problem(self, value: Any) -> str | None:
        if value is None:
            return None if self.nullable else "null"
        if self.kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        elif self.kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, self.kind)
        if not ok:
            what = {float: "a number", int: "an integer", bool: "true or false", str: "a string", list: "a list"}
            return f"{value!r:.40} is not {what[self.kind]}"
        if self.choices and value not in self.choices:
            return f"{value!r} is not one of {', '.join(map(str, self.choices))}"
        if self.lo is not None and not self.lo <= value <= self.hi:
            return f"{value!r} is outside [{self.lo:g}, {self.hi:g}]"
        if self.item is not None:
            if len(value) > self.max_len:
                return f"a list of {len(value)}, at most {self.max_len}"
            for i, x in enumerate(value):
                if (why := self.item.problem(x)) is not None:
                    return f"[{i}]: {why}"
        return None


def Int(lo: int, hi: int, **kw: Any) -> Param:
    return Param(int, lo, hi, **kw)


def Real(lo: float, hi: float, **kw: Any) -> Param:
    return Param(float, lo, hi, **kw)


def Flag(**kw: Any) -> Param:
    return Param(bool, **kw)


def OneOf(*choices: Any, **kw: Any) -> Param:
    return Param(type(choices[0]), choices=choices, **kw)


def Ints(lo: int, hi: int, max_len: int, **kw: Any) -> Param:
    return Param(list, item=Int(lo, hi), max_len=max_len, **kw)


def SubsetOf(*choices: str) -> Param:
    return Param(list, item=OneOf(*choices), max_len=len(choices), optional=True)


@dataclass(frozen=True)
class Schema:
    params: Mapping[str, Param]
    elements: Callable[[Mapping], int]             # what the inputs allocate, roughly
    check: Callable[[Mapping], str | None] = lambda p: None   # relations between parameters


TOKENS, HEADS, TOPK, REQUESTS = Int(1, 2**16), Int(1, 128), Int(1, 2**14), Int(1, 4096)
BLOCK, PAD, ROWS = Int(1, 1024), Int(0, 1024, optional=True), Int(1, 2**22)
SEQ_LENS = Ints(1, 2**22, 4096)
VALUES = dict(value_regime=OneOf(*REGIMES), scale_rule=OneOf("pow2", "raw"))
SM_SCALE = Real(1e-6, 100.0)


def blocks(seq_lens, block: int) -> int:
    return sum(-(-n // block) for n in seq_lens) + 1


def seq_lens_of(p: Mapping) -> list[int]:
    return [c + n for c, n in zip(p["context_lens"], p["query_lens"])]


def forward_elements(p: Mapping) -> int:
    seqs, dcp, tokens = seq_lens_of(p), p.get("dcp_size", 1), sum(p["query_lens"]) + p.get("pad_rows", 0)
    cache = (blocks(seqs, p["block_size"]) + p.get("spare_blocks", 1)) * (p["block_size"] + p.get("stride_pad", 0))
    # HiSparse: per layer a host cache, a slab and the logical cache.
    copies = 3 * p.get("layers", 1) if p.get("hisparse") else 1
    return copies * (dcp * cache * 656 + sum(seqs) * 576 + tokens * p["heads"] * dcp * 1088
                     + tokens * (max(seqs, default=0) + p["topk"]))


def forward_check(p: Mapping) -> str | None:
    if len(p["query_lens"]) != len(p["context_lens"]) or not p["query_lens"]:
        return "query_lens and context_lens must be non-empty lists of one length"
    if p.get("hisparse"):
        if p["cache_dtype"] == "nvfp4_ds_mla" or p.get("dcp_size", 1) > 1 or p.get("mqa", "all") != "all":
            return "hisparse needs a bfloat16 or fp8_ds_mla cache, no DCP and every token through forward_mqa"
        if "beyond_seq" in p["invalid"] or p.get("pad_rows", 0) or 0 in p["query_lens"]:
            return "hisparse cases have no indices past the sequence, padding rows or zero-length requests (undefined upstream)"
        if p.get("swap_rows") == "below" and p.get("resident_frac", 0.5) < 1:
            return "swap_rows 'below' takes the resident path, which needs every page resident (resident_frac 1)"
    return None


FORWARD = dict(
    cache_dtype=OneOf("bfloat16", "fp8_ds_mla", "nvfp4_ds_mla"), heads=HEADS,
    query_lens=Ints(0, 2**20, 4096), context_lens=Ints(0, 2**22, 4096), block_size=BLOCK, stride_pad=PAD,
    spare_blocks=Int(0, 1024, optional=True), shuffle=Flag(optional=True), table_pad=Int(0, 64, optional=True),
    topk=TOPK, sm_scale=SM_SCALE, value_regime=VALUES["value_regime"], scale_rule=OneOf("pow2", "raw", optional=True),
    invalid=SubsetOf(*INVALID_PATTERNS), mqa=OneOf("all", "decodes", optional=True),
    q_form=OneOf("tensor", "tuple", optional=True), arch=OneOf("sm90", "sm100", optional=True),
    max_decode_query_len=Int(1, 64, optional=True), max_model_len=Int(1, 2**23, optional=True),
    workspace_size=Int(1, 2**23, optional=True, nullable=True), dcp_size=Int(1, 8, optional=True),
    interleave=Int(1, 1024, optional=True), pad_rows=Int(0, 64, optional=True),
    # HiSparse (equivalence.hisparse_batch)
    hisparse=Flag(optional=True), layers=Int(1, 4, optional=True), resident_frac=Real(0, 1, optional=True),
    hot_slack=Int(-1, 2**15, optional=True), prior_hits=Real(0, 1, optional=True), slot_perm=Flag(optional=True),
    stride_blocks=Int(1, 8, optional=True), spare_state_rows=Int(0, 64, optional=True),
    swap_rows=OneOf("fit", "below", optional=True), buffer_rows=Int(1, 2**20, optional=True),
)
PREFILL = dict(tokens=TOKENS, heads=HEADS, kv_rows=ROWS, topk=TOPK, value_regime=VALUES["value_regime"],
               sm_scale=SM_SCALE, invalid=SubsetOf(*PATTERNS),
               topk_length=OneOf("none", "random", "edges", optional=True),
               sink=OneOf("none", "finite", "inf", optional=True))
DECODE = dict(batch=Int(1, 4096), s_q=Int(1, 64), heads=HEADS, topk=TOPK, seq_lens=SEQ_LENS, page_size=BLOCK,
              stride_pad=PAD, sm_scale=SM_SCALE, invalid=SubsetOf(*DECODE_PATTERNS), **VALUES)
INDEX = dict(tokens=Int(1, 2**20), requests=REQUESTS, table_width=Int(1, 2**16), topk=TOPK, block_size=BLOCK,
             invalid=SubsetOf(*PATTERNS))
MERGE = dict(ranks=Int(1, 64), tokens=Int(1, 2**20), heads=HEADS, empty_frac=Real(0, 1, optional=True),
             junk=Flag(optional=True))


def prefill_elements(p: Mapping) -> int:
    return p["tokens"] * (p["heads"] * 1088 + p["kv_rows"] + p["topk"]) + p["kv_rows"] * 576


def decode_elements(p: Mapping) -> int:
    tokens = p["batch"] * p["s_q"]
    cache = blocks(p["seq_lens"], p["page_size"]) * (p["page_size"] + p.get("stride_pad", 0)) * 656
    return cache + tokens * (p["heads"] * 1088 + p["topk"] + max(p["seq_lens"]))


def decode_check(p: Mapping) -> str | None:
    # padding_and_order's decode target keeps the padded batch's lengths (batch + pad_tokens).
    requests = p["batch"] + p.get("pad_tokens", 0)
    return None if len(p["seq_lens"]) == requests else "seq_lens must hold one length per request (batch)"


def index_elements(p: Mapping, ranks: int = 1) -> int:
    return p["tokens"] * (2 * p["topk"] + p["table_width"] * p["block_size"] * ranks) + p["requests"] * p["table_width"]


def gather_elements(p: Mapping) -> int:
    return (blocks(p["seq_lens"], p["block_size"]) * (p["block_size"] + p.get("stride_pad", 0)) * 656
            + sum(p["seq_lens"]) * 576)


def check_params(op: str, schema: Schema, params: Mapping) -> None:
    """Raise ValueError with the reason unless `params` are within `schema`: every parameter of
    the right type and range, none unknown, and inputs within the size budget."""
    for name in params:
        if name not in schema.params:
            raise ValueError(f"{op}: unknown parameter {name!r}; known: {', '.join(sorted(schema.params))}")
    for name, param in schema.params.items():
        if name not in params:
            if not param.optional:
                raise ValueError(f"{op}: parameter {name!r} is missing")
            continue
        if (why := param.problem(params[name])) is not None:
            raise ValueError(f"{op}: parameter {name}: {why}")
    if (why := schema.check(params)) is not None:
        raise ValueError(f"{op}: {why}")
    elements = schema.elements(params)
    if elements > MAX_ELEMENTS:
        raise ValueError(f"{op}: its inputs would hold ~{elements:.3g} elements, over the budget of "
                         f"{MAX_ELEMENTS:.3g} (a case file is data: sizes stay bounded)")
