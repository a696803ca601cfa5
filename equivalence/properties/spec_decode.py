"""spec_decode: B requests with s query tokens each equal the same B*s tokens as single-token decodes.

    single_tokens   sparse_decode_fp8: q [B, s, H, 576] and indices [B, s, K] against the views
                    [B*s, 1, H, 576] and [B*s, 1, K]; forward_mqa (fp8_separate path): a uniform
                    spec-decode batch against the batch where token j of request b is a request of
                    its own (query length 1, sequence length context_b + j + 1, the same block-table
                    row and top-k row).
The rows and their order are the same; a kernel whose split plan depends on s (FlashMLA's
`num_sm_parts` divides by s) declares `split_kv`.
"""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from mla_verify.equivalence.cases.batch import make_batch

from ..cases.draws import decode_params, forward_params
from ..cases.params import DecodeParams, ForwardParams
from ..spec import register
from .base import PropertySpec, Target
from .common import (
    PIPELINE_STAGES,
    attention,
    decode,
    decode_knobs,
    decode_problem,
    decode_scale,
    forward,
    forward_knobs,
    forward_scale,
    forward_stages,
)


def _decode_inputs(p: DecodeParams, seed: int, device: str) -> dict:
    kw = decode_problem(p, seed, device)
    q, idx = kw["q"], kw["indices"]
    single = {**kw, "q": q.reshape(-1, 1, *q.shape[2:]), "indices": idx.reshape(-1, 1, idx.shape[-1])}
    return {"run": decode, "spec": kw, "single": single, "scale": decode_scale(kw)}


def _forward_inputs(p: ForwardParams, seed: int, device: str) -> dict:
    batch = make_batch(p, seed, device)
    s = p.max_decode_query_len
    tokens = batch.query_start_loc[-1]
    single = dataclasses.replace(
        batch,
        rank_block_tables=[t.repeat_interleave(s, dim=0) for t in batch.rank_block_tables],
        query_start_loc=list(range(tokens + 1)),
        seq_lens=[n - s + j + 1 for n in batch.seq_lens for j in range(s)],
        config={**batch.config, "max_decode_query_len": 1},
    )
    return {"run": forward, "spec": batch, "single": single, "scale": forward_scale(batch, p.sm_scale)}


def _check(inputs: dict, p, stages) -> list:
    run = inputs["run"]
    return attention("single_tokens", run(stages, inputs["single"]), run(stages, inputs["spec"]), inputs["scale"])


register(PropertySpec(
    short="spec_decode",
    checks=("single_tokens",),
    targets={
        "sparse_decode_fp8": Target("sparse_decode_fp8", lambda p: ["sparse_decode_fp8"], ("sparse_decode_fp8",),
                                    _decode_inputs, _check, decode_knobs, lambda p: decode_params(p, s_q=st.integers(2, 4))),
        "forward_mqa": Target("forward_mqa", forward_stages, PIPELINE_STAGES, _forward_inputs, _check, forward_knobs,
                              lambda p: forward_params(p, "fp8_separate", decodes_only=True)),
    },
    doc="a batch of B requests with s tokens each equals the same tokens as B*s single-token decodes",
), priority=105)
