"""batch_invariance: a request's answer does not depend on what else runs with it.

    batched   sparse_decode_fp8: some requests of a batch of 8 or more, each run alone, against
              their rows of the batch's answer. A kernel that splits a short batch's top-k lists
              over more programs (split-KV: FlashMLA, our Triton decode) declares the deviation
              `split_kv` and is held to its bound instead of bit for bit; one that declares none
              is held bit for bit (FlashMLA #212: a row's output moved 1-2 bf16 ulps with its
              batchmates, flipping the argmax at near ties). The batches take other compositions
              as serving makes them: spec decodes (target verify: B * s_q rows) and batches of up
              to 64 requests, at top-k up to production's 2048 (the covering set's first cases:
              `coverage.properties`), where a split plan read from the row count changes.
    chunked   forward_mqa on the fp8_separate path: the prefills in one workspace chunk against
              a workspace just large enough for the longest, so they run chunk by chunk, each
              chunk's rows at other workspace offsets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from mla_verify.equivalence.cases.batch import make_batch

from mla_verify.reference.metadata import reorder_batch_threshold, split_decodes_and_prefills
from ..cases.draws import decode_params, forward_params
from ..cases.params import ForwardParams
from ..cases.profiles import Profile
from ..cases.schema import Ints, param
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


@dataclass(frozen=True)
class Alone:
    alone: tuple[int, ...] = param(Ints(0, 4095, 64), (0,))  # decode: the requests run alone


def _decode_inputs(p, seed: int, device: str) -> dict:
    kw = decode_problem(p, seed, device)
    alone = [{**kw, "q": kw["q"][i : i + 1], "indices": kw["indices"][i : i + 1]} for i in p.alone]
    # The batch's token-major rows of those requests.
    rows = torch.cat([torch.arange(i * p.s_q, (i + 1) * p.s_q) for i in p.alone]).to(device)
    return {"batch": kw, "alone": alone, "rows": rows, "scale": decode_scale(kw)[rows]}


def _decode_check(inputs: dict, p, stages) -> list:
    out, lse = decode(stages, inputs["batch"])
    alone = [decode(stages, kw) for kw in inputs["alone"]]
    got = (torch.cat([o for o, _ in alone]), torch.cat([s for _, s in alone]))
    rows = inputs["rows"]
    return attention("batched", got, (out[rows], lse[rows]), inputs["scale"])


def _forward_inputs(p: ForwardParams, seed: int, device: str) -> dict:
    batch = make_batch(p, seed, device)
    return {"batch": batch, "one_chunk": sum(batch.seq_lens), "scale": forward_scale(batch, p.sm_scale)}


def _forward_check(inputs: dict, p: ForwardParams, stages) -> list:
    batch = inputs["batch"]
    one = forward(stages, batch, workspace_size=inputs["one_chunk"])
    chunked = forward(stages, batch, workspace_size=p.workspace_size)
    return attention("chunked", chunked, one, inputs["scale"])


MIN_BATCH = 8                # batch invariance: "in a batch of 8 or more"


def _prefill_seq_lens(params: dict) -> list[int]:
    """Sequence lengths of the requests the batch treats as prefills."""
    qsl = [0]
    for n in params["query_lens"]:
        qsl.append(qsl[-1] + n)
    threshold = reorder_batch_threshold(params["heads"], params["arch"], max_decode_query_len=params["max_decode_query_len"])
    first = split_decodes_and_prefills(qsl, threshold).num_decodes
    return [c + n for c, n in zip(params["context_lens"][first:], params["query_lens"][first:])]


@st.composite
def _chunked(draw, p: Profile) -> dict:
    """fp8_separate batches with two or more prefills and a workspace that splits them into chunks.

    No beyond_seq or boundaries pattern: a prefill's entry past its own sequence (the table's
    last slot is one) reads whichever workspace row sits there (the next request's, or none past
    the chunk), garbage that moves with the layout."""
    d = draw(forward_params(p, "fp8_separate", min_prefills=2).filter(lambda d: len(_prefill_seq_lens(d)) >= 2))
    lens = _prefill_seq_lens(d)
    return {**d, "invalid": [i for i in d["invalid"] if i not in ("beyond_seq", "boundaries")],
            "workspace_size": draw(st.integers(max(lens), sum(lens) - 1))}


@st.composite
def _alone(draw, p: Profile) -> dict:
    """Decode batches of 8 or more requests of 1-4 tokens each, and the requests to run alone."""
    batch = st.integers(MIN_BATCH, max(MIN_BATCH, min(64, p.max_tokens)))
    d = draw(decode_params(p, batch=batch, s_q=st.integers(1, 4)))
    return {**d, "alone": draw(st.lists(st.integers(0, d["batch"] - 1), min_size=1, max_size=2, unique=True))}


register(PropertySpec(
    short="batch_invariance",
    checks=("batched", "chunked"),
    own_params=Alone,
    targets={
        "sparse_decode_fp8": Target("sparse_decode_fp8", lambda p: ["sparse_decode_fp8"], ("sparse_decode_fp8",),
                                    _decode_inputs, _decode_check, decode_knobs, _alone, runs=lambda p: 1 + len(p.alone)),
        "forward_mqa": Target("forward_mqa", forward_stages, PIPELINE_STAGES, _forward_inputs, _forward_check,
                              forward_knobs, _chunked),
    },
    doc="a decode request alone equals it inside a batch of 8+ (split_kv kernels: within their bound); "
        "chunked prefill with any workspace equals one chunk",
), priority=104)
