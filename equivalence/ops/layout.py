"""Exact shape-and-copy ops: the query concat, prefill chunk bounds and spec-decode reshapes."""

from __future__ import annotations

import torch

from mla_verify import reference
from mla_verify.equivalence.contract import ContractError
from mla_verify.equivalence.policy import EXACT
from mla_verify.equivalence.values import q_values

from . import Check, ImplOutput, OpSpec, register_op
from .common import generator, knobs, single


def _concat_inputs(p, seed, device):
    g = generator(seed, device)
    # Strided views of a wider buffer, as the MLA layer hands them over.
    base = q_values(g, (p["tokens"], p["heads"], 640), "normal")
    return {"ql_nope": base[..., :512], "q_pe": base[..., 560:624]}


register_op(OpSpec(
    name="concat_mla_q",
    stage="concat_mla_q",
    arguments=("ql_nope", "q_pe"),
    inputs=_concat_inputs,
    reference=lambda kw, p: {"q": reference.concat_mla_q(kw["ql_nope"], kw["q_pe"])},
    call=single(lambda q: {"q": q}),
    checks=(Check("q", EXACT, contiguous=True),),
    knobs=lambda p: knobs(p, num_tokens=p["tokens"]),
    doc="q[t,h] = [ql_nope (512) | q_pe (64)], bf16 copy",
))


def _chunks_tensor(chunks) -> torch.Tensor:
    try:
        return torch.tensor([list(c) for c in chunks], dtype=torch.int64).reshape(-1, 2)
    except (TypeError, ValueError, RuntimeError):
        raise ContractError(f"chunks: returned {chunks!r:.80}; the contract says a list of (start, end) pairs") from None


register_op(OpSpec(
    name="split_prefill_chunks",
    stage="split_prefill_chunks",
    arguments=("seq_lens", "workspace_size"),
    inputs=lambda p, seed, device: {"seq_lens": list(p["seq_lens"]), "workspace_size": p["workspace_size"]},
    reference=lambda kw, p: {"chunks": _chunks_tensor(reference.split_prefill_chunks(**kw))},
    call=single(lambda chunks: {"chunks": _chunks_tensor(chunks)}),
    checks=(Check("chunks", EXACT),),
    knobs=lambda p: knobs(p, seq_len=max(p["seq_lens"])),
    doc="greedy chunks of requests whose total length fits the prefill workspace (<=)",
))


def _spec_q_inputs(p, seed, device):
    q = q_values(generator(seed, device), (p["num_decodes"] * p["s"], p["heads"], 576), "normal")
    return {"q": q, "num_decodes": p["num_decodes"]}


register_op(OpSpec(
    name="reshape_query_for_spec_decode",
    stage="reshape_query_for_spec_decode",
    arguments=("q", "num_decodes"),
    inputs=_spec_q_inputs,
    reference=lambda kw, p: {"q": reference.reshape_query_for_spec_decode(**kw)},
    call=single(lambda q: {"q": q}),
    checks=(Check("q", EXACT),),
    knobs=lambda p: knobs(p, num_tokens=p["num_decodes"] * p["s"]),
    views=True,
    doc="[B*s, H, D] -> [B, s, H, D], token-major",
))


def _spec_out_inputs(p, seed, device):
    shape = (p["num_decodes"], p["s"], p["heads"], 512) if p.get("four_d", True) else (p["num_decodes"] * p["s"], p["heads"], 512)
    return {"out": q_values(generator(seed, device), shape, "normal")}


register_op(OpSpec(
    name="reshape_attn_output_for_spec_decode",
    stage="reshape_attn_output_for_spec_decode",
    arguments=("out",),
    inputs=_spec_out_inputs,
    reference=lambda kw, p: {"out": reference.reshape_attn_output_for_spec_decode(**kw)},
    call=lambda subject, kw, p: ImplOutput({"out": subject.fn(**kw)}, deviations=subject.deviations),
    checks=(Check("out", EXACT),),
    knobs=lambda p: knobs(p, num_tokens=p["num_decodes"] * p["s"]),
    views=True,
    doc="[B, s, H, D] -> [B*s, H, D]; 3-D unchanged",
))
