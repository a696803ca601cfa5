"""Index conversion ops (exact): logical top-k -> physical rows, with and without DCP."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from mla_verify import reference
from mla_verify.equivalence.sandbox.call_guards import returned
from mla_verify.equivalence.cases.patterns import apply_patterns, distinct_rows, prefix_candidates
from mla_verify.equivalence.judge.policy import EXACT

from ..cases.draws import dcp_index_params, patterns
from ..cases.layouts import LAYOUTS, drawn, relayout
from ..cases.patterns import PATTERNS
from ..cases.profiles import Profile
from ..cases.schema import BLOCK, REQUESTS, TOPK, Flag, Int, OneOf, Params, SubsetOf, param
from ..spec import register
from .base import Check, ImplOutput, OpSpec
from .common import generator, knobs, randint


@dataclass(frozen=True)
class IndexParams(Params):
    """T tokens' top-k rows of logical positions, converted through a block table of R requests."""

    tokens: int = param(Int(1, 2**20))
    requests: int = param(REQUESTS)
    table_width: int = param(Int(1, 2**16))  # block-table columns
    topk: int = param(TOPK)
    block_size: int = param(BLOCK)
    invalid: tuple[str, ...] = param(SubsetOf(*PATTERNS), ())
    layout: str = param(OneOf(*LAYOUTS), "contiguous")  # of the inputs that may take one (equivalence.cases.layouts)

    @property
    def ranks(self) -> int:
        return 1

    def elements(self) -> int:
        return (self.tokens * (2 * self.topk + self.table_width * self.block_size * self.ranks)
                + self.requests * self.table_width)


def _common_inputs(g: torch.Generator, p: IndexParams, logical_tokens: int):
    req_id = randint(g, 0, p.requests, p.tokens)
    table = randint(g, 0, 4096, p.requests, p.table_width)
    idx = distinct_rows(g, prefix_candidates(torch.full((p.tokens,), logical_tokens, device=g.device)), p.topk)
    idx = apply_patterns(g, idx, p.invalid, out_of_range=(logical_tokens, logical_tokens + 8 * p.topk))
    return req_id.to(torch.int32), table.to(torch.int32), idx.to(torch.int32)


SINGLE_TILE_LIMIT = 4096  # upstream: one program per row iff K is a power of two or next_pow2(K) <= 4096


def multi_tile(topk: int) -> bool:
    """Upstream's converter splits a row over tiles racing on an atomic count: with counts the
    order within the valid prefix is unspecified (spec vllm_backend.md §5.2)."""
    return topk & (topk - 1) != 0 and 1 << (topk - 1).bit_length() > SINGLE_TILE_LIMIT


def _convert_params(p: Profile) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({
        "tokens": st.integers(1, p.max_tokens * 2), "requests": st.integers(1, p.max_requests),
        # 4224 and 6144: not powers of two past upstream's single-tile limit (its prefix order unspecified).
        "table_width": st.integers(1, 6), "topk": st.sampled_from(p.decode_topk + (4224, 6144)),
        "block_size": st.sampled_from((16,) + p.block_sizes), "stride_extra": st.sampled_from((0, 0, 1, 64)),
        "prefill": st.booleans(), "counts": st.booleans(), "mapping": st.booleans(), "invalid": patterns(PATTERNS),
        "layout": st.sampled_from(drawn("convert_index"))})


@dataclass(frozen=True)
class ConvertParams(IndexParams):
    stride_extra: int = param(Int(0, 2**16), 0)  # block_stride_rows = block_size + this (0: no stride given)
    prefill: bool = param(Flag(), False)         # some tokens read a prefill workspace
    counts: bool = param(Flag(), False)          # return_valid_counts
    mapping: bool = param(Flag(), False)         # idx_mapping: batch rows -> state rows


def _convert_inputs(p: ConvertParams, seed: int, device: str) -> dict:
    g = generator(seed, device)
    bs = p.block_size
    req_id, table, idx = _common_inputs(g, p, p.table_width * bs)
    mapping = None
    if p.mapping:
        # Batch row -> state row (HiSparse's request_state_indices): the table has a row per
        # state, some requests none (-1, which reads row 0).
        states = p.requests + 2
        table = randint(g, 0, 4096, states, p.table_width).to(torch.int32)
        mapping = torch.randperm(states, generator=g, device=device)[: p.requests].to(torch.int32)
        mapping = torch.where(randint(g, 0, 4, p.requests) == 0, -1, mapping).to(torch.int32)
    kwargs = {"req_id": req_id, "block_table": table, "topk_indices": idx, "block_size": bs,
              "block_stride_rows": bs + p.stride_extra if p.stride_extra else None,
              "prefill_request_ids": None, "prefill_workspace_starts": None,
              "return_valid_counts": p.counts, "idx_mapping": mapping}
    if p.prefill:
        num_prefills = max(1, p.requests // 2)
        kwargs["prefill_request_ids"] = randint(g, -1, num_prefills, p.tokens).to(torch.int32)
        starts = randint(g, 0, 2 * p.table_width * bs, num_prefills).sort().values
        kwargs["prefill_workspace_starts"] = (starts - starts[0]).to(torch.int32)
    return relayout("convert_index", kwargs, p.layout)


def named_indices(result, counts: bool) -> dict[str, torch.Tensor]:
    named = returned(result, ("indices", "valid_counts") if counts else ("indices",))
    idx = named["indices"]
    if counts and isinstance(idx, torch.Tensor) and idx.ndim == 2 and multi_tile(idx.shape[1]):
        # Multi-tile K: the valid prefix is compared as a set (each row's prefix sorted by its own count).
        cnt = named["valid_counts"]
        if isinstance(cnt, torch.Tensor) and cnt.shape == idx.shape[:1]:
            prefix = torch.arange(idx.shape[1], device=idx.device)[None, :] < cnt.to(idx.device).long()[:, None]
            key = torch.where(prefix, idx.long(), torch.iinfo(torch.int64).max)
            named["indices"] = torch.where(prefix, key.sort(dim=1).values, idx.long()).to(idx.dtype)
    return named


register(OpSpec(
    name="convert_index",
    stage="convert_index",
    params=ConvertParams,
    draw=_convert_params,
    inputs=_convert_inputs,
    reference=lambda kw, p: named_indices(reference.convert_index(**kw), kw["return_valid_counts"]),
    call=lambda subject, kw, p: ImplOutput(named_indices(subject.fn(**kw), kw["return_valid_counts"]),
                                           deviations=subject.deviations),
    checks=(Check("indices", EXACT), Check("valid_counts", EXACT)),
    knobs=lambda p: knobs(p, num_tokens=p.tokens, seq_len=p.table_width * p.block_size),
    doc="triton_convert_req_index_to_global_index: block table / stride rows / prefill workspace / idx_mapping, "
        "stable compaction (a set past one tile)",
), priority=0)


@dataclass(frozen=True)
class DcpIndexParams(IndexParams):
    """IndexParams on rank dcp_rank of dcp_size: the top-k rows are global positions."""

    dcp_size: int = param(Int(1, 64), kw_only=True)
    dcp_rank: int = param(Int(0, 63), kw_only=True)
    interleave: int = param(Int(1, 1024), kw_only=True)
    compact: bool = param(Flag(), kw_only=True)   # compact_valid_to_front

    @property
    def ranks(self) -> int:
        return self.dcp_size

    def problem(self) -> str | None:
        return None if self.dcp_rank < self.dcp_size else "dcp_rank must be below dcp_size"


def _dcp_inputs(p: DcpIndexParams, seed: int, device: str) -> dict:
    g = generator(seed, device)
    req_id, table, idx = _common_inputs(g, p, p.table_width * p.block_size * p.dcp_size)
    return relayout("dcp_convert_index", {
        "req_id": req_id, "block_table": table, "topk_indices": idx, "block_size": p.block_size, "dcp_size": p.dcp_size,
        "dcp_rank": p.dcp_rank, "interleave": p.interleave, "compact_valid_to_front": p.compact}, p.layout)


DCP_CONVERT_INDEX = register(OpSpec(
    name="dcp_convert_index",
    stage="dcp_convert_index",
    params=DcpIndexParams,
    draw=lambda p: dcp_index_params(p, layout=st.sampled_from(drawn("dcp_convert_index"))),
    inputs=_dcp_inputs,
    reference=lambda kw, p: {"indices": reference.dcp_convert_index(**kw)},
    call=lambda subject, kw, p: ImplOutput({"indices": subject.fn(**kw)}, deviations=subject.deviations),
    checks=(Check("indices", EXACT),),
    knobs=lambda p: knobs(p, num_tokens=p.tokens, seq_len=p.table_width * p.block_size * p.dcp_size),
    doc="triton_filter_and_convert_dcp_index: this rank's shard of global top-k, through its block table",
), priority=0)
