"""Exact shape-and-copy ops: the query concat, prefill chunk bounds and spec-decode reshapes."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from mla_verify import reference
from mla_verify.equivalence.contract import ContractError
from mla_verify.equivalence.policy import EXACT
from mla_verify.equivalence.values import q_values

from ..profiles import Profile
from ..schema import Flag, HEADS, Int, Ints, Schema
from ..spec import register
from .base import Check, ImplOutput, OpSpec
from .common import generator, knobs, single


def _concat_params(p: Profile) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({"tokens": st.integers(1, p.max_tokens * 2), "heads": st.sampled_from(p.heads)})


def _concat_inputs(p, seed, device):
    g = generator(seed, device)
    # Strided views of a wider buffer, as the MLA layer hands them over.
    base = q_values(g, (p["tokens"], p["heads"], 640), "normal")
    return {"ql_nope": base[..., :512], "q_pe": base[..., 560:624]}


register(OpSpec(
    name="concat_mla_q",
    stage="concat_mla_q",
    schema=Schema(dict(tokens=Int(1, 2**20), heads=HEADS), lambda p: p["tokens"] * p["heads"] * 1216),
    draw=_concat_params,
    inputs=_concat_inputs,
    reference=lambda kw, p: {"q": reference.concat_mla_q(kw["ql_nope"], kw["q_pe"])},
    call=single(lambda q: {"q": q}),
    checks=(Check("q", EXACT, contiguous=True),),
    knobs=lambda p: knobs(p, num_tokens=p["tokens"]),
    doc="q[t,h] = [ql_nope (512) | q_pe (64)], bf16 copy",
), priority=0)


def _chunk_params(p: Profile) -> st.SearchStrategy[dict]:
    def sizes(lens):
        # Workspaces that some run of requests fills exactly: where <= and < part ways.
        exact = [t for t in (sum(lens[i:j]) for i in range(len(lens)) for j in range(i + 1, len(lens) + 1)) if t >= max(lens)]
        return st.one_of(st.sampled_from(exact), st.integers(max(lens), 2 * sum(lens)))

    return st.lists(st.integers(1, p.max_context), min_size=1, max_size=p.max_requests).flatmap(
        lambda lens: st.fixed_dictionaries({"seq_lens": st.just(lens), "workspace_size": sizes(lens)}))


def _chunks_tensor(chunks) -> torch.Tensor:
    try:
        return torch.tensor([list(c) for c in chunks], dtype=torch.int64).reshape(-1, 2)
    except (TypeError, ValueError, RuntimeError):
        raise ContractError(f"chunks: returned {chunks!r:.80}; the contract says a list of (start, end) pairs") from None


register(OpSpec(
    name="split_prefill_chunks",
    stage="split_prefill_chunks",
    schema=Schema(
        dict(seq_lens=Ints(1, 2**31, 2**16), workspace_size=Int(1, 2**40)), lambda p: len(p["seq_lens"]),
        lambda p: None if p["workspace_size"] >= max(p["seq_lens"], default=0) else "workspace_size is below a sequence"),
    draw=_chunk_params,
    inputs=lambda p, seed, device: {"seq_lens": list(p["seq_lens"]), "workspace_size": p["workspace_size"]},
    reference=lambda kw, p: {"chunks": _chunks_tensor(reference.split_prefill_chunks(**kw))},
    call=single(lambda chunks: {"chunks": _chunks_tensor(chunks)}),
    checks=(Check("chunks", EXACT),),
    knobs=lambda p: knobs(p, seq_len=max(p["seq_lens"])),
    doc="greedy chunks of requests whose total length fits the prefill workspace (<=)",
), priority=0)


SPEC_RESHAPE = Schema(dict(num_decodes=Int(1, 2**16), s=Int(1, 64), heads=HEADS, four_d=Flag(optional=True)),
                      lambda p: p["num_decodes"] * p["s"] * p["heads"] * 1152)


def _spec_reshape_params(p: Profile) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({"num_decodes": st.integers(1, p.max_requests), "s": st.integers(1, 4),
                                  "heads": st.sampled_from(p.heads), "four_d": st.booleans()})


def _spec_q_inputs(p, seed, device):
    q = q_values(generator(seed, device), (p["num_decodes"] * p["s"], p["heads"], 576), "normal")
    return {"q": q, "num_decodes": p["num_decodes"]}


register(OpSpec(
    name="reshape_query_for_spec_decode",
    stage="reshape_query_for_spec_decode",
    schema=SPEC_RESHAPE,
    draw=_spec_reshape_params,
    inputs=_spec_q_inputs,
    reference=lambda kw, p: {"q": reference.reshape_query_for_spec_decode(**kw)},
    call=single(lambda q: {"q": q}),
    checks=(Check("q", EXACT),),
    knobs=lambda p: knobs(p, num_tokens=p["num_decodes"] * p["s"]),
    views=True,
    doc="[B*s, H, D] -> [B, s, H, D], token-major",
), priority=0)


def _spec_out_inputs(p, seed, device):
    shape = (p["num_decodes"], p["s"], p["heads"], 512) if p.get("four_d", True) else (p["num_decodes"] * p["s"], p["heads"], 512)
    return {"out": q_values(generator(seed, device), shape, "normal")}


register(OpSpec(
    name="reshape_attn_output_for_spec_decode",
    stage="reshape_attn_output_for_spec_decode",
    schema=SPEC_RESHAPE,
    draw=_spec_reshape_params,
    inputs=_spec_out_inputs,
    reference=lambda kw, p: {"out": reference.reshape_attn_output_for_spec_decode(**kw)},
    call=lambda subject, kw, p: ImplOutput({"out": subject.fn(**kw)}, deviations=subject.deviations),
    checks=(Check("out", EXACT),),
    knobs=lambda p: knobs(p, num_tokens=p["num_decodes"] * p["s"]),
    views=True,
    doc="[B, s, H, D] -> [B*s, H, D]; 3-D unchanged",
), priority=0)
