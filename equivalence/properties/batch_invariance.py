"""batch_invariance: a request's answer does not depend on what else runs with it.

    batched   sparse_decode_fp8: some requests of a batch of 8 or more, each run alone, against
              their rows of the batch's answer. A kernel that splits a short batch's top-k lists
              over more programs (split-KV: FlashMLA, our Triton decode) declares the deviation
              `split_kv` and is held to its bound instead of bit for bit.
    chunked   forward_mqa on the fp8_separate path: the prefills in one workspace chunk against
              a workspace just large enough for the longest, so they run chunk by chunk, each
              chunk's rows at other workspace offsets.
"""

from __future__ import annotations

from typing import Mapping

import torch

from mla_verify.equivalence.batch import make_batch

from . import PropertySpec, Target, register_property
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


def _decode_inputs(p: Mapping, seed: int, device: str) -> dict:
    kw = decode_problem(p, seed, device)
    alone = [{**kw, "q": kw["q"][i : i + 1], "indices": kw["indices"][i : i + 1]} for i in p["alone"]]
    # The batch's token-major rows of those requests.
    rows = torch.cat([torch.arange(i * p["s_q"], (i + 1) * p["s_q"]) for i in p["alone"]]).to(device)
    return {"batch": kw, "alone": alone, "rows": rows, "scale": decode_scale(kw)[rows]}


def _decode_check(inputs: dict, p: Mapping, stages) -> list:
    out, lse = decode(stages, inputs["batch"])
    alone = [decode(stages, kw) for kw in inputs["alone"]]
    got = (torch.cat([o for o, _ in alone]), torch.cat([s for _, s in alone]))
    rows = inputs["rows"]
    return attention("batched", got, (out[rows], lse[rows]), inputs["scale"])


def _forward_inputs(p: Mapping, seed: int, device: str) -> dict:
    batch = make_batch(p, seed, device)
    return {"batch": batch, "one_chunk": sum(batch.seq_lens), "scale": forward_scale(batch, p["sm_scale"])}


def _forward_check(inputs: dict, p: Mapping, stages) -> list:
    batch = inputs["batch"]
    one = forward(stages, batch, workspace_size=inputs["one_chunk"])
    chunked = forward(stages, batch, workspace_size=p["workspace_size"])
    return attention("chunked", chunked, one, inputs["scale"])


register_property(PropertySpec(
    name="batch_invariance",
    checks=("batched", "chunked"),
    targets={
        "sparse_decode_fp8": Target("sparse_decode_fp8", lambda p: ["sparse_decode_fp8"], ("sparse_decode_fp8",),
                                    _decode_inputs, _decode_check, decode_knobs),
        "forward_mqa": Target("forward_mqa", forward_stages, PIPELINE_STAGES, _forward_inputs, _forward_check,
                              forward_knobs),
    },
    doc="a decode request alone equals it inside a batch of 8+ (split_kv kernels: within their bound); "
        "chunked prefill with any workspace equals one chunk",
))
