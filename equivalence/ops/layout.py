"""Exact shape-and-copy ops: the query concat, prefill chunk bounds and spec-decode reshapes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from mla_verify import reference
from mla_verify.equivalence.errors import ContractError
from mla_verify.equivalence.judge.policy import EXACT
from mla_verify.equivalence.cases.values import q_values

from ..cases.layouts import LAYOUTS, drawn, relayout
from ..cases.profiles import Profile
from ..cases.schema import HEADS, Flag, Int, Ints, OneOf, Params, param
from ..spec import register
from .base import Check, ImplOutput, OpSpec
from .common import generator, knobs, single


def _concat_params(p: Profile) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({"tokens": st.integers(1, p.max_tokens * 2), "heads": st.sampled_from(p.heads),
                                  "layout": st.sampled_from(drawn("concat_mla_q"))})


@dataclass(frozen=True)
class ConcatParams(Params):
    tokens: int = param(Int(1, 2**20))
    heads: int = param(HEADS)
    layout: str = param(OneOf(*LAYOUTS), "contiguous")  # contiguous: the views of one buffer as built

    def elements(self) -> int:
        return self.tokens * self.heads * 1216


def _concat_inputs(p: ConcatParams, seed: int, device: str) -> dict:
    g = generator(seed, device)
    # Strided views of a wider buffer, as the MLA layer hands them over.
    base = q_values(g, (p.tokens, p.heads, 640), "normal")
    return relayout("concat_mla_q", {"ql_nope": base[..., :512], "q_pe": base[..., 560:624]}, p.layout)


register(OpSpec(
    name="concat_mla_q",
    stage="concat_mla_q",
    params=ConcatParams,
    draw=_concat_params,
    inputs=_concat_inputs,
    reference=lambda kw, p: {"q": reference.concat_mla_q(kw["ql_nope"], kw["q_pe"])},
    call=single(lambda q: {"q": q}),
    checks=(Check("q", EXACT, contiguous=True),),
    knobs=lambda p: knobs(p, num_tokens=p.tokens),
    doc="q[t,h] = [ql_nope (512) | q_pe (64)], bf16 copy",
), priority=0)


def _chunk_params(p: Profile) -> st.SearchStrategy[dict]:
    def sizes(lens):
        # Workspaces that some run of requests fills exactly: where <= and < part ways.
        exact = [t for t in (sum(lens[i:j]) for i in range(len(lens)) for j in range(i + 1, len(lens) + 1)) if t >= max(lens)]
        return st.one_of(st.sampled_from(exact), st.integers(max(lens), 2 * sum(lens)))

    return st.lists(st.integers(1, p.max_context), min_size=1, max_size=p.max_requests).flatmap(
        lambda lens: st.fixed_dictionaries({"seq_lens": st.just(lens), "workspace_size": sizes(lens)}))


@dataclass(frozen=True)
class ChunkParams(Params):
    seq_lens: tuple[int, ...] = param(Ints(1, 2**31, 2**16))
    workspace_size: int = param(Int(1, 2**40))

    def elements(self) -> int:
        return len(self.seq_lens)

    def problem(self) -> str | None:
        return None if self.workspace_size >= max(self.seq_lens, default=0) else "workspace_size is below a sequence"


def _chunks_tensor(chunks) -> torch.Tensor:
    try:
        return torch.tensor([list(c) for c in chunks], dtype=torch.int64).reshape(-1, 2)
    except (TypeError, ValueError, RuntimeError):
        raise ContractError(f"chunks: returned {chunks!r:.80}; the contract says a list of (start, end) pairs") from None


register(OpSpec(
    name="split_prefill_chunks",
    stage="split_prefill_chunks",
    params=ChunkParams,
    draw=_chunk_params,
    inputs=lambda p, seed, device: {"seq_lens": list(p.seq_lens), "workspace_size": p.workspace_size},
    reference=lambda kw, p: {"chunks": _chunks_tensor(reference.split_prefill_chunks(**kw))},
    call=single(lambda chunks: {"chunks": _chunks_tensor(chunks)}),
    checks=(Check("chunks", EXACT),),
    knobs=lambda p: knobs(p, seq_len=max(p.seq_lens)),
    doc="greedy chunks of requests whose total length fits the prefill workspace (<=)",
), priority=0)


@dataclass(frozen=True)
class SpecReshapeParams(Params):
    """num_decodes requests of s tokens each; four_d: the output arrives [B, s, H, D] (else 3-D)."""

    num_decodes: int = param(Int(1, 2**16))
    s: int = param(Int(1, 64))
    heads: int = param(HEADS)
    four_d: bool = param(Flag(), True)
    layout: str = param(OneOf(*LAYOUTS), "contiguous")  # of the input (equivalence.cases.layouts)

    def elements(self) -> int:
        return self.num_decodes * self.s * self.heads * 1152


def _spec_reshape_params(op: str):
    def draw(p: Profile) -> st.SearchStrategy[dict]:
        return st.fixed_dictionaries({"num_decodes": st.integers(1, p.max_requests), "s": st.integers(1, 4),
                                      "heads": st.sampled_from(p.heads), "four_d": st.booleans(),
                                      "layout": st.sampled_from(drawn(op))})

    return draw


def _spec_q_inputs(p: SpecReshapeParams, seed: int, device: str) -> dict:
    q = q_values(generator(seed, device), (p.num_decodes * p.s, p.heads, 576), "normal")
    return relayout("reshape_query_for_spec_decode", {"q": q, "num_decodes": p.num_decodes}, p.layout)


register(OpSpec(
    name="reshape_query_for_spec_decode",
    stage="reshape_query_for_spec_decode",
    params=SpecReshapeParams,
    draw=_spec_reshape_params("reshape_query_for_spec_decode"),
    inputs=_spec_q_inputs,
    reference=lambda kw, p: {"q": reference.reshape_query_for_spec_decode(**kw)},
    call=single(lambda q: {"q": q}),
    checks=(Check("q", EXACT),),
    knobs=lambda p: knobs(p, num_tokens=p.num_decodes * p.s),
    views=True,
    doc="[B*s, H, D] -> [B, s, H, D], token-major",
), priority=0)


def _spec_out_inputs(p: SpecReshapeParams, seed: int, device: str) -> dict:
    shape = (p.num_decodes, p.s, p.heads, 512) if p.four_d else (p.num_decodes * p.s, p.heads, 512)
    return relayout("reshape_attn_output_for_spec_decode", {"out": q_values(generator(seed, device), shape, "normal")},
                    p.layout)


register(OpSpec(
    name="reshape_attn_output_for_spec_decode",
    stage="reshape_attn_output_for_spec_decode",
    params=SpecReshapeParams,
    draw=_spec_reshape_params("reshape_attn_output_for_spec_decode"),
    inputs=_spec_out_inputs,
    reference=lambda kw, p: {"out": reference.reshape_attn_output_for_spec_decode(**kw)},
    call=lambda subject, kw, p: ImplOutput({"out": subject.fn(**kw)}, deviations=subject.deviations),
    checks=(Check("out", EXACT),),
    knobs=lambda p: knobs(p, num_tokens=p.num_decodes * p.s),
    views=True,
    doc="[B, s, H, D] -> [B*s, H, D]; 3-D unchanged",
), priority=0)
