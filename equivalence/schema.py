"""What a Case may hold: for every op and property, each parameter's type and range, and a budget
on the elements its inputs allocate (`MAX_ELEMENTS`).

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


def _blocks(seq_lens, block: int) -> int:
    return sum(-(-n // block) for n in seq_lens) + 1


def _seq_lens(p: Mapping) -> list[int]:
    return [c + n for c, n in zip(p["context_lens"], p["query_lens"])]


def _forward_elements(p: Mapping) -> int:
    seqs, dcp, tokens = _seq_lens(p), p.get("dcp_size", 1), sum(p["query_lens"]) + p.get("pad_rows", 0)
    cache = (_blocks(seqs, p["block_size"]) + p.get("spare_blocks", 1)) * (p["block_size"] + p.get("stride_pad", 0))
    # HiSparse: per layer a host cache, a slab and the logical cache.
    copies = 3 * p.get("layers", 1) if p.get("hisparse") else 1
    return copies * (dcp * cache * 656 + sum(seqs) * 576 + tokens * p["heads"] * dcp * 1088
                     + tokens * (max(seqs, default=0) + p["topk"]))


def _forward_check(p: Mapping) -> str | None:
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


def _prefill_elements(p: Mapping) -> int:
    return p["tokens"] * (p["heads"] * 1088 + p["kv_rows"] + p["topk"]) + p["kv_rows"] * 576


def _decode_elements(p: Mapping) -> int:
    tokens = p["batch"] * p["s_q"]
    cache = _blocks(p["seq_lens"], p["page_size"]) * (p["page_size"] + p.get("stride_pad", 0)) * 656
    return cache + tokens * (p["heads"] * 1088 + p["topk"] + max(p["seq_lens"]))


def _decode_check(p: Mapping) -> str | None:
    # padding_and_order's decode target keeps the padded batch's lengths (batch + pad_tokens).
    requests = p["batch"] + p.get("pad_tokens", 0)
    return None if len(p["seq_lens"]) == requests else "seq_lens must hold one length per request (batch)"


def _index_elements(p: Mapping, ranks: int = 1) -> int:
    return p["tokens"] * (2 * p["topk"] + p["table_width"] * p["block_size"] * ranks) + p["requests"] * p["table_width"]


def _gather_elements(p: Mapping) -> int:
    return (_blocks(p["seq_lens"], p["block_size"]) * (p["block_size"] + p.get("stride_pad", 0)) * 656
            + sum(p["seq_lens"]) * 576)


SCHEMAS: dict[str, Schema] = {
    **{op: Schema(dict(n=Int(1, 2**22), **VALUES), lambda p: p["n"] * 1232)
       for op in ("quantize_fp8_ds_mla", "dequantize_fp8_ds_mla")},
    "write_fp8_ds_mla_cache": Schema(
        dict(n=Int(1, 2**22), num_blocks=Int(1, 2**20), block_size=BLOCK, stride_pad=PAD,
             skip_frac=Real(0, 1, optional=True), **VALUES),
        lambda p: p["num_blocks"] * (p["block_size"] + p.get("stride_pad", 0)) * 1312 + p["n"] * 577,
        lambda p: None if p["n"] <= p["num_blocks"] * p["block_size"] else "n exceeds num_blocks * block_size slots"),
    "sparse_prefill": Schema(PREFILL, _prefill_elements),
    "sparse_decode_fp8": Schema(DECODE, _decode_elements, _decode_check),
    "convert_index": Schema(dict(INDEX, stride_extra=Int(0, 2**16, optional=True), prefill=Flag(optional=True),
                                 counts=Flag(optional=True), mapping=Flag(optional=True)), _index_elements),
    "dcp_convert_index": Schema(
        dict(INDEX, dcp_size=Int(1, 64), dcp_rank=Int(0, 63), interleave=Int(1, 1024), compact=Flag()),
        lambda p: _index_elements(p, p["dcp_size"]),
        lambda p: None if p["dcp_rank"] < p["dcp_size"] else "dcp_rank must be below dcp_size"),
    **{op: Schema(dict(seq_lens=SEQ_LENS, block_size=BLOCK, stride_pad=PAD, table_pad=Int(0, 64, optional=True),
                       shuffle=Flag(optional=True), **VALUES), _gather_elements)
       for op in ("gather_upconvert_fp8", "gather_upconvert_nvfp4")},
    "dcp_merge": Schema(MERGE, lambda p: p["ranks"] * p["tokens"] * p["heads"] * 1026),
    "concat_mla_q": Schema(dict(tokens=Int(1, 2**20), heads=HEADS), lambda p: p["tokens"] * p["heads"] * 1216),
    "split_prefill_chunks": Schema(
        dict(seq_lens=Ints(1, 2**31, 2**16), workspace_size=Int(1, 2**40)), lambda p: len(p["seq_lens"]),
        lambda p: None if p["workspace_size"] >= max(p["seq_lens"], default=0) else "workspace_size is below a sequence"),
    **{op: Schema(dict(num_decodes=Int(1, 2**16), s=Int(1, 64), heads=HEADS, four_d=Flag(optional=True)),
                  lambda p: p["num_decodes"] * p["s"] * p["heads"] * 1152)
       for op in ("reshape_query_for_spec_decode", "reshape_attn_output_for_spec_decode")},
    "forward_mqa": Schema(FORWARD, _forward_elements, _forward_check),
    "dcp": Schema(dict(FORWARD, dcp_size=OneOf(2, 4, 8), combine=OneOf("ag_rs", "a2a")), _forward_elements,
                  _forward_check),
}

# A property case: {"target": ..., the target op's params, the property's knobs}.
PROPERTY_KNOBS: dict[str, dict[str, Param]] = {
    "split_invariance": dict(parts=Int(2, 64), scheme=OneOf("random", "contiguous", "residue")),
    "decode_equals_prefill": {},
    "padding_and_order": dict(pad_tokens=Int(1, 1024, optional=True), pad_rows=OneOf("live", "empty", optional=True),
                              pad_heads=Int(0, 128, optional=True), wider=Int(1, 2**14, optional=True),
                              pad_columns=Int(1, 64, optional=True), pad_fill=OneOf("null", "blocks", optional=True)),
    "batch_invariance": dict(alone=Ints(0, 4095, 64, optional=True)),
    "spec_decode": {},
    "dcp_size_one": {},
    "determinism": {},
    "hisparse_equals_plain": {},
}


def schema_of(op: str, params: Mapping) -> Schema:
    """The schema of `op` (for "property:NAME", of its target's op plus the property's knobs)."""
    if not op.startswith("property:"):
        if op not in SCHEMAS:
            raise ValueError(f"unknown op {op!r}; known: {', '.join(sorted(SCHEMAS))}")
        return SCHEMAS[op]
    from .properties import get_property

    name = op.removeprefix("property:")
    try:
        prop = get_property(op)
    except KeyError as exc:
        raise ValueError(str(exc.args[0])) from None
    target = params.get("target")
    if target not in prop.targets:
        raise ValueError(f"{op}: target {target!r} is not one of {', '.join(prop.targets)}")
    base = SCHEMAS[target]
    return Schema({**base.params, **PROPERTY_KNOBS.get(name, {}), "target": OneOf(*prop.targets)},
                  base.elements, base.check)


def validate_case(data: Any) -> None:
    """Raise ValueError with the reason unless `data` (a case's JSON object) is within its op's
    schema: known op, every parameter of the right type and range, no unknown ones, and inputs
    within the size budget."""
    if not isinstance(data, dict):
        raise ValueError(f"a case is a JSON object, not a {type(data).__name__}")
    op, params, seed = data.get("op"), data.get("params", {}), data.get("seed", 0)
    if not isinstance(op, str):
        raise ValueError(f"case op {op!r} is not a string")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise ValueError(f"case seed {seed!r} is not an integer in [0, 2**63)")
    if not isinstance(params, dict):
        raise ValueError(f"case params of {op} are not an object")
    schema = schema_of(op, params)
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
