"""dcp_size_one: decode context parallelism over one rank is no DCP at all, exactly.

    convert_index  dcp_convert_index with dcp_size 1 (rank 0, any interleave, either flag)
                   against convert_index without counts: one rank owns every position, at its own
                   place, and upstream's dcp_size 1 ignores compact_valid_to_front
    forward_mqa    forward_mqa_dcp over one rank against forward_mqa (fp8_mixed path): the merge
                   of one rank weighs it by exp(0) = 1 and gives back its own LSE. A token with
                   no valid entry merges to (0, -inf), the identity, where forward_mqa says
                   (0, +inf): compared in the kernels' convention
    merge          dcp_merge of one rank's (out, lse) is (out, lse) (rows a rank owns nothing of
                   are already the identity (0, -inf))
"""

from __future__ import annotations

import math

from hypothesis import strategies as st

from mla_verify.equivalence.cases.batch import make_batch
from mla_verify.equivalence.judge.policy import EXACT, LSE, OUT
from mla_verify.optimized import pipeline

from ..cases.draws import dcp_index_params, forward_params, merge_params
from ..cases.params import ForwardParams
from ..ops.dcp import DCP_MERGE, MergeParams
from ..ops.indices import DCP_CONVERT_INDEX
from ..spec import register
from ..sandbox.produced import Compared
from .base import PropertySpec, Target
from .common import PIPELINE_STAGES, attention, forward, forward_knobs, forward_scale, forward_stages

INDEX_STAGES = ("dcp_convert_index", "convert_index")
ONE_RANK = {"dcp_size": 1, "dcp_rank": 0}


def _index_check(kw: dict, p, stages) -> list:
    sharded = stages.fn("dcp_convert_index")(**kw)
    plain = stages.fn("convert_index")(
        req_id=kw["req_id"], block_table=kw["block_table"], topk_indices=kw["topk_indices"],
        block_size=kw["block_size"])
    return [Compared("convert_index", "indices", EXACT, sharded, plain)]


def _forward_inputs(p: ForwardParams, seed: int, device: str) -> dict:
    batch = make_batch(p, seed, device)
    return {"batch": batch, "scale": forward_scale(batch, p.sm_scale)}


def _forward_check(inputs: dict, p: ForwardParams, stages) -> list:
    batch = inputs["batch"]
    one_rank = pipeline.forward_mqa_dcp(batch.q, [batch.kv_cache], batch.topk_indices,
                                        [batch.metadata(pipeline.MQAMetadata, **ONE_RANK)], stages)
    lse = one_rank.lse.masked_fill(one_rank.lse == -math.inf, math.inf)
    return attention("forward_mqa", (one_rank.out, lse), forward(stages, batch), inputs["scale"])


def _merge_inputs(p: MergeParams, seed: int, device: str) -> dict:
    return DCP_MERGE.inputs(p.replace(ranks=1, junk=False), seed, device)


def _merge_check(kw: dict, p: MergeParams, stages) -> list:
    out, lse = stages.fn("dcp_merge")(**kw)
    return [Compared("merge", "out", OUT, out, kw["outs"][0]), Compared("merge", "lse", LSE, lse, kw["lses"][0])]


register(PropertySpec(
    short="dcp_size_one",
    checks=("convert_index", "forward_mqa", "merge"),
    targets={
        "dcp_convert_index": Target(
            "dcp_convert_index", lambda p: list(INDEX_STAGES), INDEX_STAGES,
            lambda p, seed, device: DCP_CONVERT_INDEX.inputs(p.replace(**ONE_RANK), seed, device),
            _index_check, lambda p: DCP_CONVERT_INDEX.knobs(p.replace(**ONE_RANK)),
            lambda p: dcp_index_params(p, sizes=(1,))),
        "forward_mqa": Target("forward_mqa", lambda p: [*forward_stages(p), "dcp_merge"], PIPELINE_STAGES,
                              _forward_inputs, _forward_check, forward_knobs, lambda p: forward_params(p, "fp8_mixed")),
        "dcp_merge": Target("dcp_merge", lambda p: ["dcp_merge"], ("dcp_merge",), _merge_inputs, _merge_check,
                            lambda p: DCP_MERGE.knobs(p.replace(ranks=1)),
                            lambda p: merge_params(p, ranks=st.just(1), junk=st.just(False))),
    },
    doc="dcp_convert_index, forward_mqa_dcp and dcp_merge over one rank equal no DCP, bit for bit",
), priority=106)
